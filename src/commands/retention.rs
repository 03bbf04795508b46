//! How long command records live, on a clock nobody can step.
//!
//! Its one rule: **a command record is never deleted because of a
//! wall-clock reading**. Boards without an RTC boot in 1970 and NTP steps
//! their clock forward and back; a record purged because the clock jumped
//! would let a redelivered command run a second time (I4).
//!
//! Ages are read on the [`AgentClock`]: milliseconds the agent has run,
//! monotonic within a run and carried over between runs (persisted in the
//! spool, and never below the newest receipt stamped with it). Time the
//! agent was not running is not counted, so an age on this clock is a lower
//! bound of the real age: records are kept too long, never too short.
//!
//! [`select`] decides which finished records to delete; it is pure and takes
//! the clock reading as an argument.

use std::time::{Duration, Instant};

/// Key of the persisted clock in the spool's `agent_state` table.
pub const CLOCK_STATE_KEY: &str = "commands_clock_ms";

/// The newest records kept whatever their age (answerable as duplicates
/// after any pause, e.g. a retained command delivered again weeks later).
pub const KEEP_NEWEST: usize = 100;

/// Records deleted per transaction.
pub const PURGE_BATCH: usize = 1000;

/// Milliseconds the agent has run, across runs.
#[derive(Debug, Clone)]
pub struct AgentClock {
    base_ms: i64,
    start: Instant,
}

impl AgentClock {
    /// Continue from `base_ms` (the persisted value, or the newest receipt
    /// stamp if that is later: the persisted value can lag by one purge
    /// interval after a crash).
    pub fn resume(base_ms: i64) -> AgentClock {
        AgentClock {
            base_ms: base_ms.max(0),
            start: Instant::now(),
        }
    }

    /// The current reading.
    pub fn now_ms(&self) -> i64 {
        self.at(Instant::now())
    }

    /// The reading at `t` (not before this run started).
    pub fn at(&self, t: Instant) -> i64 {
        let ran = t.saturating_duration_since(self.start).as_millis();
        self.base_ms
            .saturating_add(i64::try_from(ran).unwrap_or(i64::MAX))
    }
}

/// A finished record that may be deleted (the spool reads them).
pub use crate::spool::PurgeCandidate as Candidate;

/// What [`select`] enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The redelivery window: no record of a command that ran is deleted
    /// while younger than this on the [`AgentClock`].
    pub window: Duration,
    /// Records kept at most (`commands.max_records`).
    pub max_records: usize,
}

impl Policy {
    /// Below this many records after a purge forced by the cap, so the next
    /// purge is not due at the very next command.
    pub fn low_water(&self) -> usize {
        self.max_records - self.max_records / 10
    }
}

/// Which records to delete, oldest receipt first.
///
/// - `cands`: finished records that are candidates (older than the window
///   or `rejected`), in receipt order (rowid ascending).
/// - `total`: all records, unfinished ones included.
/// - `newest_kept_from`: the rowid of the [`KEEP_NEWEST`]-th newest record;
///   it and newer ones are never deleted.
/// - `now_ms`: the [`AgentClock`] reading.
///
/// Rules: a record older than the window goes; when the total is at or
/// above `max_records` (no room for the next receipt), `rejected` records go
/// too, oldest first, until the total is down to [`Policy::low_water`]. A record of a command that ran and is
/// inside the window is never deleted.
pub fn select(
    cands: &[Candidate],
    total: usize,
    newest_kept_from: i64,
    now_ms: i64,
    p: &Policy,
) -> Vec<i64> {
    let window = i64::try_from(p.window.as_millis()).unwrap_or(i64::MAX);
    let aged = |c: &Candidate| now_ms.saturating_sub(c.received_clock_ms) >= window;
    let eligible = cands.iter().filter(|c| c.rowid < newest_kept_from);
    let mut out: Vec<i64> = eligible
        .clone()
        .filter(|c| aged(c))
        .map(|c| c.rowid)
        .collect();
    let mut left = total.saturating_sub(out.len());
    if left >= p.max_records {
        for c in eligible.filter(|c| c.rejected && !aged(c)) {
            if left <= p.low_water() {
                break;
            }
            out.push(c.rowid);
            left -= 1;
        }
        out.sort_unstable();
    }
    out
}

/// Below this many records after room was made under a cap of `cap`, so
/// the next eviction is not due at the very next command: a tenth below
/// (at least one).
pub fn low_water_of(cap: usize) -> usize {
    cap.saturating_sub((cap / 10).max(1))
}

/// Which records to delete so that a tier whose share of the records is
/// `cap` ([`super::admission::Tier::cap`]) finds room, oldest first.
///
/// - `droppable`: rowids of finished records whose deletion cannot let
///   anything run twice (`rejected`, or a built-in without a side effect),
///   older than the [`KEEP_NEWEST`] newest records, oldest first;
/// - `total`: all records, unfinished ones included.
///
/// Nothing goes while `total` is below `cap`; at or above it, droppable
/// records go until the total is down to [`low_water_of`] `cap`. Records of
/// commands that ran with a side effect are never among `droppable`, so
/// none of them is deleted here, whatever its age.
pub fn evict(droppable: &[i64], total: usize, cap: usize) -> Vec<i64> {
    if total < cap {
        return Vec::new();
    }
    let excess = total - low_water_of(cap);
    droppable.iter().copied().take(excess).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: i64 = 3_600_000;

    fn policy() -> Policy {
        Policy {
            window: Duration::from_secs(3600),
            max_records: 10,
        }
    }

    fn c(rowid: i64, received_clock_ms: i64, rejected: bool) -> Candidate {
        Candidate {
            rowid,
            received_clock_ms,
            rejected,
        }
    }

    #[test]
    fn records_older_than_the_window_on_the_agent_clock_are_deleted() {
        let cands = [c(1, 0, false), c(2, HOUR, false), c(3, 2 * HOUR, false)];
        assert_eq!(select(&cands, 3, 100, 2 * HOUR, &policy()), vec![1, 2]);
        // Under the cap and inside the window: nothing goes.
        assert_eq!(
            select(&cands, 3, 100, HOUR - 1, &policy()),
            Vec::<i64>::new()
        );
    }

    #[test]
    fn a_record_of_a_command_that_ran_is_kept_inside_the_window_even_over_the_cap() {
        let cands: Vec<Candidate> = (1..=50).map(|r| c(r, 10 * HOUR, false)).collect();
        assert!(select(&cands, 50, 1000, 10 * HOUR + 1, &policy()).is_empty());
    }

    #[test]
    fn over_the_cap_the_oldest_rejected_records_go_first_down_to_the_low_water_mark() {
        let mut cands: Vec<Candidate> = (1..=20).map(|r| c(r, 5 * HOUR, r % 2 == 0)).collect();
        cands.push(c(21, 0, false)); // aged: goes whatever the cap
        let out = select(&cands, 30, 1000, 5 * HOUR, &policy());
        // 30 records, 1 aged -> 29; then every rejected one (10) -> 19, still
        // above the low water mark, but nothing else may go.
        let mut want: Vec<i64> = (1..=20).filter(|r| r % 2 == 0).collect();
        want.push(21);
        assert_eq!(out, want);
        let rejected: Vec<Candidate> = (1..=20).map(|r| c(r, 5 * HOUR, true)).collect();
        let out = select(&rejected, 12, 1000, 5 * HOUR, &policy());
        assert_eq!(out, vec![1, 2, 3], "down to 9 = 10 - 10/10");
    }

    #[test]
    fn at_the_cap_rejected_records_make_room_for_the_next_receipt() {
        let rejected: Vec<Candidate> = (1..=20).map(|r| c(r, 5 * HOUR, true)).collect();
        assert_eq!(select(&rejected, 10, 1000, 5 * HOUR, &policy()), vec![1]);
        assert!(select(&rejected, 9, 1000, 5 * HOUR, &policy()).is_empty());
    }

    #[test]
    fn at_a_tiers_cap_droppable_records_go_oldest_first_to_a_tenth_below() {
        let droppable: Vec<i64> = (1..=500).collect();
        assert!(evict(&droppable, 749, 750).is_empty(), "below the cap");
        // 750 records at a cap of 750: down to 675.
        assert_eq!(evict(&droppable, 750, 750), (1..=75).collect::<Vec<_>>());
        // Above the cap (another tier filled it): down to 675 as well.
        assert_eq!(evict(&droppable, 1000, 750).len(), 325);
        // Fewer droppable records than the excess: all of them, no more.
        assert_eq!(evict(&[3, 9], 1000, 750), vec![3, 9]);
        assert!(evict(&[], 1000, 750).is_empty());
        assert_eq!(low_water_of(5), 4, "at least one below");
        assert_eq!(low_water_of(0), 0);
    }

    #[test]
    fn the_newest_records_are_kept_whatever_their_age() {
        let cands: Vec<Candidate> = (1..=5).map(|r| c(r, 0, true)).collect();
        assert_eq!(select(&cands, 50, 4, 100 * HOUR, &policy()), vec![1, 2, 3]);
    }

    #[test]
    fn the_agent_clock_continues_from_its_persisted_value_and_never_runs_backwards() {
        let clock = AgentClock::resume(5 * HOUR);
        let a = clock.now_ms();
        let b = clock.now_ms();
        assert!(a >= 5 * HOUR && b >= a);
        assert!(AgentClock::resume(-7).now_ms() >= 0);
        let before_the_run = Instant::now();
        let clock = AgentClock::resume(HOUR);
        assert_eq!(clock.at(before_the_run), HOUR);
    }
}
