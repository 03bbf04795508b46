//! The book of rows held back on the broker's word ([`Book`]): what a
//! broker connection says about a row, or does when the row is sent, holds
//! the row back, and it is tried again later.
//!
//! Its one rule: **a broker's word never FAILs a row; only the board's own
//! limits do** (`mqtt.max_payload_bytes`, `mqtt.max_packet_bytes`, a stored
//! id or digest that does not hold: [`super::Delivery::admit`]). A broker,
//! a misconfigured relay or a man in the middle can say anything; issue 33
//! found one CONNACK, or a link dropping the connection after each PUBLISH,
//! turning the whole backlog FAILED three connections at a time. So:
//!
//! - **Over this connection's CONNACK Maximum Packet Size**
//!   ([`Kind::TooLarge`]): not sent on this connection; judged again on the
//!   next one.
//! - **Refused in its PUBACK** (MQTT 5 reason code 0x80 or more,
//!   [`Kind::Refused`]): sent again after [`RETRY_FIRST`], twice as long
//!   after each further refusal, at most [`REFUSED_MAX`], on this
//!   connection or a later one.
//! - **Set aside** ([`Kind::SetAside`]): the connection dropped with it
//!   alone in flight `mqtt.fail_after_disconnects` times in a row (a poison
//!   row kills every connection that carries it, and each replay would
//!   start with it): the rows behind it flow, and it is sent again
//!   **alone** after [`RETRY_FIRST`], twice as long each time it costs the
//!   connection again, at most [`SET_ASIDE_MAX`]; for ever.
//! - **Held** ([`Kind::Held`], [`Hold`]): a row set aside while larger than
//!   any packet the broker acknowledged teaches its size as the broker's
//!   limit (MQTT 3.1.1 has no other way to learn it); two rows set aside
//!   with no PUBACK between teach that the broker drops every row (size 0).
//!   Rows at least that large wait, set-aside ones too, without costing a
//!   connection each: one at a time probes the hold alone, on the schedule
//!   of a set-aside row (a row never dropped on first, so two poison rows
//!   cannot hold the rest for good), and a PUBACK for a packet that large
//!   lifts it.
//!
//! Bounded: at most [`MAX_BOOK`] rows have an entry. A row held back past
//! that has none: it waits for the next connection, and while such rows
//! wait the agent makes a new connection at most every [`REFUSED_MAX`]
//! ([`Book::rebuild_due`]). Pure: time and connection epochs are passed in.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rows with an entry, at most (about 100 bytes each).
pub(super) const MAX_BOOK: usize = 10_000;
/// The first wait before a refused or set-aside row is sent again.
pub(super) const RETRY_FIRST: Duration = Duration::from_secs(10);
/// The longest wait before a refused row is sent again (a refusal costs a
/// publish, not a connection).
pub(super) const REFUSED_MAX: Duration = Duration::from_secs(600);
/// The longest wait before a set-aside row, or a row probing a hold, is
/// sent again alone (each try may cost the connection).
pub(super) const SET_ASIDE_MAX: Duration = Duration::from_secs(3600);
/// Rows handed back by one [`Book::due`] call, at most.
const DUE_BATCH: usize = 256;

/// The wait before the `times`-th try: [`RETRY_FIRST`] doubled per earlier
/// time, at most `max`.
pub(super) fn backoff(times: u32, max: Duration) -> Duration {
    RETRY_FIRST
        .saturating_mul(1u32 << times.saturating_sub(1).min(16))
        .min(max)
}

/// What the broker said or did about a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    /// Refused in its PUBACK.
    Refused,
    /// Over the CONNACK Maximum Packet Size of the connection it was on.
    TooLarge,
    /// The connection dropped with it alone in flight.
    SetAside,
    /// Waits while the [`Hold`] stands (never dropped on itself).
    Held,
    /// Held back earlier on this connection and free now (a hold lifted):
    /// to be offered once more on it.
    Free,
}

/// One row's entry.
#[derive(Debug, Clone)]
struct Entry {
    kind: Kind,
    /// Times refused or set aside in this run: the wait doubles with each.
    times: u32,
    /// Not offered before this (refused, set aside).
    until: Instant,
    /// The connection it was held back on (too large: until the next).
    epoch: u64,
    /// The connection it was last offered on: a row goes once a
    /// connection, whether the lanes or [`Book::due`] reach it first.
    offered: Option<u64>,
    /// Its PUBLISH's size in bytes (`usize::MAX` when not known).
    size: usize,
    /// What the broker said, for health and the log.
    reason: Arc<str>,
}

/// Rows at least `size` bytes as a PUBLISH wait: the broker dropped the
/// connection on one (a limit it did not announce), or on every row (0).
#[derive(Debug, Clone)]
struct Hold {
    /// Packets of this many bytes or more wait; 0: every row.
    size: usize,
    /// Probes that cost the connection (the wait doubles with each).
    times: u32,
    /// The next probe not before this.
    until: Instant,
    /// The row probing it now.
    probe: Option<i64>,
}

/// The book (see the module doc).
#[derive(Debug, Default)]
pub(super) struct Book {
    entries: HashMap<i64, Entry>,
    hold: Option<Hold>,
    /// Rows held back on this connection with no room for an entry.
    overflow: u64,
    /// Since when such rows wait.
    overflow_since: Option<Instant>,
    /// Rows set aside since the last PUBACK (two distinct at most).
    aside_since_ack: Vec<i64>,
    /// `events_deferred_<counter>` not yet written to the spool.
    counts: BTreeMap<String, i64>,
    /// No wait ends before this (a lower bound, so [`Book::due`] scans the
    /// entries only when one may have ended); `None`: none waits on time.
    wake: Option<Instant>,
    /// Free rows (or a new connection) wait for a scan now.
    scan_now: bool,
    /// The last reason entered: rows refused for one reason share its text.
    last_reason: Option<Arc<str>>,
}

/// What [`Book::set_aside`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SetAside {
    /// The row alone waits; tried again alone after this long.
    Row(Duration),
    /// Rows at least this large wait (0: every row); a probe after this long.
    Hold(usize, Duration),
}

impl Book {
    /// Whether `row` waits at `now` on connection `epoch` (the lanes skip it).
    pub(super) fn waits(&self, row: i64, epoch: u64, now: Instant) -> bool {
        let Some(e) = self.entries.get(&row) else {
            return false;
        };
        if e.offered == Some(epoch) {
            return true;
        }
        match e.kind {
            Kind::TooLarge => e.epoch == epoch,
            Kind::Refused => now < e.until,
            Kind::SetAside if self.covers(e.size) => !self.is_probe(row),
            Kind::SetAside => now < e.until,
            Kind::Held => self.hold.is_some() && !self.is_probe(row),
            Kind::Free => false,
        }
    }

    /// Whether a standing hold keeps back packets of `size` bytes.
    fn covers(&self, size: usize) -> bool {
        self.hold.as_ref().is_some_and(|h| size >= h.size)
    }

    /// `row` goes out on connection `epoch` (from the lanes or [`Book::due`]).
    pub(super) fn offered(&mut self, row: i64, epoch: u64) {
        if let Some(e) = self.entries.get_mut(&row) {
            e.offered = Some(epoch);
        }
    }

    /// Whether `row` must be sent alone: set aside, or probing the hold.
    pub(super) fn alone(&self, row: i64) -> bool {
        self.is_probe(row)
            || self
                .entries
                .get(&row)
                .is_some_and(|e| e.kind == Kind::SetAside)
    }

    /// Whether `row` probes the hold now.
    pub(super) fn is_probe(&self, row: i64) -> bool {
        self.hold.as_ref().is_some_and(|h| h.probe == Some(row))
    }

    /// Rows whose wait is over on connection `epoch` at `now` and that have
    /// not gone out on it (at most `max` and [`DUE_BATCH`], oldest first),
    /// each marked offered; the hold's probe among them when its time has
    /// come.
    pub(super) fn due(&mut self, epoch: u64, now: Instant, max: usize) -> Vec<i64> {
        let woke = self.scan_now || self.wake.is_some_and(|t| t <= now);
        if !woke || self.entries.is_empty() {
            return Vec::new();
        }
        let mut rows: Vec<i64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.offered != Some(epoch))
            .filter(|(_, e)| match e.kind {
                Kind::Refused => e.until <= now,
                Kind::SetAside => !self.covers(e.size) && e.until <= now,
                Kind::Free => true,
                Kind::TooLarge | Kind::Held => false,
            })
            .map(|(r, _)| *r)
            .collect();
        let probe_due = self
            .hold
            .as_ref()
            .is_some_and(|h| h.probe.is_none() && h.until <= now);
        let probe = self.next_probe().filter(|_| probe_due);
        rows.extend(probe);
        rows.sort_unstable();
        let max = max.min(DUE_BATCH);
        let more = rows.len() > max;
        rows.truncate(max);
        // A probe cut off by `max` is chosen again at the next call.
        if let (Some(row), Some(h)) = (probe.filter(|p| rows.contains(p)), self.hold.as_mut()) {
            h.probe = Some(row);
        }
        for r in &rows {
            self.offered(*r, epoch);
        }
        self.scan_now = more;
        self.wake = self.earliest(epoch);
        rows
    }

    /// The row to probe the hold with: the oldest held row never dropped
    /// on, else the oldest set-aside row it keeps back.
    fn next_probe(&self) -> Option<i64> {
        let oldest = |kind: Kind| {
            self.entries
                .iter()
                .filter(|(_, e)| e.kind == kind && self.covers(e.size))
                .map(|(r, _)| *r)
                .min()
        };
        oldest(Kind::Held).or_else(|| oldest(Kind::SetAside))
    }

    /// When [`Book::due`] may next have something (the delivery loop's
    /// wake-up).
    pub(super) fn next_due(&self) -> Option<Instant> {
        if self.scan_now {
            return Some(Instant::now());
        }
        self.wake
    }

    /// The earliest end of a wait on connection `epoch` (a scan).
    fn earliest(&self, epoch: u64) -> Option<Instant> {
        let rows = self
            .entries
            .values()
            .filter(|e| e.offered != Some(epoch))
            .filter(|e| match e.kind {
                Kind::Refused => true,
                Kind::SetAside => !self.covers(e.size),
                _ => false,
            })
            .map(|e| e.until);
        let probe = self
            .hold
            .as_ref()
            .filter(|h| h.probe.is_none() && self.next_probe().is_some())
            .map(|h| h.until);
        rows.chain(probe).min()
    }

    /// The broker refused `row` in its PUBACK on connection `epoch` at
    /// `now`: returns the wait before it is sent again.
    pub(super) fn refused(&mut self, row: i64, epoch: u64, now: Instant, reason: &str) -> Duration {
        let (times, size) = self
            .entries
            .get(&row)
            .map_or((0, usize::MAX), |e| (e.times, e.size));
        let wait = backoff(times + 1, REFUSED_MAX);
        let e = self.entry(Kind::Refused, times + 1, now + wait, (epoch, size), reason);
        self.put(row, e, now);
        wait
    }

    /// `row` is over connection `epoch`'s CONNACK maximum: it waits for the
    /// next connection. Returns false if it already waited on this one.
    pub(super) fn too_large(&mut self, row: i64, epoch: u64, now: Instant, reason: &str) -> bool {
        if self
            .entries
            .get(&row)
            .is_some_and(|e| e.kind == Kind::TooLarge && e.epoch == epoch)
        {
            return false;
        }
        let times = self.entries.get(&row).map_or(0, |e| e.times);
        let e = self.entry(Kind::TooLarge, times, now, (epoch, usize::MAX), reason);
        self.put(row, e, now);
        true
    }

    /// Whether `row`, `size` bytes as a PUBLISH and met on connection
    /// `epoch`, waits behind the hold (then it is in the book); false when
    /// no hold keeps it back, or when it becomes the hold's probe now (its
    /// time has come and no other row probes it).
    pub(super) fn behind_hold(
        &mut self,
        row: i64,
        (size, epoch): (usize, u64),
        now: Instant,
    ) -> bool {
        let Some(h) = self.hold.as_mut() else {
            return false;
        };
        if size < h.size || h.probe == Some(row) {
            return false;
        }
        if h.probe.is_none() && h.until <= now {
            h.probe = Some(row);
            return false;
        }
        if !self.entries.contains_key(&row) {
            let e = self.entry(Kind::Held, 0, now, (epoch, size), "held");
            self.put(row, e, now);
        }
        true
    }

    /// The connection dropped with `row` (of `size` bytes if known, the
    /// largest packet the broker acknowledged in this run being
    /// `largest_acked`) alone in flight, once too often (or once, if it was
    /// set aside or probing before): set it aside, and hold rows of its
    /// size, or every row (see the module doc).
    pub(super) fn set_aside(
        &mut self,
        row: i64,
        (size, largest_acked): (Option<usize>, usize),
        (epoch, now): (u64, Instant),
        reason: &str,
    ) -> SetAside {
        if !self.aside_since_ack.contains(&row) && self.aside_since_ack.len() < 2 {
            self.aside_since_ack.push(row);
        }
        let learned = match size {
            Some(s) if s > largest_acked => Some(s),
            _ if self.aside_since_ack.len() >= 2 => Some(0),
            _ => None,
        };
        let probe = self.is_probe(row);
        let times = self
            .entries
            .get(&row)
            .filter(|e| e.kind == Kind::SetAside)
            .map_or(0, |e| e.times)
            + 1;
        let wait = backoff(times, SET_ASIDE_MAX);
        let size = size.unwrap_or(usize::MAX);
        let e = self.entry(Kind::SetAside, times, now + wait, (epoch, size), reason);
        self.put(row, e, now);
        if !probe && learned.is_none() {
            return SetAside::Row(wait);
        }
        let times = self.hold.as_ref().map_or(0, |h| h.times) + 1;
        let size = match (&self.hold, learned) {
            (Some(h), Some(l)) => h.size.min(l),
            (Some(h), None) => h.size,
            (None, l) => l.unwrap_or(0),
        };
        let wait = backoff(times, SET_ASIDE_MAX);
        self.hold = Some(Hold {
            size,
            times,
            until: now + wait,
            probe: None,
        });
        self.wake_at(now + wait);
        SetAside::Hold(size, wait)
    }

    /// Whether `row` was set aside before, or probes the hold (one more
    /// drop sets it aside again).
    pub(super) fn was_set_aside(&self, row: i64) -> bool {
        self.is_probe(row)
            || self
                .entries
                .get(&row)
                .is_some_and(|e| e.kind == Kind::SetAside)
    }

    /// The packet size the hold keeps back from, if one stands.
    pub(super) fn hold_size(&self) -> Option<usize> {
        self.hold.as_ref().map(|h| h.size)
    }

    /// PUBACKs for `rows`, the largest packet acknowledged in this run now
    /// `largest_acked`: their entries go; a hold no larger than that is
    /// lifted. Returns `Some` when it was, with whether rows with no entry
    /// were behind it (they need a new connection to be read again).
    pub(super) fn acked(&mut self, rows: &[i64], largest_acked: usize) -> Option<bool> {
        if !rows.is_empty() {
            self.aside_since_ack.clear();
        }
        for r in rows {
            self.forget(*r);
        }
        if self.hold.as_ref().is_some_and(|h| largest_acked >= h.size) {
            return Some(self.lift());
        }
        None
    }

    /// Lift the hold (acknowledged, or FAILED rows requeued by an
    /// operator): the rows behind it are free, set-aside ones back on their
    /// own schedules. Returns whether some had no entry (see [`Book::acked`]).
    pub(super) fn lift(&mut self) -> bool {
        if self.hold.take().is_none() {
            return false;
        }
        for e in self.entries.values_mut().filter(|e| e.kind == Kind::Held) {
            e.kind = Kind::Free;
            e.offered = None;
        }
        self.scan_now = true;
        self.overflow > 0
    }

    /// `row` is resolved (delivered, or FAILED by the board's own limits):
    /// its entry goes.
    pub(super) fn forget(&mut self, row: i64) {
        self.entries.remove(&row);
        if let Some(h) = self.hold.as_mut().filter(|h| h.probe == Some(row)) {
            h.probe = None;
            self.scan_now = true;
        }
    }

    /// A new connection: what waited for it goes (the lanes read every row
    /// again); a probe that did not end in a drop is chosen again.
    pub(super) fn lost(&mut self) {
        self.entries
            .retain(|_, e| !matches!(e.kind, Kind::TooLarge | Kind::Free));
        if let Some(h) = self.hold.as_mut() {
            h.probe = None;
        }
        // What went out on the last connection may go out on this one.
        self.scan_now = true;
        self.overflow = 0;
        self.overflow_since = None;
    }

    /// Whether rows held back with no entry (past [`MAX_BOOK`]) have waited
    /// [`REFUSED_MAX`] on this connection: time for a new one, which reads
    /// them again. Resets the clock.
    pub(super) fn rebuild_due(&mut self, now: Instant) -> bool {
        let due = self
            .overflow_since
            .is_some_and(|t| now.saturating_duration_since(t) >= REFUSED_MAX);
        if due {
            self.overflow_since = Some(now);
        }
        due
    }

    /// Count one row held back, as `events_deferred_<counter>`.
    pub(super) fn count(&mut self, counter: &str) {
        *self.counts.entry(counter.to_owned()).or_default() += 1;
    }

    /// The counts not yet handed on, taken (to the ledger, whose commit
    /// keeps them on a failure: [`super::ledger`]).
    pub(super) fn take_counts(&mut self) -> BTreeMap<String, i64> {
        std::mem::take(&mut self.counts)
    }

    /// Rows held back now on connection `epoch` at `now`, and what the
    /// broker said or did, for health: `(rows, why)`.
    pub(super) fn summary(&self, epoch: u64, now: Instant) -> (u64, String) {
        let mut by: BTreeMap<Kind, (u64, Option<&Entry>)> = BTreeMap::new();
        for e in self.entries.values() {
            if e.kind == Kind::TooLarge && e.epoch != epoch || e.kind == Kind::Free {
                continue;
            }
            let slot = by.entry(e.kind).or_default();
            slot.0 += 1;
            if slot.1.is_none_or(|l| l.until < e.until) {
                slot.1 = Some(e);
            }
        }
        let secs = |t: Instant| t.saturating_duration_since(now).as_secs();
        let hold = self.hold.as_ref();
        let mut parts = Vec::new();
        for (kind, (n, e)) in &by {
            let (reason, until) = e.map_or(("", now), |e| (&*e.reason, e.until));
            parts.push(match kind {
                Kind::Refused => format!(
                    "{n} refused in their PUBACK ({reason}), sent again within {} s",
                    secs(until)
                ),
                Kind::TooLarge => {
                    format!("{n} over its maximum packet size on this connection ({reason})")
                }
                Kind::SetAside => format!(
                    "{n} set aside after the connection dropped with each alone in flight ({reason}), each sent again alone within {} s",
                    secs(hold.map_or(until, |h| h.until.max(until)))
                ),
                Kind::Held => match hold {
                    Some(h) if h.size > 0 => format!(
                        "{n} as large as a {}-byte PUBLISH the broker dropped the connection on (one tries again alone in {} s; set mqtt.max_packet_bytes to the broker's limit to FAIL such rows instead)",
                        h.size,
                        secs(h.until)
                    ),
                    _ => format!(
                        "{n} waiting while the broker dropped the connection on every row it was sent (one tries again alone in {} s)",
                        hold.map_or(0, |h| secs(h.until))
                    ),
                },
                Kind::Free => continue,
            });
        }
        if self.overflow > 0 {
            parts.push(format!(
                "{} more past the book's bound, waiting for the next connection",
                self.overflow
            ));
        }
        let rows = by.values().map(|(n, _)| n).sum::<u64>() + self.overflow;
        (rows, parts.join("; "))
    }

    /// An entry, sharing the text of the last reason when it is the same.
    fn entry(
        &mut self,
        kind: Kind,
        times: u32,
        until: Instant,
        (epoch, size): (u64, usize),
        reason: &str,
    ) -> Entry {
        let reason = match &self.last_reason {
            Some(r) if &**r == reason => r.clone(),
            _ => {
                let r: Arc<str> = Arc::from(reason);
                self.last_reason = Some(r.clone());
                r
            }
        };
        Entry {
            kind,
            times,
            until,
            epoch,
            offered: None,
            size,
            reason,
        }
    }

    /// Enter `row`'s entry, if there is room (else count it as waiting for
    /// the next connection).
    fn put(&mut self, row: i64, e: Entry, now: Instant) {
        if !self.entries.contains_key(&row) && self.entries.len() >= MAX_BOOK {
            self.overflow += 1;
            self.overflow_since.get_or_insert(now);
            return;
        }
        if matches!(e.kind, Kind::Refused | Kind::SetAside) {
            self.wake_at(e.until);
        }
        self.entries.insert(row, e);
    }

    /// A wait ends at `t`.
    fn wake_at(&mut self, t: Instant) {
        self.wake = Some(self.wake.map_or(t, |w| w.min(t)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn the_wait_doubles_from_ten_seconds_to_its_bound() {
        let waits: Vec<u64> = (1..=12)
            .map(|n| backoff(n, REFUSED_MAX).as_secs())
            .collect();
        assert_eq!(
            waits,
            [10, 20, 40, 80, 160, 320, 600, 600, 600, 600, 600, 600]
        );
        assert_eq!(backoff(40, SET_ASIDE_MAX), SET_ASIDE_MAX);
    }

    #[test]
    fn a_refused_row_is_sent_again_after_its_wait_on_the_same_connection_and_never_fails() {
        // Issue 33: a broker refusing every PUBACK turned each row FAILED
        // on the third connection; now it is retried for ever.
        let t0 = Instant::now();
        let mut b = Book::default();
        let mut t = t0;
        for n in 1..=10u32 {
            let wait = b.refused(7, 1, t, "not authorized (0x87)");
            assert_eq!(wait, backoff(n, REFUSED_MAX));
            assert!(
                b.waits(7, 1, t) && b.waits(7, 2, t),
                "a new connection skips the wait"
            );
            assert!(b.due(1, t + wait - secs(1), usize::MAX).is_empty());
            t += wait;
            assert!(!b.waits(7, 1, t));
            assert_eq!(
                b.due(1, t, usize::MAX),
                vec![7],
                "not sent again on the same connection"
            );
            assert!(b.waits(7, 1, t), "offered twice on one connection");
            assert!(b.due(1, t, usize::MAX).is_empty());
        }
        let (rows, why) = b.summary(1, t);
        assert_eq!(rows, 1);
        assert!(
            why.contains("refused in their PUBACK (not authorized (0x87))"),
            "{why}"
        );
        b.acked(&[7], 0);
        assert_eq!(b.summary(1, t).0, 0);
        assert!(!b.waits(7, 1, t));
    }

    #[test]
    fn a_row_over_a_connack_maximum_waits_for_the_next_connection_only() {
        let t = Instant::now();
        let mut b = Book::default();
        assert!(b.too_large(3, 1, t, "over 128"));
        assert!(
            !b.too_large(3, 1, t, "over 128"),
            "counted twice on one connection"
        );
        assert!(b.waits(3, 1, t + secs(3600)));
        assert!(b.due(1, t + secs(3600), usize::MAX).is_empty());
        let (rows, why) = b.summary(1, t);
        assert_eq!(rows, 1);
        assert!(why.contains("over its maximum packet size on this connection (over 128)"));
        b.lost();
        assert!(!b.waits(3, 2, t), "the next connection judges it again");
        assert!(
            b.due(2, t, usize::MAX).is_empty(),
            "the lanes read it again, not the book"
        );
        assert!(b.too_large(3, 2, t, "over 128"));
    }

    #[test]
    fn a_poison_row_is_set_aside_and_tried_again_alone_ever_later() {
        // A row that kills every connection carrying it, on a broker that
        // acknowledged larger packets: not a size, the row itself.
        let mut t = Instant::now();
        let mut b = Book::default();
        b.acked(&[1], 0);
        let mut waits = Vec::new();
        for _ in 0..9 {
            let SetAside::Row(wait) = b.set_aside(5, (Some(300), 1000), (1, t), "dropped") else {
                panic!("a hold for a row smaller than acknowledged packets");
            };
            // A PUBACK for another row between the drops: not every row.
            b.acked(&[9], 1000);
            waits.push(wait.as_secs());
            assert!(b.was_set_aside(5) && b.alone(5));
            assert!(b.waits(5, 2, t + wait - secs(1)));
            t += wait;
            assert_eq!(b.due(2, t, usize::MAX), vec![5]);
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1280, 2560]);
        assert_eq!(
            b.set_aside(5, (Some(300), 1000), (1, t), "dropped"),
            SetAside::Row(SET_ASIDE_MAX)
        );
        let (_, why) = b.summary(2, t);
        assert!(
            why.contains("1 set aside after the connection dropped"),
            "{why}"
        );
    }

    #[test]
    fn a_size_the_broker_dropped_the_connection_on_holds_rows_as_large_and_one_probes_it() {
        let t = Instant::now();
        let mut b = Book::default();
        assert_eq!(
            b.set_aside(4, (Some(3000), 500), (1, t), "dropped"),
            SetAside::Hold(3000, RETRY_FIRST)
        );
        assert_eq!(b.hold_size(), Some(3000));
        // Smaller rows flow; as large ones wait without being sent.
        assert!(!b.behind_hold(10, (2999, 1), t));
        assert!(b.behind_hold(11, (3500, 1), t));
        assert!(b.waits(4, 1, t) && b.waits(11, 2, t));
        assert_eq!(b.next_due(), Some(t + RETRY_FIRST));
        // Its time comes: a row never dropped on probes it, alone.
        let later = t + RETRY_FIRST;
        assert_eq!(b.due(1, later, usize::MAX), vec![11]);
        assert!(b.is_probe(11) && b.alone(11));
        assert!(b.behind_hold(12, (3500, 1), later), "a second probe");
        // Dropped too: the next probe waits twice as long.
        assert_eq!(
            b.set_aside(11, (Some(3500), 500), (2, later), "dropped"),
            SetAside::Hold(3000, 2 * RETRY_FIRST)
        );
        let (rows, why) = b.summary(2, later);
        assert_eq!(rows, 3);
        assert!(
            why.contains("as large as a 3000-byte PUBLISH the broker dropped the connection on"),
            "{why}"
        );
        // Then the held row probes; the broker takes it after all: the
        // hold lifts, and the set-aside rows go again, each alone.
        let much_later = later + 2 * RETRY_FIRST;
        assert_eq!(b.due(2, much_later, usize::MAX), vec![12]);
        assert_eq!(b.acked(&[12], 3500), Some(false));
        assert_eq!(b.hold_size(), None);
        assert_eq!(b.due(2, much_later, usize::MAX), vec![4, 11]);
        assert!(b.alone(4) && b.alone(11));
        b.lost();
        assert_eq!(b.summary(3, much_later).0, 2, "set aside until delivered");
    }

    #[test]
    fn two_rows_set_aside_with_no_puback_between_hold_every_row() {
        // A link that drops the connection after every PUBLISH: the book
        // does not walk the backlog setting rows aside one by one.
        let t = Instant::now();
        let mut b = Book::default();
        b.acked(&[1], 800);
        assert!(matches!(
            b.set_aside(2, (Some(250), 800), (1, t), "d"),
            SetAside::Row(_)
        ));
        assert_eq!(
            b.set_aside(3, (Some(250), 800), (2, t), "d"),
            SetAside::Hold(0, RETRY_FIRST)
        );
        assert!(b.behind_hold(40, (1, 2), t));
        let (_, why) = b.summary(3, t);
        assert!(why.contains("dropped the connection on every row"), "{why}");
        // Any PUBACK lifts it.
        assert_eq!(b.acked(&[3], 800), Some(false));
        assert!(!b.behind_hold(40, (1, 2), t));
    }

    #[test]
    fn two_poison_rows_in_a_row_do_not_hold_the_rest_for_good() {
        // Two rows that each kill the connection, one after the other: the
        // book takes it for a broker that drops every row, but its probe is
        // a row never dropped on; acknowledged, it lifts the hold.
        let t = Instant::now();
        let mut b = Book::default();
        b.acked(&[1], 800);
        b.set_aside(2, (Some(250), 800), (1, t), "d");
        assert_eq!(
            b.set_aside(3, (Some(250), 800), (2, t), "d"),
            SetAside::Hold(0, RETRY_FIRST)
        );
        assert!(b.behind_hold(4, (250, 3), t));
        assert_eq!(b.due(3, t + RETRY_FIRST, usize::MAX), vec![4]);
        assert_eq!(b.acked(&[4], 800), Some(false));
        // The two poison rows are back on their own schedules, alone.
        assert_eq!(b.due(3, t + RETRY_FIRST, usize::MAX), vec![2, 3]);
        assert!(b.alone(2) && b.alone(3));
    }

    #[test]
    fn due_rows_respect_the_room_given_and_a_probe_cut_off_is_chosen_again() {
        let t = Instant::now();
        let mut b = Book::default();
        b.refused(1, 1, t, "r");
        b.set_aside(9, (Some(5000), 100), (1, t), "d");
        assert!(b.behind_hold(10, (6000, 1), t));
        let later = t + RETRY_FIRST;
        // Room for one: the refused row; the probe (row 10) waits.
        assert_eq!(b.due(1, later, 1), vec![1]);
        assert!(!b.is_probe(10));
        assert_eq!(b.next_due().map(|d| d <= Instant::now()), Some(true));
        assert_eq!(b.due(1, later, 1), vec![10]);
        assert!(b.is_probe(10));
        assert!(b.due(1, later, 1).is_empty());
    }

    #[test]
    fn the_book_is_bounded_and_rows_past_it_ask_for_a_new_connection_now_and_then() {
        let t = Instant::now();
        let mut b = Book::default();
        for row in 0..MAX_BOOK as i64 + 5 {
            b.refused(row, 1, t, "quota exceeded (0x97)");
        }
        assert_eq!(b.entries.len(), MAX_BOOK);
        let (rows, why) = b.summary(1, t);
        assert_eq!(rows, MAX_BOOK as u64 + 5);
        assert!(why.contains("5 more past the book's bound"), "{why}");
        assert!(!b.rebuild_due(t + REFUSED_MAX - secs(1)));
        assert!(b.rebuild_due(t + REFUSED_MAX));
        assert!(!b.rebuild_due(t + REFUSED_MAX + secs(1)), "again at once");
        // One connection's due rows come in bounded batches.
        assert_eq!(b.due(1, t + RETRY_FIRST, usize::MAX).len(), DUE_BATCH);
        assert_eq!(b.next_due().map(|d| d <= Instant::now()), Some(true));
    }
}
