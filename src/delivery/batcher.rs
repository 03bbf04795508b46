//! The delivery thread's batch assembly ([`crate::event::batching`]): rows of
//! batched streams wait here, per stream and in row-id order, until a batch
//! is full, would grow past the payload limit, changes wire format, or its
//! first row has waited `batch_max_ms`; then they leave as one [`Ready`].
//!
//! Nothing here retires or skips a row: rows waiting in a batch are in no
//! queue the MQTT thread sees, and after a lost connection [`Batcher::clear`]
//! drops them and the lanes read them again from the spool.

use crate::event::batching::{self, Pending};
use crate::event::envelope::EventId;
use crate::event::stream::BatchSpec;
use crate::mqtt::Ready;
use crate::spool::OutRow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A row waiting in a batch: id, event id, stored bytes.
type Row = (i64, EventId, Vec<u8>);

/// Batches being gathered, per stream.
#[derive(Debug)]
pub(super) struct Batcher {
    specs: HashMap<String, BatchSpec>,
    pending: HashMap<String, Pending<Row>>,
    prefix: String,
    /// Whole-packet size of each batch offered in this epoch, by its first
    /// row (forgotten at a lost connection).
    offered: HashMap<i64, usize>,
    /// A bound on batch packets learned from dropped connections (see
    /// [`Batcher::quick_loss`]); kept for the run.
    cap: Option<usize>,
}

impl Batcher {
    /// Batches for the streams in `specs`, published under `prefix`
    /// (`mqtt.topic_prefix`).
    pub(super) fn new(prefix: &str, specs: HashMap<String, BatchSpec>) -> Batcher {
        Batcher {
            specs,
            pending: HashMap::new(),
            prefix: prefix.to_owned(),
            offered: HashMap::new(),
            cap: None,
        }
    }

    /// Note the packet size of an offered batch (first row `row`).
    pub(super) fn offered(&mut self, row: i64, size: usize) {
        if self.offered.len() < 4 * crate::mqtt::ackmap::MAX_WINDOW {
            self.offered.insert(row, size);
        }
    }

    /// The connection dropped soon after CONNACK with `in_flight` rows
    /// unacknowledged. A broker's packet limit drops the connection on a
    /// batch over it (MQTT 3.1.1 has no other way to say so), and rows sent
    /// one at a time never find the culprit: each row fits alone. So when a
    /// batch larger than any packet acknowledged (`largest_acked`) was in
    /// flight, batches are held to half its size from then on (a few
    /// halvings reach any limit; single rows are not affected). Forgets
    /// the sizes of this epoch's batches either way. Returns the new bound
    /// when it changed, for the log.
    pub(super) fn quick_loss(&mut self, in_flight: &[i64], largest_acked: usize) -> Option<usize> {
        let biggest = in_flight
            .iter()
            .filter_map(|r| self.offered.get(r).copied())
            .max();
        self.offered.clear();
        let size = biggest.filter(|&s| s > largest_acked)?;
        let cap = (size / 2).max(1);
        if self.cap.is_some_and(|c| c <= cap) {
            return None;
        }
        self.cap = Some(cap);
        Some(cap)
    }

    /// The learned bound on batch packets, if any.
    pub(super) fn cap(&self) -> Option<usize> {
        self.cap
    }

    /// The batching of `stream`, if it is batched.
    pub(super) fn spec(&self, stream: &str) -> Option<BatchSpec> {
        self.specs.get(stream).copied()
    }

    /// The longest topic a batch of `stream` can have (with a compression
    /// level), for the packet size bound.
    pub(super) fn topic_len(&self, stream: &str) -> usize {
        self.prefix.len() + "/batches/".len() + stream.len() + "/zstd".len()
    }

    /// Add `row` of a batched stream, admitted with `event_id` (its own,
    /// read from the spool). `limit`: the largest uncompressed batch
    /// payload that fits the payload and packet limits. Returns what is
    /// ready to go: the batch the row completes, or the one it could not
    /// join (past `limit`, or another wire format).
    pub(super) fn add(
        &mut self,
        (row, event_id): (OutRow, EventId),
        spec: BatchSpec,
        limit: usize,
    ) -> Vec<Ready> {
        let json = batching::is_json(&row.payload);
        let len = row.payload.len();
        let mut out = Vec::new();
        let OutRow {
            id,
            stream,
            payload,
            ..
        } = row;
        let entry = (id, event_id, payload);
        // One lookup per row in the common case: the row joins its
        // stream's batch, which is not full yet.
        let full = match self.pending.get_mut(&stream) {
            Some(p) if p.json == json && p.size_with(len) <= limit => {
                p.rows.push(entry);
                p.bytes += len;
                p.rows.len() >= spec.max_events
            }
            other => {
                // The batch it could not join leaves first (I7).
                let fresh = Pending::new(entry, json, len);
                match other {
                    Some(p) => {
                        let closed = std::mem::replace(p, fresh);
                        out.extend(self.build(&stream, closed, spec));
                    }
                    None => {
                        self.pending.insert(stream.clone(), fresh);
                    }
                }
                spec.max_events <= 1
            }
        };
        if full {
            if let Some(p) = self.pending.remove(&stream) {
                out.extend(self.build(&stream, p, spec));
            }
        }
        out
    }

    /// Batches whose first row has waited `batch_max_ms` by `now`.
    pub(super) fn due(&mut self, now: Instant) -> Vec<Ready> {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(s, p)| {
                self.specs
                    .get(*s)
                    .is_none_or(|spec| now.duration_since(p.since) >= spec.max_wait)
            })
            .map(|(s, _)| s.clone())
            .collect();
        let mut out = Vec::new();
        for stream in due {
            if let (Some(p), Some(spec)) = (self.pending.remove(&stream), self.spec(&stream)) {
                out.extend(self.build(&stream, p, spec));
            }
        }
        out
    }

    /// When the next partial batch is due, if one waits.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.pending
            .iter()
            .filter_map(|(s, p)| Some(p.since + self.specs.get(s)?.max_wait))
            .min()
    }

    /// Forget every waiting row (a lost connection: they are read again)
    /// and the sizes of the batches offered.
    pub(super) fn clear(&mut self) {
        self.pending.clear();
        self.offered.clear();
    }

    /// One PUBLISH for `p`: a batch of two or more rows, a single row as
    /// itself; if the batch cannot be built, every row on its own.
    fn build(&self, stream: &str, p: Pending<Row>, spec: BatchSpec) -> Vec<Ready> {
        if p.rows.len() > 1 {
            let events: Vec<&[u8]> = p.rows.iter().map(|r| r.2.as_slice()).collect();
            match batching::payload(&events, p.json, spec.compression) {
                Ok(payload) => {
                    let topic = format!(
                        "{}/batches/{stream}{}",
                        self.prefix,
                        spec.compression.topic_suffix()
                    );
                    return vec![Ready {
                        row: p.rows[0].0,
                        topic: Arc::from(topic),
                        payload,
                        event_id: None,
                        members: p.rows.iter().map(|r| r.0).collect(),
                    }];
                }
                Err(e) => log::warn!(
                    "delivery: stream {stream}: a batch of {} events could not be built ({e}); sending them one by one",
                    p.rows.len()
                ),
            }
        }
        let topic: Arc<str> = Arc::from(format!("{}/events/{stream}", self.prefix));
        p.rows
            .into_iter()
            .map(|(id, event_id, payload)| Ready {
                row: id,
                topic: topic.clone(),
                payload,
                event_id: Some(event_id),
                members: Vec::new(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::stream::Compression;
    use std::time::Duration;

    /// Row `id` as admitted: with its event id, all bytes `id`.
    fn row(id: i64, stream: &str, payload: &str) -> (OutRow, EventId) {
        let event_id = EventId([id as u8; 16]);
        let row = OutRow {
            id,
            event_id: Some(event_id),
            stream: stream.to_owned(),
            payload: payload.as_bytes().to_vec(),
            digest: None,
            prio: 0,
        };
        (row, event_id)
    }

    fn spec(n: usize) -> BatchSpec {
        BatchSpec {
            max_events: n,
            max_wait: Duration::from_millis(0),
            compression: Compression::None,
        }
    }

    #[test]
    fn a_full_batch_leaves_at_once_with_every_member_in_row_order() {
        let mut b = Batcher::new("p", [("t".to_owned(), spec(3))].into());
        assert!(b.add(row(1, "t", "{\"a\":1}"), spec(3), 10_000).is_empty());
        assert!(b.add(row(2, "t", "{\"a\":2}"), spec(3), 10_000).is_empty());
        let out = b.add(row(5, "t", "{\"a\":5}"), spec(3), 10_000);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].members, [1, 2, 5]);
        assert_eq!(out[0].row, 1);
        assert_eq!(
            out[0].event_id, None,
            "a batch's events carry their own ids"
        );
        assert_eq!(&*out[0].topic, "p/batches/t");
        assert_eq!(out[0].payload, br#"{"batch":[{"a":1},{"a":2},{"a":5}]}"#);
        assert!(b.next_due().is_none());
    }

    #[test]
    fn a_row_past_the_size_limit_or_of_another_format_closes_the_batch() {
        let mut b = Batcher::new("p", [("t".to_owned(), spec(10))].into());
        let big = format!("{{\"v\":\"{}\"}}", "x".repeat(100));
        assert!(b.add(row(1, "t", &big), spec(10), 200).is_empty());
        let out = b.add(row(2, "t", &big), spec(10), 200);
        // Two would exceed 200 bytes: the first leaves alone, as a single event.
        assert_eq!(out.len(), 1);
        assert!(out[0].members.is_empty());
        assert_eq!(&*out[0].topic, "p/events/t");
        assert_eq!(out[0].event_id, Some(EventId([1; 16])));
        let out = b.add(row(3, "t", "\u{1}postcard"), spec(10), 200);
        assert_eq!(out.len(), 1, "a format change closes the JSON batch");
        assert_eq!(out[0].row, 2);
    }

    #[test]
    fn a_batch_in_flight_at_a_quick_disconnect_halves_the_batch_bound() {
        let mut b = Batcher::new("p", [("t".to_owned(), spec(3))].into());
        b.offered(1, 9_000);
        b.offered(60, 300);
        // Rows 1..=50 were the batch, 60 a single row.
        let in_flight: Vec<i64> = (1..=50).chain([60]).collect();
        assert_eq!(b.quick_loss(&in_flight, 2_500), Some(4_500));
        assert_eq!(b.cap(), Some(4_500));
        b.offered(70, 4_400);
        assert_eq!(b.quick_loss(&[70, 71], 2_500), Some(2_200));
        // No batch in flight, or one no larger than a packet acknowledged:
        // the bound stays.
        assert_eq!(b.quick_loss(&[80], 2_500), None);
        b.offered(90, 2_100);
        assert_eq!(b.quick_loss(&[90, 91], 2_500), None);
        assert_eq!(b.cap(), Some(2_200));
    }

    #[test]
    fn a_partial_batch_waits_for_its_deadline_then_leaves() {
        let s = BatchSpec {
            max_wait: Duration::from_secs(60),
            ..spec(50)
        };
        let mut b = Batcher::new("p", [("t".to_owned(), s)].into());
        b.add(row(1, "t", "{}"), s, 10_000);
        b.add(row(2, "t", "{}"), s, 10_000);
        assert!(b.due(Instant::now()).is_empty());
        let at = b.next_due().expect("a deadline");
        let out = b.due(at);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].members, [1, 2]);
        b.add(row(3, "t", "{}"), s, 10_000);
        b.clear();
        assert!(
            b.due(at + Duration::from_secs(61)).is_empty(),
            "cleared rows are read again, not sent"
        );
    }
}
