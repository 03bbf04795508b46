//! `edgespool run`: the agent, from its config (or the last-known-good copy
//! of it) to a clean stop. The work is in [`crate::agent`].

use super::spec::RUN;
use super::{args, help, Failure, Outcome, LOG_TARGET};
use crate::agent::{AgentError, ConfigSource};

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &RUN)? else {
        return help::print(&RUN);
    };
    let config = a
        .config
        .ok_or_else(|| Failure::usage_of(&RUN, "--config FILE is required"))?;
    let loaded = crate::config::file::load_at_start(&config, &a.sets).map_err(|e| {
        // Under systemd stderr is the journal: this goes through the log, as
        // everything the agent says does, to carry its priority.
        log::error!(
            target: LOG_TARGET,
            "{} (and no usable last-known-good copy {} to run instead: the agent keeps one of each config it started with)",
            e.told(),
            crate::config::file::last_good_path(&config).display()
        );
        Failure::Invalid
    })?;
    let source = ConfigSource {
        path: config,
        sets: a.sets,
        fallback: loaded.fallback,
        check_spool: a.check_spool,
    };
    // A damaged spool found after start: once more, which moves it
    // aside (in this process: no restart by the supervisor needed).
    for _ in 0..2 {
        match crate::agent::run(loaded.config.clone(), source.clone()) {
            Ok(()) => return Ok(()),
            Err(AgentError::Damaged(e)) => log::error!(target: LOG_TARGET, "{e}"),
            Err(e) => {
                log::error!(target: LOG_TARGET, "{e}");
                return Err(Failure::Failed);
            }
        }
    }
    Err(Failure::Failed)
}
