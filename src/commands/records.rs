//! The command thread's book of its records: how many there are, when the
//! next purge runs, and the agent clock they are aged on, persisted.
//! Which records a purge deletes is [`super::retention`]'s rule; this file
//! only says when it runs.
//!
//! Its one rule: **a new command is refused for want of room only after a
//! purge has had its chance**: at its tier's share of `commands.max_records`
//! ([`Tier::cap`]) a purge runs at once if the last one freed something
//! (aged records, then droppable ones, in batches:
//! [`store::make_room`]), else at most every [`PURGE_AT_CAP_INTERVAL`];
//! otherwise every [`PURGE_INTERVAL`].
//!
//! The agent clock is persisted at the stop and, while the agent runs, with
//! the writer's agent state (at most once a state period, riding a commit
//! the writer makes anyway): a purge with nothing to delete writes nothing,
//! so an idle command thread commits and syncs nothing (issue 35). After a
//! crash the clock resumes from the newest of the persisted reading and
//! the newest receipt's stamp ([`super::store::clock_ms`]), so it lags by
//! at most a state period and never runs backwards: ages read on it are
//! lower bounds, records are kept too long, never too short.

use super::admission::Tier;
use super::quiet::ErrorLog;
use super::retention::{self, AgentClock, Policy};
use super::store;
use crate::event::envelope::wall_clock_ms;
use crate::spool::Spool;
use std::time::{Duration, Instant};

/// Records are purged this often.
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
    /// Records the last purge (or the last making of room) deleted.
    last_purge_freed: usize,
    /// When room was last made at a cap.
    last_room: Option<Instant>,
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
            last_room: None,
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

    /// The records `tier` may fill ([`Tier::cap`] of `commands.max_records`).
    pub(super) fn cap(&self, tier: Tier) -> usize {
        tier.cap(self.policy.max_records)
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

    /// Delete what the retention policy allows and refresh the record count
    /// (with nothing to delete, nothing is written).
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
    }

    /// Whether records are at `tier`'s share of `commands.max_records` even
    /// after room was made. Room is made at once if the last purge freed
    /// something (records go in batches down to a tenth below the cap),
    /// else at most every [`PURGE_AT_CAP_INTERVAL`].
    pub(super) fn full(&mut self, tier: Tier, spool: &mut Spool, errors: &mut ErrorLog) -> bool {
        let cap = self.cap(tier);
        if self.count < cap {
            return false;
        }
        if self.last_purge_freed > 0
            || self
                .last_room
                .is_none_or(|t| t.elapsed() >= PURGE_AT_CAP_INTERVAL)
        {
            self.make_room(cap, spool, errors);
        }
        self.count >= cap
    }

    /// Purge what has aged, then delete droppable records down to a tenth
    /// below `cap` ([`store::make_room`]); refresh the count.
    fn make_room(&mut self, cap: usize, spool: &mut Spool, errors: &mut ErrorLog) {
        self.last_room = Some(Instant::now());
        self.purge(spool, errors);
        if self.count < cap {
            return;
        }
        match store::make_room(spool, cap) {
            Ok(n) => {
                if n > 0 {
                    log::debug!("commands: deleted {n} droppable command records to make room");
                }
                self.last_purge_freed += n;
            }
            Err(e) => errors.log("making room among command records", &e),
        }
        match spool.command_count() {
            Ok(n) => self.count = n,
            Err(e) => errors.log("counting command records", &e),
        }
    }

    /// Write the agent clock's reading to the spool, so the next run goes
    /// on from it (at the stop; while running, the writer's agent state
    /// carries it).
    pub(super) fn persist_clock(&self, spool: &mut Spool, errors: &mut ErrorLog) {
        let now = self.clock.now_ms().to_string();
        if let Err(e) = spool.set_state(retention::CLOCK_STATE_KEY, &now, wall_clock_ms().0) {
            errors.log("persisting the command clock", &e);
        }
    }
}
