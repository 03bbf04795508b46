//! The outage budget: how fast readings arrive, how long the spool can hold
//! an outage at that rate, how long the backlog takes to drain, and what
//! the flash is written per day. Pure arithmetic on samples the agent
//! takes; time is passed in.
//!
//! Its one rule: **a figure that was not measured is `None`, never a guess
//! and never a division by zero**. Rates are moving averages over a stated
//! window ([`Meter`]); the delivery rate is measured only while connected
//! and delivering, and the last measurement is kept (with when it was
//! taken) through an outage, when the current rate says nothing.
//!
//! Definitions (`window` is `agent.rate_window_secs`):
//! - ingest rate: readings committed to the spool per second, and their
//!   stored bytes (envelope payload + event id + digest) per second, per
//!   stream and in all, over the window;
//! - hold time: seconds until the spool's capacity policy refuses readings
//!   at the ingest rate ([`hold`]): against `spool.max_bytes` and against
//!   the `spool.min_free_bytes` reserve, whichever comes first;
//! - drain time: backlog rows / the last measured delivery rate
//!   ([`drain_secs`]); readings that keep arriving lengthen it;
//! - flash per day: bytes this process sent to the block layer per second
//!   over the window (`/proc/self/io` `write_bytes`), times 86,400.

use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// The window is kept as at most this many samples: a new sample closer
/// than `window / SLOTS` to the one before replaces it, so the oldest
/// sample is at most `window * (1 + 1/SLOTS)` plus one sampling interval
/// old, and memory stays fixed.
pub const SLOTS: usize = 32;

/// Shortest span (seconds) a rate is computed over; below it a rate is
/// "not measured yet".
pub const MIN_SPAN_SECS: f64 = 1.0;

/// Cumulative counts at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Monotonic time, seconds from any fixed origin.
    pub at_secs: f64,
    /// Wall clock, Unix ms (only reported, never computed with).
    pub wall_ms: i64,
    /// Per stream: (readings committed, stored bytes) since the meter began.
    pub streams: BTreeMap<String, (u64, u64)>,
    /// Rows retired (acknowledged) since the meter began.
    pub retired: u64,
    /// Bytes sent to the block layer since the meter began.
    pub write_bytes: u64,
    /// Connected to the broker at this moment.
    pub connected: bool,
    /// Rows not yet acknowledged at this moment (`Spool::backlog_estimate`).
    pub backlog: u64,
}

/// One stream's ingest rate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamRate {
    /// Readings per second.
    pub readings_per_sec: f64,
    /// Stored bytes per second.
    pub bytes_per_sec: f64,
}

/// The ingest rate over the window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IngestRate {
    /// Seconds the rate was measured over (up to the window, less while
    /// the agent has run for less).
    pub span_secs: f64,
    /// Readings per second, every stream.
    pub readings_per_sec: f64,
    /// Stored bytes per second, every stream.
    pub bytes_per_sec: f64,
    /// Per stream (streams with no reading in the window show 0).
    pub streams: BTreeMap<String, StreamRate>,
}

/// A delivery rate and when it was measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeliveryRate {
    /// Rows acknowledged per second.
    pub rows_per_sec: f64,
    /// Seconds it was measured over.
    pub span_secs: f64,
    /// Wall clock of the measurement's end, Unix ms.
    pub measured_at_ms: i64,
}

/// Moving averages over the last `window` seconds of [`Sample`]s.
#[derive(Debug, Clone)]
pub struct Meter {
    window_secs: f64,
    samples: VecDeque<Sample>,
    last_delivery: Option<DeliveryRate>,
    delivery_current: bool,
}

impl Meter {
    /// A meter over `window_secs` (at least [`MIN_SPAN_SECS`]).
    pub fn new(window_secs: f64) -> Meter {
        Meter {
            window_secs: window_secs.max(MIN_SPAN_SECS),
            samples: VecDeque::with_capacity(SLOTS + 4),
            last_delivery: None,
            delivery_current: false,
        }
    }

    /// The window, seconds.
    pub fn window_secs(&self) -> f64 {
        self.window_secs
    }

    /// Add a sample (its time at or after the last one's; an earlier one is
    /// ignored). Updates the delivery rate when one can be measured.
    pub fn record(&mut self, s: Sample) {
        if self.samples.back().is_some_and(|b| s.at_secs < b.at_secs) {
            return;
        }
        let spacing = self.window_secs / SLOTS as f64;
        let n = self.samples.len();
        // The newest sample becomes an anchor once it is `spacing` past the
        // one before it, or when it is the first of a connected (or
        // disconnected) run: the delivery rate needs where a connected run
        // begins. Until then
        // each new sample replaces it.
        let close = n >= 2
            && self
                .samples
                .get(n - 2)
                .zip(self.samples.back())
                .is_some_and(|(p, head)| {
                    head.at_secs - p.at_secs < spacing && head.connected == p.connected
                });
        if close {
            self.samples.pop_back();
        }
        self.samples.push_back(s);
        // Keep one sample at or before the window's start.
        while self
            .samples
            .get(1)
            .zip(self.samples.back())
            .is_some_and(|(second, last)| last.at_secs - second.at_secs >= self.window_secs)
        {
            self.samples.pop_front();
        }
        while self.samples.len() > SLOTS + 3 {
            self.samples.pop_front();
        }
        let measured = self.measure_delivery();
        self.delivery_current = measured.is_some();
        if measured.is_some() {
            self.last_delivery = measured;
        }
    }

    /// Oldest and newest sample, when they span at least [`MIN_SPAN_SECS`].
    fn ends(&self) -> Option<(&Sample, &Sample, f64)> {
        let (a, b) = (self.samples.front()?, self.samples.back()?);
        let span = b.at_secs - a.at_secs;
        (span >= MIN_SPAN_SECS).then_some((a, b, span))
    }

    /// The ingest rate; `None` before the samples span [`MIN_SPAN_SECS`].
    pub fn ingest(&self) -> Option<IngestRate> {
        let (a, b, span) = self.ends()?;
        let mut streams = BTreeMap::new();
        let (mut readings, mut bytes) = (0u64, 0u64);
        for (name, (r1, b1)) in &b.streams {
            let (r0, b0) = a.streams.get(name).copied().unwrap_or((0, 0));
            let (dr, db) = (r1.saturating_sub(r0), b1.saturating_sub(b0));
            readings += dr;
            bytes += db;
            streams.insert(
                name.clone(),
                StreamRate {
                    readings_per_sec: dr as f64 / span,
                    bytes_per_sec: db as f64 / span,
                },
            );
        }
        Some(IngestRate {
            span_secs: span,
            readings_per_sec: readings as f64 / span,
            bytes_per_sec: bytes as f64 / span,
            streams,
        })
    }

    /// Readings counted since the meter began (every stream).
    pub fn readings_total(&self) -> u64 {
        self.samples
            .back()
            .map_or(0, |b| b.streams.values().map(|(r, _)| r).sum())
    }

    /// Block-layer write bytes per second; `None` before the samples span
    /// [`MIN_SPAN_SECS`].
    pub fn write_bytes_per_sec(&self) -> Option<f64> {
        let (a, b, span) = self.ends()?;
        Some(b.write_bytes.saturating_sub(a.write_bytes) as f64 / span)
    }

    /// The delivery rate over the newest busy run in the window: samples
    /// connected throughout, each but the newest with rows waiting (the
    /// newest may have none: the backlog drained). A delivery rate is only
    /// a measure of what delivery can do while rows wait for it; idle
    /// spans would dilute it to the ingest rate.
    fn measure_delivery(&self) -> Option<DeliveryRate> {
        let b = self.samples.back().filter(|b| b.connected)?;
        let a = self
            .samples
            .iter()
            .rev()
            .skip(1)
            .take_while(|s| s.connected && s.backlog > 0)
            .last()?;
        let span = b.at_secs - a.at_secs;
        let rows = b.retired.saturating_sub(a.retired);
        (span >= MIN_SPAN_SECS && rows > 0).then_some(DeliveryRate {
            rows_per_sec: rows as f64 / span,
            span_secs: span,
            measured_at_ms: b.wall_ms,
        })
    }

    /// The last delivery rate measured (kept while offline or idle).
    pub fn delivery(&self) -> Option<DeliveryRate> {
        self.last_delivery
    }

    /// The newest sample measured the delivery rate (connected and
    /// delivering then), so [`Meter::delivery`] is current, not kept.
    pub fn delivery_current(&self) -> bool {
        self.delivery_current
    }
}

/// The spool's room, as the capacity policy judges it
/// ([`crate::flash::maintenance`]'s `capacity_check`), all in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Room {
    /// Live pages in the spool file.
    pub used_bytes: u64,
    /// `spool.max_bytes` (0: no bound).
    pub max_bytes: u64,
    /// Free bytes on the filesystem plus free pages inside the spool.
    pub free_bytes: u64,
    /// `spool.min_free_bytes`.
    pub reserve_bytes: u64,
    /// Rows in the spool (every state).
    pub rows: u64,
    /// Rows not yet acknowledged.
    pub backlog_rows: u64,
}

impl Room {
    /// What a row costs in the spool: live pages / rows, so the spool's
    /// fixed pages count too (on a nearly empty spool this overstates a
    /// row's cost and the hold time errs short). `None` with no rows.
    pub fn bytes_per_row(&self) -> Option<f64> {
        (self.rows > 0).then(|| self.used_bytes as f64 / self.rows as f64)
    }

    /// Bytes the capacity policy can free by dropping acknowledged rows
    /// (it drops them first when space is short; never an unacknowledged one).
    fn reclaimable(&self, per_row: f64) -> f64 {
        self.rows.saturating_sub(self.backlog_rows) as f64 * per_row
    }
}

/// Which bound refuses readings first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// `spool.max_bytes`.
    MaxBytes,
    /// `spool.min_free_bytes` on the spool's filesystem.
    FreeSpaceReserve,
}

/// How long the spool holds an outage.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hold {
    /// Seconds until `bound` refuses readings (0: it refuses now); `None`
    /// when nothing arrives (the spool does not grow).
    pub secs: Option<f64>,
    /// The bound reached first.
    pub bound: Bound,
    /// That bound's value, bytes (`max_bytes` or the reserve).
    pub bound_bytes: u64,
    /// Bytes left before it.
    pub room_bytes: f64,
    /// Spool growth assumed, bytes per second.
    pub growth_bytes_per_sec: f64,
}

/// Hold time at `readings_per_sec` readings costing `per_row` bytes each.
/// Room before `max_bytes` is `max_bytes - used + reclaimable`; before the
/// reserve `free + reclaimable - reserve`; acknowledged rows are
/// reclaimable because the policy drops them first. The smaller room wins.
pub fn hold(room: &Room, readings_per_sec: f64, per_row: f64) -> Hold {
    let growth = readings_per_sec.max(0.0) * per_row.max(0.0);
    let reclaim = room.reclaimable(per_row.max(0.0));
    let reserve_room = room.free_bytes as f64 + reclaim - room.reserve_bytes as f64;
    let mut best = (Bound::FreeSpaceReserve, room.reserve_bytes, reserve_room);
    if room.max_bytes > 0 {
        let bound_room = room.max_bytes as f64 - room.used_bytes as f64 + reclaim;
        if bound_room <= reserve_room {
            best = (Bound::MaxBytes, room.max_bytes, bound_room);
        }
    }
    let (bound, bound_bytes, left) = best;
    let left = left.max(0.0);
    let secs = if left == 0.0 {
        Some(0.0)
    } else if growth > 0.0 && growth.is_finite() {
        Some(left / growth)
    } else {
        None
    };
    Hold {
        secs,
        bound,
        bound_bytes,
        room_bytes: left,
        growth_bytes_per_sec: growth,
    }
}

/// Seconds to deliver `backlog` rows at `rows_per_sec`: 0 for no backlog,
/// `None` when the rate is not positive (no measurement to go by).
pub fn drain_secs(backlog: u64, rows_per_sec: f64) -> Option<f64> {
    if backlog == 0 {
        return Some(0.0);
    }
    (rows_per_sec > 0.0 && rows_per_sec.is_finite()).then(|| backlog as f64 / rows_per_sec)
}

/// Everything `status` and the metrics show of the outage budget.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budget {
    /// The rates' window, seconds (`agent.rate_window_secs`).
    pub window_secs: f64,
    /// `None`: not measured yet (the samples span under a second, or no
    /// reading has arrived this run).
    pub ingest: Option<IngestRate>,
    /// The room the hold time is judged on.
    pub spool: Room,
    /// Bytes a row costs in the spool ([`Room::bytes_per_row`]; with no
    /// rows, the ingest's stored bytes per reading); `None`: unknown.
    pub spool_bytes_per_row: Option<f64>,
    /// `None`: no ingest rate or row cost yet.
    pub hold: Option<Hold>,
    /// The last measured delivery rate; `None`: never measured this run.
    pub delivery: Option<DeliveryRate>,
    /// The delivery rate is from the newest sample (connected and
    /// delivering now), not kept from earlier.
    pub delivery_current: bool,
    /// Backlog / delivery rate, seconds; `None`: no delivery rate yet.
    pub drain_secs: Option<f64>,
    /// Projected flash writes, MB (10^6 bytes) per day; `None`: not measured yet.
    pub flash_mb_per_day: Option<f64>,
}

/// The budget from a meter's rates and the spool's room now.
pub fn budget(m: &Meter, room: Room) -> Budget {
    // No reading yet this run: a rate of 0 would claim the spool never fills.
    let ingest = m.ingest().filter(|_| m.readings_total() > 0);
    let per_row = room.bytes_per_row().or_else(|| {
        ingest
            .as_ref()
            .filter(|i| i.readings_per_sec > 0.0)
            .map(|i| i.bytes_per_sec / i.readings_per_sec)
    });
    let hold = ingest
        .as_ref()
        .zip(per_row)
        .map(|(i, p)| hold(&room, i.readings_per_sec, p));
    let delivery = m.delivery();
    Budget {
        window_secs: m.window_secs(),
        spool_bytes_per_row: per_row,
        hold,
        delivery,
        delivery_current: m.delivery_current(),
        drain_secs: match delivery {
            Some(d) => drain_secs(room.backlog_rows, d.rows_per_sec),
            None if room.backlog_rows == 0 => Some(0.0),
            None => None,
        },
        flash_mb_per_day: m.write_bytes_per_sec().map(|b| b * 86_400.0 / 1e6),
        ingest,
        spool: room,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: f64, pump: (u64, u64), retired: u64, connected: bool) -> Sample {
        Sample {
            at_secs: at,
            wall_ms: (at * 1000.0) as i64,
            streams: BTreeMap::from([("pump".to_owned(), pump)]),
            retired,
            write_bytes: (at * 1000.0) as u64,
            connected,
            backlog: 1,
        }
    }

    fn room() -> Room {
        Room {
            used_bytes: 1_000_000,
            max_bytes: 2_000_000,
            free_bytes: 10_000_000,
            reserve_bytes: 1_000_000,
            rows: 1000,
            backlog_rows: 1000,
        }
    }

    #[test]
    fn no_samples_or_a_span_under_a_second_is_not_measured_yet() {
        let mut m = Meter::new(60.0);
        assert!(m.ingest().is_none());
        m.record(sample(0.0, (0, 0), 0, true));
        m.record(sample(0.5, (5, 500), 0, true));
        assert!(m.ingest().is_none());
        assert!(m.write_bytes_per_sec().is_none());
        let b = budget(&m, Room::default());
        assert!(b.ingest.is_none() && b.hold.is_none() && b.flash_mb_per_day.is_none());
        assert_eq!(b.drain_secs, Some(0.0), "no backlog drains at once");
    }

    #[test]
    fn no_reading_yet_this_run_is_not_measured_yet_rather_than_zero() {
        let mut m = Meter::new(10.0);
        for i in 0..20 {
            m.record(sample(i as f64, (0, 0), 0, true));
        }
        assert_eq!(m.ingest().map(|r| r.readings_per_sec), Some(0.0));
        let b = budget(&m, room());
        assert!(b.ingest.is_none() && b.hold.is_none(), "{b:?}");
        // Once readings came, a quiet spell is a measured 0: no growth.
        m.record(sample(20.0, (5, 500), 0, true));
        for i in 21..60 {
            m.record(sample(i as f64, (5, 500), 0, true));
        }
        let b = budget(&m, room());
        assert_eq!(b.ingest.map(|r| r.readings_per_sec), Some(0.0));
        assert_eq!(b.hold.map(|h| h.secs), Some(None));
    }

    #[test]
    fn the_ingest_rate_is_the_count_over_the_span_within_the_window() {
        let mut m = Meter::new(10.0);
        // 20 readings/s, 100 bytes each, sampled every 0.1 s for 30 s.
        for i in 0..=300u64 {
            m.record(sample(i as f64 / 10.0, (2 * i, 200 * i), 0, true));
        }
        let r = m.ingest().expect("measured");
        let most = 10.0 * (1.0 + 1.0 / SLOTS as f64) + 0.1 + 1e-9;
        assert!((10.0..=most).contains(&r.span_secs), "{r:?}");
        assert!((r.readings_per_sec - 20.0).abs() < 1e-9, "{r:?}");
        assert!((r.bytes_per_sec - 2000.0).abs() < 1e-9, "{r:?}");
        assert!((r.streams["pump"].readings_per_sec - 20.0).abs() < 1e-9);
        assert!(m.samples.len() <= SLOTS + 3, "memory stays fixed");
        // 1000 write bytes per second -> 86.4 MB/day.
        let mb = budget(&m, room()).flash_mb_per_day.expect("flash");
        assert!((mb - 86.4).abs() < 1e-6, "{mb}");
    }

    #[test]
    fn a_rate_change_is_seen_once_the_window_has_passed() {
        let mut m = Meter::new(10.0);
        let mut n = 0;
        for i in 0..=200u64 {
            n += if i <= 100 { 10 } else { 1 };
            m.record(sample(i as f64 / 10.0, (n, n), 0, true));
        }
        // 100 readings/s for 10 s, then 10/s for 10 s: only the last counts.
        let r = m.ingest().expect("measured");
        assert!((r.readings_per_sec - 10.0).abs() < 3.0, "{r:?}");
    }

    #[test]
    fn the_delivery_rate_offline_is_the_last_one_measured_with_its_time() {
        let mut m = Meter::new(10.0);
        for i in 0..=50u64 {
            m.record(sample(i as f64 / 10.0, (0, 0), 70 * i / 10, true));
        }
        let d = m.delivery().expect("measured");
        assert!((d.rows_per_sec - 70.0).abs() < 1.0, "{d:?}");
        assert_eq!(d.measured_at_ms, 5000);
        for i in 51..=300u64 {
            m.record(sample(i as f64 / 10.0, (0, 0), 350, false));
        }
        assert_eq!(m.delivery(), Some(d), "kept through the outage");
        let b = budget(
            &m,
            Room {
                backlog_rows: 12_000,
                ..room()
            },
        );
        assert!(!b.delivery_current);
        let drain = b.drain_secs.expect("drain");
        assert!((drain - 12_000.0 / d.rows_per_sec).abs() < 1e-6);
        // Back online: connected and delivering replaces it.
        m.record(sample(30.1, (0, 0), 350, true));
        m.record(sample(32.1, (0, 0), 550, true));
        let d2 = m.delivery().expect("measured again");
        assert!((d2.rows_per_sec - 100.0).abs() < 1e-6, "{d2:?}");
        assert!(budget(&m, room()).delivery_current);
    }

    #[test]
    fn connected_but_idle_keeps_the_last_delivery_rate() {
        let mut m = Meter::new(10.0);
        m.record(sample(0.0, (0, 0), 0, true));
        // The backlog drained by the second sample.
        m.record(Sample {
            backlog: 0,
            ..sample(2.0, (0, 0), 20, true)
        });
        let d = m.delivery().expect("10 rows/s");
        assert!((d.rows_per_sec - 10.0).abs() < 1e-9, "{d:?}");
        for i in 3..40 {
            m.record(Sample {
                backlog: 0,
                ..sample(i as f64, (0, 0), 20, true)
            });
        }
        assert_eq!(m.delivery(), Some(d), "idle spans do not dilute it");
        assert!(!m.delivery_current());
    }

    #[test]
    fn hold_time_against_the_bytes_bound() {
        // 1 MB of 2 MB used, all unacknowledged; 10 readings/s of 1000 B.
        let h = hold(&room(), 10.0, 1000.0);
        assert_eq!(h.bound, Bound::MaxBytes);
        assert_eq!(h.secs, Some(100.0));
        assert_eq!(h.bound_bytes, 2_000_000);
    }

    #[test]
    fn acknowledged_rows_count_as_room_because_they_are_dropped_first() {
        let r = Room {
            backlog_rows: 500,
            ..room()
        };
        // 500 acknowledged rows of 1000 B are 0.5 MB more room.
        assert_eq!(hold(&r, 10.0, 1000.0).secs, Some(150.0));
    }

    #[test]
    fn hold_time_against_the_free_space_reserve() {
        let r = Room {
            free_bytes: 1_500_000,
            ..room()
        };
        let h = hold(&r, 10.0, 1000.0);
        assert_eq!(h.bound, Bound::FreeSpaceReserve);
        assert_eq!(h.secs, Some(50.0));
        // No max_bytes: only the reserve bounds it.
        let r = Room {
            max_bytes: 0,
            ..room()
        };
        let h = hold(&r, 10.0, 1000.0);
        assert_eq!(h.bound, Bound::FreeSpaceReserve);
        assert_eq!(h.secs, Some(900.0));
    }

    #[test]
    fn no_growth_holds_without_a_bound_and_a_full_spool_holds_nothing() {
        assert_eq!(hold(&room(), 0.0, 1000.0).secs, None);
        assert_eq!(hold(&room(), 10.0, 0.0).secs, None);
        let full = Room {
            used_bytes: 2_500_000,
            ..room()
        };
        let h = hold(&full, 0.0, 1000.0);
        assert_eq!((h.secs, h.bound), (Some(0.0), Bound::MaxBytes));
        assert_eq!(h.room_bytes, 0.0);
    }

    #[test]
    fn drain_time_is_backlog_over_rate_and_never_divides_by_zero() {
        assert_eq!(drain_secs(12_000, 70.0), Some(12_000.0 / 70.0));
        assert_eq!(drain_secs(0, 0.0), Some(0.0));
        assert_eq!(drain_secs(5, 0.0), None);
        assert_eq!(drain_secs(5, f64::NAN), None);
        let b = budget(&Meter::new(10.0), room());
        assert_eq!(b.drain_secs, None, "backlog and no delivery measured");
    }

    #[test]
    fn a_row_cost_is_live_pages_over_rows_or_the_reading_size_when_empty() {
        assert_eq!(room().bytes_per_row(), Some(1000.0));
        let empty = Room {
            rows: 0,
            backlog_rows: 0,
            ..room()
        };
        assert_eq!(empty.bytes_per_row(), None);
        let mut m = Meter::new(10.0);
        m.record(sample(0.0, (0, 0), 0, true));
        m.record(sample(2.0, (20, 4000), 0, true));
        let b = budget(&m, empty);
        assert_eq!(b.spool_bytes_per_row, Some(200.0));
        assert!(b.hold.is_some());
    }

    #[test]
    fn a_sample_from_the_past_is_ignored() {
        let mut m = Meter::new(10.0);
        m.record(sample(5.0, (0, 0), 0, true));
        m.record(sample(7.0, (20, 20), 0, true));
        m.record(sample(1.0, (999, 999), 0, true));
        assert!((m.ingest().expect("rate").readings_per_sec - 10.0).abs() < 1e-9);
    }
}
