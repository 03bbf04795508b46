//! The board's side of backfill in the delivery thread: it announces what
//! the spool holds (retained on `<topic_prefix>/holdings`, at every
//! connection, every `mqtt.holdings_interval_secs`, and once its backlog
//! has drained), hears the fleet's requests (`<topic_prefix>/backfill`),
//! and sends the rows asked for again, answering what it cannot send.
//!
//! Its one rule: **a row is sent again only if it is acknowledged, with its
//! stored bytes (digest checked) under its own event id, and only while
//! no live row waits**: rows not yet delivered come by ordinary delivery
//! (answered `pending`), FAILED and damaged rows are never sent (answered
//! gone with the reason), and a row sent again changes nothing in the
//! spool: its PUBACK, and the fleet's receipt for it, retire nothing (it
//! was retired already). Requests are judged by [`super::backfill`]; what
//! is sent is paced there, at most half the in-flight window at once.

use super::backfill::{Backfill, Job};
use super::Delivery;
use crate::event::backfill::{self, Answer, GoneReason, Holdings, Token};
use crate::mqtt::Ready;
use crate::spool::{HeldState, Spool};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Announcements at most this often (besides the one at each connection).
const ANNOUNCE_GAP: Duration = Duration::from_secs(10);
/// Rows read per spool read while sending again.
const READ_ROWS: usize = 256;

/// Backfill's counters, for `status` (`agent_state.backfill`).
#[derive(Debug, Default)]
pub struct BackfillStats {
    /// Holdings announced.
    pub holdings: AtomicU64,
    /// Bytes of those announcements (payloads).
    pub holdings_bytes: AtomicU64,
    /// Requests accepted.
    pub requests: AtomicU64,
    /// Requests refused, by reason ([`BackfillStats::REASONS`]).
    pub refused: [AtomicU64; 9],
    /// Rows sent again.
    pub rows_sent: AtomicU64,
    /// Rows answered gone (not held, FAILED, damaged, beyond the newest).
    pub rows_gone: AtomicU64,
    /// Rows answered as not yet delivered.
    pub rows_pending: AtomicU64,
    /// Rows asked for that did not fit the queue (the fleet asks again).
    pub rows_clipped: AtomicU64,
    /// Rows queued to send again now.
    pub queued: AtomicU64,
}

impl BackfillStats {
    /// The refusal reasons, in the order of [`BackfillStats::refused`].
    pub const REASONS: [&'static str; 9] = [
        "malformed",
        "other_board",
        "untrusted_key",
        "bad_signature",
        "stale",
        "replayed",
        "flood",
        "off",
        "skewed",
    ];

    fn refuse(&self, reason: &str) {
        let i = Self::REASONS.iter().position(|r| *r == reason).unwrap_or(0);
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    /// `(reason, count)`, every reason.
    pub fn refused_by_reason(&self) -> Vec<(&'static str, u64)> {
        Self::REASONS
            .iter()
            .zip(&self.refused)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Backfill's part of the delivery thread.
#[derive(Debug)]
pub(super) struct BackfillMode {
    state: Backfill,
    topic: String,
    interval: Duration,
    last_announce: Option<Instant>,
    /// Some stream had rows not yet delivered at the last announcement:
    /// announce again once the backlog has drained.
    undelivered: bool,
    last_drain_check: Option<Instant>,
    /// Rows sent again and not yet acknowledged: (stream, stream id, seq).
    in_flight: HashMap<i64, (String, i64, i64)>,
    /// What the front range found it cannot send, for its answer.
    gone: Vec<(i64, i64, GoneReason)>,
    pending: Vec<(i64, i64, ())>,
}

impl BackfillMode {
    /// Backfill on `holdings_topic`, announcing every `interval`, sending
    /// at most `per_sec` rows a second.
    pub(super) fn new(holdings_topic: String, interval: Duration, per_sec: u32) -> BackfillMode {
        BackfillMode {
            state: Backfill::new(per_sec, Instant::now()),
            topic: holdings_topic,
            interval,
            last_announce: None,
            undelivered: false,
            last_drain_check: None,
            in_flight: HashMap::new(),
            gone: Vec::new(),
            pending: Vec::new(),
        }
    }
}

/// Add `(f, l)` to `list`, merged with the last range when they touch.
fn merge<T: PartialEq + Copy>(list: &mut Vec<(i64, i64, T)>, f: i64, l: i64, t: T) {
    if let Some(last) = list.last_mut() {
        if last.1 + 1 == f && last.2 == t {
            last.1 = l;
            return;
        }
    }
    list.push((f, l, t));
}

impl Delivery {
    /// Announce what the spool holds, with a fresh nonce (retained).
    pub(super) fn announce(&mut self, spool: &Spool) {
        let Some(b) = self.backfill.as_mut() else {
            return;
        };
        let nonce = match backfill::fresh_token() {
            Ok(n) => n,
            Err(e) => {
                log::warn!("delivery: no holdings announced: {e}");
                return;
            }
        };
        let held = match spool.holdings() {
            Ok(h) => h,
            Err(e) => {
                log::warn!("delivery: no holdings announced: {e}");
                return;
            }
        };
        b.state.announced(nonce);
        b.last_announce = Some(Instant::now());
        b.undelivered = held.iter().any(|(_, _, h)| h.pending <= h.newest);
        let payload = backfill::encode_holdings(&Holdings {
            board: self.cfg.device_id.clone(),
            nonce,
            more: held.len() > backfill::MAX_HOLDINGS_STREAMS,
            streams: held.into_iter().map(|(_, n, h)| (n, h)).collect(),
        });
        let bytes = payload.len() as u64;
        if self.link.publish_note(b.topic.clone(), payload, true) {
            let s = &self.stats.backfill;
            s.holdings.fetch_add(1, Ordering::Relaxed);
            s.holdings_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// After a fill's live rows (`batch`): when there are some, announce
    /// again once the backlog has drained, so the retained holdings name
    /// them (a board that connected with an empty spool would otherwise
    /// say so until the interval); when there are none, rows asked for
    /// again fill the `room`.
    pub(super) fn live_or_backfill(
        &mut self,
        spool: &mut Spool,
        batch: &mut Vec<Ready>,
        room: usize,
    ) {
        if !batch.is_empty() {
            if let Some(b) = self.backfill.as_mut() {
                b.undelivered = true;
            }
        } else if room > 0 {
            *batch = self.backfill_rows(spool, room);
        }
    }

    /// When the next announcement or row sent again is due, if any.
    pub(super) fn backfill_due(&self) -> Option<Instant> {
        let b = self.backfill.as_ref()?;
        let now = Instant::now();
        let periodic = b.last_announce.map(|t| t + b.interval);
        let drain = b.undelivered.then(|| {
            b.last_drain_check
                .map_or(now, |t| t + Duration::from_secs(1))
        });
        let pace = (!b.state.idle()).then(|| b.state.pace.next_at(now));
        [periodic, drain, pace].into_iter().flatten().min()
    }

    /// Announce again when due: every interval, and once the rows not yet
    /// delivered at the last announcement are (checked once a second, a
    /// range read from the acknowledged mark).
    pub(super) fn announce_if_due(&mut self, spool: &Spool) {
        let Some(b) = self.backfill.as_mut() else {
            return;
        };
        if !self.link.connected() {
            return;
        }
        let now = Instant::now();
        let since = b.last_announce.map(|t| now.saturating_duration_since(t));
        if since.is_some_and(|s| s >= b.interval) {
            return self.announce(spool);
        }
        let check = b.undelivered
            && since.is_none_or(|s| s >= ANNOUNCE_GAP)
            && b.last_drain_check
                .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1));
        if !check {
            return;
        }
        b.last_drain_check = Some(now);
        let drained = matches!(spool.oldest_unacked_ms(), Ok(None))
            && self.stats.awaiting_receipt.load(Ordering::Relaxed) == 0;
        if drained {
            self.announce(spool);
        }
    }

    /// A request arrived: judged, planned against what the spool holds,
    /// what it cannot send answered at once; acknowledged by the caller.
    pub(super) fn on_request(&mut self, spool: &Spool, payload: &[u8]) {
        let Some(b) = self.backfill.as_mut() else {
            return;
        };
        let s = &self.stats.backfill;
        let checked = backfill::parse_request(payload).and_then(|r| {
            r.check(&self.cfg.device_id, &self.cfg.receipt_keys)
                .map(|()| r)
        });
        let req = match checked {
            Ok(r) => r,
            Err(e) => {
                s.refuse(e.reason());
                log::warn!("delivery: backfill request refused: {e}");
                return;
            }
        };
        let (wall, trusted) = crate::event::envelope::wall_clock_ms();
        if let Err(r) = b.state.admit(&req, Instant::now(), trusted.then_some(wall)) {
            s.refuse(r.word());
            log::warn!(
                "delivery: backfill request {} refused: {}",
                crate::event::hex::encode(&req.id),
                r.word()
            );
            return;
        }
        let held = match spool.holdings() {
            Ok(h) => h,
            Err(e) => {
                // Accepted, not served: the fleet asks again.
                log::warn!("delivery: backfill request not served: {e}");
                return;
            }
        };
        let a = b.state.plan(&req, &held, Instant::now());
        s.requests.fetch_add(1, Ordering::Relaxed);
        s.rows_clipped.fetch_add(a.clipped, Ordering::Relaxed);
        s.queued.store(b.state.queued_rows(), Ordering::Relaxed);
        let gone: u64 = a
            .gone
            .iter()
            .flat_map(|(_, r)| r.iter())
            .map(|(f, l, _)| (l - f + 1) as u64)
            .sum();
        s.rows_gone.fetch_add(gone, Ordering::Relaxed);
        log::info!(
            "delivery: backfill request {}: {} rows asked, {} queued, {gone} gone, {} over the queue's bound",
            crate::event::hex::encode(&req.id),
            req.rows(),
            a.queued,
            a.clipped
        );
        let answer = Answer {
            board: self.cfg.device_id.clone(),
            request: req.id,
            queued: a.queued,
            gone: a.gone,
            pending: Vec::new(),
        };
        let topic = b.topic.clone();
        self.link
            .publish_note(topic, backfill::encode_answer(&answer), false);
    }

    /// Rows to send again now: only when the lanes gave nothing (live data
    /// first), within the pace, `room` and half the in-flight window.
    fn backfill_rows(&mut self, spool: &mut Spool, room: usize) -> Vec<Ready> {
        let window = self.cfg.window;
        let Some(b) = self.backfill.as_mut() else {
            return Vec::new();
        };
        if b.state.idle() || !self.link.connected() {
            return Vec::new();
        }
        let cap = (window / 2).max(1).saturating_sub(b.in_flight.len());
        let mut n = (room.min(cap) as u64).min(b.state.pace.available(Instant::now()));
        let mut out = Vec::new();
        // Reads per fill, at most: a long run of rows not to send (not yet
        // delivered, gone) is walked over several fills.
        let mut reads = 8;
        while n > 0 && reads > 0 {
            reads -= 1;
            let Some(job) = self
                .backfill
                .as_mut()
                .and_then(|b| b.state.front().cloned())
            else {
                break;
            };
            match self.walk(spool, job, &mut n, &mut out) {
                Ok(true) => self.finish_job(),
                Ok(false) => {}
                Err(e) => {
                    self.log_error("read rows to send again", &e);
                    break;
                }
            }
        }
        if let Some(b) = self.backfill.as_mut() {
            b.state.pace.spend(out.len() as u64);
            let s = &self.stats.backfill;
            s.rows_sent.fetch_add(out.len() as u64, Ordering::Relaxed);
            s.queued.store(b.state.queued_rows(), Ordering::Relaxed);
        }
        out
    }

    /// Read on in the front range `job`, sending at most `n` rows (which it
    /// lowers) into `out`; true when the range is done.
    fn walk(
        &mut self,
        spool: &mut Spool,
        mut job: Job,
        n: &mut u64,
        out: &mut Vec<Ready>,
    ) -> Result<bool, crate::spool::SpoolError> {
        let from = match job.from_id {
            Some(id) => id,
            None => match spool.backfill_start(job.stream_id, job.next)? {
                Some(id) => id,
                None => {
                    self.gone_here(job.next, job.last, GoneReason::Retention);
                    return Ok(true);
                }
            },
        };
        let rows = spool.backfill_rows(job.stream_id, from, READ_ROWS)?;
        let read_all = rows.len() < READ_ROWS;
        job.from_id = Some(from);
        let mut done = false;
        let mut looked = 0;
        for r in rows {
            if r.seq > job.last {
                done = true;
                break;
            }
            job.from_id = Some(r.row.id + 1);
            if r.seq < job.next {
                continue;
            }
            if *n == 0 {
                job.from_id = Some(r.row.id);
                break;
            }
            if r.seq > job.next {
                self.gone_here(job.next, r.seq - 1, GoneReason::Retention);
            }
            match r.state {
                HeldState::Acked => match self.resend_one(&r.row) {
                    Some(ready) => {
                        if let Some(b) = self.backfill.as_mut() {
                            b.in_flight
                                .insert(r.row.id, (job.stream.clone(), job.stream_id, r.seq));
                        }
                        out.push(ready);
                        *n -= 1;
                    }
                    None => self.gone_here(r.seq, r.seq, GoneReason::Damaged),
                },
                HeldState::Unresolved => {
                    if let Some(b) = self.backfill.as_mut() {
                        merge(&mut b.pending, r.seq, r.seq, ());
                    }
                }
                HeldState::Failed => self.gone_here(r.seq, r.seq, GoneReason::Failed),
            }
            looked += (r.seq - job.next + 1) as u64;
            job.next = r.seq + 1;
        }
        if !done && read_all && *n > 0 && job.next <= job.last {
            // No row of the stream left at or after `next`: retention took
            // them (out of order) since the request was planned.
            self.gone_here(job.next, job.last, GoneReason::Retention);
            done = true;
        }
        let Some(b) = self.backfill.as_mut() else {
            return Ok(true);
        };
        b.state.advanced(looked);
        let finished = done || job.next > job.last;
        if let Some(front) = b.state.front() {
            *front = job;
        }
        Ok(finished)
    }

    /// `row` as a single publish, if its bytes still match their digest and
    /// it fits the packet limit in force.
    fn resend_one(&mut self, row: &crate::spool::OutRow) -> Option<Ready> {
        let event_id = row.event_id?;
        if !row.digest_ok() || row.payload.len() > self.cfg.max_payload_bytes {
            return None;
        }
        let topic = self.topic(&row.stream);
        let extra = crate::mqtt::publish_extra(self.cfg.protocol, true);
        let (limit, whose) = self.packet_limit();
        if super::packet_too_large(&topic, row.payload.len(), extra, limit, whose).is_some() {
            return None;
        }
        Some(Ready {
            row: row.id,
            topic,
            payload: row.payload.clone(),
            event_id: Some(event_id),
            members: Vec::new(),
        })
    }

    fn gone_here(&mut self, f: i64, l: i64, why: GoneReason) {
        if let Some(b) = self.backfill.as_mut() {
            merge(&mut b.gone, f, l, why);
            self.stats
                .backfill
                .rows_gone
                .fetch_add((l - f + 1).max(0) as u64, Ordering::Relaxed);
        }
    }

    /// The front range is done: its answer (what it could not send) goes
    /// out, if there is one.
    fn finish_job(&mut self) {
        let Some(b) = self.backfill.as_mut() else {
            return;
        };
        let Some(job) = b.state.pop(Instant::now()) else {
            return;
        };
        let gone = std::mem::take(&mut b.gone);
        let pending: Vec<(i64, i64)> = std::mem::take(&mut b.pending)
            .into_iter()
            .map(|(f, l, ())| (f, l))
            .collect();
        self.stats.backfill.rows_pending.fetch_add(
            pending.iter().map(|(f, l)| (l - f + 1) as u64).sum(),
            Ordering::Relaxed,
        );
        if gone.is_empty() && pending.is_empty() || job.request == [0; 16] {
            return;
        }
        let answer = Answer {
            board: self.cfg.device_id.clone(),
            request: job.request,
            queued: 0,
            gone: vec![(job.stream.clone(), gone)],
            pending: vec![(job.stream, pending)],
        };
        let topic = b.topic.clone();
        self.link
            .publish_note(topic, backfill::encode_answer(&answer), false);
    }

    /// Take the rows sent again out of what the poller reports: their
    /// PUBACK retires nothing (they are retired), and they mark nothing.
    pub(super) fn backfill_progress(&mut self, rows: Vec<i64>) -> Vec<i64> {
        match self.backfill.as_mut() {
            Some(b) if !b.in_flight.is_empty() => rows
                .into_iter()
                .filter(|r| b.in_flight.remove(r).is_none())
                .collect(),
            _ => rows,
        }
    }

    /// Whether `row` was sent again on request and is in flight.
    pub(super) fn is_backfill(&self, row: i64) -> bool {
        self.backfill
            .as_ref()
            .is_some_and(|b| b.in_flight.contains_key(&row))
    }

    /// Rows sent again that were in flight when the connection was lost:
    /// queued again, first.
    pub(super) fn backfill_lost(&mut self) {
        if let Some(b) = self.backfill.as_mut() {
            let rows: Vec<(String, i64, i64)> = b.in_flight.drain().map(|(_, v)| v).collect();
            // Their answers are not the fleet's to wait for: it asks again
            // for what it still lacks.
            const NO_REQUEST: Token = [0; 16];
            b.state.lost(&rows, NO_REQUEST);
        }
    }
}
