//! The command thread's repeated log lines, kept few: a sender flooding
//! the command topic with bad messages, or a disk that stays full, must not
//! flood the log too.
//!
//! Its one rule: **a line of one kind is written at most once per
//! interval** ([`Quiet`]: 30 s, with a count of the ones left out;
//! [`ErrorLog`]: 30 s across every spool error of the thread).

use crate::spool::SpoolError;
use std::time::{Duration, Instant};

/// Repeated warnings of one kind are logged at most this often.
const QUIET_INTERVAL: Duration = Duration::from_secs(30);
/// Spool errors are logged at most this often.
const ERROR_INTERVAL: Duration = Duration::from_secs(30);

/// A warning logged at most once per [`QUIET_INTERVAL`], with a count of
/// the ones left out.
#[derive(Default)]
pub(super) struct Quiet {
    last: Option<Instant>,
    left_out: u64,
}

impl Quiet {
    /// Log `msg()` as a warning unless one was logged within the interval
    /// (then only count it).
    pub(super) fn warn(&mut self, msg: impl FnOnce() -> String) {
        if self.last.is_some_and(|t| t.elapsed() < QUIET_INTERVAL) {
            self.left_out += 1;
            return;
        }
        let more = match std::mem::take(&mut self.left_out) {
            0 => String::new(),
            n => format!(" ({n} more like it since the last line)"),
        };
        log::warn!("{}{more} (repeats logged every 30 s)", msg());
        self.last = Some(Instant::now());
    }
}

/// Spool errors of the command thread, logged at most once per
/// [`ERROR_INTERVAL`] whatever their kind (the ones between are dropped).
#[derive(Default)]
pub(super) struct ErrorLog {
    last: Option<Instant>,
}

impl ErrorLog {
    /// Log that `what` failed with `e`, unless an error was logged within
    /// the interval.
    pub(super) fn log(&mut self, what: &str, e: &SpoolError) {
        if self.last.is_none_or(|t| t.elapsed() > ERROR_INTERVAL) {
            log::error!("commands: {what}: {e} (repeats logged every 30 s)");
            self.last = Some(Instant::now());
        }
    }
}
