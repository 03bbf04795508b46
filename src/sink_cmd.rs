//! `edgespool sink` and `edgespool sink --stats`: arguments to a store, a
//! run, and an exit code (part of the binary, not the library).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use edgespool::sink::batch::BatchPolicy;
use edgespool::sink::{SinkOptions, SinkStats};

/// `--pg-ca`, `--pg-cert`, `--pg-key`: TLS files for `--postgres`.
#[derive(Default)]
pub struct PgTlsArgs {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl PgTlsArgs {
    /// Whether any of the flags was given.
    pub fn any(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    #[cfg(feature = "pg-sink")]
    fn files(&self) -> edgespool::sink::pg_tls::TlsFiles {
        edgespool::sink::pg_tls::TlsFiles {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// `sink` arguments, as parsed.
pub struct SinkArgs {
    pub url: String,
    pub topic: String,
    pub db: Option<PathBuf>,
    pub postgres: Option<String>,
    pub pg_tls: PgTlsArgs,
    pub client_id: String,
    pub share: Option<String>,
    pub batch_max: usize,
    pub batch_ms: u64,
}

/// Run the sink until SIGTERM/SIGINT. Exit 0; 1 on a store failure or if
/// any payload mismatch was seen; 2 for a bad `--url`.
pub fn run(a: SinkArgs) -> ExitCode {
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
        return ExitCode::from(2);
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let _ = signal_hook::flag::register(sig, stop.clone());
    }
    let mut opts = SinkOptions::new(host, port, a.topic, a.client_id);
    opts.shared_group = a.share;
    opts.batch = BatchPolicy {
        max: a.batch_max,
        window: Duration::from_millis(a.batch_ms),
        idle: Duration::from_millis(2),
    };
    let result = match (a.db, a.postgres) {
        (Some(db), _) => match edgespool::sink::SinkDb::open(&db) {
            Ok(mut store) => edgespool::sink::run(&opts, &mut store, &stop),
            Err(e) => Err(format!("sink database {}: {e}", db.display())),
        },
        (None, Some(conninfo)) => run_postgres(&opts, &conninfo, &a.pg_tls, &stop),
        (None, None) => Err("sink needs --db FILE or --postgres CONNINFO".into()),
    };
    match result {
        Ok(s) => {
            print_totals(&s);
            if s.mismatches > 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("edgespool: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_totals(s: &SinkStats) {
    println!(
        "sink: first {} duplicates {} mismatches {} unreadable {}",
        s.first, s.duplicates, s.mismatches, s.unreadable
    );
}

#[cfg(feature = "pg-sink")]
fn run_postgres(
    opts: &SinkOptions,
    conninfo: &str,
    tls: &PgTlsArgs,
    stop: &AtomicBool,
) -> Result<SinkStats, String> {
    use edgespool::sink::StoreError;
    let files = tls.files();
    // The server may come up after the sink: wait for it, as for the broker.
    let mut backoff = Duration::from_millis(200);
    let mut store = loop {
        match edgespool::sink::postgres::PgStore::connect(conninfo, &opts.client_id, &files) {
            Ok(s) => break s,
            Err(StoreError::Transient(e)) if !stop.load(std::sync::atomic::Ordering::Relaxed) => {
                log::warn!("sink: PostgreSQL not reachable ({e}); retrying in {backoff:?}");
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
pub fn stats(
    db: Option<PathBuf>,
    postgres: Option<String>,
    tls: &PgTlsArgs,
    json: bool,
) -> ExitCode {
    let now = edgespool::envelope::wall_clock_ms().0;
    let report = match (db, postgres) {
        (Some(db), _) => edgespool::sink::stats::from_sqlite(&db, now)
            .map_err(|e| format!("sink database {}: {e}", db.display())),
        (None, Some(conninfo)) => postgres_report(&conninfo, tls, now),
        (None, None) => Err("sink --stats needs --db FILE or --postgres CONNINFO".into()),
    };
    match report {
        Ok(r) if json => crate::print_json(&r),
        Ok(r) => {
            print!("{}", edgespool::sink::stats::render(&r));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("edgespool: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "pg-sink")]
fn postgres_report(
    conninfo: &str,
    tls: &PgTlsArgs,
    now: i64,
) -> Result<edgespool::sink::stats::Report, String> {
    let mut c = edgespool::sink::postgres::connect_client(conninfo, &tls.files())
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
