//! Receipt mode in the delivery thread (`mqtt.retire_on = "receipt"`): a
//! PUBACKed row waits in [`crate::delivery::awaiting::Awaiting`] until a receipt from
//! the fleet's sink names its event id; only then is it retired. A row whose
//! receipt has not come within `mqtt.receipt_timeout_secs` of its PUBACK is
//! read again from the spool and published again, with the same event id
//! and bytes.
//!
//! Its one rule: **in receipt mode a PUBACK retires nothing**; only a
//! receipt signed for this board by a key of `mqtt.receipt_public_keys`,
//! naming a waiting row's own stream, event id and payload digest, does
//! ([`crate::event::receipts::Receipt::check`]). Not even while the broker
//! refuses the receipts subscription: whoever can refuse a SUBACK (a
//! hostile broker, a local user on the board broker's port) would
//! otherwise retire every row with no receipt at all; the rows wait in the
//! spool instead, and health says why. A receipt is acknowledged to the broker only once
//! it has been read here: the broker's in-flight window, not a queue that
//! drops, paces them. After a restart the waiting rows are
//! simply unacknowledged rows of the spool: they are sent again and the
//! sink receipts the duplicates.

use super::Delivery;
use crate::delivery::awaiting::Awaiting;
use crate::event::envelope::EventId;
use crate::mqtt::Ready;
use crate::spool::{OutRow, Spool};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rows read again for a missing receipt per fill, at most.
const RESEND_BATCH: usize = 256;

/// When each row delivered and not yet stored was first PUBACKed: unlike
/// the book's own times it survives the row being sent again, so a row
/// the fleet never stores ages (the health rule), oldest first.
#[derive(Debug, Default)]
struct FirstPubacks {
    at: HashMap<i64, Instant>,
    order: BTreeSet<(Instant, i64)>,
    cap: usize,
}

impl FirstPubacks {
    /// Noted at most `cap` rows (beyond that the age is a lower bound).
    fn new(cap: usize) -> FirstPubacks {
        FirstPubacks {
            cap,
            ..FirstPubacks::default()
        }
    }

    /// `row` was PUBACKed at `now`; a row already noted keeps its time.
    fn note(&mut self, row: i64, now: Instant) {
        if self.at.len() >= self.cap || self.at.contains_key(&row) {
            return;
        }
        self.at.insert(row, now);
        self.order.insert((now, row));
    }

    /// `rows` are stored (retired).
    fn forget(&mut self, rows: &[i64]) {
        for row in rows {
            if let Some(t) = self.at.remove(row) {
                self.order.remove(&(t, *row));
            }
        }
    }

    fn len(&self) -> usize {
        self.at.len()
    }

    fn oldest_age(&self, now: Instant) -> Option<Duration> {
        self.order
            .first()
            .map(|(t, _)| now.saturating_duration_since(*t))
    }
}

/// A row offered: its stream, event id and the sha256 of its payload.
type Offered = ((Arc<str>, EventId), [u8; 32]);

/// What the delivery thread keeps in receipt mode.
#[derive(Debug)]
pub(super) struct ReceiptMode {
    awaiting: Awaiting,
    timeout: Duration,
    /// Stream, event id and payload digest of each row offered in this
    /// epoch and not yet PUBACKed (what a waiting row is matched by), at
    /// most `offer_cap`.
    offered: HashMap<i64, Offered>,
    offer_cap: usize,
    /// Streams' names, shared by their rows.
    names: HashMap<String, Arc<str>>,
    /// Rows to publish again, in row order.
    resend: Vec<i64>,
    /// Rows published again in this epoch and not yet PUBACKed: the lanes
    /// skip them (they are out of the lanes' order, and once in flight).
    resent: std::collections::HashSet<i64>,
    /// Why the broker refused the receipts subscription, while it does
    /// (rows wait meanwhile: a refusal retires nothing).
    unavailable: Option<String>,
    last_malformed_log: Option<Instant>,
    /// Rows delivered and not yet stored, by their first PUBACK.
    first: FirstPubacks,
}

impl ReceiptMode {
    /// Receipt mode with at most `window` rows waiting, each for `timeout`,
    /// and at most `window` plus one largest batch offered and not yet
    /// PUBACKed.
    pub(super) fn new(window: usize, timeout: Duration) -> ReceiptMode {
        ReceiptMode {
            awaiting: Awaiting::new(window),
            timeout,
            offered: HashMap::new(),
            offer_cap: window.max(1) + crate::event::stream::MAX_BATCH_EVENTS,
            names: HashMap::new(),
            resend: Vec::new(),
            resent: std::collections::HashSet::new(),
            unavailable: None,
            last_malformed_log: None,
            first: FirstPubacks::new(4 * window.max(1)),
        }
    }
}

impl Delivery {
    /// Whether the lanes must not offer `row`: it waits for its receipt,
    /// or it was published again for a missing one and is in flight.
    pub(super) fn awaits_receipt(&self, row: i64) -> bool {
        self.receipts
            .as_ref()
            .is_some_and(|r| r.awaiting.contains(row) || r.resent.contains(&row))
    }

    /// Whether no new row may be offered: the book of rows waiting for a
    /// receipt is full (rows to send again still go).
    pub(super) fn receipts_full(&self) -> bool {
        self.receipts.as_ref().is_some_and(|r| r.awaiting.is_full())
    }

    /// Whether no new row may be offered because the book of rows offered
    /// and not yet PUBACKed is at its cap: a row offered beyond it could
    /// not be matched to its receipt and would be sent again.
    pub(super) fn offers_full(&self) -> bool {
        self.receipts
            .as_ref()
            .is_some_and(|r| r.offered.len() >= r.offer_cap)
    }

    /// Remember `row`'s stream, event id (`event_id`, as admitted) and
    /// digest as it is offered (not beyond the cap: such a row is sent
    /// again after its PUBACK).
    pub(super) fn note_offered(&mut self, row: &OutRow, event_id: EventId) {
        let Some(r) = self.receipts.as_mut() else {
            return;
        };
        // Admitted rows passed their digest check: they have one.
        let Some(digest) = row.digest else {
            return;
        };
        if r.offered.len() >= r.offer_cap {
            return;
        }
        let stream = r
            .names
            .entry(row.stream.clone())
            .or_insert_with(|| Arc::from(row.stream.as_str()))
            .clone();
        r.offered.insert(row.id, ((stream, event_id), digest));
    }

    /// `row` was refused by its PUBACK: no receipt is to come for this
    /// offer (it is offered again on another connection).
    pub(super) fn forget_offered(&mut self, row: i64) {
        if let Some(r) = self.receipts.as_mut() {
            r.offered.remove(&row);
        }
    }

    /// The rows `acked` PUBACKs acknowledged: those to retire now (all of
    /// them without receipt mode); in receipt mode they wait for their
    /// receipt instead.
    pub(super) fn after_pubacks(&mut self, acked: Vec<i64>) -> Vec<i64> {
        let Some(r) = self.receipts.as_mut() else {
            return acked;
        };
        let now = Instant::now();
        for row in acked {
            r.first.note(row, now);
            r.resent.remove(&row);
            match r.offered.remove(&row) {
                Some((key, digest)) => r.awaiting.delivered(row, key, digest, now),
                // Not remembered (the book of offers overflowed): sent
                // again later rather than retired without its receipt.
                None => r.resend.push(row),
            }
        }
        self.publish_receipt_stats();
        Vec::new()
    }

    /// A receipt arrived: if it is signed for this board by a trusted key,
    /// the waiting rows it names with their own digest are retired; if
    /// not, it retires nothing and is counted by reason.
    pub(super) fn on_receipt(&mut self, payload: &[u8]) {
        let Some(r) = self.receipts.as_mut() else {
            return;
        };
        let s = &self.stats;
        let checked = crate::event::receipts::parse(payload).and_then(|rc| {
            rc.check(&self.cfg.device_id, &self.cfg.receipt_keys)
                .map(|()| rc)
        });
        match checked {
            Ok(receipt) => {
                let m = r.awaiting.receipt(&receipt);
                s.receipts.fetch_add(1, Ordering::Relaxed);
                s.receipt_unmatched
                    .fetch_add(m.unmatched as u64, Ordering::Relaxed);
                s.receipt_wrong_digest
                    .fetch_add(m.wrong_digest as u64, Ordering::Relaxed);
                if m.wrong_digest > 0 {
                    log::warn!(
                        "delivery: a signed receipt names {} waiting events with a digest other than their bytes': the fleet stored other bytes under their ids; they retire nothing and are sent again",
                        m.wrong_digest
                    );
                }
                s.last_receipt_ms.store(
                    crate::event::envelope::wall_clock_ms().0.max(0) as u64,
                    Ordering::Relaxed,
                );
                // A retired row may have been read ahead while it waited:
                // it must not be offered again from there.
                self.lanes.discard(&m.rows.iter().copied().collect());
                r.first.forget(&m.rows);
                self.ledger.add(None, m.rows);
            }
            Err(e) => {
                s.receipts_refused.count(e.reason());
                let quiet = r
                    .last_malformed_log
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(30));
                if !quiet {
                    log::warn!("delivery: {e}; it retires nothing (repeats are logged every 30 s)");
                    r.last_malformed_log = Some(Instant::now());
                }
            }
        }
        self.publish_receipt_stats();
    }

    /// The broker granted or refused the receipts subscription. Refused:
    /// nothing is retired for it (a SUBACK is the broker's word, not the
    /// fleet's); rows keep waiting for their receipt, are sent again after
    /// the receipt timeout, and the book's bound holds new rows in the
    /// spool; health says `receipts unavailable` until a connection is
    /// granted it again.
    pub(super) fn on_receipts_availability(&mut self, available: bool, why: Option<String>) {
        let Some(r) = self.receipts.as_mut() else {
            return;
        };
        if available {
            if r.unavailable.take().is_some() {
                log::info!("delivery: receipts can arrive again");
            }
        } else {
            let why = why.unwrap_or_else(|| "the receipts subscription was refused".into());
            if r.unavailable.is_none() {
                log::error!(
                    "delivery: {why}; {} rows wait for their receipt and new rows stay in the spool: a refused subscription retires nothing (health degraded)",
                    r.awaiting.len()
                );
            }
            r.unavailable = Some(why);
        }
        self.stats
            .receipts_unavailable
            .store(u64::from(!available), Ordering::Relaxed);
        self.publish_receipt_stats();
    }

    /// Rows whose receipt did not come in time join the rows to send again;
    /// returns when the next one is due, if any waits.
    pub(super) fn expire_receipts(&mut self) -> Option<Instant> {
        let r = self.receipts.as_mut()?;
        let now = Instant::now();
        let expired = r.awaiting.expired(now, r.timeout);
        if !expired.is_empty() {
            log::warn!(
                "delivery: no receipt for {} rows within {} s of their PUBACK; sending them again",
                expired.len(),
                r.timeout.as_secs()
            );
            r.resend.extend(expired);
            r.resend.sort_unstable();
            r.resend.dedup();
        }
        let next = r
            .awaiting
            .oldest_age(now)
            .map(|age| now + r.timeout.saturating_sub(age));
        self.publish_receipt_stats();
        next
    }

    /// The rows to send again, read from the spool (at most
    /// [`RESEND_BATCH`] a call), as single publishes.
    pub(super) fn resend_ready(&mut self, spool: &mut Spool) -> Vec<Ready> {
        let ids: Vec<i64> = match self.receipts.as_mut() {
            Some(r) if !r.resend.is_empty() => {
                let n = r.resend.len().min(RESEND_BATCH);
                r.resend.drain(..n).collect()
            }
            _ => return Vec::new(),
        };
        let rows = match spool.unresolved_rows(&ids) {
            Ok(rows) => rows,
            Err(e) => {
                self.log_error("read rows to send again", &e);
                if let Some(r) = self.receipts.as_mut() {
                    r.resend.splice(0..0, ids);
                }
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(rows.len());
        let limits = self.packet_limit();
        for row in rows {
            if self.ledger.holds(row.id) {
                continue;
            }
            let Some((topic, _, event_id)) = self.admit(spool, &row, limits) else {
                continue;
            };
            self.note_offered(&row, event_id);
            if let Some(r) = self.receipts.as_mut() {
                r.resent.insert(row.id);
            }
            out.push(Ready {
                row: row.id,
                topic,
                payload: row.payload,
                event_id: Some(event_id),
                members: Vec::new(),
            });
        }
        self.stats
            .resent_for_receipt
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    /// A lost connection: what was offered on it is no longer in flight
    /// (its rows are read again by the lanes, those to send again for a
    /// missing receipt too); the waiting rows keep waiting.
    pub(super) fn receipts_lost(&mut self) {
        if let Some(r) = self.receipts.as_mut() {
            // The lanes read every unacknowledged row that does not wait
            // again: rows to send again, or in flight again, among them.
            r.offered.clear();
            r.resend.clear();
            r.resent.clear();
        }
    }

    /// The waiting rows' gauges, for status and the metrics.
    fn publish_receipt_stats(&mut self) {
        let Some(r) = self.receipts.as_mut() else {
            return;
        };
        let s = &self.stats;
        // Delivered and not yet stored: waiting in the book, or sent again.
        s.awaiting_receipt
            .store(r.first.len() as u64, Ordering::Relaxed);
        let age = r.first.oldest_age(Instant::now());
        s.oldest_awaiting_ms
            .store(age.map_or(0, |a| a.as_millis() as u64), Ordering::Relaxed);
    }
}
