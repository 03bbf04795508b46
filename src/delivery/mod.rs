//! The delivery thread: fills the in-flight window from the spool and retires
//! rows whose PUBACK arrived.
//!
//! Owns the delivery connection to the spool. Its one rule: **a row is retired
//! only when the MQTT poller thread reports its PUBACK ([`Link::take_progress`], I2),
//! and after a [`DeliveryMsg::Lost`] rows are offered again from the oldest
//! unacknowledged one, in row-id order (I7)**.
//!
//! The delivery thread reads rows ahead and offers them to a bounded ready
//! queue; the MQTT poller thread submits from that queue as PUBACKs free the window,
//! so the window refills without a thread hop per acknowledgement. Attempts
//! and retirements wait in the [`ledger`] and ride the writer's next commit
//! (its commit window, or at once past [`ledger::RECORD_BATCH`]), never a
//! commit of their own but at the stop. It never blocks the MQTT threads
//! and is never waited on by ingest.

use crate::mqtt::{DeliveryMsg, Link, Ready};
pub mod awaiting;
pub mod backfill;
mod batcher;
mod brokerword;
mod defer;
mod holdings;
pub mod lanes;
pub mod ledger;
#[cfg(test)]
mod model;
mod receipts;

use crate::delivery::lanes::Lanes;
use crate::delivery::ledger::Ledger;
use crate::event::envelope::EventId;
use crate::metrics::WATCHDOG_REBUILDS;
use crate::mqtt::publish_packet_size;
use crate::spool::{OutRow, Spool, SpoolError};
use batcher::Batcher;
use holdings::BackfillMode;
pub use holdings::BackfillStats;
use receipts::ReceiptMode;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Delivery counters, shared with the agent's summary line.
#[derive(Debug, Default)]
pub struct DeliveryStats {
    /// Rows submitted (each attempt counts).
    pub submitted: AtomicU64,
    /// Rows retired on PUBACK.
    pub retired: AtomicU64,
    /// Rows handed back for replay after a lost connection.
    pub requeued: AtomicU64,
    /// Rows marked FAILED (oversized, damaged payload).
    pub failed: AtomicU64,
    /// Stamped each time the delivery loop goes round (at least every
    /// `IDLE_POLL`), for the systemd watchdog.
    pub heartbeat: crate::os::notify::Heartbeat,
    /// Receipt mode: rows PUBACKed and not yet stored (waiting for their
    /// receipt, or sent again for a missing one).
    pub awaiting_receipt: AtomicU64,
    /// Receipt mode: how long the oldest of them has waited since its
    /// first PUBACK (re-sends do not reset it), ms.
    pub oldest_awaiting_ms: AtomicU64,
    /// Receipts read (well-formed, signed for this board by a trusted key).
    pub receipts: AtomicU64,
    /// Event ids receipts named that no waiting row has (not yet PUBACKed,
    /// already retired, unknown): nothing retired for them.
    pub receipt_unmatched: AtomicU64,
    /// Event ids signed receipts named with a digest other than the
    /// waiting row's bytes: nothing retired for them.
    pub receipt_wrong_digest: AtomicU64,
    /// Receipts refused whole, by reason (they retire nothing).
    pub receipts_refused: RefusedReceipts,
    /// Rows published again because their receipt did not come in time.
    pub resent_for_receipt: AtomicU64,
    /// Wall clock of the last receipt, Unix ms (0: none yet).
    pub last_receipt_ms: AtomicU64,
    /// 1 while the broker refuses the receipts subscription (rows wait
    /// meanwhile).
    pub receipts_unavailable: AtomicU64,
    /// Rows held back on the broker's word (refused, over its CONNACK
    /// maximum, set aside after dropped connections: [`defer`]).
    pub deferred: AtomicU64,
    /// What the broker said or did about them, for health.
    pub deferred_why: std::sync::Mutex<String>,
    /// Holdings announced and rows sent again on the fleet's request
    /// ([`holdings`]).
    pub backfill: BackfillStats,
}

impl DeliveryStats {
    /// What the broker said or did about the rows held back (empty: none).
    pub fn deferred_why(&self) -> String {
        self.deferred_why
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default()
    }
}

/// Receipts refused whole, by [`crate::event::receipts::ReceiptError::reason`].
#[derive(Debug, Default)]
pub struct RefusedReceipts {
    /// Not the receipt's shape, too large, bad hex.
    pub malformed: AtomicU64,
    /// Version 1: no signature.
    pub unsigned: AtomicU64,
    /// Signed for another board.
    pub other_board: AtomicU64,
    /// Signed by a key `mqtt.receipt_public_keys` does not list.
    pub untrusted_key: AtomicU64,
    /// A signature that does not verify (forged or altered).
    pub bad_signature: AtomicU64,
}

impl RefusedReceipts {
    /// Count one refusal of `reason`.
    pub fn count(&self, reason: &str) {
        let c = match reason {
            "unsigned" => &self.unsigned,
            "other_board" => &self.other_board,
            "untrusted_key" => &self.untrusted_key,
            "bad_signature" => &self.bad_signature,
            _ => &self.malformed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// `(reason, count)` for every reason, in a fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("malformed", l(&self.malformed)),
            ("unsigned", l(&self.unsigned)),
            ("other_board", l(&self.other_board)),
            ("untrusted_key", l(&self.untrusted_key)),
            ("bad_signature", l(&self.bad_signature)),
        ]
    }

    /// Every refusal.
    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, n)| n).sum()
    }
}

/// Settings for the delivery thread.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// `mqtt.topic_prefix`.
    pub topic_prefix: String,
    /// `mqtt.inflight_window`.
    pub window: usize,
    /// `mqtt.max_payload_bytes`.
    pub max_payload_bytes: usize,
    /// `mqtt.max_packet_bytes`: the broker's limit on a whole PUBLISH.
    pub max_packet_bytes: usize,
    /// `mqtt.fail_after_disconnects`: a row alone in flight at this many
    /// dropped connections in a row is set aside (tried again alone later,
    /// never FAILED: [`defer`]).
    pub fail_after_disconnects: u32,
    /// `mqtt.protocol`: what a PUBLISH carries beyond topic and payload.
    pub protocol: crate::mqtt::Protocol,
    /// `mqtt.min_share_pct`: the starvation bound of [`crate::delivery::lanes`].
    pub min_share_pct: u8,
    /// Streams with `live_first = true` ([`crate::delivery::lanes`]).
    pub live_streams: HashSet<String>,
    /// Batched streams and their batching ([`crate::event::batching`]).
    pub batching: HashMap<String, crate::event::stream::BatchSpec>,
    /// `mqtt.retire_on`: on the PUBACK, or on a receipt ([`receipts`]).
    pub retire_on: crate::mqtt::RetireOn,
    /// `mqtt.receipt_timeout_secs`.
    pub receipt_timeout: Duration,
    /// `mqtt.receipt_window`.
    pub receipt_window: usize,
    /// The board's `device_id`: a receipt must be signed for it.
    pub device_id: String,
    /// `mqtt.receipt_public_keys`: the keys whose receipts retire rows.
    pub receipt_keys: Vec<crate::event::signature::PublicKey>,
    /// Backfill ([`holdings`]): `<topic_prefix>/holdings`,
    /// `mqtt.holdings_interval_secs` and `mqtt.backfill_rows_per_sec`;
    /// `None`: the board neither announces nor hears requests
    /// ([`crate::mqtt::MqttConfig::backfill`]).
    pub backfill: Option<(String, Duration, u32)>,
}

/// With nothing to record, look at the spool this often even without a
/// message (a safety net: every change that makes rows sendable sends one).
const IDLE_POLL: Duration = Duration::from_secs(10);

/// Uncommitted retirements past which no new row is offered (a full disk:
/// acknowledgements would pile up in memory). Twice [`ledger::RECORD_BATCH`].
const MAX_UNRECORDED: usize = 2 * ledger::RECORD_BATCH;

/// The delivery loop: its records go to `ledger`, whose commits the writer
/// makes. Returns when `stop` is set, after committing the records the
/// writer has not taken.
pub fn run(
    mut spool: Spool,
    cfg: DeliveryConfig,
    link: Link,
    rx: Receiver<DeliveryMsg>,
    stop: Arc<AtomicBool>,
    (stats, ledger): (Arc<DeliveryStats>, Ledger),
) {
    let mut d = Delivery::new(cfg, link, stats, ledger);
    while !stop.load(Ordering::Relaxed) {
        d.stats.heartbeat.beat();
        // Event-driven: the MQTT thread, ingest and the agent's stop send
        // messages; the timers are batches and receipts waiting (and a slow
        // safety poll).
        let mut wait = if d.ledger.standalone() && d.ledger.waiting() {
            ledger::STANDALONE_INTERVAL
        } else {
            IDLE_POLL
        };
        if let Some(due) = d.batcher.next_due() {
            wait = wait.min(due.saturating_duration_since(Instant::now()));
        }
        if let Some(due) = d.book_refresh_due() {
            wait = wait.min(due.saturating_duration_since(Instant::now()));
        }
        if let Some(due) = d.expire_receipts() {
            wait = wait.min(due.saturating_duration_since(Instant::now()));
        }
        if let Some(due) = d.backfill_due() {
            wait = wait.min(due.saturating_duration_since(Instant::now()));
        }
        if let Some(due) = d.book.next_due().filter(|_| d.link.connected()) {
            // Not sooner than this: rows of the book wait seconds, and a
            // full ready queue holds them a moment without a spin.
            let soon = due.saturating_duration_since(Instant::now());
            wait = wait.min(soon.max(Duration::from_millis(50)));
        }
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok(msg) => d.handle(msg, &mut spool),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        while let Ok(msg) = rx.try_recv() {
            d.handle(msg, &mut spool);
        }
        d.collect();
        d.defer_refused();
        d.fill(&mut spool);
        d.book_refresh();
        d.write_counts();
        if d.ledger.standalone() && d.ledger.standalone_due() {
            d.flush(&mut spool);
        }
        d.announce_if_due(&spool);
    }
    // Acks already received are committed before exit; nothing else is.
    d.collect();
    d.defer_refused();
    d.flush(&mut spool);
}

struct Delivery {
    cfg: DeliveryConfig,
    /// Receipt mode's bookkeeping; `None` when rows retire on the PUBACK.
    receipts: Option<ReceiptMode>,
    /// Backfill's bookkeeping; `None` when the board neither announces
    /// its holdings nor hears requests.
    backfill: Option<BackfillMode>,
    /// Rows held back on the broker's word ([`defer`]).
    book: defer::Book,
    /// When health's copy of the book was last refreshed.
    book_published: Option<Instant>,
    /// A change to the book not yet in health's copy.
    book_dirty: bool,
    /// When each kind of rate-limited WARN was last logged.
    warned: HashMap<&'static str, Instant>,
    link: Link,
    epoch: u64,
    /// Rows read from the spool in this epoch, not yet offered, by priority.
    lanes: Lanes,
    /// Rows of batched streams waiting for their batch to fill.
    batcher: Batcher,
    /// Topic per stream, built once.
    topics: HashMap<String, Arc<str>>,
    /// Delivery records until the writer's commit takes them.
    ledger: Ledger,
    stats: Arc<DeliveryStats>,
    last_error_log: Option<Instant>,
    /// The row alone in flight at the last quick disconnects, and how many in a row.
    suspect: Option<(i64, u32)>,
    /// Whole-packet size of each row offered in this epoch and not yet
    /// acknowledged (at most the ready queue plus the window).
    offered_size: HashMap<i64, usize>,
    /// The largest PUBLISH the broker has acknowledged in this run.
    largest_acked: usize,
    /// Sending one row at a time to find a row the broker refuses; acks
    /// counted since.
    probing: Option<usize>,
}

impl Delivery {
    /// The delivery thread's state for `cfg`: nothing read, nothing offered.
    fn new(cfg: DeliveryConfig, link: Link, stats: Arc<DeliveryStats>, ledger: Ledger) -> Delivery {
        let lanes = Lanes::new(cfg.min_share_pct, cfg.live_streams.clone());
        let batcher = Batcher::new(&cfg.topic_prefix, cfg.batching.clone());
        let receipts = (cfg.retire_on == crate::mqtt::RetireOn::Receipt)
            .then(|| ReceiptMode::new(cfg.receipt_window, cfg.receipt_timeout));
        let backfill = cfg
            .backfill
            .clone()
            .map(|(topic, every, per_sec)| BackfillMode::new(topic, every, per_sec));
        Delivery {
            receipts,
            backfill,
            book: Default::default(),
            book_published: None,
            book_dirty: false,
            warned: HashMap::new(),
            batcher,
            cfg,
            link,
            epoch: 0,
            lanes,
            topics: HashMap::new(),
            ledger,
            stats,
            last_error_log: None,
            suspect: None,
            offered_size: HashMap::new(),
            largest_acked: 0,
            probing: None,
        }
    }

    fn handle(&mut self, msg: DeliveryMsg, spool: &mut Spool) {
        match msg {
            DeliveryMsg::Lost {
                epoch,
                rows,
                reason,
                quick,
                closed_on_rows,
                watchdog,
            } => {
                // Acks received before the loss are real: into the ledger,
                // whose rows the replay skips until they are committed.
                self.collect();
                self.defer_refused();
                if watchdog {
                    if let Err(e) = spool.count(WATCHDOG_REBUILDS, 1) {
                        self.log_error("count a watchdog rebuild", &e);
                    }
                }
                self.on_drop(&rows, quick, closed_on_rows);
                self.stats
                    .requeued
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                log::debug!(
                    "delivery: epoch {epoch}: {} rows back to replay ({reason})",
                    rows.len()
                );
                self.epoch = epoch;
                self.book.lost();
                self.book_changed();
                // Replay from the oldest unacknowledged row, in order (I7).
                self.lanes.reset();
                self.batcher.clear();
                self.offered_size.clear();
                self.receipts_lost();
                self.backfill_lost();
            }
            DeliveryMsg::Connected { .. } => {
                match spool.newest_id() {
                    Ok(newest) => self.lanes.connected(newest),
                    Err(e) => self.log_error("read the newest row id", &e),
                }
                // At every connection: the fleet may have lost anything
                // while this board was away.
                self.announce(spool);
            }
            DeliveryMsg::Backfill { epoch, publish } => {
                self.link.took_request();
                self.on_request(spool, &publish.payload);
                // Read: the broker may send the next one.
                self.link.ack(epoch, &publish);
            }
            DeliveryMsg::Requeued => {
                if self.book.hold_size().is_some() {
                    self.book.lift();
                    log::info!("delivery: FAILED rows requeued; rows held back since the broker dropped a connection go again");
                    self.book_changed();
                }
            }
            DeliveryMsg::Receipt { epoch, publish } => {
                // The PUBACKs the poller thread took before this receipt come
                // first: a receipt for a row whose PUBACK still waits in the
                // link would match nothing, and the row would wait out its
                // timeout for a receipt that already came (again after
                // every re-send, with a sink quicker than this thread).
                self.collect();
                self.link.took_receipt();
                self.on_receipt(&publish.payload);
                // Read: the broker may send the next one.
                self.link.ack(epoch, &publish);
            }
            DeliveryMsg::Receipts { available, why } => {
                self.on_receipts_availability(available, why);
            }
            DeliveryMsg::Progress | DeliveryMsg::NewRows | DeliveryMsg::Stop => {}
        }
    }

    /// Move what the MQTT side submitted and saw acknowledged into the
    /// pending delivery records.
    fn collect(&mut self) {
        let (sent, acked) = self.link.take_progress();
        if sent.is_empty() && acked.is_empty() {
            return;
        }
        // Rows sent again on request are retired already: their publish
        // marks nothing, their PUBACK retires nothing.
        let sent = match self.backfill.is_some() {
            true => sent.into_iter().filter(|r| !self.is_backfill(*r)).collect(),
            false => sent,
        };
        let acked = self.backfill_progress(acked);
        if self.suspect.is_some_and(|(row, _)| acked.contains(&row)) {
            self.suspect = None;
        }
        for row in &acked {
            if let Some(size) = self.offered_size.remove(row) {
                self.largest_acked = self.largest_acked.max(size);
            }
        }
        self.book_acked(&acked);
        if let Some(n) = self.probing.as_mut() {
            *n += acked.len();
            if *n >= 2 * self.cfg.window {
                log::info!("delivery: rows flow again; back to the full in-flight window");
                self.link.probe(false);
                self.probing = None;
            }
        }
        self.stats
            .submitted
            .fetch_add(sent.len() as u64, Ordering::Relaxed);
        // Only the highest row ever submitted is recorded (the SENT mark).
        let retire = self.after_pubacks(acked);
        self.ledger.add(sent.iter().copied().max(), retire);
    }

    fn log_error(&mut self, what: &str, e: &SpoolError) {
        let quiet = self
            .last_error_log
            .is_some_and(|t| t.elapsed() < Duration::from_secs(30));
        if !quiet {
            log::error!("delivery: {what}: {e} (will retry; repeats are logged every 30 s)");
            self.last_error_log = Some(Instant::now());
        }
    }

    /// Commit the records the writer did not take, on this thread's
    /// connection: at the stop, or with no writer ([`Ledger::standalone`]).
    /// On an error they wait again (at the stop they are lost: their rows
    /// are sent again at the next start, duplicates, never loss).
    fn flush(&mut self, spool: &mut Spool) {
        self.write_counts();
        let mut t = self.ledger.take();
        if t.is_empty() {
            return;
        }
        let counts = std::mem::take(&mut t.counts);
        match spool.record_delivery(&t.sent, &t.acked) {
            Ok(n) => {
                self.stats.retired.fetch_add(n as u64, Ordering::Relaxed);
                self.ledger.committed(t);
            }
            Err(e) => {
                self.log_error("recording deliveries", &e);
                self.ledger.restore(t);
            }
        }
        let mut unwritten = Vec::new();
        for (name, by) in counts {
            if let Err(e) = spool.count(&name, by) {
                self.log_error("count rows held back by the broker", &e);
                unwritten.push((name, by));
            }
        }
        self.ledger.count(unwritten);
    }

    /// Keep the ready queue at two windows' worth, reading ahead from the
    /// spool, highest priority first ([`crate::delivery::lanes`]).
    fn fill(&mut self, spool: &mut Spool) {
        // While delivery records cannot be committed (a full disk), send
        // nothing new: acknowledgements would pile up in memory.
        if !self.link.connected() || self.ledger.uncommitted() > MAX_UNRECORDED {
            return;
        }
        let target = 2 * self.cfg.window;
        let mut room = target.saturating_sub(self.link.ready_len());
        let mut batch = self.resend_ready(spool);
        room = room.saturating_sub(batch.len());
        let retried = self.retry_ready(spool, room);
        room = room.saturating_sub(retried.len());
        batch.extend(retried);
        if self.receipts_full() {
            room = 0;
        }
        if let Err(e) = self.lanes.refill(spool) {
            self.log_error("read sendable rows", &e);
            return;
        }
        // The limits hold for the whole fill (a CONNACK or a dropped
        // connection changes them, never a row offered): looked up once,
        // not per row (the broker's limit is behind the shared lock).
        let limits = self.packet_limit();
        // Rows offered beyond the book of offers could not be matched to
        // their receipt (receipt mode): none is taken past it.
        while room > 0 && !self.offers_full() {
            let row = match self.lanes.pick() {
                Some(row) => row,
                None => {
                    // The read-ahead ran dry within this fill (a backlog
                    // larger than it): read on.
                    if let Err(e) = self.lanes.refill(spool) {
                        self.log_error("read sendable rows", &e);
                        break;
                    }
                    match self.lanes.pick() {
                        Some(row) => row,
                        None => break,
                    }
                }
            };
            if self.ledger.holds(row.id)
                || self.awaits_receipt(row.id)
                || self.book.waits(row.id, self.epoch, Instant::now())
            {
                continue; // acknowledged (not yet committed), waiting for its receipt, or held back by the broker
            }
            let Some((topic, size, event_id)) = self.admit(spool, &row, limits) else {
                continue;
            };
            self.book.offered(row.id, self.epoch);
            if self.book.alone(row.id) {
                self.probe_alone();
            }
            self.note_offered(&row, event_id);
            // While probing for a refused row, rows go one by one.
            match self
                .batcher
                .spec(&row.stream)
                .filter(|_| self.probing.is_none())
            {
                Some(spec) => {
                    let limit = self.batch_limit(&row.stream, limits.0);
                    for r in self.batcher.add((row, event_id), spec, limit) {
                        self.note_size(&r);
                        batch.push(r);
                        room = room.saturating_sub(1);
                    }
                }
                None => {
                    if self.offered_size.len() < 4 * crate::mqtt::ackmap::MAX_WINDOW {
                        self.offered_size.insert(row.id, size);
                    }
                    batch.push(Ready {
                        row: row.id,
                        topic,
                        payload: row.payload,
                        event_id: Some(event_id),
                        members: Vec::new(),
                    });
                    room -= 1;
                }
            }
        }
        for r in self.batcher.due(Instant::now()) {
            self.note_size(&r);
            batch.push(r);
        }
        // Live data first: rows asked for again only when nothing else was.
        self.live_or_backfill(spool, &mut batch, room);
        if batch.is_empty() {
            return;
        }
        if self.link.offer(self.epoch, batch).is_err() {
            // Stale epoch: a Lost message is on its way and resets the read-ahead.
            self.lanes.reset();
        }
    }

    /// Whether `row` may be sent: its stored event id is one, its digest
    /// holds and it fits the payload and packet limits as a single
    /// PUBLISH. Returns its single-event topic, packet size and event id. A
    /// row the board's own limits refuse is marked FAILED (and the rows
    /// behind it flow); one the broker's word refuses (its CONNACK maximum,
    /// a size it dropped the connection on) is held back ([`defer`]).
    /// `limits`: [`Delivery::packet_limit`].
    fn admit(
        &mut self,
        spool: &mut Spool,
        row: &OutRow,
        (limit, whose): (usize, &'static str),
    ) -> Option<(Arc<str>, usize, EventId)> {
        let Some(event_id) = row.event_id else {
            // Damaged like a payload that fails its digest, and counted
            // with those: kept FAILED (`status` shows the stored text),
            // never sent under an id it does not have.
            let why = "its stored event id is not one (8-4-4-4-12 lowercase hex)";
            let named = format!("in row {}", row.id);
            self.fail(spool, row.id, &named, why, "digest_mismatch");
            return None;
        };
        if !row.digest_ok() {
            let why = "payload does not match its stored digest";
            self.fail(spool, row.id, &event_id, why, "digest_mismatch");
            return None;
        }
        if row.payload.len() > self.cfg.max_payload_bytes {
            let why = format!(
                "payload of {} bytes exceeds mqtt.max_payload_bytes {}",
                row.payload.len(),
                self.cfg.max_payload_bytes
            );
            self.fail(spool, row.id, &event_id, &why, "oversized");
            return None;
        }
        let topic = self.topic(&row.stream);
        let extra = crate::mqtt::publish_extra(self.cfg.protocol, true);
        if let Some(why) = packet_too_large(&topic, row.payload.len(), extra, limit, whose) {
            if limit < self.cfg.max_packet_bytes {
                // The broker's CONNACK limit: this connection's word, judged
                // again on the next one.
                self.defer_too_large(row.id, &event_id, &why);
            } else {
                self.fail(spool, row.id, &event_id, &why, "packet_too_large");
            }
            return None;
        }
        let size = publish_packet_size(topic.len(), row.payload.len() + extra);
        if self.held_back(row.id, size, &event_id) {
            return None;
        }
        Some((topic, size, event_id))
    }

    /// The single-event topic of `stream` (built once per stream).
    fn topic(&mut self, stream: &str) -> Arc<str> {
        if let Some(t) = self.topics.get(stream) {
            return t.clone();
        }
        let t: Arc<str> = Arc::from(format!("{}/events/{stream}", self.cfg.topic_prefix));
        self.topics.insert(stream.to_owned(), t.clone());
        t
    }

    /// The whole-packet limit in force and whose it is.
    fn packet_limit(&self) -> (usize, &'static str) {
        match self.link.broker_max_packet() {
            Some(m) if m < self.cfg.max_packet_bytes => {
                (m, "the broker's maximum packet size (CONNACK)")
            }
            _ => (self.cfg.max_packet_bytes, "mqtt.max_packet_bytes"),
        }
    }

    /// The largest uncompressed batch payload of `stream` that fits
    /// `mqtt.max_payload_bytes` and the packet limit (with a learned limit
    /// below it, under that too). `packet`: the limit of
    /// [`Delivery::packet_limit`].
    fn batch_limit(&self, stream: &str, mut packet: usize) -> usize {
        if let Some(l) = self.book.hold_size() {
            packet = packet.min(l.saturating_sub(1));
        }
        if let Some(c) = self.batcher.cap() {
            packet = packet.min(c);
        }
        // Fixed header and Remaining Length: at most 5 bytes.
        let overhead = publish_packet_size(self.batcher.topic_len(stream), 0)
            + crate::mqtt::publish_extra(self.cfg.protocol, false)
            + 4;
        let limit = self
            .cfg
            .max_payload_bytes
            .min(packet.saturating_sub(overhead));
        // Incompressible bytes grow a little in a frame (LZ4 worst case
        // about 0.4% plus its 19-byte header and end mark; zstd's raw
        // blocks 3 bytes per 128 KiB plus an 18-byte header): keep room.
        match self.batcher.spec(stream).map(|s| s.compression) {
            Some(crate::event::stream::Compression::None) | None => limit,
            Some(_) => limit.saturating_sub(limit / 128 + 64),
        }
    }

    /// Remember the packet size of an offered publish (for a limit learned
    /// from a dropped connection).
    fn note_size(&mut self, r: &Ready) {
        let extra = crate::mqtt::publish_extra(self.cfg.protocol, r.members.is_empty());
        let size = publish_packet_size(r.topic.len(), r.payload.len() + extra);
        if !r.members.is_empty() {
            self.batcher.offered(r.row, size);
        }
        if self.offered_size.len() < 4 * crate::mqtt::ackmap::MAX_WINDOW {
            self.offered_size.insert(r.row, size);
        }
    }

    /// Mark one row FAILED (kept, shown by `status`, counted as
    /// `events_failed_<counter>`); the rows behind it flow. `event_id`
    /// names the event in the log. Only the board's own limits call this
    /// (a broker's word holds rows back instead: [`defer`]).
    fn fail(
        &mut self,
        spool: &mut Spool,
        id: i64,
        event_id: &dyn std::fmt::Display,
        why: &str,
        counter: &str,
    ) {
        self.book.forget(id);
        log::error!("delivery: event {event_id} marked FAILED: {why}");
        match spool.mark_failed(id, why, counter) {
            Ok(()) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.log_error("mark failed", &e),
        }
    }
}

/// Why a row cannot be sent under the broker's whole-packet limit, if it
/// cannot: the QoS 1 PUBLISH carrying `payload_len` bytes on `topic` is
/// larger than `max_packet_bytes` (MQTT 3.1.1 §2.2, §3.3; see
/// [`crate::mqtt::publish_packet_size`]). A broker drops the connection on
/// such a packet (3.1.1 has no way to refuse one publish), so it must never
/// leave.
fn packet_too_large(
    topic: &str,
    payload_len: usize,
    extra: usize,
    max_packet_bytes: usize,
    whose: &str,
) -> Option<String> {
    let size = crate::mqtt::publish_packet_size(topic.len(), payload_len + extra);
    (size > max_packet_bytes).then(|| {
        format!(
            "PUBLISH packet of {size} bytes (payload {payload_len} bytes on {topic}) exceeds {whose} {max_packet_bytes}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link to a broker that is never connected, and a receipt-mode
    /// delivery state on it (10 s timeout).
    fn receipt_delivery() -> Delivery {
        let (tx, _rx) = std::sync::mpsc::channel();
        let mcfg = crate::mqtt::MqttConfig {
            topic_prefix: "t/dev".into(),
            max_packet_bytes: crate::mqtt::PROTOCOL_MAX_PACKET,
            retire_on: crate::mqtt::RetireOn::Receipt,
            receipt_timeout: Duration::from_secs(10),
            receipt_window: 100,
            ..crate::mqtt::settings::test_config()
        };
        let (link, _thread) = crate::mqtt::new(mcfg, tx, Arc::new(AtomicBool::new(false)), None);
        let cfg = DeliveryConfig {
            topic_prefix: "t/dev".into(),
            window: 16,
            max_payload_bytes: 1024,
            max_packet_bytes: crate::mqtt::PROTOCOL_MAX_PACKET,
            fail_after_disconnects: 3,
            protocol: crate::mqtt::Protocol::V5,
            min_share_pct: 10,
            live_streams: HashSet::new(),
            batching: HashMap::new(),
            retire_on: crate::mqtt::RetireOn::Receipt,
            receipt_timeout: Duration::from_secs(10),
            receipt_window: 100,
            device_id: "dev".into(),
            receipt_keys: vec![fleet_key().public()],
            backfill: Some(("t/dev/holdings".into(), Duration::from_secs(600), 200)),
        };
        let stats = Arc::new(DeliveryStats::default());
        let ledger = Ledger::new(None);
        Delivery::new(cfg, link, stats, ledger)
    }

    /// The fleet's key in these tests (one per test process).
    fn fleet_key() -> &'static crate::event::signature::SigningKey {
        static KEY: std::sync::OnceLock<crate::event::signature::SigningKey> =
            std::sync::OnceLock::new();
        KEY.get_or_init(|| {
            crate::event::signature::SigningKey::generate()
                .expect("keygen")
                .0
        })
    }

    /// A receipt PUBLISH for `events` of board `dev`, signed by `key`.
    fn receipt_publish(
        events: &[(&str, EventId, [u8; 32])],
        key: &crate::event::signature::SigningKey,
    ) -> Box<rumqttc::Publish> {
        let payload = crate::event::receipts::encode("dev", events, key).remove(0);
        Box::new(rumqttc::Publish::new(
            "t/dev/receipts",
            rumqttc::QoS::AtLeastOnce,
            payload,
        ))
    }

    #[test]
    fn a_receipt_right_behind_its_rows_puback_retires_the_row() {
        // Found end to end (tests/it/receipts_e2e.rs): the MQTT thread takes
        // a row's PUBACK, then its receipt; the delivery thread handled the
        // receipt before taking the PUBACK, matched nothing, and the row
        // waited out its timeout for a receipt that had come.
        let dir = tempfile::tempdir().expect("tempdir");
        let mut spool = Spool::open(&dir.path().join("s.db"), &Default::default()).expect("spool");
        let mut d = receipt_delivery();
        let id = "0123abcd-0000-4000-8000-00000000000a";
        let event_id = EventId::parse(id).expect("an id");
        let payload = b"{}".to_vec();
        let row = OutRow {
            id: 7,
            event_id: Some(event_id),
            stream: "s".to_owned(),
            digest: Some(<sha2::Sha256 as sha2::Digest>::digest(&payload).into()),
            payload,
            prio: 0,
        };
        d.note_offered(&row, event_id);
        d.link.acked_for_test(&[7]);
        let digest = row.digest.expect("a digest");
        // Forged (another key), for another board, with other bytes'
        // digest: none retires the row.
        let stranger = crate::event::signature::SigningKey::generate()
            .expect("keygen")
            .0;
        let forged = receipt_publish(&[("s", event_id, digest)], &stranger);
        d.handle(
            DeliveryMsg::Receipt {
                epoch: 0,
                publish: forged,
            },
            &mut spool,
        );
        let other = crate::event::receipts::encode("dev2", &[("s", event_id, digest)], fleet_key())
            .remove(0);
        let other = Box::new(rumqttc::Publish::new(
            "t/dev/receipts",
            rumqttc::QoS::AtLeastOnce,
            other,
        ));
        d.handle(
            DeliveryMsg::Receipt {
                epoch: 0,
                publish: other,
            },
            &mut spool,
        );
        let wrong = receipt_publish(&[("s", event_id, [0; 32])], fleet_key());
        d.handle(
            DeliveryMsg::Receipt {
                epoch: 0,
                publish: wrong,
            },
            &mut spool,
        );
        assert!(
            !d.ledger.holds(7),
            "a receipt it must not trust retired the row"
        );
        let refused = d.stats.receipts_refused.by_reason();
        assert_eq!(refused[3], ("untrusted_key", 1));
        assert_eq!(refused[2], ("other_board", 1));
        assert_eq!(d.stats.receipt_wrong_digest.load(Ordering::Relaxed), 1);
        let receipt = receipt_publish(&[("s", event_id, digest)], fleet_key());
        d.handle(
            DeliveryMsg::Receipt {
                epoch: 0,
                publish: receipt,
            },
            &mut spool,
        );
        assert_eq!(
            d.ledger.take().acked,
            vec![7],
            "the receipt did not retire its row"
        );
        assert_eq!(d.stats.receipt_unmatched.load(Ordering::Relaxed), 0);
        assert!(!d.awaits_receipt(7));
    }

    #[test]
    fn offers_stop_at_the_book_of_offers_and_a_refused_row_frees_its_place() {
        // Found by the wire bench: with batches of 50, rows offered past a
        // fixed cap of 2,024 were not remembered, and each such row was sent
        // again alone after its PUBACK (batched drains in receipt mode ran
        // at a tenth of puback mode). Now nothing is offered past the cap.
        let mut d = receipt_delivery();
        let cap = 100 + crate::event::stream::MAX_BATCH_EVENTS;
        let event_id = |id: i64| {
            let mut b = [0u8; 16];
            b[8..].copy_from_slice(&id.to_be_bytes());
            EventId(b)
        };
        let row = |id: i64| OutRow {
            id,
            event_id: Some(event_id(id)),
            stream: "s".to_owned(),
            digest: Some([0; 32]),
            payload: Vec::new(),
            prio: 0,
        };
        for id in 1..cap as i64 {
            d.note_offered(&row(id), event_id(id));
        }
        assert!(!d.offers_full(), "full one row early");
        d.note_offered(&row(cap as i64), event_id(cap as i64));
        assert!(d.offers_full());
        d.forget_offered(3);
        assert!(!d.offers_full(), "a refused row kept its place");
        // Once PUBACKed, offered rows move to the book of waiting rows.
        d.link.acked_for_test(&[1, 2]);
        d.collect();
        assert!(d.awaits_receipt(1) && d.awaits_receipt(2));
    }

    #[test]
    fn a_row_whose_stored_event_id_is_not_one_goes_failed_and_is_kept() {
        // The spool stores ids as text; one that does not read back (a
        // damaged page, a hand edit) is never sent under an id it does not
        // have, never retired, never dropped: FAILED like a payload that
        // fails its digest, and the row behind it flows.
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.db");
        let mut spool = Spool::open(&path, &Default::default()).expect("spool");
        let mut ids = crate::event::envelope::EventIdGen::new().expect("ids");
        let ev = |x: f64| crate::spool::NewEvent {
            replay: None,
            stream: "s".into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("x".into(), crate::event::reading::FieldValue::Num(x))],
            key: None,
            reply: None,
        };
        let evs = [ev(1.0), ev(2.0)];
        let format = crate::event::envelope::Format::Json;
        assert_eq!(
            spool
                .append(&evs, &mut ids, "dev", format, 5)
                .expect("append"),
            2
        );
        rusqlite::Connection::open(&path)
            .expect("a second connection")
            .execute("UPDATE events SET event_id = 'NOT-AN-ID' WHERE id = 1", [])
            .expect("damage the first id");
        let rows = spool.sendable(0, 10).expect("rows");
        assert_eq!(rows.len(), 2, "a row with a damaged id is still read");
        assert_eq!(rows[0].event_id, None);
        let mut d = receipt_delivery();
        let limits = d.packet_limit();
        assert!(d.admit(&mut spool, &rows[0], limits).is_none());
        let (_, _, second) = d
            .admit(&mut spool, &rows[1], limits)
            .expect("the next row flows");
        assert_eq!(Some(second), rows[1].event_id);
        let failed = spool.failed_rows(10).expect("failed rows");
        assert_eq!(failed.len(), 1);
        assert_eq!(
            (failed[0].id, failed[0].event_id.as_str()),
            (1, "NOT-AN-ID")
        );
        assert!(
            failed[0].reason.contains("stored event id"),
            "{}",
            failed[0].reason
        );
        let counters = spool.counters().expect("counters");
        assert!(
            counters.contains(&("events_failed_digest_mismatch".to_owned(), 1)),
            "{counters:?}"
        );
        let left: Vec<i64> = spool
            .sendable(0, 10)
            .expect("rows")
            .iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(left, vec![2]);
        // Kept: an operator's requeue puts it back (and it fails again).
        assert_eq!(spool.requeue_failed(None).expect("requeue"), 1);
    }

    #[test]
    fn a_packet_over_the_limit_is_named_with_its_size_and_the_limit() {
        // 1 + 2 + (2 + 10 + 2 + 1000) = 1017 bytes on the wire.
        let topic = "p/events/s";
        assert_eq!(
            packet_too_large(topic, 1000, 0, 1017, "mqtt.max_packet_bytes"),
            None
        );
        let why = packet_too_large(topic, 1000, 0, 1016, "mqtt.max_packet_bytes").expect("over");
        assert_eq!(
            why,
            "PUBLISH packet of 1017 bytes (payload 1000 bytes on p/events/s) exceeds mqtt.max_packet_bytes 1016"
        );
    }
}
