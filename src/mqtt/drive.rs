//! Polling one connection ([`MqttThread::drive`]): wait for the next event
//! no longer than the watchdog allows, hand each event to its handler, and
//! end the connection when it fails, when new settings or a redelivery ask
//! for a fresh one, or when the watchdog expires.
//!
//! Its one rule: the poll is the thread's only clock (no timer thread).
//! The wait is cut to the watchdog's deadline while rows are in flight, and
//! a connection ends by returning its reason: the bookkeeping of the end is
//! the caller's (`MqttThread::lose`), never done here.

use super::link::Link;
use super::poller::Conn;
use super::settings::Protocol;
use super::shared::{lock, Shared};
use super::thread::MqttThread;
use super::wire::{Ev, Failure};
use rumqttc::RecvTimeoutError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Longest poll while connected with nothing in flight (rumqttc sends its
/// keep-alive pings from inside the poll, so this is only a safety net).
const IDLE_WAIT: Duration = Duration::from_secs(30);

impl MqttThread {
    /// Poll one connection until it fails; returns why.
    pub(super) fn drive(&self, connection: &mut Conn) -> String {
        // Long enough to see a connect attempt through, short enough to see
        // the stop flag (the poll itself runs on, never cut short:
        // [`super::poller`]).
        let connect_wait = self.cfg.connect_timeout + Duration::from_secs(2);
        let mut wait = self.wait(&lock(&self.shared), connect_wait);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return "agent stopping".into();
            }
            let event = connection.recv_timeout(wait);
            if self.stop.load(Ordering::Relaxed) {
                // Whatever woke us (the offline status, a DISCONNECT): stop.
                // The PUBACKs the poller receives until the connection is
                // lost still retire theirs (`super::rowacks`).
                if let Ok(Ok(Ev::End(why))) = &event {
                    log::warn!("mqtt: at the stop: {why}");
                }
                return "agent stopping".into();
            }
            match event {
                Ok(Ok(Ev::ConnAck {
                    session_present,
                    granted,
                })) => {
                    if self.cfg.protocol == Protocol::V5 {
                        self.v5_answered.set(true);
                    }
                    if let Err(why) = self.on_connack(session_present, granted) {
                        return why;
                    }
                }
                // Handled on the poller thread (`super::rowacks`); not
                // forwarded here.
                Ok(Ok(Ev::OutgoingPublish(_) | Ev::PubAck { .. })) => {}
                Ok(Ok(Ev::End(why))) => return why,
                Ok(Ok(Ev::Publish(p))) => match &self.commands {
                    Some(c) if p.topic == *c.topic => {
                        let epoch = lock(&self.shared).epoch;
                        (c.sink)(epoch, p);
                    }
                    _ if self.receipts.as_deref() == Some(p.topic.as_str()) => {
                        self.on_receipt(p);
                    }
                    _ if self.backfill.as_deref() == Some(p.topic.as_str()) => {
                        self.on_request(p);
                    }
                    _ => {
                        if self.receipts.is_none() && p.topic == self.receipts_topic() {
                            self.leave_receipts();
                        }
                        // Not ours: acknowledge so the broker does not resend it.
                        let epoch = lock(&self.shared).epoch;
                        Link {
                            shared: self.shared.clone(),
                            wake: self.wake.clone(),
                        }
                        .ack(epoch, &p);
                    }
                },
                Ok(Ok(Ev::SubAck { refused })) => self.on_suback(refused),
                Ok(Ok(Ev::DisconnectSent)) => log::trace!("mqtt: our DISCONNECT left"),
                Ok(Ok(Ev::Other(ev))) => log::trace!("mqtt: {ev}"),
                Ok(Err(f)) => return self.on_failure(f),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return "event loop closed".into(),
            }
            // One lock after each event (a row's own events do not come
            // here: `super::rowacks`): the acknowledgements held back,
            // whether the connection ends, and how long the next wait may be.
            let end = {
                let mut s = lock(&self.shared);
                // The request channel drains as the event loop runs: hand it
                // the acknowledgements that found it full (then the rows
                // they held back).
                if !s.acks_due.is_empty() {
                    s.pump();
                }
                wait = self.wait(&s, connect_wait);
                self.retry_commands(&mut s)
                    .err()
                    .or_else(|| self.why_end(&mut s))
            };
            if let Some(why) = end {
                return why;
            }
        }
    }

    /// How long the next poll may wait. Event-driven: events come for
    /// CONNACK, SUBACKs and incoming PUBLISHes, for rumqttc's own keep-alive
    /// pings and for the DISCONNECT that stop/reconfigure send; our only
    /// timers are the watchdog's deadline while rows are in flight and,
    /// connected without the command subscription, the time to send it. A row's
    /// own events do not come here ([`super::rowacks`]), so with nothing in
    /// flight the wait is at most `ack_timeout`: a row submitted meanwhile
    /// starts the watchdog's clock (`progress_at`) after this wait began,
    /// so its deadline is still ahead when the wait ends.
    fn wait(&self, s: &Shared, connect_wait: Duration) -> Duration {
        let wait = self.watchdog_wait(s, connect_wait);
        // Connected without the command subscription: wake to send it.
        match s.conn.sub.retry_at().filter(|_| s.connected) {
            Some(t) => wait.min(
                t.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(50)),
            ),
            None => wait,
        }
    }

    /// Connected without the command subscription and its time has come:
    /// send it on this connection ([`super::subjudge`]). Errors: the
    /// connection must end (the client refused the request).
    fn retry_commands(&self, s: &mut Shared) -> Result<(), String> {
        let due = s.conn.sub.retry_at().is_some_and(|t| Instant::now() >= t);
        if !s.connected || !due {
            return Ok(());
        }
        log::info!("mqtt: trying the command subscription again");
        self.subscribe_commands(s)
    }

    /// How long the next poll may wait for the watchdog's sake.
    fn watchdog_wait(&self, s: &Shared, connect_wait: Duration) -> Duration {
        match s.progress_at.filter(|_| s.connected && !s.ack.is_empty()) {
            _ if !s.connected => connect_wait,
            Some(t) => self
                .cfg
                .ack_timeout
                .saturating_sub(t.elapsed())
                .max(Duration::from_millis(50)),
            None => IDLE_WAIT.min(self.cfg.ack_timeout),
        }
    }

    /// After each event: why this connection must end now, if it must (new
    /// settings, a rebuild or a redelivery asked for, or the watchdog).
    fn why_end(&self, s: &mut Shared) -> Option<String> {
        if s.reconfigure.is_some() {
            return Some("configuration changed; reconnecting with the new settings".into());
        }
        if let Some(why) = s.rebuild.take() {
            self.reconnect_now.set(true);
            return Some(why);
        }
        if std::mem::take(&mut s.redeliver) {
            self.reconnect_now.set(true);
            return Some("reconnecting so the broker redelivers the commands held back".into());
        }
        // Watchdog: connected, rows waiting, no acknowledgement for too
        // long (rumqtt issues 1014/1056: a stall that looks healthy).
        let stalled = s.connected
            && !s.ack.is_empty()
            && s.progress_at
                .is_some_and(|t| t.elapsed() > self.cfg.ack_timeout);
        stalled.then(|| {
            self.watchdog_fired.set(true);
            format!(
                "watchdog: no PUBACK for {} s with rows in flight; rebuilding the client",
                self.cfg.ack_timeout.as_secs()
            )
        })
    }

    /// The connection failed: note what the next connection must know (a
    /// refusal, an oversized packet) and return why, in an operator's words.
    fn on_failure(&self, mut f: Failure) -> String {
        let connected = {
            let mut s = lock(&self.shared);
            s.conn.peer_closed = true;
            s.connected
        };
        let v5 = self.cfg.protocol == Protocol::V5;
        if f.closed_by_peer && !connected && v5 && self.v5_answered.get() {
            // No CONNACK from a broker that has answered MQTT 5 before: a
            // broker shutting down or starting (or a port forward with no
            // broker behind it) does this; the protocol is not the cause.
            f.reason = "the broker closed the connection without answering the CONNECT; it has accepted MQTT 5 before, so it is restarting or unreachable".to_owned();
            self.broker_away.set(true);
        } else if f.closed_by_peer && !connected && v5 {
            // No CONNACK ever: what a broker that does not speak
            // MQTT 5 does with a level-5 CONNECT (aedes 1.2).
            f.reason = "the broker closed the connection without answering the MQTT 5 CONNECT: a broker that does not speak MQTT 5 does this; if so, set mqtt.protocol = \"3.1.1\" (otherwise see the broker's log)".to_owned();
            f.refused = true;
        } else if f.refused && !f.protocol_refused && v5 {
            // A CONNACK that refused for another reason is an MQTT 5 answer.
            self.v5_answered.set(true);
        }
        self.refused.set(f.refused);
        if f.oversize.is_some() {
            self.oversize.set(f.oversize);
        }
        f.reason
    }

    /// A backfill request: to the delivery thread (which reads the spool
    /// and judges it), acknowledged once read. Past
    /// [`super::handoff::REQUESTS_QUEUED_MAX`] waiting one is left
    /// unacknowledged and counted: the broker holds the rest of a flood.
    fn on_request(&self, p: rumqttc::Publish) {
        let (epoch, room) = {
            let mut s = lock(&self.shared);
            let room = s.requests_queued < super::handoff::REQUESTS_QUEUED_MAX;
            if room {
                s.requests_queued += 1;
            } else {
                s.requests_dropped += 1;
            }
            (s.epoch, room)
        };
        if room {
            let _ = self.to_delivery.send(super::DeliveryMsg::Backfill {
                epoch,
                publish: Box::new(p),
            });
        }
    }

    /// `<topic_prefix>/receipts`.
    fn receipts_topic(&self) -> String {
        format!("{}/receipts", self.cfg.topic_prefix)
    }

    /// A receipt came while rows retire on PUBACKs: the session kept the
    /// subscription from when this board retired on receipts. Leave it
    /// (once per connection), so stale receipts stop queuing for this
    /// board at the broker (issue 33). Done on a receipt's arrival, not at
    /// every CONNACK: an UNSUBSCRIBE for a subscription the session does
    /// not have is answered with an error code rumqttc logs as a WARN.
    fn leave_receipts(&self) {
        let mut s = lock(&self.shared);
        if s.conn.left_receipts {
            return;
        }
        s.conn.left_receipts = true;
        let t = self.receipts_topic();
        if let Some(client) = &s.client {
            match client.try_unsubscribe(&t) {
                Ok(()) => log::info!(
                    "mqtt: leaving {t}: the session kept it from receipt mode, and rows now retire on their PUBACK"
                ),
                Err(e) => log::warn!("mqtt: cannot leave the receipts subscription {t}: {e}"),
            }
        }
    }

    /// A receipt: to the delivery thread (which alone may retire rows),
    /// which acknowledges it to the broker once it has read it
    /// (`Link::ack`): the broker's in-flight window paces receipts, none is
    /// dropped for lack of room. Past [`super::RECEIPTS_QUEUED_MAX`] waiting
    /// (a broker that ignores its own window) one is left unacknowledged
    /// and counted: the broker sends it again with the next session.
    fn on_receipt(&self, p: rumqttc::Publish) {
        let (epoch, room) = {
            let mut s = lock(&self.shared);
            let room = s.receipts_queued < super::RECEIPTS_QUEUED_MAX;
            if room {
                s.receipts_queued += 1;
            } else {
                s.receipts_dropped += 1;
            }
            (s.epoch, room)
        };
        if room {
            let _ = self.to_delivery.send(super::DeliveryMsg::Receipt {
                epoch,
                publish: Box::new(p),
            });
        }
    }
}
