//! The rest of a command's line, read against that command's entry in the
//! table ([`super::spec`]): an option the entry does not list is an error
//! naming the option (the caller names the command), so a flag that would
//! have no effect never passes silently.

use std::ffi::OsString;
use std::path::PathBuf;

use super::spec::{Command, Flag, Opt};
use super::Failure;

/// `--pg-ca`, `--pg-cert`, `--pg-key`: TLS files for `--postgres`.
#[derive(Default, Debug, Clone)]
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

/// Every option of every command, as read; a command's line can only set
/// the fields of the options its table entry lists.
#[derive(Default, Debug)]
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
    pub pg_password_file: Option<PathBuf>,
    pub stats: bool,
    pub batch_max: Option<usize>,
    pub batch_ms: Option<u64>,
    pub pg_tls: PgTlsArgs,
    pub no_receipts: bool,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub to: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub receipt_key: Option<PathBuf>,
}

/// Reads the rest of the line for `cmd`. `Ok(None)`: `-h` or `--help` was
/// given (what follows it is not read; what came before was, so a bad
/// option before it is still told).
///
/// Errors: [`Failure::Usage`] naming `cmd` and the option or argument.
pub fn read(p: &mut lexopt::Parser, cmd: &'static Command) -> Result<Option<Args>, Failure> {
    read_line(p, cmd).map_err(|msg| Failure::usage_of(cmd, msg))
}

fn read_line(p: &mut lexopt::Parser, cmd: &'static Command) -> Result<Option<Args>, String> {
    use lexopt::prelude::*;
    let mut a = Args::default();
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        let opt = match arg {
            Long("help") | Short('h') => return Ok(None),
            Long(name) => cmd
                .long(name)
                .ok_or_else(|| format!("unknown option --{name}"))?,
            Short(c) => cmd.short(c).ok_or_else(|| format!("unknown option -{c}"))?,
            Value(v) if cmd.operand.is_some() && a.config.is_none() => {
                a.config = Some(PathBuf::from(v));
                continue;
            }
            Value(v) => return Err(unexpected(&v.to_string_lossy())),
        };
        let value = match opt.value {
            Some(what) => p
                .value()
                .map_err(|_| format!("--{} needs a value ({what})", opt.long))?,
            None => OsString::new(),
        };
        a.apply(opt, value)?;
    }
    Ok(Some(a))
}

/// The error for a stray argument, naming it unless it may hold a secret
/// (`password=x`, a shell-quoting slip in a `--postgres` conninfo): no
/// text of a password reaches a message.
fn unexpected(arg: &str) -> String {
    if arg.to_ascii_lowercase().contains("pass") {
        "unexpected argument (not shown: it may hold a password; quote a conninfo as one argument)"
            .to_owned()
    } else {
        format!("unexpected argument {arg:?}")
    }
}

impl Args {
    /// Sets what `opt` sets, from its value `v` (empty for a switch).
    fn apply(&mut self, opt: &Opt, v: OsString) -> Result<(), String> {
        let text = |v: OsString| {
            v.into_string()
                .map_err(|_| format!("--{}: the value is not UTF-8", opt.long))
        };
        let number = |v: OsString| {
            let t = text(v)?;
            t.parse::<u64>()
                .map_err(|e| format!("--{}: {t:?} is not a number ({e})", opt.long))
        };
        match opt.flag {
            Flag::Config => self.config = Some(v.into()),
            Flag::Set => self.sets.push(text(v)?),
            Flag::CheckSpool => self.check_spool = true,
            Flag::Sample => self.sample = true,
            Flag::Spool => self.spool = Some(v.into()),
            Flag::Json => self.json = true,
            Flag::Dir => self.dir = Some(v.into()),
            Flag::Url => self.url = Some(text(v)?),
            Flag::Topic => self.topic = Some(text(v)?),
            Flag::Db => self.db = Some(v.into()),
            Flag::Postgres => self.postgres = Some(text(v)?),
            Flag::PgPasswordFile => self.pg_password_file = Some(v.into()),
            Flag::PgCa => self.pg_tls.ca = Some(v.into()),
            Flag::PgCert => self.pg_tls.cert = Some(v.into()),
            Flag::PgKey => self.pg_tls.key = Some(v.into()),
            Flag::ClientId => self.client_id = Some(text(v)?),
            Flag::Share => self.share = Some(text(v)?),
            Flag::BatchMax => {
                let n = number(v)?;
                self.batch_max = Some(usize::try_from(n).map_err(|e| format!("--batch-max: {e}"))?)
            }
            Flag::BatchMs => self.batch_ms = Some(number(v)?),
            Flag::NoReceipts => self.no_receipts = true,
            Flag::Username => self.username = Some(text(v)?),
            Flag::PasswordFile => self.password_file = Some(v.into()),
            Flag::Stats => self.stats = true,
            Flag::To => self.to = Some(v.into()),
            Flag::Out => self.out = Some(v.into()),
            Flag::ReceiptKey => self.receipt_key = Some(v.into()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::spec::{self, COMMANDS};
    use super::*;

    fn read(cmd: &'static Command, args: &[&str]) -> Result<Option<Args>, String> {
        let mut p = lexopt::Parser::from_args(args.iter().copied());
        read_line(&mut p, cmd)
    }

    #[test]
    fn every_option_in_the_table_is_read_by_its_command() {
        for cmd in COMMANDS {
            for o in cmd.opts {
                let long = format!("--{}", o.long);
                let mut line = vec![long.as_str()];
                if o.value.is_some() {
                    line.push("7");
                }
                let a = read(cmd, &line);
                assert!(
                    matches!(a, Ok(Some(_))),
                    "{} {line:?}: {:?}",
                    cmd.name,
                    a.err()
                );
            }
        }
    }

    #[test]
    fn no_two_options_of_a_command_share_a_name() {
        for cmd in COMMANDS {
            for (i, o) in cmd.opts.iter().enumerate() {
                for p in &cmd.opts[i + 1..] {
                    assert_ne!(o.long, p.long, "{}", cmd.name);
                    assert!(o.short.is_none() || o.short != p.short, "{}", cmd.name);
                }
                assert_ne!(o.long, "help", "{}: --help is every command's", cmd.name);
                assert_ne!(o.short, Some('h'), "{}: -h is every command's", cmd.name);
            }
        }
    }

    #[test]
    fn an_option_of_another_command_is_unknown_and_named() {
        assert_eq!(
            read(&spec::STATUS, &["--jsn"]).err().as_deref(),
            Some("unknown option --jsn")
        );
        assert_eq!(
            read(&spec::STATUS, &["--url", "mqtt://x:1"])
                .err()
                .as_deref(),
            Some("unknown option --url")
        );
        assert_eq!(
            read(&spec::RUN, &["-x"]).err().as_deref(),
            Some("unknown option -x")
        );
        let a = read(&spec::RUN, &["--check-spool", "-c", "b.toml"]);
        let a = a.ok().flatten().expect("run takes -c and --check-spool");
        assert!(a.check_spool);
        assert_eq!(a.config, Some(PathBuf::from("b.toml")));
    }

    #[test]
    fn a_bare_file_is_read_once_and_only_where_it_is_the_operand() {
        let a = read(&spec::CHECK_CONFIG, &["a.toml"]).ok().flatten();
        assert_eq!(a.and_then(|a| a.config), Some(PathBuf::from("a.toml")));
        assert_eq!(
            read(&spec::CHECK_CONFIG, &["a.toml", "b.toml"]).err(),
            Some("unexpected argument \"b.toml\"".to_owned())
        );
        assert_eq!(
            read(&spec::TEST, &["--config", "a.toml", "b.toml"]).err(),
            Some("unexpected argument \"b.toml\"".to_owned())
        );
        assert!(read(&spec::STATUS, &["a.toml"]).is_err());
    }

    #[test]
    fn help_ends_the_line_but_an_earlier_bad_option_is_told_first() {
        assert!(matches!(
            read(&spec::SINK, &["--help", "--bogus"]),
            Ok(None)
        ));
        assert!(matches!(read(&spec::SINK, &["-h"]), Ok(None)));
        let a = read(&spec::STATUS, &["--spool", "--help"]).ok().flatten();
        assert_eq!(
            a.and_then(|a| a.spool),
            Some(PathBuf::from("--help")),
            "a value is taken as given, even one that looks like an option"
        );
        assert!(read(&spec::STATUS, &["--bogus", "--help"]).is_err());
    }

    #[test]
    fn a_missing_or_bad_value_names_the_option() {
        assert_eq!(
            read(&spec::STATUS, &["--spool"]).err().as_deref(),
            Some("--spool needs a value (PATH)")
        );
        let e = read(&spec::SINK, &["--batch-max", "many"]).err();
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("--batch-max: \"many\" is not a number")),
            "{e:?}"
        );
        assert!(read(&spec::STATUS, &["--json=yes"]).is_err());
        let a = read(&spec::SINK, &["--batch-ms=7"]).ok().flatten();
        assert_eq!(a.and_then(|a| a.batch_ms), Some(7));
    }

    #[test]
    fn a_stray_argument_that_may_hold_a_password_is_not_echoed() {
        let e = read(&spec::SINK, &["--postgres", "host=db", "password=s3cret"])
            .expect_err("stray argument");
        assert!(
            !e.contains("s3cret") && e.contains("unexpected argument"),
            "{e}"
        );
        let e = read(&spec::SINK, &["stray"]).expect_err("stray argument");
        assert!(e.contains("\"stray\""), "{e}");
    }
}
