//! What the MQTT thread does with the broker's acknowledgements of the
//! connection itself: CONNACK (size the window, subscribe to commands,
//! announce the status, submit what is ready) and SUBACK. A row's PUBACK is
//! handled on the poller thread ([`super::rowacks`]).
//!
//! Its one rule: a SUBACK answers the oldest subscription still due on this
//! connection (`conn.subacks_due`), in the order they were sent.

use super::facts::Sub;
use super::handoff::DeliveryMsg;
use super::settings::Protocol;
use super::shared::{lock, Shared};
use super::status::announce_online;
use super::thread::{ConnMode, MqttThread};
use super::wire::Granted;
use rumqttc::QoS;
use std::time::Instant;

impl MqttThread {
    /// CONNACK: subscribe to commands (unless the broker closes connections
    /// on that), announce the retained status, submit what is ready.
    /// Errors: why this connection must end.
    pub(super) fn on_connack(&self, session_present: bool, granted: Granted) -> Result<(), String> {
        if self.mode.get() == ConnMode::Discard {
            // Messages published before the persistent session
            // is back are not queued for us: be quick.
            self.reconnect_now.set(true);
            return Err("broker session discarded to drop an oversized packet; \
                    reconnecting with a persistent session"
                .into());
        }
        {
            let mut s = lock(&self.shared);
            s.connected = true;
            s.connacks += 1;
            s.conn.since = Instant::now();
            s.conn.connacked_at = Some(Instant::now());
            s.granted = granted;
            // The broker's Receive Maximum bounds the window (MQTT 5
            // §3.3.4: a client must not exceed it); rumqttc holds back
            // whatever goes over, which would stall our watchdog's clock.
            let window = granted.receive_max.map_or(self.cfg.inflight_window, |m| {
                self.cfg.inflight_window.min(m.max(1) as usize)
            });
            s.window = if s.window == 1 { 1 } else { window };
            s.full_window = window;
            // Subscribe before any publish of this fresh client
            // (rumqttc does not re-subscribe by itself), so the
            // subscribe's packet id is never one a publish holds.
            // Telemetry never waits on it: see `account_end`.
            s.conn.subacks_due.clear();
            if s.conn.sub.at_connack(Instant::now()) {
                self.subscribe_commands(&mut s)?;
            }
            // Receipts on every connection (rumqttc does not re-subscribe);
            // telemetry never waits on them either.
            if let (Some(t), Some(client)) = (&self.receipts, &s.client) {
                if let Err(e) = client.try_subscribe(t, QoS::AtLeastOnce) {
                    return Err(format!("cannot subscribe to {t}: {e}"));
                }
                s.conn.subacks_due.push_back(Sub::Receipts);
            }
            // Backfill requests, on every connection as well.
            if let (Some(t), Some(client)) = (&self.backfill, &s.client) {
                if let Err(e) = client.try_subscribe(t, QoS::AtLeastOnce) {
                    return Err(format!("cannot subscribe to {t}: {e}"));
                }
                s.conn.subacks_due.push_back(Sub::Backfill);
            }
            if self.cfg.status_topic {
                announce_online(&mut s, &self.cfg);
            }
            s.pump();
        }
        let limits = match self.cfg.protocol {
            Protocol::V311 => ", MQTT 3.1.1".to_owned(),
            Protocol::V5 => format!(
                ", MQTT 5, receive maximum {}, maximum packet size {}",
                granted
                    .receive_max
                    .map_or("not set".to_owned(), |m| m.to_string()),
                granted
                    .max_packet
                    .map_or("not set".to_owned(), |m| format!("{m} bytes")),
            ),
        };
        log::info!(
            "mqtt: connected to {}:{} (session_present={session_present}, keep_alive={} s{limits})",
            self.cfg.host,
            self.cfg.port,
            // MQTT 3.1.1 has no server keep-alive (§3.1.2.10): this is the
            // one in force, whatever the broker's own maximum; an MQTT 5
            // broker may impose its own (Server Keep Alive, §3.2.2.3.14).
            granted
                .keep_alive
                .map_or(self.cfg.keep_alive.as_secs(), u64::from)
        );
        let _ = self
            .to_delivery
            .send(DeliveryMsg::Connected { session_present });
        Ok(())
    }

    /// Send the command SUBSCRIBE on this connection (commands on).
    /// Errors: the client's request channel refused it; the connection ends.
    pub(super) fn subscribe_commands(&self, s: &mut Shared) -> Result<(), String> {
        let (Some(c), Some(client)) = (&self.commands, &s.client) else {
            return Ok(());
        };
        if let Err(e) = client.try_subscribe(&c.topic, QoS::AtLeastOnce) {
            return Err(format!("cannot subscribe to {}: {e}", c.topic));
        }
        s.conn.sub.sent(Instant::now());
        s.conn.subacks_due.push_back(Sub::Commands);
        Ok(())
    }

    /// SUBACK of the command subscription: granted, or refused by the broker
    /// (return code 0x80, MQTT 3.1.1 §3.9.3; mosquitto answers so when its
    /// ACL denies the subscription). Telemetry never waits on it.
    pub(super) fn on_suback(&self, refused: Option<String>) {
        let due = lock(&self.shared).conn.subacks_due.pop_front();
        if due == Some(Sub::Receipts) {
            return self.on_receipts_suback(refused);
        }
        if due == Some(Sub::Backfill) {
            return self.on_backfill_suback(refused);
        }
        let mut s = lock(&self.shared);
        s.conn.sub.answered(refused.is_none());
        if let Some(code) = refused {
            let topic = self.commands.as_ref().map_or("", |c| c.topic.as_str());
            if s.conn.sub_refused.is_none() {
                log::error!("mqtt: the broker refused the command subscription to {topic} ({code}); commands will not arrive, telemetry keeps flowing: check the broker's ACL for this client");
            }
            s.conn.sub_refused = Some(format!(
                "the broker refused the subscription to {topic} ({code}): check its ACL"
            ));
        } else {
            s.subacks += 1;
            s.conn.sub_refused = None;
            drop(s);
            log::info!("mqtt: subscribed to commands");
        }
    }

    /// SUBACK of the backfill subscription: refused (an ACL that does not
    /// let this board read `<topic_prefix>/backfill`), the fleet's requests
    /// do not arrive and nothing else changes: logged at ERROR.
    fn on_backfill_suback(&self, refused: Option<String>) {
        let topic = self.backfill.as_deref().unwrap_or_default();
        match refused {
            Some(code) => log::error!("mqtt: the broker refused the subscription to {topic} ({code}): the fleet cannot ask this board for rows again; check its ACL (docs/fleet.md)"),
            None => log::info!("mqtt: subscribed to backfill requests"),
        }
    }

    /// SUBACK of the receipts subscription: granted, or refused (an ACL
    /// that does not let this board read its receipts). Refused, rows wait
    /// (a refusal retires nothing) and health says so; granted again on a
    /// later connection, receipts are back.
    fn on_receipts_suback(&self, refused: Option<String>) {
        let topic = self.receipts.as_deref().unwrap_or_default();
        let why = refused.map(|code| {
            format!("the broker refused the subscription to {topic} ({code}): check its ACL; rows wait for their receipt until it is granted (a refusal retires nothing)")
        });
        {
            let mut s = lock(&self.shared);
            if s.conn.receipts_unavailable == why {
                return;
            }
            s.conn.receipts_unavailable = why.clone();
        }
        match &why {
            Some(w) => log::error!("mqtt: {w}"),
            None => log::info!("mqtt: subscribed to receipts"),
        }
        let _ = self.to_delivery.send(DeliveryMsg::Receipts {
            available: why.is_none(),
            why,
        });
    }
}
