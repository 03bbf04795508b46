//! `edgespool status`: the spool's report, read-only, as text or JSON. The
//! work is in [`edgespool::status`].

use super::{failed, load_config, print_json, print_usage, usage, Args, Outcome, OwnFlags};

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = Args::read(p, OwnFlags::default())? else {
        return print_usage();
    };
    // `--spool` wins over `--config`: no config is read when both are given.
    let path = match (a.spool, a.config) {
        (Some(s), _) => s,
        (None, Some(c)) => load_config(&c, &[])?.spool.path,
        (None, None) => return Err(usage("status needs --config FILE or --spool PATH")),
    };
    let now = edgespool::envelope::wall_clock_ms().0;
    let r = edgespool::status::report(&path, now).map_err(failed)?;
    if a.json {
        return print_json(&edgespool::status::to_json(&r));
    }
    print!("{}", edgespool::status::render(&r, now));
    Ok(())
}
