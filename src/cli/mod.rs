//! What every subcommand shares: the failures they end with and the exit
//! codes those become, and a few helpers. The table of commands and their
//! options is [`spec`]; [`args`] reads a line against it, [`help`] prints
//! it. `main` picks the subcommand; each subcommand's `main` reads the rest
//! of the line through [`args::read`].
//!
//! Exit codes: 0 ok; 1 runtime failure (spool, lock, OS; for `test`, a
//! source that gave no reading, a listener that cannot bind or a spool
//! directory `run` would refuse); 2 bad usage or bad config (for
//! `check-config`, also a replay file that is missing or lacks a configured
//! column).

pub mod args;
pub mod check_config;
#[cfg(test)]
mod docs_gen;
pub mod export;
pub mod help;
pub mod keygen;
pub mod probe_storage;
pub mod report;
pub mod run;
#[cfg(feature = "sink")]
pub mod sink;
pub mod spec;
pub mod status;
pub mod test;
pub mod trial;

use std::fmt::Display;
use std::path::Path;

use spec::Command;

/// Exit code: the command did what it was asked.
pub const EXIT_OK: u8 = 0;
/// Exit code: a runtime failure (spool, lock, OS, a source or a store).
pub const EXIT_FAILURE: u8 = 1;
/// Exit code: bad usage, or a config (or a file it names) that is invalid.
pub const EXIT_BAD_INPUT: u8 = 2;

/// The target of the binary's own log lines. Journal searches and
/// `RUST_LOG` filters name it; it stays the crate root's, as it was when
/// these lines were written in `main.rs`.
pub const LOG_TARGET: &str = "edgespool";

/// How a subcommand failed. Only a usage error is still to be told (with
/// the command's usage lines, by `main`); the others were told where they
/// happened, each in its own words.
#[derive(Debug)]
pub enum Failure {
    /// Exit 2: `edgespool COMMAND: MSG` and the command's usage lines
    /// (`command` is `None` when there is no command to name).
    Usage {
        /// The command whose line was wrong.
        command: Option<&'static Command>,
        /// What was wrong, naming the option or argument.
        msg: String,
    },
    /// Exit 2: a config or an input that cannot work.
    Invalid,
    /// Exit 1.
    Failed,
}

impl Failure {
    /// The exit code this failure ends the process with.
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage { .. } | Failure::Invalid => EXIT_BAD_INPUT,
            Failure::Failed => EXIT_FAILURE,
        }
    }

    /// A usage error of `cmd` (told by `main`, with its usage lines).
    pub fn usage_of(cmd: &'static Command, msg: impl Into<String>) -> Failure {
        Failure::Usage {
            command: Some(cmd),
            msg: msg.into(),
        }
    }
}

/// What a subcommand's entry point returns.
pub type Outcome = Result<(), Failure>;

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

/// Reads the first word: a subcommand's name, or `-h`/`--help` or
/// `-V`/`--version` (which end the line: what follows is not read).
///
/// Errors: a usage error naming no command.
pub fn first_word(p: &mut lexopt::Parser) -> Result<First, Failure> {
    use lexopt::prelude::*;
    let bad = |msg: String| Failure::Usage { command: None, msg };
    match p.next().map_err(|e| bad(e.to_string()))? {
        Some(Value(v)) => Ok(First::Command(v.to_string_lossy().into_owned())),
        Some(Long("version") | Short('V')) => Ok(First::Version),
        Some(Long("help") | Short('h')) => Ok(First::Help),
        Some(Long(o)) => Err(bad(format!("unknown option --{o}"))),
        Some(Short(c)) => Err(bad(format!("unknown option -{c}"))),
        None => Err(bad("missing command".into())),
    }
}

/// A name that is no command.
pub fn unknown(name: &str) -> Outcome {
    Err(Failure::Usage {
        command: None,
        msg: format!("unknown command {name:?}"),
    })
}

/// `edgespool --version`.
pub fn print_version() -> Outcome {
    println!("edgespool {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

/// The config at `path` with `sets` applied; an invalid one is told on
/// stderr as `config invalid: ...` (the key and line named), a missing one
/// as `config file PATH does not exist`.
pub fn load_config(path: &Path, sets: &[String]) -> Result<crate::config::Config, Failure> {
    crate::config::load(path, sets).map_err(|e| {
        eprintln!("{}", e.told());
        Failure::Invalid
    })
}

/// `n` and the noun that agrees with it: `counted(1, "source", "sources")`
/// is `1 source`, any other `n` takes `many`.
pub fn counted(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
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

    #[test]
    fn the_first_word_is_a_name_help_version_or_a_usage_error() {
        let first = |args: &[&str]| {
            let mut p = lexopt::Parser::from_args(args.iter().copied());
            first_word(&mut p).map_err(|e| match e {
                Failure::Usage { command: None, msg } => msg,
                other => format!("{other:?}"),
            })
        };
        assert!(matches!(first(&["run", "--bogus"]), Ok(First::Command(n)) if n == "run"));
        assert!(matches!(
            first(&["--version", "--bogus"]),
            Ok(First::Version)
        ));
        assert!(matches!(first(&["-V"]), Ok(First::Version)));
        assert!(matches!(first(&["-h"]), Ok(First::Help)));
        assert_eq!(first(&[]).err().as_deref(), Some("missing command"));
        assert_eq!(
            first(&["--json"]).err().as_deref(),
            Some("unknown option --json")
        );
    }

    #[test]
    fn usage_and_bad_config_exit_2_runtime_failures_exit_1() {
        assert_eq!(
            Failure::usage_of(&spec::RUN, "x").exit_code(),
            EXIT_BAD_INPUT
        );
        assert_eq!(Failure::Invalid.exit_code(), EXIT_BAD_INPUT);
        assert_eq!(Failure::Failed.exit_code(), EXIT_FAILURE);
        assert_eq!((EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT), (0, 1, 2));
    }
}
