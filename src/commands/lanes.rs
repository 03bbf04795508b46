//! Where a command runs, and the lanes that run the long ones: a command
//! name's [`Route`], the [`Pending`] commands waiting for their turn, and
//! each lane's thread.
//!
//! Its one rule: **a lane's thread runs one job at a time and is handed a
//! job only after the command's `running` state has committed** (the
//! worker's `start` commits it, then calls [`LaneState::send`]); every job
//! it ran comes back as a [`CmdMsg::Done`], and only then is the lane idle.

use super::admission::Tier;
use super::builtin::{self, Kind};
use super::exec_handler;
use super::message::{CmdMsg, Lane};
use super::timefloor::TimeFloor;
use super::ExecHandler;
use crate::event::envelope::wall_clock_ms;
use crate::intake::ControlSender;
use serde_json::{Map, Value};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

/// Where a command name runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// On the command thread, at once.
    Local,
    /// On a lane.
    Lane(Lane),
    /// No such command.
    Unknown,
}

/// Where `name` runs, with the exec handlers `handlers` declared.
pub(super) fn route(name: &str, handlers: &[ExecHandler]) -> Route {
    match builtin::kind(name) {
        Some(Kind::Local) => Route::Local,
        Some(Kind::Agent) => Route::Lane(Lane::Agent),
        None if handler(name, handlers).is_some() => Route::Lane(Lane::Exec),
        None => Route::Unknown,
    }
}

/// The exec handler named `name`, if one is declared.
pub(super) fn handler<'a>(name: &str, handlers: &'a [ExecHandler]) -> Option<&'a ExecHandler> {
    handlers.iter().find(|h| h.name == name)
}

/// Whether `name` may be run again after an interruption: every built-in
/// may; an exec handler only if declared `retry_safe` (an unknown name may
/// not).
pub(super) fn retry_safe(name: &str, handlers: &[ExecHandler]) -> bool {
    if builtin::kind(name).is_some() {
        return true;
    }
    handler(name, handlers).is_some_and(|h| h.retry_safe)
}

/// The error answered for a command no built-in or handler is named
/// after, listing the names known.
pub(super) fn unknown_command(name: &str, handlers: &[ExecHandler]) -> String {
    let mut known: Vec<&str> = super::BUILTINS.to_vec();
    known.extend(handlers.iter().map(|h| h.name.as_str()));
    format!("unknown command {name:?} (known: {})", known.join(", "))
}

/// A claimed command waiting for its turn.
pub(super) struct Pending {
    pub(super) scope: String,
    pub(super) command_id: String,
    pub(super) name: String,
    pub(super) args: Map<String, Value>,
    /// Deadline on the wall clock (trusted clock only).
    pub(super) deadline_wall: Option<i64>,
    /// `issued_at_ms` plus its TTL, whatever the clock at receipt: judged
    /// against the [`TimeFloor`] while the wall clock is untrusted.
    pub(super) deadline_issued: Option<i64>,
    /// Deadline on the monotonic clock (from receipt in this process).
    pub(super) deadline_mono: Option<Instant>,
    /// The deadline cannot be judged (received before a restart on an untrusted clock).
    pub(super) age_unknown: bool,
    /// Its share of the bounds and its place in a lane's queue.
    pub(super) tier: Tier,
}

impl Pending {
    /// Why the command may no longer start, if so: its signed deadline
    /// against the time `floor` knows has passed at agent clock `clock_ms`
    /// (whatever the wall clock says), then a trusted wall clock against
    /// the issue time, else the monotonic time since receipt.
    pub(super) fn expired(&self, floor: &TimeFloor, clock_ms: i64) -> Option<String> {
        const PAST_TTL: &str = "expired: past its ttl_secs (or commands.default_ttl_secs); not run";
        if self.age_unknown {
            return Some(
                "expired: its age cannot be judged (received before a restart, clock not trusted)"
                    .to_owned(),
            );
        }
        // The floor is a time that has passed whatever the wall clock
        // says: judged first, so a clock past 2026 yet behind (restored by
        // fake-hwclock or a slow RTC, not vouched for by time sync) cannot
        // let a replayed command run that the floor knows is expired.
        if let Some(why) = self
            .deadline_issued
            .and_then(|d| floor.expired(d, clock_ms))
        {
            return Some(why);
        }
        let (now_ms, trusted) = wall_clock_ms();
        if trusted {
            if self.deadline_wall.is_some_and(|d| now_ms > d) {
                return Some(PAST_TTL.to_owned());
            }
            if self.deadline_wall.is_some() {
                return None;
            }
        }
        self.deadline_mono
            .is_some_and(|d| Instant::now() > d)
            .then(|| PAST_TTL.to_owned())
    }
}

/// What a lane's thread runs.
pub(super) enum Job {
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

/// One lane as the command thread sees it.
pub(super) struct LaneState {
    lane: Lane,
    /// Claimed commands waiting, oldest first (at most `commands.max_queued`).
    pub(super) queue: VecDeque<Pending>,
    /// A job was sent and its `Done` has not arrived.
    pub(super) busy: bool,
    tx: Sender<LaneJob>,
}

impl LaneState {
    /// Start `lane`'s thread; it reports finished jobs on `done` and asks
    /// the agent through `ctl`. `None` (logged) when the OS refuses a thread.
    pub(super) fn start(lane: Lane, done: Sender<CmdMsg>, ctl: ControlSender) -> Option<LaneState> {
        let (tx, rx) = std::sync::mpsc::channel::<LaneJob>();
        let name = match lane {
            Lane::Exec => "cmd-exec",
            Lane::Agent => "cmd-agent",
        };
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || lane_thread(lane, rx, done, ctl))
        {
            Ok(_) => Some(LaneState {
                lane,
                queue: VecDeque::new(),
                busy: false,
                tx,
            }),
            Err(e) => {
                log::error!("commands: cannot start the {name} thread: {e}; commands disabled");
                None
            }
        }
    }

    /// Hand `p` to the lane's thread as `job` and mark the lane busy. False
    /// (logged) when the thread is gone.
    pub(super) fn send(&mut self, p: Pending, job: Job, retry_safe: bool) -> bool {
        let job = LaneJob {
            scope: p.scope,
            command_id: p.command_id,
            name: p.name,
            args: p.args,
            job,
            retry_safe,
        };
        if self.tx.send(job).is_err() {
            log::error!("commands: the {} thread is gone", self.lane.name());
            return false;
        }
        self.busy = true;
        true
    }
}

/// A lane's thread: runs its jobs one at a time; ends when the command
/// thread drops its side of the job channel.
fn lane_thread(lane: Lane, rx: Receiver<LaneJob>, done: Sender<CmdMsg>, ctl: ControlSender) {
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
