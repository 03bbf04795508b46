//! The MQTT thread's body ([`MqttThread`]) and its constructor ([`new`]):
//! one connection after another. Choose how to connect, read the setup,
//! drive the connection until it ends, hand every row it had in flight back,
//! wait out the backoff, and again.
//!
//! Its one rule: a connection ends in one place (`lose`), whatever ended it:
//! the epoch moves on, the ack map is dropped and every row it held goes
//! back to the delivery thread as replay-eligible; no packet id outlives
//! the connection it was given on.

use super::facts::ConnState;
use super::handoff::{CommandSub, DeliveryMsg};
use super::link::Link;
use super::packet::{drain_limit, incoming_limit, INCOMING_WITHOUT_COMMANDS};
use super::rowacks::RowAcks;
use super::settings::{MqttConfig, RetireOn};
use super::setup::setup;
use super::shared::{lock, Shared};
use super::status::status_topic;
use super::subjudge::{Verdict, KILLS_TO_JUDGE, OFF_MAX};
use super::wire::{self, Granted};
use crate::metrics::Histogram;
use crate::mqtt::ackmap::AckMap;
use crate::os::backoff::Backoff;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How a connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConnMode {
    /// The configured settings and the normal incoming limit.
    Normal,
    /// A larger incoming limit, once, to take an oversized packet the broker
    /// keeps resending so it can be rejected and acknowledged.
    Drain,
    /// A clean session, once, closed right after CONNACK: drops a packet
    /// too large to take at all, with everything else the broker queued.
    Discard,
}

/// The connection thread's body.
pub struct MqttThread {
    pub(super) cfg: MqttConfig,
    /// Command subscription; `None` when commands are off.
    pub(super) commands: Option<CommandSub>,
    /// `<topic_prefix>/receipts` when rows are retired on receipts.
    pub(super) receipts: Option<String>,
    /// `<topic_prefix>/backfill` when the board hears backfill requests
    /// ([`MqttConfig::backfill`]).
    pub(super) backfill: Option<String>,
    /// Incoming packet limit of a normal connection.
    pub(super) incoming_limit: usize,
    /// Size of a packet that exceeded the last connection's limit.
    pub(super) oversize: Cell<Option<usize>>,
    /// The current connection's mode.
    pub(super) mode: Cell<ConnMode>,
    /// Reconnect without the backoff delay (a redelivery was asked for).
    pub(super) reconnect_now: Cell<bool>,
    /// The last attempt ended with a CONNACK refusal (logged at ERROR).
    pub(super) refused: Cell<bool>,
    /// The watchdog ended the last connection (see [`DeliveryMsg::Lost`]).
    pub(super) watchdog_fired: Cell<bool>,
    /// The last attempt ended with a broker that once answered going
    /// away before its CONNACK: restarting or unreachable (logged at WARN).
    pub(super) broker_away: Cell<bool>,
    /// This broker has answered a level-5 CONNECT with a CONNACK (accepted,
    /// or refused for a reason other than the protocol version) since start
    /// or since the config named another broker or protocol: it speaks
    /// MQTT 5, so a connection it closes before its CONNACK says nothing
    /// about `mqtt.protocol`.
    pub(super) v5_answered: Cell<bool>,
    /// Last disconnect reason and when it was logged (repeats are rate-limited).
    pub(super) last_reason: Mutex<Option<(String, Instant)>>,
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) wake: Arc<Condvar>,
    pub(super) to_delivery: Sender<DeliveryMsg>,
    pub(super) stop: Arc<AtomicBool>,
}

/// Create the shared state and the thread body. Run [`MqttThread::run`] on
/// its own thread; give the [`Link`] to the delivery thread.
pub fn new(
    cfg: MqttConfig,
    to_delivery: Sender<DeliveryMsg>,
    stop: Arc<AtomicBool>,
    commands: Option<CommandSub>,
) -> (Link, MqttThread) {
    let shared = Arc::new(Mutex::new(Shared {
        ack: AckMap::new(),
        client: None,
        connected: false,
        epoch: 0,
        window: cfg.inflight_window,
        full_window: cfg.inflight_window,
        ready: VecDeque::new(),
        submitted: Vec::new(),
        acked: Vec::new(),
        notified: false,
        progress_at: None,
        reconfigure: None,
        connacks: 0,
        subacks: 0,
        conn: ConnState::new(),
        status: cfg
            .status_topic
            .then(|| (status_topic(&cfg), serde_json::json!({}))),
        redeliver: false,
        rebuild: None,
        sent_at: VecDeque::new(),
        puback_latency: Histogram::new(),
        status_too_large_logged: false,
        granted: Granted::default(),
        refused: Vec::new(),
        batches: HashMap::new(),
        receipts_queued: 0,
        receipts_dropped: 0,
        requests_queued: 0,
        requests_dropped: 0,
        notes: VecDeque::new(),
        acks_due: VecDeque::new(),
    }));
    let receipts =
        (cfg.retire_on == RetireOn::Receipt).then(|| format!("{}/receipts", cfg.topic_prefix));
    let backfill = cfg.backfill().then(|| cfg.backfill_topic());
    let incoming_limit = commands
        .as_ref()
        .map_or(INCOMING_WITHOUT_COMMANDS, |c| {
            incoming_limit(&c.topic, c.max_payload_bytes)
        })
        .max(receipts.as_ref().map_or(0, |t| {
            // Room for a receipt over the limit to arrive and be refused
            // as such (not dropped by the broker: MQTT 5 counts the whole
            // packet, fixed header and properties too).
            incoming_limit(t, crate::event::receipts::MAX_RECEIPT_BYTES + 64)
        }))
        .max(backfill.as_ref().map_or(0, |t| {
            incoming_limit(t, crate::event::backfill::MAX_REQUEST_BYTES + 64)
        }));
    let wake = Arc::new(Condvar::new());
    (
        Link {
            shared: shared.clone(),
            wake: wake.clone(),
        },
        MqttThread {
            cfg,
            commands,
            receipts,
            backfill,
            incoming_limit,
            oversize: Cell::new(None),
            mode: Cell::new(ConnMode::Normal),
            reconnect_now: Cell::new(false),
            refused: Cell::new(false),
            broker_away: Cell::new(false),
            watchdog_fired: Cell::new(false),
            v5_answered: Cell::new(false),
            last_reason: Mutex::new(None),
            shared,
            wake,
            to_delivery,
            stop,
        },
    )
}

/// A reconnect delay at least this long is said at INFO: an operator who
/// just restarted the broker wonders why nothing connects yet.
const ANNOUNCED_DELAY: Duration = Duration::from_secs(5);

impl MqttThread {
    /// Drive connections until the stop flag is set.
    pub fn run(mut self) {
        // rumqttc's rustls needs a process-wide crypto provider: ring (see
        // Cargo.toml). An error means one is installed already, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut backoff = Backoff::new(self.cfg.reconnect_min, self.cfg.reconnect_max);
        let mut first = true;
        let mut said = false;
        while !self.stop.load(Ordering::Relaxed) {
            let new_cfg = lock(&self.shared).reconfigure.take();
            if let Some(c) = new_cfg {
                if (&c.host, c.port, c.protocol)
                    != (&self.cfg.host, self.cfg.port, self.cfg.protocol)
                {
                    // Another broker (or protocol): what the last one
                    // answered says nothing about this one.
                    self.v5_answered.set(false);
                }
                backoff = Backoff::new(c.reconnect_min, c.reconnect_max);
                self.cfg = c;
                first = true; // reconnect at once with the new settings
            }
            if !first {
                let delay = backoff.next_delay();
                // The first wait people notice is said, once until a
                // connection is healthy again (not at every attempt).
                if delay >= ANNOUNCED_DELAY && !said {
                    log::info!(
                        "mqtt: next connection attempt in {:.1} s; attempts back off up to {} s (mqtt.reconnect_max_ms), not said again until connected",
                        delay.as_secs_f64(),
                        self.cfg.reconnect_max.as_secs()
                    );
                    said = true;
                } else {
                    log::debug!("mqtt: reconnecting in {} ms", delay.as_millis());
                }
                self.sleep(delay);
                if self.stop.load(Ordering::Relaxed) {
                    break;
                }
            }
            first = false;
            let mode = self.next_mode();
            self.mode.set(mode);
            let limit = match mode {
                ConnMode::Drain => drain_limit(self.incoming_limit),
                ConnMode::Normal | ConnMode::Discard => self.incoming_limit,
            };
            let setup = match setup(&self.cfg, limit, mode == ConnMode::Discard) {
                Ok(o) => o,
                Err(e) => {
                    self.lose(&e);
                    continue;
                }
            };
            let (client, raw) = wire::connect(&self.cfg, setup);
            let rows = RowAcks::new(self.shared.clone(), self.to_delivery.clone());
            let mut connection = super::poller::Conn::start(raw, self.cfg.keep_alive, rows);
            lock(&self.shared).client = Some(client.clone());
            let reason = self.drive(&mut connection);
            let (carried, lived) = {
                let s = lock(&self.shared);
                let lived = s.conn.connacked_at.map(|t| t.elapsed());
                (
                    s.conn.had_puback,
                    lived.is_some_and(|t| t >= self.cfg.keep_alive),
                )
            };
            if carried || lived {
                // A connection that carried data (a PUBACK), or was up for
                // a keep-alive: a healthy connection that ended.
                backoff.reset();
                said = false;
            }
            client.try_disconnect();
            self.lose(&reason);
            if self.reconnect_now.take() {
                first = true;
            }
        }
        let _ = lock(&self.shared).client.take();
    }

    /// How to make the next connection, after what ended the last one.
    fn next_mode(&self) -> ConnMode {
        let Some(n) = self.oversize.take() else {
            return ConnMode::Normal;
        };
        let drain = drain_limit(self.incoming_limit);
        if n <= drain {
            log::warn!(
                "mqtt: the broker sent a {n}-byte packet, over the incoming limit of {} bytes \
                 (commands.max_payload_bytes plus topic and header); taking it on one connection \
                 with a {drain}-byte limit so it is rejected and acknowledged, not resent forever",
                self.incoming_limit
            );
            ConnMode::Drain
        } else if self.cfg.clean_session {
            // A clean session drops it at every disconnect already.
            ConnMode::Normal
        } else {
            log::error!(
                "mqtt: the broker sent a {n}-byte packet, larger than this agent takes at all \
                 ({drain} bytes); discarding the broker session once (clean session) to drop it: \
                 commands queued at the broker for this board are lost. If it is a retained \
                 command, clear it (an empty retained message) or set the broker's message size limit"
            );
            ConnMode::Discard
        }
    }

    /// Sleep `d`, or less if [`Link::stop`] or [`Link::reconfigure`] wakes us.
    fn sleep(&self, d: Duration) {
        let until = Instant::now() + d;
        let mut s = lock(&self.shared);
        while !self.stop.load(Ordering::Relaxed) && s.reconfigure.is_none() {
            let now = Instant::now();
            if now >= until {
                break;
            }
            s = self
                .wake
                .wait_timeout(s, until - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Drop the connection's bookkeeping; every row in flight becomes replay-eligible.
    fn lose(&self, reason: &str) {
        let (epoch, rows, quick, closed_on_rows) = {
            let mut s = lock(&self.shared);
            let (quick, by_peer) = self.account_end(&mut s, reason);
            let keep_alive = self.cfg.keep_alive;
            let closed_on_rows = by_peer
                && !s.ack.is_empty()
                && s.progress_at.is_some_and(|t| t.elapsed() < keep_alive);
            s.connected = false;
            s.client = None;
            s.epoch += 1;
            s.progress_at = None;
            s.sent_at.clear();
            s.ready.clear();
            s.acks_due.clear();
            // Holdings are announced again at the next connection; an
            // answer lost here is asked again by the fleet.
            s.notes.clear();
            // A new session redelivers by itself, and is the rebuild asked for.
            s.redeliver = false;
            s.rebuild = None;
            let handles: Vec<i64> = s.ack.reset().into_iter().filter(|r| *r >= 0).collect();
            let rows: Vec<i64> = handles.into_iter().flat_map(|r| s.members(r)).collect();
            s.batches.clear();
            (s.epoch, rows, quick, closed_on_rows)
        };
        let repeat = {
            let mut last = self.last_reason.lock().unwrap_or_else(|p| p.into_inner());
            let same = last
                .as_ref()
                .is_some_and(|(r, t)| r == reason && t.elapsed() < Duration::from_secs(60));
            if !same {
                *last = Some((reason.to_owned(), Instant::now()));
            }
            same
        };
        let refused = self.refused.take();
        let away = self.broker_away.take();
        if rows.is_empty() && repeat {
            // The same failure again within a minute: no new information.
            log::debug!("mqtt: disconnected: {reason}");
        } else if refused {
            // The broker answered and said no: retrying will not change
            // that until the broker or this config does.
            log::error!("mqtt: {reason}; retrying with backoff");
        } else if away {
            // Nothing for the operator to change here; it passes when the
            // broker is back.
            log::warn!("mqtt: {reason}; retrying with backoff");
        } else if rows.is_empty() || self.stop.load(Ordering::Relaxed) {
            // At a clean stop the rows in flight simply stay SENT for the next run.
            log::info!(
                "mqtt: disconnected: {reason} ({} rows in flight stay unacknowledged)",
                rows.len()
            );
        } else {
            log::warn!("mqtt: disconnected: {reason}; requeued {} unacknowledged rows for replay from the spool", rows.len());
        }
        let _ = self.to_delivery.send(DeliveryMsg::Lost {
            epoch,
            rows,
            reason: reason.to_owned(),
            quick,
            closed_on_rows,
            watchdog: self.watchdog_fired.take(),
        });
    }

    /// Bookkeeping when a connection ends (or an attempt fails): backoff,
    /// quick drops, and whether the command subscription goes out next
    /// time ([`super::subjudge`]). Returns `(quick, by_peer)`: the
    /// connection ended within a keep-alive of CONNACK without a PUBACK,
    /// closed by the peer; closed by the peer or the network at all.
    fn account_end(&self, s: &mut Shared, reason: &str) -> (bool, bool) {
        let keep_alive = self.cfg.keep_alive;
        let c = &mut s.conn;
        if s.connected {
            c.since = Instant::now();
        }
        c.last_error = Some(reason.to_owned());
        // Taken whatever else holds, so it never outlives its connection.
        let by_peer = std::mem::take(&mut c.peer_closed) && !self.stop.load(Ordering::Relaxed);
        let Some(at) = c.connacked_at.take() else {
            return (false, by_peer);
        };
        let short = at.elapsed() < keep_alive;
        let quick = short && !c.had_puback && by_peer;
        if quick {
            c.quick_drops += 1;
        } else {
            c.quick_drops = 0;
        }
        match c.sub.ended(Instant::now(), by_peer) {
            Verdict::Same => {}
            Verdict::Off { kills, off_for } => {
                let msg = format!(
                    "the broker closed the connection right after the command SUBSCRIBE {kills} times in a row (ACL?); connecting without it, trying again in {} s (at most {} s off at a time)",
                    off_for.as_secs(),
                    OFF_MAX.as_secs()
                );
                if kills == KILLS_TO_JUDGE {
                    log::error!("mqtt: {msg}; telemetry keeps flowing");
                } else {
                    log::warn!("mqtt: {msg}");
                }
            }
            Verdict::Withdrawn => log::warn!(
                "mqtt: a connection without the command subscription was closed as soon: the link drops connections, not the subscription; subscribing again on every connection"
            ),
        }
        c.had_puback = false;
        c.left_receipts = false;
        (quick, by_peer)
    }
}
