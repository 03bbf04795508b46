//! The agent: ties sources, the spool, delivery and the MQTT connection
//! together, and stops cleanly.
//!
//! Threads:
//! - **sampler**: runs each source on its interval and sends readings over a
//!   channel (an `exec` source that hangs delays only other sources, never a
//!   commit);
//! - **ingest** (the calling thread): group-commits readings into the spool
//!   every `spool.commit_window_ms`, runs maintenance (checkpoints, retention)
//!   and the summary line;
//! - **delivery** ([`crate::delivery`]): spool → in-flight window, PUBACK → retire;
//! - **mqtt** ([`crate::mqtt`]): the rumqttc event loop, no SQLite.
//!
//! One file per job: `startup` (the spool claimed and opened, the
//! settings each thread gets), `commit` (the ingest thread's loop and its
//! commits), `upkeep` (retention, checkpoints, space), `health`, `summary`,
//! `figures` (metrics), `control` (config reloads and pushes); the wiring
//! of the threads and the stop are here.
//!
//! Its one rule: **on SIGTERM/SIGINT every reading already taken is committed
//! before exit** (field case F12); nothing is reported as stored before its
//! commit.

mod commit;
mod control;
mod figures;
pub mod health;
mod health_record;
mod outage;
mod startup;
mod summary;
mod upkeep;

pub use startup::open_spool;

use crate::commands::worker::{CmdMsg, WorkerConfig};
use crate::config::Config;
use crate::delivery::{self, DeliveryStats};
use crate::event::envelope::{wall_clock_ms, EventIdGen};
use crate::intake::{Control, IngestMsg};
use crate::mqtt::{self, DeliveryMsg};
use crate::os::threads::join_within;
use crate::source::sampler::SamplerUpdate;
use crate::spool::{CheckpointMode, NewEvent, Spool, SpoolError};
use startup::{
    apply_tuning, claim_spool, command_subscription, delivery_config, forward_controls,
    open_full_durability, open_full_spool, open_ingest_spool, signal_flags, spool_dir,
    storage_backoff, tune_from_probe, wake_on_signals, with_confirmed_push,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes one WAL frame takes: a 4096-byte page and its 24-byte frame header
/// (<https://www.sqlite.org/fileformat.html#the_write_ahead_log>).
const WAL_FRAME_BYTES: u64 = 4096 + 24;
/// Readings of the board's own sources (`[[sources]]` other than bridges,
/// the agent's events) the ingest thread's buffer always has room for: the
/// socket and the bridges hold at most
/// [`crate::intake::budget::INPUT_MAX_READINGS`] beside them.
const OWN_RESERVED_READINGS: usize = 5_000;
/// Readings held in memory while the spool refuses writes (busy, full); past
/// this the newest are dropped and counted (`readings_dropped_buffer_full`).
const MAX_BUFFERED: usize = OWN_RESERVED_READINGS + crate::intake::budget::INPUT_MAX_READINGS;
/// Bytes ([`NewEvent::heap_bytes`]) of the board's own readings the buffer
/// always has room for, beside `ingest.max_buffered_bytes` of socket and
/// bridge input: 16 MiB, 5,000 readings of about 3 KiB (a `system` sample
/// is about 2 KiB).
const OWN_RESERVED_BYTES: usize = 16 * 1024 * 1024;
/// Errors that stop the agent (exit non-zero; the supervisor restarts it).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The spool could not be opened (see the cause); fix it and restart.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The spool directory, lock file or OS facility failed.
    #[error("{0}")]
    Setup(String),
    /// A background integrity check found the spool damaged; the marker is
    /// written, so running again moves the file aside and starts fresh.
    #[error("{0}")]
    Damaged(String),
}
impl From<crate::spool::integrity::OpenError> for AgentError {
    fn from(e: crate::spool::integrity::OpenError) -> Self {
        match e {
            crate::spool::integrity::OpenError::Spool(s) => AgentError::Spool(s),
            crate::spool::integrity::OpenError::Refused(m) => AgentError::Setup(m),
        }
    }
}
/// Where the running config came from, for `apply-config`, `reload-config`
/// and SIGHUP.
#[derive(Debug, Clone)]
pub struct ConfigSource {
    /// The `--config` file.
    pub path: PathBuf,
    /// `--set` overrides, applied on top of every reload.
    pub sets: Vec<String>,
    /// Set when the file was invalid at start and the last-known-good copy runs.
    pub fallback: Option<String>,
    /// Check the spool's integrity after delivery starts even if the last
    /// stop was clean (`run --check-spool`).
    pub check_spool: bool,
}
/// Records which board this spool's rows are published as (`status` shows
/// it), with a WARN when the spool was last run under another device id: a
/// spool moved to another board, or a `@hostname` that changed. Its rows
/// carry the old id in their payloads but go out under this board's topic
/// prefix, which a sink checking identities sets aside as forged; set
/// `device_id` to the old id to deliver them.
fn record_device_id(spool: &mut Spool, device_id: &str, identity_line: &str) {
    let before = spool.state("device_id").ok().flatten();
    if let Some(before) = before.filter(|b| b.split(' ').next() != Some(device_id)) {
        log::warn!(
            "this spool was last run as device_id {before}, now {identity_line}: the rows it holds carry the old id in their payloads but are published under this board's topic prefix, and a sink that checks identities sets them aside; to deliver them, set device_id to the old id"
        );
    }
    if let Err(e) = spool.set_state("device_id", identity_line, wall_clock_ms().0) {
        log::warn!("cannot record the device id in the spool: {e}");
    }
}

/// Run until SIGTERM/SIGINT. Returns Ok after a clean stop.
pub fn run(cfg: Config, source: ConfigSource) -> Result<(), AgentError> {
    let identity_line = format!(
        "{} (from {})",
        cfg.device_id,
        cfg.device_id_source.describe()
    );
    log::info!(
        "edgespool {} starting: device_id {identity_line}",
        env!("CARGO_PKG_VERSION")
    );
    let (stop, hup) = signal_flags()?;
    // Everything the ingest thread reacts to arrives on one channel, so it
    // sleeps until a reading, a control request, a signal or its next deadline.
    let (ingest_tx, ingest_rx) = mpsc::channel::<IngestMsg>();
    let signals = wake_on_signals(ingest_tx.clone())?;
    let _lock = claim_spool(&cfg, &source.path)?;
    // Before any open: reading the kept serial for a signed push opens the
    // spool read-only, which leaves an empty -wal beside a bare copy.
    let before = crate::spool::integrity::look_before_open(&cfg.spool.path);
    let (mut cfg, confirmed_push) = with_confirmed_push(cfg, &source);
    // Clients' readings wait in the channel until the ingest loop runs,
    // within the input budget.
    let input = crate::intake::budget::InputBudget::new(cfg.ingest.max_buffered_bytes);
    let socket_ingest =
        crate::ingest::start(&cfg.ingest, ingest_tx.clone(), &input).map_err(AgentError::Setup)?;
    let tuning = tune_from_probe(&mut cfg);
    crate::flash::probe::remove_stale_files(&spool_dir(&cfg));
    let check_reason = crate::spool::integrity::take_stamp(&cfg.spool.path).or_else(|| {
        source
            .check_spool
            .then(|| "asked for (--check-spool)".to_owned())
    });
    let mut ingest = open_ingest_spool(&cfg, tuning.as_ref(), before)?;
    let run_id = ingest.begin_run(
        wall_clock_ms().0,
        std::process::id(),
        env!("CARGO_PKG_VERSION"),
    )?;
    record_device_id(&mut ingest, &cfg.device_id, &identity_line);
    // The run's start reaches the database file now, not at the first
    // timed checkpoint: a copy of the file alone, taken while this run goes
    // on, then shows a run that never ended (integrity::wal_lost).
    let _ = ingest.checkpoint(CheckpointMode::Passive);
    let identity = control::config_identity(&source.path, confirmed_push.as_ref());
    // The commit window every committing thread reads (a write budget widens it).
    let window = crate::flash::write_budget::SharedWindow::new(cfg.spool.commit_window);
    let net = match start_network(&cfg, &ingest, &identity, ingest_tx.clone(), &window) {
        Ok(net) => net,
        Err(e) => {
            let _ = ingest.end_run(run_id, wall_clock_ms().0, "error", Some(&e.to_string()));
            return Err(e);
        }
    };
    // Delivery is running: now the whole-file check, if the file needs one.
    let verdict =
        check_reason.map(|why| crate::spool::integrity::spawn_check(cfg.spool.path.clone(), why));
    let (sampler_tx, sampler_rx) = mpsc::channel::<SamplerUpdate>();
    let sampler = {
        let (stop, sources, path) = (stop.clone(), cfg.sources.clone(), cfg.spool.path.clone());
        let (readings_tx, bridges) = (ingest_tx, input.bridges.clone());
        spawn("sampler", move || {
            crate::source::sampler::run(sources, path, (readings_tx, bridges), sampler_rx, stop)
        })?
    };
    let mut ing = Ingest::new(Parts {
        full_spool: open_full_spool(&cfg, &ingest)?,
        run_id,
        spool: ingest,
        cfg,
        source,
        push: confirmed_push,
        link: net.link.clone(),
        to_delivery: net.to_delivery.clone(),
        delivery_stats: net.stats.clone(),
        sampler: sampler_tx,
        verdict,
        socket_counts: socket_ingest.counters(),
        tuning,
        window,
    })?;
    ing.note_socket_ingest(&socket_ingest);
    if let Some(msg) = ing.source.fallback.clone() {
        log::error!("{msg}");
        ing.agent_event("config_invalid", &msg);
    }
    let metrics_listener = ing.start_metrics();
    // The spool is open and every thread runs: tell systemd (Type=notify).
    ing.notifier.ready();
    ing.notifier.start_watchdog(vec![
        ("ingest", ing.heartbeat.clone()),
        ("delivery", net.stats.heartbeat.clone()),
    ]);
    ing.run_until_stopped(&ingest_rx, &stop, &hup, &net.stats);
    socket_ingest.stop_intake();
    ing.notifier.stopping();
    // The loop also ends on a fatal condition: stop the sampler either way.
    stop.store(true, Ordering::Relaxed);
    signals.close();
    ing.stop_threads(&ingest_rx, sampler, net);
    socket_ingest.finish();
    ing.store_socket_counts();
    ing.stop_metrics(metrics_listener);
    ing.record_end()
}

/// Start a named thread running `f`.
fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, AgentError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| AgentError::Setup(format!("cannot start the {name} thread: {e}")))
}

/// The network threads: mqtt, delivery and commands, with what they share.
struct Network {
    link: mqtt::Link,
    stats: Arc<DeliveryStats>,
    to_delivery: Sender<DeliveryMsg>,
    mqtt: JoinHandle<()>,
    delivery: JoinHandle<()>,
    command: JoinHandle<()>,
    /// Wakes the command thread to see `net_stop`.
    cmd_wake: Sender<CmdMsg>,
    /// Stops the network threads (mqtt, delivery, commands).
    net_stop: Arc<AtomicBool>,
}

/// Start the mqtt, delivery and command threads on their own connections
/// (siblings of `ingest`); the command thread's control requests reach the
/// ingest thread through `ingest_tx`.
fn start_network(
    cfg: &Config,
    ingest: &Spool,
    config_identity: &str,
    ingest_tx: Sender<IngestMsg>,
    window: &crate::flash::write_budget::SharedWindow,
) -> Result<Network, AgentError> {
    let delivery_spool = ingest.open_sibling(&cfg.spool.options)?;
    let command_spool = open_full_durability(cfg, ingest)?;
    let (to_delivery, delivery_rx) = mpsc::channel::<DeliveryMsg>();
    let net_stop = Arc::new(AtomicBool::new(false));
    let (cmd_tx, cmd_rx) = mpsc::channel::<CmdMsg>();
    let inbox = crate::commands::worker::Inbox::new(
        cmd_tx.clone(),
        crate::commands::worker::inbox_limit(cfg.commands.max_payload_bytes),
        &cfg.commands.operator_scopes,
    );
    let inbox_meter = inbox.meter();
    let (link, mqtt_thread) = mqtt::new(
        cfg.mqtt.clone(),
        to_delivery.clone(),
        net_stop.clone(),
        command_subscription(cfg, inbox),
    );
    // The retained `online` status at the first connect already tells these.
    link.set_status(
        (&cfg.device_id, cfg.device_id_source.kind()),
        config_identity,
        ingest.backlog_estimate().unwrap_or(0),
    );
    let stats = Arc::new(DeliveryStats::default());
    let mqtt = spawn("mqtt", move || mqtt_thread.run())?;
    let delivery = {
        let (stop, stats, link, dcfg) = (
            net_stop.clone(),
            stats.clone(),
            link.clone(),
            delivery_config(cfg, window.clone()),
        );
        spawn("delivery", move || {
            delivery::run(delivery_spool, dcfg, link, delivery_rx, stop, stats)
        })?
    };
    let (ctl_tx, ctl_rx) = mpsc::channel::<Control>();
    let command = {
        let wcfg = WorkerConfig {
            device_id: cfg.device_id.clone(),
            format: cfg.mqtt.payload_format,
            commands: cfg.commands.clone(),
        };
        let (stop, link, to_delivery, cmd_tx) = (
            net_stop.clone(),
            link.clone(),
            to_delivery.clone(),
            cmd_tx.clone(),
        );
        spawn("commands", move || {
            crate::commands::worker::run(
                command_spool,
                wcfg,
                link,
                inbox_meter,
                cmd_rx,
                cmd_tx,
                ctl_tx,
                to_delivery,
                stop,
            )
        })?
    };
    forward_controls(ctl_rx, ingest_tx);
    Ok(Network {
        link,
        stats,
        to_delivery,
        mqtt,
        delivery,
        command,
        cmd_wake: cmd_tx,
        net_stop,
    })
}

/// What [`Ingest::new`] is built from.
struct Parts {
    cfg: Config,
    source: ConfigSource,
    push: Option<crate::push::Stored>,
    spool: Spool,
    full_spool: Spool,
    run_id: i64,
    link: mqtt::Link,
    to_delivery: Sender<DeliveryMsg>,
    delivery_stats: Arc<DeliveryStats>,
    sampler: Sender<SamplerUpdate>,
    verdict: Option<crate::spool::integrity::Verdict>,
    socket_counts: Option<Arc<crate::ingest::Counters>>,
    tuning: Option<crate::flash::probe::Profile>,
    window: crate::flash::write_budget::SharedWindow,
}

/// The ingest thread's state: the spool connections, the buffers, upkeep
/// and health bookkeeping, the config in force.
struct Ingest {
    /// This run's record in the spool (`runs`).
    run_id: i64,
    /// systemd's notification socket (READY, STATUS, STOPPING, WATCHDOG).
    notifier: crate::os::notify::Notifier,
    /// Stamped each time the ingest loop goes round, for the watchdog.
    heartbeat: crate::os::notify::Heartbeat,
    cfg: Config,
    source: ConfigSource,
    link: mqtt::Link,
    sampler: Sender<SamplerUpdate>,
    spool: Spool,
    ids: EventIdGen,
    buffer: Vec<NewEvent>,
    /// [`NewEvent::heap_bytes`] of `buffer` and `full_buffer` together.
    buffered_bytes: usize,
    to_delivery: Sender<DeliveryMsg>,
    appended: u64,
    dropped: u64,
    /// Readings the stop could not commit ([`Ingest::stop_threads`]).
    lost: usize,
    last_error_log: Option<Instant>,
    retry_at: Option<Instant>,
    /// Storage bookkeeping for maintenance, capacity and `status`.
    upkeep: Upkeep,
    /// Counter increments not yet stored (a full disk refuses them too).
    pending_counts: HashMap<String, i64>,
    /// The ingest socket's counters, moved into the spool's at each summary.
    socket_counts: Option<Arc<crate::ingest::Counters>>,
    /// What the storage probe derived, re-applied over every reloaded config.
    tuning: Option<crate::flash::probe::Derived>,
    /// Backoff for storage writes that failed transiently (busy, I/O).
    storage_backoff: crate::os::backoff::Backoff,
    /// Connection with `synchronous = FULL` for `durability = "full"` streams.
    full_spool: Spool,
    /// Readings of full-durability streams waiting for their (immediate) commit.
    full_buffer: Vec<NewEvent>,
    /// The last `full` group commit that stored its readings: how many it
    /// held, how long its transaction took and when it ended (for the wait
    /// for stragglers, [`Ingest::gather_stragglers`]).
    last_full_group: Option<(usize, std::time::Duration, std::time::Instant)>,
    /// How long the last successful commit's transaction took (append to
    /// commit, no checkpoint or capacity check), and when it ended.
    last_commit: (std::time::Duration, std::time::Instant),
    /// The confirmed config push in force (kept in the state directory).
    push: Option<crate::push::Stored>,
    /// A push applied live, waiting for a connection to confirm it.
    pending_push: Option<crate::push::Pending>,
    /// Delivery counters (rows FAILED since start, for health).
    delivery_stats: Arc<DeliveryStats>,
    /// sha256 of the local config file (and the confirmed push on top), for
    /// the retained status message.
    config_sha: String,
    /// Metrics snapshot, textfile, commit latency, drops this run.
    metrics: figures::MetricsState,
    /// Samples and the last budget of the outage budget.
    outage: outage::OutageState,
    /// The commit window in force, shared with the delivery thread.
    window: crate::flash::write_budget::SharedWindow,
    /// Chooses the window from the measured writes (`spool.write_budget_mb_per_day`).
    budget: crate::flash::write_budget::Controller,
    /// When retention last ran (it runs with the checkpoint cadence).
    retention_at: Option<Instant>,
}
/// What the ingest thread tracks about the spool between maintenance passes.
struct Upkeep {
    /// (device, inode) of the spool file at open.
    identity: Option<(u64, u64)>,
    /// (device, inode) of the spool's `-shm` file (the WAL index) at open.
    shm: Option<(u64, u64)>,
    /// What the `-shm` path was (missing, or another inode) when that was
    /// last warned about: one WARN per change, not one per pass.
    shm_warned: Option<Option<(u64, u64)>>,
    /// Set when the agent must stop for its supervisor (spool replaced).
    fatal: Option<String>,
    /// The background integrity check, if one runs.
    verdict: Option<crate::spool::integrity::Verdict>,
    /// The fatal condition is a damaged spool (run again to move it aside).
    damaged: bool,
    last_checkpoint: Instant,
    /// The last checkpoint's outcome, for `status` (stored at the summary).
    last_checkpoint_json: Option<serde_json::Value>,
    /// Checkpoints run since start.
    checkpoints: u64,
    /// Last time sequence numbers were persisted.
    seqs_persisted: Instant,
    /// The health reasons last stored (without figures), so health is
    /// written when they change or at the summary interval, not each pass.
    health_kinds: Vec<String>,
    health_stored_at: Option<Instant>,
    /// The health record of the last pass, refreshed by the summary.
    health_record: Option<String>,
    /// Wall ms when the current set of health reasons began.
    health_since: i64,
    /// Readings the in-memory buffer refused since the last health pass.
    buffer_drops: u64,
    /// The last pass left retention or space to give back for the next one.
    more_work: bool,
    /// Last capacity check and its answer (checked at most once a second).
    capacity_checked: Option<Instant>,
    refusal: Option<crate::flash::maintenance::Refusal>,
    /// A checkpoint found the WAL pinned by a reader.
    checkpoint_blocked: bool,
    /// Consecutive incomplete checkpoints: since when, how many.
    incomplete_run: Option<(Instant, u32)>,
    /// Since when a reader has kept the WAL a bulk step (a retention
    /// batch, a shrink step) left from starting over, and whether that was
    /// logged; further bulk steps wait ([`Ingest::bulk_step_allowed`]).
    bulk_pinned: Option<(Instant, bool)>,
    /// Write budget baseline: (when, /proc/self/io write_bytes).
    budget_since: (Instant, u64),
    /// Commits on the `synchronous = FULL` ingest connection.
    full_commits: u64,
    last_refusal_log: Option<Instant>,
    last_checkpoint_error: Option<Instant>,
    /// SQLITE_FULL was hit; cleared by [`Ingest::recovered_from_disk_full`].
    disk_full: bool,
    /// Wall clock and monotonic clock at start, to notice clock steps.
    wall_anchor: (i64, Instant),
    clock_step_logged: bool,
    /// Another process listens on `ingest.socket` (the agent runs without it).
    ingest_socket_taken: Option<String>,
    /// Mean bytes of a buffered reading when last seen (for the budget's
    /// buffer bound).
    reading_bytes: usize,
}
/// The write budget's settings from `[spool]`.
fn budget_settings(cfg: &Config) -> crate::flash::write_budget::BudgetSettings {
    crate::flash::write_budget::BudgetSettings {
        bytes_per_day: cfg.spool.write_budget_bytes_per_day,
        base_window: cfg.spool.commit_window,
        // The probe may derive a base above it: the base wins.
        max_window: cfg.spool.max_commit_window.max(cfg.spool.commit_window),
    }
}

impl Ingest {
    fn new(p: Parts) -> Result<Ingest, AgentError> {
        let ids = EventIdGen::new()
            .map_err(|e| AgentError::Setup(format!("OS random source failed: {e}")))?;
        let budget = crate::flash::write_budget::Controller::new(budget_settings(&p.cfg));
        let mut ing = Ingest {
            run_id: p.run_id,
            upkeep: Upkeep::new(&p.cfg.spool.path, p.verdict),
            full_spool: p.full_spool,
            full_buffer: Vec::new(),
            last_full_group: None,
            last_commit: (std::time::Duration::ZERO, std::time::Instant::now()),
            push: p.push,
            pending_push: None,
            delivery_stats: p.delivery_stats,
            config_sha: String::new(),
            cfg: p.cfg,
            source: p.source,
            link: p.link,
            sampler: p.sampler,
            spool: p.spool,
            ids,
            buffer: Vec::new(),
            buffered_bytes: 0,
            to_delivery: p.to_delivery,
            appended: 0,
            dropped: 0,
            lost: 0,
            last_error_log: None,
            retry_at: None,
            metrics: Default::default(),
            outage: Default::default(),
            pending_counts: HashMap::new(),
            socket_counts: p.socket_counts,
            notifier: crate::os::notify::Notifier::from_env(),
            heartbeat: crate::os::notify::Heartbeat::default(),
            tuning: p.tuning.as_ref().map(|t| t.derived),
            storage_backoff: storage_backoff(p.tuning.as_ref()),
            window: p.window,
            retention_at: None,
            budget,
        };
        ing.config_sha = ing.config_identity();
        Ok(ing)
    }

    /// The stop: the sampler first, then every reading it produced is
    /// committed, then the network threads, each within a bound. The
    /// readings that could not be committed are kept in `lost`.
    fn stop_threads(
        &mut self,
        readings_rx: &Receiver<IngestMsg>,
        sampler: JoinHandle<()>,
        net: Network,
    ) {
        let _ = self.sampler.send(SamplerUpdate::Stop);
        let _ = sampler.join();
        self.commit_what_is_left(readings_rx);
        let lost = self.buffer.len() + self.full_buffer.len();
        net.net_stop.store(true, Ordering::Relaxed);
        // The network threads sleep until an event: wake each to see the flag.
        self.link.stop();
        let _ = self.to_delivery.send(DeliveryMsg::Stop);
        let _ = net.cmd_wake.send(CmdMsg::Wake);
        // Bounded: a connect attempt or a running command handler must not
        // hold the stop past the supervisor's timeout. Whatever they had in
        // flight is replayed (rows) or reported interrupted (commands) at the
        // next start.
        let deadline = Instant::now() + Duration::from_secs(3);
        join_within(net.command, deadline, "the command thread");
        join_within(net.delivery, deadline, "the delivery thread");
        join_within(net.mqtt, deadline, "the mqtt thread");
        self.lost = lost;
    }

    /// Record how this run ended (with the readings [`Ingest::stop_threads`]
    /// could not commit); after a clean end, settle the WAL and stamp the file so
    /// the next start can trust it without reading all of it.
    fn record_end(self) -> Result<(), AgentError> {
        let mut ing = self;
        let (run_id, lost) = (ing.run_id, ing.lost);
        if let Some(msg) = ing.upkeep.fatal.take() {
            let _ = ing
                .spool
                .end_run(run_id, wall_clock_ms().0, "error", Some(&msg));
            if ing.upkeep.damaged {
                return Err(AgentError::Damaged(msg));
            }
            return Err(AgentError::Setup(msg));
        }
        let (status, err) = if lost == 0 {
            ("ok", None)
        } else {
            log::error!("{lost} readings could not be committed at shutdown and are lost");
            let _ = ing.spool.count("readings_lost_at_shutdown", lost as i64);
            ("error", Some(format!("{lost} readings lost at shutdown")))
        };
        ing.spool
            .end_run(run_id, wall_clock_ms().0, status, err.as_deref())?;
        let appended = ing.appended;
        let settled = ing
            .spool
            .checkpoint(CheckpointMode::Truncate)
            .is_ok_and(|r| r.busy == 0);
        let path = ing.cfg.spool.path.clone();
        drop(ing);
        if settled && lost == 0 {
            // The next start can trust this file without reading all of it.
            crate::spool::integrity::write_stamp(&path);
        }
        log::info!("stopped cleanly; {appended} readings appended this run");
        Ok(())
    }
}
