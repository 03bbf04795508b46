//! The agent: ties sources, the spool, delivery and the MQTT connection
//! together, and stops cleanly.
//!
//! Threads:
//! - **sampler**: runs each source on its interval and sends readings over a
//!   channel (an `exec` source that hangs delays only other sources, never a
//!   commit);
//! - **writer** (the calling thread, [`writer`]): group-commits readings into
//!   the spool every `spool.commit_window_ms`, drives the storage upkeep
//!   ([`crate::flash::upkeep`]), health and the summary line, and answers
//!   the command thread's control requests, which arrive on its own channel;
//! - **delivery** ([`crate::delivery`]): spool → in-flight window, PUBACK → retire;
//! - **mqtt** ([`crate::mqtt`]): the rumqttc event loop, no SQLite;
//! - **commands** ([`crate::commands`]): command records and handlers.
//!
//! One file per job: `startup` (the spool claimed and opened, the
//! settings each thread gets), `writer/` (the writer thread, one file per
//! concern), `health` (pure); the wiring of the threads and the stop are
//! here.
//!
//! Its one rule: **on SIGTERM/SIGINT every reading already taken is committed
//! before exit** (field case F12); nothing is reported as stored before its
//! commit.

pub mod health;
mod startup;
mod writer;

pub use startup::{check_places, open_spool};

use crate::commands::signed::OperatorKeys;
use crate::commands::worker::{CmdMsg, WorkerConfig};
use crate::config::Config;
use crate::delivery::{self, DeliveryStats};
use crate::event::envelope::wall_clock_ms;
use crate::flash::upkeep::Upkeep;
use crate::intake::{ControlSender, IngestMsg};
use crate::mqtt::{self, DeliveryMsg};
use crate::os::threads::join_within;
use crate::source::sampler::SamplerUpdate;
use crate::spool::{CheckpointMode, Spool, SpoolError};
use startup::{
    claim_spool, command_subscription, delivery_config, open_full_durability, open_full_spool,
    open_ingest_spool, signal_flags, spool_dir, tune_from_probe, upkeep_settings, wake_on_signals,
    with_confirmed_push,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use writer::{Parts, Writer};

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
    // Everything the writer reacts to arrives on one channel, so it sleeps
    // until a reading, a control request, a signal or its next deadline.
    let (ingest_tx, ingest_rx) = mpsc::channel::<IngestMsg>();
    let signals = wake_on_signals(ingest_tx.clone())?;
    let _lock = claim_spool(&cfg, &source.path)?;
    // Before any open: reading the kept serial for a signed push opens the
    // spool read-only, which leaves an empty -wal beside a bare copy.
    let before = crate::spool::integrity::look_before_open(&cfg.spool.path);
    let (mut cfg, confirmed_push) = with_confirmed_push(cfg, &source);
    // Clients' readings wait in the channel until the writer's loop runs,
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
    let (mut spool, run_id, spool_lost) =
        open_for_run(&cfg, tuning.as_ref(), before, &identity_line)?;
    let identity = writer::config_identity(&source.path, confirmed_push.as_ref());
    // The upkeep holds the commit window every committing thread reads.
    let mut upkeep = Upkeep::new(
        &cfg.spool.path,
        upkeep_settings(&cfg),
        Instant::now(),
        wall_clock_ms().0,
    );
    let net = match start_network(&cfg, &spool, &identity, ingest_tx.clone()) {
        Ok(net) => net,
        Err(e) => {
            let _ = spool.end_run(run_id, wall_clock_ms().0, "error", Some(&e.to_string()));
            return Err(e);
        }
    };
    // Delivery is running: now the whole-file check, if the file needs one.
    if let Some(why) = check_reason {
        let path = cfg.spool.path.clone();
        upkeep.watch_integrity(crate::spool::integrity::spawn_check(path, why));
    }
    let sampler = start_sampler(&cfg, &stop, ingest_tx, &input)?;
    let mut w = Writer::new(Parts {
        full_spool: open_full_spool(&cfg, &spool)?,
        run_id,
        spool,
        upkeep,
        cfg,
        source,
        push: confirmed_push,
        link: net.link.clone(),
        to_delivery: net.to_delivery.clone(),
        delivery_stats: net.stats.clone(),
        ledger: net.ledger.clone(),
        commands_clock: net.commands_clock.clone(),
        sampler: sampler.0.clone(),
        socket_counts: socket_ingest.counters(),
        tuning,
        spool_lost,
    })?;
    w.note_socket_ingest(&socket_ingest);
    w.report_fallback();
    let metrics_listener = w.start_metrics();
    w.ready(net.stats.heartbeat.clone());
    w.run_until_stopped(&ingest_rx, &stop, &hup, &net.stats);
    socket_ingest.stop_intake();
    w.stopping();
    // The loop also ends on a fatal condition: stop the sampler either way.
    stop.store(true, Ordering::Relaxed);
    signals.close();
    stop_threads(&mut w, &ingest_rx, sampler, net);
    socket_ingest.finish();
    w.store_socket_counts();
    w.stop_metrics(metrics_listener);
    w.record_end()
}

/// The writer's connection, opened for this run: the run's record begun,
/// the device id recorded, the start checkpointed into the file, and the
/// run marker written; with what the open found lost.
fn open_for_run(
    cfg: &Config,
    tuning: Option<&crate::flash::probe::Profile>,
    before: crate::spool::integrity::Before,
    identity_line: &str,
) -> Result<(Spool, i64, Option<String>), AgentError> {
    let opened = open_ingest_spool(cfg, tuning, before)?;
    let mut spool = opened.spool;
    let (started_ms, pid) = (wall_clock_ms().0, std::process::id());
    let run_id = spool.begin_run(started_ms, pid, env!("CARGO_PKG_VERSION"))?;
    record_device_id(&mut spool, &cfg.device_id, identity_line);
    // The run's start reaches the database file now, not at the first
    // timed checkpoint: a copy of the file alone, taken while this run goes
    // on, then shows a run that never ended (integrity::wal_lost).
    let _ = spool.checkpoint(CheckpointMode::Passive);
    // A reader holding the WAL from before this run keeps even that
    // checkpoint from the file: the marker names the run whatever it does.
    let marker = crate::spool::integrity::run_marker::RunMarker {
        run_id,
        pid: i64::from(pid),
        started_ms,
    };
    if let Err(e) = crate::spool::integrity::run_marker::write(&cfg.spool.path, &marker) {
        log::warn!(
            "cannot write the run marker {}: {e}; if this run's -wal is lost after an unclean stop, the next start names it only if the file shows this run",
            crate::spool::integrity::run_marker::path(&cfg.spool.path).display()
        );
    }
    Ok((spool, run_id, opened.lost))
}

/// The sampler thread, sending its readings to the writer (`readings`) and
/// the bridges' within `input`; returns its update channel and its handle.
fn start_sampler(
    cfg: &Config,
    stop: &Arc<AtomicBool>,
    readings: Sender<IngestMsg>,
    input: &crate::intake::budget::InputBudget,
) -> Result<(Sender<SamplerUpdate>, JoinHandle<()>), AgentError> {
    let (sampler_tx, sampler_rx) = mpsc::channel::<SamplerUpdate>();
    let (stop, sources, path) = (stop.clone(), cfg.sources.clone(), cfg.spool.path.clone());
    let bridges = input.bridges.clone();
    let handle = spawn("sampler", move || {
        crate::source::sampler::run(sources, path, (readings, bridges), sampler_rx, stop)
    })?;
    Ok((sampler_tx, handle))
}

/// The stop: the sampler first, then every reading it produced is
/// committed, then the network threads, each within a bound. The readings
/// that could not be committed are kept as lost ([`Writer::record_end`]).
fn stop_threads(
    w: &mut Writer,
    readings: &Receiver<IngestMsg>,
    (sampler_tx, sampler): (Sender<SamplerUpdate>, JoinHandle<()>),
    net: Network,
) {
    let _ = sampler_tx.send(SamplerUpdate::Stop);
    let _ = sampler.join();
    w.commit_what_is_left(readings);
    net.stop();
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
    /// Delivery records, committed by the writer.
    ledger: delivery::ledger::Ledger,
    /// The command records' clock, which the writer persists.
    commands_clock: Option<crate::commands::retention::AgentClock>,
    to_delivery: Sender<DeliveryMsg>,
    mqtt: JoinHandle<()>,
    delivery: JoinHandle<()>,
    command: JoinHandle<()>,
    /// Wakes the command thread to see `net_stop`.
    cmd_wake: Sender<CmdMsg>,
    /// Stops the network threads (mqtt, delivery, commands).
    net_stop: Arc<AtomicBool>,
}

impl Network {
    /// Stop the network threads, each within a bound: a connect attempt or
    /// a running command handler must not hold the stop past the
    /// supervisor's timeout. Whatever they had in flight is replayed (rows)
    /// or reported interrupted (commands) at the next start.
    fn stop(self) {
        self.net_stop.store(true, Ordering::Relaxed);
        // The network threads sleep until an event: wake each to see the flag.
        self.link.stop();
        let _ = self.to_delivery.send(DeliveryMsg::Stop);
        let _ = self.cmd_wake.send(CmdMsg::Wake);
        let deadline = Instant::now() + Duration::from_secs(3);
        join_within(self.command, deadline, "the command thread");
        join_within(self.delivery, deadline, "the delivery thread");
        join_within(self.mqtt, deadline, "the mqtt thread");
    }
}

/// Start the mqtt, delivery and command threads on their own connections
/// (siblings of the writer's `spool`); the command thread's control
/// requests go straight into the writer's channel `ingest_tx`, and delivery
/// records wait in a ledger whose commits the writer makes (it wakes the
/// writer through the same channel).
fn start_network(
    cfg: &Config,
    spool: &Spool,
    config_identity: &str,
    ingest_tx: Sender<IngestMsg>,
) -> Result<Network, AgentError> {
    let delivery_spool = spool.open_sibling(&cfg.spool.options)?;
    let command_spool = open_full_durability(cfg, spool)?;
    let (to_delivery, delivery_rx) = mpsc::channel::<DeliveryMsg>();
    let net_stop = Arc::new(AtomicBool::new(false));
    let (cmd_tx, cmd_rx) = mpsc::channel::<CmdMsg>();
    let inbox = crate::commands::worker::Inbox::new(
        cmd_tx.clone(),
        crate::commands::worker::inbox_limit(cfg.commands.max_payload_bytes),
        OperatorKeys::new(&cfg.device_id, &cfg.commands.operator_public_keys),
        cfg.commands.max_payload_bytes,
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
        spool.backlog_estimate().unwrap_or(0),
    );
    let stats = Arc::new(DeliveryStats::default());
    let ledger = delivery::ledger::Ledger::new(Some(ingest_tx.clone()));
    let mqtt = spawn("mqtt", move || mqtt_thread.run())?;
    let delivery = {
        let (stop, shared, link, dcfg) = (
            net_stop.clone(),
            (stats.clone(), ledger.clone()),
            link.clone(),
            delivery_config(cfg),
        );
        spawn("delivery", move || {
            delivery::run(delivery_spool, dcfg, link, delivery_rx, stop, shared)
        })?
    };
    // One clock for the command thread and the writer that persists it.
    let clock = crate::commands::store::clock_ms(&command_spool)
        .map(crate::commands::retention::AgentClock::resume);
    let commands_clock = clock.as_ref().ok().cloned();
    let command = {
        let wcfg = WorkerConfig {
            device_id: cfg.device_id.clone(),
            format: cfg.mqtt.payload_format,
            commands: cfg.commands.clone(),
        };
        let ctl = ControlSender::new(ingest_tx);
        let (stop, link, to_delivery, cmd_tx) = (
            net_stop.clone(),
            link.clone(),
            to_delivery.clone(),
            cmd_tx.clone(),
        );
        spawn("commands", move || {
            crate::commands::worker::run(
                command_spool,
                clock,
                wcfg,
                link,
                inbox_meter,
                cmd_rx,
                cmd_tx,
                ctl,
                to_delivery,
                stop,
            )
        })?
    };
    Ok(Network {
        link,
        stats,
        ledger,
        commands_clock,
        to_delivery,
        mqtt,
        delivery,
        command,
        cmd_wake: cmd_tx,
        net_stop,
    })
}
