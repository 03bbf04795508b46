//! The MQTT connection thread: owns the rumqttc event loop, turns PUBACKs into
//! retirements through [`AckMap`], and rebuilds the client after every
//! disconnect.
//!
//! Its one rule: **this thread never touches SQLite and never waits on it**;
//! it reports to the delivery thread over a channel, so a slow SD-card fsync
//! cannot starve keepalives.
//!
//! Why the client is rebuilt after every disconnect: rumqttc 0.25.1 keeps
//! unacknowledged publishes in memory and, on a CONNACK without
//! `session_present`, drops them silently (field case F08); on a resumed
//! session it re-sends them with their old packet ids. Neither is a proof of
//! anything we could map back to rows safely, so the spool owns redelivery: on
//! any disconnect, inconsistency or watchdog expiry, every row in flight is
//! handed back as replay-eligible ([`DeliveryMsg::Lost`]) and a fresh client is
//! built after a capped, jittered backoff.

use crate::ack::AckMap;
use crate::backoff::Backoff;
pub mod settings;
pub mod wire;

pub use settings::{MqttConfig, Protocol, TlsFiles};

use rumqttc::{QoS, RecvTimeoutError};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use wire::{Client, Conn, Ev, Granted, PubAckRefusal};

/// Messages to the delivery thread.
#[derive(Debug)]
pub enum DeliveryMsg {
    /// Acknowledgements or submissions are waiting in [`Link::take_progress`],
    /// or the ready queue is running low.
    Progress,
    /// The connection was dropped or rebuilt: these rows are no longer in
    /// flight and none was retired. From now on, offers must carry `epoch`.
    Lost {
        /// The new epoch.
        epoch: u64,
        /// Rows that were in flight.
        rows: Vec<i64>,
        /// Why (for the log).
        reason: String,
        /// The connection ended within a keep-alive of its CONNACK without
        /// carrying a PUBACK (what a broker refusing a publish looks like).
        quick: bool,
    },
    /// CONNACK accepted.
    Connected {
        /// The broker's `session_present` flag (MQTT 3.1.1 §3.2.2.2).
        session_present: bool,
    },
    /// New rows were committed to the spool.
    NewRows,
    /// FAILED rows were requeued (appended again) by `requeue-failed`: an
    /// operator retries them, so a packet limit learned from a dropped
    /// connection is forgotten.
    Requeued,
    /// The agent is stopping: look at the stop flag now.
    Stop,
}

/// A row read from the spool, ready to publish.
#[derive(Debug, Clone)]
pub struct Ready {
    /// Spool row id.
    pub row: i64,
    /// `<topic_prefix>/events/<stream>`.
    pub topic: Arc<str>,
    /// The stored payload bytes.
    pub payload: Vec<u8>,
    /// The row's event id, sent as the `event_id` user property under MQTT 5
    /// (empty for a batch: its events carry their own ids).
    pub event_id: String,
    /// A batch ([`crate::batching`]): every row it carries, `row` first, in
    /// row-id order; one PUBACK retires them all. Empty for a single row.
    pub members: Vec<i64>,
}

/// State shared by the MQTT thread and the delivery thread; locked only for
/// non-blocking operations (no I/O, no SQLite under this lock).
pub struct Shared {
    ack: AckMap<i64>,
    client: Option<Client>,
    connected: bool,
    epoch: u64,
    window: usize,
    /// `mqtt.inflight_window`; `window` is 1 while delivery probes.
    full_window: usize,
    /// Rows offered by the delivery thread, oldest first, not yet submitted.
    ready: VecDeque<Ready>,
    /// Rows submitted since the delivery thread last looked (to mark SENT).
    submitted: Vec<i64>,
    /// Rows whose PUBACK arrived since the delivery thread last looked.
    acked: Vec<i64>,
    /// A [`DeliveryMsg::Progress`] is already on its way.
    notified: bool,
    /// When the oldest unanswered publish was submitted, or the last PUBACK arrived.
    progress_at: Option<Instant>,
    /// New connection settings to apply with one reconnect.
    reconfigure: Option<MqttConfig>,
    /// Rebuild the connection now so the broker redelivers the commands
    /// left unacknowledged while the command thread had no room.
    redeliver: bool,
    /// CONNACKs accepted and command SUBACKs granted since start (a pushed
    /// config that changes the connection is confirmed by new ones).
    connacks: u64,
    subacks: u64,
    /// What health needs to know about the connection.
    conn: ConnState,
    /// `<topic_prefix>/status` and what the agent last told for it, when
    /// `mqtt.status_topic` is on.
    status: Option<(String, serde_json::Value)>,
    /// When each packet id in flight left (`Outgoing::Publish`), for the
    /// PUBACK latency; at most [`SENT_AT_MAX`] entries, cleared with the map.
    sent_at: VecDeque<(u16, Instant)>,
    /// Time from a publish leaving to its PUBACK, rows only (this run).
    puback_latency: crate::metrics::Histogram,
    /// The online status was found over `mqtt.max_packet_bytes` (warned once).
    status_too_large_logged: bool,
    /// What this connection's CONNACK granted (MQTT 5).
    granted: Granted,
    /// Rows whose PUBACK refused them (MQTT 5 reason code 0x80 or more, not
    /// transient), for the delivery thread to mark FAILED.
    refused: Vec<(i64, PubAckRefusal)>,
    /// The rows of each batch submitted on this connection, by its first
    /// row (the handle in the ack map); cleared with the map.
    batches: HashMap<i64, Vec<i64>>,
}

impl Shared {
    /// The rows `row` stands for: a batch's members (forgotten here), else
    /// the row itself.
    fn members(&mut self, row: i64) -> Vec<i64> {
        self.batches.remove(&row).unwrap_or_else(|| vec![row])
    }
}

/// Bound of [`Shared::sent_at`]: more than the ack map can hold, so an entry
/// is only ever dropped for a packet id that will get no PUBACK.
const SENT_AT_MAX: usize = 2 * crate::ack::MAX_WINDOW;

fn offline_payload() -> Vec<u8> {
    br#"{"state":"offline"}"#.to_vec()
}

/// Publish the retained `online` status right after CONNACK, through the ack
/// map (a stand-in row) so packet ids stay matched to rows.
fn announce_online(s: &mut Shared, cfg: &MqttConfig) {
    let Some((topic, info)) = s.status.clone() else {
        return;
    };
    let Some(client) = s.client.clone() else {
        return;
    };
    let mut v = serde_json::json!({
        "state": "online",
        "version": env!("CARGO_PKG_VERSION"),
        "since_ms": crate::envelope::wall_clock_ms().0,
        "client_id": cfg.client_id,
    });
    if let (Some(o), serde_json::Value::Object(i)) = (v.as_object_mut(), info) {
        o.extend(i);
    }
    let payload = v.to_string().into_bytes();
    let size = publish_packet_size(
        topic.len(),
        payload.len() + publish_extra(cfg.protocol, false),
    );
    let limit = packet_limit(cfg.max_packet_bytes, s.granted);
    if size > limit {
        // A broker closes the connection on a packet over its limit: the
        // status must never cost the connection that carries the rows.
        if !s.status_too_large_logged {
            s.status_too_large_logged = true;
            log::warn!(
                "the retained online status on {topic} is a {size}-byte PUBLISH, over the packet limit of {limit} bytes (mqtt.max_packet_bytes or the broker's maximum packet size): not sent (raise the limit or set mqtt.status_topic = false)"
            );
        }
        return;
    }
    if s.ack.submitted(STATUS_ROW).is_err() {
        return;
    }
    if client
        .try_publish(&topic, QoS::AtLeastOnce, true, payload, None)
        .is_err()
    {
        s.ack.submit_failed();
    }
}

/// The connection's story for health and backoff.
#[derive(Debug)]
struct ConnState {
    /// When `connected` last changed.
    since: Instant,
    /// Why the last connection ended or the last attempt failed.
    last_error: Option<String>,
    /// When this connection's CONNACK arrived.
    connacked_at: Option<Instant>,
    /// This connection carried a PUBACK.
    had_puback: bool,
    /// The command SUBSCRIBE went out on this connection and no SUBACK came.
    awaiting_suback: bool,
    /// Connections in a row that ended within a keep-alive of CONNACK
    /// without a PUBACK.
    quick_drops: u32,
    /// Connections in a row that ended while the command SUBSCRIBE waited.
    sub_kills: u32,
    /// Connect without the command subscription until then.
    skip_sub_until: Option<Instant>,
    /// The next wait before trying the command subscription again.
    sub_retry: Duration,
    /// Why commands cannot arrive, if they cannot.
    commands_unavailable: Option<String>,
    /// This connection ended by an error from the peer or the network (not
    /// by our watchdog, a reconfigure or a stop).
    peer_closed: bool,
}

impl ConnState {
    fn new() -> ConnState {
        ConnState {
            since: Instant::now(),
            last_error: None,
            connacked_at: None,
            had_puback: false,
            awaiting_suback: false,
            quick_drops: 0,
            sub_kills: 0,
            skip_sub_until: None,
            sub_retry: SUB_RETRY_MIN,
            commands_unavailable: None,
            peer_closed: false,
        }
    }
}

/// First wait before subscribing to commands again after the broker closed
/// connections on the subscription; doubles up to [`SUB_RETRY_MAX`].
const SUB_RETRY_MIN: Duration = Duration::from_secs(600);
const SUB_RETRY_MAX: Duration = Duration::from_secs(3600);

/// What [`Link::health_facts`] reports.
#[derive(Debug, Clone)]
pub struct LinkFacts {
    /// Connected now.
    pub connected: bool,
    /// How long in the current state.
    pub state_for: Duration,
    /// Why the last connection ended.
    pub last_error: Option<String>,
    /// Rows submitted, not acknowledged.
    pub in_flight: usize,
    /// Since the oldest in-flight row was submitted or the last PUBACK.
    pub no_puback_for: Option<Duration>,
    /// See [`crate::health::Facts::quick_drops`].
    pub quick_drops: u32,
    /// Why commands cannot arrive.
    pub commands_unavailable: Option<String>,
}

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
    fn pump(&mut self) {
        if !self.connected {
            return;
        }
        let Some(client) = self.client.clone() else {
            return;
        };
        while self.ack.len() < self.window {
            let Some(r) = self.ready.front() else {
                return;
            };
            if self.ack.submitted(r.row).is_err() {
                return;
            }
            let event_id = (!r.event_id.is_empty()).then_some(r.event_id.as_str());
            match client.try_publish(
                &r.topic,
                QoS::AtLeastOnce,
                false,
                r.payload.clone(),
                event_id,
            ) {
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
                        self.batches.insert(r.row, r.members.clone());
                    }
                    self.ready.pop_front();
                }
                Err(_) => {
                    // Channel full: it never entered rumqttc; try again later.
                    self.ack.submit_failed();
                    return;
                }
            }
        }
    }
}

/// Why an offer was refused. The rows stay in the spool and are read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotNow {
    /// The caller's epoch is stale: process the pending [`DeliveryMsg::Lost`] first.
    StaleEpoch,
}

/// Handle used by the delivery thread.
#[derive(Debug, Clone)]
pub struct Link {
    shared: Arc<Mutex<Shared>>,
    /// Wakes the MQTT thread out of a backoff sleep (paired with `shared`).
    wake: Arc<Condvar>,
}

fn lock(m: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    // A panic elsewhere aborts the process (panic = "abort"), so a poisoned
    // lock only occurs in tests; the data is still consistent there.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
    /// caller's last [`DeliveryMsg::Lost`]; the rows are dropped here and read
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
    pub fn ack(&self, epoch: u64, publish: &rumqttc::Publish) {
        let s = lock(&self.shared);
        if s.epoch == epoch && s.connected {
            if let Some(c) = &s.client {
                if let Err(e) = c.try_ack(publish) {
                    log::warn!("mqtt: could not acknowledge pkid {}: {e}", publish.pkid);
                }
            }
        }
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
            commands_unavailable: s.conn.commands_unavailable.clone(),
        }
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
    pub fn puback_latency(&self) -> crate::metrics::Histogram {
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
                c.try_publish(topic, QoS::AtMostOnce, true, offline_payload(), None)
                    .is_ok()
            });
        if !offline {
            Self::interrupt(&mut s);
        }
        self.wake.notify_all();
    }

    /// What the retained `online` status tells: the config's sha256 and the
    /// backlog (rows not yet acknowledged, at most), sent at each connect.
    pub fn set_status(&self, config_sha256: &str, backlog: u64) {
        let mut s = lock(&self.shared);
        if let Some(st) = s.status.as_mut() {
            st.1 = serde_json::json!({"config_sha256": config_sha256, "backlog": backlog});
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

/// Longest poll while connected with nothing in flight (rumqttc sends its
/// keep-alive pings from inside the poll, so this is only a safety net).
const IDLE_WAIT: Duration = Duration::from_secs(30);

/// Where PUBLISHes on the command topic go: `(connection epoch, publish)`.
pub type CommandSink = Box<dyn Fn(u64, rumqttc::Publish) + Send>;

/// The command subscription.
pub struct CommandSub {
    /// `<topic_prefix>/commands`.
    pub topic: String,
    /// `commands.max_payload_bytes`: sets the incoming packet limit.
    pub max_payload_bytes: usize,
    /// Where its messages go.
    pub sink: CommandSink,
}

/// Incoming packet limit when commands are off (nothing is subscribed; a
/// session left from an earlier config may still deliver).
const INCOMING_WITHOUT_COMMANDS: usize = 64 * 1024;

/// The incoming packet limit for commands of at most `max_payload` bytes on
/// `topic`: rumqttc compares it with a packet's remaining length, which for
/// a QoS 1 PUBLISH is 2 (topic length) + the topic + 2 (packet id) + the
/// payload (MQTT 3.1.1 §3.3.2).
pub fn incoming_limit(topic: &str, max_payload: usize) -> usize {
    max_payload + topic.len() + 4
}

/// The largest MQTT 3.1.1 control packet: a 1-byte fixed header, a 4-byte
/// Remaining Length and the largest Remaining Length, 268,435,455 bytes
/// (MQTT 3.1.1 §2.2.3). The default of `mqtt.max_packet_bytes`: no limit
/// beyond the protocol's.
pub const PROTOCOL_MAX_PACKET: usize = 1 + 4 + 268_435_455;

/// Bytes of the Remaining Length field for `remaining` (MQTT 3.1.1 §2.2.3:
/// 7 bits per byte, 1 to 4 bytes). `None` past 268,435,455, which no packet
/// can carry.
fn remaining_length_bytes(remaining: usize) -> Option<usize> {
    match remaining {
        0..=127 => Some(1),
        128..=16_383 => Some(2),
        16_384..=2_097_151 => Some(3),
        2_097_152..=268_435_455 => Some(4),
        _ => None,
    }
}

/// Size on the wire of the QoS 1 PUBLISH carrying `payload_len` bytes on a
/// topic of `topic_len` bytes (UTF-8): the whole packet a broker's packet
/// limit counts (mosquitto's `max_packet_size`), not only the payload.
///
/// Fixed header byte (MQTT 3.1.1 §2.2) + Remaining Length (§2.2.3) +
/// topic length prefix (2) + topic (§3.3.2.1) + packet identifier (2, QoS 1,
/// §3.3.2.2) + payload (§3.3.3). Past what Remaining Length can encode the
/// result is `usize::MAX` (over any limit).
pub fn publish_packet_size(topic_len: usize, payload_len: usize) -> usize {
    let remaining = 2usize
        .saturating_add(topic_len)
        .saturating_add(2)
        .saturating_add(payload_len);
    match remaining_length_bytes(remaining) {
        Some(n) => 1 + n + remaining,
        None => usize::MAX,
    }
}

/// The limit of a one-off connection taken after a packet over the normal
/// limit: the 1 MiB this agent always accepted, and more than the normal one.
fn drain_limit(normal: usize) -> usize {
    (1024 * 1024).max(normal * 2)
}

/// How a connection is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnMode {
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
    cfg: MqttConfig,
    /// Command subscription; `None` when commands are off.
    commands: Option<CommandSub>,
    /// Incoming packet limit of a normal connection.
    incoming_limit: usize,
    /// Size of a packet that exceeded the last connection's limit.
    oversize: Cell<Option<usize>>,
    /// The current connection's mode.
    mode: Cell<ConnMode>,
    /// Reconnect without the backoff delay (a redelivery was asked for).
    reconnect_now: Cell<bool>,
    /// The last attempt ended with a CONNACK refusal (logged at ERROR).
    refused: Cell<bool>,
    /// Last disconnect reason and when it was logged (repeats are rate-limited).
    last_reason: Mutex<Option<(String, Instant)>>,
    shared: Arc<Mutex<Shared>>,
    wake: Arc<Condvar>,
    to_delivery: Sender<DeliveryMsg>,
    stop: Arc<AtomicBool>,
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
        sent_at: VecDeque::new(),
        puback_latency: crate::metrics::Histogram::new(),
        status_too_large_logged: false,
        granted: Granted::default(),
        refused: Vec::new(),
        batches: HashMap::new(),
    }));
    let incoming_limit = commands.as_ref().map_or(INCOMING_WITHOUT_COMMANDS, |c| {
        incoming_limit(&c.topic, c.max_payload_bytes)
    });
    let wake = Arc::new(Condvar::new());
    (
        Link {
            shared: shared.clone(),
            wake: wake.clone(),
        },
        MqttThread {
            cfg,
            commands,
            incoming_limit,
            oversize: Cell::new(None),
            mode: Cell::new(ConnMode::Normal),
            reconnect_now: Cell::new(false),
            refused: Cell::new(false),
            last_reason: Mutex::new(None),
            shared,
            wake,
            to_delivery,
            stop,
        },
    )
}

/// Read a secrets file for the connection; the error names the file and the key.
fn read_file(key: &str, path: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read mqtt.{key} {}: {e}", path.display()))
}

/// What a connection needs beyond the config: TLS material and the
/// password read from their files (so rotated files apply at the next
/// connect), the incoming limit, the will. `max_incoming` is the largest
/// packet remaining length taken: rumqttc drops the connection on a larger
/// one before reading it.
///
/// Errors: a file cannot be read; the message names the config key and path.
fn setup(cfg: &MqttConfig, max_incoming: usize, clean: bool) -> Result<wire::Setup, String> {
    let mut transport = None;
    if let Some(tls) = &cfg.tls {
        let ca = read_file("ca_file", &tls.ca_file)?;
        let client_auth = match &tls.client {
            Some((c, k)) => Some((
                read_file("client_cert_file", c)?,
                read_file("client_key_file", k)?,
            )),
            None => None,
        };
        transport = Some(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Simple {
                ca,
                alpn: None,
                client_auth,
            },
        ));
    }
    let mut credentials = None;
    if let Some((user, pass_file)) = &cfg.credentials {
        let pass = match pass_file {
            Some(p) => String::from_utf8(read_file("password_file", p)?)
                .map_err(|_| format!("mqtt.password_file {} is not UTF-8", p.display()))?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
            None => String::new(),
        };
        credentials = Some((user.clone(), pass));
    }
    Ok(wire::Setup {
        max_incoming,
        clean,
        will: cfg
            .status_topic
            .then(|| (status_topic(cfg), offline_payload())),
        credentials,
        transport,
    })
}

/// Bytes a PUBLISH under `protocol` carries beyond the 3.1.1 packet
/// [`publish_packet_size`] counts: nothing under 3.1.1; under MQTT 5 the
/// property length (§3.3.2.3.1) and, for a row, its `event_id` user
/// property ([`wire::V5_EVENT_PROPERTIES`]).
pub fn publish_extra(protocol: crate::mqtt::Protocol, row: bool) -> usize {
    match (protocol, row) {
        (crate::mqtt::Protocol::V311, _) => 0,
        (crate::mqtt::Protocol::V5, true) => wire::V5_EVENT_PROPERTIES,
        (crate::mqtt::Protocol::V5, false) => 1,
    }
}

/// The whole-packet limit in force: `mqtt.max_packet_bytes`, or the
/// broker's Maximum Packet Size from CONNACK (MQTT 5) if smaller.
fn packet_limit(configured: usize, granted: Granted) -> usize {
    granted
        .max_packet
        .map_or(configured, |m| configured.min(m as usize))
}

/// `<topic_prefix>/status`.
fn status_topic(cfg: &MqttConfig) -> String {
    format!("{}/status", cfg.topic_prefix)
}

/// The ack map's stand-in row for the retained `online` status publish: a
/// PUBACK for it retires nothing.
const STATUS_ROW: i64 = -1;

/// A connection error in words an operator can act on. `keep_alive` is
/// the one this client asked for, named when a broker refuses with a code
/// 3.1.1 does not define.
fn classify(e: &rumqttc::ConnectionError, keep_alive: Duration) -> String {
    use rumqttc::ConnectionError as E;
    match e {
        E::Tls(t) => format!("TLS failed: {t} (check mqtt.ca_file, the client certificate and key, their validity dates and the board's clock)"),
        E::ConnectionRefused(code) => refusal(*code),
        E::NetworkTimeout => "connect timed out (broker unreachable?)".to_owned(),
        E::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
        )) => format!("the broker sent a {n}-byte packet, over the incoming limit"),
        E::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::InvalidConnectReturnCode(code),
        )) => undefined_refusal(*code, keep_alive),
        other => format!("connection error: {other}"),
    }
}

/// A CONNACK refusal (MQTT 3.1.1 §3.2.2.3, return codes 1 to 5) in words
/// an operator can act on. Not transient: the same config gets the same
/// answer, so it is logged at ERROR.
fn refusal(code: rumqttc::ConnectReturnCode) -> String {
    use rumqttc::ConnectReturnCode as C;
    match code {
        C::BadUserNamePassword => "the broker refused the login: bad user name or password (CONNACK return code 4): check mqtt.username and mqtt.password_file".to_owned(),
        C::NotAuthorized => "the broker refused the login: not authorized (CONNACK return code 5): check mqtt.username, mqtt.password_file and the broker's access rules for this client".to_owned(),
        C::BadClientId => "the broker refused the client identifier (CONNACK return code 2): check mqtt.client_id".to_owned(),
        C::RefusedProtocolVersion => "the broker refused protocol level 4, MQTT 3.1.1 (CONNACK return code 1)".to_owned(),
        C::ServiceUnavailable => "the broker refused the connection: server unavailable (CONNACK return code 3)".to_owned(),
        C::Success => "broker refused the connection with return code 0".to_owned(),
    }
}

/// A CONNACK return code MQTT 3.1.1 does not define (§3.2.2.3 ends at 5).
/// aedes answers 6 to a keep-alive above its `keepaliveLimit` (the MQTT 5
/// meaning would be a refusal too), so the keep-alive is named.
fn undefined_refusal(code: u8, keep_alive: Duration) -> String {
    format!(
        "the broker refused the connection with CONNACK return code {code}, which MQTT 3.1.1 does not define: \
         some brokers (aedes) send 6 for a keep-alive above their limit; this client asks for a keep-alive of {} s \
         (mqtt.keep_alive_secs): lower it, or check the broker's log for the cause",
        keep_alive.as_secs()
    )
}

/// Whether the broker answered the CONNECT and said no (a CONNACK refusal,
/// or a return code outside 3.1.1): the same config gets the same answer.
fn is_refusal(e: &rumqttc::ConnectionError) -> bool {
    matches!(
        e,
        rumqttc::ConnectionError::ConnectionRefused(_)
            | rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
                rumqttc::mqttbytes::Error::InvalidConnectReturnCode(_),
            ))
    )
}

/// A 3.1.1 connection error as a [`wire::Failure`].
fn failure_v4(e: &rumqttc::ConnectionError, keep_alive: Duration) -> wire::Failure {
    let oversize = match e {
        rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
        )) => Some(*n),
        _ => None,
    };
    wire::Failure {
        reason: classify(e, keep_alive),
        refused: is_refusal(e),
        oversize,
        closed_by_peer: false,
    }
}

impl MqttThread {
    /// Drive connections until the stop flag is set.
    pub fn run(mut self) {
        // rumqttc's rustls needs a process-wide crypto provider: ring (see
        // Cargo.toml). An error means one is installed already, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut backoff = Backoff::new(self.cfg.reconnect_min, self.cfg.reconnect_max);
        let mut first = true;
        while !self.stop.load(Ordering::Relaxed) {
            let new_cfg = lock(&self.shared).reconfigure.take();
            if let Some(c) = new_cfg {
                backoff = Backoff::new(c.reconnect_min, c.reconnect_max);
                self.cfg = c;
                first = true; // reconnect at once with the new settings
            }
            if !first {
                let delay = backoff.next_delay();
                log::debug!("mqtt: reconnecting in {} ms", delay.as_millis());
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
            let (client, mut connection) = wire::connect(&self.cfg, setup);
            lock(&self.shared).client = Some(client.clone());
            let reason = self.drive(&mut connection, &mut backoff);
            let lived = lock(&self.shared)
                .conn
                .connacked_at
                .is_some_and(|t| t.elapsed() >= self.cfg.keep_alive);
            if lived {
                // Up for a keep-alive: a healthy connection that ended.
                backoff.reset();
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
        let (epoch, rows, quick) = {
            let mut s = lock(&self.shared);
            let quick = self.account_end(&mut s, reason);
            s.connected = false;
            s.client = None;
            s.epoch += 1;
            s.progress_at = None;
            s.sent_at.clear();
            s.ready.clear();
            // A new session redelivers by itself.
            s.redeliver = false;
            let handles: Vec<i64> = s.ack.reset().into_iter().filter(|r| *r >= 0).collect();
            let rows: Vec<i64> = handles.into_iter().flat_map(|r| s.members(r)).collect();
            s.batches.clear();
            (s.epoch, rows, quick)
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
        if rows.is_empty() && repeat {
            // The same failure again within a minute: no new information.
            log::debug!("mqtt: disconnected: {reason}");
        } else if refused {
            // The broker answered and said no: retrying will not change
            // that until the broker or this config does.
            log::error!("mqtt: {reason}; retrying with backoff");
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
        });
    }

    /// Bookkeeping when a connection ends (or an attempt fails): backoff,
    /// quick drops, and a command subscription the broker will not take.
    fn account_end(&self, s: &mut Shared, reason: &str) -> bool {
        let keep_alive = self.cfg.keep_alive;
        let c = &mut s.conn;
        if s.connected {
            c.since = Instant::now();
        }
        c.last_error = Some(reason.to_owned());
        let Some(at) = c.connacked_at.take() else {
            return false;
        };
        let short = at.elapsed() < keep_alive;
        let quick = short && !c.had_puback && std::mem::take(&mut c.peer_closed);
        if quick {
            c.quick_drops += 1;
        } else {
            c.quick_drops = 0;
        }
        if c.awaiting_suback && short && !self.stop.load(Ordering::Relaxed) {
            c.sub_kills += 1;
            if c.sub_kills >= 2 {
                c.skip_sub_until = Some(Instant::now() + c.sub_retry);
                let msg = format!(
                    "the broker closed the connection on the command subscription {} times in a row (ACL?); connecting without it, trying again in {} min",
                    c.sub_kills,
                    c.sub_retry.as_secs() / 60
                );
                log::error!("mqtt: {msg}; telemetry keeps flowing");
                c.commands_unavailable = Some(msg);
                c.sub_retry = (c.sub_retry * 2).min(SUB_RETRY_MAX);
                c.sub_kills = 0;
            }
        }
        c.awaiting_suback = false;
        c.had_puback = false;
        quick
    }

    /// CONNACK: subscribe to commands (unless the broker closes connections
    /// on that), announce the retained status, submit what is ready.
    /// Errors: why this connection must end.
    fn on_connack(&self, session_present: bool, granted: Granted) -> Result<(), String> {
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
            let skip = s.conn.skip_sub_until.is_some_and(|t| Instant::now() < t);
            // Subscribe before any publish of this fresh client
            // (rumqttc does not re-subscribe by itself), so the
            // subscribe's packet id is never one a publish holds.
            // Telemetry never waits on it: see `account_end`.
            if let (Some(c), Some(client), false) = (&self.commands, &s.client, skip) {
                if let Err(e) = client.try_subscribe(&c.topic, QoS::AtLeastOnce) {
                    return Err(format!("cannot subscribe to {}: {e}", c.topic));
                }
                s.conn.awaiting_suback = true;
            }
            if self.cfg.status_topic {
                announce_online(&mut s, &self.cfg);
            }
            s.pump();
        }
        let limits = match self.cfg.protocol {
            crate::mqtt::Protocol::V311 => ", MQTT 3.1.1".to_owned(),
            crate::mqtt::Protocol::V5 => format!(
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

    /// PUBACK: the row it acknowledges is retired (through the delivery
    /// thread); the window refills from here. Errors: an inconsistency that
    /// ends the connection (the map is dropped, rows replayed).
    fn on_puback(
        &self,
        pkid: u16,
        refused: Option<PubAckRefusal>,
        backoff: &mut Backoff,
    ) -> Result<(), String> {
        if let Some(r) = refused {
            return self.on_refused_puback(pkid, r);
        }
        let notify = {
            let mut s = lock(&self.shared);
            let sent = s
                .sent_at
                .iter()
                .position(|(p, _)| *p == pkid)
                .and_then(|i| s.sent_at.remove(i))
                .map(|(_, t)| t.elapsed());
            match s.ack.on_puback(pkid) {
                Ok(STATUS_ROW) => {
                    s.pump();
                    false
                }
                Ok(row) => {
                    if !s.conn.had_puback {
                        // Backoff resets only once a connection
                        // has carried data (or lived a keep-alive).
                        s.conn.had_puback = true;
                        backoff.reset();
                    }
                    let rows = s.members(row);
                    s.acked.extend(rows);
                    if let Some(d) = sent {
                        s.puback_latency.observe(d);
                    }
                    s.progress_at = if s.ack.is_empty() {
                        None
                    } else {
                        Some(Instant::now())
                    };
                    // Refill the window from here: no thread hop per PUBACK.
                    s.pump();
                    let wanted = s.acked.len() >= 64 || s.ready.len() < s.window;
                    let first = !s.notified;
                    if wanted && first {
                        s.notified = true;
                    }
                    wanted && first
                }
                Err(e) => return Err(format!("ack correlation: {e}")),
            }
        };
        if notify {
            let _ = self.to_delivery.send(DeliveryMsg::Progress);
        }
        Ok(())
    }

    /// A PUBACK with a reason code of 0x80 or more (MQTT 5.0 §3.4.2.1): the
    /// row is not delivered. A refusal about the moment (quota exceeded,
    /// packet id in use) ends the connection, so the row is sent again
    /// after the backoff; any other goes to the delivery thread to be
    /// marked FAILED with its reason, and the rows behind it flow.
    /// Errors: why the connection must end.
    fn on_refused_puback(&self, pkid: u16, r: PubAckRefusal) -> Result<(), String> {
        let notify = {
            let mut s = lock(&self.shared);
            s.sent_at.retain(|(p, _)| *p != pkid);
            let row = match s.ack.on_puback(pkid) {
                Ok(row) => row,
                Err(e) => return Err(format!("ack correlation: {e}")),
            };
            if r.transient() {
                return Err(format!("{r}; sending it again after the backoff"));
            }
            s.pump();
            if row == STATUS_ROW {
                log::warn!("mqtt: the retained online status was refused: {r}");
                return Ok(());
            }
            for row in s.members(row) {
                s.refused.push((row, r));
            }
            let first = !s.notified;
            s.notified = true;
            first
        };
        if notify {
            let _ = self.to_delivery.send(DeliveryMsg::Progress);
        }
        Ok(())
    }

    /// SUBACK of the command subscription: granted, or refused by the broker
    /// (return code 0x80, MQTT 3.1.1 §3.9.3; mosquitto answers so when its
    /// ACL denies the subscription). Telemetry never waits on it.
    fn on_suback(&self, refused: Option<String>) {
        if let Some(code) = refused {
            let topic = self.commands.as_ref().map_or("", |c| c.topic.as_str());
            let mut s = lock(&self.shared);
            s.conn.awaiting_suback = false;
            if s.conn.commands_unavailable.is_none() {
                log::error!("mqtt: the broker refused the command subscription to {topic} ({code}); commands will not arrive, telemetry keeps flowing: check the broker's ACL for this client");
            }
            s.conn.commands_unavailable = Some(format!(
                "the broker refused the subscription to {topic} ({code}): check its ACL"
            ));
        } else {
            let mut s = lock(&self.shared);
            s.subacks += 1;
            s.conn.awaiting_suback = false;
            s.conn.sub_kills = 0;
            s.conn.sub_retry = SUB_RETRY_MIN;
            s.conn.commands_unavailable = None;
            drop(s);
            log::info!("mqtt: subscribed to commands");
        }
    }

    /// Poll one connection until it fails; returns why.
    fn drive(&self, connection: &mut Conn, backoff: &mut Backoff) -> String {
        // Long enough to never cancel a connect attempt (rumqttc's poll is
        // cancelled by the timeout), short enough to see the stop flag.
        let connect_wait = self.cfg.connect_timeout + Duration::from_secs(2);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return "agent stopping".into();
            }
            // Event-driven: the poll wakes for packets, for requests the
            // delivery thread submits, for rumqttc's own keep-alive pings and
            // for the DISCONNECT that stop/reconfigure send; our only timer
            // is the watchdog's deadline while rows are in flight.
            let wait = {
                let s = lock(&self.shared);
                match s.progress_at.filter(|_| s.connected && !s.ack.is_empty()) {
                    _ if !s.connected => connect_wait,
                    Some(t) => self
                        .cfg
                        .ack_timeout
                        .saturating_sub(t.elapsed())
                        .max(Duration::from_millis(50)),
                    None => IDLE_WAIT,
                }
            };
            let event = connection.recv_timeout(wait, self.cfg.keep_alive);
            if self.stop.load(Ordering::Relaxed) {
                // Whatever woke us (the offline status, a DISCONNECT): stop
                // without matching it to rows.
                return "agent stopping".into();
            }
            match event {
                Ok(Ok(Ev::ConnAck {
                    session_present,
                    granted,
                })) => {
                    if let Err(why) = self.on_connack(session_present, granted) {
                        return why;
                    }
                }
                Ok(Ok(Ev::OutgoingPublish(pkid))) => {
                    let mut s = lock(&self.shared);
                    if let Err(e) = s.ack.on_outgoing_publish(pkid) {
                        return format!("ack correlation: {e}");
                    }
                    s.sent_at.retain(|(p, _)| *p != pkid);
                    if s.sent_at.len() >= SENT_AT_MAX {
                        s.sent_at.pop_front();
                    }
                    s.sent_at.push_back((pkid, Instant::now()));
                }
                Ok(Ok(Ev::PubAck { pkid, refused })) => {
                    if let Err(why) = self.on_puback(pkid, refused, backoff) {
                        return why;
                    }
                }
                Ok(Ok(Ev::Publish(p))) => match &self.commands {
                    Some(c) if p.topic == *c.topic => {
                        let epoch = lock(&self.shared).epoch;
                        (c.sink)(epoch, p);
                    }
                    _ => {
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
                Ok(Ok(Ev::Other(ev))) => log::trace!("mqtt: {ev}"),
                Ok(Err(mut f)) => {
                    let connected = {
                        let mut s = lock(&self.shared);
                        s.conn.peer_closed = true;
                        s.connected
                    };
                    if f.closed_by_peer
                        && !connected
                        && self.cfg.protocol == crate::mqtt::Protocol::V5
                    {
                        // No CONNACK: what a broker that does not speak
                        // MQTT 5 does with a level-5 CONNECT (aedes 1.2).
                        f.reason = "the broker closed the connection without answering the MQTT 5 CONNECT: a broker that does not speak MQTT 5 does this; if so, set mqtt.protocol = \"3.1.1\" (otherwise see the broker's log)".to_owned();
                        f.refused = true;
                    }
                    self.refused.set(f.refused);
                    if f.oversize.is_some() {
                        self.oversize.set(f.oversize);
                    }
                    return f.reason;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return "event loop closed".into(),
            }
            // Watchdog: connected, rows waiting, no acknowledgement for too
            // long (rumqtt issues 1014/1056: a stall that looks healthy).
            if lock(&self.shared).reconfigure.is_some() {
                return "configuration changed; reconnecting with the new settings".into();
            }
            if std::mem::take(&mut lock(&self.shared).redeliver) {
                self.reconnect_now.set(true);
                return "reconnecting so the broker redelivers the commands held back".into();
            }
            let stalled = {
                let s = lock(&self.shared);
                s.connected
                    && !s.ack.is_empty()
                    && s.progress_at
                        .is_some_and(|t| t.elapsed() > self.cfg.ack_timeout)
            };
            if stalled {
                return format!(
                    "watchdog: no PUBACK for {} s with rows in flight; rebuilding the client",
                    self.cfg.ack_timeout.as_secs()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let d: Vec<u128> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert!((75..=125).contains(&d[0]), "{d:?}");
        assert!((150..=250).contains(&d[1]), "{d:?}");
        assert!(d[5..].iter().all(|&x| (750..=1000).contains(&x)), "{d:?}");
        b.reset();
        assert!(b.next_delay().as_millis() <= 125);
    }

    /// What rumqttc itself writes for a QoS 1 PUBLISH with a packet id (as
    /// every publish of ours has when it is encoded).
    fn rumqttc_publish(topic_len: usize, payload_len: usize) -> (usize, usize, usize) {
        let mut p = rumqttc::Publish::new(
            "t".repeat(topic_len),
            QoS::AtLeastOnce,
            vec![b'x'; payload_len],
        );
        p.pkid = 7;
        let mut buf = bytes::BytesMut::new();
        let written = p.write(&mut buf).expect("rumqttc encodes it");
        (p.size(), written, buf.len())
    }

    #[test]
    fn publish_packet_size_matches_what_rumqttc_writes_at_every_length_boundary() {
        // Remaining Length grows a byte at 128, 16,384 and 2,097,152
        // (MQTT 3.1.1 §2.2.3); remaining = 2 + topic + 2 + payload.
        let topic = 20;
        let mut payloads = vec![0, 1, 100, 1000, 65_536];
        for edge in [128usize, 16_384, 2_097_152] {
            let p = edge - 4 - topic;
            payloads.extend([p - 1, p, p + 1]);
        }
        for payload in payloads {
            let (size, written, buf) = rumqttc_publish(topic, payload);
            let ours = publish_packet_size(topic, payload);
            assert_eq!(ours, size, "payload {payload}: rumqttc size()");
            assert_eq!(ours, written, "payload {payload}: rumqttc write()");
            assert_eq!(ours, buf, "payload {payload}: bytes in the buffer");
        }
        for topic in [1, 60, 200, 1000] {
            let (size, _, buf) = rumqttc_publish(topic, 3000);
            assert_eq!(publish_packet_size(topic, 3000), size);
            assert_eq!(publish_packet_size(topic, 3000), buf);
        }
    }

    #[test]
    fn rumqttc_refuses_a_publish_one_byte_over_its_outgoing_limit_as_we_count_it() {
        let mut p = rumqttc::Publish::new("a/events/s", QoS::AtLeastOnce, vec![0u8; 500]);
        p.pkid = 1;
        let size = publish_packet_size(10, 500);
        let packet = rumqttc::Packet::Publish(p);
        let mut buf = bytes::BytesMut::new();
        assert!(packet.write(&mut buf, size).is_ok());
        assert!(matches!(
            packet.write(&mut buf, size - 1),
            Err(rumqttc::mqttbytes::Error::OutgoingPacketTooLarge { pkt_size, max })
                if pkt_size == size && max == size - 1
        ));
    }

    #[test]
    fn a_publish_past_the_protocol_limit_counts_as_larger_than_any_limit() {
        let max_remaining = 268_435_455;
        assert_eq!(
            publish_packet_size(10, max_remaining - 14),
            PROTOCOL_MAX_PACKET
        );
        assert_eq!(publish_packet_size(10, max_remaining - 13), usize::MAX);
        assert_eq!(publish_packet_size(usize::MAX, 1), usize::MAX);
    }

    #[test]
    fn offers_wait_while_disconnected_and_stale_epochs_are_refused() {
        let (tx, _rx) = std::sync::mpsc::channel();
        let cfg = MqttConfig {
            tls: None,
            credentials: None,
            host: "127.0.0.1".into(),
            port: 1,
            client_id: "t".into(),
            topic_prefix: "t".into(),
            keep_alive: Duration::from_secs(30),
            clean_session: false,
            inflight_window: 16,
            max_payload_bytes: 1024,
            max_packet_bytes: PROTOCOL_MAX_PACKET,
            payload_format: crate::envelope::Format::Json,
            connect_timeout: Duration::from_secs(10),
            reconnect_min: Duration::from_millis(500),
            reconnect_max: Duration::from_secs(30),
            ack_timeout: Duration::from_secs(60),
            fail_after_disconnects: 3,
            protocol: Protocol::V5,
            session_expiry_secs: 0,
            min_share_pct: 10,
            status_topic: false,
        };
        let (link, _t) = new(cfg, tx, Arc::new(AtomicBool::new(false)), None);
        let ready = |row| Ready {
            row,
            topic: Arc::from("t"),
            payload: b"x".to_vec(),
            event_id: String::new(),
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
