//! Receipts: the fleet's word that its database stored an event, and the
//! bookkeeping of the rows that wait for one.
//!
//! A PUBACK proves the broker has a message, nothing more: brokers drop
//! acknowledged QoS 1 messages (queue caps, a local relay restarted, lossy
//! persistence). With `mqtt.retire_on = "receipt"` a PUBACKed row waits here
//! until a receipt from the sink names its own event id; only then is it
//! retired (`ACKED`). Its one rule: **a receipt retires only rows that are
//! waiting for one (PUBACKed, same stream, same event id); anything else in
//! it retires nothing and is counted**, and a row not covered within the
//! timeout is published again with the same id and bytes.
//!
//! Wire format, on `<topic_prefix>/receipts` (QoS 1, JSON, at most
//! [`MAX_RECEIPT_BYTES`] bytes and [`MAX_RECEIPT_EVENTS`] ids):
//!
//! ```text
//! {"v":1,"stored":{"<stream>":["<event id>", ...], ...}}
//! ```
//!
//! An event id is the hyphenated lowercase form (36 characters) the
//! envelope carries. Pure: time is passed in, nothing here does I/O.

use crate::stream::topic_safe;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest receipt accepted, bytes.
pub const MAX_RECEIPT_BYTES: usize = 64 * 1024;
/// Most event ids one receipt may name; the sink splits larger sets.
pub const MAX_RECEIPT_EVENTS: usize = 1024;
/// Most streams one receipt may name.
const MAX_RECEIPT_STREAMS: usize = 64;

/// A receipt, checked: per stream, the event ids the sink's database holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Receipt {
    /// `(stream, event ids)`, in the order the receipt gave them.
    pub stored: Vec<(String, Vec<String>)>,
}

impl Receipt {
    /// Event ids named, all streams.
    pub fn len(&self) -> usize {
        self.stored.iter().map(|(_, ids)| ids.len()).sum()
    }

    /// Whether it names no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a receipt was refused (it retires nothing; the caller counts it as
/// `receipts_malformed` and logs the reason, rate-limited).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    /// Larger than [`MAX_RECEIPT_BYTES`].
    #[error("receipt of {0} bytes is over the limit of {MAX_RECEIPT_BYTES}")]
    TooLarge(usize),
    /// Not the JSON shape above (the parser's message).
    #[error("receipt is not {{\"v\":1,\"stored\":{{stream:[event ids]}}}}: {0}")]
    Shape(String),
    /// A version this agent does not know.
    #[error("receipt version {0} is not 1")]
    Version(u64),
    /// More than [`MAX_RECEIPT_EVENTS`] ids or too many streams.
    #[error("receipt names {0} events (at most {MAX_RECEIPT_EVENTS})")]
    TooMany(usize),
    /// A stream name that no agent stream can have.
    #[error("receipt names an invalid stream {0:?}")]
    Stream(String),
    /// An event id that is not the 36-character hyphenated form.
    #[error("receipt names an invalid event id {0:?}")]
    EventId(String),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    v: u64,
    stored: serde_json::Map<String, serde_json::Value>,
}

/// Read and check a receipt's payload. Strict: unknown keys, bad stream
/// names, malformed ids and oversized receipts are refused whole.
///
/// Errors: [`ReceiptError`], naming what was wrong.
pub fn parse(payload: &[u8]) -> Result<Receipt, ReceiptError> {
    if payload.len() > MAX_RECEIPT_BYTES {
        return Err(ReceiptError::TooLarge(payload.len()));
    }
    let w: Wire =
        serde_json::from_slice(payload).map_err(|e| ReceiptError::Shape(e.to_string()))?;
    if w.v != 1 {
        return Err(ReceiptError::Version(w.v));
    }
    if w.stored.len() > MAX_RECEIPT_STREAMS {
        return Err(ReceiptError::TooMany(w.stored.len()));
    }
    let mut out = Receipt::default();
    let mut total = 0usize;
    for (stream, ids) in w.stored {
        if stream.is_empty() || stream.len() > 64 || !stream.chars().all(topic_safe) {
            return Err(ReceiptError::Stream(stream));
        }
        let serde_json::Value::Array(ids) = ids else {
            return Err(ReceiptError::Shape(format!(
                "stored.{stream} is not an array"
            )));
        };
        total += ids.len();
        if total > MAX_RECEIPT_EVENTS {
            return Err(ReceiptError::TooMany(total));
        }
        let mut list = Vec::with_capacity(ids.len());
        for id in ids {
            match id {
                serde_json::Value::String(s) if event_id_ok(&s) => list.push(s),
                other => return Err(ReceiptError::EventId(other.to_string())),
            }
        }
        out.stored.push((stream, list));
    }
    Ok(out)
}

/// The payloads of receipts for `stored` (`(stream, event id)` pairs, in
/// any order), each within [`MAX_RECEIPT_EVENTS`] ids.
pub fn encode(stored: &[(&str, &str)]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for chunk in stored.chunks(MAX_RECEIPT_EVENTS) {
        let mut by: Vec<(&str, Vec<&str>)> = Vec::new();
        for (stream, id) in chunk {
            match by.iter_mut().find(|(s, _)| s == stream) {
                Some((_, ids)) => ids.push(id),
                None => by.push((stream, vec![id])),
            }
        }
        // A receipt names at most MAX_RECEIPT_STREAMS streams.
        for part in by.chunks(MAX_RECEIPT_STREAMS) {
            let stored: serde_json::Map<String, serde_json::Value> = part
                .iter()
                .map(|(s, ids)| ((*s).to_owned(), serde_json::json!(ids)))
                .collect();
            out.push(
                serde_json::json!({"v": 1, "stored": stored})
                    .to_string()
                    .into_bytes(),
            );
        }
    }
    out
}

/// Whether `s` is an event id as the envelope writes it: 8-4-4-4-12
/// lowercase hex.
pub fn event_id_ok(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        })
}

/// What one receipt did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Matched {
    /// Rows now stored at the fleet: retire them.
    pub rows: Vec<i64>,
    /// Ids named that no waiting row has (not yet PUBACKed, already
    /// retired, another board's, forged): counted, nothing retired.
    pub unmatched: usize,
}

/// A waiting row.
#[derive(Debug, Clone)]
struct Entry {
    row: i64,
}

/// Rows PUBACKed and waiting for their receipt, bounded by `cap`.
#[derive(Debug)]
pub struct Awaiting {
    by_key: HashMap<(Arc<str>, String), Entry>,
    by_row: HashMap<i64, (Arc<str>, String)>,
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

    /// `row` (of `stream`, with `event_id`) was PUBACKed at `now`: it waits.
    /// A row already waiting keeps its first time (its timeout runs from its
    /// first PUBACK).
    pub fn delivered(&mut self, row: i64, stream: Arc<str>, event_id: String, now: Instant) {
        if self.by_row.contains_key(&row) {
            return;
        }
        let key = (stream, event_id);
        if let Some(old) = self.by_key.insert(key.clone(), Entry { row }) {
            // One event id on two rows (a requeued FAILED row): the newer row
            // is the one the spool keeps; the older is forgotten here.
            self.by_row.remove(&old.row);
        }
        self.by_row.insert(row, key);
        self.order.push_back((now, row));
    }

    /// Apply `r`: the waiting rows it names leave the book and are returned
    /// for retirement.
    pub fn receipt(&mut self, r: &Receipt) -> Matched {
        let mut m = Matched::default();
        for (stream, ids) in &r.stored {
            for id in ids {
                // The key's stream is an Arc<str>: look up with an owned one.
                let key: (Arc<str>, String) = (Arc::from(stream.as_str()), id.clone());
                match self.by_key.remove(&key) {
                    Some(e) => {
                        self.by_row.remove(&e.row);
                        m.rows.push(e.row);
                    }
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

    /// Forget `rows` (retired another way: the fallback to PUBACKs).
    pub fn remove(&mut self, rows: &[i64]) {
        for row in rows {
            if let Some(key) = self.by_row.remove(row) {
                self.by_key.remove(&key);
            }
        }
        self.trim_order();
    }

    /// Every waiting row, leaving the book empty (in row order).
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

    const A: &str = "0123abcd-0000-4000-8000-00000000000a";
    const B: &str = "0123abcd-0000-4000-8000-00000000000b";
    const C: &str = "0123abcd-0000-4000-8000-00000000000c";

    fn receipt(stream: &str, ids: &[&str]) -> Receipt {
        parse(&encode(&ids.iter().map(|i| (stream, *i)).collect::<Vec<_>>())[0]).unwrap()
    }

    #[test]
    fn a_receipt_round_trips_and_names_its_streams() {
        let bytes = encode(&[("s", A), ("t", B), ("s", C)]);
        assert_eq!(bytes.len(), 1);
        let r = parse(&bytes[0]).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(
            r.stored,
            vec![
                ("s".to_owned(), vec![A.to_owned(), C.to_owned()]),
                ("t".to_owned(), vec![B.to_owned()])
            ]
        );
    }

    #[test]
    fn malformed_receipts_are_refused_whole() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "is not"),
            (br#"{"v":2,"stored":{}}"#, "version 2"),
            (br#"{"v":1,"stored":{},"x":1}"#, "unknown field"),
            (br#"{"v":1,"stored":{"s":"a"}}"#, "not an array"),
            (br#"{"v":1,"stored":{"a/b":[]}}"#, "invalid stream"),
            (br#"{"v":1,"stored":{"s":["nope"]}}"#, "invalid event id"),
            (br#"{"v":1,"stored":{"s":[1]}}"#, "invalid event id"),
            (
                br#"{"v":1,"stored":{"s":["0123ABCD-0000-4000-8000-00000000000a"]}}"#,
                "invalid event id",
            ),
        ];
        for (p, want) in cases {
            let e = parse(p).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(p));
        }
        let big = vec![b' '; MAX_RECEIPT_BYTES + 1];
        assert_eq!(
            parse(&big),
            Err(ReceiptError::TooLarge(MAX_RECEIPT_BYTES + 1))
        );
        let many: Vec<(&str, &str)> = (0..=MAX_RECEIPT_EVENTS).map(|_| ("s", A)).collect();
        let mut one = String::from(r#"{"v":1,"stored":{"s":["#);
        one.push_str(&vec![format!("\"{A}\""); many.len()].join(","));
        one.push_str("]}}");
        assert!(matches!(
            parse(one.as_bytes()),
            Err(ReceiptError::TooMany(_))
        ));
        // The encoder splits what one receipt may not hold.
        assert_eq!(encode(&many).len(), 2);
    }

    #[test]
    fn only_waiting_rows_with_their_own_stream_and_id_are_retired() {
        let t = Instant::now();
        let mut w = Awaiting::new(10);
        w.delivered(1, Arc::from("s"), A.to_owned(), t);
        w.delivered(2, Arc::from("s"), B.to_owned(), t);
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
    fn rows_without_a_receipt_come_back_after_the_timeout_in_row_order() {
        let t = Instant::now();
        let mut w = Awaiting::new(10);
        w.delivered(5, Arc::from("s"), B.to_owned(), t);
        w.delivered(3, Arc::from("s"), A.to_owned(), t);
        w.delivered(9, Arc::from("s"), C.to_owned(), t + Duration::from_secs(5));
        // A second PUBACK of row 5 keeps its first time.
        w.delivered(5, Arc::from("s"), B.to_owned(), t + Duration::from_secs(6));
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
        w.delivered(1, Arc::from("s"), A.to_owned(), t);
        assert!(!w.is_full());
        w.delivered(2, Arc::from("s"), B.to_owned(), t);
        assert!(w.is_full());
        // A FAILED row requeued: same id, new row.
        w.delivered(3, Arc::from("s"), A.to_owned(), t);
        assert!(!w.contains(1) && w.contains(3));
        assert_eq!(w.receipt(&receipt("s", &[A])).rows, vec![3]);
        w.remove(&[2]);
        assert!(w.is_empty());
        w.delivered(4, Arc::from("s"), C.to_owned(), t);
        assert_eq!(w.drain(), vec![4]);
        assert!(w.is_empty());
    }

    #[test]
    fn only_the_envelopes_id_form_is_an_event_id() {
        assert!(event_id_ok(A));
        assert!(!event_id_ok(&A.replace('-', "x")));
        assert!(!event_id_ok(&A[1..]));
        assert!(!event_id_ok(&A.to_uppercase()));
    }
}
