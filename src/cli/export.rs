//! `edgespool export (--config FILE | --spool PATH) --to PATH`: a
//! consistent copy of the spool, taken while the agent runs, for a backup or
//! a move to another board. The work is in [`crate::spool::backup`].
//! Its options are its entry in the command table ([`super::spec::EXPORT`]).

use super::spec::EXPORT;
use super::{args, failed, help, load_config, Failure, Outcome};

/// Runs `export` with the rest of the line (its options: [`EXPORT`]).
pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &EXPORT)? else {
        return help::print(&EXPORT);
    };
    let Some(to) = a.to else {
        return Err(Failure::usage_of(
            &EXPORT,
            "--to PATH (a new file) is required",
        ));
    };
    // `--spool` wins over `--config`: no config is read when both are given.
    let path = match (a.spool, a.config) {
        (Some(s), _) => s,
        (None, Some(c)) => load_config(&c, &[])?.spool.path,
        (None, None) => {
            return Err(Failure::usage_of(
                &EXPORT,
                "--config FILE or --spool PATH is required",
            ))
        }
    };
    // A backup is background work beside the agent: under CPU contention
    // (a board's one or two cores) the agent's commits go first.
    // SAFETY: setpriority(2) on this process only; no memory is shared.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    match crate::spool::backup::export(&path, &to) {
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
        Err(
            e @ (crate::spool::backup::ExportError::Exists(_)
            | crate::spool::backup::ExportError::NotUtf8(_)),
        ) => {
            eprintln!("edgespool: {e}");
            Err(Failure::Invalid)
        }
        Err(e) => Err(failed(e)),
    }
}
