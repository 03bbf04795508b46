//! Model check of the delivery bookkeeping (issue 15): the ack map
//! ([`crate::mqtt::ackmap`]) and the spool's state changes ([`crate::spool`], a real
//! SQLite file in a temporary directory) driven by random interleavings of
//! append, offer, publish, PUBACK (in order, out of order, duplicated, for a
//! packet id not outstanding), a refused submission, group commit, a lost
//! connection (with and without session), a restart (reopening the file,
//! after a clean stop or a kill that loses the uncommitted records), FAILED,
//! requeue and retention, against a small reference model.
//!
//! The driver does what the MQTT thread and the delivery thread do
//! (publisher.rs, mqtt/) in one thread: offer rows from the spool through
//! the real delivery lanes ([`crate::delivery::lanes`]: stream `s0` at priority 100,
//! the others 0, a 34% share for the lower priority, all reset at each new
//! connection), gather stream `s1`'s rows into batches of up to three that
//! one packet id carries and one PUBACK retires ([`crate::event::batching`]), skip
//! rows acknowledged but not yet committed, group-commit attempts and
//! retirements, commit them before a replay, and drop the map on any
//! inconsistency. The simulated
//! client gives packet ids as rumqttc does (cycling `1..=PKIDS`, a publish
//! held while its id is still outstanding) and the simulated broker
//! acknowledges what it received, in any order.
//!
//! Invariants checked after every step (docs/invariants.md):
//! - **I2** a row is retired (ACKED) only after the PUBACK of a publish
//!   that carried it arrived in the current connection, and the PUBACK
//!   the ack map matches is for the row the wire carried;
//! - **I1** no row vanishes: every appended row is unresolved (PENDING or
//!   SENT), ACKED, FAILED, or deleted by retention once ACKED; at the end of
//!   each case every row not FAILED is ACKED after a final drain;
//! - the acknowledged mark never passes an unresolved row;
//! - **I3** an event's id and payload bytes never change, across replays,
//!   restarts and requeues; no event id is issued twice, and each stream's
//!   sequence numbers are 1..=n, each once, across restarts;
//! - **I7** first offers of a stream in an epoch go in row-id order, and the
//!   first offer of a stream after a replay is its oldest unresolved row
//!   (none skipped); `live_first` (which reorders a stream on purpose) is
//!   out of the model.
//!
//! Receipt mode (`mqtt.retire_on = "receipt"`, issue 22) runs the same
//! steps with a simulated broker queue and sink: a PUBACKed row waits in the
//! real [`crate::delivery::awaiting::Awaiting`] book; the broker may lose what it
//! acknowledged; the sink stores what reaches it and sends receipts, which
//! arrive out of order, duplicated or never; forged receipts name rows that
//! are not waiting; a receipt timeout sends rows again. Checked besides:
//! - no row is retired without a receipt naming its own stream and event id
//!   while it waited (PUBACKed), and a forged receipt retires nothing;
//! - every row is eventually retired or sent again: the final drain ends
//!   with every row not FAILED stored and ACKED, whatever the broker lost.
//!
//! Out of the model: a duplicate PUBACK delivered after its packet id was
//! given to another publish. The client cannot tell it from that publish's
//! own PUBACK; brokers send one PUBACK per PUBLISH, and the client sends each
//! row once per connection, so it does not arise. A duplicate is delivered
//! at once here, and must be refused as an unknown packet id.

use crate::event::envelope::{CompactEnvelope, EventId, EventIdGen, Format};
use crate::event::reading::FieldValue;
use crate::mqtt::ackmap::{AckMap, Inconsistency};
use crate::spool::{NewEvent, Spool, SpoolOptions};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;

/// In-flight window, below [`PKIDS`] as in the agent (a packet id is never
/// reused while mapped).
const WINDOW: usize = 4;
/// rumqttc's `inflight`: packet ids cycle `1..=PKIDS`.
const PKIDS: u16 = 6;
const STREAMS: u8 = 3;

#[derive(Debug, Clone)]
enum Op {
    Append {
        stream: u8,
        n: u8,
    },
    Fill,
    Refuse,
    Outgoing,
    BrokerAck(u8),
    DeliverAck {
        index: u8,
        duplicate: bool,
    },
    StaleAck(u16),
    Flush,
    /// The connection dropped; the next CONNACK had a session or not.
    /// Both replay from the spool (the client is rebuilt, ack.rs), and the
    /// model checks that they do.
    Lost {
        session_present: bool,
    },
    Restart {
        clean: bool,
    },
    Fail(u8),
    Requeue,
    Retention(u8),
    /// Receipt mode: the sink stores an event the broker holds.
    SinkStores(u8),
    /// Receipt mode: the broker loses an event it acknowledged.
    BrokerLoses(u8),
    /// Receipt mode: a receipt reaches the agent (again, if `duplicate`).
    Receipt {
        index: u8,
        duplicate: bool,
    },
    /// Receipt mode: a receipt naming rows that are not waiting.
    ForgedReceipt(u8),
    /// Receipt mode: the receipt timeout passes.
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..STREAMS, 1u8..4).prop_map(|(stream, n)| Op::Append { stream, n }),
        5 => Just(Op::Fill),
        1 => Just(Op::Refuse),
        6 => Just(Op::Outgoing),
        5 => any::<u8>().prop_map(Op::BrokerAck),
        5 => (any::<u8>(), prop::bool::weighted(0.1))
            .prop_map(|(index, duplicate)| Op::DeliverAck { index, duplicate }),
        1 => (1..=PKIDS + 2).prop_map(Op::StaleAck),
        3 => Just(Op::Flush),
        1 => any::<bool>().prop_map(|session_present| Op::Lost { session_present }),
        1 => any::<bool>().prop_map(|clean| Op::Restart { clean }),
        1 => any::<u8>().prop_map(Op::Fail),
        1 => Just(Op::Requeue),
        1 => (1u8..4).prop_map(Op::Retention),
    ]
}

fn receipt_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(),
        3 => any::<u8>().prop_map(Op::SinkStores),
        1 => any::<u8>().prop_map(Op::BrokerLoses),
        3 => (any::<u8>(), prop::bool::weighted(0.1))
            .prop_map(|(index, duplicate)| Op::Receipt { index, duplicate }),
        1 => any::<u8>().prop_map(Op::ForgedReceipt),
        1 => Just(Op::Expire),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Unresolved,
    Acked,
    Failed,
    Purged,
}

#[derive(Debug, Clone)]
struct RowModel {
    status: Status,
    event_id: Option<EventId>,
    stream: String,
}

/// Stream whose rows go out in batches, and how many per batch.
const BATCHED: &str = "s1";
const BATCH: usize = 3;

struct World {
    _dir: tempfile::TempDir,
    path: PathBuf,
    spool: Spool,
    ids: EventIdGen,
    map: AckMap<i64>,
    clock_ms: i64,
    // The model.
    rows: BTreeMap<i64, RowModel>,
    next_id: i64,
    /// Event id -> payload bytes first seen (I3).
    payloads: HashMap<EventId, Vec<u8>>,
    /// Stream -> sequence numbers seen.
    seqs: HashMap<String, BTreeSet<u64>>,
    // The delivery thread.
    epoch: u64,
    lanes: crate::delivery::lanes::Lanes,
    /// Rows of the batched stream waiting for their batch.
    pending: Vec<i64>,
    /// Every publish's rows, by its handle (the first row).
    batches: HashMap<i64, Vec<i64>>,
    /// Publishes (handles) offered, not yet submitted.
    ready: VecDeque<i64>,
    retiring: BTreeSet<i64>,
    to_mark: Vec<i64>,
    to_retire: Vec<i64>,
    /// Highest row first offered in this epoch, per stream.
    last_offer: HashMap<String, i64>,
    // The simulated client and broker.
    channel: VecDeque<i64>,
    next_pkid: u16,
    wire: BTreeMap<u16, i64>,
    transit: Vec<(u16, i64)>,
    /// Lost connections whose next CONNACK had a session.
    resumed_sessions: u32,
    /// Receipt mode's simulated broker queue, sink and receipts.
    receipts: Option<ReceiptSim>,
}

/// Receipt mode: what the delivery thread keeps, and the world behind the
/// broker (its queue to the sink, the sink, the receipts on their way).
struct ReceiptSim {
    awaiting: crate::delivery::awaiting::Awaiting,
    base: std::time::Instant,
    /// Virtual time since `base`.
    t: std::time::Duration,
    /// Events the broker acknowledged and holds for the sink.
    queue: Vec<(String, EventId)>,
    /// Receipts the sink sent, not yet at the agent.
    in_flight: Vec<crate::event::receipts::Receipt>,
    /// Rows a receipt matched while they waited (only these may retire).
    matched: BTreeSet<i64>,
    /// Rows to send again (their receipt did not come in time).
    resend: VecDeque<i64>,
    /// Rows sent again in this epoch (outside the lanes' order, I7 does
    /// not apply to them).
    resent: BTreeSet<i64>,
}

/// Rows waiting for their receipt, at most, in the model.
const RECEIPT_WINDOW: usize = 5;

/// The digest a row's payload has in the model: a function of its id (the
/// sink names the digest of the bytes it stored, which are the row's).
fn digest_of(id: EventId) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[..16].copy_from_slice(&id.0);
    d[16..].copy_from_slice(&id.0);
    d
}

/// A receipt as the book sees it: one whose signature the delivery thread
/// already checked ([`crate::event::receipts::Receipt::check`]).
fn checked(
    stored: Vec<(String, Vec<crate::event::receipts::Stored>)>,
) -> crate::event::receipts::Receipt {
    let mut stored = stored;
    stored.sort_by(|a, b| a.0.cmp(&b.0));
    crate::event::receipts::Receipt {
        board: "model".into(),
        key: crate::event::signature::PublicKey([0; 32]),
        stored,
        sig: [0; crate::event::signature::SIGNATURE_BYTES],
    }
}
/// The receipt timeout, in the model's virtual time.
const RECEIPT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spool.db");
        let mut spool = Spool::open(&path, &SpoolOptions::default()).unwrap();
        spool
            .set_priorities(&[("s0".to_owned(), 100)].into())
            .unwrap();
        World {
            _dir: dir,
            path,
            spool,
            ids: EventIdGen::new().unwrap(),
            map: AckMap::new(),
            clock_ms: 1_790_000_000_000,
            rows: BTreeMap::new(),
            next_id: 1,
            payloads: HashMap::new(),
            seqs: HashMap::new(),
            epoch: 0,
            lanes: crate::delivery::lanes::Lanes::new(34, Default::default()),
            pending: Vec::new(),
            batches: HashMap::new(),
            ready: VecDeque::new(),
            retiring: BTreeSet::new(),
            to_mark: Vec::new(),
            to_retire: Vec::new(),
            last_offer: HashMap::new(),
            channel: VecDeque::new(),
            next_pkid: 1,
            wire: BTreeMap::new(),
            transit: Vec::new(),
            resumed_sessions: 0,
            receipts: None,
        }
    }

    /// A world in receipt mode.
    fn with_receipts() -> World {
        let mut w = World::new();
        w.receipts = Some(ReceiptSim {
            awaiting: crate::delivery::awaiting::Awaiting::new(RECEIPT_WINDOW),
            base: std::time::Instant::now(),
            t: std::time::Duration::ZERO,
            queue: Vec::new(),
            in_flight: Vec::new(),
            matched: BTreeSet::new(),
            resend: VecDeque::new(),
            resent: BTreeSet::new(),
        });
        w
    }

    /// Whether `row` waits for its receipt.
    fn awaits(&self, row: i64) -> bool {
        self.receipts
            .as_ref()
            .is_some_and(|r| r.awaiting.contains(row))
    }

    /// Whether `row` is out of the lanes' order: waiting for its receipt,
    /// or to be (or already) sent again for a missing one.
    fn outside_lanes(&self, row: i64) -> bool {
        self.receipts.as_ref().is_some_and(|r| {
            r.awaiting.contains(row) || r.resend.contains(&row) || r.resent.contains(&row)
        })
    }

    /// The (stream, event id) of `row`.
    fn key(&self, row: i64) -> (String, EventId) {
        let m = &self.rows[&row];
        (m.stream.clone(), m.event_id.unwrap_or(EventId([0; 16])))
    }

    fn outstanding(&self, pkid: u16) -> bool {
        self.wire.contains_key(&pkid) || self.transit.iter().any(|(p, _)| *p == pkid)
    }

    fn unresolved(&self) -> impl Iterator<Item = i64> + '_ {
        self.rows
            .iter()
            .filter(|(_, r)| r.status == Status::Unresolved)
            .map(|(id, _)| *id)
    }

    fn step(&mut self, op: &Op) {
        self.clock_ms += 10;
        match *op {
            Op::Append { stream, n } => {
                let name = format!("s{stream}");
                let events: Vec<NewEvent> = (0..n)
                    .map(|i| NewEvent {
                        stream: name.clone(),
                        ts_ms: self.clock_ms + i64::from(i),
                        clock_trusted: true,
                        mono: None,
                        fields: vec![("v".to_owned(), FieldValue::Num(f64::from(i) + 0.5))],
                        replay: None,
                        key: None,
                        reply: None,
                    })
                    .collect();
                let format = if stream == 1 {
                    Format::Postcard
                } else {
                    Format::Json
                };
                let appended = self
                    .spool
                    .append(&events, &mut self.ids, "model", format, self.clock_ms)
                    .unwrap();
                assert_eq!(appended, usize::from(n));
                for _ in 0..n {
                    self.rows.insert(
                        self.next_id,
                        RowModel {
                            status: Status::Unresolved,
                            event_id: None,
                            stream: name.clone(),
                        },
                    );
                    self.next_id += 1;
                }
            }
            Op::Fill => self.fill(),
            Op::Refuse => {
                if let Some(row) = self.map.submit_failed() {
                    assert_eq!(self.channel.pop_back(), Some(row));
                    self.ready.push_front(row);
                }
            }
            Op::Outgoing => {
                if self.channel.is_empty() || self.outstanding(self.next_pkid) {
                    // Nothing queued, or rumqttc holds the publish until
                    // the packet id's PUBACK (a collision).
                    return;
                }
                let pkid = self.next_pkid;
                self.next_pkid = pkid % PKIDS + 1;
                let row = self.channel.pop_front().unwrap();
                assert_eq!(self.map.on_outgoing_publish(pkid), Ok(()));
                self.wire.insert(pkid, row);
                self.to_mark.extend(self.members(row));
            }
            Op::BrokerAck(i) => {
                if self.wire.is_empty() {
                    return;
                }
                let pkid = *self
                    .wire
                    .keys()
                    .nth(usize::from(i) % self.wire.len())
                    .unwrap();
                let row = self.wire.remove(&pkid).unwrap();
                self.transit.push((pkid, row));
                let keys: Vec<(String, EventId)> =
                    self.members(row).into_iter().map(|r| self.key(r)).collect();
                if let Some(r) = self.receipts.as_mut() {
                    r.queue.extend(keys);
                }
            }
            Op::DeliverAck { index, duplicate } => {
                if self.transit.is_empty() {
                    return;
                }
                let (pkid, row) = self.transit.remove(usize::from(index) % self.transit.len());
                assert_eq!(
                    self.map.on_puback(pkid),
                    Ok(row),
                    "PUBACK {pkid} matched to a wrong row"
                );
                // One PUBACK retires every row its publish carried (in
                // receipt mode: they wait for their receipt instead).
                let rows = self.members(row);
                let keys: Vec<(i64, (String, EventId))> =
                    rows.iter().map(|r| (*r, self.key(*r))).collect();
                if let Some(r) = self.receipts.as_mut() {
                    let now = r.base + r.t;
                    for (row, (stream, id)) in keys {
                        r.resent.remove(&row);
                        r.awaiting
                            .delivered(row, (stream.into(), id), digest_of(id), now);
                    }
                } else {
                    self.to_retire.extend(&rows);
                    self.retiring.extend(rows);
                }
                if duplicate {
                    assert_eq!(
                        self.map.on_puback(pkid),
                        Err(Inconsistency::UnknownAck { pkid })
                    );
                    self.lost();
                }
            }
            Op::StaleAck(pkid) => {
                if self.outstanding(pkid) {
                    return;
                }
                assert_eq!(
                    self.map.on_puback(pkid),
                    Err(Inconsistency::UnknownAck { pkid })
                );
                self.lost();
            }
            Op::Flush => self.flush(),
            Op::Lost { session_present } => {
                // The client is rebuilt either way: a resumed session's
                // re-sends are never relied on (ack.rs), so both cases
                // replay from the spool.
                self.resumed_sessions += u32::from(session_present);
                self.lost();
            }
            Op::Restart { clean } => {
                if clean {
                    self.flush();
                    self.spool.persist_seqs().unwrap();
                }
                // A kill loses what was not committed: those rows are sent
                // again (duplicates, never loss).
                self.to_mark.clear();
                self.to_retire.clear();
                self.retiring.clear();
                if let Some(r) = self.receipts.as_mut() {
                    // The book is memory: its rows are unacknowledged rows
                    // of the spool again, sent again after the restart.
                    r.awaiting = crate::delivery::awaiting::Awaiting::new(RECEIPT_WINDOW);
                    r.matched.clear();
                    r.resend.clear();
                }
                self.spool = Spool::open(&self.path, &SpoolOptions::default()).unwrap();
                // What the agent does at every start.
                self.spool
                    .set_priorities(&[("s0".to_owned(), 100)].into())
                    .unwrap();
                self.ids = EventIdGen::new().unwrap();
                self.new_epoch();
            }
            Op::Fail(i) => {
                let handles: Vec<i64> = self.map.rows().chain(self.ready.iter().copied()).collect();
                let in_flight: BTreeSet<i64> = handles
                    .into_iter()
                    .flat_map(|h| self.members(h))
                    .chain(self.pending.iter().copied())
                    // Read ahead by the delivery thread: only it marks
                    // rows FAILED, never one it holds behind its back.
                    .chain(self.lanes.buffered_ids())
                    .collect();
                let candidates: Vec<i64> = self
                    .unresolved()
                    // Nor one its receipt book holds (waiting, or queued
                    // to be sent again): the delivery thread holds those.
                    .filter(|id| {
                        !in_flight.contains(id)
                            && !self.retiring.contains(id)
                            && !self.outside_lanes(*id)
                    })
                    .collect();
                if candidates.is_empty() {
                    return;
                }
                let id = candidates[usize::from(i) % candidates.len()];
                self.spool.mark_failed(id, "model", "model").unwrap();
                self.rows.get_mut(&id).unwrap().status = Status::Failed;
            }
            Op::Requeue => {
                let failed: Vec<i64> = self
                    .rows
                    .iter()
                    .filter(|(_, r)| r.status == Status::Failed)
                    .map(|(id, _)| *id)
                    .collect();
                let n = self.spool.requeue_failed(None).unwrap();
                assert_eq!(n, failed.len());
                for id in failed {
                    // Appended again after every row, with the same event id.
                    let old = self.rows.remove(&id).unwrap();
                    self.rows.insert(
                        self.next_id,
                        RowModel {
                            status: Status::Unresolved,
                            event_id: old.event_id,
                            stream: old.stream,
                        },
                    );
                    self.next_id += 1;
                }
            }
            Op::Retention(batch) => {
                let before: BTreeSet<i64> = self.db_rows().keys().copied().collect();
                let n = self
                    .spool
                    .purge_acked(i64::MAX, usize::from(batch))
                    .unwrap();
                let after: BTreeSet<i64> = self.db_rows().keys().copied().collect();
                let gone: Vec<i64> = before.difference(&after).copied().collect();
                assert_eq!(gone.len(), n);
                for id in gone {
                    let r = self.rows.get_mut(&id).unwrap();
                    assert_eq!(
                        r.status,
                        Status::Acked,
                        "retention deleted row {id}, {:?}",
                        r.status
                    );
                    r.status = Status::Purged;
                }
            }
            Op::SinkStores(_)
            | Op::BrokerLoses(_)
            | Op::Receipt { .. }
            | Op::ForgedReceipt(_)
            | Op::Expire => self.receipt_step(op),
        }
    }

    /// The receipt steps: the world behind the broker, and the agent's book.
    fn receipt_step(&mut self, op: &Op) {
        let forged: Vec<(String, EventId)> = match *op {
            Op::ForgedReceipt(i) => {
                // Rows that do not wait: unresolved ones not PUBACKed, and an
                // id no row has.
                let mut ids: Vec<(String, EventId)> = self
                    .unresolved()
                    .filter(|r| !self.awaits(*r) && self.rows[r].event_id.is_some())
                    .take(usize::from(i % 4))
                    .map(|r| self.key(r))
                    .collect();
                let mut no_row = [0u8; 16];
                no_row[6] = 0x40;
                no_row[8] = 0x80;
                no_row[15] = i;
                ids.push(("s0".to_owned(), EventId(no_row)));
                ids
            }
            _ => Vec::new(),
        };
        // Rows that wait, named with a digest not their bytes'.
        let wrong: Vec<(String, EventId)> = match *op {
            Op::ForgedReceipt(_) => self
                .unresolved()
                .filter(|r| self.awaits(*r))
                .map(|r| self.key(r))
                .collect(),
            _ => Vec::new(),
        };
        let Some(r) = self.receipts.as_mut() else {
            return;
        };
        match *op {
            Op::SinkStores(i) if !r.queue.is_empty() => {
                let (stream, id) = r.queue.remove(usize::from(i) % r.queue.len());
                r.in_flight
                    .push(checked(vec![(stream, vec![(id, digest_of(id))])]));
            }
            Op::BrokerLoses(i) if !r.queue.is_empty() => {
                r.queue.remove(usize::from(i) % r.queue.len());
            }
            Op::Receipt { index, duplicate } if !r.in_flight.is_empty() => {
                let at = usize::from(index) % r.in_flight.len();
                let receipt = if duplicate {
                    r.in_flight[at].clone()
                } else {
                    r.in_flight.remove(at)
                };
                let m = r.awaiting.receipt(&receipt);
                r.matched.extend(m.rows.iter().copied());
                // As the delivery thread does: a retired row read ahead
                // while it waited is not offered again from there.
                self.lanes.discard(&m.rows.iter().copied().collect());
                self.retiring.extend(m.rows.iter().copied());
                self.to_retire.extend(m.rows);
            }
            Op::ForgedReceipt(_) => {
                // Unknown ids, and waiting ones under other bytes' digest.
                let named = forged
                    .into_iter()
                    .map(|(s, id)| (s, vec![(id, digest_of(id))]))
                    .chain(wrong.into_iter().map(|(s, id)| (s, vec![(id, [0xee; 32])])))
                    .collect();
                let m = r.awaiting.receipt(&checked(named));
                assert!(m.rows.is_empty(), "a forged receipt retired {:?}", m.rows);
            }
            Op::Expire => {
                r.t += RECEIPT_TIMEOUT;
                let now = r.base + r.t;
                let expired = r.awaiting.expired(now, RECEIPT_TIMEOUT);
                r.resend.extend(expired);
            }
            _ => {}
        }
    }

    /// The rows publish `handle` carries.
    fn members(&self, handle: i64) -> Vec<i64> {
        self.batches
            .get(&handle)
            .cloned()
            .unwrap_or_else(|| vec![handle])
    }

    /// The delivery thread's fill: publishes from the lanes until the
    /// window is full.
    fn fill(&mut self) {
        while self.map.len() < WINDOW {
            let handle = match self.ready.pop_front() {
                Some(h) => h,
                None => match self.resend_one().or_else(|| self.next_publish()) {
                    Some(h) => h,
                    None => return,
                },
            };
            self.map.submitted(handle).unwrap();
            self.channel.push_back(handle);
        }
    }

    /// Receipt mode: a row whose receipt did not come, read again from the
    /// spool (by id, as the delivery thread does) and sent alone.
    fn resend_one(&mut self) -> Option<i64> {
        loop {
            let id = self.receipts.as_mut()?.resend.pop_front()?;
            let rows = self.spool.unresolved_rows(&[id]).unwrap();
            if let Some(row) = rows.into_iter().next() {
                assert_eq!(self.rows[&row.id].event_id, row.event_id);
                let id = row.event_id.expect("a stored id reads back");
                assert_eq!(self.payloads[&id], row.payload, "resent bytes changed");
                if !self.retiring.contains(&row.id) {
                    self.receipts.as_mut()?.resent.insert(row.id);
                    return Some(row.id);
                }
            }
        }
    }

    /// The next publish: a row, or a batch of the batched stream (full, or
    /// what there is once no row is left to read).
    fn next_publish(&mut self) -> Option<i64> {
        if self.receipts.as_ref().is_some_and(|r| r.awaiting.is_full()) {
            return None;
        }
        loop {
            let row = match self.lanes.pick() {
                Some(r) => r,
                None => {
                    self.lanes.refill(&self.spool).unwrap();
                    match self.lanes.pick() {
                        Some(r) => r,
                        None => return self.close_batch(),
                    }
                }
            };
            assert!(row.digest_ok(), "row {} fails its digest", row.id);
            let m = &self.rows[&row.id];
            assert_eq!(m.stream, row.stream, "row {}: stream", row.id);
            assert_eq!(
                m.event_id, row.event_id,
                "event id of row {} changed",
                row.id
            );
            let id = row.event_id.expect("a stored id reads back");
            assert_eq!(self.payloads[&id], row.payload, "payload of {id} changed");
            if self.retiring.contains(&row.id) || self.outside_lanes(row.id) {
                continue;
            }
            // I7 per stream: first offers in order; the first after a
            // replay is the stream's oldest unresolved row.
            match self.last_offer.get(&row.stream) {
                Some(&last) => assert!(row.id > last, "row {} offered after {last}", row.id),
                None => assert_eq!(
                    Some(row.id),
                    self.unresolved()
                        .find(|id| self.rows[id].stream == row.stream
                            && !self.retiring.contains(id)
                            && !self.outside_lanes(*id)),
                    "the replay skipped a row of {}",
                    row.stream
                ),
            }
            self.last_offer.insert(row.stream.clone(), row.id);
            if row.stream != BATCHED {
                return Some(row.id);
            }
            self.pending.push(row.id);
            if self.pending.len() == BATCH {
                return self.close_batch();
            }
        }
    }

    fn close_batch(&mut self) -> Option<i64> {
        let rows = std::mem::take(&mut self.pending);
        let first = *rows.first()?;
        self.batches.insert(first, rows);
        Some(first)
    }

    fn flush(&mut self) {
        if let Some(r) = &self.receipts {
            for id in &self.to_retire {
                assert!(
                    r.matched.contains(id),
                    "row {id} retired without a receipt naming its event id"
                );
            }
        }
        let expect = self
            .to_retire
            .iter()
            .filter(|id| {
                self.rows
                    .get(id)
                    .is_some_and(|r| r.status == Status::Unresolved)
            })
            .collect::<BTreeSet<_>>()
            .len();
        let n = self
            .spool
            .record_delivery(&self.to_mark, &self.to_retire)
            .unwrap();
        assert_eq!(n, expect, "rows retired");
        for id in self.to_retire.drain(..) {
            let r = self.rows.get_mut(&id).unwrap();
            if r.status == Status::Unresolved {
                r.status = Status::Acked;
            }
        }
        self.to_mark.clear();
        self.retiring.clear();
    }

    /// A lost connection or an inconsistency: acks received are committed,
    /// the map is dropped, the client rebuilt, rows replayed from the spool.
    fn lost(&mut self) {
        self.flush();
        self.map.reset();
        self.new_epoch();
    }

    fn new_epoch(&mut self) {
        if let Some(r) = self.receipts.as_mut() {
            // What was to be sent again, or was in flight again, is read
            // by the lanes now like any unacknowledged row.
            r.resent.clear();
            r.resend.clear();
        }
        self.map = AckMap::new();
        self.epoch += 1;
        self.lanes.reset();
        self.pending.clear();
        self.batches.clear();
        self.ready.clear();
        self.last_offer.clear();
        self.channel.clear();
        self.next_pkid = 1;
        self.wire.clear();
        self.transit.clear();
    }

    /// Every row in the file: id -> (event id, state, stream, payload).
    fn db_rows(&self) -> BTreeMap<i64, (String, String, String, Vec<u8>)> {
        let mut st = self
            .spool
            .raw()
            .prepare("SELECT id, event_id, state, stream, payload FROM event_states ORDER BY id")
            .unwrap();
        st.query_map([], |r| {
            Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    }

    fn check(&mut self) {
        let db = self.db_rows();
        for (id, (event_id, state, stream, payload)) in &db {
            let m = self
                .rows
                .get_mut(id)
                .unwrap_or_else(|| panic!("row {id} in the file, not in the model"));
            match &m.event_id {
                None => {
                    // First sight of an appended row: a new event id (I3),
                    // stored as the text it is read back from.
                    let eid = EventId::parse(event_id)
                        .unwrap_or_else(|| panic!("row {id}: stored id {event_id:?}"));
                    assert!(
                        !self.payloads.contains_key(&eid),
                        "event id {event_id} issued twice"
                    );
                    self.payloads.insert(eid, payload.clone());
                    m.event_id = Some(eid);
                    let seq = match serde_json::from_slice::<serde_json::Value>(payload) {
                        Ok(v) => v["seq"].as_u64().unwrap(),
                        Err(_) => {
                            postcard::from_bytes::<CompactEnvelope>(payload)
                                .unwrap()
                                .seq
                        }
                    };
                    let seen = self.seqs.entry(stream.clone()).or_default();
                    assert!(seen.insert(seq), "{stream} seq {seq} issued twice");
                }
                Some(e) => {
                    assert_eq!(e.hyphenated(), *event_id, "row {id}: event id changed");
                    assert_eq!(&self.payloads[e], payload, "row {id}: payload changed");
                }
            }
            let want: &[&str] = match m.status {
                Status::Unresolved => &["PENDING", "SENT"],
                Status::Acked => &["ACKED"],
                Status::Failed => &["FAILED"],
                Status::Purged => panic!("row {id} purged but still in the file"),
            };
            assert!(
                want.contains(&state.as_str()),
                "row {id} is {state}, the model says {:?}",
                m.status
            );
        }
        for (id, m) in &self.rows {
            if !db.contains_key(id) {
                assert_eq!(
                    m.status,
                    Status::Purged,
                    "row {id} vanished ({:?})",
                    m.status
                );
            }
        }
        let mark: i64 = self
            .spool
            .raw()
            .query_row("SELECT acked_through FROM delivery_mark", [], |r| r.get(0))
            .unwrap();
        if let Some(id) = self.unresolved().find(|id| *id <= mark) {
            panic!("acked mark {mark} passed unresolved row {id}");
        }
        for (stream, seqs) in &self.seqs {
            let n = seqs.len() as u64;
            assert_eq!(
                seqs.iter().next_back().copied(),
                Some(n),
                "{stream}: gaps in {seqs:?}"
            );
        }
    }

    /// Reconnect and deliver until every row not FAILED is acknowledged
    /// (in receipt mode: stored by the sink and receipted, what the broker
    /// lost sent again after the timeout).
    fn drain(&mut self) {
        self.lost();
        for _ in 0..1000 {
            if self.unresolved().next().is_none() {
                return;
            }
            self.fill();
            while !self.channel.is_empty() {
                self.step(&Op::Outgoing);
            }
            while !self.wire.is_empty() {
                self.step(&Op::BrokerAck(0));
            }
            while !self.transit.is_empty() {
                self.step(&Op::DeliverAck {
                    index: 0,
                    duplicate: false,
                });
            }
            while self.receipts.as_ref().is_some_and(|r| !r.queue.is_empty()) {
                self.step(&Op::SinkStores(0));
            }
            while self
                .receipts
                .as_ref()
                .is_some_and(|r| !r.in_flight.is_empty())
            {
                self.step(&Op::Receipt {
                    index: 0,
                    duplicate: false,
                });
            }
            self.flush();
            if self
                .receipts
                .as_ref()
                .is_some_and(|r| !r.awaiting.is_empty())
            {
                self.step(&Op::Expire);
            }
            self.check();
        }
        panic!(
            "rows never acknowledged: {:?}",
            self.unresolved().collect::<Vec<_>>()
        );
    }
}

/// Cases per property: 512 natively; 64 under qemu-user, where each case
/// runs some 20 times slower and the native run already explores the space.
fn model_cases() -> u32 {
    if crate::os::process::under_qemu() {
        64
    } else {
        512
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: model_cases(),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn delivery_bookkeeping_keeps_its_invariants_under_any_interleaving(
        ops in prop::collection::vec(op(), 1..120)
    ) {
        let mut w = World::new();
        for op in &ops {
            w.step(op);
            w.check();
        }
        w.drain();
    }

    #[test]
    fn receipt_mode_retires_only_on_a_receipt_for_the_rows_own_event_id(
        ops in prop::collection::vec(receipt_op(), 1..160)
    ) {
        let mut w = World::with_receipts();
        for op in &ops {
            w.step(op);
            w.check();
        }
        w.drain();
    }
}
