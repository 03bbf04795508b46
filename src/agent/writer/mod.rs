//! The writer thread (the agent's calling thread): every reading of every
//! producer committed into the spool, the storage upkeep driven, health and
//! the summary recorded, the command thread's control requests answered.
//! Its loop sleeps until a message or the nearest deadline, never on a
//! polling timer.
//!
//! One owner per concern, each in its own file: the readings waiting for a
//! commit ([`buffer`]), the spool connections and the commits
//! ([`commit`]), the groups of `full` readings ([`group`]), the deadlines
//! that decide when to commit, to run upkeep and to summarise
//! ([`schedule`]), the config in force and its pushes ([`control`]), health
//! ([`health_record`]), metrics ([`figures`]), the outage budget
//! ([`outage`]), local input's shares of the spool ([`shares`]), the
//! summary line ([`summary`]), what rides the commits (counters, delivery
//! records, agent state: [`riding`]), the clock anchor once time sync
//! vouches for the wall clock ([`clock`]). The storage upkeep is
//! [`crate::flash::upkeep::Upkeep`]'s.
//!
//! Its one rule: **a reading is reported stored only after the transaction
//! holding it committed**, and on a stop every reading already taken is
//! committed before exit (field case F12).

mod buffer;
mod clock;
mod commit;
mod control;
mod figures;
mod group;
mod health_record;
mod outage;
mod riding;
mod schedule;
mod shares;
mod summary;

pub(super) use control::config_identity;

use super::{AgentError, ConfigSource};
use crate::config::Config;
use crate::delivery::DeliveryStats;
use crate::event::envelope::{wall_clock_ms, EventIdGen};
use crate::event::reading::FieldValue;
use crate::event::stream::{Durability, AGENT_STREAM};
use crate::flash::upkeep::{Fatal, Load, Pass, Upkeep};
use crate::intake::IngestMsg;
use crate::mqtt::{self, DeliveryMsg};
use crate::source::sampler::SamplerUpdate;
use crate::spool::{CheckpointMode, NewEvent, Spool};
use buffer::MAX_BUFFERED;
use schedule::Deadlines;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What [`Writer::new`] is built from.
pub(super) struct Parts {
    pub(super) cfg: Config,
    pub(super) source: ConfigSource,
    pub(super) push: Option<crate::push::Stored>,
    /// The writer's connection (the config's `synchronous`).
    pub(super) spool: Spool,
    /// The connection with `synchronous = FULL`, sharing its sequences.
    pub(super) full_spool: Spool,
    pub(super) run_id: i64,
    pub(super) upkeep: Upkeep,
    pub(super) link: mqtt::Link,
    pub(super) to_delivery: Sender<DeliveryMsg>,
    pub(super) delivery_stats: Arc<DeliveryStats>,
    /// Delivery records, which ride the writer's commits.
    pub(super) ledger: crate::delivery::ledger::Ledger,
    /// The command records' clock, persisted with the agent state (none:
    /// commands are off).
    pub(super) commands_clock: Option<crate::commands::retention::AgentClock>,
    pub(super) sampler: Sender<SamplerUpdate>,
    pub(super) socket_counts: Option<Arc<crate::ingest::Counters>>,
    pub(super) tuning: Option<crate::flash::probe::Profile>,
    /// What opening the spool found lost ([`crate::spool::integrity::Opened::lost`]).
    pub(super) spool_lost: Option<String>,
}

/// The threads the writer talks to.
struct Peers {
    /// The MQTT connection's handle: health facts, retained status, reconfigure.
    link: mqtt::Link,
    /// The sampler: interval and source changes.
    sampler: Sender<SamplerUpdate>,
    /// The delivery thread: new rows to read.
    to_delivery: Sender<DeliveryMsg>,
    /// Delivery's counters (rows FAILED, receipts), for health and metrics.
    delivery_stats: Arc<DeliveryStats>,
    /// Delivery records waiting to ride a commit.
    ledger: crate::delivery::ledger::Ledger,
    /// The command records' clock, persisted with the agent state.
    commands_clock: Option<crate::commands::retention::AgentClock>,
    /// The ingest socket's counters, moved into the spool's at each summary.
    socket_counts: Option<Arc<crate::ingest::Counters>>,
    /// Local input's shares of the spool (the socket's peers, the bridges).
    shares: Option<Arc<crate::intake::share::Shares>>,
}

/// This run: its record in the spool, systemd, and how it ends.
struct RunRecord {
    /// This run's record in the spool (`runs`).
    id: i64,
    /// systemd's notification socket (READY, STATUS, STOPPING, WATCHDOG).
    notifier: crate::os::notify::Notifier,
    /// Stamped each time the loop goes round, for the watchdog.
    heartbeat: crate::os::notify::Heartbeat,
    /// Readings the stop could not commit.
    lost: usize,
    /// Why the loop stopped on its own (the upkeep's finding).
    fatal: Option<Fatal>,
}

/// The writer thread's state: one owner per concern ([`self`]).
pub(super) struct Writer {
    conf: control::Conf,
    buffer: buffer::Buffer,
    store: commit::Store,
    upkeep: Upkeep,
    health: health_record::HealthRecord,
    metrics: figures::MetricsState,
    outage: outage::OutageState,
    /// What rides the next commit.
    riding: riding::Riding,
    /// The stop's last commits: every rider rides, the sequence book too.
    final_ride: bool,
    peers: Peers,
    run: RunRecord,
    clock: clock::ClockWatch,
}

impl Writer {
    pub(super) fn new(p: Parts) -> Result<Writer, AgentError> {
        let ids = EventIdGen::new()
            .map_err(|e| AgentError::Setup(format!("OS random source failed: {e}")))?;
        let backoff = super::startup::storage_backoff(p.tuning.as_ref());
        let mut health = health_record::HealthRecord::new(wall_clock_ms().0);
        health.spool_lost = p.spool_lost;
        Ok(Writer {
            buffer: buffer::Buffer::new(p.cfg.ingest.max_buffered_bytes),
            store: commit::Store::new(p.spool, p.full_spool, ids, backoff),
            conf: control::Conf::new(p.cfg, p.source, p.push, p.tuning.map(|t| t.derived)),
            upkeep: p.upkeep,
            health,
            metrics: Default::default(),
            outage: Default::default(),
            riding: Default::default(),
            final_ride: false,
            peers: Peers {
                link: p.link,
                sampler: p.sampler,
                to_delivery: p.to_delivery,
                delivery_stats: p.delivery_stats,
                ledger: p.ledger,
                commands_clock: p.commands_clock,
                socket_counts: p.socket_counts,
                shares: None,
            },
            run: RunRecord {
                id: p.run_id,
                notifier: crate::os::notify::Notifier::from_env(),
                heartbeat: crate::os::notify::Heartbeat::default(),
                lost: 0,
                fatal: None,
            },
            clock: clock::ClockWatch::new(),
        })
    }

    /// The config file was invalid at start and the last-known-good copy
    /// runs: an ERROR and an `_agent` event say so.
    pub(super) fn report_fallback(&mut self) {
        if let Some(msg) = self.conf.source.fallback.clone() {
            log::error!("{msg}");
            self.agent_event("config_invalid", &msg);
        }
    }

    /// The spool is open and every thread runs: tell systemd (Type=notify),
    /// and watch this loop's heartbeat and delivery's.
    pub(super) fn ready(&self, delivery: crate::os::notify::Heartbeat) {
        self.run.notifier.ready();
        self.run.notifier.start_watchdog(vec![
            ("ingest", self.run.heartbeat.clone()),
            ("delivery", delivery),
        ]);
    }

    /// Tell systemd the stop has begun.
    pub(super) fn stopping(&self) {
        self.run.notifier.stopping();
    }

    /// The loop: sleeps until a message or the nearest deadline (the open
    /// commit window, the upkeep's pass, the summary), so an idle agent
    /// wakes about once per pass. Ends on `stop`, a closed channel, or a
    /// fatal finding of the upkeep.
    pub(super) fn run_until_stopped(
        &mut self,
        rx: &Receiver<IngestMsg>,
        stop: &AtomicBool,
        hup: &AtomicBool,
        stats: &DeliveryStats,
    ) {
        let summary_every = self.conf.cfg.agent.summary_interval;
        let mut at = Deadlines::new(Instant::now(), self.upkeep.period(), summary_every);
        // Health from the first second (`starting`, or a listener that did
        // not bind), not the last run's record until the first pass.
        self.record_health();
        while !stop.load(Ordering::Relaxed) {
            self.run.heartbeat.beat();
            // A full-durability commit that failed retries soon; a pushed
            // config waits for its confirmation.
            let hurry = !self.buffer.is_empty(Durability::Full) || self.conf.pending_push.is_some();
            let next = at.next_wake(Instant::now(), hurry);
            match self.take_a_group(rx, &mut at, next) {
                Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if hup.swap(false, Ordering::Relaxed) {
                log::info!("SIGHUP: reloading {}", self.conf.source.path.display());
                match self.reload() {
                    Ok(v) => log::info!("config reloaded: {v}"),
                    Err(e) => log::error!("{e}"),
                }
            }
            let now = Instant::now();
            self.judge_pending_push();
            if self.clock.due(now) {
                self.watch_clock(now);
            }
            // The `full` readings of this pass, in one commit (and those
            // whose commit failed, retried).
            self.commit_full();
            let window = self.upkeep.window();
            if at.commit_due(now, window, self.window_state()) {
                self.commit(Durability::Batched);
                at.committed(now, window, !self.buffer.is_empty(Durability::Batched));
            }
            if at.upkeep_due(now) {
                let pass = self.upkeep_pass();
                at.upkeep_after(now, pass.wake_in);
                if pass.fatal.is_some() {
                    self.run.fatal = pass.fatal;
                    break;
                }
            }
            // Health's reasons changed, or nothing else committed for an
            // idle period: the state opens a window of its own (at most
            // once a state period).
            if self
                .riding
                .opens_window(now, self.state_period(), self.idle_state_period())
            {
                at.open_window(now, self.upkeep.window());
            }
            if at.summary_due(now) {
                self.summary(stats);
                at.summary_after(now, self.conf.cfg.agent.summary_interval);
            }
        }
    }

    /// What the commit window's decision looks at now.
    fn window_state(&self) -> schedule::WindowState {
        schedule::WindowState {
            buffered: !self.buffer.is_empty(Durability::Batched),
            half_full: self.buffer.half_full(),
            retry_at: self.store.retry_at(),
        }
    }

    /// One pass of the storage upkeep, then health and the outage sample
    /// (unless the pass found the spool gone or damaged).
    fn upkeep_pass(&mut self) -> Pass {
        let load = Load {
            appended: self.store.appended(),
            taken: self.buffer.taken(),
            buffered: self.buffer.len(Durability::Batched),
            buffered_bytes: self.buffer.bytes(),
            bound_readings: MAX_BUFFERED,
            bound_bytes: self.buffer.max_bytes(),
        };
        let pass = self.upkeep.tick(
            self.store.conn(Durability::Batched),
            Instant::now(),
            wall_clock_ms().0,
            &load,
        );
        if pass.fatal.is_none() {
            self.refresh_shares();
            self.record_health();
            self.sample_outage();
        }
        pass
    }

    /// Take a reading into the buffer of its stream's durability, or refuse
    /// it when the buffer is at its bound ([`buffer::Buffer::push`]) or a
    /// bridge's reading past its share of the spool ([`shares`]).
    fn push(&mut self, ev: NewEvent) {
        if !self.bridge_admits(&ev) {
            return;
        }
        let durability = self.conf.cfg.stream_durability(&ev.stream);
        if !self.buffer.push(ev, durability) {
            self.metrics.dropped += 1;
        }
    }

    /// Ask the kernel whether time sync vouches for the wall clock; the
    /// first time it does, take the anchor ([`clock`]) into the `full`
    /// buffer, whatever the config says of its stream: it commits with an
    /// fsync in this pass.
    fn watch_clock(&mut self, now: Instant) {
        let sync = crate::os::clock::kernel_sync();
        let wall = wall_clock_ms();
        let stamp = crate::os::clock::stamp();
        if let Some(ev) = self.clock.anchor(sync, wall, stamp, now) {
            if !self.buffer.push(ev, Durability::Full) {
                self.metrics.dropped += 1;
            }
        }
    }

    /// Append an event on the `_agent` stream (config fallbacks and the like),
    /// so operators see it on `<topic_prefix>/events/_agent`.
    fn agent_event(&mut self, kind: &str, detail: &str) {
        let now = crate::os::clock::reading_now();
        self.push(NewEvent {
            replay: None,
            stream: AGENT_STREAM.into(),
            ts_ms: now.wall_ms,
            clock_trusted: now.trusted,
            mono: now.mono.map(Box::new),
            fields: vec![
                ("event".into(), FieldValue::Text(kind.into())),
                ("detail".into(), FieldValue::Text(detail.into())),
            ],
            key: None,
            reply: None,
        });
    }

    /// At the stop: commit what the sampler produced and what is buffered
    /// (retrying for up to 10 s), with every rider: counters, delivery
    /// records, the agent state and the sequence numbers. The readings left
    /// are kept as lost for [`Writer::record_end`].
    pub(super) fn commit_what_is_left(&mut self, rx: &Receiver<IngestMsg>) {
        while let Ok(m) = rx.try_recv() {
            match m {
                IngestMsg::Reading(r) => self.push(r),
                IngestMsg::Count { name, by } => self.riding.count(name, by),
                IngestMsg::Control(_) | IngestMsg::Wake | IngestMsg::Records { .. } => {}
            }
        }
        self.commit_full();
        self.final_ride = true;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.store.retry_now();
            self.commit(Durability::Batched);
            let left = !self.buffer.is_empty(Durability::Batched)
                || self.rides_waiting(Instant::now()) && self.store.retry_at().is_some();
            if !left || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.final_ride = false;
        self.run.lost = self.buffer.len(Durability::Batched) + self.buffer.len(Durability::Full);
    }

    /// Record how this run ended (with the readings the stop could not
    /// commit); after a clean end, settle the WAL and stamp the file so the
    /// next start can trust it without reading all of it.
    pub(super) fn record_end(self) -> Result<(), AgentError> {
        let mut w = self;
        if w.run.fatal.is_none() {
            // What came in after the last commit (the ingest socket's counters).
            w.final_ride = true;
            w.commit(Durability::Batched);
        }
        let (run_id, lost) = (w.run.id, w.run.lost);
        let spool = w.store.conn(Durability::Batched);
        if let Some(fatal) = w.run.fatal.take() {
            let msg = fatal.message().to_owned();
            let _ = spool.end_run(run_id, wall_clock_ms().0, "error", Some(&msg));
            return Err(match fatal {
                Fatal::Damaged(_) => AgentError::Damaged(msg),
                Fatal::Replaced(_) => AgentError::Setup(msg),
            });
        }
        let (status, err) = if lost == 0 {
            ("ok", None)
        } else {
            log::error!("{lost} readings could not be committed at shutdown and are lost");
            let _ = spool.count("readings_lost_at_shutdown", lost as i64);
            ("error", Some(format!("{lost} readings lost at shutdown")))
        };
        spool.end_run(run_id, wall_clock_ms().0, status, err.as_deref())?;
        let settled = spool
            .checkpoint(CheckpointMode::Truncate)
            .is_ok_and(|r| r.busy == 0);
        let appended = w.store.appended();
        let path = w.conf.cfg.spool.path.clone();
        drop(w);
        if settled {
            // Every commit of this run is in the file now: the file alone
            // is the whole spool.
            crate::spool::integrity::run_marker::remove(&path);
        }
        if settled && lost == 0 {
            // The next start can trust this file without reading all of it.
            crate::spool::integrity::write_stamp(&path);
        }
        log::info!("stopped cleanly; {appended} readings appended this run");
        Ok(())
    }
}
