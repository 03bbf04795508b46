//! `edgespool status`: the spool's report, read-only, as text or JSON. The
//! work is in [`crate::cli::report`].
//!
//! Its one rule: **status finds the spool whenever the agent does**: with
//! `--config` naming a file that is invalid or gone, the agent runs its
//! last-known-good copy (field case F15), so status reads the spool that
//! copy names, and says so on stderr.

use std::path::{Path, PathBuf};

use super::spec::STATUS;
use super::{args, failed, help, print_json, Failure, Outcome};

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &STATUS)? else {
        return help::print(&STATUS);
    };
    // `--spool` wins over `--config`: no config is read when both are given.
    let path = match (a.spool, a.config) {
        (Some(s), _) => s,
        (None, Some(c)) => spool_of(&c)?,
        (None, None) => {
            return Err(Failure::usage_of(
                &STATUS,
                "--config FILE or --spool PATH is required",
            ))
        }
    };
    let now = crate::event::envelope::wall_clock_ms().0;
    let r = crate::cli::report::report(&path, now).map_err(failed)?;
    if a.json {
        return print_json(&crate::cli::report::to_json(&r));
    }
    print!("{}", crate::cli::report::render(&r, now));
    Ok(())
}

/// The spool `config` names; when `config` cannot be used, the one its
/// last-known-good copy names (what the agent runs then), told on stderr.
///
/// Errors: neither the file nor a copy of it can be used (both told).
fn spool_of(config: &Path) -> Result<PathBuf, Failure> {
    let e = match crate::config::load(config, &[]) {
        Ok(c) => return Ok(c.spool.path),
        Err(e) => e,
    };
    match crate::config::file::last_good_for_reading(config) {
        Ok((lg, c)) => {
            eprintln!("{}", e.told());
            eprintln!(
                "edgespool: reading the spool named by the last-known-good copy {} instead (the config the agent falls back to while the file is invalid)",
                lg.display()
            );
            Ok(c.spool.path)
        }
        Err(why) => {
            eprintln!("{}", e.told());
            eprintln!("edgespool: no spool to read: {why}");
            Err(Failure::Invalid)
        }
    }
}
