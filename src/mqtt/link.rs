//! The handle the delivery and command threads hold ([`Link`]): offer rows
//! and take back what became of them, acknowledge commands, ask for a
//! redelivery, new settings, a probe window or a stop, and read what health
//! and metrics report.
//!
//! Its one rule: every call returns at once. It takes the shared lock for
//! bookkeeping only and reaches the MQTT thread through rumqttc's request
//! channel (the `try_` calls) or the wake condvar, never by waiting on it.

use super::facts::LinkFacts;
use super::handoff::{NotNow, Ready};
use super::settings::MqttConfig;
use super::shared::{lock, Shared};
use super::status::offline_payload;
use super::wire::PubAckRefusal;
use crate::metrics::Histogram;
use rumqttc::QoS;
use std::sync::{Arc, Condvar, Mutex};

/// Handle used by the delivery thread.
#[derive(Debug, Clone)]
pub struct Link {
    pub(super) shared: Arc<Mutex<Shared>>,
    /// Wakes the MQTT thread out of a backoff sleep (paired with `shared`).
    pub(super) wake: Arc<Condvar>,
}

impl Link {
    /// Rows in flight (submitted, not yet acknowledged).
    pub fn in_flight(&self) -> usize {
        lock(&self.shared).ack.len()
    }

    /// Rows offered and not yet submitted.
    pub fn ready_len(&self) -> usize {
        lock(&self.shared).ready.len()
    }

    /// The current connection epoch (it changes at every disconnect).
    pub fn epoch(&self) -> u64 {
        lock(&self.shared).epoch
    }

    /// True while connected.
    pub fn connected(&self) -> bool {
        lock(&self.shared).connected
    }

    /// Append `rows` (in row order, after everything offered before) to the
    /// ready queue of `epoch` and submit what the window allows. Never blocks.
    ///
    /// Errors: [`NotNow::StaleEpoch`] when the connection was lost since the
    /// caller's last [`super::DeliveryMsg::Lost`]; the rows are dropped here and read
    /// again from the spool.
    pub fn offer(&self, epoch: u64, rows: Vec<Ready>) -> Result<(), NotNow> {
        let mut s = lock(&self.shared);
        if s.epoch != epoch {
            return Err(NotNow::StaleEpoch);
        }
        s.ready.extend(rows);
        s.pump();
        Ok(())
    }

    /// Acknowledge an incoming QoS 1 PUBLISH (manual acks), only if the
    /// connection it arrived on (`epoch`) is still the current one: a packet
    /// id means nothing on another connection. Otherwise the broker
    /// redelivers it on the next session and the receipt store answers it.
    /// An acknowledgement the client's request channel has no room for now
    /// waits in [`Shared::acks_due`] and goes before the next publish.
    pub fn ack(&self, epoch: u64, publish: &rumqttc::Publish) {
        let mut s = lock(&self.shared);
        if s.epoch != epoch || !s.connected {
            return;
        }
        let Some(c) = s.client.clone() else {
            return;
        };
        if s.acks_due.is_empty() && c.try_ack(publish).is_ok() {
            return;
        }
        if s.acks_due.len() >= super::shared::ACKS_DUE_MAX {
            log::warn!(
                "mqtt: could not acknowledge pkid {}: {} acknowledgements already wait for room",
                publish.pkid,
                s.acks_due.len()
            );
            return;
        }
        s.acks_due.push_back(publish.clone());
        s.pump();
    }

    /// Rebuild the connection at once if it is still the one of `epoch`, so
    /// that the broker redelivers the PUBLISHes left unacknowledged on it (a
    /// broker resends them when the session resumes, not before). Returns
    /// false if the connection changed since: the broker resent them then.
    pub fn redeliver(&self, epoch: u64) -> bool {
        let mut s = lock(&self.shared);
        if s.epoch != epoch || !s.connected {
            return false;
        }
        s.redeliver = true;
        Self::interrupt(&mut s);
        self.wake.notify_all();
        true
    }

    /// Rebuild the connection at once if it is still the one of `epoch`
    /// (`why` is logged as the disconnect's reason), so that every row not
    /// acknowledged is read again from the spool on the next one. Returns
    /// false if the connection changed since (that did it already).
    pub fn rebuild(&self, epoch: u64, why: &str) -> bool {
        let mut s = lock(&self.shared);
        if s.epoch != epoch || !s.connected {
            return false;
        }
        s.rebuild = Some(why.to_owned());
        Self::interrupt(&mut s);
        self.wake.notify_all();
        true
    }

    /// Apply new connection settings with one reconnect (no change → nothing).
    pub fn reconfigure(&self, cfg: MqttConfig) {
        let mut s = lock(&self.shared);
        s.reconfigure = Some(cfg);
        Self::interrupt(&mut s);
        self.wake.notify_all();
    }

    /// The connection as health sees it.
    pub fn health_facts(&self) -> LinkFacts {
        let s = lock(&self.shared);
        LinkFacts {
            connected: s.connected,
            state_for: s.conn.since.elapsed(),
            last_error: s.conn.last_error.clone(),
            in_flight: s.ack.len(),
            no_puback_for: s
                .progress_at
                .filter(|_| !s.ack.is_empty())
                .map(|t| t.elapsed()),
            quick_drops: s.conn.quick_drops,
            commands_unavailable: s.conn.commands_unavailable(),
            receipts_unavailable: s.conn.receipts_unavailable.clone(),
            receipts_dropped: s.receipts_dropped,
        }
    }

    /// The delivery thread took one [`super::DeliveryMsg::Backfill`].
    pub fn took_request(&self) {
        let mut s = lock(&self.shared);
        s.requests_queued = s.requests_queued.saturating_sub(1);
    }

    /// Backfill requests left unacknowledged because too many waited, since
    /// start.
    pub fn requests_dropped(&self) -> u64 {
        lock(&self.shared).requests_dropped
    }

    /// Publish one of the board's notes (its holdings, retained; an answer
    /// to a request) at QoS 1 on this connection, ahead of rows; dropped if
    /// not connected, or over the packet limit in force (logged). Returns
    /// whether it was queued.
    pub fn publish_note(&self, topic: String, payload: Vec<u8>, retain: bool) -> bool {
        let mut s = lock(&self.shared);
        if !s.connected {
            return false;
        }
        let size = super::packet::publish_packet_size(topic.len(), payload.len() + 64);
        let limit = s.granted.max_packet.map_or(usize::MAX, |m| m as usize);
        if size > limit {
            log::warn!("mqtt: a note of {size} bytes on {topic} is over the broker's maximum packet size {limit}: not sent");
            return false;
        }
        if s.notes.len() >= super::shared::NOTES_MAX {
            s.notes.pop_front();
        }
        s.notes.push_back((topic, payload, retain));
        s.pump();
        true
    }

    /// The delivery thread took one [`super::DeliveryMsg::Receipt`].
    pub fn took_receipt(&self) {
        let mut s = lock(&self.shared);
        s.receipts_queued = s.receipts_queued.saturating_sub(1);
    }

    /// Submit one row at a time (`true`) to find a row the broker refuses
    /// by disconnecting, or the whole `mqtt.inflight_window` again.
    pub fn probe(&self, one_at_a_time: bool) {
        let mut s = lock(&self.shared);
        s.window = if one_at_a_time { 1 } else { s.full_window };
    }

    /// CONNACKs accepted and command SUBACKs granted since start.
    pub fn connection_counts(&self) -> (u64, u64) {
        let s = lock(&self.shared);
        (s.connacks, s.subacks)
    }

    /// Time from a publish leaving to its PUBACK, rows only, since start.
    pub fn puback_latency(&self) -> Histogram {
        lock(&self.shared).puback_latency
    }

    /// Wake the MQTT thread now (it sleeps until an event or a deadline):
    /// call after setting its stop flag. With the status topic on, the wake
    /// is the retained `offline` status itself (QoS 0), and the connection
    /// then closes without a DISCONNECT, so the broker publishes the will
    /// too: either way the retained status reads `offline`.
    pub fn stop(&self) {
        let mut s = lock(&self.shared);
        let offline = s
            .status
            .as_ref()
            .zip(s.client.as_ref())
            .is_some_and(|((topic, _), c)| {
                c.try_publish(topic, QoS::AtMostOnce, true, offline_payload())
                    .is_ok()
            });
        if !offline {
            Self::interrupt(&mut s);
        }
        self.wake.notify_all();
    }

    /// What the retained `online` status tells: the board's `device_id` and
    /// where it came from ([`crate::os::identity::DeviceIdSource::kind`]), the
    /// config's sha256 and the backlog (rows not yet acknowledged, at most),
    /// sent at each connect.
    pub fn set_status(&self, device: (&str, &str), config_sha256: &str, backlog: u64) {
        let mut s = lock(&self.shared);
        if let Some(st) = s.status.as_mut() {
            st.1 = serde_json::json!({
                "device_id": device.0,
                "device_id_source": device.1,
                "config_sha256": config_sha256,
                "backlog": backlog,
            });
        }
    }

    /// Make the event loop return from its poll: a DISCONNECT request is the
    /// one request rumqttc's blocking client can send without waiting.
    fn interrupt(s: &mut Shared) {
        if let Some(c) = &s.client {
            c.try_disconnect();
        }
    }

    /// The broker's maximum packet size from this connection's CONNACK
    /// (MQTT 5 §3.2.2.3.6), if it gave one.
    pub fn broker_max_packet(&self) -> Option<usize> {
        lock(&self.shared).granted.max_packet.map(|m| m as usize)
    }

    /// Take the rows the broker refused (PUBACK reason code 0x80 or more,
    /// MQTT 5) since the last call, with the refusal.
    pub fn take_refused(&self) -> Vec<(i64, PubAckRefusal)> {
        std::mem::take(&mut lock(&self.shared).refused)
    }

    /// As the poller thread does on a PUBACK: `rows` acknowledged, not yet
    /// taken by the delivery thread.
    #[cfg(test)]
    pub fn acked_for_test(&self, rows: &[i64]) {
        lock(&self.shared).acked.extend_from_slice(rows);
    }

    /// Take the rows submitted and the rows acknowledged since the last call:
    /// `(submitted, acked)`.
    pub fn take_progress(&self) -> (Vec<i64>, Vec<i64>) {
        let mut s = lock(&self.shared);
        s.notified = false;
        (
            std::mem::take(&mut s.submitted),
            std::mem::take(&mut s.acked),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mqtt::new;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn offers_wait_while_disconnected_and_stale_epochs_are_refused() {
        let (tx, _rx) = std::sync::mpsc::channel();
        let cfg = crate::mqtt::settings::test_config();
        let (link, _t) = new(cfg, tx, Arc::new(AtomicBool::new(false)), None);
        let ready = |row| Ready {
            row,
            topic: Arc::from("t"),
            payload: b"x".to_vec(),
            event_id: None,
            members: Vec::new(),
        };
        // Disconnected: held in the ready queue, nothing in flight.
        assert_eq!(link.offer(0, vec![ready(1)]), Ok(()));
        assert_eq!(link.in_flight(), 0);
        assert_eq!(link.ready_len(), 1);
        assert_eq!(link.offer(1, vec![ready(2)]), Err(NotNow::StaleEpoch));
        assert_eq!(link.ready_len(), 1);
    }
}
