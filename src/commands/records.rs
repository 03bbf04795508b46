//! The command thread's book of its records: how many there are, when the
//! next purge runs, and the agent clock they are aged on, persisted.
//! Which records a purge deletes is [`super::retention`]'s rule; this file
//! only says when it runs.
//!
//! Its one rule: **a new command is refused for want of room only after a
//! purge has had its chance**: at `commands.max_records` a purge runs at
//! once if the last one freed something (rejected records go in batches),
//! else at most every [`PURGE_AT_CAP_INTERVAL`]; otherwise every
//! [`PURGE_INTERVAL`], each purge persisting the clock.

use super::quiet::ErrorLog;
use super::retention::{self, AgentClock, Policy};
use super::store;
use crate::envelope::wall_clock_ms;
use crate::spool::Spool;
use std::time::{Duration, Instant};

/// Records are purged and the agent clock persisted this often.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);
/// While records are at their cap, a purge is tried at most this often.
const PURGE_AT_CAP_INTERVAL: Duration = Duration::from_secs(5);

/// Command records as the command thread counts them.
pub(super) struct Records {
    clock: AgentClock,
    policy: Policy,
    /// Command records in the spool (refreshed at every purge).
    count: usize,
    last_purge: Option<Instant>,
    /// Records the last purge deleted.
    last_purge_freed: usize,
}

impl Records {
    /// Records aged on `clock`, kept as `policy` says; none counted until
    /// the first [`Records::purge`].
    pub(super) fn new(clock: AgentClock, policy: Policy) -> Records {
        Records {
            clock,
            policy,
            count: 0,
            last_purge: None,
            last_purge_freed: 0,
        }
    }

    /// The agent clock now, ms.
    pub(super) fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Records counted.
    pub(super) fn count(&self) -> usize {
        self.count
    }

    /// A receipt was committed: one record more.
    pub(super) fn added(&mut self) {
        self.count += 1;
    }

    /// How long until the next purge is due (zero when it is).
    pub(super) fn until_purge(&self) -> Duration {
        PURGE_INTERVAL.saturating_sub(self.last_purge.map_or(PURGE_INTERVAL, |t| t.elapsed()))
    }

    /// Whether the next purge is due.
    pub(super) fn purge_due(&self) -> bool {
        self.last_purge
            .is_none_or(|t| t.elapsed() >= PURGE_INTERVAL)
    }

    /// Delete what the retention policy allows, refresh the record count and
    /// persist the agent clock.
    pub(super) fn purge(&mut self, spool: &mut Spool, errors: &mut ErrorLog) {
        self.last_purge = Some(Instant::now());
        self.last_purge_freed = match store::purge(spool, self.clock.now_ms(), &self.policy) {
            Ok(n) => {
                if n > 0 {
                    log::debug!("commands: purged {n} command records");
                }
                n
            }
            Err(e) => {
                errors.log("purging command records", &e);
                0
            }
        };
        match spool.command_count() {
            Ok(n) => self.count = n,
            Err(e) => errors.log("counting command records", &e),
        }
        self.persist_clock(spool, errors);
    }

    /// Whether records are at `commands.max_records` even after a purge. A
    /// purge is tried at once if the last one freed something (rejected
    /// records go in batches down to the low-water mark), else at most every
    /// [`PURGE_AT_CAP_INTERVAL`].
    pub(super) fn full(&mut self, spool: &mut Spool, errors: &mut ErrorLog) -> bool {
        if self.count < self.policy.max_records {
            return false;
        }
        if self.last_purge_freed > 0
            || self
                .last_purge
                .is_none_or(|t| t.elapsed() >= PURGE_AT_CAP_INTERVAL)
        {
            self.purge(spool, errors);
        }
        self.count >= self.policy.max_records
    }

    /// Write the agent clock's reading to the spool, so the next run goes
    /// on from it.
    pub(super) fn persist_clock(&self, spool: &mut Spool, errors: &mut ErrorLog) {
        let now = self.clock.now_ms().to_string();
        if let Err(e) = spool.set_state(retention::CLOCK_STATE_KEY, &now, wall_clock_ms().0) {
            errors.log("persisting the command clock", &e);
        }
    }
}
