//! The delivery records waiting for a commit: the highest row submitted
//! (the SENT mark) and the rows whose PUBACK (or receipt) arrived. The
//! delivery thread adds them; the writer thread takes them into its next
//! commit, where they ride the readings' transaction
//! ([`crate::spool::Riders`]) instead of a commit of their own (issue 35).
//!
//! Counters of the delivery thread (`events_deferred_<reason>`) wait here
//! too, and ride whatever commit takes the records; they never ask for one.
//!
//! One rule: **a row the ledger holds is not offered again** until its
//! record has committed (it is acknowledged; only a commit that fails puts
//! the record back, to be taken by the next one). A crash loses the records
//! not yet committed: their rows are sent again with the same event id and
//! bytes (duplicates, never loss, I2).

use crate::intake::IngestMsg;
use std::collections::{BTreeMap, HashSet};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Records waiting past which the writer commits at once instead of at
/// the close of its window: at 100 readings a second a 60 s window holds
/// fewer; a drain after an outage reaches it in a second or two.
pub const RECORD_BATCH: usize = 8192;

/// With no writer to take them (delivery run on its own, as the throughput
/// bench does), records wait this long for the delivery thread's own commit.
pub const STANDALONE_INTERVAL: Duration = Duration::from_secs(1);

/// Records a commit took ([`Ledger::take`]): give them back with
/// [`Ledger::committed`] or [`Ledger::restore`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// The highest row submitted, if it moved.
    pub sent: Vec<i64>,
    /// Rows acknowledged.
    pub acked: Vec<i64>,
    /// Counter increments, name and amount (the taker stores them or
    /// gives them back with [`Ledger::count`]).
    pub counts: Vec<(String, i64)>,
}

impl Taken {
    /// Nothing was taken.
    pub fn is_empty(&self) -> bool {
        self.sent.is_empty() && self.acked.is_empty() && self.counts.is_empty()
    }
}

#[derive(Debug, Default)]
struct Book {
    sent: Option<i64>,
    acked: Vec<i64>,
    /// Every acknowledged row not yet committed: waiting or taken.
    holds: HashSet<i64>,
    /// The writer was woken for what waits (and, urgently, for a full batch).
    woken: bool,
    urged: bool,
    /// When the oldest waiting record came.
    since: Option<Instant>,
    /// Counter increments waiting to ride a commit.
    counts: BTreeMap<String, i64>,
}

/// The delivery records of this run ([`self`]). Cloning shares them.
#[derive(Debug, Clone)]
pub struct Ledger {
    book: Arc<Mutex<Book>>,
    /// The writer's channel: records waiting open its commit window.
    wake: Option<Sender<IngestMsg>>,
}

impl Ledger {
    /// An empty ledger whose records wake the writer through `wake` (none:
    /// the caller commits them itself, as tests do).
    pub fn new(wake: Option<Sender<IngestMsg>>) -> Ledger {
        Ledger {
            book: Arc::default(),
            wake,
        }
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        // panic = "abort" in release: a poisoned lock only happens in tests.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows were submitted up to `high` and `acked` were acknowledged: they
    /// wait for the writer's next commit, which this wakes (at once when a
    /// batch of [`RECORD_BATCH`] waits).
    pub fn add(&self, high: Option<i64>, acked: Vec<i64>) {
        if high.is_none() && acked.is_empty() {
            return;
        }
        let mut b = self.book();
        b.since.get_or_insert_with(Instant::now);
        b.sent = b.sent.max(high);
        b.holds.extend(acked.iter().copied());
        b.acked.extend(acked);
        let now = b.acked.len() >= RECORD_BATCH && !b.urged;
        let wake = !b.woken || now;
        b.woken = true;
        b.urged |= now;
        drop(b);
        if let (true, Some(tx)) = (wake, &self.wake) {
            let _ = tx.send(IngestMsg::Records { now });
        }
    }

    /// Add `counts` (counter name, amount) to what the next commit takes.
    /// They never wake the writer: a counter need not reach the file
    /// before the readings' or the records' next commit (issue 35).
    pub fn count(&self, counts: impl IntoIterator<Item = (String, i64)>) {
        let mut b = self.book();
        for (name, by) in counts {
            *b.counts.entry(name).or_default() += by;
        }
    }

    /// Whether `row` is acknowledged and its record not yet committed.
    pub fn holds(&self, row: i64) -> bool {
        self.book().holds.contains(&row)
    }

    /// Acknowledged rows whose record has not committed yet.
    pub fn uncommitted(&self) -> usize {
        self.book().holds.len()
    }

    /// Whether records wait for a commit.
    pub fn waiting(&self) -> bool {
        let b = self.book();
        b.sent.is_some() || !b.acked.is_empty()
    }

    /// No writer takes these records: the delivery thread commits them
    /// itself once [`Ledger::standalone_due`].
    pub fn standalone(&self) -> bool {
        self.wake.is_none()
    }

    /// Records have waited [`STANDALONE_INTERVAL`], or a batch is full.
    pub fn standalone_due(&self) -> bool {
        let b = self.book();
        b.acked.len() >= RECORD_BATCH || b.since.is_some_and(|t| t.elapsed() >= STANDALONE_INTERVAL)
    }

    /// Take what waits, for a commit (the rows stay held until
    /// [`Ledger::committed`]).
    pub fn take(&self) -> Taken {
        let mut b = self.book();
        b.woken = false;
        b.urged = false;
        b.since = None;
        Taken {
            sent: b.sent.take().into_iter().collect(),
            acked: std::mem::take(&mut b.acked),
            counts: std::mem::take(&mut b.counts).into_iter().collect(),
        }
    }

    /// The commit holding `t` stored it (the committer counts the rows it
    /// retired in [`super::DeliveryStats::retired`]).
    pub fn committed(&self, t: Taken) {
        let mut b = self.book();
        for id in &t.acked {
            b.holds.remove(id);
        }
    }

    /// The commit holding `t` failed: its records wait again, first, and
    /// wake the writer again.
    pub fn restore(&self, t: Taken) {
        if t.is_empty() {
            return;
        }
        let mut b = self.book();
        b.sent = b.sent.max(t.sent.into_iter().max());
        let later = std::mem::replace(&mut b.acked, t.acked);
        b.acked.extend(later);
        for (name, by) in t.counts {
            *b.counts.entry(name).or_default() += by;
        }
        b.woken = false;
        b.since.get_or_insert_with(Instant::now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger() -> (Ledger, std::sync::mpsc::Receiver<IngestMsg>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Ledger::new(Some(tx)), rx)
    }

    fn wakes(rx: &std::sync::mpsc::Receiver<IngestMsg>) -> Vec<bool> {
        rx.try_iter()
            .map(|m| match m {
                IngestMsg::Records { now } => now,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn records_wake_the_writer_once_until_it_takes_them() {
        let (l, rx) = ledger();
        l.add(Some(3), vec![1, 2]);
        l.add(Some(5), vec![3]);
        assert_eq!(wakes(&rx), vec![false], "one wake for what waits");
        assert!(l.holds(2) && l.waiting());
        let t = l.take();
        assert_eq!(
            t,
            Taken {
                sent: vec![5],
                acked: vec![1, 2, 3],
                counts: Vec::new(),
            }
        );
        // Taken, not committed: still held, so not offered again.
        assert!(l.holds(3) && !l.waiting());
        l.add(None, vec![4]);
        assert_eq!(wakes(&rx), vec![false]);
        l.committed(t);
        assert!(!l.holds(1) && l.holds(4));
    }

    #[test]
    fn a_failed_commit_puts_its_records_back_first() {
        let (l, rx) = ledger();
        l.add(Some(2), vec![1, 2]);
        let t = l.take();
        l.add(Some(4), vec![3, 4]);
        l.restore(t);
        let again = l.take();
        assert_eq!(again.sent, vec![4]);
        assert_eq!(again.acked, vec![1, 2, 3, 4]);
        assert_eq!(l.uncommitted(), 4);
        let _ = wakes(&rx);
    }

    #[test]
    fn counters_wait_for_a_commit_without_asking_for_one() {
        let (l, rx) = ledger();
        l.count([("events_deferred_x".to_owned(), 2)]);
        l.count([("events_deferred_x".to_owned(), 1)]);
        assert!(wakes(&rx).is_empty(), "a counter woke the writer");
        assert!(!l.waiting(), "a counter reads as a record waiting");
        let t = l.take();
        assert_eq!(t.counts, vec![("events_deferred_x".to_owned(), 3)]);
        l.restore(t);
        assert_eq!(l.take().counts, vec![("events_deferred_x".to_owned(), 3)]);
    }

    #[test]
    fn a_full_batch_asks_for_a_commit_at_once() {
        let (l, rx) = ledger();
        l.add(None, (0..RECORD_BATCH as i64 - 1).collect());
        l.add(None, vec![RECORD_BATCH as i64]);
        l.add(None, vec![RECORD_BATCH as i64 + 1]);
        assert_eq!(wakes(&rx), vec![false, true]);
    }
}
