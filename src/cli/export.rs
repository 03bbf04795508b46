//! `edgespool export (--config FILE | --spool PATH) --to PATH`: a
//! consistent copy of the spool, taken while the agent runs, for a backup or
//! a move to another board. The work is in [`edgespool::spool::backup`].
//! It reads its own flags (`--to` belongs to it alone).

use super::{failed, load_config, Failure, Outcome};
use std::path::PathBuf;

/// This subcommand's usage line.
pub const USAGE: &str = "usage: edgespool export (--config FILE | --spool PATH) --to PATH";

/// What the line asks for: (config, spool, to), or `None` for `--help`.
type Line = Option<(Option<PathBuf>, Option<PathBuf>, Option<PathBuf>)>;

fn read_line(p: &mut lexopt::Parser) -> Result<Line, lexopt::Error> {
    use lexopt::prelude::*;
    let (mut config, mut spool, mut to) = (None, None, None);
    while let Some(arg) = p.next()? {
        match arg {
            Long("config") | Short('c') => config = Some(PathBuf::from(p.value()?)),
            Long("spool") => spool = Some(PathBuf::from(p.value()?)),
            Long("to") => to = Some(PathBuf::from(p.value()?)),
            Long("help") | Short('h') => return Ok(None),
            arg => return Err(arg.unexpected()),
        }
    }
    Ok(Some((config, spool, to)))
}

/// A usage error, told with this subcommand's usage line (exit 2).
fn bad_usage(why: impl std::fmt::Display) -> Failure {
    eprintln!("edgespool: {why}\n{USAGE}");
    Failure::Invalid
}

/// Runs `export` with the rest of the line.
pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let (config, spool, to) = match read_line(p) {
        Ok(Some(line)) => line,
        Ok(None) => {
            println!("{USAGE}");
            return Ok(());
        }
        Err(e) => return Err(bad_usage(e)),
    };
    let Some(to) = to else {
        return Err(bad_usage("export needs --to PATH (a new file)"));
    };
    // `--spool` wins over `--config`: no config is read when both are given.
    let path = match (spool, config) {
        (Some(s), _) => s,
        (None, Some(c)) => load_config(&c, &[])?.spool.path,
        (None, None) => return Err(bad_usage("export needs --config FILE or --spool PATH")),
    };
    // A backup is background work beside the agent: under CPU contention
    // (a board's one or two cores) the agent's commits go first.
    // SAFETY: setpriority(2) on this process only; no memory is shared.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    match edgespool::spool::backup::export(&path, &to) {
        Ok(e) => {
            println!(
                "exported {} to {}: {} rows ({} not yet acknowledged), {} bytes, quick_check ok; read {} ms, {} ms in all",
                path.display(),
                to.display(),
                e.rows,
                e.unacked,
                e.bytes,
                e.read.as_millis(),
                e.total.as_millis()
            );
            Ok(())
        }
        Err(e @ edgespool::spool::backup::ExportError::Exists(_)) => {
            eprintln!("edgespool: {e}");
            Err(Failure::Invalid)
        }
        Err(e) => Err(failed(e)),
    }
}
