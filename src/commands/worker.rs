//! The command thread: receipt, deduplication, dispatch, results.
//!
//! Its one rule: **the PUBLISH of a command is acknowledged only after its
//! receipt (or its rejection) has committed**, and only on the connection it
//! arrived on; a handler starts only after `running` has committed, so a
//! crash mid-run is seen as `interrupted` at the next start, never silently
//! re-run (field case F14).
//!
//! Long handlers (exec programs, requests to the main thread) run on an
//! executor thread, one at a time, so a duplicate arriving meanwhile is
//! answered `in_progress` at once.

use super::builtin::{self, Control, Kind};
use super::exec_handler::{self, HandlerOutcome};
use super::store::{cstate, Claim, EventCtx, Reply, ResultEvent};
use super::{parse, Command};
use crate::config::{CommandsConfig, ExecHandler};
use crate::envelope::{wall_clock_ms, EventIdGen, Format};
use crate::mqtt::{DeliveryMsg, Link};
use crate::spool::{Spool, SpoolError};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// The executor finished a job.
    Done {
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

struct ExecJob {
    scope: String,
    command_id: String,
    name: String,
    args: Map<String, Value>,
    job: Job,
    retry_safe: bool,
}

/// Run the command thread until `stop`.
#[allow(clippy::too_many_arguments)] // the thread's wiring, built once by the agent
pub fn run(
    mut spool: Spool,
    cfg: WorkerConfig,
    link: Link,
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
    let (job_tx, job_rx) = std::sync::mpsc::channel::<ExecJob>();
    let executor = {
        let (done, ctl) = (self_tx, ctl);
        std::thread::Builder::new()
            .name("executor".into())
            .spawn(move || executor(job_rx, done, ctl))
    };
    if let Err(e) = &executor {
        log::error!("commands: cannot start executor thread: {e}; commands disabled");
        return;
    }
    let mut w = Worker {
        cfg,
        link,
        queue: VecDeque::new(),
        busy: false,
        job_tx,
        unsaved: Vec::new(),
        to_delivery,
        last_error_log: None,
    };
    w.recover(&mut spool, &mut ids);
    let mut last_purge = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // Event-driven: wake for a message, a result to retry, or the purge.
        let wait = if w.unsaved.is_empty() {
            Duration::from_secs(60).saturating_sub(last_purge.elapsed())
        } else {
            Duration::from_millis(200)
        };
        match rx.recv_timeout(wait.max(Duration::from_millis(1))) {
            Ok(msg) => w.handle(msg, &mut spool, &mut ids),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        w.retry_unsaved(&mut spool, &mut ids);
        w.dispatch(&mut spool, &mut ids);
        if last_purge.elapsed() > Duration::from_secs(60) {
            last_purge = Instant::now();
            let cutoff = wall_clock_ms().0 - w.cfg.commands.record_retention.as_millis() as i64;
            match spool.purge_commands(cutoff, 1000) {
                Ok(n) if n > 0 => log::debug!("commands: purged {n} old records"),
                Ok(_) => {}
                Err(e) => log::warn!("commands: purge failed: {e}"),
            }
        }
    }
    // The executor ends when its job channel closes.
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
    queue: VecDeque<Pending>,
    busy: bool,
    job_tx: Sender<ExecJob>,
    /// Finished commands whose result could not be committed yet (disk full, busy).
    unsaved: Vec<Unsaved>,
    to_delivery: Sender<DeliveryMsg>,
    last_error_log: Option<Instant>,
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
        let (now, trusted) = wall_clock_ms();
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
            self.queue.push_back(Pending {
                scope: u.scope,
                command_id: u.command_id,
                name: u.name,
                args,
                deadline_wall,
                deadline_mono: None,
                age_unknown: u.ttl_ms.is_some() && deadline_wall.is_none(),
            });
            let _ = now;
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
                scope,
                command_id,
                name,
                outcome,
                duration,
                retry_safe,
            } => {
                self.busy = false;
                let (state, result) = match outcome {
                    HandlerOutcome::Completed(v) => (cstate::COMPLETED, v.to_string()),
                    HandlerOutcome::Failed(v) => (cstate::FAILED, v.to_string()),
                    HandlerOutcome::Rejected(e) => {
                        (cstate::REJECTED, json!({"error": e}).to_string())
                    }
                };
                self.finish(
                    spool,
                    ids,
                    &scope,
                    &command_id,
                    &name,
                    state,
                    result,
                    Some(duration.as_millis() as i64),
                    Some(retry_safe),
                );
            }
        }
    }

    fn incoming(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        spool: &mut Spool,
        ids: &mut EventIdGen,
    ) {
        let cmd: Command = match parse(&publish.payload, self.cfg.commands.max_payload_bytes) {
            Ok(c) => c,
            Err(e) => {
                log::warn!("commands: rejected message on {}: {e}", publish.topic);
                let mut ctx = self.ctx(ids);
                let res = spool.reject_unparsed(e.command_id(), &e.to_string(), &mut ctx);
                match res {
                    Ok(()) => self.link.ack(epoch, &publish),
                    Err(err) => self.log_error("recording a rejected command", &err),
                }
                return;
            }
        };
        let (now, trusted) = wall_clock_ms();
        let deadline_wall = cmd
            .ttl
            .filter(|_| trusted)
            .map(|t| cmd.issued_at_ms.unwrap_or(now) + t.as_millis() as i64);
        let mut ctx = self.ctx(ids);
        let claim = spool.claim_command(&cmd, publish.retain, deadline_wall, &mut ctx);
        match claim {
            Ok(claim) => {
                // Only now, with the receipt committed, may the broker forget it.
                self.link.ack(epoch, &publish);
                match claim {
                    Claim::New => {
                        log::info!("command {}/{} ({}) received", cmd.scope, cmd.command_id, cmd.name);
                        self.queue.push_back(Pending {
                            scope: cmd.scope,
                            command_id: cmd.command_id,
                            name: cmd.name,
                            args: cmd.args,
                            deadline_wall,
                            deadline_mono: cmd.ttl.map(|t| Instant::now() + t),
                            age_unknown: false,
                        });
                    }
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
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
            }
            // Not acknowledged: the broker redelivers it on the next session.
            Err(e) => self.log_error(
                "claiming a command receipt (not acknowledged; will be redelivered)",
                &e,
            ),
        }
    }

    /// Start the next queued command if nothing runs.
    fn dispatch(&mut self, spool: &mut Spool, ids: &mut EventIdGen) {
        while !self.busy {
            let Some(p) = self.queue.pop_front() else {
                return;
            };
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
                    "expired: past its ttl_secs; not run"
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
                continue;
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
                continue;
            }
            match spool.start_command(&p.scope, &p.command_id) {
                Ok(true) => {}
                Ok(false) => continue, // already finished by someone else
                Err(e) => {
                    self.log_error("marking a command running", &e);
                    self.queue.push_front(p);
                    return;
                }
            }
            if kind == Some(Kind::Local) {
                let t = Instant::now();
                let outcome = builtin::run_local(&p.name, &p.args, spool);
                if p.name == "requeue-failed" {
                    // Requeued rows lie behind the delivery cursor.
                    let _ = self.to_delivery.send(DeliveryMsg::Rescan);
                }
                self.handle(
                    CmdMsg::Done {
                        scope: p.scope,
                        command_id: p.command_id,
                        name: p.name,
                        outcome,
                        duration: t.elapsed(),
                        retry_safe: true,
                    },
                    spool,
                    ids,
                );
                continue;
            }
            let retry_safe = self.retry_safe(&p.name);
            let job = ExecJob {
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
            if self.job_tx.send(job).is_err() {
                log::error!("commands: executor thread is gone");
                return;
            }
            self.busy = true;
        }
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
        match spool.finish_command(&ev, &mut ctx) {
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

fn executor(rx: Receiver<ExecJob>, done: Sender<CmdMsg>, ctl: Sender<Control>) {
    while let Ok(j) = rx.recv() {
        let t = Instant::now();
        let outcome = match &j.job {
            Job::Exec(h) => exec_handler::run(h, &j.args),
            Job::Agent => builtin::run_agent(&j.name, &j.args, &ctl),
        };
        let msg = CmdMsg::Done {
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
