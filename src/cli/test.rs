//! `edgespool test --config FILE [--set k=v]...` (and its alias
//! `check-config FILE --sample`): one reading from every source printed as
//! it would be sent, every listener's bind checked, nothing written (the
//! work is in [`crate::cli::trial`]).
//!
//! Exit codes: 0 every source gave a reading (or takes none: an mqtt
//! source; or has no rows yet: a followed replay), every listener can
//! bind (and `ingest.socket_group` exists) and `run` would accept the
//! spool's directory and file;
//! 1 a source, listener or the spool's place failed (each named on stderr,
//! then one summary line naming them all); 2 the config is invalid (the key
//! named).

use super::spec::TEST;
use super::{args, help, load_config, Failure, Outcome};

/// Loads the config and runs [`report`].
pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &TEST)? else {
        return help::print(&TEST);
    };
    let config = a
        .config
        .ok_or_else(|| Failure::usage_of(&TEST, "--config FILE is required"))?;
    let cfg = load_config(&config, &a.sets)?;
    if report(&cfg, &config) {
        Ok(())
    } else {
        Err(Failure::Failed)
    }
}

/// Prints each source's reading on stdout, as
/// `source NAME (sources[N]) -> TOPIC (B bytes)` then the JSON envelope
/// on the next line, indented; each failure on stderr as
/// `source NAME (sources[N]): no reading: ERROR`, and each listener that
/// cannot bind as `listener KEY: ERROR`; then the spool's directories and
/// file judged exactly as `run` judges them ([`crate::agent::check_places`],
/// for this process's uid). Ends with one line on stderr naming every
/// failure. True if nothing failed.
pub fn report(cfg: &crate::config::Config, config_file: &std::path::Path) -> bool {
    let mut failed = Vec::new();
    let results = crate::cli::trial::sample_sources(cfg);
    for r in &results {
        match &r.outcome {
            Ok(crate::cli::trial::Taken::Reading(shown)) => {
                println!(
                    "source {} ({}) -> {} ({} bytes)\n  {}",
                    r.name, r.key, shown.topic, shown.payload_bytes, shown.json
                );
            }
            Ok(
                crate::cli::trial::Taken::NoSample(what)
                | crate::cli::trial::Taken::NoRowsYet(what),
            ) => {
                println!("source {} ({}): {what}", r.name, r.key);
            }
            Err(e) => {
                eprintln!("source {} ({}): no reading: {e}", r.name, r.key);
                failed.push(format!("source {}", r.name));
            }
        }
    }
    for l in crate::cli::trial::listeners(cfg) {
        match crate::cli::trial::try_bind(&l) {
            Ok(()) => println!("listener {}: can bind", l.key()),
            Err(e) => {
                eprintln!("listener {}: {e}", l.key());
                failed.push(format!("listener {}", l.key()));
            }
        }
    }
    if !spool_place(cfg, config_file) {
        failed.push("directories (as run judges them)".to_owned());
    }
    if failed.is_empty() {
        println!("test: ok ({}; nothing was written)", counts(&results));
        return true;
    }
    eprintln!("test: {} failed: {}", failed.len(), failed.join(", "));
    false
}

/// Whether `run` would accept the spool's place, told as `spool
/// directory DIR: run can use it as uid N` on stdout or `run would
/// refuse: WHY` (run's own sentence) on stderr. Checked as root, a line
/// says how to check as the service's user (the packaged unit runs the
/// agent as `edgespool`).
fn spool_place(cfg: &crate::config::Config, config_file: &std::path::Path) -> bool {
    let me = crate::os::fsguard::files::euid();
    let as_root = match me {
        0 => " (checked as root: `sudo -u edgespool edgespool test ...` checks as the packaged service's user)",
        _ => "",
    };
    let dir = cfg
        .spool
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    match crate::agent::check_places(cfg, config_file) {
        Ok(()) => {
            println!(
                "spool directory {}: run can use it as uid {me}{as_root}",
                dir.display()
            );
            true
        }
        Err(e) => {
            eprintln!("run would refuse: {e}{as_root}");
            false
        }
    }
}

/// `N sources gave a reading`, then `, M take none (mqtt)` and `, K have no
/// rows yet (follow)` when there are such sources.
fn counts(results: &[crate::cli::trial::SourceResult]) -> String {
    use crate::cli::trial::Taken;
    let count = |f: fn(&Taken) -> bool| {
        results
            .iter()
            .filter(|r| r.outcome.as_ref().is_ok_and(f))
            .count()
    };
    let readings = count(|t| matches!(t, Taken::Reading(_)));
    let none = count(|t| matches!(t, Taken::NoSample(_)));
    let waiting = count(|t| matches!(t, Taken::NoRowsYet(_)));
    let mut out = format!(
        "{} gave a reading",
        super::counted(readings, "source", "sources")
    );
    if none > 0 {
        out.push_str(&format!(
            ", {}",
            super::counted(none, "takes none (mqtt)", "take none (mqtt)")
        ));
    }
    if waiting > 0 {
        let rows = super::counted(
            waiting,
            "has no rows yet (follow)",
            "have no rows yet (follow)",
        );
        out.push_str(&format!(", {rows}"));
    }
    out
}
