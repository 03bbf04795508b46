//! The clock anchor: the first time in a run that the kernel says time
//! sync vouches for the wall clock, one event on [`CLOCK_STREAM`] reads
//! both clocks at one instant ([`Anchor`]), so the fleet can move the
//! readings this boot took before it (their [`MonoStamp`]s) to true time.
//!
//! Its one rule: **an anchor is appended only while the kernel says the
//! wall clock is synchronized, and at most once a run**, as a `full`
//! event: it commits with an fsync, and goes out like any other row,
//! after an outage too. A second run in the same boot appends its own,
//! which agrees with the first unless someone stepped the clock between
//! them (the fleet then keeps the second aside).

use crate::event::clock::{Anchor, MonoStamp, Sync, CLOCK_STREAM};
use crate::spool::NewEvent;
use std::time::{Duration, Instant};

/// How often the kernel is asked while no anchor has been appended.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Whether this run still owes its anchor, and when to look next.
#[derive(Debug)]
pub(super) struct ClockWatch {
    anchored: bool,
    next_check: Option<Instant>,
}

impl ClockWatch {
    pub(super) fn new() -> ClockWatch {
        ClockWatch {
            anchored: false,
            next_check: None,
        }
    }

    /// Whether to ask the kernel now.
    pub(super) fn due(&self, now: Instant) -> bool {
        !self.anchored && self.next_check.is_none_or(|t| now >= t)
    }

    /// The anchor event to append, given what the kernel said (`sync`) and
    /// both clocks read right after (`wall`: Unix ms and whether it is past
    /// the floor; `stamp`: this boot's monotonic clock), at `now`. `None`:
    /// not yet (asked again after [`CHECK_EVERY`]), or never in this run
    /// (no boot id or `CLOCK_BOOTTIME`: no reading carries a stamp either).
    pub(super) fn anchor(
        &mut self,
        sync: Sync,
        wall: (i64, bool),
        stamp: Option<MonoStamp>,
        now: Instant,
    ) -> Option<NewEvent> {
        self.next_check = Some(now + CHECK_EVERY);
        let Sync::Synchronized { maxerror_us } = sync else {
            return None;
        };
        let (wall_ms, trusted) = wall;
        if !trusted {
            return None;
        }
        self.anchored = true;
        let at = stamp?;
        let anchor = Anchor { at, wall_ms };
        log::info!(
            "clock: time sync vouches for the wall clock (max error {maxerror_us} µs); \
             anchor for boot {} at {} ms since boot appended on stream {CLOCK_STREAM}",
            at.boot_id.simple(),
            at.mono_ms
        );
        let mut ev = NewEvent::new(CLOCK_STREAM, wall_ms, true, anchor.fields(maxerror_us));
        ev.mono = Some(Box::new(at));
        Some(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::clock::BootId;
    use crate::event::reading::FieldValue;

    const STAMP: MonoStamp = MonoStamp {
        boot_id: BootId([3; 16]),
        mono_ms: 90_000,
    };
    const SYNCED: Sync = Sync::Synchronized { maxerror_us: 4000 };
    const WALL: (i64, bool) = (1_796_000_000_000, true);

    #[test]
    fn no_anchor_until_the_kernel_says_synchronized_then_exactly_one() {
        let t0 = Instant::now();
        let mut w = ClockWatch::new();
        assert!(w.due(t0));
        let off = Sync::Unsynchronized {
            maxerror_us: 16_000_000,
        };
        assert!(w.anchor(off, WALL, Some(STAMP), t0).is_none());
        assert!(
            !w.due(t0 + Duration::from_millis(500)),
            "asked once a second"
        );
        assert!(w.due(t0 + CHECK_EVERY));
        assert!(w.anchor(Sync::Unknown, WALL, Some(STAMP), t0).is_none());
        let ev = w
            .anchor(SYNCED, WALL, Some(STAMP), t0 + CHECK_EVERY)
            .expect("anchor");
        assert_eq!((ev.stream.as_str(), ev.ts_ms), (CLOCK_STREAM, WALL.0));
        assert!(ev.clock_trusted);
        assert_eq!(ev.mono.as_deref(), Some(&STAMP));
        assert_eq!(ev.fields[2].1, FieldValue::Num(WALL.0 as f64));
        assert!(!w.due(t0 + Duration::from_secs(3600)), "once a run");
    }

    #[test]
    fn a_synchronized_kernel_with_a_clock_before_the_floor_is_not_believed() {
        let mut w = ClockWatch::new();
        let t0 = Instant::now();
        assert!(w.anchor(SYNCED, (5_000, false), Some(STAMP), t0).is_none());
        assert!(w.due(t0 + CHECK_EVERY));
    }

    #[test]
    fn without_a_monotonic_stamp_there_is_no_anchor_and_no_more_asking() {
        let mut w = ClockWatch::new();
        let t0 = Instant::now();
        assert!(w.anchor(SYNCED, WALL, None, t0).is_none());
        assert!(!w.due(t0 + Duration::from_secs(60)));
    }
}
