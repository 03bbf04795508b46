//! `edgespool status`: the spool's report, read-only, as text or JSON. The
//! work is in [`crate::cli::report`].

use super::spec::STATUS;
use super::{args, failed, help, load_config, print_json, Failure, Outcome};

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &STATUS)? else {
        return help::print(&STATUS);
    };
    // `--spool` wins over `--config`: no config is read when both are given.
    let path = match (a.spool, a.config) {
        (Some(s), _) => s,
        (None, Some(c)) => load_config(&c, &[])?.spool.path,
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
