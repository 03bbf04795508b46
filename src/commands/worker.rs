//! The command thread: receipt, admission, deduplication, dispatch, results.
//!
//! Its one rule: **the PUBLISH of a command is acknowledged only after its
//! receipt (or its rejection) has committed**, and only on the connection it
//! arrived on; a handler starts only after `running` has committed, so a
//! crash mid-run is seen as `interrupted` at the next start, never silently
//! re-run (field case F14).
//!
//! Where a command runs:
//! - built-ins that only read the spool (`ping`, `status`, `checkpoint`,
//!   `requeue-failed`) run on this thread as soon as they are received;
//! - built-ins that ask the agent (`set-interval`, `flush`, `apply-config`,
//!   `reload-config`) run one at a time on the agent lane's thread;
//! - exec handlers run one at a time on the exec lane's thread.
//!
//! So `ping` answers while a long exec handler runs, and a duplicate
//! arriving meanwhile is answered `in_progress` at once.
//!
//! Admission, everything bounded:
//! - the [`Inbox`] from the MQTT thread holds at most [`inbox_limit`] bytes
//!   of command payloads not yet taken (parked ones included);
//! - each lane holds at most `commands.max_queued` claimed commands;
//! - records at most `commands.max_records` ([`super::retention`]);
//! - new commands per scope within `commands.max_per_minute_per_scope`
//!   ([`super::rate`]).
//!
//! Result events are spool rows under the spool's capacity policy like any
//! others; commands are not refused for it, so an operator can still reach a
//! board whose disk is short.
//!
//! A command that cannot be taken now (its lane full, records at their
//! cap, the spool refusing writes) is **held back**: not acknowledged, so
//! the broker keeps it. It is parked in memory, within the inbox's bytes,
//! and taken when there is room; what does not fit in the inbox is not even
//! forwarded, and once there is room again the connection is rebuilt so the
//! broker redelivers it (MQTT 3.1.1 §4.4: unacknowledged messages are resent
//! when the session resumes, not before). With `mqtt.clean_session = true`
//! the broker forgets those instead.

use super::builtin::{self, Kind};
use super::exec_handler::{self, HandlerOutcome};
use super::rate::RateLimiter;
use super::retention::{self, AgentClock, Policy};
use super::store::{self, cstate, Admit, Claim, EventCtx, Receipt, Reply, ResultEvent};
use super::{parse, Command};
use crate::commands::{CommandsConfig, ExecHandler};
use crate::envelope::{wall_clock_ms, EventIdGen, Format};
use crate::intake::Control;
use crate::mqtt::{DeliveryMsg, Link};
use crate::spool::{Spool, SpoolError};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Records are purged and the agent clock persisted this often.
const PURGE_INTERVAL: Duration = Duration::from_secs(60);
/// While records are at their cap, a purge is tried at most this often.
const PURGE_AT_CAP_INTERVAL: Duration = Duration::from_secs(5);
/// While commands are held back, room is looked for this often.
const HOLD_POLL: Duration = Duration::from_millis(500);
/// Repeated warnings of one kind are logged at most this often.
const QUIET_INTERVAL: Duration = Duration::from_secs(30);
/// Parked commands looked at per turn of the loop (keeps it responsive).
const PARKED_PER_TURN: usize = 256;

/// Bytes of command payloads the [`Inbox`] holds at most: 4 MiB, or four
/// of the largest commands if that is more.
pub fn inbox_limit(max_payload_bytes: usize) -> usize {
    (4 * 1024 * 1024).max(4 * max_payload_bytes)
}

/// The command thread's side of the [`Inbox`]: bytes held, and PUBLISHes
/// the MQTT thread could not forward.
#[derive(Debug)]
pub struct InboxMeter {
    bytes: AtomicUsize,
    limit: usize,
    /// `(connection epoch of the latest, how many)` not forwarded.
    dropped: Mutex<Option<(u64, u64)>>,
}

impl InboxMeter {
    fn cost(p: &rumqttc::Publish) -> usize {
        p.payload.len().max(1)
    }

    /// `p` was taken (answered or claimed) or dropped: its bytes are free.
    fn release(&self, p: &rumqttc::Publish) {
        let n = Self::cost(p);
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_sub(n))
            });
    }

    fn held(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    fn take_dropped(&self) -> Option<(u64, u64)> {
        self.dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// The MQTT thread's hand-off of command PUBLISHes to the command thread,
/// bounded by bytes: a PUBLISH that would take the bytes held over the limit
/// is not forwarded and not acknowledged (the broker keeps it), and the
/// command thread has the broker redeliver it once there is room.
#[derive(Debug, Clone)]
pub struct Inbox {
    tx: Sender<CmdMsg>,
    meter: Arc<InboxMeter>,
}

impl Inbox {
    /// An inbox sending to the command thread's channel `tx`, holding at
    /// most `limit` bytes.
    pub fn new(tx: Sender<CmdMsg>, limit: usize) -> Inbox {
        Inbox {
            tx,
            meter: Arc::new(InboxMeter {
                bytes: AtomicUsize::new(0),
                limit,
                dropped: Mutex::new(None),
            }),
        }
    }

    /// The command thread's side.
    pub fn meter(&self) -> Arc<InboxMeter> {
        self.meter.clone()
    }

    /// Forward a PUBLISH received on connection `epoch`, if it fits (one
    /// always does when nothing is held). Called by the MQTT thread; never
    /// blocks.
    pub fn offer(&self, epoch: u64, publish: rumqttc::Publish) {
        let n = InboxMeter::cost(&publish);
        let m = &self.meter;
        let fits = m
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                (b == 0 || b + n <= m.limit).then_some(b + n)
            })
            .is_ok();
        if !fits {
            let mut d = m.dropped.lock().unwrap_or_else(|p| p.into_inner());
            let count = d.map_or(0, |(_, c)| c);
            *d = Some((epoch, count + 1));
            return;
        }
        if let Err(e) = self.tx.send(CmdMsg::Incoming { epoch, publish }) {
            // The command thread is gone (stopping).
            if let CmdMsg::Incoming { publish, .. } = e.0 {
                m.release(&publish);
            }
        }
    }
}

/// Messages to the command thread.
#[derive(Debug)]
pub enum CmdMsg {
    /// Look at the stop flag now (sent by the agent when it stops; the
    /// worker otherwise sleeps until a message or its next deadline).
    Wake,
    /// A PUBLISH on the command topic, received on connection `epoch`.
    Incoming {
        /// Connection epoch it arrived on (acks go only to that connection).
        epoch: u64,
        /// The message.
        publish: rumqttc::Publish,
    },
    /// A lane's thread finished a job.
    Done {
        /// The lane it ran on.
        lane: Lane,
        /// Scope.
        scope: String,
        /// Command id.
        command_id: String,
        /// Name.
        name: String,
        /// Outcome.
        outcome: HandlerOutcome,
        /// How long it ran.
        duration: Duration,
        /// Handler may be re-run after an interruption.
        retry_safe: bool,
    },
}

/// Settings for the command thread.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// `device_id`.
    pub device_id: String,
    /// Payload format of result events.
    pub format: Format,
    /// `[commands]`.
    pub commands: CommandsConfig,
}

/// A thread that runs long commands one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Exec handlers (programs from the board config).
    Exec,
    /// Built-ins that ask the agent's main thread.
    Agent,
}

impl Lane {
    fn index(self) -> usize {
        match self {
            Lane::Exec => 0,
            Lane::Agent => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Lane::Exec => "exec-handler",
            Lane::Agent => "agent-request",
        }
    }
}

/// Where a command name runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// On the command thread, at once.
    Local,
    /// On a lane.
    Lane(Lane),
    /// No such command.
    Unknown,
}

struct Pending {
    scope: String,
    command_id: String,
    name: String,
    args: Map<String, Value>,
    /// Deadline on the wall clock (trusted clock only).
    deadline_wall: Option<i64>,
    /// Deadline on the monotonic clock (from receipt in this process).
    deadline_mono: Option<Instant>,
    /// The deadline cannot be judged (received before a restart on an untrusted clock).
    age_unknown: bool,
}

enum Job {
    /// Boxed: a handler is large and a job is moved through a channel.
    Exec(Box<ExecHandler>),
    Agent,
}

struct LaneJob {
    scope: String,
    command_id: String,
    name: String,
    args: Map<String, Value>,
    job: Job,
    retry_safe: bool,
}

struct LaneState {
    queue: VecDeque<Pending>,
    busy: bool,
    tx: Sender<LaneJob>,
}

/// A PUBLISH held back in memory, unacknowledged, until it can be taken.
struct Parked {
    epoch: u64,
    publish: rumqttc::Publish,
    /// Where it runs (`None`: not parseable; only the spool's room matters).
    route: Option<Route>,
}

/// An episode of new commands left unacknowledged.
struct Hold {
    /// Connection of the latest PUBLISH the inbox could not forward.
    dropped_epoch: Option<u64>,
    parked: u64,
    dropped: u64,
    why: String,
}

/// A warning logged at most once per [`QUIET_INTERVAL`], with a count of
/// the ones left out.
#[derive(Default)]
struct Quiet {
    last: Option<Instant>,
    left_out: u64,
}

impl Quiet {
    fn warn(&mut self, msg: impl FnOnce() -> String) {
        if self.last.is_some_and(|t| t.elapsed() < QUIET_INTERVAL) {
            self.left_out += 1;
            return;
        }
        let more = match std::mem::take(&mut self.left_out) {
            0 => String::new(),
            n => format!(" ({n} more like it since the last line)"),
        };
        log::warn!("{}{more} (repeats logged every 30 s)", msg());
        self.last = Some(Instant::now());
    }
}

/// Run the command thread until `stop`.
#[allow(clippy::too_many_arguments)] // the thread's wiring, built once by the agent
pub fn run(
    mut spool: Spool,
    cfg: WorkerConfig,
    link: Link,
    inbox: Arc<InboxMeter>,
    rx: Receiver<CmdMsg>,
    self_tx: Sender<CmdMsg>,
    ctl: Sender<Control>,
    to_delivery: Sender<DeliveryMsg>,
    stop: Arc<AtomicBool>,
) {
    let mut ids = match EventIdGen::new() {
        Ok(g) => g,
        Err(e) => {
            log::error!("commands: OS random source failed: {e}; commands disabled");
            return;
        }
    };
    let clock = match store::clock_ms(&spool) {
        Ok(ms) => AgentClock::resume(ms),
        Err(e) => {
            // Without it no record age can be judged: purging could delete a
            // record inside the redelivery window.
            log::error!("commands: cannot read the command clock: {e}; commands disabled");
            return;
        }
    };
    let lane = |lane: Lane| -> Option<LaneState> {
        let (tx, rx) = std::sync::mpsc::channel::<LaneJob>();
        let (done, ctl) = (self_tx.clone(), ctl.clone());
        let name = match lane {
            Lane::Exec => "cmd-exec",
            Lane::Agent => "cmd-agent",
        };
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || lane_thread(lane, rx, done, ctl))
        {
            Ok(_) => Some(LaneState {
                queue: VecDeque::new(),
                busy: false,
                tx,
            }),
            Err(e) => {
                log::error!("commands: cannot start the {name} thread: {e}; commands disabled");
                None
            }
        }
    };
    let (Some(exec), Some(agent)) = (lane(Lane::Exec), lane(Lane::Agent)) else {
        return;
    };
    let limiter = RateLimiter::new(cfg.commands.max_per_minute_per_scope);
    let mut w = Worker {
        cfg,
        link,
        local: VecDeque::new(),
        lanes: [exec, agent],
        inbox,
        parked: VecDeque::new(),
        unsaved: Vec::new(),
        to_delivery,
        last_error_log: None,
        clock,
        started: Instant::now(),
        limiter,
        records: 0,
        hold: None,
        last_hold_warning: None,
        write_retry: None,
        last_purge: None,
        last_purge_freed: 0,
        malformed_log: Quiet::default(),
        refused_log: Quiet::default(),
        rejected_log: Quiet::default(),
    };
    w.recover(&mut spool, &mut ids);
    w.purge(&mut spool);
    while !stop.load(Ordering::Relaxed) {
        // Event-driven: wake for a message, a result to retry, room for held
        // commands, or the purge.
        let wait = if !w.unsaved.is_empty() {
            Duration::from_millis(200)
        } else if w.hold.is_some() {
            HOLD_POLL
        } else {
            PURGE_INTERVAL.saturating_sub(w.last_purge.map_or(PURGE_INTERVAL, |t| t.elapsed()))
        };
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok(msg) => w.handle(msg, &mut spool, &mut ids),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        w.retry_unsaved(&mut spool, &mut ids);
        w.dispatch(&mut spool, &mut ids);
        w.unpark(&mut spool, &mut ids);
        w.dispatch(&mut spool, &mut ids);
        w.release_if_room(&mut spool);
        if w.last_purge.is_none_or(|t| t.elapsed() >= PURGE_INTERVAL) {
            w.purge(&mut spool);
        }
    }
    w.persist_clock(&mut spool);
    // The lane threads end when their job channels close.
    drop(w);
}

/// A finished command whose result is not committed yet.
struct Unsaved {
    scope: String,
    command_id: String,
    name: String,
    state: String,
    result: String,
    duration_ms: Option<i64>,
    retry_safe: Option<bool>,
}

struct Worker {
    cfg: WorkerConfig,
    link: Link,
    /// Local built-ins waiting (only at start, or within one loop turn).
    local: VecDeque<Pending>,
    /// Indexed by [`Lane::index`].
    lanes: [LaneState; 2],
    inbox: Arc<InboxMeter>,
    /// Held back in memory, oldest first.
    parked: VecDeque<Parked>,
    /// Finished commands whose result could not be committed yet (disk full, busy).
    unsaved: Vec<Unsaved>,
    to_delivery: Sender<DeliveryMsg>,
    last_error_log: Option<Instant>,
    clock: AgentClock,
    /// Origin of the rate limiter's time.
    started: Instant,
    limiter: RateLimiter,
    /// Command records in the spool (refreshed at every purge).
    records: usize,
    hold: Option<Hold>,
    last_hold_warning: Option<Instant>,
    /// After a failed spool write: when to try again, and the delay that
    /// doubles on each failure in a row.
    write_retry: Option<(Instant, Duration)>,
    last_purge: Option<Instant>,
    /// Records the last purge deleted.
    last_purge_freed: usize,
    malformed_log: Quiet,
    refused_log: Quiet,
    rejected_log: Quiet,
}

impl Worker {
    fn ctx<'a>(&'a self, ids: &'a mut EventIdGen) -> EventCtx<'a> {
        EventCtx {
            ids,
            device_id: &self.cfg.device_id,
            format: self.cfg.format,
        }
    }

    fn log_error(&mut self, what: &str, e: &SpoolError) {
        if self
            .last_error_log
            .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
        {
            log::error!("commands: {what}: {e} (repeats logged every 30 s)");
            self.last_error_log = Some(Instant::now());
        }
    }

    fn policy(&self) -> Policy {
        Policy {
            window: self.cfg.commands.record_retention,
            max_records: self.cfg.commands.max_records,
        }
    }

    fn route(&self, name: &str) -> Route {
        match builtin::kind(name) {
            Some(Kind::Local) => Route::Local,
            Some(Kind::Agent) => Route::Lane(Lane::Agent),
            None if self.handler(name).is_some() => Route::Lane(Lane::Exec),
            None => Route::Unknown,
        }
    }

    fn enqueue(&mut self, p: Pending) {
        match self.route(&p.name) {
            Route::Lane(l) => self.lanes[l.index()].queue.push_back(p),
            // Unknown names (a handler removed from the config since) are
            // rejected where local built-ins run.
            Route::Local | Route::Unknown => self.local.push_back(p),
        }
    }

    /// Delete what the retention policy allows, refresh the record count and
    /// persist the agent clock.
    fn purge(&mut self, spool: &mut Spool) {
        self.last_purge = Some(Instant::now());
        let policy = self.policy();
        self.last_purge_freed = match store::purge(spool, self.clock.now_ms(), &policy) {
            Ok(n) => {
                if n > 0 {
                    log::debug!("commands: purged {n} command records");
                }
                n
            }
            Err(e) => {
                self.log_error("purging command records", &e);
                0
            }
        };
        match spool.command_count() {
            Ok(n) => self.records = n,
            Err(e) => self.log_error("counting command records", &e),
        }
        self.persist_clock(spool);
    }

    /// Whether records are at `commands.max_records` even after a purge. A
    /// purge is tried at once if the last one freed something (rejected
    /// records go in batches down to the low-water mark), else at most every
    /// [`PURGE_AT_CAP_INTERVAL`].
    fn records_full(&mut self, spool: &mut Spool) -> bool {
        if self.records < self.cfg.commands.max_records {
            return false;
        }
        if self.last_purge_freed > 0
            || self
                .last_purge
                .is_none_or(|t| t.elapsed() >= PURGE_AT_CAP_INTERVAL)
        {
            self.purge(spool);
        }
        self.records >= self.cfg.commands.max_records
    }

    fn persist_clock(&mut self, spool: &mut Spool) {
        let now = self.clock.now_ms().to_string();
        if let Err(e) = spool.set_state(retention::CLOCK_STATE_KEY, &now, wall_clock_ms().0) {
            self.log_error("persisting the command clock", &e);
        }
    }

    /// Why the spool is not written to now, if it is not: a write failed
    /// (disk full, busy) and its retry delay has not passed.
    fn write_refusal(&self) -> Option<String> {
        self.write_retry
            .filter(|(at, _)| Instant::now() < *at)
            .map(|(_, delay)| {
                format!(
                    "the spool refused a write; trying again in at most {} ms",
                    delay.as_millis()
                )
            })
    }

    /// A spool write failed: hold new commands back for a while (1 s,
    /// doubling to 30 s while it keeps failing).
    fn write_failed(&mut self) {
        let delay = self.write_retry.map_or(Duration::from_secs(1), |(_, d)| {
            (d * 2).min(Duration::from_secs(30))
        });
        self.write_retry = Some((Instant::now() + delay, delay));
    }

    /// Why a new command for `route` cannot be taken now, if it cannot.
    fn admission_refusal(&mut self, route: Route, spool: &mut Spool) -> Option<String> {
        let max_queued = self.cfg.commands.max_queued;
        if let Route::Lane(l) = route {
            if self.lanes[l.index()].queue.len() >= max_queued {
                return Some(format!(
                    "the {} queue is full ({max_queued} waiting, commands.max_queued)",
                    l.name()
                ));
            }
        }
        if self.records_full(spool) {
            return Some(format!(
                "{} command records (commands.max_records) and none may be deleted yet: \
                 the commands ran within the redelivery window (commands.record_retention_secs)",
                self.records
            ));
        }
        self.write_refusal()
    }

    /// Start an episode of held-back commands (logged once), or count into
    /// the current one.
    fn hold(&mut self, why: impl FnOnce() -> String) -> &mut Hold {
        let Worker {
            hold,
            last_hold_warning,
            ..
        } = self;
        hold.get_or_insert_with(|| {
            let why = why();
            let msg = format!(
                "commands: {why}; not acknowledging new commands: the broker keeps them, \
                 they are taken once there is room"
            );
            if last_hold_warning.is_some_and(|t| t.elapsed() < Duration::from_secs(600)) {
                log::debug!("{msg}");
            } else {
                log::warn!("{msg} (logged at most every 10 min)");
                *last_hold_warning = Some(Instant::now());
            }
            Hold {
                dropped_epoch: None,
                parked: 0,
                dropped: 0,
                why,
            }
        })
    }

    /// Keep `publish` unacknowledged, in memory, until it can be taken.
    fn park(&mut self, epoch: u64, publish: rumqttc::Publish, route: Option<Route>, why: String) {
        self.hold(|| why).parked += 1;
        self.parked.push_back(Parked {
            epoch,
            publish,
            route,
        });
    }

    /// A PUBLISH of connection `epoch` was neither taken nor kept: only a
    /// redelivery brings it back.
    fn dropped(&mut self, epoch: u64, n: u64, why: impl FnOnce() -> String) {
        let h = self.hold(why);
        h.dropped += n;
        h.dropped_epoch = Some(epoch);
    }

    /// Take parked commands that fit now, oldest first; drop those of an
    /// earlier connection (they cannot be acknowledged there; the broker
    /// resent them on the new one).
    fn unpark(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        if let Some((epoch, n)) = self.inbox.take_dropped() {
            let limit = self.inbox.limit;
            self.dropped(epoch, n, || {
                format!("the command inbox is full ({limit} bytes of commands not yet taken)")
            });
        }
        let current = self.link.epoch();
        let mut i = 0;
        let mut looked = 0;
        while i < self.parked.len() && looked < PARKED_PER_TURN {
            looked += 1;
            let p = &self.parked[i];
            if p.epoch != current {
                if let Some(p) = self.parked.remove(i) {
                    self.inbox.release(&p.publish);
                }
                continue;
            }
            let fits = match p.route {
                Some(route) => self.admission_refusal(route, spool).is_none(),
                None => self.write_refusal().is_none(),
            };
            if !fits {
                i += 1;
                continue;
            }
            if let Some(p) = self.parked.remove(i) {
                // Parked again (at the back) if things changed meanwhile.
                self.incoming(p.epoch, p.publish, spool, ids);
            }
        }
    }

    /// With nothing parked and the inbox at most half full, end the episode
    /// of held-back commands; if the inbox dropped some on the current
    /// connection, rebuild it so the broker redelivers them.
    fn release_if_room(&mut self, spool: &mut Spool) {
        if self.hold.is_none() {
            return;
        }
        if !self.parked.is_empty() || self.inbox.held() > self.inbox.limit / 2 {
            return;
        }
        if let Some(why) = self.no_room(spool) {
            log::trace!("commands: still holding back new commands: {why}");
            return;
        }
        let Some(h) = self.hold.take() else {
            return;
        };
        let how = match h.dropped_epoch {
            Some(epoch) if self.link.redeliver(epoch) => {
                "reconnecting so the broker redelivers the ones not kept"
            }
            Some(_) => {
                "the connection was rebuilt since, so the broker redelivered the ones not kept"
            }
            None => "all were taken from memory",
        };
        log::info!(
            "commands: room again ({} before); {} commands were parked, {} not kept; {how}",
            h.why,
            h.parked,
            h.dropped
        );
        if let Err(e) = spool.count("commands_held_back", (h.parked + h.dropped) as i64) {
            self.log_error("counting held-back commands", &e);
        }
    }

    /// Why held-back commands cannot be taken yet: a lane more than half
    /// full, records at their cap, or the spool refusing data.
    fn no_room(&mut self, spool: &mut Spool) -> Option<String> {
        let half = self.cfg.commands.max_queued.div_ceil(2);
        if let Some(l) = self.lanes.iter().find(|l| l.queue.len() > half) {
            // Redelivered commands would mostly be parked again.
            return Some(format!("{} commands waiting in a lane", l.queue.len()));
        }
        if self.records_full(spool) {
            return Some(format!("{} command records", self.records));
        }
        self.write_refusal()
    }

    /// At start: `received` commands never began and are queued; `running`
    /// ones were cut off by a crash: re-run if retry-safe, else `interrupted`.
    fn recover(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        let list = match spool.unfinished_commands() {
            Ok(l) => l,
            Err(e) => {
                self.log_error("reading unfinished commands", &e);
                return;
            }
        };
        let trusted = wall_clock_ms().1;
        for u in list {
            let request: Value = serde_json::from_str(&u.request).unwrap_or(Value::Null);
            let args = request
                .get("args")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let safe = self.retry_safe(&u.name);
            if u.state == cstate::RUNNING {
                if safe {
                    log::warn!("command {}/{} was running when the agent stopped; re-running (handler is retry-safe)", u.scope, u.command_id);
                    if let Err(e) = spool.requeue_command(&u.scope, &u.command_id) {
                        self.log_error("requeue interrupted command", &e);
                        continue;
                    }
                } else {
                    log::warn!("command {}/{} was running when the agent stopped; reported interrupted, not re-run", u.scope, u.command_id);
                    let result = json!({"error": "interrupted: the agent stopped while the command ran; not re-run because the handler is not declared retry_safe"}).to_string();
                    self.finish(
                        spool,
                        ids,
                        &u.scope,
                        &u.command_id,
                        &u.name,
                        cstate::INTERRUPTED,
                        result,
                        None,
                        Some(false),
                    );
                    continue;
                }
            }
            let deadline_wall = u.deadline_ms.or_else(|| {
                u.ttl_ms
                    .filter(|_| trusted && u.received_ms >= crate::envelope::CLOCK_FLOOR_MS)
                    .map(|t| u.received_ms + t)
            });
            self.enqueue(Pending {
                scope: u.scope,
                command_id: u.command_id,
                name: u.name,
                args,
                deadline_wall,
                deadline_mono: None,
                age_unknown: u.ttl_ms.is_some() && deadline_wall.is_none(),
            });
        }
    }

    fn retry_safe(&self, name: &str) -> bool {
        if builtin::kind(name).is_some() {
            return true;
        }
        self.handler(name).is_some_and(|h| h.retry_safe)
    }

    fn handler(&self, name: &str) -> Option<&ExecHandler> {
        self.cfg.commands.handlers.iter().find(|h| h.name == name)
    }

    fn handle(&mut self, msg: CmdMsg, spool: &mut Spool, ids: &mut EventIdGen) {
        match msg {
            CmdMsg::Wake => {}
            CmdMsg::Incoming { epoch, publish } => self.incoming(epoch, publish, spool, ids),
            CmdMsg::Done {
                lane,
                scope,
                command_id,
                name,
                outcome,
                duration,
                retry_safe,
            } => {
                self.lanes[lane.index()].busy = false;
                self.done(
                    spool,
                    ids,
                    &scope,
                    &command_id,
                    &name,
                    outcome,
                    duration,
                    retry_safe,
                );
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // one finished job's fields
    fn done(
        &mut self,
        spool: &mut Spool,
        ids: &mut EventIdGen,
        scope: &str,
        command_id: &str,
        name: &str,
        outcome: HandlerOutcome,
        duration: Duration,
        retry_safe: bool,
    ) {
        let (state, result) = match outcome {
            HandlerOutcome::Completed(v) => (cstate::COMPLETED, v.to_string()),
            HandlerOutcome::Failed(v) => (cstate::FAILED, v.to_string()),
            HandlerOutcome::Rejected(e) => (cstate::REJECTED, json!({"error": e}).to_string()),
        };
        self.finish(
            spool,
            ids,
            scope,
            command_id,
            name,
            state,
            result,
            Some(duration.as_millis() as i64),
            Some(retry_safe),
        );
    }

    fn incoming(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) {
        if publish.payload.is_empty() {
            // The MQTT way to clear a retained command is an empty retained
            // message; subscribers connected at that moment get it with the
            // retain flag cleared (MQTT 3.1.1 §3.3.1.3), so any empty
            // payload is taken as a clear. Nothing to answer.
            log::debug!(
                "commands: empty message on {} (retain={}): a retained command was cleared; ignored",
                publish.topic,
                publish.retain
            );
            if let Err(e) = spool.count("commands_retained_cleared", 1) {
                self.log_error("counting a cleared retained command", &e);
            }
            self.link.ack(epoch, &publish);
            self.inbox.release(&publish);
            return;
        }
        let cmd: Command = match parse(&publish.payload, self.cfg.commands.max_payload_bytes) {
            Ok(c) => c,
            Err(e) => {
                if let Some(why) = self.write_refusal() {
                    self.park(epoch, publish, None, why);
                    return;
                }
                self.malformed_log
                    .warn(|| format!("commands: rejected message on {}: {e}", publish.topic));
                let mut ctx = self.ctx(ids);
                let res = store::reject_unparsed(
                    spool,
                    e.command_id(),
                    &e.to_string(),
                    &publish.payload,
                    &mut ctx,
                );
                match res {
                    Ok(()) => {
                        self.write_retry = None;
                        self.link.ack(epoch, &publish);
                        self.inbox.release(&publish);
                        let _ = self.to_delivery.send(DeliveryMsg::NewRows);
                    }
                    Err(err) => {
                        self.log_error(
                            "recording a rejected command (kept, not acknowledged)",
                            &err,
                        );
                        self.write_failed();
                        self.park(
                            epoch,
                            publish,
                            None,
                            format!("the spool refused a write: {err}"),
                        );
                    }
                }
                return;
            }
        };
        let route = self.route(&cmd.name);
        if let Some(why) = self.admission_refusal(route, spool) {
            self.park(epoch, publish, Some(route), why);
            return;
        }
        // Exec handlers get a time to live when the command names none;
        // built-ins need none.
        let ttl = cmd.ttl.or(match route {
            Route::Lane(Lane::Exec) => Some(self.cfg.commands.default_ttl),
            _ => None,
        });
        let (now, trusted) = wall_clock_ms();
        let deadline_wall = ttl
            .filter(|_| trusted)
            .map(|t| cmd.issued_at_ms.unwrap_or(now) + t.as_millis() as i64);
        let rate_now = self.started.elapsed();
        let over_rate;
        let unknown;
        let admit = if !self.limiter.allows(&cmd.scope, rate_now) {
            over_rate = format!(
                "rate limit: more than {} new commands per minute in scope {:?} \
                 (commands.max_per_minute_per_scope); not recorded: send it again later",
                self.cfg.commands.max_per_minute_per_scope, cmd.scope
            );
            Admit::Refuse(&over_rate)
        } else if route == Route::Unknown {
            let mut known: Vec<&str> = super::BUILTINS.to_vec();
            known.extend(self.cfg.commands.handlers.iter().map(|h| h.name.as_str()));
            unknown = format!(
                "unknown command {:?} (known: {})",
                cmd.name,
                known.join(", ")
            );
            Admit::Reject(&unknown)
        } else {
            Admit::Accept
        };
        let receipt = Receipt {
            deadline_ms: deadline_wall,
            ttl,
            clock_ms: self.clock.now_ms(),
            admit,
        };
        let mut ctx = self.ctx(ids);
        let claim = store::claim(spool, &cmd, publish.retain, &receipt, &mut ctx);
        let claim = match claim {
            Ok(c) => c,
            // Not acknowledged: kept and tried again, or redelivered by the
            // broker on the next session.
            Err(e) => {
                self.log_error("claiming a command receipt (kept, not acknowledged)", &e);
                self.write_failed();
                self.park(
                    epoch,
                    publish,
                    Some(route),
                    format!("the spool refused a write: {e}"),
                );
                return;
            }
        };
        self.write_retry = None;
        // Only now, with the receipt committed, may the broker forget it.
        self.link.ack(epoch, &publish);
        self.inbox.release(&publish);
        let _ = self.to_delivery.send(DeliveryMsg::NewRows);
        match claim {
            Claim::New => {
                self.limiter.take(&cmd.scope, rate_now);
                self.records += 1;
                log::info!(
                    "command {}/{} ({}) received",
                    cmd.scope,
                    cmd.command_id,
                    cmd.name
                );
                self.enqueue(Pending {
                    scope: cmd.scope,
                    command_id: cmd.command_id,
                    name: cmd.name,
                    args: cmd.args,
                    deadline_wall,
                    deadline_mono: ttl.map(|t| Instant::now() + t),
                    age_unknown: false,
                });
            }
            Claim::Rejected => {
                self.limiter.take(&cmd.scope, rate_now);
                self.records += 1;
                self.rejected_log.warn(|| {
                    format!(
                        "commands: {}/{} rejected: unknown command {:?}",
                        cmd.scope, cmd.command_id, cmd.name
                    )
                });
            }
            Claim::Refused => self.refused_log.warn(|| {
                format!(
                    "commands: {}/{} refused: over commands.max_per_minute_per_scope in scope {:?}",
                    cmd.scope, cmd.command_id, cmd.scope
                )
            }),
            Claim::Duplicate { state } => log::info!(
                "command {}/{}: duplicate delivery{}; answered from the store ({state}), not run again",
                cmd.scope,
                cmd.command_id,
                if publish.retain { " (retained)" } else { "" }
            ),
            Claim::InProgress => log::info!(
                "command {}/{}: duplicate while still running; answered in_progress",
                cmd.scope,
                cmd.command_id
            ),
            Claim::Conflict => log::warn!(
                "command {}/{}: same id, different request; answered conflict, original untouched",
                cmd.scope,
                cmd.command_id
            ),
        }
    }

    /// Run every waiting local built-in, and start the next command of each
    /// idle lane.
    fn dispatch(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        while let Some(p) = self.local.pop_front() {
            if !self.start(p, None, spool, ids) {
                return;
            }
        }
        for lane in [Lane::Exec, Lane::Agent] {
            while !self.lanes[lane.index()].busy {
                let Some(p) = self.lanes[lane.index()].queue.pop_front() else {
                    break;
                };
                if !self.start(p, Some(lane), spool, ids) {
                    break;
                }
            }
        }
    }

    /// Judge `p`'s deadline, commit `running`, and run it here (local) or
    /// hand it to `lane`'s thread. Returns false when the spool could not
    /// mark it running (it is put back and tried again later).
    fn start(
        &mut self,
        p: Pending,
        lane: Option<Lane>,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) -> bool {
        // A trusted wall clock judges against the issue time; otherwise
        // only the monotonic time since receipt counts.
        let (now_ms, trusted) = wall_clock_ms();
        let expired = p.age_unknown
            || match (trusted, p.deadline_wall, p.deadline_mono) {
                (true, Some(d), _) => now_ms > d,
                (_, _, Some(d)) => Instant::now() > d,
                _ => false,
            };
        if expired {
            let why = if p.age_unknown {
                "expired: its age cannot be judged (received before a restart, clock not trusted)"
            } else {
                "expired: past its ttl_secs (or commands.default_ttl_secs); not run"
            };
            self.finish(
                spool,
                ids,
                &p.scope,
                &p.command_id,
                &p.name,
                cstate::EXPIRED,
                json!({"error": why}).to_string(),
                None,
                None,
            );
            return true;
        }
        let kind = builtin::kind(&p.name);
        let exec = self.handler(&p.name).cloned();
        if kind.is_none() && exec.is_none() {
            let mut known: Vec<&str> = super::BUILTINS.to_vec();
            known.extend(self.cfg.commands.handlers.iter().map(|h| h.name.as_str()));
            let why = json!({"error": format!("unknown command {:?} (known: {})", p.name, known.join(", "))}).to_string();
            self.finish(
                spool,
                ids,
                &p.scope,
                &p.command_id,
                &p.name,
                cstate::REJECTED,
                why,
                None,
                None,
            );
            return true;
        }
        match spool.start_command(&p.scope, &p.command_id) {
            Ok(true) => {}
            Ok(false) => return true, // already finished by someone else
            Err(e) => {
                self.log_error("marking a command running", &e);
                match lane {
                    Some(l) => self.lanes[l.index()].queue.push_front(p),
                    None => self.local.push_front(p),
                }
                return false;
            }
        }
        let Some(lane) = lane else {
            let t = Instant::now();
            if p.name == "requeue-failed" {
                // Before the copies exist, so delivery never judges one by
                // a packet limit it learned from the failure.
                let _ = self.to_delivery.send(DeliveryMsg::Requeued);
            }
            let outcome = builtin::run_local(&p.name, &p.args, spool);
            if p.name == "requeue-failed" {
                // Requeued rows are appended as new rows, after every row.
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
            }
            self.done(
                spool,
                ids,
                &p.scope,
                &p.command_id,
                &p.name,
                outcome,
                t.elapsed(),
                true,
            );
            return true;
        };
        let retry_safe = self.retry_safe(&p.name);
        let job = LaneJob {
            scope: p.scope,
            command_id: p.command_id,
            name: p.name,
            args: p.args,
            job: match exec {
                Some(h) => Job::Exec(Box::new(h)),
                None => Job::Agent,
            },
            retry_safe,
        };
        if self.lanes[lane.index()].tx.send(job).is_err() {
            log::error!("commands: the {} thread is gone", lane.name());
            return false;
        }
        self.lanes[lane.index()].busy = true;
        true
    }

    #[allow(clippy::too_many_arguments)] // one result event's fields
    fn finish(
        &mut self,
        spool: &mut Spool,
        ids: &mut EventIdGen,
        scope: &str,
        command_id: &str,
        name: &str,
        state: &str,
        result: String,
        duration_ms: Option<i64>,
        retry_safe: Option<bool>,
    ) {
        let ev = ResultEvent {
            scope,
            command_id: Some(command_id),
            name: Some(name),
            state,
            result: &result,
            duration_ms,
            reply: Reply::Result,
            retry_safe,
        };
        let mut ctx = self.ctx(ids);
        match store::finish(spool, &ev, &mut ctx) {
            Ok(_) => {
                log::info!("command {scope}/{command_id} ({name}) {state}");
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
            }
            Err(e) => {
                self.log_error("storing a command result (kept in memory, retried)", &e);
                self.unsaved.push(Unsaved {
                    scope: scope.to_owned(),
                    command_id: command_id.to_owned(),
                    name: name.to_owned(),
                    state: state.to_owned(),
                    result,
                    duration_ms,
                    retry_safe,
                });
            }
        }
    }

    fn retry_unsaved(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        for u in std::mem::take(&mut self.unsaved) {
            self.finish(
                spool,
                ids,
                &u.scope,
                &u.command_id,
                &u.name,
                &u.state,
                u.result,
                u.duration_ms,
                u.retry_safe,
            );
        }
    }
}

/// A lane's thread: runs its jobs one at a time.
fn lane_thread(lane: Lane, rx: Receiver<LaneJob>, done: Sender<CmdMsg>, ctl: Sender<Control>) {
    while let Ok(j) = rx.recv() {
        let t = Instant::now();
        let outcome = match &j.job {
            Job::Exec(h) => exec_handler::run(h, &j.args),
            Job::Agent => builtin::run_agent(&j.name, &j.args, &ctl),
        };
        let msg = CmdMsg::Done {
            lane,
            scope: j.scope,
            command_id: j.command_id,
            name: j.name,
            outcome,
            duration: t.elapsed(),
            retry_safe: j.retry_safe,
        };
        if done.send(msg).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(len: usize) -> rumqttc::Publish {
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, vec![b'x'; len])
    }

    #[test]
    fn the_inbox_forwards_up_to_its_bytes_and_notes_what_it_left_at_the_broker() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100);
        let meter = inbox.meter();
        inbox.offer(1, publish(60));
        inbox.offer(1, publish(30));
        inbox.offer(1, publish(20)); // 110 > 100: left at the broker
        inbox.offer(2, publish(20));
        assert_eq!(rx.try_iter().count(), 2);
        assert_eq!(meter.held(), 90);
        assert_eq!(meter.take_dropped(), Some((2, 2)), "latest epoch, count");
        assert_eq!(meter.take_dropped(), None);
        meter.release(&publish(60));
        inbox.offer(3, publish(20));
        assert_eq!(rx.try_iter().count(), 1);
        assert_eq!(meter.held(), 50);
    }

    #[test]
    fn one_command_larger_than_the_inbox_still_passes_when_nothing_is_held() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100);
        inbox.offer(1, publish(500));
        assert_eq!(rx.try_iter().count(), 1);
        inbox.offer(1, publish(1));
        assert_eq!(rx.try_iter().count(), 0);
        assert_eq!(inbox.meter().take_dropped(), Some((1, 1)));
    }

    #[test]
    fn the_inbox_holds_four_mib_or_four_of_the_largest_commands() {
        assert_eq!(inbox_limit(65_536), 4 * 1024 * 1024);
        assert_eq!(inbox_limit(1024 * 1024), 4 * 1024 * 1024);
        assert_eq!(inbox_limit(2 * 1024 * 1024), 8 * 1024 * 1024);
    }
}
