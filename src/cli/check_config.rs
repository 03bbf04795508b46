//! `edgespool check-config FILE`: the config, then the replay files it
//! names, then (with `--sample`, the older spelling of `test`) what `test`
//! does. Exit 2 for a bad config or file, 1 for a source that gave no
//! reading.

use std::path::Path;

use super::spec::CHECK_CONFIG;
use super::{args, help, load_config, Failure, Outcome};

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &CHECK_CONFIG)? else {
        return help::print(&CHECK_CONFIG);
    };
    let config = a
        .config
        .ok_or_else(|| Failure::usage_of(&CHECK_CONFIG, "FILE is required"))?;
    check(&config, &a.sets, a.sample)
}

fn check(config: &Path, sets: &[String], sample: bool) -> Outcome {
    let c = load_config(config, sets)?;
    let problems = crate::source::check_files(&c.sources);
    for (key, msg) in &problems {
        eprintln!("config invalid: {}: {key}: {msg}", config.display());
    }
    if !problems.is_empty() {
        return Err(Failure::Invalid);
    }
    if let Some(caution) = c.commands.caution() {
        eprintln!("caution: {}: {caution}", config.display());
    }
    if sample && !super::test::report(&c, config) {
        return Err(Failure::Failed);
    }
    println!(
        "{}: ok (device {} from {}, {}, broker {}:{})",
        config.display(),
        c.device_id,
        c.device_id_source.describe(),
        super::counted(c.sources.len(), "source", "sources"),
        c.mqtt.host,
        c.mqtt.port
    );
    Ok(())
}
