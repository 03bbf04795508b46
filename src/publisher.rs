//! The delivery thread: fills the in-flight window from the spool and retires
//! rows whose PUBACK arrived.
//!
//! Owns the delivery connection to the spool. Its one rule: **a row is retired
//! only on a [`DeliveryMsg::Acked`] for it (I2), and after a
//! [`DeliveryMsg::Lost`] the window is refilled from the oldest unacknowledged
//! row, in row-id order (I7)**. It never blocks the MQTT thread (submission is
//! a non-blocking `try_publish` under a short lock) and is never waited on by
//! ingest.

use crate::envelope::wall_clock_ms;
use crate::mqtt::{DeliveryMsg, Link, NotNow};
use crate::spool::{Spool, SpoolError};
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
    /// Recorded as a row's next retry time after an attempt (`mqtt.ack_timeout_secs`).
    pub ack_timeout: Duration,
}

/// The delivery loop. Returns when `stop` is set, after committing the
/// retirements it has received.
pub fn run(
    mut spool: Spool,
    cfg: DeliveryConfig,
    link: Link,
    rx: Receiver<DeliveryMsg>,
    stop: Arc<AtomicBool>,
    stats: Arc<DeliveryStats>,
) {
    let mut d = Delivery {
        cfg,
        link,
        epoch: 0,
        cursor: 0,
        to_retire: Vec::new(),
        to_mark: Vec::new(),
        stats,
        last_error_log: None,
    };
    while !stop.load(Ordering::Relaxed) {
        let wait = if d.to_retire.is_empty() {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(10)
        };
        match rx.recv_timeout(wait) {
            Ok(msg) => d.handle(msg, &mut spool),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        // Take whatever else is queued without waiting.
        while let Ok(msg) = rx.try_recv() {
            d.handle(msg, &mut spool);
            if d.to_retire.len() >= 256 {
                break;
            }
        }
        d.flush(&mut spool);
        d.fill(&mut spool);
        d.flush(&mut spool);
    }
    // Acks already received are committed before exit; nothing else is.
    while let Ok(msg) = rx.try_recv() {
        if let DeliveryMsg::Acked(r) = msg {
            d.to_retire.push(r);
        }
    }
    d.flush(&mut spool);
}

struct Delivery {
    cfg: DeliveryConfig,
    link: Link,
    epoch: u64,
    /// Highest row id submitted in this epoch.
    cursor: i64,
    to_retire: Vec<i64>,
    to_mark: Vec<i64>,
    stats: Arc<DeliveryStats>,
    last_error_log: Option<Instant>,
}

impl Delivery {
    fn handle(&mut self, msg: DeliveryMsg, spool: &mut Spool) {
        match msg {
            DeliveryMsg::Acked(row) => self.to_retire.push(row),
            DeliveryMsg::Lost {
                epoch,
                rows,
                reason,
            } => {
                // Acks received before the loss are real: commit them first.
                self.flush(spool);
                self.stats
                    .requeued
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                log::debug!(
                    "delivery: epoch {epoch}: {} rows back to replay ({reason})",
                    rows.len()
                );
                self.epoch = epoch;
                self.cursor = 0;
            }
            DeliveryMsg::Connected { .. } | DeliveryMsg::NewRows => {}
        }
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

    /// Commit pending retirements and attempt marks. On a transient error the
    /// ids stay queued and are retried; nothing is dropped.
    fn flush(&mut self, spool: &mut Spool) {
        let now = wall_clock_ms().0;
        if !self.to_retire.is_empty() {
            match spool.retire(&self.to_retire, now) {
                Ok(n) => {
                    self.stats.retired.fetch_add(n as u64, Ordering::Relaxed);
                    self.to_retire.clear();
                }
                Err(e) => self.log_error("retire", &e),
            }
        }
        if !self.to_mark.is_empty() {
            match spool.mark_sent(&self.to_mark, now, self.cfg.ack_timeout.as_millis() as i64) {
                Ok(()) => self.to_mark.clear(),
                Err(e) => self.log_error("mark sent", &e),
            }
        }
    }

    /// Submit rows while the window has room.
    fn fill(&mut self, spool: &mut Spool) {
        loop {
            if !self.link.connected() {
                return;
            }
            let room = self.cfg.window.saturating_sub(self.link.in_flight());
            if room == 0 {
                return;
            }
            let rows = match spool.sendable(self.cursor, room) {
                Ok(r) => r,
                Err(e) => {
                    self.log_error("read sendable rows", &e);
                    return;
                }
            };
            if rows.is_empty() {
                return;
            }
            for row in rows {
                if self.to_retire.contains(&row.id) {
                    // Acked, retirement not yet committed.
                    self.cursor = row.id;
                    continue;
                }
                if !row.digest_ok() {
                    self.fail(
                        spool,
                        row.id,
                        &row.event_id,
                        "payload does not match its stored digest",
                        "digest_mismatch",
                    );
                    self.cursor = row.id;
                    continue;
                }
                if row.payload.len() > self.cfg.max_payload_bytes {
                    let why = format!(
                        "payload of {} bytes exceeds mqtt.max_payload_bytes {}",
                        row.payload.len(),
                        self.cfg.max_payload_bytes
                    );
                    self.fail(spool, row.id, &row.event_id, &why, "oversized");
                    self.cursor = row.id;
                    continue;
                }
                let topic = format!("{}/events/{}", self.cfg.topic_prefix, row.stream);
                match self
                    .link
                    .submit(self.epoch, self.cfg.window, row.id, &topic, &row.payload)
                {
                    Ok(()) => {
                        self.cursor = row.id;
                        self.to_mark.push(row.id);
                        self.stats.submitted.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(NotNow::ChannelFull | NotNow::WindowFull) => return,
                    Err(NotNow::Disconnected | NotNow::StaleEpoch) => return,
                }
            }
        }
    }

    fn fail(&mut self, spool: &mut Spool, id: i64, event_id: &str, why: &str, counter: &str) {
        log::error!("delivery: event {event_id} marked FAILED: {why}");
        match spool.mark_failed(id, why, counter) {
            Ok(()) => {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.log_error("mark failed", &e),
        }
    }
}
