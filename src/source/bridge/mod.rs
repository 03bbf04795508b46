//! The `kind = "mqtt"` source: a durable bridge from a local MQTT broker
//! (the mosquitto that Node-RED, a Modbus poller or a script already
//! publish to) into the spool.
//!
//! Its one rule: **a local message is acknowledged (PUBACK) only after the reading it became is committed to the spool**, or
//! when it can never become one (a refused payload, a retained copy, a topic
//! no longer configured). Between the two brokers a QoS 1 message is thus
//! always held by one of them: the local broker keeps it in the bridge's
//! persistent session (clean session off) until our acknowledgement, and
//! redelivers it to the next connection with the same client id.
//!
//! How it runs, per source (three threads):
//! - the source thread (the sampler's) owns the rumqttc sync `Client` and
//!   `Connection`, one fresh pair per connection (an epoch), and turns each
//!   PUBLISH into a [`NewEvent`] with its own reply channel, sent to the
//!   ingest thread at once (many in flight: a reply comes only after the
//!   commit window);
//! - the acker waits for the outcomes in arrival order and acknowledges each
//!   committed one, only on the connection (epoch) it arrived on: a packet
//!   id means nothing on another connection. A refused commit (spool or disk
//!   full) is not acknowledged: the acker ends the connection and the source
//!   thread reconnects after a backoff, so the broker redelivers it;
//! - a watcher ends the connection as soon as the sampler drops the source's
//!   control channel (config reload, agent stop).
//!
//! Duplicates (at least once): a message committed but not yet acknowledged
//! when the connection ends (a kill, a stop, a refusal on the same
//! connection) is redelivered and stored again. With `id_field` the second
//! copy gets the same event id and is not appended again
//! ([`crate::spool::NewEvent::key`]); without it, it is a second event.
//!
//! What is not stored, but acknowledged and counted (persistent counter
//! `bridge_payload_refused`, WARN logged once a minute with topic and
//! reason): a payload [`payload::decode`] refuses. It could never succeed,
//! and leaving it unacknowledged would hold the session's in-flight slot
//! forever. It is not stored as an event with an error field: a consumer
//! would have to filter such events out of every stream.

pub mod loopguard;
pub mod payload;

pub use loopguard::LoopGuard;
pub use payload::{decode, Decoded, PayloadError, PayloadFormat, PayloadSettings, TOPIC_FIELD};

use crate::intake::budget::{Budget, Hold};
use crate::intake::IngestMsg;
use crate::os::backoff::Backoff;
use crate::spool::{CommitOutcome, NewEvent, ReadingKey, Reply};
use rumqttc::{Client, Connection, Event, Outgoing, Packet, Publish, QoS, RecvTimeoutError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default `max_payload_bytes` of an mqtt source: 64 KiB.
pub const DEFAULT_MAX_PAYLOAD: usize = 64 * 1024;

/// Keep-alive of the local connection (MQTT 3.1.1 §3.1.2.10).
const KEEP_ALIVE: Duration = Duration::from_secs(30);
/// TCP connect + CONNACK; the broker is local.
const CONNECT_TIMEOUT_SECS: u64 = 5;
/// Room in rumqttc's request channel for acknowledgements: far above a
/// broker's in-flight limit per client (mosquitto's default is 20).
const REQUESTS: usize = 1024;
/// Reconnect backoff.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Past this, a packet over the incoming limit is not taken even once.
const LARGEST_DRAIN: usize = 64 * 1024 * 1024;
/// Repeated warnings are logged at most once per this period.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// How long a message waits for room in memory (the bridges' share of
/// `ingest.max_buffered_bytes`) before the bridge gives up on it for now:
/// well inside the keep-alive, which only a poll of the connection serves.
const ROOM_WAIT: Duration = Duration::from_secs(10);

/// A validated `kind = "mqtt"` source (built by the config module).
#[derive(Debug, Clone, PartialEq)]
pub struct BridgeSpec {
    /// Host of `url` (the local broker).
    pub host: String,
    /// Port of `url`.
    pub port: u16,
    /// `topics`: topic filters (MQTT 3.1.1 §4.7), each checked by
    /// [`check_filter`].
    pub topics: Vec<String>,
    /// `qos`: of the subscriptions; the config accepts only 1. 0 cannot be
    /// made durable (never queued for an offline session, never
    /// acknowledged); 2 livelocks with rumqttc 0.25, which keeps no QoS 2
    /// state across connections: a PUBREL resent after a reconnect ends
    /// every new connection ("unsolicited ack"). A QoS 2 publisher's
    /// messages arrive here at QoS 1 (MQTT 3.1.1 §3.8.4).
    pub qos: QoS,
    /// `client_id`: the persistent session's identity at the local broker;
    /// default `edgespool-bridge-<device_id>-<source name>`.
    pub client_id: String,
    /// `username` and `password_file` (read at each connect).
    pub credentials: Option<(String, Option<PathBuf>)>,
    /// `payload`, `max_payload_bytes`, `id_field`.
    pub payload: PayloadSettings,
    /// Set by the config when `topics` take the agent's own events and the
    /// broker is not the main one as far as the config could tell without
    /// a resolver: the bridge resolves both at its start and stays off if
    /// they are one broker (a loop).
    pub loop_guard: Option<LoopGuard>,
}

impl BridgeSpec {
    /// `mqtt://host:port`, for messages.
    pub fn url(&self) -> String {
        format!("mqtt://{}:{}", self.host, self.port)
    }
}

/// Checks one `topics` entry: non-empty, at most 65,535 bytes, no NUL
/// (MQTT 3.1.1 §4.7.3, §1.5.3), `#` only as the whole last level and `+`
/// only as a whole level (§4.7.1).
///
/// # Errors
///
/// What is wrong, as a sentence.
pub fn check_filter(filter: &str) -> Result<(), String> {
    if filter.is_empty() {
        return Err("a topic filter must not be empty".into());
    }
    if filter.len() > 65_535 {
        return Err("a topic filter is at most 65535 bytes".into());
    }
    if filter.contains('\0') {
        return Err("a topic filter must not contain NUL".into());
    }
    if !rumqttc::valid_filter(filter) {
        return Err("not a valid topic filter: '#' only as the whole last level, '+' only as a whole level (MQTT 3.1.1 §4.7.1)".into());
    }
    Ok(())
}

/// Whether `topic` matches `filter` (MQTT 3.1.1 §4.7): a topic starting
/// with `$` matches only a filter that starts with `$` too (§4.7.2).
pub fn filter_matches(filter: &str, topic: &str) -> bool {
    match (topic.strip_prefix('$'), filter.strip_prefix('$')) {
        (Some(t), Some(f)) => rumqttc::matches(t, f),
        (Some(_), None) => false,
        (None, _) => rumqttc::matches(topic, filter),
    }
}

/// What `check-config --sample` says about an mqtt source: it takes no
/// sample, but the local broker should accept TCP at `url` (tried for up
/// to `timeout` per address).
///
/// # Errors
///
/// The address does not resolve or no address accepts a connection.
pub fn probe(spec: &BridgeSpec, timeout: Duration) -> Result<String, String> {
    use std::net::ToSocketAddrs;
    let addrs = (spec.host.as_str(), spec.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {}: {e}", spec.url()))?;
    let mut last = format!("{} resolves to no address", spec.url());
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(_) => {
                return Ok(format!(
                    "mqtt bridge from {} (topics {}): the broker accepts connections; no sample taken, readings arrive as local programs publish",
                    spec.url(),
                    spec.topics.join(", ")
                ))
            }
            Err(e) => last = format!("cannot connect to {} ({a}): {e}", spec.url()),
        }
    }
    Err(last)
}

/// The connection of the moment, shared by the three threads.
struct Shared {
    conn: Mutex<Conn>,
    /// Wakes the backoff sleep.
    wake: Condvar,
    /// The source is to stop (its control channel closed).
    stop: AtomicBool,
    /// 1 + the epoch of a connection on which a commit was refused (0:
    /// none): that connection ends so the broker redelivers what was not
    /// acknowledged. Tagged, so a late outcome of an older connection does
    /// not end the current one.
    refused: AtomicU64,
    /// The last connection ended on a refused commit.
    refused_before: AtomicBool,
}

struct Conn {
    /// Bumped when a connection ends.
    epoch: u64,
    /// The current connection's client, `None` between connections.
    client: Option<Client>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Acknowledge `publish` if `epoch` is still the current connection.
    /// The client is cloned out so the lock is not held while `ack` waits
    /// for room in the request channel.
    fn ack(&self, epoch: u64, publish: &Publish) {
        let client = {
            let c = self.lock();
            if c.epoch != epoch {
                return;
            }
            c.client.clone()
        };
        if let Some(client) = client {
            if let Err(e) = client.ack(publish) {
                log::debug!("bridge: could not acknowledge pkid {}: {e}", publish.pkid);
            }
        }
    }

    /// Make the connection's poll return: a DISCONNECT request is the one
    /// request the blocking client sends without waiting.
    fn interrupt(&self, epoch: Option<u64>) {
        let c = self.lock();
        if epoch.is_none_or(|e| e == c.epoch) {
            if let Some(client) = &c.client {
                let _ = client.try_disconnect();
            }
        }
        self.wake.notify_all();
    }

    fn stopping(&self, global: &AtomicBool) -> bool {
        self.stop.load(Ordering::Relaxed) || global.load(Ordering::Relaxed)
    }

    /// Sleep `d`, or less if the source is stopped.
    fn sleep(&self, d: Duration, global: &AtomicBool) {
        let until = Instant::now() + d;
        let mut c = self.lock();
        while !self.stopping(global) {
            let now = Instant::now();
            if now >= until {
                break;
            }
            c = self
                .wake
                .wait_timeout(c, (until - now).min(Duration::from_secs(1)))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// A reading sent for commit, waiting for its outcome to be acknowledged.
struct Pending {
    epoch: u64,
    /// The PUBLISH to acknowledge, its payload dropped (only the packet id
    /// and QoS matter).
    ack: Publish,
    outcome: Receiver<CommitOutcome>,
    /// Its room in the bridges' memory budget, given back with the outcome.
    hold: Hold,
}

/// A WARN logged at most once per [`LOG_EVERY`], with how many were held back.
#[derive(Default)]
struct RateLog {
    last: Option<Instant>,
    held: u64,
}

impl RateLog {
    /// Some(note on the lines held back since the last one, empty if
    /// none) when a line is due.
    fn due(&mut self) -> Option<String> {
        if self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            self.held += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(match std::mem::take(&mut self.held) {
            0 => String::new(),
            n => format!("; {n} such lines held back"),
        })
    }
}

/// The acker: waits for each reading's outcome in order; acknowledges the
/// committed ones on their own connection; on a refusal ends that
/// connection (the broker redelivers). Ends when the source thread drops
/// its sender and every outcome is in (the ingest thread answers or drops
/// each reply, so this never waits past the agent's stop).
fn acker(name: String, shared: Arc<Shared>, rx: Receiver<Pending>) {
    let mut log = RateLog::default();
    let mut lasting_log = RateLog::default();
    let mut refused = 0u64;
    for p in rx {
        let outcome = p.outcome.recv();
        drop(p.hold);
        match outcome {
            Ok(Ok(_event_id)) => {
                shared.refused_before.store(false, Ordering::Relaxed);
                shared.ack(p.epoch, &p.ack);
            }
            // Refused for good (a reused id, not encodable): sent again it
            // would be refused again, so acknowledged like a bad payload.
            Ok(Err(why)) if why.lasting => {
                shared.ack(p.epoch, &p.ack);
                if let Some(held) = lasting_log.due() {
                    log::warn!(
                        "bridge {name}: {why}; acknowledged and not stored (it would be refused again){held}"
                    );
                }
            }
            Ok(Err(why)) => {
                refused += 1;
                if let Some(held) = log.due() {
                    log::warn!(
                        "bridge {name}: the spool refused a reading ({why}); not acknowledged, so the local broker keeps it and redelivers it after a reconnect ({refused} refused since start{held})"
                    );
                }
                shared.refused.store(p.epoch + 1, Ordering::Relaxed);
                shared.interrupt(Some(p.epoch));
            }
            // The agent stopped before committing it: not stored, not
            // acknowledged; the broker redelivers it to the next run.
            Err(_) => {}
        }
    }
}

/// How one connection ended.
enum End {
    /// The source is stopping (or the ingest thread is gone).
    Stop,
    /// Lost or failed; reconnect after the backoff.
    Lost(String),
    /// A commit was refused: reconnect after the backoff (not reset), so
    /// the broker redelivers what was not acknowledged.
    Refused,
}

/// One bridge source's state on its own thread.
struct Bridge<'a> {
    name: &'a str,
    spec: &'a BridgeSpec,
    tx: Sender<IngestMsg>,
    /// The bridges' share of the input's memory budget.
    budget: Arc<Budget>,
    /// The loop guard's resolution has found the two brokers apart (or
    /// there is none to check).
    loop_checked: bool,
    room_log: RateLog,
    to_acker: Sender<Pending>,
    shared: Arc<Shared>,
    global: Arc<AtomicBool>,
    /// A connection of this run has subscribed (the first always does:
    /// `topics` may have changed since the session was made).
    subscribed_once: bool,
    refused_payloads: u64,
    refusal_log: RateLog,
    lost_log: RateLog,
    /// A packet over the incoming limit ended the last connection.
    oversize: Option<usize>,
}

/// Run the bridge of source `name` until `ctl` closes (config reload,
/// agent stop) or `global` is set. Readings go to the ingest thread (`tx`),
/// each holding room in `budget` until its outcome. `ctl` carries interval
/// changes, which mean nothing here.
pub fn run(
    name: &str,
    spec: &BridgeSpec,
    (tx, budget): (Sender<IngestMsg>, Arc<Budget>),
    ctl: Receiver<Duration>,
    global: Arc<AtomicBool>,
) {
    let shared = Arc::new(Shared {
        conn: Mutex::new(Conn {
            epoch: 0,
            client: None,
        }),
        wake: Condvar::new(),
        stop: AtomicBool::new(false),
        refused: AtomicU64::new(0),
        refused_before: AtomicBool::new(false),
    });
    let (to_acker, acker_rx) = mpsc::channel();
    let spawned = {
        let (s1, s2) = (shared.clone(), shared.clone());
        let n = name.to_owned();
        std::thread::Builder::new()
            .name(format!("bridge-ack-{name}"))
            .spawn(move || acker(n, s1, acker_rx))
            .and_then(|_| {
                std::thread::Builder::new()
                    .name(format!("bridge-ctl-{name}"))
                    .spawn(move || {
                        while ctl.recv().is_ok() {}
                        s2.stop.store(true, Ordering::Relaxed);
                        s2.interrupt(None);
                    })
            })
    };
    if let Err(e) = spawned {
        log::error!("bridge {name}: cannot start its threads: {e}; this source is off");
        return;
    }
    let mut b = Bridge {
        name,
        spec,
        tx,
        budget,
        loop_checked: spec.loop_guard.is_none(),
        room_log: RateLog::default(),
        to_acker,
        shared,
        global,
        subscribed_once: false,
        refused_payloads: 0,
        refusal_log: RateLog::default(),
        lost_log: RateLog::default(),
        oversize: None,
    };
    b.run();
    log::debug!("bridge {name}: stopped");
}

impl Bridge<'_> {
    fn stopping(&self) -> bool {
        self.shared.stopping(&self.global)
    }

    fn run(&mut self) {
        let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
        let mut first = true;
        while !self.stopping() {
            if !first {
                self.shared.sleep(backoff.next_delay(), &self.global);
                if self.stopping() {
                    break;
                }
            }
            first = false;
            if !self.loop_checked && !self.check_loop() {
                return;
            }
            let opts = match self.options() {
                Ok(o) => o,
                Err(e) => {
                    if self.lost_log.due().is_some() {
                        log::error!("bridge {}: {e}; retrying with backoff", self.name);
                    }
                    continue;
                }
            };
            let (client, mut connection) = Client::new(opts, REQUESTS);
            let mut net = connection.eventloop.network_options();
            net.set_connection_timeout(CONNECT_TIMEOUT_SECS);
            connection.eventloop.set_network_options(net);
            let epoch = {
                let mut c = self.shared.lock();
                c.client = Some(client.clone());
                c.epoch
            };
            let end = self.drive(&client, &mut connection, epoch, &mut backoff);
            {
                let mut c = self.shared.lock();
                c.epoch += 1;
                c.client = None;
            }
            let _ = client.try_disconnect();
            drop(connection);
            match end {
                End::Stop => break,
                End::Refused => {
                    self.shared.refused_before.store(true, Ordering::Relaxed);
                    log::debug!("bridge {}: reconnecting after a refused commit so the local broker redelivers what was not acknowledged", self.name);
                }
                End::Lost(why) => {
                    if let Some(held) = self.lost_log.due() {
                        log::warn!(
                            "bridge {}: connection to {} ended: {why}; reconnecting with backoff{held}",
                            self.name,
                            self.spec.url()
                        );
                    } else {
                        log::debug!("bridge {}: connection ended: {why}", self.name);
                    }
                }
            }
        }
    }

    /// The loop guard at the start: resolve this bridge's broker and the
    /// main one; if they share an address, say so (ERROR, counted
    /// `bridge_loop_refused`) and return false: the source stays off until
    /// the config changes. A name that does not resolve yet is tried again
    /// before the next connect.
    fn check_loop(&mut self) -> bool {
        let Some(g) = &self.spec.loop_guard else {
            return true;
        };
        let main = (g.main_host.as_str(), g.main_port);
        match loopguard::resolved_overlap((&self.spec.host, self.spec.port), main) {
            Ok(None) => {
                self.loop_checked = true;
                true
            }
            Ok(Some((ours, theirs))) => {
                log::error!(
                    "bridge {}: {} reaches {ours}, and mqtt.url's broker {}:{} reaches {theirs}: one broker, and topic {:?} takes the agent's own events ({}) back: a loop; this source is off until the config changes",
                    self.name,
                    self.spec.url(),
                    g.main_host,
                    g.main_port,
                    g.topic,
                    g.own
                );
                for name in [
                    "bridge_loop_refused".to_owned(),
                    format!("bridge_loop_refused.{}", self.name),
                ] {
                    let _ = self.tx.send(IngestMsg::Count { name, by: 1 });
                }
                false
            }
            Err(e) => {
                if self.lost_log.due().is_some() {
                    log::warn!(
                        "bridge {}: cannot check that {} is not mqtt.url's broker yet ({e}); tried again before the next connect",
                        self.name,
                        self.spec.url()
                    );
                }
                true
            }
        }
    }

    /// Connection options: a persistent session, manual acknowledgements,
    /// the password read from its file now (a rotated file applies at the
    /// next connect), an incoming limit above `max_payload_bytes` so an
    /// oversized payload is read and refused, not resent forever.
    fn options(&mut self) -> Result<rumqttc::MqttOptions, String> {
        let s = self.spec;
        let mut o = rumqttc::MqttOptions::new(s.client_id.clone(), s.host.clone(), s.port);
        if let Some((user, file)) = &s.credentials {
            let pass = match file {
                Some(p) => std::fs::read_to_string(p)
                    .map_err(|e| format!("cannot read password_file {}: {e}", p.display()))?
                    .trim_end_matches(['\n', '\r'])
                    .to_owned(),
                None => String::new(),
            };
            o.set_credentials(user.clone(), pass);
        }
        // Room for the topic (at most 65,535 bytes) and the header around
        // a payload up to twice the limit, or 1 MiB.
        let normal = (2 * s.payload.max_payload_bytes).max(1024 * 1024) + 65_535 + 8;
        let incoming = match self.oversize.take() {
            Some(n) if n <= LARGEST_DRAIN => {
                log::warn!(
                    "bridge {}: the local broker sent a {n}-byte packet, over the incoming limit of {normal} bytes; taking it on one connection so it is refused and acknowledged, not resent forever",
                    self.name
                );
                n.max(normal)
            }
            Some(n) => {
                log::error!(
                    "bridge {}: the local broker sends a {n}-byte packet, larger than the bridge takes at all ({LARGEST_DRAIN} bytes); it blocks this session until it is removed: set message_size_limit in mosquitto.conf so such messages are refused at publish",
                    self.name
                );
                normal
            }
            None => normal,
        };
        // Outgoing: the SUBSCRIBE (2 + filter + 1 bytes each, MQTT 3.1.1
        // §3.8.3) is the largest packet the bridge sends.
        let subscribe: usize = s.topics.iter().map(|t| t.len() + 3).sum();
        o.set_max_packet_size(incoming, subscribe + 1024);
        o.set_keep_alive(KEEP_ALIVE);
        o.set_clean_session(false);
        o.set_manual_acks(true);
        o.set_request_channel_capacity(REQUESTS);
        Ok(o)
    }

    /// Poll one connection until it ends.
    fn drive(
        &mut self,
        client: &Client,
        connection: &mut Connection,
        epoch: u64,
        backoff: &mut Backoff,
    ) -> End {
        let connect_wait = Duration::from_secs(CONNECT_TIMEOUT_SECS + 2);
        let mut connected = false;
        loop {
            // Long enough never to cancel a connect attempt (rumqttc's poll
            // is cancelled by the timeout); pings happen inside the poll.
            let wait = if connected { KEEP_ALIVE } else { connect_wait };
            let event = connection.recv_timeout(wait);
            if self.stopping() {
                return End::Stop;
            }
            if self.shared.refused.load(Ordering::Relaxed) == epoch + 1 {
                return End::Refused;
            }
            // The backoff resets once a connection carries something past
            // its CONNACK (a broker that ends each connection right after
            // CONNACK gets the growing delay), and not while commits are
            // refused (reset by the acker's next acknowledgement).
            let carried = matches!(
                &event,
                Ok(Ok(Event::Incoming(
                    Packet::Publish(_) | Packet::SubAck(_) | Packet::PingResp
                ))) | Err(RecvTimeoutError::Timeout)
            );
            if carried && connected && !self.shared.refused_before.load(Ordering::Relaxed) {
                backoff.reset();
            }
            match event {
                Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                    connected = true;
                    log::info!(
                        "bridge {}: connected to {} as {} (session_present={})",
                        self.name,
                        self.spec.url(),
                        self.spec.client_id,
                        ack.session_present
                    );
                    // Without a session the broker has no subscriptions for
                    // us; with one, subscribing again would resend retained
                    // messages, so only the first connection of a run does.
                    if !ack.session_present || !self.subscribed_once {
                        let filters = self
                            .spec
                            .topics
                            .iter()
                            .map(|t| rumqttc::SubscribeFilter::new(t.clone(), self.spec.qos));
                        if let Err(e) = client.try_subscribe_many(filters) {
                            return End::Lost(format!("cannot subscribe: {e}"));
                        }
                    }
                }
                Ok(Ok(Event::Incoming(Packet::SubAck(ack)))) => self.on_suback(&ack),
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    if !self.on_publish(p, epoch) {
                        return End::Stop;
                    }
                }
                Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) => {
                    return End::Lost("disconnected".into());
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    if let rumqttc::ConnectionError::MqttState(
                        rumqttc::StateError::Deserialization(
                            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
                        ),
                    ) = &e
                    {
                        self.oversize = Some(*n);
                    }
                    return End::Lost(e.to_string());
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return End::Lost("event loop closed".into())
                }
            }
        }
    }

    fn on_suback(&mut self, ack: &rumqttc::SubAck) {
        let failed: Vec<&str> = ack
            .return_codes
            .iter()
            .zip(&self.spec.topics)
            .filter(|(c, _)| matches!(c, rumqttc::SubscribeReasonCode::Failure))
            .map(|(_, t)| t.as_str())
            .collect();
        if failed.is_empty() {
            self.subscribed_once = true;
            log::info!(
                "bridge {}: subscribed to {} at {:?}",
                self.name,
                self.spec.topics.join(", "),
                self.spec.qos
            );
        } else {
            // Not retried at once: an ACL does not change by itself. The
            // next connection without a session tries again.
            log::error!(
                "bridge {}: the local broker refused the subscription to {} (SUBACK 0x80): check its ACL for client {}",
                self.name,
                failed.join(", "),
                self.spec.client_id
            );
        }
    }

    /// One PUBLISH: a reading sent for commit (acknowledged by the acker
    /// after it), or acknowledged now if it can never become one. False
    /// when the ingest thread is gone.
    fn on_publish(&mut self, mut p: Publish, epoch: u64) -> bool {
        let configured = self.spec.topics.iter().any(|f| filter_matches(f, &p.topic));
        if p.retain || !configured {
            // A retained copy (sent because of a subscription, MQTT 3.1.1
            // §3.3.1.3: the message itself was delivered when published),
            // or a topic of a subscription the session kept from an older
            // config.
            log::debug!(
                "bridge {}: acknowledged without storing a {} message on {}",
                self.name,
                if p.retain {
                    "retained"
                } else {
                    "no longer configured"
                },
                p.topic
            );
            self.shared.ack(epoch, &p);
            return true;
        }
        let decoded = match decode(&p.topic, &p.payload, &self.spec.payload) {
            Ok(d) => d,
            Err(e) => return self.refuse(&p, epoch, &e),
        };
        let (reply, outcome) = Reply::channel();
        // The message carries no time of its own: the agent's clock. With an
        // `id_field` the event id then derives from the key and this time
        // (with the rest of the payload, [`crate::event::envelope::derived_event_id`]),
        // so a redelivery after a rollback made the spool forget the key is
        // a new event, never a second payload under the first id.
        let now = crate::os::clock::reading_now();
        // The topic is the key's scope: one id on two topics is two messages.
        let key = decoded.key.map(|k| {
            let scope = format!("topic:{}", p.topic);
            ReadingKey::new(scope, k, self.name, &decoded.fields, None)
        });
        let mut ev = NewEvent::new(self.name, now.wall_ms, now.trusted, decoded.fields);
        ev.mono = now.mono.map(Box::new);
        ev.key = key.map(Box::new);
        ev.reply = Some(reply);
        let Some(hold) = self.room_for(&ev, epoch) else {
            // Not handed over and not acknowledged: the broker keeps it.
            return true;
        };
        if self.tx.send(IngestMsg::Reading(ev)).is_err() {
            return false;
        }
        p.payload = Default::default();
        // The acker outlives this thread's sends; if it is gone the reading
        // simply stays unacknowledged and is redelivered.
        let _ = self.to_acker.send(Pending {
            epoch,
            ack: p,
            outcome,
            hold,
        });
        true
    }

    /// Room in memory for `ev`, waiting up to [`ROOM_WAIT`] (counted
    /// `bridge_backpressure` when it waits). `None` when there is none by
    /// then, or the source stops: this connection ends (as on a refused
    /// commit) so the local broker redelivers the message later.
    fn room_for(&mut self, ev: &NewEvent, epoch: u64) -> Option<Hold> {
        if self.shared.refused.load(Ordering::Relaxed) == epoch + 1 {
            // This connection is ending: the rest waits for the next one.
            return None;
        }
        let deadline = Instant::now() + ROOM_WAIT;
        let stopping = || self.shared.stopping(&self.global);
        let taken = self.budget.take(ev.heap_bytes(), Some(deadline), &stopping);
        let waited = match &taken {
            Ok((_, w)) => w.is_some(),
            Err(_) => true,
        };
        if waited {
            for name in [
                "bridge_backpressure".to_owned(),
                format!("bridge_backpressure.{}", self.name),
            ] {
                let _ = self.tx.send(IngestMsg::Count { name, by: 1 });
            }
        }
        match taken {
            Ok((hold, _)) => Some(hold),
            Err(full) => {
                if !self.stopping() {
                    if let Some(held) = self.room_log.due() {
                        log::warn!(
                            "bridge {}: no room in memory for its readings for {} s ({} bytes, {}, full: the spool is not keeping up); not acknowledged, so the local broker keeps the message and redelivers it after a reconnect{held}",
                            self.name,
                            ROOM_WAIT.as_secs(),
                            full.max_bytes,
                            full.key
                        );
                    }
                    self.shared.refused.store(epoch + 1, Ordering::Relaxed);
                    self.shared.interrupt(Some(epoch));
                }
                None
            }
        }
    }

    /// A payload that can never become a reading: acknowledged, counted,
    /// logged rate-limited.
    fn refuse(&mut self, p: &Publish, epoch: u64, why: &PayloadError) -> bool {
        self.shared.ack(epoch, p);
        self.refused_payloads += 1;
        if let Some(held) = self.refusal_log.due() {
            log::warn!(
                "bridge {}: refused a message on {}: {why}; acknowledged and not stored ({} refused since start, counted bridge_payload_refused{held})",
                self.name,
                p.topic,
                self.refused_payloads
            );
        }
        for name in [
            "bridge_payload_refused".to_owned(),
            format!("bridge_payload_refused.{}", self.name),
        ] {
            if self.tx.send(IngestMsg::Count { name, by: 1 }).is_err() {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_checked_as_mqtt_defines_them() {
        for ok in ["plant/#", "#", "+/temp", "a/+/b", "$SYS/#", "a//b"] {
            assert!(check_filter(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/#/b", "a#", "a+/b", "a/b+", "a\0b"] {
            assert!(check_filter(bad).is_err(), "{bad:?}");
        }
        assert!(check_filter(&"a".repeat(65_536)).is_err());
    }

    #[test]
    fn dollar_topics_match_only_dollar_filters() {
        assert!(filter_matches("plant/#", "plant/line1/temp"));
        assert!(filter_matches("plant/+/temp", "plant/line1/temp"));
        assert!(!filter_matches("plant/+", "plant/line1/temp"));
        assert!(!filter_matches("#", "$SYS/broker/uptime"));
        assert!(filter_matches("$SYS/#", "$SYS/broker/uptime"));
        assert!(filter_matches(
            "edgespool/+/events/#",
            "edgespool/b1/events/plant"
        ));
    }

    #[test]
    fn rate_log_holds_repeats_back() {
        let mut l = RateLog::default();
        assert_eq!(l.due().as_deref(), Some(""));
        assert_eq!(l.due(), None);
        assert_eq!(l.due(), None);
        l.last = Some(Instant::now() - LOG_EVERY - Duration::from_secs(1));
        assert_eq!(l.due().as_deref(), Some("; 2 such lines held back"));
    }
}
