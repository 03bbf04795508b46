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
//! - **delivery** ([`crate::publisher`]): spool → in-flight window, PUBACK → retire;
//! - **mqtt** ([`crate::mqtt`]): the rumqttc event loop, no SQLite.
//!
//! Its one rule: **on SIGTERM/SIGINT every reading already taken is committed
//! before exit** (field case F12); nothing is reported as stored before its
//! commit.

mod control;
mod figures;

use crate::commands::worker::{CmdMsg, WorkerConfig};
use crate::config::Config;
use crate::envelope::{wall_clock_ms, EventIdGen};
use crate::fsguard::SpoolLock;
use crate::intake::{Control, IngestMsg};
use crate::mqtt::{self, DeliveryMsg};
use crate::publisher::{self, DeliveryConfig, DeliveryStats};
use crate::sampler::SamplerUpdate;
use crate::spool::{CheckpointMode, NewEvent, Spool, SpoolError};
use crate::stream::AGENT_STREAM;
use crate::threads::join_within;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes one WAL frame takes: a 4096-byte page and its 24-byte frame header
/// (<https://www.sqlite.org/fileformat.html#the_write_ahead_log>).
const WAL_FRAME_BYTES: u64 = 4096 + 24;

/// Longest a maintenance pass keeps deleting (each batch holds the write
/// lock; the delivery thread's commits wait behind it).
const MAINTENANCE_BUDGET: Duration = Duration::from_millis(100);
/// The next pass when the last one left work over.
const MAINTENANCE_AGAIN: Duration = Duration::from_millis(250);
/// Free pages given back per pass (1 MiB of 4 KiB pages): one step is one
/// transaction, so this also bounds what it adds to the WAL.
const SHRINK_STEP_PAGES: u64 = 256;

/// Readings held in memory while the spool refuses writes (busy, full); past
/// this the newest are dropped and counted (`readings_dropped_buffer_full`).
const MAX_BUFFERED: usize = 10_000;

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

/// Open the configured spool, moving a damaged one aside
/// ([`crate::integrity::open_spool_at`]).
pub fn open_spool(cfg: &Config) -> Result<Spool, AgentError> {
    Ok(crate::integrity::open_spool_at(
        &cfg.spool.path,
        &cfg.spool.options,
    )?)
}

/// The local config with the confirmed config push kept in the state
/// directory on top, if there is one and the local policy still allows it
/// (a push the local file no longer allows is ignored, loudly).
fn with_confirmed_push(
    local: Config,
    source: &ConfigSource,
) -> (Config, Option<crate::push::Stored>) {
    let Some(stored) = crate::push::load(&spool_dir(&local)) else {
        return (local, None);
    };
    let text_path = if source.fallback.is_some() {
        crate::configfile::last_good_path(&source.path)
    } else {
        source.path.clone()
    };
    let composed = std::fs::read_to_string(&text_path)
        .map_err(|e| format!("cannot read {}: {e}", text_path.display()))
        .and_then(|text| {
            let push = crate::policy::check(&local, &stored.text, stored.signature.as_deref())?;
            crate::push::compose(
                &local,
                &text,
                &text_path.display().to_string(),
                &source.sets,
                &push,
            )
        });
    match composed {
        Ok(cfg) => {
            log::info!(
                "running the local config with the confirmed config push (sha256 {})",
                crate::configfile::sha256_hex(stored.text.as_bytes())
            );
            (cfg, Some(stored))
        }
        Err(e) => {
            log::warn!("the stored config push is ignored: {e}; running the local config alone");
            (local, None)
        }
    }
}

/// `s` without its digits: a health reason's kind, whatever its figures.
fn without_digits(s: &str) -> String {
    s.chars().filter(|c| !c.is_ascii_digit()).collect()
}

/// A thread that blocks on SIGTERM, SIGINT and SIGHUP and wakes the ingest
/// thread (the flags themselves are set by the handlers registered in
/// [`run`]). Close the returned handle to end it.
fn wake_on_signals(tx: Sender<IngestMsg>) -> Result<signal_hook::iterator::Handle, AgentError> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| AgentError::Setup(format!("cannot install signal handler: {e}")))?;
    let handle = signals.handle();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for _ in signals.forever() {
                if tx.send(IngestMsg::Wake).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| AgentError::Setup(format!("cannot start the signal thread: {e}")))?;
    Ok(handle)
}

/// Forward the command thread's control requests into the ingest channel
/// (a thread blocked on `ctl` until the command thread drops its sender).
fn forward_controls(ctl: Receiver<Control>, tx: Sender<IngestMsg>) {
    let spawned = std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for c in ctl {
                if tx.send(IngestMsg::Control(c)).is_err() {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start the control thread: {e}; live config changes are off");
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

/// Run until SIGTERM/SIGINT. Returns Ok after a clean stop.
pub fn run(cfg: Config, source: ConfigSource) -> Result<(), AgentError> {
    let (stop, hup) = signal_flags()?;
    // Everything the ingest thread reacts to arrives on one channel, so it
    // sleeps until a reading, a control request, a signal or its next deadline.
    let (ingest_tx, ingest_rx) = mpsc::channel::<IngestMsg>();
    let signals = wake_on_signals(ingest_tx.clone())?;
    let _lock = claim_spool(&cfg)?;

    let (mut cfg, confirmed_push) = with_confirmed_push(cfg, &source);
    // Clients' readings wait in the channel until the ingest loop runs.
    let socket_ingest =
        crate::ingest::start(&cfg.ingest, ingest_tx.clone()).map_err(AgentError::Setup)?;
    let tuning = tune_from_probe(&mut cfg);
    crate::probe::remove_stale_files(&spool_dir(&cfg));
    let check_reason = crate::integrity::take_stamp(&cfg.spool.path).or_else(|| {
        source
            .check_spool
            .then(|| "asked for (--check-spool)".to_owned())
    });
    let mut ingest = open_ingest_spool(&cfg, tuning.as_ref())?;
    let run_id = ingest.begin_run(
        wall_clock_ms().0,
        std::process::id(),
        env!("CARGO_PKG_VERSION"),
    )?;
    let delivery_spool = ingest.open_sibling(&cfg.spool.options)?;
    let ids = EventIdGen::new()
        .map_err(|e| AgentError::Setup(format!("OS random source failed: {e}")))?;

    let command_spool = open_full_durability(&cfg, &ingest)?;

    let (to_delivery, delivery_rx) = mpsc::channel::<DeliveryMsg>();
    let net_stop = Arc::new(AtomicBool::new(false));
    let (cmd_tx, cmd_rx) = mpsc::channel::<CmdMsg>();
    let cmd_wake = cmd_tx.clone();
    let inbox = crate::commands::worker::Inbox::new(
        cmd_tx.clone(),
        crate::commands::worker::inbox_limit(cfg.commands.max_payload_bytes),
    );
    let inbox_meter = inbox.meter();
    let (link, mqtt_thread) = mqtt::new(
        cfg.mqtt.clone(),
        to_delivery.clone(),
        net_stop.clone(),
        command_subscription(&cfg, inbox),
    );
    // The retained `online` status at the first connect already tells these.
    link.set_status(
        &control::config_identity(&source.path, confirmed_push.as_ref()),
        ingest.backlog_estimate().unwrap_or(0),
    );
    let stats = Arc::new(DeliveryStats::default());
    let dcfg = delivery_config(&cfg);
    let spawn = |name: &str| std::thread::Builder::new().name(name.to_owned());
    let mqtt_handle = spawn("mqtt")
        .spawn(move || mqtt_thread.run())
        .map_err(|e| AgentError::Setup(format!("cannot start mqtt thread: {e}")))?;
    let delivery_handle = {
        let (stop, stats, link) = (net_stop.clone(), stats.clone(), link.clone());
        spawn("delivery")
            .spawn(move || publisher::run(delivery_spool, dcfg, link, delivery_rx, stop, stats))
            .map_err(|e| AgentError::Setup(format!("cannot start delivery thread: {e}")))?
    };
    // Delivery is running: now the whole-file check, if the file needs one.
    let verdict =
        check_reason.map(|why| crate::integrity::spawn_check(cfg.spool.path.clone(), why));
    let (ctl_tx, ctl_rx) = mpsc::channel::<Control>();
    let command_handle = {
        let wcfg = WorkerConfig {
            device_id: cfg.device_id.clone(),
            format: cfg.mqtt.payload_format,
            commands: cfg.commands.clone(),
        };
        let (stop, link, to_delivery) = (net_stop.clone(), link.clone(), to_delivery.clone());
        spawn("commands")
            .spawn(move || {
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
            })
            .map_err(|e| AgentError::Setup(format!("cannot start command thread: {e}")))?
    };
    forward_controls(ctl_rx, ingest_tx.clone());
    let readings_tx = ingest_tx;
    let readings_rx = ingest_rx;
    let (sampler_tx, sampler_rx) = mpsc::channel::<SamplerUpdate>();
    let sampler_handle = {
        let (stop, sources, path) = (stop.clone(), cfg.sources.clone(), cfg.spool.path.clone());
        spawn("sampler")
            .spawn(move || crate::sampler::run(sources, path, readings_tx, sampler_rx, stop))
            .map_err(|e| AgentError::Setup(format!("cannot start sampler thread: {e}")))?
    };

    let full_spool = open_full_spool(&cfg, &ingest)?;
    let mut ing = Ingest {
        full_spool,
        full_buffer: Vec::new(),
        push: confirmed_push,
        pending_push: None,
        delivery_stats: stats.clone(),
        config_sha: String::new(),
        cfg: cfg.clone(),
        source,
        link,
        sampler: sampler_tx,
        spool: ingest,
        ids,
        buffer: Vec::new(),
        to_delivery,
        appended: 0,
        dropped: 0,
        last_error_log: None,
        retry_at: None,
        upkeep: Upkeep::new(&cfg.spool.path, verdict),
        metrics: Default::default(),
        pending_counts: HashMap::new(),
        socket_counts: socket_ingest.counters(),
        notifier: crate::notify::Notifier::from_env(),
        heartbeat: crate::notify::Heartbeat::default(),
        tuning: tuning.as_ref().map(|p| p.derived),
        storage_backoff: storage_backoff(tuning.as_ref()),
    };
    ing.config_sha = ing.config_identity();
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
        ("delivery", stats.heartbeat.clone()),
    ]);
    ing.run_until_stopped(&readings_rx, &stop, &hup, &stats);
    socket_ingest.stop_intake();
    ing.notifier.stopping();
    // The loop also ends on a fatal condition: stop the sampler either way.
    stop.store(true, Ordering::Relaxed);
    signals.close();

    let lost = ing.stop_threads(
        &readings_rx,
        Threads {
            sampler: sampler_handle,
            command: command_handle,
            delivery: delivery_handle,
            mqtt: mqtt_handle,
            cmd_wake,
            net_stop,
        },
    );
    socket_ingest.finish();
    ing.store_socket_counts();
    ing.stop_metrics(metrics_listener);
    ing.record_end(run_id, lost)
}

/// The threads [`run`] started, for the stop.
struct Threads {
    sampler: std::thread::JoinHandle<()>,
    command: std::thread::JoinHandle<()>,
    delivery: std::thread::JoinHandle<()>,
    mqtt: std::thread::JoinHandle<()>,
    /// Wakes the command thread to see `net_stop`.
    cmd_wake: Sender<CmdMsg>,
    /// Stops the network threads (mqtt, delivery, commands).
    net_stop: Arc<AtomicBool>,
}

impl From<crate::integrity::OpenError> for AgentError {
    fn from(e: crate::integrity::OpenError) -> Self {
        match e {
            crate::integrity::OpenError::Spool(s) => AgentError::Spool(s),
            crate::integrity::OpenError::Refused(m) => AgentError::Setup(m),
        }
    }
}

impl Ingest {
    /// The stop: the sampler first, then every reading it produced is
    /// committed, then the network threads, each within a bound. Returns how
    /// many readings could not be committed.
    fn stop_threads(&mut self, readings_rx: &Receiver<IngestMsg>, t: Threads) -> usize {
        let _ = self.sampler.send(SamplerUpdate::Stop);
        let _ = t.sampler.join();
        self.commit_what_is_left(readings_rx);
        let lost = self.buffer.len() + self.full_buffer.len();
        t.net_stop.store(true, Ordering::Relaxed);
        // The network threads sleep until an event: wake each to see the flag.
        self.link.stop();
        let _ = self.to_delivery.send(DeliveryMsg::Stop);
        let _ = t.cmd_wake.send(CmdMsg::Wake);
        // Bounded: a connect attempt or a running command handler must not
        // hold the stop past the supervisor's timeout. Whatever they had in
        // flight is replayed (rows) or reported interrupted (commands) at the
        // next start.
        let deadline = Instant::now() + Duration::from_secs(3);
        join_within(t.command, deadline, "the command thread");
        join_within(t.delivery, deadline, "the delivery thread");
        join_within(t.mqtt, deadline, "the mqtt thread");
        lost
    }
}

/// SIGTERM/SIGINT set the first flag (stop), SIGHUP the second (reload).
fn signal_flags() -> Result<(Arc<AtomicBool>, Arc<AtomicBool>), AgentError> {
    let setup =
        |e: std::io::Error| AgentError::Setup(format!("cannot install signal handler: {e}"));
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(setup)?;
    }
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone()).map_err(setup)?;
    Ok((stop, hup))
}

/// Creates the spool's directory, takes the spool lock (held until the
/// returned guard drops) and refuses a network filesystem.
fn claim_spool(cfg: &Config) -> Result<SpoolLock, AgentError> {
    if let Some(dir) = cfg
        .spool
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir).map_err(|e| {
            AgentError::Setup(format!(
                "cannot create spool directory {}: {e}",
                dir.display()
            ))
        })?;
    }
    let lock = SpoolLock::acquire(&cfg.spool.path).map_err(AgentError::Setup)?;
    warn_loose_secrets(cfg);
    crate::fsguard::check_local_fs(&cfg.spool.path, cfg.spool.allow_network_fs)
        .map_err(AgentError::Setup)?;
    Ok(lock)
}

/// The ingest thread's connection: opened (migrated if needed), the WAL
/// brake set, the storage profile stored and the pragmas logged.
fn open_ingest_spool(
    cfg: &Config,
    tuning: Option<&crate::probe::Profile>,
) -> Result<Spool, AgentError> {
    let mut ingest = open_spool(cfg)?;
    for r in ingest.set_priorities(&cfg.stream_priorities())? {
        log::info!(
            "stream {}: delivery priority {} -> {} ({} unacknowledged rows moved with it)",
            r.stream,
            r.from,
            r.to,
            r.rows
        );
    }
    // The brake fires after the commit that crosses it, so it sits below
    // twice the threshold by about the largest transaction (a retention
    // batch), which keeps the WAL within twice the threshold.
    ingest
        .wal()
        .set_brake_frames((3 * cfg.spool.checkpoint_wal_bytes / 2 / WAL_FRAME_BYTES) as i64);
    if let Some(p) = tuning {
        if let Ok(json) = serde_json::to_string(p) {
            let _ = ingest.set_state("storage_profile", &json, wall_clock_ms().0);
        }
    }
    let p = ingest.pragmas().clone();
    log::info!(
        "spool {}: journal_mode={} synchronous={} busy_timeout={}ms journal_size_limit={} wal_autocheckpoint={}",
        cfg.spool.path.display(),
        p.journal_mode,
        p.synchronous,
        p.busy_timeout_ms,
        p.journal_size_limit,
        p.wal_autocheckpoint
    );
    Ok(ingest)
}

/// A connection that fsyncs at every commit (synchronous FULL): commands
/// and their results, and `durability = "full"` readings.
fn open_full_durability(cfg: &Config, ingest: &Spool) -> Result<Spool, AgentError> {
    let mut o = cfg.spool.options.clone();
    o.synchronous = crate::spool::Synchronous::Full;
    Ok(ingest.open_sibling(&o)?)
}

/// The connection for `durability = "full"` readings, sharing the ingest
/// connection's sequence counters.
fn open_full_spool(cfg: &Config, ingest: &Spool) -> Result<Spool, AgentError> {
    let mut s = open_full_durability(cfg, ingest)?;
    // One sequence counter per stream, whichever connection commits it.
    s.share_seqs(ingest);
    Ok(s)
}

/// The command subscription the MQTT thread makes (`None` with commands
/// off): each command publish goes to the command thread's inbox.
fn command_subscription(
    cfg: &Config,
    inbox: crate::commands::worker::Inbox,
) -> Option<mqtt::CommandSub> {
    cfg.commands.enabled.then(|| {
        let sink: mqtt::CommandSink = Box::new(move |epoch, publish| inbox.offer(epoch, publish));
        mqtt::CommandSub {
            topic: format!("{}/commands", cfg.mqtt.topic_prefix),
            max_payload_bytes: cfg.commands.max_payload_bytes,
            sink,
        }
    })
}

/// The delivery thread's settings, from `[mqtt]`.
fn delivery_config(cfg: &Config) -> DeliveryConfig {
    DeliveryConfig {
        topic_prefix: cfg.mqtt.topic_prefix.clone(),
        window: cfg.mqtt.inflight_window,
        max_payload_bytes: cfg.mqtt.max_payload_bytes,
        max_packet_bytes: cfg.mqtt.max_packet_bytes,
        fail_after_disconnects: cfg.mqtt.fail_after_disconnects,
        protocol: cfg.mqtt.protocol,
        min_share_pct: cfg.mqtt.min_share_pct,
        live_streams: cfg.live_first_streams(),
        batching: cfg.stream_batching(),
    }
}

/// Retry pacing for a spool that refuses writes, from the storage probe.
fn storage_backoff(tuning: Option<&crate::probe::Profile>) -> crate::backoff::Backoff {
    let (lo, hi) = tuning
        .map(|p| (p.derived.retry_min_ms, p.derived.retry_max_ms))
        .unwrap_or((100, 5000));
    crate::backoff::Backoff::new(Duration::from_millis(lo), Duration::from_millis(hi))
}

/// Measure the spool's device (or read its stored profile) and put the
/// derived knobs into `cfg` where the config leaves them unset
/// (`spool.tune_from_probe`).
fn tune_from_probe(cfg: &mut Config) -> Option<crate::probe::Profile> {
    if cfg.spool.tune_from_probe {
        let dir = spool_dir(cfg);
        match crate::probe::load_or_probe(&dir) {
            Ok((profile, fresh)) => {
                let m = &profile.measurements;
                let d = profile.derived;
                log::info!(
                    "storage probe ({}): fsync p50 {} us, p99 {} us, max {} us, write {:.1} MB/s -> commit window {} ms, checkpoint at {} WAL bytes, storage retry {}..{} ms, spool bound {} bytes",
                    if fresh { "measured now" } else { "stored profile" },
                    m.fsync_p50_us, m.fsync_p99_us, m.fsync_max_us,
                    m.write_bytes_per_sec as f64 / 1e6,
                    d.commit_window_ms, d.checkpoint_wal_bytes, d.retry_min_ms, d.retry_max_ms, d.max_spool_bytes
                );
                apply_tuning(cfg, &d);
                Some(profile)
            }
            Err(e) => {
                log::warn!(
                    "storage probe failed on {}: {e}; using the configured values",
                    dir.display()
                );
                None
            }
        }
    } else {
        None
    }
}

impl Ingest {
    /// At the stop: commit what the sampler produced and what is buffered
    /// (retrying for up to 10 s), and persist the sequence numbers.
    fn commit_what_is_left(&mut self, rx: &Receiver<IngestMsg>) {
        while let Ok(m) = rx.try_recv() {
            match m {
                IngestMsg::Reading(r) => self.push(r),
                IngestMsg::Count { name, by } => {
                    *self.pending_counts.entry(name).or_default() += by;
                }
                IngestMsg::Control(_) | IngestMsg::Wake => {}
            }
        }
        self.flush_counts();
        self.commit_full();
        let _ = self.spool.persist_seqs();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.buffer.is_empty() && Instant::now() < deadline {
            self.retry_at = None;
            self.commit();
            if !self.buffer.is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }

    /// Record how run `run_id` ended (`lost` readings could not be
    /// committed); after a clean end, settle the WAL and stamp the file so
    /// the next start can trust it without reading all of it.
    fn record_end(self, run_id: i64, lost: usize) -> Result<(), AgentError> {
        let mut ing = self;
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
            crate::integrity::write_stamp(&path);
        }
        log::info!("stopped cleanly; {appended} readings appended this run");
        Ok(())
    }
}

fn spool_dir(cfg: &Config) -> std::path::PathBuf {
    cfg.spool
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into())
}

/// Warn about secrets files that group or others can read.
fn warn_loose_secrets(cfg: &Config) {
    use std::os::unix::fs::PermissionsExt;
    let mut files = Vec::new();
    if let Some(t) = &cfg.mqtt.tls {
        if let Some((_, key)) = &t.client {
            files.push(("mqtt.client_key_file", key.clone()));
        }
    }
    if let Some((_, Some(p))) = &cfg.mqtt.credentials {
        files.push(("mqtt.password_file", p.clone()));
    }
    for (key, path) in files {
        match std::fs::metadata(&path) {
            Ok(m) if m.permissions().mode() & 0o077 != 0 => log::warn!(
                "{key} {} is readable by group or others (mode {:o}); chmod 600 it",
                path.display(),
                m.permissions().mode() & 0o777
            ),
            Ok(_) => {}
            Err(e) => log::warn!("{key} {}: {e}", path.display()),
        }
    }
}

/// Put the probe's derived knobs into `cfg` (`spool.tune_from_probe`),
/// except where the config set a key itself.
fn apply_tuning(cfg: &mut Config, d: &crate::probe::Derived) {
    if !cfg.spool.explicit.commit_window {
        cfg.spool.commit_window = Duration::from_millis(d.commit_window_ms);
    }
    if !cfg.spool.explicit.checkpoint_wal_bytes {
        cfg.spool.checkpoint_wal_bytes = d.checkpoint_wal_bytes;
    }
    let cap = &mut cfg.spool.capacity;
    cap.max_bytes = if cap.max_bytes == 0 {
        d.max_spool_bytes
    } else {
        cap.max_bytes.min(d.max_spool_bytes)
    };
}

struct Ingest {
    /// systemd's notification socket (READY, STATUS, STOPPING, WATCHDOG).
    notifier: crate::notify::Notifier,
    /// Stamped each time the ingest loop goes round, for the watchdog.
    heartbeat: crate::notify::Heartbeat,
    cfg: Config,
    source: ConfigSource,
    link: mqtt::Link,
    sampler: Sender<SamplerUpdate>,
    spool: Spool,
    ids: EventIdGen,
    buffer: Vec<NewEvent>,
    to_delivery: Sender<DeliveryMsg>,
    appended: u64,
    dropped: u64,
    last_error_log: Option<Instant>,
    retry_at: Option<Instant>,
    /// Storage bookkeeping for maintenance, capacity and `status`.
    upkeep: Upkeep,
    /// Counter increments not yet stored (a full disk refuses them too).
    pending_counts: HashMap<String, i64>,
    /// The ingest socket's counters, moved into the spool's at each summary.
    socket_counts: Option<Arc<crate::ingest::Counters>>,
    /// What the storage probe derived, re-applied over every reloaded config.
    tuning: Option<crate::probe::Derived>,
    /// Backoff for storage writes that failed transiently (busy, I/O).
    storage_backoff: crate::backoff::Backoff,
    /// Connection with `synchronous = FULL` for `durability = "full"` streams.
    full_spool: Spool,
    /// Readings of full-durability streams waiting for their (immediate) commit.
    full_buffer: Vec<NewEvent>,
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
}

/// What the ingest thread tracks about the spool between maintenance passes.
struct Upkeep {
    /// (device, inode) of the spool file at open.
    identity: Option<(u64, u64)>,
    /// Set when the agent must stop for its supervisor (spool replaced).
    fatal: Option<String>,
    /// The background integrity check, if one runs.
    verdict: Option<crate::integrity::Verdict>,
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
    /// Wall ms when the current set of health reasons began.
    health_since: i64,
    /// Readings the in-memory buffer refused since the last health pass.
    buffer_drops: u64,
    /// Rows FAILED as last seen by health, and when that count last grew.
    failed_seen: (u64, Option<Instant>),
    /// The last pass left retention or space to give back for the next one.
    more_work: bool,
    /// Last capacity check and its answer (checked at most once a second).
    capacity_checked: Option<Instant>,
    refusal: Option<crate::maintenance::Refusal>,
    /// A checkpoint found the WAL pinned by a reader.
    checkpoint_blocked: bool,
    /// Consecutive incomplete checkpoints: since when, how many.
    incomplete_run: Option<(Instant, u32)>,
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
}

impl Upkeep {
    fn new(spool: &Path, verdict: Option<crate::integrity::Verdict>) -> Upkeep {
        Upkeep {
            identity: crate::maintenance::file_identity(spool),
            fatal: None,
            verdict,
            damaged: false,
            last_checkpoint: Instant::now(),
            last_checkpoint_json: None,
            checkpoints: 0,
            seqs_persisted: Instant::now(),
            health_kinds: Vec::new(),
            health_stored_at: None,
            health_since: wall_clock_ms().0,
            buffer_drops: 0,
            failed_seen: (0, None),
            more_work: false,
            capacity_checked: None,
            refusal: None,
            checkpoint_blocked: false,
            incomplete_run: None,
            budget_since: (
                Instant::now(),
                crate::maintenance::proc_write_bytes().unwrap_or(0),
            ),
            full_commits: 0,
            last_refusal_log: None,
            last_checkpoint_error: None,
            disk_full: false,
            wall_anchor: (wall_clock_ms().0, Instant::now()),
            clock_step_logged: false,
        }
    }
}

impl Ingest {
    fn push(&mut self, ev: NewEvent) {
        if self.buffer.len() + self.full_buffer.len() >= MAX_BUFFERED {
            ev.refuse("not stored: the agent's in-memory buffer is full (the spool is not keeping up); retry later");
            self.dropped += 1;
            self.metrics.dropped += 1;
            self.upkeep.buffer_drops += 1;
            return;
        }
        if self.cfg.stream_durability(&ev.stream) == crate::stream::Durability::Full {
            self.full_buffer.push(ev);
            self.commit_full();
        } else {
            self.buffer.push(ev);
        }
    }

    /// Commit full-durability readings now, on the FULL connection. The same
    /// commit path as the batched one, run with the two connections and
    /// buffers exchanged for the call.
    fn commit_full(&mut self) {
        if self.full_buffer.is_empty() {
            return;
        }
        std::mem::swap(&mut self.spool, &mut self.full_spool);
        std::mem::swap(&mut self.buffer, &mut self.full_buffer);
        let retry_at = self.retry_at.take();
        self.commit();
        if self.buffer.is_empty() {
            self.upkeep.full_commits += 1;
        }
        self.retry_at = retry_at;
        std::mem::swap(&mut self.buffer, &mut self.full_buffer);
        std::mem::swap(&mut self.spool, &mut self.full_spool);
    }

    /// Commit the buffer in one transaction; on a transient error keep it and
    /// retry after a second.
    /// Refuse the buffered readings if the spool or the disk is at its limit,
    /// after dropping the oldest acknowledged rows first (I6: never an
    /// unacknowledged one). Checked at most once a second.
    fn capacity_refusal(&mut self) -> Option<crate::maintenance::Refusal> {
        let fresh = self
            .upkeep
            .capacity_checked
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
        if fresh {
            return self.upkeep.refusal;
        }
        let cap = self.cfg.spool.capacity;
        let dir = spool_dir(&self.cfg);
        let check = |spool: &Spool| -> Option<crate::maintenance::Refusal> {
            let (used, free_pages) = spool.usage().ok()?;
            let fs_free = crate::maintenance::fs_free_bytes(&dir).ok()?;
            crate::maintenance::capacity_check(&cap, used, free_pages, fs_free)
        };
        let mut refusal = check(&self.spool);
        if refusal.is_some() {
            // Policy: drop the oldest acknowledged rows first, in bounded batches.
            let mut purged = 0;
            for _ in 0..4 {
                match self
                    .spool
                    .purge_acked(i64::MAX, self.cfg.spool.purge_batch_rows)
                {
                    Ok(0) | Err(_) => break,
                    Ok(n) => purged += n,
                }
            }
            if purged > 0 {
                log::warn!("capacity: dropped the {purged} oldest acknowledged rows to make room");
                let _ = self.spool.count("events_purged_for_space", purged as i64);
                refusal = check(&self.spool);
            }
        }
        self.upkeep.capacity_checked = Some(Instant::now());
        if refusal.is_none() && self.upkeep.refusal.is_some() {
            log::info!("capacity: space is back; taking readings again");
        }
        self.upkeep.refusal = refusal;
        refusal
    }

    /// After SQLITE_FULL, ingest stays off until a TRUNCATE checkpoint has
    /// emptied the WAL into the database and the filesystem has headroom
    /// again (1 MiB, or the configured reserve if larger); otherwise new
    /// appends would eat freed space before the checkpoint and delivery
    /// records that need it.
    fn recovered_from_disk_full(&mut self) -> bool {
        let headroom = self.cfg.spool.capacity.min_free_bytes.max(1024 * 1024);
        let ok = matches!(self.spool.checkpoint(CheckpointMode::Truncate), Ok(r) if r.busy == 0)
            && crate::maintenance::fs_free_bytes(&spool_dir(&self.cfg))
                .is_ok_and(|f| f >= headroom);
        if ok {
            log::info!("disk has room again; taking readings again");
            self.upkeep.disk_full = false;
            self.upkeep.capacity_checked = None;
        }
        ok
    }

    /// Count `n` readings of the buffer as dropped for `reason`, per stream.
    fn drop_buffer(&mut self, reason: &str) -> usize {
        let mut by_stream: HashMap<String, i64> = HashMap::new();
        let why = format!("not stored: the spool refused new readings ({reason}); retry later");
        for ev in &self.buffer {
            *by_stream.entry(ev.stream.clone()).or_default() += 1;
            ev.refuse(&why);
        }
        let n = self.buffer.len();
        self.buffer.clear();
        self.metrics.dropped += n as u64;
        *self
            .pending_counts
            .entry(format!("readings_dropped_{reason}"))
            .or_default() += n as i64;
        for (stream, k) in by_stream {
            *self
                .pending_counts
                .entry(format!("readings_dropped_{reason}.{stream}"))
                .or_default() += k;
        }
        self.flush_counts();
        n
    }

    /// Store pending counter increments in one transaction; kept on failure
    /// (a full disk) and retried, so no drop goes uncounted.
    fn flush_counts(&mut self) {
        if self.pending_counts.is_empty() {
            return;
        }
        let counts: Vec<(String, i64)> = self
            .pending_counts
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        if self.spool.count_many(&counts).is_ok() {
            self.pending_counts.clear();
        }
    }

    /// Commit the buffer in one transaction. Busy: keep it and retry after a
    /// second. Disk full or over capacity: refuse these readings, counted.
    fn commit(&mut self) {
        self.flush_counts();
        if self.buffer.is_empty() || self.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        if self.upkeep.disk_full && !self.recovered_from_disk_full() {
            self.drop_buffer("disk_full");
            return;
        }
        if let Some(r) = self.capacity_refusal() {
            let n = self.drop_buffer(r.reason());
            if self
                .upkeep
                .last_refusal_log
                .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
            {
                log::error!("capacity: refusing new readings ({r}); {n} dropped now, counted as readings_dropped_{} (repeats logged every 30 s)", r.reason());
                self.upkeep.last_refusal_log = Some(Instant::now());
            }
            return;
        }
        let started = Instant::now();
        match self.spool.append(
            &self.buffer,
            &mut self.ids,
            &self.cfg.device_id,
            self.cfg.mqtt.payload_format,
            wall_clock_ms().0,
        ) {
            Ok(n) => {
                self.observe_commit(started.elapsed());
                self.appended += n as u64;
                self.buffer.clear();
                self.retry_at = None;
                self.storage_backoff.reset();
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
                self.checkpoint_if_due();
            }
            Err(SpoolError::Full { source, .. }) => {
                // A half-written transaction was rolled back; nothing partial stays.
                self.upkeep.disk_full = true;
                let n = self.drop_buffer("disk_full");
                self.upkeep.capacity_checked = None;
                if self
                    .upkeep
                    .last_refusal_log
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::error!("ingest: disk full ({source}); {n} readings refused, counted as readings_dropped_disk_full (repeats logged every 30 s)");
                    self.upkeep.last_refusal_log = Some(Instant::now());
                }
            }
            Err(e) => {
                self.retry_at = Some(Instant::now() + self.storage_backoff.next_delay());
                if self
                    .last_error_log
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::error!(
                        "ingest: commit of {} readings failed: {e}; kept in memory and retried (repeats logged every 30 s)",
                        self.buffer.len()
                    );
                    self.last_error_log = Some(Instant::now());
                }
            }
        }
        if self.dropped > 0
            && self
                .spool
                .count("readings_dropped_buffer_full", self.dropped as i64)
                .is_ok()
        {
            let why = if self.retry_at.is_some() || self.upkeep.disk_full {
                "while the spool refused writes"
            } else {
                "readings arrived faster than the spool could commit them"
            };
            log::error!(
                "ingest: {} readings dropped, counted as readings_dropped_buffer_full: the in-memory buffer ({MAX_BUFFERED} readings) was full {why}",
                self.dropped
            );
            self.dropped = 0;
        }
    }

    /// Run the checkpoint the policy asks for now, and record the outcome
    /// in memory (written to `agent_state` at the summary interval, not with
    /// a commit of its own each time).
    fn checkpoint_if_due(&mut self) {
        let written = self.spool.wal().frames_since_checkpoint() * WAL_FRAME_BYTES;
        let inputs = crate::maintenance::CheckpointInputs {
            written_bytes: written,
            threshold_bytes: self.cfg.spool.checkpoint_wal_bytes,
            since_last: self.upkeep.last_checkpoint.elapsed(),
            interval: self.cfg.spool.checkpoint_interval,
        };
        let Some(mode) = crate::maintenance::checkpoint_due(&inputs) else {
            return;
        };
        self.run_checkpoint(mode, written);
    }

    fn run_checkpoint(&mut self, mode: CheckpointMode, written: u64) {
        let wal = std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let t = Instant::now();
        let res = self.spool.checkpoint(mode);
        let took = t.elapsed();
        self.upkeep.last_checkpoint = Instant::now();
        self.upkeep.checkpoints += 1;
        let now = wall_clock_ms().0;
        match res {
            Ok(r) => {
                let incomplete = r.busy != 0 || r.checkpointed_frames < r.log_frames;
                // One incomplete PASSIVE is routine (the delivery thread was
                // mid-read); a reader pins the WAL when several in a row,
                // over seconds, cannot finish.
                let (first, n) = match (incomplete, self.upkeep.incomplete_run) {
                    (false, _) => (Instant::now(), 0),
                    (true, Some((t, n))) => (t, n + 1),
                    (true, None) => (Instant::now(), 1),
                };
                self.upkeep.incomplete_run = incomplete.then_some((first, n));
                let blocked = n >= 3 && first.elapsed() >= Duration::from_secs(2);
                self.upkeep.last_checkpoint_json = Some(
                    serde_json::json!({"mode": format!("{mode:?}").to_lowercase(), "busy": r.busy,
                    "log_frames": r.log_frames, "checkpointed_frames": r.checkpointed_frames,
                    "written_bytes_before": written, "wal_file_bytes_before": wal,
                    "duration_ms": took.as_millis() as u64, "at_ms": now}),
                );
                if blocked {
                    let _ = self.spool.count("wal_checkpoint_blocked", 1);
                    if !self.upkeep.checkpoint_blocked {
                        log::warn!("checkpoint {mode:?} blocked: busy={} log={} checkpointed={} wal_bytes={wal}: a reader is pinning the WAL; health degraded", r.busy, r.log_frames, r.checkpointed_frames);
                    }
                } else if self.upkeep.checkpoint_blocked {
                    log::info!(
                        "checkpoint {mode:?} completed again (log={}); WAL no longer pinned",
                        r.log_frames
                    );
                } else {
                    log::debug!(
                        "checkpoint {mode:?}: log={} checkpointed={} in {} ms",
                        r.log_frames,
                        r.checkpointed_frames,
                        took.as_millis()
                    );
                }
                self.upkeep.checkpoint_blocked = blocked;
            }
            Err(e) => {
                if self
                    .upkeep
                    .last_checkpoint_error
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::warn!(
                        "checkpoint {mode:?} failed: {e} (skipped; repeats logged every 30 s)"
                    );
                    self.upkeep.last_checkpoint_error = Some(Instant::now());
                }
            }
        }
    }

    /// The ingest loop: sleeps until a message or the nearest deadline
    /// (the open commit window, maintenance, the summary), never on a
    /// polling timer, so an idle agent wakes about once per maintenance pass.
    fn run_until_stopped(
        &mut self,
        rx: &Receiver<IngestMsg>,
        stop: &AtomicBool,
        hup: &AtomicBool,
        stats: &DeliveryStats,
    ) {
        let mut commit_at: Option<Instant> = None;
        let mut maint_at = Instant::now() + self.maintenance_period();
        let mut summary_at = Instant::now() + self.cfg.agent.summary_interval;
        while !stop.load(Ordering::Relaxed) {
            self.heartbeat.beat();
            let mut next = maint_at.min(summary_at);
            if let Some(c) = commit_at {
                next = next.min(c);
            }
            if !self.full_buffer.is_empty() || self.pending_push.is_some() {
                // A full-durability commit that failed retries soon; a pushed
                // config waits for its confirmation.
                next = next.min(Instant::now() + Duration::from_millis(200));
            }
            match rx.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Ok(IngestMsg::Reading(ev)) => self.push(ev),
                Ok(IngestMsg::Control(c)) => self.control(c),
                Ok(IngestMsg::Count { name, by }) => {
                    *self.pending_counts.entry(name).or_default() += by;
                    // Stored by the next commit (which flushes counts first):
                    // one write per window however many arrive.
                    commit_at.get_or_insert_with(|| Instant::now() + self.cfg.spool.commit_window);
                }
                Ok(IngestMsg::Wake) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if hup.swap(false, Ordering::Relaxed) {
                log::info!("SIGHUP: reloading {}", self.source.path.display());
                match self.reload() {
                    Ok(v) => log::info!("config reloaded: {v}"),
                    Err(e) => log::error!("{e}"),
                }
            }
            let now = Instant::now();
            self.judge_pending_push();
            // Full-durability readings that could not commit at once retry here.
            self.commit_full();
            if !self.buffer.is_empty() && commit_at.is_none() {
                // The window opens with its first reading.
                commit_at = Some(now + self.cfg.spool.commit_window);
            }
            if commit_at.is_some_and(|c| now >= c) {
                self.commit();
                commit_at = (!self.buffer.is_empty()).then(|| now + self.cfg.spool.commit_window);
            }
            if now >= maint_at {
                self.maintain();
                maint_at = now
                    + if self.upkeep.more_work {
                        MAINTENANCE_AGAIN
                    } else {
                        self.maintenance_period()
                    };
                if self.upkeep.fatal.is_some() {
                    break;
                }
            }
            if now >= summary_at {
                self.summary(stats);
                summary_at = now + self.cfg.agent.summary_interval;
            }
        }
    }

    /// Maintenance (retention, checkpoints, health) runs this often.
    fn maintenance_period(&self) -> Duration {
        self.cfg
            .spool
            .checkpoint_interval
            .min(Duration::from_secs(5))
    }

    /// Append an event on the `_agent` stream (config fallbacks and the like),
    /// so operators see it on `<topic_prefix>/events/_agent`.
    fn agent_event(&mut self, kind: &str, detail: &str) {
        let (ts_ms, clock_trusted) = wall_clock_ms();
        self.push(NewEvent {
            replay: None,
            stream: AGENT_STREAM.into(),
            ts_ms,
            clock_trusted,
            fields: vec![
                (
                    "event".into(),
                    crate::reading::FieldValue::Text(kind.into()),
                ),
                (
                    "detail".into(),
                    crate::reading::FieldValue::Text(detail.into()),
                ),
            ],
            key: None,
            reply: None,
        });
    }

    /// Retention in bounded batches with a checkpoint between them (F02), the
    /// checkpoint policy, the spool-file identity check, and the health and
    /// write-budget record for `status`.
    fn maintain(&mut self) {
        let found = self
            .upkeep
            .verdict
            .as_ref()
            .and_then(|v| v.lock().unwrap_or_else(|p| p.into_inner()).clone());
        if let Some(damage) = found {
            let msg = format!(
                "spool {} is damaged ({damage}); stopping to move it aside and start a fresh spool",
                self.cfg.spool.path.display()
            );
            log::error!("{msg}");
            self.upkeep.fatal = Some(msg);
            self.upkeep.damaged = true;
            return;
        }
        if let Some(id) = self.upkeep.identity {
            if crate::maintenance::file_identity(&self.cfg.spool.path) != Some(id) {
                let msg = format!(
                    "spool {} was removed or replaced under the running agent; stopping without claiming durability (the supervisor restarts a clean process)",
                    self.cfg.spool.path.display()
                );
                log::error!("{msg}");
                self.upkeep.fatal = Some(msg);
                return;
            }
        }
        let retention_ms = self.cfg.spool.acked_retention.as_millis() as i64;
        let (anchor_wall, anchor_mono) = self.upkeep.wall_anchor;
        let expected = anchor_wall + anchor_mono.elapsed().as_millis() as i64;
        let wall = wall_clock_ms().0;
        let now = crate::maintenance::retention_now(wall, expected);
        if now != wall && !self.upkeep.clock_step_logged {
            log::warn!(
                "wall clock stepped by {} s since start; retention keeps judging ages by monotonic time",
                (wall - expected) / 1000
            );
            self.upkeep.clock_step_logged = true;
        }
        let cutoff = now - retention_ms;
        let mut purged = 0;
        // A pass holds the write lock for at most about MAINTENANCE_BUDGET
        // (the delivery thread's commits wait behind it); what is left is
        // done at the next pass, which then comes sooner.
        let started = Instant::now();
        self.upkeep.more_work = false;
        loop {
            if started.elapsed() >= MAINTENANCE_BUDGET {
                self.upkeep.more_work = true;
                break;
            }
            match self
                .spool
                .purge_acked(cutoff, self.cfg.spool.purge_batch_rows)
            {
                Ok(0) => break,
                Ok(n) => {
                    purged += n;
                    self.run_checkpoint(CheckpointMode::Passive, 0);
                }
                Err(e) => {
                    log::warn!("retention skipped: {e}");
                    break;
                }
            }
        }
        if purged > 0 {
            log::debug!("retention: deleted {purged} acknowledged rows");
        }
        self.persist_seqs_if_due();
        if !self.upkeep.more_work {
            self.shrink_step();
        }
        self.checkpoint_if_due();
        self.record_health();
    }

    /// Sequence numbers reach `streams` once a minute or every 10,000
    /// readings (an append writes only its rows; a restart reads the rows
    /// appended since the last persist, so this bounds startup work).
    fn persist_seqs_if_due(&mut self) {
        let due = self.spool.appended_since_persist() >= 10_000
            || self.upkeep.seqs_persisted.elapsed() >= Duration::from_secs(60);
        if due && self.spool.persist_seqs().is_ok() {
            self.upkeep.seqs_persisted = Instant::now();
        }
    }

    /// Give free pages back in a bounded step (at most 4 MiB a pass) once
    /// they exceed the live data plus 8 MiB, then let the checkpoint policy
    /// copy the moved pages (issue: the spool gives space back).
    fn shrink_step(&mut self) {
        match self.spool.shrink_step(8 * 1024 * 1024, SHRINK_STEP_PAGES) {
            Ok(0) => {}
            Ok(n) => {
                log::debug!("spool: gave {n} free pages back to the filesystem");
                self.upkeep.more_work = n >= SHRINK_STEP_PAGES;
                // The moved pages go to the database now, one step at a time.
                self.run_checkpoint(CheckpointMode::Passive, 0);
            }
            Err(e) => {
                if self
                    .upkeep
                    .last_checkpoint_error
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::warn!("incremental vacuum skipped: {e}");
                    self.upkeep.last_checkpoint_error = Some(Instant::now());
                }
            }
        }
    }

    /// Health and write budget into `agent_state`, for `status`.
    /// The health line, stored only when it changes (a commit twice a
    /// second whatever the rate was a large share of the flash writes).
    fn record_health(&mut self) {
        let link = self.link.health_facts();
        let dropping = if let Some(r) = self.upkeep.refusal {
            Some(r.to_string())
        } else if self.upkeep.disk_full {
            Some("disk full".to_owned())
        } else if std::mem::take(&mut self.upkeep.buffer_drops) > 0 {
            Some(
                "the in-memory buffer overflowed (readings arrive faster than they commit)"
                    .to_owned(),
            )
        } else {
            None
        };
        let facts = crate::health::Facts {
            connected: link.connected,
            state_for: link.state_for,
            last_error: link.last_error,
            broker: format!("{}:{}", self.cfg.mqtt.host, self.cfg.mqtt.port),
            in_flight: link.in_flight,
            no_puback_for: link.no_puback_for,
            quick_drops: link.quick_drops,
            commands_unavailable: link.commands_unavailable,
            failed_since_start: self.recent_failures(),
            checkpoint_blocked: self.upkeep.checkpoint_blocked,
            dropping,
            config_fallback: self.source.fallback.is_some(),
        };
        // Judged once a maintenance pass: a pass early, so `degraded` is
        // recorded within the bound, not up to a pass after it.
        let bound = crate::health::grace(self.cfg.mqtt.keep_alive)
            .saturating_sub(self.maintenance_period());
        let health = crate::health::assess(&facts, bound);
        if let Ok(backlog) = self.spool.backlog_estimate() {
            self.link.set_status(&self.config_sha, backlog);
        }
        // Each reason is logged once when it appears (by its wording
        // without figures), and again only after it went away.
        let kinds: Vec<String> = health.reasons.iter().map(|r| without_digits(r)).collect();
        for (reason, kind) in health.reasons.iter().zip(&kinds) {
            if !self.upkeep.health_kinds.contains(kind) {
                log::warn!("health degraded: {reason}");
            }
        }
        if health.reasons.is_empty() && !self.upkeep.health_kinds.is_empty() {
            log::info!("health ok again");
        }
        if kinds != self.upkeep.health_kinds {
            self.upkeep.health_since = wall_clock_ms().0;
        }
        let record = serde_json::json!({
            "state": if health.reasons.is_empty() { "ok" } else { "degraded" },
            "reasons": health.reasons,
            "since_ms": self.upkeep.health_since,
        });
        let stale = self
            .upkeep
            .health_stored_at
            .is_none_or(|t| t.elapsed() >= self.cfg.agent.summary_interval);
        if self.upkeep.health_kinds == kinds && !stale {
            return;
        }
        self.upkeep.health_kinds = kinds;
        if self
            .spool
            .set_state("health", &record.to_string(), wall_clock_ms().0)
            .is_ok()
        {
            self.upkeep.health_stored_at = Some(Instant::now());
        }
    }

    /// Rows FAILED since start, while the last one is under 10 minutes old
    /// (then health may be ok again; `status` keeps the rows and reasons).
    fn recent_failures(&mut self) -> u64 {
        let failed = self.delivery_stats.failed.load(Ordering::Relaxed);
        if failed > self.upkeep.failed_seen.0 {
            self.upkeep.failed_seen = (failed, Some(Instant::now()));
        }
        match self.upkeep.failed_seen.1 {
            Some(t) if t.elapsed() < Duration::from_secs(600) => failed,
            _ => 0,
        }
    }

    /// What this run has cost the flash so far, for `status`: bytes the
    /// kernel sent to the block layer for this process (`/proc/self/io`),
    /// commits on every connection, checkpoints, and what follows per hour,
    /// per reading and per day.
    fn write_budget(&self) -> serde_json::Value {
        let (since, bytes0) = self.upkeep.budget_since;
        let bytes = crate::maintenance::proc_write_bytes()
            .unwrap_or(bytes0)
            .saturating_sub(bytes0);
        let elapsed = since.elapsed();
        let commits = self.spool.wal().commits();
        let checkpoints = self.upkeep.checkpoints;
        // synchronous=NORMAL fsyncs only at checkpoints (the WAL, then the
        // database: https://www.sqlite.org/wal.html#sync); FULL at every commit.
        let fsyncs = 2 * checkpoints + self.upkeep.full_commits;
        let per_hour = |n: u64| crate::maintenance::per_hour(n, elapsed);
        let readings = self.appended.max(1);
        serde_json::json!({
            "window_secs": elapsed.as_secs(),
            "write_bytes_total": bytes,
            "write_bytes_per_hour": per_hour(bytes),
            "commits_total": commits,
            "commits_per_hour": per_hour(commits),
            "checkpoints_total": checkpoints,
            "checkpoints_per_hour": per_hour(checkpoints),
            "fsyncs_estimated_total": fsyncs,
            "fsyncs_estimated_per_hour": per_hour(fsyncs),
            "readings_total": self.appended,
            "bytes_per_reading": bytes / readings,
            "projected_mb_per_day": per_hour(bytes) as f64 * 24.0 / 1e6,
            "wal_file_bytes": std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
                .map(|m| m.len())
                .unwrap_or(0),
        })
    }

    fn summary(&mut self, stats: &DeliveryStats) {
        let mut states = vec![
            ("write_budget", self.write_budget().to_string()),
            ("latency", self.latency_json().to_string()),
        ];
        if let Some(c) = &self.upkeep.last_checkpoint_json {
            states.push(("last_checkpoint", c.to_string()));
        }
        let _ = self.spool.set_states(&states, wall_clock_ms().0);
        let wal = std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let (backlog, age) = self.backlog_and_age();
        let line = format!(
            "summary: appended={} submitted={} retired={} requeued={} failed={} buffered={} wal_bytes={wal} backlog={backlog} oldest_unacked_secs={} connected={} dropped={}",
            self.appended,
            stats.submitted.load(Ordering::Relaxed),
            stats.retired.load(Ordering::Relaxed),
            stats.requeued.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
            self.buffer.len(),
            age.map_or(0, |a| a.as_secs()),
            u8::from(self.link.connected()),
            self.metrics.dropped,
        );
        log::info!("{line}");
        self.notifier.status(&line);
        self.store_socket_counts();
        self.publish_metrics(true, true);
    }
}
