//! The sink's MQTT session: subscribe, gather batches, acknowledge after commit.
//!
//! Its one rule: a PUBACK (MQTT 3.1.1 §3.4, sent in the order the PUBLISH
//! packets arrived, §4.6) leaves only for a delivery whose transaction has
//! committed, and only on the connection that delivered it. rumqttc's manual
//! acks (`set_manual_acks(true)`, `Client::try_ack`) queue a `PubAck(pkid)`
//! request; the event loop writes it whenever it next polls, on whatever
//! connection it then has, and a packet id of a lost connection may name
//! another message on the next one. So a lost connection drops the whole
//! client (and any acknowledgement still queued in it): the next connection
//! starts from a new client with the same id and the persistent session, and
//! the broker sends again every message it holds unacknowledged (§4.4),
//! which the store then counts as a duplicate.
//!
//! After each commit the receipts the batch owes ([`super::outbox`]) are
//! published at QoS 1 with `try_publish`, right after that batch's PUBACKs
//! and before the next batch's ([`Owed`]): a receipt never waits for PUBACKs
//! of later batches, which keep coming while the broker holds a backlog for
//! the sink. One the client cannot take now waits in the bounded outbox,
//! across reconnects (what it says stays true), and at most
//! [`super::outbox::MAX_IN_FLIGHT`] are out unacknowledged, so receipts
//! never fill rumqttc's in-flight window that PUBACKs also wait behind;
//! PUBACKs never wait for receipts.
//!
//! One message never stalls the session: a PUBLISH over the incoming limit
//! ([`MAX_INCOMING`]) ends the connection before rumqttc reads it, and the
//! persistent session would send it again, first, at every reconnect. The
//! next session takes it with a limit of its size, sets it aside unread
//! (an [`Unreadable::Oversized`](super::message::Unreadable) item) and
//! acknowledges it after the commit like any other delivery; then the limit
//! returns to normal ([`Drain`]).
//!
//! The store runs on its own thread ([`super::committer`]): batch N+1 is
//! received and decoded here while batch N commits there, one batch with
//! the store at most. PUBACKs and receipts are queued, and sent, only from
//! this thread and only once the store's `Ok` for their batch is back; a
//! batch that fails ends the session with neither it nor the batch
//! gathered behind it acknowledged.

use super::batch::{BatchPolicy, Item};
use super::committer::{Committer, Done};
use super::identity::Shape;
use super::outbox::Outbox;
use super::poller::{Polled, Poller};
use super::{SinkStats, Store, StoreError};
use crate::os::fsguard::files::read_secret;
use rumqttc::{
    Client, ConnectReturnCode, Connection, ConnectionError, Event, Incoming, MqttOptions, Outgoing,
    Publish, QoS, RecvTimeoutError, StateError, SubscribeFilter, SubscribeReasonCode,
};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Sink settings.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Broker host.
    pub host: String,
    /// Broker port.
    pub port: u16,
    /// Topic filter, e.g. `edgespool/+/events/#`.
    pub filter: String,
    /// MQTT client id. The broker keeps the session (and what it has not had
    /// acknowledged) under it: a restarted sink must come back with the same id.
    pub client_id: String,
    /// Subscribe as `$share/<group>/<filter>` to spread load over sinks. A
    /// ShareName (MQTT 5 §4.8.2: at least one character, no `/`, `+` or
    /// `#`); [`run`] refuses another, and a `filter` shared already.
    pub shared_group: Option<String>,
    /// When a batch commits.
    pub batch: BatchPolicy,
    /// Interval of the summary log line.
    pub report: Duration,
    /// The key that signs the receipts published after each commit
    /// (`--receipt-key`); `None`: no receipts (a board retires nothing on
    /// an unsigned one). Leave it out for a broker whose ACL does not let
    /// the sink write `<prefix>/receipts`: mosquitto 2.0 closes the
    /// connection of a 3.1.1 client after a denied QoS 1 publish.
    pub receipts: Option<std::sync::Arc<crate::event::signature::SigningKey>>,
    /// MQTT login: a user name and the file holding its password (read
    /// anew at every connect, so a rotated password needs no restart; one
    /// trailing newline dropped). `None`: anonymous. A fleet broker should
    /// refuse anonymous clients: the sink's user reads every device's events
    /// and writes every device's receipts, and a receipt retires rows.
    pub credentials: Option<(String, PathBuf)>,
}

/// The password in `path`, without one trailing newline: read only from a
/// regular file named itself (a symlink is refused, never followed) that
/// group and others cannot read ([`read_secret`]).
///
/// Errors: the file is a symlink, not a regular file, readable by group
/// or others (the message names the path, the mode and `chmod 600`),
/// cannot be read, or is not UTF-8.
pub fn read_password(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let bytes = read_secret(path).map_err(|e| {
        format!("MQTT password file {shown} (--password-file, or password_file in --config): {e}")
    })?;
    let text =
        String::from_utf8(bytes).map_err(|_| format!("MQTT password file {shown} is not UTF-8"))?;
    Ok(text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text)
        .to_owned())
}

impl SinkOptions {
    /// Options with the default batch policy (500 deliveries, 100 ms window,
    /// 2 ms pause), a 10 s summary line, and no receipts (no key yet).
    pub fn new(host: String, port: u16, filter: String, client_id: String) -> SinkOptions {
        SinkOptions {
            host,
            port,
            filter,
            client_id,
            shared_group: None,
            batch: BatchPolicy {
                max: 500,
                window: Duration::from_millis(100),
                idle: Duration::from_millis(2),
            },
            report: Duration::from_secs(10),
            receipts: None,
            credentials: None,
        }
    }

    /// The filter boards' holdings come on ([`super::notes::holdings_filter`]),
    /// subscribed on its own and never shared: a holdings message is
    /// retained (a sink that starts gets every board's at once, idle boards
    /// too), and a broker sends no retained message on a shared
    /// subscription (MQTT 5 §4.8.2). Every sink gets every board's; the
    /// ledger's rate limit per board, in the database, lets one ask.
    /// A `$share/GROUP/` in `filter` is the events' group, as
    /// `shared_group` is: the holdings filter is taken from what follows it.
    pub fn holdings_subscription(&self) -> Option<String> {
        super::notes::holdings_filter(super::identity::unshared(&self.filter).1)
    }

    /// The filters as subscribed: `filter`, and its batch twin (see
    /// [`batches_filter`]) when it has one; each as `$share/GROUP/FILTER`
    /// with a group.
    pub fn subscriptions(&self) -> Vec<String> {
        let mut out = vec![self.filter.clone()];
        out.extend(batches_filter(&self.filter));
        match &self.shared_group {
            Some(g) => out.iter().map(|f| format!("$share/{g}/{f}")).collect(),
            None => out,
        }
    }
}

/// The filter for the batched publishes of the streams an events filter
/// names: `P/events/#` → `P/batches/#`; `P/events/S` (a stream or `+`) →
/// `P/batches/S/#`, which matches `P/batches/S` and its `/lz4` and `/zstd`
/// forms (`#` also matches the parent level, MQTT 3.1.1 §4.7.1.2). `None` for
/// a filter whose second-to-last level is not `events`: it is taken as
/// given (`edgespool/#` already matches the batches).
pub fn batches_filter(filter: &str) -> Option<String> {
    let (rest, last) = filter.rsplit_once('/')?;
    let prefix = match rest.rsplit_once('/') {
        Some((p, "events")) => format!("{p}/batches"),
        None if rest == "events" => "batches".to_owned(),
        _ => return None,
    };
    Some(match last {
        "#" => format!("{prefix}/#"),
        s => format!("{prefix}/{s}/#"),
    })
}

/// How one connection ended.
enum End {
    /// `stop` was set.
    Stop,
    /// Connection or store lost; reconnect after a pause.
    Lost(String),
    /// The broker sent a PUBLISH of this remaining length, over the
    /// session's incoming limit (rumqttc closed the connection before
    /// reading it): reconnect with a limit that takes it, to set it aside.
    Oversized(usize),
    /// A session with a raised limit has set its oversized deliveries
    /// aside and acknowledged them (or waited [`DRAIN_WAIT`] for none):
    /// reconnect at once with the normal limit.
    Drained,
}

/// Run the sink until `stop`; returns what it stored and receipted.
///
/// The store runs on a thread of its own ([`Committer`]): while one batch
/// commits, the next is gathered and decoded here; at most one is with the
/// store, and its PUBACKs are queued only once it is back committed.
///
/// Errors: a filter that fixes no level for the device, or a shared
/// subscription's group that is no ShareName ([`Shape::of_subscription`]),
/// a fatal store error or a refused subscription
/// (retrying cannot help; exit non-zero), or the store thread could not be
/// started.
pub fn run<S: Store + Send>(
    opts: &SinkOptions,
    store: &mut S,
    stop: &AtomicBool,
) -> Result<SinkStats, String> {
    let shape = Shape::of_subscription(&opts.filter, opts.shared_group.as_deref())?;
    log::info!(
        "sink: reading events on {shape} (device = level {} of {}); a delivery on a topic of another shape is set aside as forged",
        shape.device_level(),
        opts.filter
    );
    std::thread::scope(|scope| {
        let mut committer = Committer::start(scope, store, opts.receipts.clone())?;
        sessions(opts, &shape, &mut committer, stop)
        // The committer is dropped here, idle (every session waits for its
        // batch), and the scope joins the store thread.
    })
}

/// Connections, one after the other, until `stop`.
fn sessions(
    opts: &SinkOptions,
    shape: &Shape,
    committer: &mut Committer<Vec<Publish>>,
    stop: &AtomicBool,
) -> Result<SinkStats, String> {
    let mut totals = SinkStats::default();
    let mut outbox = Outbox::new();
    let mut backoff = Duration::from_millis(100);
    let mut last_report = Instant::now();
    let mut oversize: Option<usize> = None;
    let mut ledger = (None, None);
    while !stop.load(Ordering::Relaxed) {
        let limit = incoming_limit(oversize.take());
        let (client, conn) = match connect(opts, limit) {
            Ok(c) => c,
            Err(why) => {
                log::warn!("sink: {why}; trying again in {backoff:?}");
                sleep_unless(stop, backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let poller = Poller::start(conn)?;
        outbox.new_connection();
        let began = Instant::now();
        let mut s = Session {
            opts,
            shape,
            off_shape_told: false,
            client: &client,
            conn: &poller,
            committer: &mut *committer,
            pending: Vec::new(),
            items: Vec::new(),
            notes: Vec::new(),
            subacks_due: VecDeque::new(),
            ledger: &mut ledger,
            batch_bytes: 0,
            owed: Default::default(),
            first_at: Instant::now(),
            last_at: Instant::now(),
            totals: &mut totals,
            outbox: &mut outbox,
            drain: (limit > MAX_INCOMING).then(|| Drain::new(limit, Instant::now())),
        };
        let end = s.run(stop, &mut last_report);
        // Whatever ended the session, this connection is done with (a dead
        // one has already stopped its poller).
        let _ = client.try_disconnect();
        poller.finish();
        match end? {
            End::Stop => break,
            End::Oversized(n) => {
                log::warn!(
                    "sink: the broker sent a PUBLISH of {n} bytes, over the incoming limit of \
                     {MAX_INCOMING} bytes; reading it on the next session with a {n}-byte limit \
                     to set it aside (unreadable) and acknowledge it, not have it sent again \
                     for ever"
                );
                oversize = Some(n);
                // A pause, not a growing one: each such session sets at
                // least one message aside.
                sleep_unless(stop, Duration::from_millis(100));
            }
            End::Drained => {
                log::info!("sink: back to the incoming limit of {MAX_INCOMING} bytes");
            }
            End::Lost(why) => {
                log::warn!("sink: connection lost: {why}; reconnecting in {backoff:?}");
                // A session that lasted is not a failure streak.
                if began.elapsed() > Duration::from_secs(30) {
                    backoff = Duration::from_millis(100);
                }
                sleep_unless(stop, backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    totals.receipts_dropped += outbox.take_dropped();
    log::info!("sink: {totals}{}", ledger_words(&ledger.0));
    Ok(totals)
}

/// While a batch is with the store, how long to wait for it before taking
/// the deliveries that arrived meanwhile.
const BUSY_POLL: Duration = Duration::from_millis(2);

/// The largest PUBLISH a session takes (its remaining length: topic, packet
/// id and payload; rumqttc's `max_incoming_packet_size`). A larger one
/// ends the session before it is read ([`End::Oversized`]); the next
/// session takes it with a limit of its size, sets it aside and
/// acknowledges it, then the limit returns to this ([`Drain`]).
pub const MAX_INCOMING: usize = 16 << 20;

/// The largest remaining length MQTT can encode (3.1.1 §2.2.3, v5 §1.5.5:
/// four bytes of variable byte integer): no PUBLISH is larger.
pub const MQTT_MAX_REMAINING: usize = 268_435_455;

/// How long a session with a raised limit waits for an oversized delivery
/// before it goes back to the normal limit (the broker may have dropped
/// the message meanwhile: expired, or removed with its publisher's session).
const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// The incoming limit of the next session: [`MAX_INCOMING`], or the size
/// of the oversized PUBLISH the last one ended on (logged at WARN).
fn incoming_limit(oversize: Option<usize>) -> usize {
    match oversize {
        Some(n) if n > MAX_INCOMING && n <= MQTT_MAX_REMAINING => n,
        Some(n) => {
            // rumqttc reads at most MQTT's largest length, so this is a
            // broker that speaks something else; nothing to raise.
            log::error!("sink: a PUBLISH of {n} bytes cannot be read at all; keeping the limit");
            MAX_INCOMING
        }
        None => MAX_INCOMING,
    }
}

/// A session with a raised incoming limit: the oversized deliveries taken
/// (by packet id) whose PUBACK has not yet gone out.
struct Drain {
    limit: usize,
    until: Instant,
    seen: bool,
    unacked: Vec<u16>,
}

impl Drain {
    /// A session with incoming limit `limit`, begun at `now`.
    fn new(limit: usize, now: Instant) -> Drain {
        Drain {
            limit,
            until: now + DRAIN_WAIT,
            seen: false,
            unacked: Vec::new(),
        }
    }

    /// An oversized delivery taken (`pkid`: its packet id, `None` for QoS
    /// 0, which has no PUBACK to wait for and is not sent again).
    fn took(&mut self, pkid: Option<u16>) {
        if let Some(p) = pkid {
            self.seen = true;
            self.unacked.push(p);
        }
    }

    /// The PUBACK of `pkid` has been written out.
    fn acked(&mut self, pkid: u16) {
        self.unacked.retain(|&p| p != pkid);
    }

    /// Whether the session has done its job at `now`: every oversized
    /// delivery it took acknowledged, or none came within [`DRAIN_WAIT`].
    fn done(&self, now: Instant) -> bool {
        match self.seen {
            true => self.unacked.is_empty(),
            false => now >= self.until,
        }
    }
}

/// The remaining length of `p` as rumqttc checks it against the limit:
/// topic (with its length), packet id (QoS 1 and 2), payload.
fn remaining_length(p: &Publish) -> usize {
    let pkid = if p.qos == QoS::AtMostOnce { 0 } else { 2 };
    2 + p.topic.len() + pkid + p.payload.len()
}

/// A batch is committed once its payloads reach this many bytes, whatever
/// `--batch-max` says: with incoming packets of up to 16 MiB, 500 of them
/// would make one transaction too large for PostgreSQL (1 GiB per message),
/// fail every time and be redelivered for ever.
const MAX_BATCH_BYTES: usize = 16 << 20;

/// A client and its connection (not yet connected), taking PUBLISH packets
/// of up to `incoming` bytes.
///
/// Errors: the password file cannot be read (the attempt is retried).
fn connect(opts: &SinkOptions, incoming: usize) -> Result<(Client, Connection), String> {
    let mut o = MqttOptions::new(opts.client_id.clone(), opts.host.clone(), opts.port);
    if let Some((user, file)) = &opts.credentials {
        o.set_credentials(user.clone(), read_password(file)?);
    }
    o.set_clean_session(false);
    o.set_manual_acks(true);
    o.set_keep_alive(Duration::from_secs(10));
    o.set_max_packet_size(incoming, 1 << 20);
    o.set_inflight(super::outbox::CLIENT_IN_FLIGHT);
    // Room for every acknowledgement of a full batch, and the receipts that
    // follow them, so `try_ack` does not find the request channel full in
    // the common case.
    let cap = opts.batch.max.saturating_mul(2).max(64);
    Ok(Client::new(
        o,
        cap.saturating_add(super::outbox::MAX_IN_FLIGHT),
    ))
}

/// What committed batches owe the broker, in the order it is handed to the
/// client: a batch's PUBACKs, then its receipts, then the next batch's.
///
/// Why: receipts once waited until no PUBACK at all was queued. While the
/// broker holds a backlog for the sink, a commit's PUBACKs are queued before
/// the last ones have left, so no receipt went out until the backlog was
/// drained, and the outbox dropped the oldest (20,000 events with
/// `--batch-max 10`: 953 receipts dropped, 9,530 events never receipted,
/// sent again by their boards after the receipt timeout).
enum Owed {
    /// The PUBACK of a delivery (packet id and QoS are what it needs).
    Ack(Publish),
    /// A committed batch's receipts, `(topic, payload)`.
    Receipts(Vec<(String, Vec<u8>)>),
}

/// One connection, from CONNECT to its loss or `stop`.
struct Session<'a> {
    opts: &'a SinkOptions,
    /// The topics the filter fixes: any other is set aside unread.
    shape: &'a Shape,
    /// Whether a delivery of another shape was logged on this connection.
    off_shape_told: bool,
    client: &'a Client,
    conn: &'a Poller,
    /// The store thread; the batch with it is acknowledged when it is back.
    committer: &'a mut Committer<Vec<Publish>>,
    /// Deliveries of the open batch, in arrival order.
    pending: Vec<Publish>,
    items: Vec<Item>,
    /// Boards' holdings and answers of the open batch.
    notes: Vec<super::notes::BoardNote>,
    /// SUBACKs due on this connection, oldest first: the main filters'
    /// (`false`) and the holdings' (`true`).
    subacks_due: VecDeque<bool>,
    /// The ledger's last figures, and when they were asked for.
    ledger: &'a mut (Option<super::LedgerSummary>, Option<Instant>),
    /// Payload bytes in `items`: a batch is also committed at
    /// MAX_BATCH_BYTES, so a few large messages never make one transaction
    /// too big to send.
    batch_bytes: usize,
    /// Committed, not yet handed to the client (its channel was full):
    /// PUBACKs and receipts, batch after batch.
    owed: VecDeque<Owed>,
    first_at: Instant,
    last_at: Instant,
    totals: &'a mut SinkStats,
    outbox: &'a mut Outbox,
    /// Set on a session with a raised incoming limit.
    drain: Option<Drain>,
}

impl Session<'_> {
    /// Gather and hand over batches until the connection ends or `stop`;
    /// then wait for the batch with the store. On a clean stop its PUBACKs
    /// (and receipts) get a moment to leave; on a lost connection they go
    /// with the client, and its receipts wait in the outbox. The open
    /// batch, never handed to the store, is not acknowledged: the broker
    /// sends it again.
    fn run(&mut self, stop: &AtomicBool, last_report: &mut Instant) -> Result<End, String> {
        let end = self.gather(stop, last_report);
        let settled = match self.committer.wait() {
            Some(d) => self.settle(d),
            None => Ok(None),
        };
        let end = match (end?, settled?) {
            // What was committed before (and this batch, if it was) may go.
            (e @ (End::Stop | End::Drained), _) => {
                self.flush();
                e
            }
            (e @ (End::Lost(_) | End::Oversized(_)), _) => e,
        };
        self.keep_receipts();
        Ok(end)
    }

    /// The receipts not yet handed to this client wait in the outbox for
    /// the next one (what they say stays true); the PUBACKs go with this
    /// connection, whose packet ids mean nothing on the next.
    fn keep_receipts(&mut self) {
        for o in self.owed.drain(..) {
            if let Owed::Receipts(r) = o {
                for (topic, payload) in r {
                    self.outbox.push(topic, payload);
                }
            }
        }
        self.totals.receipts_dropped += self.outbox.take_dropped();
    }

    /// Receive, batch, and hand batches to the store, one at a time: a due
    /// batch waits (and grows) while the last one is with the store, until
    /// it is full. A batch back from the store is followed at once by the
    /// next (the store is never left waiting for PUBACKs to be queued).
    fn gather(&mut self, stop: &AtomicBool, last_report: &mut Instant) -> Result<End, String> {
        loop {
            if let Some(d) = self.committer.try_done() {
                if let Some(end) = self.settle(d)? {
                    return Ok(end);
                }
            }
            if stop.load(Ordering::Relaxed) {
                return Ok(End::Stop);
            }
            if self.drain.as_ref().is_some_and(|d| d.done(Instant::now())) {
                return Ok(End::Drained);
            }
            if !self.committer.busy() && (self.full() || self.due()) {
                self.submit()?;
            }
            self.hand_over();
            if self.committer.busy() {
                // Full while the store holds the last batch: take nothing
                // more (a batch never passes --batch-max) until it answers.
                let end = match self.full() {
                    true => self.committer.wait().map_or(Ok(None), |d| self.settle(d))?,
                    false => self.gather_while_busy()?,
                };
                if let Some(end) = end {
                    return Ok(end);
                }
                continue;
            }
            let wait = self.opts.batch.wait(
                self.items.len() + self.notes.len(),
                self.first_at.elapsed(),
                self.last_at.elapsed(),
                Duration::from_secs(1),
            );
            let got = self.conn.recv_timeout(wait);
            if let Some(end) = self.on_event(got)? {
                return Ok(end);
            }
            if last_report.elapsed() >= self.opts.report {
                *last_report = Instant::now();
                log::info!("sink: {}{}", self.totals, ledger_words(&self.ledger.0));
            }
        }
    }

    /// While a batch is with the store: wait on the store up to
    /// [`BUSY_POLL`], then take every delivery that has arrived meanwhile
    /// (until the open batch is full). Waiting on the store rather than on
    /// each delivery keeps this thread from waking once per PUBLISH, which
    /// on a small machine costs the database the CPU it commits with.
    /// `Some` ends the session.
    fn gather_while_busy(&mut self) -> Result<Option<End>, String> {
        if let Some(d) = self.committer.wait_for(BUSY_POLL) {
            return self.settle(d);
        }
        while !self.full() {
            match self.conn.recv_timeout(Duration::ZERO) {
                Err(RecvTimeoutError::Timeout) => break,
                got => {
                    if let Some(end) = self.on_event(got)? {
                        return Ok(Some(end));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Whether the open batch can take no more: `--batch-max` events (a
    /// batched publish counts as all it carries), or [`MAX_BATCH_BYTES`].
    fn full(&self) -> bool {
        let n = self.items.len() + self.notes.len();
        n > 0 && (self.batch_bytes >= MAX_BATCH_BYTES || n >= self.opts.batch.max)
    }

    /// Whether the open batch is due by the batch policy.
    fn due(&self) -> bool {
        self.opts.batch.due(
            self.items.len() + self.notes.len(),
            self.first_at.elapsed(),
            self.last_at.elapsed(),
        )
    }

    /// Hand what committed batches owe to the client, in order, while its
    /// request channel takes it: a batch's PUBACKs, then its receipts
    /// (through the outbox, which holds them while
    /// [`super::outbox::MAX_IN_FLIGHT`] are out), then the next batch's.
    fn hand_over(&mut self) {
        while let Some(o) = self.owed.front() {
            match o {
                Owed::Ack(p) => {
                    if self.client.try_ack(p).is_err() {
                        return;
                    }
                    self.owed.pop_front();
                }
                Owed::Receipts(_) => {
                    if let Some(Owed::Receipts(r)) = self.owed.pop_front() {
                        for (topic, payload) in r {
                            self.outbox.push(topic, payload);
                        }
                    }
                    self.totals.receipts_dropped += self.outbox.take_dropped();
                    if !self.publish_receipts() {
                        return;
                    }
                }
            }
        }
        self.publish_receipts();
    }

    /// Hand the outbox's receipts to the client until it has none, or
    /// [`super::outbox::MAX_IN_FLIGHT`] are out (`true`: PUBACKs may go
    /// on), or the client's request channel is full (`false`).
    fn publish_receipts(&mut self) -> bool {
        while let Some((topic, payload)) = self.outbox.next() {
            let (topic, payload) = (topic.to_owned(), payload.to_vec());
            if self
                .client
                .try_publish(topic, QoS::AtLeastOnce, false, payload)
                .is_err()
            {
                return false;
            }
            self.outbox.sent();
            self.totals.receipts += 1;
        }
        true
    }

    /// React to what the event loop gave; `Some` ends the session.
    fn on_event(&mut self, got: Result<Polled, RecvTimeoutError>) -> Result<Option<End>, String> {
        match got {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(c)))) => {
                if c.code != ConnectReturnCode::Success {
                    return Ok(Some(End::Lost(format!("broker refused: {:?}", c.code))));
                }
                let subs = self.opts.subscriptions();
                log::info!(
                    "sink: connected as {} (session_present {}), subscribing {}",
                    self.opts.client_id,
                    c.session_present,
                    subs.join(" ")
                );
                // rumqttc does not re-subscribe by itself; with a session
                // present it is a harmless repeat.
                let filters = subs
                    .into_iter()
                    .map(|f| SubscribeFilter::new(f, QoS::AtLeastOnce));
                if let Err(e) = self.client.try_subscribe_many(filters) {
                    return Ok(Some(End::Lost(format!("subscribe request: {e}"))));
                }
                self.subacks_due.clear();
                self.subacks_due.push_back(false);
                if let Some(h) = self.opts.holdings_subscription() {
                    if let Err(e) = self.client.try_subscribe(h, QoS::AtLeastOnce) {
                        return Ok(Some(End::Lost(format!("subscribe request: {e}"))));
                    }
                    self.subacks_due.push_back(true);
                }
            }
            Ok(Ok(Event::Incoming(Incoming::SubAck(s))))
                if self.subacks_due.pop_front() == Some(true) =>
            {
                holdings_suback(self.opts, &s.return_codes);
            }
            Ok(Ok(Event::Incoming(Incoming::SubAck(s)))) => {
                let subs = self.opts.subscriptions();
                // One return code per filter, in the order subscribed
                // (MQTT 3.1.1 §3.9.3).
                if let Some((f, _)) = subs
                    .iter()
                    .zip(&s.return_codes)
                    .find(|(_, c)| **c == SubscribeReasonCode::Failure)
                {
                    return Err(format!("broker refused the subscription {f}"));
                }
                log::info!("sink: subscribed {}", subs.join(" "));
            }
            Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => self.take(p),
            // The broker has one of our receipts or requests (we publish
            // nothing else).
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => self.outbox.acked(),
            // Written and flushed: an oversized delivery is acknowledged.
            Ok(Ok(Event::Outgoing(Outgoing::PubAck(pkid)))) => {
                if let Some(d) = &mut self.drain {
                    d.acked(pkid);
                }
            }
            Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Err(ConnectionError::MqttState(StateError::Deserialization(
                rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
            )))) => return Ok(Some(End::Oversized(n))),
            Ok(Err(e)) => return Ok(Some(End::Lost(e.to_string()))),
            Err(RecvTimeoutError::Disconnected) => {
                return Ok(Some(End::Lost("event loop closed".into())))
            }
        }
        Ok(None)
    }

    /// A delivery joins the open batch; one over [`MAX_INCOMING`] (read on
    /// a session with a raised limit) is set aside unread.
    fn take(&mut self, mut p: Publish) {
        if self.items.is_empty() && self.notes.is_empty() {
            self.first_at = Instant::now();
        }
        self.last_at = Instant::now();
        if self.shape.holdings(&p.topic) {
            self.take_note(&p);
            p.payload = Default::default();
            self.pending.push(p);
            return;
        }
        let packet = remaining_length(&p);
        let new = match &mut self.drain {
            Some(d) if packet > MAX_INCOMING => {
                log::warn!(
                    "sink: setting aside a PUBLISH of {packet} bytes on {} (over the incoming \
                     limit of {MAX_INCOMING} bytes; read with a {}-byte limit): kept in \
                     unreadable with its topic, size and first bytes, then acknowledged",
                    p.topic,
                    d.limit
                );
                // QoS 0 is stored with its batch while the session runs on.
                d.took((p.qos != QoS::AtMostOnce).then_some(p.pkid));
                let mut it = Item::oversized(&p.topic, &p.payload, packet, MAX_INCOMING);
                it.publisher = self.shape.publisher(&p.topic).to_owned();
                vec![it]
            }
            // A batched publish becomes one item per event, all in this
            // transaction: its PUBACK waits for every one of them.
            _ => match self.shape.read(&p.topic) {
                Ok(_) => super::unbatch::items(&p.topic, &p.payload),
                // Before it is read: a topic of another shape names no
                // device the sink could trust (field case F8).
                Err(why) => {
                    if !std::mem::replace(&mut self.off_shape_told, true) {
                        log::warn!(
                            "sink: {why}: set aside as forged (the filter is {:?}; a wider \
                             subscription left in this client id's session delivers such \
                             topics too); told once a connection, counted in forged",
                            self.opts.filter
                        );
                    }
                    let from = self.shape.publisher(&p.topic);
                    vec![Item::forged(&p.topic, &p.payload, from, why)]
                }
            },
        };
        let bytes: usize = new.iter().map(|it| it.payload.len()).sum();
        self.batch_bytes = self.batch_bytes.saturating_add(bytes);
        self.items.extend(new);
        // The PUBACK needs only the packet id and QoS (rumqttc's
        // `get_ack_req`): the payload, copied into the items, is not
        // kept twice until the commit.
        p.payload = Default::default();
        self.pending.push(p);
    }

    /// A board's holdings or answer joins the open batch; one that cannot
    /// be read, or names another board than its topic's, is counted and
    /// acknowledged with the batch (a note is worth nothing twice).
    fn take_note(&mut self, p: &Publish) {
        match super::notes::read(&p.topic, &p.payload) {
            Ok(n) => self.notes.push(n),
            Err(e) => {
                self.totals.notes_refused += 1;
                log::warn!("sink: {e}; set aside");
            }
        }
    }

    /// Hand the open batch to the store thread (which is free), with the
    /// ledger's figures asked for once a summary interval.
    ///
    /// Errors: the store thread is gone.
    fn submit(&mut self) -> Result<(), String> {
        let items = std::mem::take(&mut self.items);
        let deliveries = std::mem::take(&mut self.pending);
        self.batch_bytes = 0;
        let summary = self
            .ledger
            .1
            .is_none_or(|t| t.elapsed() >= self.opts.report);
        if summary {
            self.ledger.1 = Some(Instant::now());
        }
        let extra = super::committer::Extra {
            notes: std::mem::take(&mut self.notes),
            summary,
        };
        self.committer.submit(items, extra, deliveries)
    }

    /// A batch back from the store: once committed, its PUBACKs and then
    /// its receipts are queued. `Some` ends the session (the store is
    /// lost; the batch is not acknowledged).
    ///
    /// Errors: a fatal store error.
    fn settle(&mut self, d: Done<Vec<Publish>>) -> Result<Option<End>, String> {
        let committed = match d.result {
            Ok(c) => c,
            Err(StoreError::Transient(e)) => return Ok(Some(End::Lost(format!("store: {e}")))),
            Err(e @ (StoreError::Fatal(_) | StoreError::Settings(_))) => return Err(e.to_string()),
        };
        *self.totals += committed.stats;
        if let Some(l) = committed.summary {
            self.ledger.0 = Some(l);
        }
        self.owed.extend(d.tag.into_iter().map(Owed::Ack));
        // Built from a topic a PUBLISH came on: always valid; checked so
        // that one that is not can never block the outbox. Backfill
        // requests go with the receipts.
        let receipts: Vec<_> = (committed.owed.into_iter().chain(committed.asks))
            .filter(|(topic, _)| rumqttc::valid_topic(topic))
            .collect();
        if !receipts.is_empty() {
            self.owed.push_back(Owed::Receipts(receipts));
        }
        Ok(None)
    }

    /// Give queued acknowledgements and receipts a moment to leave before a
    /// clean stop (an acknowledgement that does not go out is only a
    /// duplicate later, a receipt only a re-send from the agent).
    fn flush(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            self.hand_over();
            let idle = self.owed.is_empty() && self.outbox.is_empty();
            match self.conn.recv_timeout(Duration::from_millis(50)) {
                Err(RecvTimeoutError::Timeout) if idle && self.outbox.in_flight() == 0 => return,
                Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => self.outbox.acked(),
                Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => return,
                _ => {}
            }
        }
    }
}

/// The holdings subscription's SUBACK: refused (an ACL that does not let
/// the sink read `<prefix>/holdings`), the sink goes on without it: the
/// ledger still sees what arrives, and asks no board for anything.
fn holdings_suback(opts: &SinkOptions, codes: &[SubscribeReasonCode]) {
    let f = opts.holdings_subscription().unwrap_or_default();
    if codes.contains(&SubscribeReasonCode::Failure) {
        log::error!(
            "sink: the broker refused the subscription to {f}: boards' holdings will not arrive, \
             so a restored database cannot ask for what it lost (let the sinks read \
             <prefix>/holdings and write <prefix>/backfill: docs/fleet.md)"
        );
    } else {
        log::info!("sink: subscribed {f} (boards' holdings)");
    }
}

/// The ledger's words for the summary line, when the store has told them.
fn ledger_words(l: &Option<super::LedgerSummary>) -> String {
    match l {
        Some(l) => format!(" {}", l.words(crate::event::envelope::wall_clock_ms().0)),
        None => String::new(),
    }
}

fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raised_limit_lasts_until_the_oversized_deliveries_are_acknowledged() {
        assert_eq!(incoming_limit(None), MAX_INCOMING);
        assert_eq!(incoming_limit(Some(17 << 20)), 17 << 20);
        assert_eq!(incoming_limit(Some(MQTT_MAX_REMAINING)), MQTT_MAX_REMAINING);
        assert_eq!(incoming_limit(Some(MQTT_MAX_REMAINING + 1)), MAX_INCOMING);
        let t0 = Instant::now();
        let mut d = Drain::new(17 << 20, t0);
        assert!(!d.done(t0));
        assert!(d.done(t0 + DRAIN_WAIT), "none came: back to normal");
        d.took(None);
        assert!(d.done(t0 + DRAIN_WAIT), "QoS 0 holds nothing open");
        d.took(Some(3));
        d.took(Some(4));
        assert!(!d.done(t0 + DRAIN_WAIT * 10), "waits for its PUBACKs");
        d.acked(3);
        d.acked(9);
        assert!(!d.done(t0));
        d.acked(4);
        assert!(d.done(t0));
        let p = Publish::new("a/b", QoS::AtLeastOnce, vec![0u8; 10]);
        assert_eq!(remaining_length(&p), 2 + 3 + 2 + 10);
        let p = Publish::new("a/b", QoS::AtMostOnce, vec![0u8; 10]);
        assert_eq!(remaining_length(&p), 2 + 3 + 10);
    }

    #[test]
    fn batch_filters_follow_the_events_filter() {
        let f = |s: &str| batches_filter(s);
        assert_eq!(
            f("edgespool/+/events/#").as_deref(),
            Some("edgespool/+/batches/#")
        );
        assert_eq!(f("events/#").as_deref(), Some("batches/#"));
        assert_eq!(
            f("es/d1/events/system").as_deref(),
            Some("es/d1/batches/system/#")
        );
        assert_eq!(f("es/+/events/+").as_deref(), Some("es/+/batches/+/#"));
        assert_eq!(f("edgespool/#"), None);
        assert_eq!(f("#"), None);
        let mut o =
            crate::sink::SinkOptions::new("h".into(), 1, "es/+/events/#".into(), "c".into());
        o.shared_group = Some("g".into());
        assert_eq!(
            o.subscriptions(),
            vec!["$share/g/es/+/events/#", "$share/g/es/+/batches/#"]
        );
        assert_eq!(o.holdings_subscription().as_deref(), Some("es/+/holdings"));
        // The group in the filter: the holdings are never shared either
        // (before, `$share/g/es/+/holdings`: no retained holdings at all).
        o.shared_group = None;
        o.filter = "$share/g/es/+/events/#".into();
        assert_eq!(
            o.subscriptions(),
            vec!["$share/g/es/+/events/#", "$share/g/es/+/batches/#"]
        );
        assert_eq!(o.holdings_subscription().as_deref(), Some("es/+/holdings"));
    }
}
