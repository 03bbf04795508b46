//! The delivery thread's answers to the broker's word: a refusing PUBACK,
//! a CONNACK Maximum Packet Size below a row, a connection dropped with
//! rows in flight. Each holds rows back in the book ([`super::defer`]),
//! counted as `events_deferred_<reason>`, logged at WARN (a repeat of the
//! same kind at most once a minute), named by health; the book's rows go
//! out again when their wait ends.
//!
//! Its one rule: **what the broker says or does defers rows, never FAILs
//! them** (see [`super::defer`]); [`super::Delivery::fail`] is for the
//! board's own limits only.

use super::defer::SetAside;
use super::Delivery;
use crate::mqtt::Ready;
use crate::spool::Spool;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often health's copy of the book is refreshed, at most.
const SUMMARY_EVERY: Duration = Duration::from_secs(1);
/// A repeat of one kind of WARN is logged at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

impl Delivery {
    /// The rows whose PUBACK refused them (MQTT 5 reason code 0x80 or
    /// more): the broker took the publish and said no, so they are not
    /// delivered; they are sent again with backoff ([`super::defer`]),
    /// counted as `events_deferred_puback_<reason>`.
    pub(super) fn defer_refused(&mut self) {
        let now = Instant::now();
        for (row, r) in self.link.take_refused() {
            self.forget_offered(row);
            let why = r.to_string();
            let wait = self.book.refused(row, self.epoch, now, &why);
            self.book.count(&format!("puback_{}", r.name));
            self.warn(
                "refused",
                &format!(
                    "delivery: event in row {row} refused by the broker ({why}); sent again in {} s (never FAILED for what a broker says)",
                    wait.as_secs()
                ),
            );
            self.book_changed();
        }
    }

    /// `row` is over this connection's CONNACK maximum (`why`): it waits
    /// for the next connection.
    pub(super) fn defer_too_large(&mut self, row: i64, event: &dyn std::fmt::Display, why: &str) {
        if self.book.too_large(row, self.epoch, Instant::now(), why) {
            self.book.count("packet_too_large");
            self.warn(
                "too_large",
                &format!("delivery: event {event} waits for the next connection: {why}"),
            );
            self.book_changed();
        }
    }

    /// Whether `row`, `size` bytes as a PUBLISH, waits behind a hold (a
    /// size the broker dropped the connection on); if so it is in the book.
    pub(super) fn held_back(
        &mut self,
        row: i64,
        size: usize,
        event: &dyn std::fmt::Display,
    ) -> bool {
        if !self
            .book
            .behind_hold(row, (size, self.epoch), Instant::now())
        {
            return false;
        }
        self.book.count("held");
        let limit = self.book.hold_size().unwrap_or(0);
        self.warn(
            "held",
            &format!("delivery: event {event} ({size} bytes as a PUBLISH) waits: the broker dropped the connection on a {limit}-byte PUBLISH and has not acknowledged one as large since"),
        );
        self.book_changed();
        true
    }

    /// A connection ended with `in_flight` rows in flight. `quick`: within
    /// a keep-alive of CONNACK with no PUBACK, closed by the peer;
    /// `closed_on_rows`: closed by the peer (or the network) within a
    /// keep-alive of the oldest row in flight leaving, no PUBACK since.
    ///
    /// A publish the broker answers by closing the connection never gets a
    /// PUBACK, and each replay would start with it again: with several
    /// rows in flight, rows then go one at a time; a row alone in flight at
    /// `fail_after_disconnects` such drops in a row (at one, if it was set
    /// aside before) is set aside, so the rows behind it flow. Never a
    /// guess between rows, never FAILED.
    pub(super) fn on_drop(&mut self, in_flight: &[i64], quick: bool, closed_on_rows: bool) {
        let row = match in_flight {
            [one] if closed_on_rows => *one,
            [_, _, ..] if quick => {
                if let Some(cap) = self.batcher.quick_loss(in_flight, self.largest_acked) {
                    log::warn!("delivery: the connection dropped with a batch larger than any packet the broker acknowledged in flight: batches now at most {cap} bytes per PUBLISH; set mqtt.max_packet_bytes to the broker's limit");
                }
                if self.probing.is_none() {
                    log::warn!("delivery: connections drop soon after CONNACK with rows in flight; sending one row at a time to find a row the broker refuses");
                    self.probe_alone();
                }
                self.suspect = None;
                return;
            }
            _ => {
                self.suspect = None;
                return;
            }
        };
        let n = match self.suspect {
            Some((r, n)) if r == row => n + 1,
            _ => 1,
        };
        self.suspect = Some((row, n));
        if n < self.cfg.fail_after_disconnects && !self.book.was_set_aside(row) {
            return;
        }
        self.suspect = None;
        let size = self.offered_size.get(&row).copied();
        let why =
            format!("the connection dropped {n} times in a row with this row alone in flight");
        let now = Instant::now();
        match self
            .book
            .set_aside(row, (size, self.largest_acked), (self.epoch, now), &why)
        {
            SetAside::Row(wait) => log::warn!(
                "delivery: row {row} set aside: {why} (larger than the broker accepts? denied? see the broker's log); the rows behind it flow, it is sent again alone in {} s (never FAILED for what a broker does)",
                wait.as_secs()
            ),
            SetAside::Hold(0, wait) => log::warn!(
                "delivery: row {row} set aside: the broker dropped the connection on every row it was sent since its last PUBACK; every row waits, one is sent alone in {} s to try again (never FAILED for what a broker does)",
                wait.as_secs()
            ),
            SetAside::Hold(limit, wait) => log::warn!(
                "delivery: row {row} set aside: the broker dropped the connection on a {limit}-byte PUBLISH (the largest it acknowledged is {} bytes); rows of {limit} bytes or more wait, one is sent alone in {} s to try again; set mqtt.max_packet_bytes to the broker's limit to FAIL such rows instead",
                self.largest_acked,
                wait.as_secs()
            ),
        }
        self.book.count("disconnects");
        self.book_changed();
    }

    /// Send one row at a time (a row that may cost the connection must be
    /// alone in flight to be told apart).
    pub(super) fn probe_alone(&mut self) {
        if self.probing.is_none() {
            self.link.probe(true);
            self.probing = Some(0);
        }
    }

    /// PUBACKs for `acked`: their entries go; a hold they lift lets the
    /// rows behind it go again (a new connection when some have no entry).
    pub(super) fn book_acked(&mut self, acked: &[i64]) {
        let Some(rebuild) = self.book.acked(acked, self.largest_acked) else {
            return;
        };
        log::info!(
            "delivery: the broker acknowledged a {}-byte PUBLISH: rows held back since it dropped a connection go again",
            self.largest_acked
        );
        if rebuild {
            self.link.rebuild(
                self.epoch,
                "rows held back past the book's bound are read again",
            );
        }
        self.book_changed();
    }

    /// The book's rows whose wait ended, at most `room`, read from the
    /// spool and admitted as single publishes (a row set aside, or probing
    /// a hold, alone). None while receipt mode's books are full.
    pub(super) fn retry_ready(&mut self, spool: &mut Spool, room: usize) -> Vec<Ready> {
        let now = Instant::now();
        if self.book.rebuild_due(now) {
            self.link.rebuild(
                self.epoch,
                "rows refused past the book's bound are read again",
            );
        }
        if room == 0 || self.offers_full() || self.receipts_full() {
            return Vec::new();
        }
        let ids = self.book.due(self.epoch, now, room);
        if ids.is_empty() {
            return Vec::new();
        }
        let rows = match spool.unresolved_rows(&ids) {
            Ok(rows) => rows,
            Err(e) => {
                self.log_error("read rows held back by the broker", &e);
                return Vec::new();
            }
        };
        let limits = self.packet_limit();
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            if self.ledger.holds(row.id) || self.awaits_receipt(row.id) {
                continue;
            }
            let Some((topic, size, event_id)) = self.admit(spool, &row, limits) else {
                continue;
            };
            if self.book.alone(row.id) {
                self.probe_alone();
            }
            self.note_offered(&row, event_id);
            if self.offered_size.len() < 4 * crate::mqtt::ackmap::MAX_WINDOW {
                self.offered_size.insert(row.id, size);
            }
            out.push(Ready {
                row: row.id,
                topic,
                payload: row.payload,
                event_id: Some(event_id),
                members: Vec::new(),
            });
        }
        self.book_changed();
        out
    }

    /// Hand the `events_deferred_<reason>` counts taken so far to the
    /// ledger: they ride the writer's next commit, never one of their own
    /// ([`super::ledger`]).
    pub(super) fn write_counts(&mut self) {
        let counts = self.book.take_counts();
        if !counts.is_empty() {
            self.ledger.count(
                counts
                    .into_iter()
                    .map(|(name, n)| (format!("events_deferred_{name}"), n)),
            );
        }
    }

    /// The book changed: health's copy (at most every [`SUMMARY_EVERY`]:
    /// it scans the book).
    pub(super) fn book_changed(&mut self) {
        let now = Instant::now();
        let recent = self
            .book_published
            .is_some_and(|t| now.saturating_duration_since(t) < SUMMARY_EVERY);
        if recent {
            self.book_dirty = true;
            return;
        }
        let (rows, why) = self.book.summary(self.epoch, now);
        self.book_dirty = false;
        self.book_published = Some(now);
        self.stats.deferred.store(rows, Ordering::Relaxed);
        if let Ok(mut w) = self.stats.deferred_why.lock() {
            *w = why;
        }
    }

    /// When health's copy of a change held back by the rate limit is due
    /// (`None`: it is current): the loop wakes for it, or health would
    /// wait for the next message or safety poll to hear of the change.
    pub(super) fn book_refresh_due(&self) -> Option<Instant> {
        self.book_dirty.then(|| {
            self.book_published
                .map_or_else(Instant::now, |t| t + SUMMARY_EVERY)
        })
    }

    /// Refresh health's copy if a change was held back by the rate limit.
    pub(super) fn book_refresh(&mut self) {
        let stale = self
            .book_published
            .is_none_or(|t| t.elapsed() >= SUMMARY_EVERY);
        if self.book_dirty && stale {
            self.book_changed();
        }
    }

    /// Log `line` at WARN unless a line of `kind` was logged within
    /// [`WARN_EVERY`] (then at DEBUG).
    fn warn(&mut self, kind: &'static str, line: &str) {
        let now = Instant::now();
        match self.warned.get(kind) {
            Some(t) if now.saturating_duration_since(*t) < WARN_EVERY => {
                log::debug!("{line}");
            }
            _ => {
                self.warned.insert(kind, now);
                log::warn!("{line} (repeats of this kind are logged once a minute)");
            }
        }
    }
}
