//! The rows waiting for a receipt: PUBACKed rows in receipt mode
//! (`mqtt.retire_on = "receipt"`), each kept until a receipt from the
//! fleet names its own stream and event id, or its timeout comes.
//!
//! Its one rule: **a receipt retires only rows that are waiting for one
//! (PUBACKed, same stream, same event id, and the digest of the very bytes
//! the row holds); anything else in it retires nothing and is counted**,
//! and a row not covered within the timeout is published again with the
//! same id and bytes. The receipt's wire format and its signature check
//! are [`crate::event::receipts`]: only a checked receipt comes here. Pure:
//! time is passed in, nothing here does I/O.

use crate::event::envelope::EventId;
use crate::event::receipts::Receipt;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one receipt did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Matched {
    /// Rows now stored at the fleet: retire them.
    pub rows: Vec<i64>,
    /// Ids named that no waiting row has (not yet PUBACKed, already
    /// retired, another board's, forged): counted, nothing retired.
    pub unmatched: usize,
    /// Ids of waiting rows named with another digest: the fleet stored
    /// other bytes under that id (I3 broken somewhere): counted, the row
    /// keeps waiting and is sent again at its timeout.
    pub wrong_digest: usize,
}

/// A waiting row and the digest of its payload as the spool stores it.
#[derive(Debug, Clone)]
struct Entry {
    row: i64,
    digest: [u8; 32],
}

/// Rows PUBACKed and waiting for their receipt, bounded by `cap`.
#[derive(Debug)]
pub struct Awaiting {
    by_key: HashMap<(Arc<str>, EventId), Entry>,
    by_row: HashMap<i64, (Arc<str>, EventId)>,
    /// `(since, row)` in PUBACK order, for the timeout (entries of rows that
    /// left are skipped when met).
    order: VecDeque<(Instant, i64)>,
    cap: usize,
}

impl Awaiting {
    /// An empty book holding at most `cap` rows.
    pub fn new(cap: usize) -> Awaiting {
        Awaiting {
            by_key: HashMap::new(),
            by_row: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// Rows waiting.
    pub fn len(&self) -> usize {
        self.by_row.len()
    }

    /// Whether no row waits.
    pub fn is_empty(&self) -> bool {
        self.by_row.is_empty()
    }

    /// Whether the book is full: no new row may be sent until receipts (or
    /// timeouts) make room.
    pub fn is_full(&self) -> bool {
        self.by_row.len() >= self.cap
    }

    /// Whether `row` waits for its receipt.
    pub fn contains(&self, row: i64) -> bool {
        self.by_row.contains_key(&row)
    }

    /// `row` (of `stream`, with `event_id` and its payload's sha256
    /// `digest`) was PUBACKed at `now`: it waits. A row already waiting
    /// keeps its first time (its timeout runs from its first PUBACK).
    pub fn delivered(
        &mut self,
        row: i64,
        (stream, event_id): (Arc<str>, EventId),
        digest: [u8; 32],
        now: Instant,
    ) {
        if self.by_row.contains_key(&row) {
            return;
        }
        let key = (stream, event_id);
        if let Some(old) = self.by_key.insert(key.clone(), Entry { row, digest }) {
            // One event id on two rows (a requeued FAILED row): the newer row
            // is the one the spool keeps; the older is forgotten here.
            self.by_row.remove(&old.row);
        }
        self.by_row.insert(row, key);
        self.order.push_back((now, row));
    }

    /// Apply `r` (checked: [`Receipt::check`]): the waiting rows it names
    /// with their own digest leave the book and are returned for
    /// retirement.
    ///
    /// [`Receipt::check`]: crate::event::receipts::Receipt::check
    pub fn receipt(&mut self, r: &Receipt) -> Matched {
        let mut m = Matched::default();
        for (stream, events) in &r.stored {
            // The key's stream is an Arc<str>: look up with an owned one.
            let stream: Arc<str> = Arc::from(stream.as_str());
            for (id, digest) in events {
                let key = (stream.clone(), *id);
                match self.by_key.get(&key) {
                    Some(e) if e.digest == *digest => {
                        let row = e.row;
                        self.by_key.remove(&key);
                        self.by_row.remove(&row);
                        m.rows.push(row);
                    }
                    Some(_) => m.wrong_digest += 1,
                    None => m.unmatched += 1,
                }
            }
        }
        self.trim_order();
        m
    }

    /// Rows whose receipt has not come within `timeout` of their PUBACK (at
    /// `now`): they leave the book, to be published again.
    pub fn expired(&mut self, now: Instant, timeout: Duration) -> Vec<i64> {
        let mut out = Vec::new();
        while let Some(&(since, row)) = self.order.front() {
            if now.saturating_duration_since(since) < timeout {
                break;
            }
            self.order.pop_front();
            if let Some(key) = self.by_row.get(&row) {
                let current = self.by_key.get(key).is_some_and(|e| e.row == row);
                if current {
                    let key = key.clone();
                    self.by_key.remove(&key);
                    self.by_row.remove(&row);
                    out.push(row);
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Forget `rows` (tests only: since a refused receipts subscription
    /// retires nothing, a row leaves the book by its receipt alone).
    #[cfg(test)]
    pub fn remove(&mut self, rows: &[i64]) {
        for row in rows {
            if let Some(key) = self.by_row.remove(row) {
                self.by_key.remove(&key);
            }
        }
        self.trim_order();
    }

    /// Every waiting row, leaving the book empty (in row order; tests only).
    #[cfg(test)]
    pub fn drain(&mut self) -> Vec<i64> {
        let mut rows: Vec<i64> = self.by_row.keys().copied().collect();
        rows.sort_unstable();
        self.by_row.clear();
        self.by_key.clear();
        self.order.clear();
        rows
    }

    /// How long the oldest waiting row has waited at `now`.
    pub fn oldest_age(&mut self, now: Instant) -> Option<Duration> {
        self.trim_order();
        self.order
            .front()
            .map(|(since, _)| now.saturating_duration_since(*since))
    }

    /// Drop leading order entries of rows that left.
    fn trim_order(&mut self) {
        while let Some(&(_, row)) = self.order.front() {
            if self.by_row.contains_key(&row) {
                break;
            }
            self.order.pop_front();
        }
        // Bound the lazy queue: entries of rows that left in its middle.
        if self.order.len() > 2 * self.cap + 64 {
            let by_row = &self.by_row;
            self.order.retain(|(_, row)| by_row.contains_key(row));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::receipts::{encode, parse};
    use crate::event::signature::SigningKey;

    const A: &str = "0123abcd-0000-4000-8000-00000000000a";
    const B: &str = "0123abcd-0000-4000-8000-00000000000b";
    const C: &str = "0123abcd-0000-4000-8000-00000000000c";

    /// The digest each test row's payload has.
    const D: [u8; 32] = [7; 32];

    fn receipt(stream: &str, ids: &[&str]) -> Receipt {
        receipt_with(stream, ids, D)
    }

    fn receipt_with(stream: &str, ids: &[&str], digest: [u8; 32]) -> Receipt {
        let key = SigningKey::generate().expect("keygen").0;
        let events: Vec<(&str, EventId, [u8; 32])> =
            ids.iter().map(|i| (stream, id(i), digest)).collect();
        parse(&encode("gw1", &events, &key)[0]).expect("a receipt")
    }

    fn s(stream: &str, event: &str) -> (Arc<str>, EventId) {
        (Arc::from(stream), id(event))
    }

    fn id(s: &str) -> EventId {
        EventId::parse(s).expect("a test id")
    }

    #[test]
    fn only_waiting_rows_with_their_own_stream_and_id_are_retired() {
        let t = Instant::now();
        let mut w = Awaiting::new(10);
        w.delivered(1, s("s", A), D, t);
        w.delivered(2, s("s", B), D, t);
        // Another stream's id, an unknown id, a row not yet PUBACKed: nothing.
        let m = w.receipt(&receipt("t", &[A]));
        assert_eq!((m.rows.len(), m.unmatched), (0, 1));
        let m = w.receipt(&receipt("s", &[C]));
        assert_eq!((m.rows.len(), m.unmatched), (0, 1));
        assert_eq!(w.len(), 2);
        let m = w.receipt(&receipt("s", &[B, A]));
        assert_eq!(m.rows, vec![2, 1]);
        assert!(w.is_empty());
        // A duplicate receipt retires nothing more.
        let m = w.receipt(&receipt("s", &[A]));
        assert_eq!((m.rows.len(), m.unmatched), (0, 1));
    }

    #[test]
    fn a_receipt_naming_other_bytes_under_a_waiting_id_retires_nothing() {
        let t = Instant::now();
        let mut w = Awaiting::new(10);
        w.delivered(1, s("s", A), D, t);
        let m = w.receipt(&receipt_with("s", &[A], [8; 32]));
        assert_eq!((m.rows.len(), m.unmatched, m.wrong_digest), (0, 0, 1));
        assert!(w.contains(1), "the row keeps waiting");
        assert_eq!(w.receipt(&receipt("s", &[A])).rows, vec![1]);
    }

    #[test]
    fn rows_without_a_receipt_come_back_after_the_timeout_in_row_order() {
        let t = Instant::now();
        let mut w = Awaiting::new(10);
        w.delivered(5, s("s", B), D, t);
        w.delivered(3, s("s", A), D, t);
        w.delivered(9, s("s", C), D, t + Duration::from_secs(5));
        // A second PUBACK of row 5 keeps its first time.
        w.delivered(5, s("s", B), D, t + Duration::from_secs(6));
        let to = Duration::from_secs(10);
        assert!(w.expired(t + Duration::from_secs(9), to).is_empty());
        assert_eq!(
            w.oldest_age(t + Duration::from_secs(9)),
            Some(Duration::from_secs(9))
        );
        assert_eq!(w.expired(t + Duration::from_secs(10), to), vec![3, 5]);
        assert_eq!(w.len(), 1);
        assert!(w.contains(9) && !w.contains(5));
        assert_eq!(w.expired(t + Duration::from_secs(15), to), vec![9]);
        assert_eq!(w.oldest_age(t), None);
    }

    #[test]
    fn the_book_is_bounded_and_a_requeued_id_follows_its_newer_row() {
        let t = Instant::now();
        let mut w = Awaiting::new(2);
        w.delivered(1, s("s", A), D, t);
        assert!(!w.is_full());
        w.delivered(2, s("s", B), D, t);
        assert!(w.is_full());
        // A FAILED row requeued: same id, new row.
        w.delivered(3, s("s", A), D, t);
        assert!(!w.contains(1) && w.contains(3));
        assert_eq!(w.receipt(&receipt("s", &[A])).rows, vec![3]);
        w.remove(&[2]);
        assert!(w.is_empty());
        w.delivered(4, s("s", C), D, t);
        assert_eq!(w.drain(), vec![4]);
        assert!(w.is_empty());
    }
}
