//! The `edgespool` command: parses arguments, runs, maps results to exit codes.
//!
//! Exit codes: 0 ok; 1 runtime failure (spool, lock, OS; for `test`, a
//! source that gave no reading or a listener that cannot bind); 2 bad usage
//! or bad config (for `check-config`, also a replay file that is missing or
//! lacks a configured column).

mod sink_cmd;
mod test_cmd;

use sink_cmd::{PgTlsArgs, SinkArgs};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "usage:
  edgespool run --config FILE [--set key.path=value]... [--check-spool]
  edgespool check-config FILE [--set key.path=value]...
  edgespool test --config FILE [--set key.path=value]...
  edgespool status (--config FILE | --spool PATH) [--json]
  edgespool probe-storage (--config FILE | --dir DIR) [--json]
  edgespool sink --url mqtt://HOST:PORT --topic FILTER (--db FILE | --postgres CONNINFO)
                 [--client-id ID] [--share GROUP] [--batch-max N] [--batch-ms MS]
                 [--pg-ca FILE] [--pg-cert FILE --pg-key FILE]
  edgespool sink --stats (--db FILE | --postgres CONNINFO) [--json]
                 [--pg-ca FILE] [--pg-cert FILE --pg-key FILE]
  edgespool --version";

enum Cmd {
    Run {
        config: PathBuf,
        sets: Vec<String>,
        check_spool: bool,
    },
    Check {
        config: PathBuf,
        sets: Vec<String>,
        sample: bool,
    },
    Test {
        config: PathBuf,
        sets: Vec<String>,
    },
    Status {
        config: Option<PathBuf>,
        spool: Option<PathBuf>,
        json: bool,
    },
    Probe {
        config: Option<PathBuf>,
        dir: Option<PathBuf>,
        json: bool,
    },
    Sink(SinkArgs),
    SinkStats {
        db: Option<PathBuf>,
        postgres: Option<String>,
        pg_tls: PgTlsArgs,
        json: bool,
    },
    Help,
    Version,
}

fn parse_args() -> Result<Cmd, lexopt::Error> {
    use lexopt::prelude::*;
    let mut p = lexopt::Parser::from_env();
    let sub = match p.next()? {
        Some(Value(v)) => v.string()?,
        Some(Long("version")) => return Ok(Cmd::Version),
        Some(Long("help") | Short('h')) => return Ok(Cmd::Help),
        Some(a) => return Err(a.unexpected()),
        None => return Err("missing command".into()),
    };
    let (mut config, mut spool, mut sets, mut json) = (None, None, Vec::new(), false);
    let (mut dir, mut check_spool, mut sample) = (None, false, false);
    let (mut url, mut topic, mut db, mut client_id, mut share) = (None, None, None, None, None);
    let (mut postgres, mut stats, mut batch_max, mut batch_ms) = (None, false, None, None);
    let mut pg_tls = PgTlsArgs::default();
    while let Some(arg) = p.next()? {
        match arg {
            Long("config") | Short('c') => config = Some(PathBuf::from(p.value()?)),
            Long("spool") => spool = Some(PathBuf::from(p.value()?)),
            Long("set") => sets.push(p.value()?.string()?),
            Long("json") => json = true,
            Long("check-spool") if sub == "run" => check_spool = true,
            Long("sample") if sub == "check-config" => sample = true,
            Long("dir") => dir = Some(PathBuf::from(p.value()?)),
            Long("url") => url = Some(p.value()?.string()?),
            Long("topic") => topic = Some(p.value()?.string()?),
            Long("db") => db = Some(PathBuf::from(p.value()?)),
            Long("client-id") => client_id = Some(p.value()?.string()?),
            Long("share") => share = Some(p.value()?.string()?),
            Long("postgres") => postgres = Some(p.value()?.string()?),
            Long("pg-ca") => pg_tls.ca = Some(PathBuf::from(p.value()?)),
            Long("pg-cert") => pg_tls.cert = Some(PathBuf::from(p.value()?)),
            Long("pg-key") => pg_tls.key = Some(PathBuf::from(p.value()?)),
            Long("stats") if sub == "sink" => stats = true,
            Long("batch-max") => batch_max = Some(p.value()?.parse::<usize>()?),
            Long("batch-ms") => batch_ms = Some(p.value()?.parse::<u64>()?),
            Long("help") | Short('h') => return Ok(Cmd::Help),
            Value(v) if matches!(sub.as_str(), "check-config" | "test") && config.is_none() => {
                config = Some(PathBuf::from(v))
            }
            a => return Err(a.unexpected()),
        }
    }
    match sub.as_str() {
        "run" => Ok(Cmd::Run {
            config: config.ok_or("run needs --config FILE")?,
            sets,
            check_spool,
        }),
        "check-config" => Ok(Cmd::Check {
            config: config.ok_or("check-config needs FILE")?,
            sets,
            sample,
        }),
        "test" => Ok(Cmd::Test {
            config: config.ok_or("test needs --config FILE")?,
            sets,
        }),
        "status" if config.is_some() || spool.is_some() => Ok(Cmd::Status {
            config,
            spool,
            json,
        }),
        "status" => Err("status needs --config FILE or --spool PATH".into()),
        "probe-storage" if config.is_some() || dir.is_some() => {
            Ok(Cmd::Probe { config, dir, json })
        }
        "probe-storage" => Err("probe-storage needs --config FILE or --dir DIR".into()),
        "help" => Ok(Cmd::Help),
        "sink" if db.is_some() == postgres.is_some() => {
            Err("sink needs one of --db FILE or --postgres CONNINFO".into())
        }
        "sink" if postgres.is_none() && pg_tls.any() => {
            Err("--pg-ca, --pg-cert and --pg-key go with --postgres".into())
        }
        "sink" if stats => Ok(Cmd::SinkStats {
            db,
            postgres,
            pg_tls,
            json,
        }),
        "sink" => Ok(Cmd::Sink(SinkArgs {
            url: url.ok_or("sink needs --url mqtt://HOST:PORT")?,
            topic: topic.ok_or("sink needs --topic FILTER")?,
            // A persistent session is found again by its client id: a
            // PostgreSQL sink (one of N) must be given a stable one.
            client_id: match (client_id, &postgres) {
                (Some(id), _) => id,
                (None, None) => format!("edgespool-sink-{}", std::process::id()),
                (None, Some(_)) => {
                    return Err("sink --postgres needs --client-id ID (stable per sink)".into())
                }
            },
            db,
            postgres,
            pg_tls,
            share,
            batch_max: batch_max.filter(|&n| n > 0).unwrap_or(500),
            batch_ms: batch_ms.unwrap_or(100),
        })),
        other => Err(format!("unknown command {other:?}").into()),
    }
}

fn main() -> ExitCode {
    init_logging();
    let cmd = match parse_args() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("edgespool: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match cmd {
        Cmd::Sink(args) => sink_cmd::run(args),
        Cmd::SinkStats {
            db,
            postgres,
            pg_tls,
            json,
        } => sink_cmd::stats(db, postgres, &pg_tls, json),
        Cmd::Help => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Cmd::Probe { config, dir, json } => {
            let dir = match (dir, config) {
                (Some(d), _) => d,
                (None, Some(c)) => match edgespool::config::load(&c, &[]) {
                    Ok(cfg) => cfg
                        .spool
                        .path
                        .parent()
                        .filter(|d| !d.as_os_str().is_empty())
                        .map(PathBuf::from)
                        .unwrap_or_else(|| PathBuf::from(".")),
                    Err(e) => {
                        eprintln!("config invalid: {e}");
                        return ExitCode::from(2);
                    }
                },
                (None, None) => return ExitCode::from(2),
            };
            if let Err(e) = std::fs::create_dir_all(&dir) {
                eprintln!("edgespool: cannot create {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
            match edgespool::probe::probe_and_store(&dir, 64, 16 * 1024 * 1024) {
                Ok(p) if json => {
                    println!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Ok(p) => {
                    let (m, d) = (p.measurements, p.derived);
                    println!(
                        "storage probe of {} ({} fsyncs of 4 KiB, 16 MiB sequential):",
                        dir.display(),
                        m.samples
                    );
                    println!(
                        "  fsync latency: p50 {} us, p99 {} us, max {} us",
                        m.fsync_p50_us, m.fsync_p99_us, m.fsync_max_us
                    );
                    println!(
                        "  sequential write: {:.1} MB/s; free space {} bytes",
                        m.write_bytes_per_sec as f64 / 1e6,
                        m.fs_free_bytes
                    );
                    println!("derived (used by `run` unless the config sets the key):");
                    println!("  spool.commit_window_ms     {}", d.commit_window_ms);
                    println!("  spool.checkpoint_wal_bytes {}", d.checkpoint_wal_bytes);
                    println!(
                        "  storage retry backoff      {}..{} ms",
                        d.retry_min_ms, d.retry_max_ms
                    );
                    println!("  spool size bound           {} bytes", d.max_spool_bytes);
                    println!(
                        "stored in {}",
                        edgespool::probe::profile_path(&dir).display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("edgespool: probe of {} failed: {e}", dir.display());
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Version => {
            println!("edgespool {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Cmd::Check {
            config,
            sets,
            sample,
        } => check_config(&config, &sets, sample),
        Cmd::Test { config, sets } => test_cmd::run(&config, &sets),
        Cmd::Status {
            config,
            spool,
            json,
        } => {
            let path = match (spool, config) {
                (Some(s), _) => s,
                (None, Some(c)) => match edgespool::config::load(&c, &[]) {
                    Ok(cfg) => cfg.spool.path,
                    Err(e) => {
                        eprintln!("config invalid: {e}");
                        return ExitCode::from(2);
                    }
                },
                (None, None) => return ExitCode::from(2),
            };
            let now = edgespool::envelope::wall_clock_ms().0;
            match edgespool::status::report(&path, now) {
                Ok(r) if json => print_json(&edgespool::status::to_json(&r)),
                Ok(r) => {
                    print!("{}", edgespool::status::render(&r, now));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("edgespool: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Run {
            config,
            sets,
            check_spool,
        } => {
            let loaded = match edgespool::configfile::load_at_start(&config, &sets) {
                Ok(l) => l,
                Err(e) => {
                    log::error!("config invalid: {e} (and no usable last-known-good copy)");
                    return ExitCode::from(2);
                }
            };
            let source = edgespool::agent::ConfigSource {
                path: config,
                sets,
                fallback: loaded.fallback,
                check_spool,
            };
            // A damaged spool found after start: once more, which moves it
            // aside (in this process: no restart by the supervisor needed).
            for _ in 0..2 {
                match edgespool::agent::run(loaded.config.clone(), source.clone()) {
                    Ok(()) => return ExitCode::SUCCESS,
                    Err(edgespool::agent::AgentError::Damaged(e)) => log::error!("{e}"),
                    Err(e) => {
                        log::error!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            ExitCode::FAILURE
        }
    }
}

/// `check-config`: the config, then the replay files it names, then (with
/// `sample`, the older spelling of `test`) what `test` does. Exit 2 for a
/// bad config or file, 1 for a source that gave no reading.
fn check_config(config: &Path, sets: &[String], sample: bool) -> ExitCode {
    let c = match edgespool::config::load(config, sets) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("config invalid: {e}");
            return ExitCode::from(2);
        }
    };
    let problems = edgespool::source::check_files(&c.sources);
    for (key, msg) in &problems {
        eprintln!("config invalid: {}: {key}: {msg}", config.display());
    }
    if !problems.is_empty() {
        return ExitCode::from(2);
    }
    if sample && !test_cmd::report(&c) {
        return ExitCode::FAILURE;
    }
    println!(
        "{}: ok (device {}, {} sources, broker {}:{})",
        config.display(),
        c.device_id,
        c.sources.len(),
        c.mqtt.host,
        c.mqtt.port
    );
    ExitCode::SUCCESS
}

/// Log to stderr through env_logger (`RUST_LOG`, default `info`). Under
/// systemd (`JOURNAL_STREAM` set: stderr is the journal) each line starts
/// with its syslog priority, `<3>` error to `<7>` debug (sd-daemon(3)), and
/// carries no timestamp of its own: the journal stamps every line.
fn init_logging() {
    use std::io::Write;
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        b.format(|buf, record| {
            let prio = match record.level() {
                log::Level::Error => 3,
                log::Level::Warn => 4,
                log::Level::Info => 6,
                log::Level::Debug | log::Level::Trace => 7,
            };
            writeln!(buf, "<{prio}>{}: {}", record.target(), record.args())
        });
    }
    b.init();
}

/// Prints `value` as pretty JSON on stdout (`status --json`, `sink --stats
/// --json`); a value that cannot be serialised is an error on stderr.
fn print_json<T: serde::Serialize>(value: &T) -> ExitCode {
    match serde_json::to_string_pretty(value) {
        Ok(s) => {
            println!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("edgespool: {e}");
            ExitCode::FAILURE
        }
    }
}
