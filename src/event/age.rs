//! How old a wall-clock stamp is, on a board whose clock may not have been
//! set when the stamp was read, or when it is read back.
//!
//! A board without a real-time clock boots in 1970 and steps its clock
//! once time sync sets it: a row, a run, a record stamped before then
//! carries a 1970 time, and "now less the stamp" is 56 years. A clock that
//! ran ahead and was stepped back leaves stamps in the future. Neither is
//! an age, and a field engineer reading one thinks the spool is broken.
//! `status` and the metrics judge every stamp they turn into an age here
//! ([`stamp_age`]), and say what the clock can say instead.
//!
//! Its one rule: **an age is told only between two readings of the same
//! kind of clock**: both past [`CLOCK_FLOOR_MS`] (a set clock), or both
//! before it (an unset clock ages by itself: it loses time across a
//! reboot, never gains it, so such an age is never longer than the true
//! one). A stamp before the floor read on a clock past it has no age, and
//! neither has one later than now by more than [`AHEAD_TOLERANCE_MS`].

use crate::event::envelope::CLOCK_FLOOR_MS;

/// How far a stamp may lie after now and still count as "just now", ms: a
/// time-sync step of a few seconds back at boot (chrony's `makestep`,
/// systemd-timesyncd) is no news; a larger one is shown as
/// [`StampAge::Ahead`].
pub const AHEAD_TOLERANCE_MS: i64 = 5_000;

/// What a wall-clock stamp's age is, seen at another wall-clock reading
/// ([`stamp_age`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampAge {
    /// `now - at`, ms, at least 0 (a stamp up to [`AHEAD_TOLERANCE_MS`]
    /// ahead is 0): both read on a set clock, or both on an unset one.
    Age(i64),
    /// The stamp was read before the clock was set (before
    /// [`CLOCK_FLOOR_MS`]) and now is past it: how long ago it was cannot
    /// be told from the stamp.
    BeforeClockSet,
    /// The stamp was read on a set clock and now is before the floor: the
    /// clock has gone back to 1970 since (a reboot without an RTC, not yet
    /// set by time sync).
    ClockNotSetNow,
    /// The stamp lies this many ms after now, more than
    /// [`AHEAD_TOLERANCE_MS`]: read on a clock that was ahead and has been
    /// stepped back since.
    Ahead(i64),
}

impl StampAge {
    /// The age in ms when there is one ([`StampAge::Age`]).
    pub fn ms(self) -> Option<i64> {
        match self {
            StampAge::Age(ms) => Some(ms),
            _ => None,
        }
    }
}

/// Whether a wall-clock reading (Unix ms) is of a set clock: not before
/// [`CLOCK_FLOOR_MS`].
pub fn clock_set(ms: i64) -> bool {
    ms >= CLOCK_FLOOR_MS
}

/// The age of a stamp read at `at_ms`, seen at `now_ms` (both Unix ms, of
/// the wall clock); also how long a span from `at_ms` to `now_ms` lasted
/// (a run's start and its end). See [`StampAge`].
pub fn stamp_age(at_ms: i64, now_ms: i64) -> StampAge {
    match (clock_set(at_ms), clock_set(now_ms)) {
        (false, true) => StampAge::BeforeClockSet,
        (true, false) => StampAge::ClockNotSetNow,
        _ => match now_ms.saturating_sub(at_ms) {
            d if d >= 0 => StampAge::Age(d),
            d if d >= -AHEAD_TOLERANCE_MS => StampAge::Age(0),
            d => StampAge::Ahead(d.saturating_neg()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SET: i64 = 1_790_000_000_000;

    #[test]
    fn stamps_of_a_set_clock_have_their_age() {
        assert_eq!(stamp_age(SET, SET + 12_000), StampAge::Age(12_000));
        assert_eq!(stamp_age(SET, SET), StampAge::Age(0));
        assert_eq!(stamp_age(SET + 12_000, SET + 12_000).ms(), Some(0));
        // On the floor itself the clock is set.
        assert_eq!(
            stamp_age(CLOCK_FLOOR_MS, CLOCK_FLOOR_MS + 1),
            StampAge::Age(1)
        );
    }

    #[test]
    fn a_stamp_from_1970_seen_on_a_set_clock_has_no_age() {
        // The board booted in 1970, appended, then time sync set the
        // clock: now less the stamp would be 56 years.
        let booted = 42_000;
        assert_eq!(stamp_age(booted, SET), StampAge::BeforeClockSet);
        assert_eq!(stamp_age(0, SET).ms(), None);
        assert_eq!(
            stamp_age(CLOCK_FLOOR_MS - 1, CLOCK_FLOOR_MS),
            StampAge::BeforeClockSet
        );
    }

    #[test]
    fn stamps_of_an_unset_clock_age_by_that_clock() {
        // Still in 1970: both on the same unset clock.
        assert_eq!(stamp_age(42_000, 102_000), StampAge::Age(60_000));
        // A reboot restarted the clock at 1970: the stamp of the last boot
        // lies ahead, and says so.
        assert_eq!(stamp_age(900_000, 60_000), StampAge::Ahead(840_000));
    }

    #[test]
    fn a_set_stamp_seen_on_a_clock_back_in_1970_says_so() {
        assert_eq!(stamp_age(SET, 60_000), StampAge::ClockNotSetNow);
    }

    #[test]
    fn a_stamp_ahead_of_now_is_just_now_within_the_tolerance_and_ahead_past_it() {
        assert_eq!(
            stamp_age(SET + AHEAD_TOLERANCE_MS, SET),
            StampAge::Age(0),
            "a small step back is no news"
        );
        assert_eq!(
            stamp_age(SET + AHEAD_TOLERANCE_MS + 1, SET),
            StampAge::Ahead(AHEAD_TOLERANCE_MS + 1)
        );
        // A clock a day ahead, stepped back.
        assert_eq!(
            stamp_age(SET + 86_400_000, SET),
            StampAge::Ahead(86_400_000)
        );
        // Extremes neither overflow nor panic.
        assert_eq!(stamp_age(i64::MAX, SET), StampAge::Ahead(i64::MAX - SET));
        assert_eq!(stamp_age(i64::MIN, SET), StampAge::BeforeClockSet);
        assert_eq!(stamp_age(i64::MIN, 0), StampAge::Age(i64::MAX));
    }
}
