//! The command thread: its loop, receipt, admission, dispatch.
//!
//! Its one rule: **the PUBLISH of a command is acknowledged only after its
//! receipt (or its rejection) has committed**, and only on the connection it
//! arrived on; a handler starts only after `running` has committed, so a
//! crash mid-run is seen as `interrupted` at the next start, never silently
//! re-run (field case F14, [`super::recovery`]).
//!
//! Where a command runs ([`super::lanes`]):
//! - built-ins that only read the spool (`ping`, `status`, `checkpoint`,
//!   `requeue-failed`) run on this thread as soon as they are received;
//! - built-ins that ask the agent (`set-interval`, `flush`, `apply-config`,
//!   `reload-config`) run one at a time on the agent lane's thread;
//! - exec handlers run one at a time on the exec lane's thread.
//!
//! So `ping` answers while a long exec handler runs, and a duplicate
//! arriving meanwhile is answered `in_progress` at once.
//!
//! Admission, everything bounded, a quarter of every bound kept for the
//! operator ([`super::admission`]: tiers, shares, budgets, and what a
//! sender can and cannot do):
//! - the [`Inbox`] from the MQTT thread holds at most [`inbox_limit`] bytes
//!   of other commands' payloads not yet taken (parked ones included), and
//!   a third more for operator commands;
//! - messages taken from the channel wait in a [`super::backlog`] by tier:
//!   operator commands are handled first, then pushes, then the rest;
//! - each lane holds at most `commands.max_queued` claimed commands (other
//!   commands three quarters), operator commands ahead in the queue;
//! - records at most `commands.max_records` (other commands three quarters;
//!   [`super::records`], [`super::retention`]); `ping` and `status` are
//!   answered at receipt with a droppable record, and so, by default, is
//!   the refusal of an unsigned command with a side effect;
//! - new commands per scope within `commands.max_per_minute_per_scope`,
//!   and those no operator key signed within `commands.max_per_minute`
//!   ([`super::rate`]).
//!
//! The operator is whoever signs with a key in
//! `commands.operator_public_keys` ([`super::signed`]); the inbox checks
//! the signature and hands the command over with its [`Tier`], which this
//! thread takes as it is.
//!
//! Result events are spool rows under the spool's capacity policy like any
//! others ([`super::results`]); commands are not refused for it, so an
//! operator can still reach a board whose disk is short.
//!
//! Another command over its rate or finding no room among the
//! records is answered (`rate_limited`, `no_room`) and not recorded. A
//! command that cannot be taken now (its lane full, an operator command or
//! a push finding no room among the records, the spool refusing writes) is
//! **held back** ([`super::hold`]): not
//! acknowledged, so the broker keeps it. It is parked in memory, within the
//! inbox's bytes, and taken when there is room; what does not fit in the
//! inbox is not even forwarded, and once there is room again the connection
//! is rebuilt so the broker redelivers it (MQTT 3.1.1 §4.4: unacknowledged
//! messages are resent when the session resumes, not before). With
//! `mqtt.clean_session = true` the broker forgets those instead.

pub use super::inbox::{inbox_limit, Inbox, InboxMeter};
pub use super::message::{CmdMsg, Lane};

use super::admission::{self, Budgets, Tier};
use super::backlog::Backlog;
use super::builtin;
use super::hold::HeldBack;
use super::lanes::{self, Job, LaneState, Pending, Route};
use super::quiet::{ErrorLog, Quiet};
use super::records::Records;
use super::recovery;
use super::results::{self, Finished, Results};
use super::retention::{AgentClock, Policy};
use super::signed::Signer;
use super::store::{self, cstate, Admit, Answered, Claim, EventCtx, Receipt};
use super::timefloor::{Mark, TimeFloor};
use super::{parse, Command, CommandsConfig, ExecHandler, ParseError};
use crate::event::envelope::{wall_clock_ms, EventIdGen, Format};
use crate::intake::ControlSender;
use crate::mqtt::{DeliveryMsg, Link};
use crate::spool::Spool;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod receive;

/// While commands are held back, room is looked for this often.
const HOLD_POLL: Duration = Duration::from_millis(500);
/// While a result waits to be committed again, it is retried this often.
const UNSAVED_POLL: Duration = Duration::from_millis(200);
/// Before the connection is rebuilt for a redelivery, no acknowledgement
/// has been handed to the MQTT thread for this long (they leave first).
const ACK_FLUSH: Duration = Duration::from_millis(500);
/// Parked commands looked at per turn of the loop (keeps it responsive).
const PARKED_PER_TURN: usize = 256;
/// Messages dropped unanswered are added to the spool's count at most this
/// often.
const UNANSWERED_COUNT_EVERY: Duration = Duration::from_secs(10);

/// Whether `cmd`, routed to `route`, is to run if it is new: not an unknown
/// name, not a built-in without a side effect (answered at receipt, its
/// record droppable), not refused for want of a signature.
fn runs(route: Route, cmd: &Command, unsigned: bool) -> bool {
    route != Route::Unknown && !admission::side_effect_free(&cmd.name) && !unsigned
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

/// Run the command thread until `stop`, aging records on `clock` (read
/// from the spool by [`store::clock_ms`]; an error disables commands: no
/// record age could be judged).
#[allow(clippy::too_many_arguments)] // the thread's wiring, built once by the agent
pub fn run(
    mut spool: Spool,
    clock: Result<AgentClock, crate::spool::SpoolError>,
    cfg: WorkerConfig,
    link: Link,
    inbox: Arc<InboxMeter>,
    rx: Receiver<CmdMsg>,
    self_tx: Sender<CmdMsg>,
    ctl: ControlSender,
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
    let clock = match clock {
        Ok(clock) => clock,
        Err(e) => {
            // Without it no record age can be judged: purging could delete a
            // record inside the redelivery window.
            log::error!("commands: cannot read the command clock: {e}; commands disabled");
            return;
        }
    };
    let start = |lane| LaneState::start(lane, self_tx.clone(), ctl.clone());
    let (Some(exec), Some(agent)) = (start(Lane::Exec), start(Lane::Agent)) else {
        return;
    };
    let floor = match store::time_floor(&spool) {
        Ok(floor) => floor,
        Err(e) => {
            // Without it a replayed signed command could run again while the
            // clock is untrusted (I4).
            log::error!("commands: cannot read the time floor: {e}; commands disabled");
            return;
        }
    };
    let mut w = Worker::new(cfg, link, inbox, [exec, agent], clock, to_delivery);
    w.floor = floor;
    w.recover(&mut spool, &mut ids);
    w.purge(&mut spool);
    while !stop.load(Ordering::Relaxed) {
        // Everything waiting is sorted by tier first (bounded by the
        // inbox's bytes), then the highest tier's oldest is handled.
        let mut took = false;
        while let Ok(msg) = rx.try_recv() {
            w.take(msg, &mut spool, &mut ids);
            took = true;
        }
        if let Some((tier, epoch, publish)) = w.backlog.pop() {
            w.incoming(epoch, publish, tier, &mut spool, &mut ids);
            w.turn(&mut spool, &mut ids);
            continue;
        }
        if took {
            // A lane's `Done` taken above freed its lane: start what waits
            // now, not at the next wake (up to a purge interval away).
            w.turn(&mut spool, &mut ids);
            continue;
        }
        // Event-driven: wake for a message, a result to retry, room for held
        // commands, or the purge.
        let wait = if w.results.any_unsaved() {
            UNSAVED_POLL
        } else if w.held.holding() {
            HOLD_POLL
        } else if w.unanswered.0 > 0 {
            UNANSWERED_COUNT_EVERY.min(w.records.until_purge())
        } else {
            w.records.until_purge()
        };
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok(msg) => w.take(msg, &mut spool, &mut ids),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        w.turn(&mut spool, &mut ids);
    }
    w.records.persist_clock(&mut spool, &mut w.errors);
    w.unanswered.1 = None;
    w.count_unanswered(&mut spool);
    // The lane threads end when their job channels close.
    drop(w);
}

/// How a parsed command is received: its time to live and deadline, and
/// what it gets if it is new.
struct Admission {
    route: Route,
    /// The command's own TTL, or the default for exec handlers.
    ttl: Option<Duration>,
    /// Unix ms, on a trusted wall clock only.
    deadline_wall: Option<i64>,
    /// `issued_at_ms` plus the TTL, whatever the clock ([`Pending`]).
    deadline_issued: Option<i64>,
    /// The rate limiter's time at receipt (since the thread started).
    rate_now: Duration,
    /// Its share of the bounds.
    tier: Tier,
    verdict: Verdict,
}

/// What a new command gets; the owned form of [`Admit`].
enum Verdict {
    Accept,
    /// Recorded `rejected` with this error.
    Reject(String),
    /// Recorded `rejected` with this error (`unsigned: ...`): a side effect
    /// no operator key signed.
    Unsigned(String),
    /// Answered `rejected` with this error, not recorded (rate limit).
    Refuse(String),
    /// Answered `no_room` with this error, not recorded.
    NoRoom(String),
    /// A built-in without a side effect, answered at receipt: recorded
    /// finished with this answer.
    Answer(Answered),
}

impl Verdict {
    fn admit(&self) -> Admit<'_> {
        match self {
            Verdict::Accept => Admit::Accept,
            Verdict::Reject(why) => Admit::Reject(why),
            Verdict::Unsigned(why) => Admit::Unsigned(why),
            Verdict::Refuse(why) => Admit::Refuse(why),
            Verdict::NoRoom(why) => Admit::NoRoom(why),
            Verdict::Answer(a) => Admit::Answer(a),
        }
    }
}

struct Worker {
    cfg: WorkerConfig,
    link: Link,
    /// Local built-ins waiting (only at start, or within one loop turn).
    local: VecDeque<Pending>,
    /// Indexed by [`Lane::index`].
    lanes: [LaneState; 2],
    inbox: Arc<InboxMeter>,
    /// Messages taken from the channel, not yet handled, by tier.
    backlog: Backlog,
    held: HeldBack,
    results: Results,
    to_delivery: Sender<DeliveryMsg>,
    errors: ErrorLog,
    records: Records,
    /// A time the board knows has passed, raised by the operator's
    /// commands as their receipts commit.
    floor: TimeFloor,
    /// Origin of the rate limiter's time.
    started: Instant,
    budgets: Budgets,
    /// After a failed spool write: when to try again, and the delay that
    /// doubles on each failure in a row.
    write_retry: Option<(Instant, Duration)>,
    /// When a PUBLISH was last acknowledged (handed to the MQTT thread).
    last_ack: Option<Instant>,
    /// Messages dropped unanswered, not yet counted in the spool, and when
    /// they were last counted ([`Worker::count_unanswered`]).
    unanswered: (u64, Option<Instant>),
    unanswered_log: Quiet,
    malformed_log: Quiet,
    refused_log: Quiet,
    no_room_log: Quiet,
    rejected_log: Quiet,
}

impl Worker {
    fn new(
        cfg: WorkerConfig,
        link: Link,
        inbox: Arc<InboxMeter>,
        lanes: [LaneState; 2],
        clock: AgentClock,
        to_delivery: Sender<DeliveryMsg>,
    ) -> Worker {
        let policy = Policy {
            window: cfg.commands.record_retention,
            max_records: cfg.commands.max_records,
        };
        let results = Results::new(cfg.device_id.clone(), cfg.format, to_delivery.clone());
        let budgets = Budgets::new(
            cfg.commands.max_per_minute_per_scope,
            cfg.commands.max_per_minute,
            cfg.commands.max_answers_per_minute,
        );
        Worker {
            cfg,
            link,
            local: VecDeque::new(),
            lanes,
            inbox,
            backlog: Backlog::default(),
            held: HeldBack::default(),
            results,
            to_delivery,
            errors: ErrorLog::default(),
            records: Records::new(clock, policy),
            floor: TimeFloor::default(),
            started: Instant::now(),
            budgets,
            write_retry: None,
            last_ack: None,
            unanswered: (0, None),
            unanswered_log: Quiet::default(),
            malformed_log: Quiet::default(),
            refused_log: Quiet::default(),
            no_room_log: Quiet::default(),
            rejected_log: Quiet::default(),
        }
    }

    /// One turn of the loop after a message (or none): results kept in
    /// memory, commands waiting, parked ones, the end of a hold, the purge.
    fn turn(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        self.count_unanswered(spool);
        self.results.retry(spool, ids, &mut self.errors);
        self.dispatch(spool, ids);
        self.unpark(spool, ids);
        self.dispatch(spool, ids);
        self.release_if_room(spool);
        if self.records.purge_due() {
            self.purge(spool);
        }
    }

    fn ctx<'a>(&'a self, ids: &'a mut EventIdGen) -> EventCtx<'a> {
        EventCtx {
            ids,
            device_id: &self.cfg.device_id,
            format: self.cfg.format,
        }
    }

    fn route(&self, name: &str) -> Route {
        lanes::route(name, &self.cfg.commands.handlers)
    }

    fn handler(&self, name: &str) -> Option<&ExecHandler> {
        lanes::handler(name, &self.cfg.commands.handlers)
    }

    /// Queue `p` where it runs: in a lane, behind the commands of its tier
    /// and higher ones, ahead of lower ones.
    fn enqueue(&mut self, p: Pending) {
        match self.route(&p.name) {
            Route::Lane(l) => {
                let queue = &mut self.lanes[l.index()].queue;
                let at = queue
                    .iter()
                    .position(|q| q.tier < p.tier)
                    .unwrap_or(queue.len());
                queue.insert(at, p);
            }
            // Unknown names (a handler removed from the config since) are
            // rejected where local built-ins run.
            Route::Local | Route::Unknown => self.local.push_back(p),
        }
    }

    fn finish(&mut self, spool: &mut Spool, ids: &mut EventIdGen, f: Finished) {
        self.results.finish(spool, ids, &mut self.errors, f);
    }

    /// At start: the commands the last run left unfinished are ended or
    /// queued again ([`recovery::recover`]).
    fn recover(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        let handlers = &self.cfg.commands.handlers;
        let queue = recovery::recover(spool, ids, &mut self.results, &mut self.errors, handlers);
        for p in queue {
            self.enqueue(p);
        }
    }

    fn purge(&mut self, spool: &mut Spool) {
        self.records.purge(spool, &mut self.errors);
    }

    fn records_full(&mut self, tier: Tier, spool: &mut Spool) -> bool {
        self.records.full(tier, spool, &mut self.errors)
    }

    /// Why there is no room for a record of `tier`.
    fn records_full_why(&self, tier: Tier) -> String {
        format!(
            "{} command records, the {} of commands.max_records ({}) that {} commands may fill, \
             and none may be deleted yet: the commands ran within the redelivery window \
             (commands.record_retention_secs)",
            self.records.count(),
            self.records.cap(tier),
            self.cfg.commands.max_records,
            tier.name()
        )
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

    /// Why a new command of `tier` for `route` has no room in its lane, if
    /// it has none.
    fn lane_refusal(&self, route: Route, tier: Tier) -> Option<String> {
        let Route::Lane(l) = route else {
            return None;
        };
        let max_queued = self.cfg.commands.max_queued;
        let cap = tier.cap(max_queued);
        let waiting = self.lanes[l.index()].queue.len();
        (waiting >= cap).then(|| {
            format!(
                "the {} queue is full for {} commands ({waiting} waiting, {cap} of \
                 commands.max_queued {max_queued})",
                l.name(),
                tier.name()
            )
        })
    }

    /// Why a command of `tier` for `route` is held back now, if it is: its
    /// lane full, no room among the records (operator commands and pushes
    /// only: other commands are answered `no_room`), or the spool refusing
    /// writes.
    fn hold_reason(&mut self, route: Route, tier: Tier, spool: &mut Spool) -> Option<String> {
        if tier != Tier::Other && self.records_full(tier, spool) {
            return Some(self.records_full_why(tier));
        }
        self.lane_refusal(route, tier)
            .or_else(|| self.write_refusal())
    }

    /// Take parked commands that fit now, oldest first; drop those of an
    /// earlier connection (they cannot be acknowledged there; the broker
    /// resent them on the new one).
    fn unpark(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        if let Some((epoch, n)) = self.inbox.take_dropped() {
            let limit = self.inbox.limit();
            self.held.dropped(epoch, n, || {
                format!("the command inbox is full ({limit} bytes of commands not yet taken)")
            });
        }
        let current = self.link.epoch();
        let mut i = 0;
        let mut looked = 0;
        while i < self.held.parked.len() && looked < PARKED_PER_TURN {
            looked += 1;
            let p = &self.held.parked[i];
            if p.epoch != current {
                if let Some(p) = self.held.parked.remove(i) {
                    self.inbox.release(&p.publish);
                }
                continue;
            }
            let fits = match p.route {
                Some(route) => self.hold_reason(route, p.tier, spool).is_none(),
                None => self.write_refusal().is_none(),
            };
            if !fits {
                i += 1;
                continue;
            }
            if let Some(p) = self.held.parked.remove(i) {
                // Parked again (at the back) if things changed meanwhile.
                self.incoming(p.epoch, p.publish, p.tier, spool, ids);
            }
        }
    }

    /// With nothing parked or in the backlog and the inbox at most half
    /// full, end the episode of held-back commands; if the inbox dropped
    /// some, rebuild the connection so the broker redelivers them, once the
    /// inbox is empty: the broker sends again everything not acknowledged,
    /// so a command still on its way through would be answered twice.
    fn release_if_room(&mut self, spool: &mut Spool) {
        if !self.held.holding() {
            return;
        }
        let most = if self.held.redelivers() {
            0
        } else {
            self.inbox.limit() / 2
        };
        if !self.held.parked.is_empty() || !self.backlog.is_empty() || self.inbox.held() > most {
            return;
        }
        // The acknowledgements handed to the MQTT thread must leave on the
        // connection before it is rebuilt, or those commands come back too.
        if self.held.redelivers() && self.last_ack.is_some_and(|t| t.elapsed() < ACK_FLUSH) {
            return;
        }
        if let Some(why) = self.no_room(spool) {
            log::trace!("commands: still holding back new commands: {why}");
            return;
        }
        let Some(h) = self.held.end() else {
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
        let held_back = h.ended(how);
        if let Err(e) = spool.count("commands_held_back", held_back as i64) {
            self.errors.log("counting held-back commands", &e);
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
        if self.records_full(Tier::Push, spool) {
            return Some(format!("{} command records", self.records.count()));
        }
        self.write_refusal()
    }

    /// A message from the channel: a PUBLISH waits in the backlog by tier,
    /// the rest is handled now.
    fn take(&mut self, msg: CmdMsg, spool: &mut Spool, ids: &mut EventIdGen) {
        match msg {
            CmdMsg::Incoming {
                epoch,
                publish,
                tier,
            } => self.backlog.push(tier, epoch, publish),
            other => self.handle(other, spool, ids),
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
        if let Some(why) = p.expired(&self.floor, self.records.now_ms()) {
            log::info!("command {}/{} ({}) {why}", p.scope, p.command_id, p.name);
            let f = Finished::not_run(p.scope, p.command_id, p.name, cstate::EXPIRED, &why);
            self.finish(spool, ids, f);
            return true;
        }
        let kind = builtin::kind(&p.name);
        let exec = self.handler(&p.name).cloned();
        if kind.is_none() && exec.is_none() {
            let why = lanes::unknown_command(&p.name, &self.cfg.commands.handlers);
            let f = Finished::not_run(p.scope, p.command_id, p.name, cstate::REJECTED, &why);
            self.finish(spool, ids, f);
            return true;
        }
        match spool.start_command(&p.scope, &p.command_id) {
            Ok(true) => {}
            Ok(false) => return true, // already finished by someone else
            Err(e) => {
                self.errors.log("marking a command running", &e);
                match lane {
                    Some(l) => self.lanes[l.index()].queue.push_front(p),
                    None => self.local.push_front(p),
                }
                return false;
            }
        }
        let Some(lane) = lane else {
            self.run_here(p, spool, ids);
            return true;
        };
        let retry_safe = lanes::retry_safe(&p.name, &self.cfg.commands.handlers);
        let job = match exec {
            Some(h) => Job::Exec(Box::new(h)),
            None => Job::Agent,
        };
        self.lanes[lane.index()].send(p, job, retry_safe)
    }

    /// Run the local built-in `p` on this thread, now (its `running` has
    /// committed), and end it.
    fn run_here(&mut self, p: Pending, spool: &mut Spool, ids: &mut EventIdGen) {
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
        let f = Finished::ran(p.scope, p.command_id, p.name, outcome, t.elapsed(), true);
        self.finish(spool, ids, f);
    }
}
