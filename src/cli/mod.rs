//! What every subcommand shares: the one flag vocabulary they all read,
//! the usage text, the failures they end with and the exit codes those
//! become. `main` picks the subcommand; each subcommand's `main` reads the
//! rest of the line through [`Args::read`].
//!
//! Exit codes: 0 ok; 1 runtime failure (spool, lock, OS; for `test`, a
//! source that gave no reading or a listener that cannot bind); 2 bad usage
//! or bad config (for `check-config`, also a replay file that is missing or
//! lacks a configured column).

pub mod check_config;
pub mod export;
pub mod probe_storage;
pub mod run;
pub mod sink;
pub mod status;
pub mod test;

use std::fmt::Display;
use std::path::{Path, PathBuf};

/// Exit code: the command did what it was asked.
pub const EXIT_OK: u8 = 0;
/// Exit code: a runtime failure (spool, lock, OS, a source or a store).
pub const EXIT_FAILURE: u8 = 1;
/// Exit code: bad usage, or a config (or a file it names) that is invalid.
pub const EXIT_BAD_INPUT: u8 = 2;

pub const USAGE: &str = "usage:
  edgespool run --config FILE [--set key.path=value]... [--check-spool]
  edgespool check-config FILE [--set key.path=value]...
  edgespool test --config FILE [--set key.path=value]...
  edgespool status (--config FILE | --spool PATH) [--json]
  edgespool probe-storage (--config FILE | --dir DIR) [--json]
  edgespool sink --url mqtt://HOST:PORT --topic FILTER (--db FILE | --postgres CONNINFO)
                 [--client-id ID] [--share GROUP] [--batch-max N] [--batch-ms MS] [--no-receipts]
                 [--username USER --password-file FILE]
                 [--pg-ca FILE] [--pg-cert FILE --pg-key FILE]
  edgespool sink --stats (--db FILE | --postgres CONNINFO) [--json]
                 [--pg-ca FILE] [--pg-cert FILE --pg-key FILE]
  edgespool --version";

/// The target of the binary's own log lines. Journal searches and
/// `RUST_LOG` filters name it; it stays the crate root's, as it was when
/// these lines were written in `main.rs`.
pub const LOG_TARGET: &str = "edgespool";

/// How a subcommand failed. Only a usage error is still to be told (with
/// the usage text, by `main`); the others were told where they happened,
/// each in its own words.
#[derive(Debug)]
pub enum Failure {
    /// Exit 2, with the usage text.
    Usage(lexopt::Error),
    /// Exit 2: a config or an input that cannot work.
    Invalid,
    /// Exit 1.
    Failed,
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage(_) | Failure::Invalid => EXIT_BAD_INPUT,
            Failure::Failed => EXIT_FAILURE,
        }
    }
}

impl From<lexopt::Error> for Failure {
    fn from(e: lexopt::Error) -> Self {
        Failure::Usage(e)
    }
}

/// What a subcommand's entry point returns.
pub type Outcome = Result<(), Failure>;

/// A usage error with `msg` (told by `main`, with the usage text).
pub fn usage(msg: impl Into<lexopt::Error>) -> Failure {
    Failure::Usage(msg.into())
}

/// Tells a runtime failure on stderr as `edgespool: WHY`.
pub fn failed(why: impl Display) -> Failure {
    eprintln!("edgespool: {why}");
    Failure::Failed
}

/// The first word of the line.
pub enum First {
    Command(String),
    Help,
    Version,
}

/// Reads the first word: a subcommand's name, or `--help`/`--version`
/// (which end the line: what follows is not read).
pub fn first_word(p: &mut lexopt::Parser) -> Result<First, lexopt::Error> {
    use lexopt::prelude::*;
    match p.next()? {
        Some(Value(v)) => Ok(First::Command(v.string()?)),
        Some(Long("version")) => Ok(First::Version),
        Some(Long("help") | Short('h')) => Ok(First::Help),
        Some(a) => Err(a.unexpected()),
        None => Err("missing command".into()),
    }
}

/// The flags that belong to one subcommand each; anywhere else each is an
/// unexpected argument, as an unknown flag is.
#[derive(Clone, Copy, Default)]
pub struct OwnFlags {
    /// `--check-spool` (`run`).
    pub check_spool: bool,
    /// `--sample` (`check-config`).
    pub sample: bool,
    /// `--stats` (`sink`).
    pub stats: bool,
    /// The config FILE given bare, without `--config` (`check-config`, `test`).
    pub file: bool,
}

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
}

/// Every flag of every subcommand, as read. One vocabulary for all: a
/// subcommand takes (and ignores) the flags of the others, so a line that
/// names a flag it has no use for still runs, as it always has.
#[derive(Default)]
pub struct Args {
    pub config: Option<PathBuf>,
    pub spool: Option<PathBuf>,
    pub sets: Vec<String>,
    pub json: bool,
    pub check_spool: bool,
    pub sample: bool,
    pub dir: Option<PathBuf>,
    pub url: Option<String>,
    pub topic: Option<String>,
    pub db: Option<PathBuf>,
    pub client_id: Option<String>,
    pub share: Option<String>,
    pub postgres: Option<String>,
    pub stats: bool,
    pub batch_max: Option<usize>,
    pub batch_ms: Option<u64>,
    pub pg_tls: PgTlsArgs,
    pub no_receipts: bool,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl Args {
    /// Reads the rest of the line. `None`: `--help` (or `-h`) was given,
    /// and nothing after it is read.
    pub fn read(p: &mut lexopt::Parser, own: OwnFlags) -> Result<Option<Args>, lexopt::Error> {
        use lexopt::prelude::*;
        let mut a = Args::default();
        while let Some(arg) = p.next()? {
            match arg {
                Long("config") | Short('c') => a.config = Some(PathBuf::from(p.value()?)),
                Long("spool") => a.spool = Some(PathBuf::from(p.value()?)),
                Long("set") => a.sets.push(p.value()?.string()?),
                Long("json") => a.json = true,
                Long("check-spool") if own.check_spool => a.check_spool = true,
                Long("sample") if own.sample => a.sample = true,
                Long("dir") => a.dir = Some(PathBuf::from(p.value()?)),
                Long("url") => a.url = Some(p.value()?.string()?),
                Long("topic") => a.topic = Some(p.value()?.string()?),
                Long("db") => a.db = Some(PathBuf::from(p.value()?)),
                Long("client-id") => a.client_id = Some(p.value()?.string()?),
                Long("share") => a.share = Some(p.value()?.string()?),
                Long("postgres") => a.postgres = Some(p.value()?.string()?),
                Long("pg-ca") => a.pg_tls.ca = Some(PathBuf::from(p.value()?)),
                Long("pg-cert") => a.pg_tls.cert = Some(PathBuf::from(p.value()?)),
                Long("pg-key") => a.pg_tls.key = Some(PathBuf::from(p.value()?)),
                Long("stats") if own.stats => a.stats = true,
                Long("batch-max") => a.batch_max = Some(p.value()?.parse::<usize>()?),
                Long("batch-ms") => a.batch_ms = Some(p.value()?.parse::<u64>()?),
                Long("no-receipts") => a.no_receipts = true,
                Long("username") => a.username = Some(p.value()?.string()?),
                Long("password-file") => a.password_file = Some(PathBuf::from(p.value()?)),
                Long("help") | Short('h') => return Ok(None),
                Value(v) if own.file && a.config.is_none() => a.config = Some(PathBuf::from(v)),
                arg => return Err(arg.unexpected()),
            }
        }
        Ok(Some(a))
    }
}

/// `help`: the rest of the line is read as any subcommand's (a bad flag is
/// still a usage error), then the usage text.
pub fn help(p: &mut lexopt::Parser) -> Outcome {
    Args::read(p, OwnFlags::default())?;
    print_usage()
}

/// A name that is no subcommand: the rest of the line is read first, so a
/// bad flag is told before the name is, and `--help` still helps.
pub fn unknown(name: &str, p: &mut lexopt::Parser) -> Outcome {
    match Args::read(p, OwnFlags::default())? {
        Some(_) => Err(usage(format!("unknown command {name:?}"))),
        None => print_usage(),
    }
}

pub fn print_usage() -> Outcome {
    println!("{USAGE}");
    Ok(())
}

pub fn print_version() -> Outcome {
    println!("edgespool {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

/// The config at `path` with `sets` applied; an invalid one is told on
/// stderr as `config invalid: ...` (the key and line named).
pub fn load_config(path: &Path, sets: &[String]) -> Result<edgespool::config::Config, Failure> {
    edgespool::config::load(path, sets).map_err(|e| {
        eprintln!("config invalid: {e}");
        Failure::Invalid
    })
}

/// Prints `value` as pretty JSON on stdout (`status --json`, `sink --stats
/// --json`); a value that cannot be serialised is an error on stderr.
pub fn print_json<T: serde::Serialize>(value: &T) -> Outcome {
    match serde_json::to_string_pretty(value) {
        Ok(s) => {
            println!("{s}");
            Ok(())
        }
        Err(e) => Err(failed(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(args: &[&str], own: OwnFlags) -> Result<Option<Args>, String> {
        let mut p = lexopt::Parser::from_args(args.iter().copied());
        Args::read(&mut p, own).map_err(|e| e.to_string())
    }

    #[test]
    fn a_flag_of_one_subcommand_is_unexpected_in_the_others() {
        let run = OwnFlags {
            check_spool: true,
            ..OwnFlags::default()
        };
        let a = read(&["--check-spool"], run).expect("run takes --check-spool");
        assert!(a.is_some_and(|a| a.check_spool));
        for flag in ["--check-spool", "--sample", "--stats"] {
            assert_eq!(
                read(&[flag], OwnFlags::default()).err(),
                Some(format!("invalid option '{flag}'"))
            );
        }
    }

    #[test]
    fn the_flags_of_other_subcommands_are_read_and_left_unused() {
        let a = read(
            &["--spool", "s.db", "--url", "u", "--batch-ms", "7"],
            OwnFlags::default(),
        )
        .expect("one vocabulary for all")
        .expect("no --help");
        assert_eq!(a.spool, Some(PathBuf::from("s.db")));
        assert_eq!((a.url.as_deref(), a.batch_ms), (Some("u"), Some(7)));
    }

    #[test]
    fn a_bare_file_is_read_once_and_only_where_it_is_owned() {
        let file = OwnFlags {
            file: true,
            ..OwnFlags::default()
        };
        let a = read(&["a.toml"], file)
            .expect("bare FILE")
            .expect("no --help");
        assert_eq!(a.config, Some(PathBuf::from("a.toml")));
        assert_eq!(
            read(&["a.toml", "b.toml"], file).err(),
            Some("unexpected argument \"b.toml\"".to_owned())
        );
        assert_eq!(
            read(&["--config", "a.toml", "b.toml"], file).err(),
            Some("unexpected argument \"b.toml\"".to_owned())
        );
        assert!(read(&["a.toml"], OwnFlags::default()).is_err());
    }

    #[test]
    fn help_ends_the_line_but_an_earlier_bad_flag_is_told_first() {
        assert!(matches!(
            read(&["--help", "--bogus"], OwnFlags::default()),
            Ok(None)
        ));
        assert!(matches!(read(&["-h"], OwnFlags::default()), Ok(None)));
        assert_eq!(
            read(&["--spool", "--help"], OwnFlags::default())
                .ok()
                .flatten()
                .and_then(|a| a.spool),
            Some(PathBuf::from("--help")),
            "a flag's value is taken as given, even one that looks like a flag"
        );
        assert!(read(&["--bogus", "--help"], OwnFlags::default()).is_err());
    }

    #[test]
    fn the_first_word_is_a_name_help_version_or_a_usage_error() {
        let first = |args: &[&str]| {
            let mut p = lexopt::Parser::from_args(args.iter().copied());
            first_word(&mut p).map_err(|e| e.to_string())
        };
        assert!(matches!(first(&["run", "--bogus"]), Ok(First::Command(n)) if n == "run"));
        assert!(matches!(
            first(&["--version", "--bogus"]),
            Ok(First::Version)
        ));
        assert!(matches!(first(&["-h"]), Ok(First::Help)));
        assert_eq!(first(&[]).err().as_deref(), Some("missing command"));
        assert_eq!(
            first(&["--json"]).err().as_deref(),
            Some("invalid option '--json'")
        );
    }

    #[test]
    fn usage_and_bad_config_exit_2_runtime_failures_exit_1() {
        assert_eq!(usage("x").exit_code(), EXIT_BAD_INPUT);
        assert_eq!(Failure::Invalid.exit_code(), EXIT_BAD_INPUT);
        assert_eq!(Failure::Failed.exit_code(), EXIT_FAILURE);
        assert_eq!((EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT), (0, 1, 2));
    }
}
