//! `edgespool sink` and `edgespool sink --stats`: the reference consumer's
//! flags and settings file ([`settings`]) to a store, a run until stopped
//! (or a report), and an exit code. The work is in [`crate::sink`].

mod settings;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use super::args::{self, PgTlsArgs};
use super::spec::SINK;
use super::{failed, help, print_json, Failure, Outcome};
use crate::sink::batch::BatchPolicy;
use crate::sink::{SinkOptions, SinkStats};
use settings::Store;

/// The target of this file's log lines: the module they were written in
/// before the split, which journal searches and `RUST_LOG` filters name.
#[cfg(feature = "pg-sink")]
const LOG_TARGET: &str = "edgespool::sink_cmd";

/// A usage error of `sink`.
fn usage(msg: &str) -> Failure {
    Failure::usage_of(&SINK, msg)
}

/// `sink` arguments, checked.
struct SinkArgs {
    url: String,
    topic: String,
    store: Store,
    client_id: String,
    share: Option<String>,
    batch_max: usize,
    batch_ms: u64,
    /// The key that signs receipts (`--receipt-key`, `receipt_key`);
    /// `None`: no receipts (`--no-receipts`, `receipts = false`, or no key:
    /// a board retires nothing on an unsigned receipt).
    receipt_key: Option<Arc<crate::event::signature::SigningKey>>,
    /// `--username` and `--password-file`: the MQTT login.
    credentials: Option<(String, PathBuf)>,
}

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(mut a) = args::read(p, &SINK)? else {
        return help::print(&SINK);
    };
    let file = match a.config.take() {
        Some(path) => settings::read(&path).map_err(|e| {
            eprintln!("{e}");
            Failure::Invalid
        })?,
        None => settings::SinkSection::default(),
    };
    let m = settings::merge(a, file).map_err(|e| usage(&e))?;
    let Some(store) = m.store else {
        return Err(usage(
            "a store is required: --db FILE or --postgres CONNINFO (or db / [sink.postgres] in --config)",
        ));
    };
    if m.stats {
        return stats(&store, m.json);
    }
    // With a settings file, a setting a run lacks is named by its key there.
    // With a settings file, a setting a run lacks is named by its key
    // there (and the flag); without one, by the flag.
    let required = |key: &str, what: &str, flag: &str, no_file: &str| match &m.file {
        Some((path, line)) => {
            let at = line.map_or(String::new(), |l| format!(":{l}"));
            eprintln!(
                "config invalid: {}{at}: sink.{key}: required key is missing: {what} (or {flag})",
                path.display()
            );
            Failure::Invalid
        }
        None => usage(no_file),
    };
    let url = m.url.clone().ok_or_else(|| {
        required(
            "url",
            "the broker, mqtt://HOST:PORT",
            "--url",
            "--url mqtt://HOST:PORT (or url in --config) is required",
        )
    })?;
    let topic = m.topic.clone().ok_or_else(|| {
        required(
            "topic",
            "the events filter, e.g. edgespool/+/events/#",
            "--topic",
            "--topic FILTER (or topic in --config) is required",
        )
    })?;
    let credentials = match (m.username, m.password_file) {
        (Some(u), Some(f)) => {
            // Read once now, so a wrong path fails the start, not every
            // connect in the background.
            if let Err(why) = crate::sink::consume::read_password(&f) {
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
    let client_id = match (m.client_id.clone(), &store) {
        (Some(id), _) => id,
        (None, Store::Sqlite(_)) => format!("edgespool-sink-{}", std::process::id()),
        (None, Store::Postgres { .. }) => {
            return Err(required(
                "client_id",
                "with PostgreSQL, a stable MQTT client id per sink, under which the broker keeps its session",
                "--client-id",
                "PostgreSQL needs --client-id ID (stable per sink)",
            ))
        }
    };
    let receipt_key = match (m.receipts, m.receipt_key) {
        (true, Some(path)) => Some(Arc::new(load_receipt_key(&path)?)),
        (true, None) => {
            log::warn!(
                target: super::LOG_TARGET,
                "sink: no receipts: no --receipt-key FILE (receipt_key in --config); boards with mqtt.retire_on = \"receipt\" retire nothing without a signed receipt (make a key with `edgespool keygen --out FILE`, list its public key in their mqtt.receipt_public_keys), or pass --no-receipts"
            );
            None
        }
        (false, _) => None,
    };
    run(SinkArgs {
        url,
        topic,
        store,
        client_id,
        share: m.share,
        batch_max: m.batch_max.filter(|&n| n > 0).unwrap_or(500),
        batch_ms: m.batch_ms.unwrap_or(100),
        receipt_key,
        credentials,
    })
}

/// The receipt key at `path`: a PEM Ed25519 private key only its owner
/// can read (`edgespool keygen` writes one).
///
/// Errors: exit 2, naming the file and what is wrong with it.
fn load_receipt_key(
    path: &std::path::Path,
) -> Result<crate::event::signature::SigningKey, Failure> {
    let shown = path.display();
    let pem = crate::os::fsguard::files::read_secret(path).map_err(|e| {
        eprintln!(
            "edgespool: receipt key {shown} (--receipt-key, or receipt_key in --config): {e}"
        );
        Failure::Invalid
    })?;
    crate::event::signature::SigningKey::from_pem(&pem).map_err(|e| {
        eprintln!(
            "edgespool: receipt key {shown}: {e} (make one with `edgespool keygen --out FILE`)"
        );
        Failure::Invalid
    })
}

/// Run the sink until SIGTERM/SIGINT. Exit 0; 1 on a store failure or if
/// any payload mismatch was seen; 2 for a bad `--url`, a `--topic` that
/// fixes no level for the device, a `--share` group (or `$share/` one in
/// the topic) that is no MQTT 5 ShareName, or PostgreSQL settings that cannot work
/// (conninfo, TLS files, password file).
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
    // A filter that fixes no level for the device can never be right.
    if let Err(why) = crate::sink::identity::Shape::of_filter(&a.topic) {
        eprintln!("edgespool: --topic (topic in --config): {why}");
        return Err(Failure::Invalid);
    }
    // Nor can a group that is no ShareName, or a second one.
    if let Err(why) = crate::sink::identity::Shape::of_subscription(&a.topic, a.share.as_deref()) {
        eprintln!("edgespool: --share (share in --config): {why}");
        return Err(Failure::Invalid);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let _ = signal_hook::flag::register(sig, stop.clone());
    }
    let mut opts = SinkOptions::new(host, port, a.topic, a.client_id);
    opts.shared_group = a.share;
    opts.receipts = a.receipt_key;
    opts.credentials = a.credentials;
    opts.batch = BatchPolicy {
        max: a.batch_max,
        window: Duration::from_millis(a.batch_ms),
        idle: Duration::from_millis(2),
    };
    let s = match a.store {
        Store::Sqlite(db) => match crate::sink::SinkDb::open(&db) {
            Ok(mut store) => crate::sink::run(&opts, &mut store, &stop),
            Err(e) => Err(format!("sink database {}: {e}", db.display())),
        }
        .map_err(failed)?,
        Store::Postgres {
            conninfo,
            password_file,
            tls,
        } => run_postgres(&opts, &pg_connect(&conninfo, &tls, password_file)?, &stop)?,
    };
    print_totals(&s);
    if s.mismatches > 0 {
        return Err(Failure::Failed);
    }
    Ok(())
}

fn print_totals(s: &SinkStats) {
    println!("sink: {s}");
}

/// The conninfo parsed with its password and TLS files; one that cannot
/// work is told here (exit 2), its passwords hidden.
#[cfg(feature = "pg-sink")]
fn pg_connect(
    conninfo: &str,
    tls: &PgTlsArgs,
    password_file: Option<PathBuf>,
) -> Result<crate::sink::pg_tls::PgConnect, Failure> {
    use crate::sink::{conninfo as ci, pg_password::PasswordFrom, pg_tls};
    if ci::has_password(conninfo) {
        log::warn!(target: LOG_TARGET, "sink: the password in --postgres is visible to every local user (/proc/PID/cmdline); use --pg-password-file or --config with password_file");
    }
    let files = pg_tls::TlsFiles {
        ca: tls.ca.clone(),
        cert: tls.cert.clone(),
        key: tls.key.clone(),
    };
    let c =
        pg_tls::PgConnect::new_with(conninfo, &files, password_file.as_deref()).map_err(|e| {
            eprintln!("edgespool: {e}");
            Failure::Invalid
        })?;
    let from = match &c.password_from {
        PasswordFrom::Conninfo => "the conninfo".to_owned(),
        PasswordFrom::File(p) => format!("password file {}", p.display()),
        PasswordFrom::Env => "PGPASSWORD".to_owned(),
        PasswordFrom::Passfile(p) => format!("PGPASSFILE {}", p.display()),
        PasswordFrom::None => "none".to_owned(),
    };
    log::info!(target: LOG_TARGET, "sink: PostgreSQL {}, password from {from}", ci::redact(conninfo));
    Ok(c)
}

#[cfg(not(feature = "pg-sink"))]
fn pg_connect(_: &str, _: &PgTlsArgs, _: Option<PathBuf>) -> Result<(), Failure> {
    Err(failed(
        "this edgespool was built without the pg-sink feature",
    ))
}

/// Settings the store refused (no password where the server asks for one)
/// end with exit 2, told on stderr: restarting cannot help; any other
/// store failure with exit 1.
#[cfg(feature = "pg-sink")]
fn store_failure(e: crate::sink::StoreError) -> Failure {
    match e {
        crate::sink::StoreError::Settings(why) => {
            eprintln!("edgespool: PostgreSQL settings cannot work: {why}");
            Failure::Invalid
        }
        e => failed(format_args!("PostgreSQL: {e}")),
    }
}

#[cfg(feature = "pg-sink")]
fn run_postgres(
    opts: &SinkOptions,
    connect: &crate::sink::pg_tls::PgConnect,
    stop: &AtomicBool,
) -> Result<SinkStats, Failure> {
    use crate::sink::StoreError;
    // The server may come up after the sink: wait for it, as for the broker.
    let mut backoff = Duration::from_millis(200);
    let mut store = loop {
        match crate::sink::postgres::PgStore::connect_with(connect.clone(), &opts.client_id) {
            Ok(s) => break s,
            Err(StoreError::Transient(e)) if !stop.load(std::sync::atomic::Ordering::Relaxed) => {
                log::warn!(target: LOG_TARGET, "sink: PostgreSQL not reachable ({e}); retrying in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(store_failure(e)),
        }
    };
    crate::sink::run(opts, &mut store, stop).map_err(failed)
}

#[cfg(not(feature = "pg-sink"))]
fn run_postgres(_: &SinkOptions, _: &(), _: &AtomicBool) -> Result<SinkStats, Failure> {
    Err(failed(
        "this edgespool was built without the pg-sink feature",
    ))
}

/// `sink --stats`: print the store's report (text, or JSON with `json`).
fn stats(store: &Store, json: bool) -> Outcome {
    let now = crate::event::envelope::wall_clock_ms().0;
    let r = match store {
        Store::Sqlite(db) => crate::sink::stats::from_sqlite(db, now)
            .map_err(|e| failed(format_args!("sink database {}: {e}", db.display())))?,
        Store::Postgres {
            conninfo,
            password_file,
            tls,
        } => postgres_report(&pg_connect(conninfo, tls, password_file.clone())?, now)?,
    };
    if json {
        return print_json(&r);
    }
    print!("{}", crate::sink::stats::render(&r));
    Ok(())
}

#[cfg(feature = "pg-sink")]
fn postgres_report(
    connect: &crate::sink::pg_tls::PgConnect,
    now: i64,
) -> Result<crate::sink::stats::Report, Failure> {
    let mut c = crate::sink::postgres::connect_client_with(connect).map_err(store_failure)?;
    crate::sink::stats::from_postgres(&mut c, now).map_err(|e| {
        failed(format_args!(
            "PostgreSQL: {}",
            crate::sink::postgres::error_text(&e)
        ))
    })
}

#[cfg(not(feature = "pg-sink"))]
fn postgres_report(_: &(), _: i64) -> Result<crate::sink::stats::Report, Failure> {
    Err(failed(
        "this edgespool was built without the pg-sink feature",
    ))
}
