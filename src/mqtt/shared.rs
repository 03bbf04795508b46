//! The state the MQTT thread, its poller thread ([`super::rowacks`]) and
//! the delivery thread share ([`Shared`]) behind one mutex, and the pump
//! that moves offered rows into the window.
//!
//! Its one rule: the lock is held for bookkeeping only — no I/O, no SQLite,
//! no waiting under it — and the pump enters each row in the ack FIFO before
//! its request can reach the event loop, under that same lock, so the FIFO's
//! order and the request channel's order stay equal.

use super::facts::ConnState;
use super::handoff::Ready;
use super::settings::MqttConfig;
use super::wire::{Client, Granted, PubAckRefusal};
use crate::metrics::Histogram;
use crate::mqtt::ackmap::{AckMap, MAX_WINDOW};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// State shared by the MQTT thread and the delivery thread; locked only for
/// non-blocking operations (no I/O, no SQLite under this lock).
pub struct Shared {
    pub(super) ack: AckMap<i64>,
    pub(super) client: Option<Client>,
    pub(super) connected: bool,
    pub(super) epoch: u64,
    pub(super) window: usize,
    /// `mqtt.inflight_window`; `window` is 1 while delivery probes.
    pub(super) full_window: usize,
    /// Rows offered by the delivery thread, oldest first, not yet submitted.
    pub(super) ready: VecDeque<Ready>,
    /// Rows submitted since the delivery thread last looked (to mark SENT).
    pub(super) submitted: Vec<i64>,
    /// Rows whose PUBACK arrived since the delivery thread last looked.
    pub(super) acked: Vec<i64>,
    /// A [`super::DeliveryMsg::Progress`] is already on its way.
    pub(super) notified: bool,
    /// When the oldest unanswered publish was submitted, or the last PUBACK arrived.
    pub(super) progress_at: Option<Instant>,
    /// New connection settings to apply with one reconnect.
    pub(super) reconfigure: Option<MqttConfig>,
    /// Rebuild the connection now so the broker redelivers the commands
    /// left unacknowledged while the command thread had no room.
    pub(super) redeliver: bool,
    /// Rebuild the connection now, for this reason (the delivery thread
    /// wants every row read again: [`super::Link::rebuild`]).
    pub(super) rebuild: Option<String>,
    /// CONNACKs accepted and command SUBACKs granted since start (a pushed
    /// config that changes the connection is confirmed by new ones).
    pub(super) connacks: u64,
    pub(super) subacks: u64,
    /// What health needs to know about the connection.
    pub(super) conn: ConnState,
    /// `<topic_prefix>/status` and what the agent last told for it, when
    /// `mqtt.status_topic` is on.
    pub(super) status: Option<(String, serde_json::Value)>,
    /// When each packet id in flight left (`Outgoing::Publish`), for the
    /// PUBACK latency; at most [`SENT_AT_MAX`] entries, cleared with the map.
    pub(super) sent_at: VecDeque<(u16, Instant)>,
    /// Time from a publish leaving to its PUBACK, rows only (this run).
    pub(super) puback_latency: Histogram,
    /// The online status was found over `mqtt.max_packet_bytes` (warned once).
    pub(super) status_too_large_logged: bool,
    /// What this connection's CONNACK granted (MQTT 5).
    pub(super) granted: Granted,
    /// Rows whose PUBACK refused them (MQTT 5 reason code 0x80 or more, not
    /// transient), for the delivery thread to mark FAILED.
    pub(super) refused: Vec<(i64, PubAckRefusal)>,
    /// The rows of each batch submitted on this connection, by its first
    /// row (the handle in the ack map); cleared with the map.
    pub(super) batches: HashMap<i64, Vec<i64>>,
    /// Receipts sent to the delivery thread and not yet taken.
    pub(super) receipts_queued: usize,
    /// Receipts dropped because too many waited.
    pub(super) receipts_dropped: u64,
    /// Backfill requests sent to the delivery thread and not yet taken.
    pub(super) requests_queued: usize,
    /// Backfill requests left unacknowledged because too many waited.
    pub(super) requests_dropped: u64,
    /// The board's own notes to publish (QoS 1): `(topic, payload,
    /// retain)`, its holdings and its answers to backfill requests, at most
    /// [`NOTES_MAX`]; sent ahead of rows, through the ack map as a
    /// stand-in row ([`NOTE_ROW`]). Cleared with the connection.
    pub(super) notes: VecDeque<(String, Vec<u8>, bool)>,
    /// Acknowledgements of incoming QoS 1 PUBLISHes (receipts, commands)
    /// the client's request channel had no room for, oldest first; handed
    /// to it before any new publish. One dropped instead would hold a slot
    /// of the broker's in-flight window for this client until the session
    /// ends. Cleared with the connection.
    pub(super) acks_due: VecDeque<rumqttc::Publish>,
}

/// Bound of [`Shared::acks_due`]: above what a broker keeps unacknowledged
/// for one client (mosquitto's `max_inflight_messages` is 20 by default).
pub(super) const ACKS_DUE_MAX: usize = 1024;

/// Bound of [`Shared::notes`]: the oldest goes beyond it (a newer holdings
/// says more than an older one; a lost answer is asked again).
pub(super) const NOTES_MAX: usize = 8;

/// The ack map's stand-in row for a note's publish: a PUBACK for it
/// retires nothing (as the status's, [`super::status::STATUS_ROW`]).
pub(super) const NOTE_ROW: i64 = -2;

/// Bound of [`Shared::sent_at`]: more than the ack map can hold, so an entry
/// is only ever dropped for a packet id that will get no PUBACK.
pub(super) const SENT_AT_MAX: usize = 2 * MAX_WINDOW;

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("in_flight", &self.ack.len())
            .field("ready", &self.ready.len())
            .field("connected", &self.connected)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl Shared {
    /// Submit ready rows while connected and the window has room, in order.
    /// Each row enters the ack FIFO before its request can reach the event
    /// loop; the lock held by the caller keeps FIFO and channel order equal.
    pub(super) fn pump(&mut self) {
        if !self.connected {
            return;
        }
        let Some(client) = self.client.clone() else {
            return;
        };
        // Acknowledgements first: a publish can wait, a lost one cannot.
        while let Some(p) = self.acks_due.front() {
            if client.try_ack(p).is_err() {
                return;
            }
            self.acks_due.pop_front();
        }
        // The board's notes next: few, small, and the fleet's view of it.
        while self.ack.len() < self.window {
            let Some((topic, payload, retain)) = self.notes.pop_front() else {
                break;
            };
            if self.ack.submitted(NOTE_ROW).is_err() {
                self.notes.push_front((topic, payload, retain));
                return;
            }
            if let Err(e) =
                client.try_publish(&topic, rumqttc::QoS::AtLeastOnce, retain, payload.clone())
            {
                log::debug!("mqtt: note on {topic} waits for room: {e}");
                self.ack.submit_failed();
                self.notes.push_front((topic, payload, retain));
                return;
            }
        }
        while self.ack.len() < self.window {
            let Some(mut r) = self.ready.pop_front() else {
                return;
            };
            if self.ack.submitted(r.row).is_err() {
                self.ready.push_front(r);
                return;
            }
            // The payload moves into the request (no copy per publish); a
            // full channel hands it back.
            let payload = std::mem::take(&mut r.payload);
            match client.try_publish_row(&r.topic, payload, r.event_id) {
                Ok(()) => {
                    if self.progress_at.is_none() {
                        // The watchdog's clock starts with the first row in
                        // flight (the status publish may be ahead of it).
                        self.progress_at = Some(Instant::now());
                    }
                    if r.members.is_empty() {
                        self.submitted.push(r.row);
                    } else {
                        self.submitted.extend_from_slice(&r.members);
                        self.batches.insert(r.row, r.members);
                    }
                }
                Err(Some(payload)) => {
                    // Channel full: it never entered rumqttc; try again later.
                    self.ack.submit_failed();
                    r.payload = payload;
                    self.ready.push_front(r);
                    return;
                }
                Err(None) => {
                    // Refused without its bytes back (rumqttc gives them
                    // back on every refusal it has): the row never entered
                    // rumqttc and cannot wait here unchanged (I3), so this
                    // connection ends and the spool offers it again.
                    self.ack.submit_failed();
                    client.try_disconnect();
                    return;
                }
            }
        }
    }

    /// The rows `row` stands for: a batch's members (forgotten here), else
    /// the row itself.
    pub(super) fn members(&mut self, row: i64) -> Vec<i64> {
        self.batches.remove(&row).unwrap_or_else(|| vec![row])
    }
}

/// The shared state, locked (poisoning is ignored: see the comment inside).
pub(super) fn lock(m: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // A panic elsewhere aborts the process (panic = "abort"), so a poisoned
    // lock only occurs in tests; the data is still consistent there.
    m.lock().unwrap_or_else(|p| p.into_inner())
}
