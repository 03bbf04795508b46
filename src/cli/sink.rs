//! `edgespool sink` and `edgespool sink --stats`: the reference consumer's
//! arguments to a store, a run until stopped (or a report), and an exit
//! code. The work is in [`edgespool::sink`].

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::args::{self, PgTlsArgs};
use super::spec::SINK;
use super::{failed, help, print_json, Failure, Outcome};
use edgespool::sink::batch::BatchPolicy;
use edgespool::sink::{SinkOptions, SinkStats};

/// The target of this file's log lines: the module they were written in
/// before the split, which journal searches and `RUST_LOG` filters name.
#[cfg(feature = "pg-sink")]
const LOG_TARGET: &str = "edgespool::sink_cmd";

/// Where the sink keeps what it takes: exactly one of `--db` and
/// `--postgres`.
enum Store {
    Sqlite(PathBuf),
    Postgres(String),
}

/// A usage error of `sink`.
fn usage(msg: &str) -> Failure {
    Failure::usage_of(&SINK, msg)
}

/// `sink` arguments, checked.
struct SinkArgs {
    url: String,
    topic: String,
    store: Store,
    pg_tls: PgTlsArgs,
    client_id: String,
    share: Option<String>,
    batch_max: usize,
    batch_ms: u64,
    /// `--no-receipts`: publish no receipts (for boards that retire rows on
    /// the PUBACK, or a broker ACL that does not let the sink write them).
    no_receipts: bool,
    /// `--username` and `--password-file`: the MQTT login.
    credentials: Option<(String, PathBuf)>,
}

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &SINK)? else {
        return help::print(&SINK);
    };
    let store = match (a.db, a.postgres) {
        (Some(db), None) => Store::Sqlite(db),
        (None, Some(conninfo)) => Store::Postgres(conninfo),
        _ => {
            return Err(usage(
                "one of --db FILE and --postgres CONNINFO is required",
            ))
        }
    };
    if matches!(store, Store::Sqlite(_)) && a.pg_tls.any() {
        return Err(usage("--pg-ca, --pg-cert and --pg-key go with --postgres"));
    }
    if a.stats {
        return stats(&store, &a.pg_tls, a.json);
    }
    let url = a
        .url
        .ok_or_else(|| usage("--url mqtt://HOST:PORT is required"))?;
    let topic = a.topic.ok_or_else(|| usage("--topic FILTER is required"))?;
    let credentials = match (a.username, a.password_file) {
        (Some(u), Some(f)) => {
            // Read once now, so a wrong path fails the start, not every
            // connect in the background.
            if let Err(why) = edgespool::sink::consume::read_password(&f) {
                eprintln!("edgespool: {why}");
                return Err(Failure::Invalid);
            }
            Some((u, f))
        }
        (None, None) => None,
        _ => return Err(usage("--username and --password-file go together")),
    };
    // A persistent session is found again by its client id: a PostgreSQL
    // sink (one of N) must be given a stable one.
    let client_id = match (a.client_id, &store) {
        (Some(id), _) => id,
        (None, Store::Sqlite(_)) => format!("edgespool-sink-{}", std::process::id()),
        (None, Store::Postgres(_)) => {
            return Err(usage("--postgres needs --client-id ID (stable per sink)"))
        }
    };
    run(SinkArgs {
        url,
        topic,
        store,
        pg_tls: a.pg_tls,
        client_id,
        share: a.share,
        batch_max: a.batch_max.filter(|&n| n > 0).unwrap_or(500),
        batch_ms: a.batch_ms.unwrap_or(100),
        no_receipts: a.no_receipts,
        credentials,
    })
}

/// Run the sink until SIGTERM/SIGINT. Exit 0; 1 on a store failure or if
/// any payload mismatch was seen; 2 for a bad `--url`.
fn run(a: SinkArgs) -> Outcome {
    let Some((host, port)) = a
        .url
        .strip_prefix("mqtt://")
        .and_then(|r| r.rsplit_once(':'))
        .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h.to_owned(), p)))
    else {
        eprintln!(
            "edgespool: --url must be mqtt://HOST:PORT (got {:?})",
            a.url
        );
        return Err(Failure::Invalid);
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let _ = signal_hook::flag::register(sig, stop.clone());
    }
    let mut opts = SinkOptions::new(host, port, a.topic, a.client_id);
    opts.shared_group = a.share;
    opts.receipts = !a.no_receipts;
    opts.credentials = a.credentials;
    opts.batch = BatchPolicy {
        max: a.batch_max,
        window: Duration::from_millis(a.batch_ms),
        idle: Duration::from_millis(2),
    };
    let result = match a.store {
        Store::Sqlite(db) => match edgespool::sink::SinkDb::open(&db) {
            Ok(mut store) => edgespool::sink::run(&opts, &mut store, &stop),
            Err(e) => Err(format!("sink database {}: {e}", db.display())),
        },
        Store::Postgres(conninfo) => run_postgres(&opts, &conninfo, &a.pg_tls, &stop),
    };
    let s = result.map_err(failed)?;
    print_totals(&s);
    if s.mismatches > 0 {
        return Err(Failure::Failed);
    }
    Ok(())
}

fn print_totals(s: &SinkStats) {
    println!("sink: {s}");
}

#[cfg(feature = "pg-sink")]
fn tls_files(tls: &PgTlsArgs) -> edgespool::sink::pg_tls::TlsFiles {
    edgespool::sink::pg_tls::TlsFiles {
        ca: tls.ca.clone(),
        cert: tls.cert.clone(),
        key: tls.key.clone(),
    }
}

#[cfg(feature = "pg-sink")]
fn run_postgres(
    opts: &SinkOptions,
    conninfo: &str,
    tls: &PgTlsArgs,
    stop: &AtomicBool,
) -> Result<SinkStats, String> {
    use edgespool::sink::StoreError;
    let files = tls_files(tls);
    // The server may come up after the sink: wait for it, as for the broker.
    let mut backoff = Duration::from_millis(200);
    let mut store = loop {
        match edgespool::sink::postgres::PgStore::connect(conninfo, &opts.client_id, &files) {
            Ok(s) => break s,
            Err(StoreError::Transient(e)) if !stop.load(std::sync::atomic::Ordering::Relaxed) => {
                log::warn!(target: LOG_TARGET, "sink: PostgreSQL not reachable ({e}); retrying in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    edgespool::sink::run(opts, &mut store, stop)
}

#[cfg(not(feature = "pg-sink"))]
fn run_postgres(
    _: &SinkOptions,
    _: &str,
    _: &PgTlsArgs,
    _: &AtomicBool,
) -> Result<SinkStats, String> {
    Err("this edgespool was built without the pg-sink feature".into())
}

/// `sink --stats`: print the store's report (text, or JSON with `json`).
fn stats(store: &Store, tls: &PgTlsArgs, json: bool) -> Outcome {
    let now = edgespool::envelope::wall_clock_ms().0;
    let report = match store {
        Store::Sqlite(db) => edgespool::sink::stats::from_sqlite(db, now)
            .map_err(|e| format!("sink database {}: {e}", db.display())),
        Store::Postgres(conninfo) => postgres_report(conninfo, tls, now),
    };
    let r = report.map_err(failed)?;
    if json {
        return print_json(&r);
    }
    print!("{}", edgespool::sink::stats::render(&r));
    Ok(())
}

#[cfg(feature = "pg-sink")]
fn postgres_report(
    conninfo: &str,
    tls: &PgTlsArgs,
    now: i64,
) -> Result<edgespool::sink::stats::Report, String> {
    let mut c = edgespool::sink::postgres::connect_client(conninfo, &tls_files(tls))
        .map_err(|e| format!("PostgreSQL: {e}"))?;
    edgespool::sink::stats::from_postgres(&mut c, now).map_err(|e| format!("PostgreSQL: {e}"))
}

#[cfg(not(feature = "pg-sink"))]
fn postgres_report(
    _: &str,
    _: &PgTlsArgs,
    _: i64,
) -> Result<edgespool::sink::stats::Report, String> {
    Err("this edgespool was built without the pg-sink feature".into())
}
