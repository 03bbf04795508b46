//! A time the board knows has passed, without a trusted wall clock: the
//! floor a command's signed deadline is judged against while the wall clock
//! is untrusted (a board without an RTC boots in 1970, or at the last time
//! fake-hwclock saved, before NTP).
//!
//! Its one rule: **only an operator's signature moves the floor, and only
//! upward**. An operator-signed command carries `issued_at_ms` under its
//! signature ([`super::signed`]): once its receipt is claimed, that time has
//! passed. Since then the agent has run for a while on the
//! [`super::retention::AgentClock`] (time the agent ran, monotonic, carried
//! over between runs), and real time has passed at least as much. So
//!
//! ```text
//! floor(clock) = max(issued_ms, offset_ms + clock)
//!   issued_ms = the newest operator-signed issued_at_ms accepted
//!   offset_ms = the largest issued_at_ms - (agent clock at its receipt)
//! ```
//!
//! is a lower bound of now (both parts only grow; the first holds even if
//! the agent clock lags after a crash). A replay of a signed command whose
//! record is gone (aged out past `record_retention_secs`, which is itself
//! judged on the agent clock) finds its deadline below the floor and is
//! answered `expired`, on a trusted clock or not.
//!
//! Both values live in the spool's `agent_state` ([`ISSUED_STATE_KEY`],
//! [`OFFSET_STATE_KEY`]) and are raised in the transaction that claims the
//! command's receipt ([`super::store::claim`]): no commit of their own, and
//! they outlive every command record. An unsigned command, or one signed
//! by no listed key, cannot move them.
//!
//! A signed `issued_at_ms` in the future is the operator's mistake, and it
//! would push the floor up and expire later commands while the clock is
//! untrusted. When the kernel says time sync vouches for the wall clock at
//! receipt, an issue time is counted at most [`MAX_ISSUED_AHEAD`] past it;
//! otherwise (no sync yet, or a clock restored by fake-hwclock, which can
//! be days behind) the operator's word is all the board has, and it is
//! taken as it is (docs/commands.md says what to do then): clamping to a
//! clock that is behind would lower the floor and let a replay run.

use std::time::Duration;

/// Key in `agent_state` of the newest operator-signed `issued_at_ms`
/// accepted, Unix ms (decimal text).
pub const ISSUED_STATE_KEY: &str = "commands_signed_issued_ms";

/// Key in `agent_state` of the largest `issued_at_ms` less the agent clock
/// at its receipt, ms (decimal text): the floor is this plus the agent
/// clock now.
pub const OFFSET_STATE_KEY: &str = "commands_signed_offset_ms";

/// How far past a synchronized wall clock a signed issue time is counted:
/// an operator's clock may run a little ahead of the board's (counting
/// less only lowers the floor).
pub const MAX_ISSUED_AHEAD: Duration = Duration::from_secs(60);

/// What one accepted operator-signed command raises the floor to
/// ([`TimeFloor::raise`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// Its issue time as counted, Unix ms.
    pub issued_ms: i64,
    /// That issue time less the agent clock at its receipt, ms.
    pub offset_ms: i64,
}

impl Mark {
    /// The mark of an operator-signed command issued at `issued_ms`,
    /// received at agent clock `clock_ms`; `synced_wall_ms` is the wall
    /// clock then (Unix ms) if time sync vouches for it, and the issue time
    /// is then counted at most [`MAX_ISSUED_AHEAD`] past it.
    pub fn of(issued_ms: i64, clock_ms: i64, synced_wall_ms: Option<i64>) -> Mark {
        let ahead = i64::try_from(MAX_ISSUED_AHEAD.as_millis()).unwrap_or(i64::MAX);
        let issued_ms = match synced_wall_ms {
            Some(wall) => issued_ms.min(wall.saturating_add(ahead)),
            None => issued_ms,
        };
        Mark {
            issued_ms,
            offset_ms: issued_ms.saturating_sub(clock_ms),
        }
    }
}

/// The floor: nothing known (a new or wiped spool), or the two values of
/// the module doc.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimeFloor {
    known: Option<Mark>,
}

impl TimeFloor {
    /// The floor stored as `issued_ms` and `offset_ms` (either missing:
    /// nothing known).
    pub fn new(issued_ms: Option<i64>, offset_ms: Option<i64>) -> TimeFloor {
        TimeFloor {
            known: issued_ms.zip(offset_ms).map(|(issued_ms, offset_ms)| Mark {
                issued_ms,
                offset_ms,
            }),
        }
    }

    /// Raise it by `m` (each value to the larger one).
    pub fn raise(&mut self, m: Mark) {
        let k = self.known.get_or_insert(m);
        k.issued_ms = k.issued_ms.max(m.issued_ms);
        k.offset_ms = k.offset_ms.max(m.offset_ms);
    }

    /// The floor at agent clock `clock_ms`: Unix ms that have certainly
    /// passed; `None` when nothing is known.
    pub fn at(&self, clock_ms: i64) -> Option<i64> {
        self.known
            .map(|k| k.issued_ms.max(k.offset_ms.saturating_add(clock_ms)))
    }

    /// Why a command whose signed deadline (`issued_at_ms` + its TTL) is
    /// `deadline_ms` may no longer run at agent clock `clock_ms`, if so:
    /// the deadline is before the floor.
    pub fn expired(&self, deadline_ms: i64, clock_ms: i64) -> Option<String> {
        let floor = self.at(clock_ms)?;
        (deadline_ms < floor).then(|| {
            format!(
                "expired: the deadline (issued_at_ms + ttl_secs, \
                 {deadline_ms}) is before {floor}, a time this board knows has passed (the newest \
                 operator-signed issued_at_ms it accepted, plus the time the agent has run since), \
                 whatever the wall clock says; \
                 not run"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000;
    const MIN: i64 = 60_000;

    #[test]
    fn nothing_known_expires_nothing() {
        let f = TimeFloor::default();
        assert_eq!(f.at(5 * MIN), None);
        assert_eq!(f.expired(0, 5 * MIN), None);
        assert_eq!(TimeFloor::new(Some(T0), None), f);
    }

    #[test]
    fn the_floor_is_the_newest_issue_time_carried_forward_by_the_agent_clock() {
        let mut f = TimeFloor::default();
        // A issued at t0, received at agent clock 1 min; B issued ten
        // minutes later, received at 3 min.
        f.raise(Mark::of(T0, MIN, None));
        f.raise(Mark::of(T0 + 10 * MIN, 3 * MIN, None));
        assert_eq!(f.at(3 * MIN), Some(T0 + 10 * MIN));
        // An hour of running later, an hour more has passed at least.
        assert_eq!(f.at(63 * MIN), Some(T0 + 70 * MIN));
        // The agent clock lagging after a crash never takes it below B.
        assert_eq!(f.at(0), Some(T0 + 10 * MIN));
        // A's deadline (t0 + 60 s) is past; one ten minutes after B is not.
        assert!(f.expired(T0 + MIN, 3 * MIN).is_some());
        assert_eq!(f.expired(T0 + 20 * MIN, 3 * MIN), None);
        // An older command received later lowers nothing.
        f.raise(Mark::of(T0 - 60 * MIN, 4 * MIN, None));
        assert_eq!(f.at(3 * MIN), Some(T0 + 10 * MIN));
    }

    #[test]
    fn a_single_command_expires_itself_once_it_has_aged_past_its_ttl_on_the_agent_clock() {
        let mut f = TimeFloor::default();
        f.raise(Mark::of(T0, 5 * MIN, None));
        let deadline = T0 + MIN;
        assert_eq!(f.expired(deadline, 5 * MIN + 30_000), None);
        assert!(f.expired(deadline, 6 * MIN + 1).is_some());
    }

    #[test]
    fn a_future_issue_time_counts_at_most_a_minute_past_a_synchronized_clock() {
        let far = T0 + 365 * 24 * 60 * MIN;
        let m = Mark::of(far, MIN, Some(T0));
        assert_eq!(m.issued_ms, T0 + MIN);
        assert_eq!(m.offset_ms, T0);
        // Behind the synchronized clock, or with no clock to trust: as
        // signed.
        assert_eq!(Mark::of(T0 - MIN, 0, Some(T0)).issued_ms, T0 - MIN);
        assert_eq!(Mark::of(far, MIN, None).issued_ms, far);
    }
}
