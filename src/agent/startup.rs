//! Starting the agent: the spool claimed (directory, lock, local
//! filesystem), the confirmed config push composed on the local config, the
//! storage probe's knobs, the spool's connections opened, the settings each
//! thread gets.
//!
//! One rule: nothing here starts delivery or takes a reading; a start that
//! fails leaves the spool as it found it.

use super::{AgentError, ConfigSource, IngestMsg};
use crate::config::Config;
use crate::delivery::DeliveryConfig;
use crate::event::envelope::wall_clock_ms;
use crate::flash::upkeep::{brake_frames, UpkeepSettings};
use crate::flash::write_budget::BudgetSettings;
use crate::mqtt;
use crate::os::fsguard::SpoolLock;
use crate::spool::Spool;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

/// Open the configured spool, moving a damaged one aside
/// ([`crate::spool::integrity::open_spool_seen`]), judged on `before`: what its
/// directory showed before anything opened it.
pub fn open_spool(
    cfg: &Config,
    before: crate::spool::integrity::Before,
) -> Result<Spool, AgentError> {
    Ok(open_spool_judged(cfg, before)?.spool)
}

/// [`open_spool`], with what the open found lost
/// ([`crate::spool::integrity::Opened::lost`]).
fn open_spool_judged(
    cfg: &Config,
    before: crate::spool::integrity::Before,
) -> Result<crate::spool::integrity::Opened, AgentError> {
    Ok(crate::spool::integrity::open_spool_judged(
        &cfg.spool.path,
        &cfg.spool.options,
        before,
    )?)
}

/// The local config with the confirmed config push kept in the state
/// directory on top, if there is one and the local policy still allows it
/// (a push the local file no longer allows is ignored, loudly).
pub(super) fn with_confirmed_push(
    local: Config,
    source: &ConfigSource,
) -> (Config, Option<crate::push::Stored>) {
    let Some(stored) = crate::push::load(&spool_dir(&local)) else {
        return (local, None);
    };
    let (text_path, text) = if source.fallback.is_some() {
        (
            crate::config::file::last_good_path(&source.path),
            crate::config::file::last_good_text(&source.path),
        )
    } else {
        let text = std::fs::read_to_string(&source.path)
            .map_err(|e| format!("cannot read {}: {e}", source.path.display()));
        (source.path.clone(), text)
    };
    let composed = text.and_then(|text| {
        let push = crate::push::policy::check(&local, &stored.text, stored.signature.as_deref())?;
        crate::push::compose(
            &local,
            &text,
            &text_path.display().to_string(),
            &source.sets,
            &push,
        )
    });
    let composed = composed.and_then(|cfg| kept_signed(&local, cfg, &stored));
    match composed {
        Ok(cfg) => {
            log::info!(
                "running the local config with the confirmed config push (sha256 {})",
                crate::config::file::sha256_hex(stored.text.as_bytes())
            );
            (cfg, Some(stored))
        }
        Err(e) => {
            log::warn!(
                "the stored config push {} is ignored: {e}; running the local config alone",
                spool_dir(&local).join("config-push.toml").display()
            );
            (local, None)
        }
    }
}

/// `cfg` composed from `stored` when `stored` is unsigned, or signed with the
/// serial the spool records as kept; a stored signed config with any other
/// serial (an older file put back, one from before serials) is refused.
fn kept_signed(
    local: &Config,
    cfg: Config,
    stored: &crate::push::Stored,
) -> Result<Config, String> {
    if stored.signature.is_none() {
        return Ok(cfg);
    }
    let kept = crate::spool::Spool::open_read_only(&local.spool.path)
        .ok()
        .and_then(|s| {
            s.state(crate::push::policy::KEPT_SERIAL_STATE_KEY)
                .ok()
                .flatten()
        })
        .and_then(|v| v.parse::<u64>().ok());
    match (cfg.signed_serial, kept) {
        (Some(s), Some(k)) if s == k => Ok(cfg),
        (s, k) => Err(format!(
            "it is a signed config with serial {}, and the serial this board kept is {}",
            s.map_or("none".to_owned(), |s| s.to_string()),
            k.map_or("none".to_owned(), |k| k.to_string())
        )),
    }
}

/// SIGTERM/SIGINT set the first flag (stop), SIGHUP the second (reload).
pub(super) fn signal_flags() -> Result<(Arc<AtomicBool>, Arc<AtomicBool>), AgentError> {
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

/// A thread that blocks on SIGTERM, SIGINT and SIGHUP and wakes the ingest
/// thread (the flags themselves are set by the handlers registered in
/// [`run`]). Close the returned handle to end it.
pub(super) fn wake_on_signals(
    tx: Sender<IngestMsg>,
) -> Result<signal_hook::iterator::Handle, AgentError> {
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

/// Refuses what [`check_places`] refuses, creates the spool's directory
/// (mode 0750) and judges it again, takes the spool lock (held until the
/// returned guard drops) and refuses a network filesystem.
pub(super) fn claim_spool(cfg: &Config, config_file: &Path) -> Result<SpoolLock, AgentError> {
    use crate::os::fsguard::dirs::{check, Role};
    check_places(cfg, config_file).map_err(AgentError::Setup)?;
    let dir = spool_dir(cfg);
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o750)
        .create(&dir)
        .map_err(|e| {
            AgentError::Setup(format!(
                "cannot create spool directory {}: {e}",
                dir.display()
            ))
        })?;
    check(Role::Spool, &dir).map_err(AgentError::Setup)?;
    let lock = SpoolLock::acquire(&cfg.spool.path).map_err(AgentError::Setup)?;
    warn_loose_secrets(cfg);
    note_local_broker_pubacks(cfg);
    if let Some(caution) = cfg.commands.caution() {
        log::warn!("{caution}");
    }
    crate::os::fsguard::check_local_fs(&cfg.spool.path, cfg.spool.allow_network_fs)
        .map_err(AgentError::Setup)?;
    Ok(lock)
}

/// What `run` refuses before it creates anything, for this process's uid:
/// a config directory, state directory or spool directory another user
/// could write or owns ([`crate::os::fsguard::dirs::check`]), a spool
/// directory this uid cannot write (or create), and a spool file another
/// user owns or may write or this uid cannot write. `edgespool test` calls
/// it too, so it says what `run` will.
///
/// Errors: the first refusal, naming the path and the fix.
pub fn check_places(cfg: &Config, config_file: &Path) -> Result<(), String> {
    use crate::os::fsguard::dirs::{check, check_writable, Role};
    let parent = |p: &Path| {
        p.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    };
    let config_dir = parent(config_file);
    check(Role::Config, &config_dir)?;
    let state_dir = parent(&crate::config::file::last_good_path(config_file));
    if state_dir != config_dir {
        check(Role::State, &state_dir)?;
    }
    // Judged before it is made too: a parent others can write is refused
    // before anything is created under it.
    let dir = spool_dir(cfg);
    check(Role::Spool, &dir)?;
    check_writable(Role::Spool, &dir)?;
    check_spool_file(&cfg.spool.path)
}

/// Refuse an existing spool file that another user owns or may write:
/// SQLite gives its `-wal` and `-shm` the database file's owner, and
/// whoever may write it may write rows the board then publishes as its own.
/// One this uid may not write would fail at the first open.
fn check_spool_file(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata(path) else {
        return Ok(()); // not there yet: created by the agent
    };
    let me = crate::os::fsguard::files::euid();
    let shown = path.display();
    if m.uid() != 0 && m.uid() != me {
        return Err(format!(
            "spool {shown} is owned by uid {}, not by root or this agent (uid {me}): chown {me} {shown} (and its -wal and -shm)",
            m.uid()
        ));
    }
    if m.is_file() && m.mode() & 0o022 != 0 {
        return Err(format!(
            "spool {shown} is writable by group or others (mode {:o}): chmod go-w {shown}",
            m.mode() & 0o7777
        ));
    }
    crate::os::fsguard::dirs::may_read_write(path).map_err(|e| {
        format!("spool {shown} cannot be read and written by this agent (uid {me}): {e}; chown {me} {shown} and chmod u+rw {shown}")
    })
}

/// The writer's connection: opened (migrated if needed), the WAL
/// brake set, the storage profile stored and the pragmas logged; with what
/// the open found lost.
pub(super) fn open_ingest_spool(
    cfg: &Config,
    tuning: Option<&crate::flash::probe::Profile>,
    before: crate::spool::integrity::Before,
) -> Result<crate::spool::integrity::Opened, AgentError> {
    let crate::spool::integrity::Opened {
        spool: mut ingest,
        lost,
    } = open_spool_judged(cfg, before)?;
    for r in ingest.set_priorities(&cfg.stream_priorities())? {
        log::info!(
            "stream {}: delivery priority {} -> {} ({} unacknowledged rows moved with it)",
            r.stream,
            r.from,
            r.to,
            r.rows
        );
    }
    ingest
        .wal()
        .set_brake_frames(brake_frames(cfg.spool.checkpoint_wal_bytes));
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
    Ok(crate::spool::integrity::Opened {
        spool: ingest,
        lost,
    })
}

/// A connection that fsyncs at every commit (synchronous FULL): commands
/// and their results, and `durability = "full"` readings.
pub(super) fn open_full_durability(cfg: &Config, ingest: &Spool) -> Result<Spool, AgentError> {
    let mut o = cfg.spool.options.clone();
    o.synchronous = crate::spool::Synchronous::Full;
    Ok(ingest.open_sibling(&o)?)
}

/// The connection for `durability = "full"` readings, sharing the ingest
/// connection's sequence counters.
pub(super) fn open_full_spool(cfg: &Config, ingest: &Spool) -> Result<Spool, AgentError> {
    let mut s = open_full_durability(cfg, ingest)?;
    // One sequence counter per stream, whichever connection commits it.
    s.share_seqs(ingest);
    Ok(s)
}

/// The command subscription the MQTT thread makes (`None` with commands
/// off): each command publish goes to the command thread's inbox.
pub(super) fn command_subscription(
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

/// The storage upkeep's settings, from `[spool]` (after the probe's knobs,
/// [`apply_tuning`]).
pub(super) fn upkeep_settings(cfg: &Config) -> UpkeepSettings {
    let s = &cfg.spool;
    UpkeepSettings {
        acked_retention: s.acked_retention,
        purge_batch_rows: s.purge_batch_rows,
        checkpoint_interval: s.checkpoint_interval,
        checkpoint_wal_bytes: s.checkpoint_wal_bytes,
        capacity: s.capacity,
        budget: BudgetSettings {
            bytes_per_day: s.write_budget_bytes_per_day,
            base_window: s.commit_window,
            // The probe may derive a base above it: the base wins.
            max_window: s.max_commit_window.max(s.commit_window),
        },
    }
}

/// The delivery thread's settings, from `[mqtt]`.
pub(super) fn delivery_config(cfg: &Config) -> DeliveryConfig {
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
        retire_on: cfg.mqtt.retire_on,
        receipt_timeout: cfg.mqtt.receipt_timeout,
        receipt_window: cfg.mqtt.receipt_window,
        device_id: cfg.device_id.clone(),
        receipt_keys: cfg.mqtt.receipt_public_keys.clone(),
        backfill: cfg.mqtt.backfill().then(|| {
            (
                cfg.mqtt.holdings_topic(),
                cfg.mqtt.holdings_interval,
                cfg.mqtt.backfill_rows_per_sec,
            )
        }),
    }
}

/// Retry pacing for a spool that refuses writes, from the storage probe.
pub(super) fn storage_backoff(
    tuning: Option<&crate::flash::probe::Profile>,
) -> crate::os::backoff::Backoff {
    let (lo, hi) = tuning
        .map(|p| (p.derived.retry_min_ms, p.derived.retry_max_ms))
        .unwrap_or((100, 5000));
    crate::os::backoff::Backoff::new(Duration::from_millis(lo), Duration::from_millis(hi))
}

/// Measure the spool's device (or read its stored profile) and put the
/// derived knobs into `cfg` where the config leaves them unset
/// (`spool.tune_from_probe`); then log the bounds in force and where each
/// comes from ([`bounds_in_force`]), probe or not.
pub(super) fn tune_from_probe(cfg: &mut Config) -> Option<crate::flash::probe::Profile> {
    let configured = cfg.spool.clone();
    let profile = if cfg.spool.tune_from_probe {
        let dir = spool_dir(cfg);
        match crate::flash::probe::load_or_probe(&dir) {
            Ok((profile, fresh)) => {
                let m = &profile.measurements;
                let d = profile.derived;
                // What the probe proposes; the line after says what is in force.
                log::info!(
                    "storage probe ({}): fsync p50 {} us, p99 {} us, max {} us, write {:.1} MB/s, {} bytes free -> proposes commit window {} ms, checkpoint at {} WAL bytes, storage retry {}..{} ms, spool bound {} bytes (half the free space)",
                    if fresh { "measured now" } else { "stored profile" },
                    m.fsync_p50_us, m.fsync_p99_us, m.fsync_max_us,
                    m.write_bytes_per_sec as f64 / 1e6, m.fs_free_bytes,
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
    };
    log::info!(
        "{}",
        bounds_in_force(
            &configured,
            profile.as_ref().map(|p| &p.derived),
            &cfg.spool
        )
    );
    profile
}

/// The start-up line of the bounds in force: the commit window, the
/// checkpoint threshold and the spool bound, each with where it comes from
/// (the config key, the probe, or the default), from the `[spool]` settings
/// as `configured`, the probe's `derived` knobs (`None`: no probe) and the
/// settings `in_force` after [`apply_tuning`]. Issue 36: the line once gave
/// the probe's 42 GB bound while `spool.max_bytes` held it to 1 GiB.
pub(super) fn bounds_in_force(
    configured: &crate::config::SpoolConfig,
    derived: Option<&crate::flash::probe::Derived>,
    in_force: &crate::config::SpoolConfig,
) -> String {
    let probe = |set: bool| match (set, derived) {
        (true, _) => None,
        (false, Some(_)) => Some("the storage probe"),
        (false, None) => Some("default"),
    };
    let window = probe(configured.explicit.commit_window).unwrap_or("spool.commit_window_ms");
    let checkpoint =
        probe(configured.explicit.checkpoint_wal_bytes).unwrap_or("spool.checkpoint_wal_bytes");
    let (max, set) = (in_force.capacity.max_bytes, configured.capacity.max_bytes);
    let bound = match derived {
        _ if max == 0 => "spool bound: none (spool.max_bytes = 0)".to_owned(),
        Some(_) if set == 0 => format!(
            "spool bound {max} bytes (the storage probe: half the free space; spool.max_bytes unset)"
        ),
        Some(d) if d.max_spool_bytes < set => format!(
            "spool bound {max} bytes (the storage probe: half the free space, under spool.max_bytes {set})"
        ),
        Some(d) => format!(
            "spool bound {max} bytes (spool.max_bytes; the probe proposed {})",
            d.max_spool_bytes
        ),
        None => format!("spool bound {max} bytes (spool.max_bytes)"),
    };
    format!(
        "bounds in force: commit window {} ms ({window}), checkpoint at {} WAL bytes ({checkpoint}), {bound}, free space reserve {} bytes (spool.min_free_bytes)",
        in_force.commit_window.as_millis(),
        in_force.checkpoint_wal_bytes,
        in_force.capacity.min_free_bytes
    )
}

/// Put the probe's derived knobs into `cfg` (`spool.tune_from_probe`),
/// except where the config set a key itself.
pub(super) fn apply_tuning(cfg: &mut Config, d: &crate::flash::probe::Derived) {
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

pub(super) fn spool_dir(cfg: &Config) -> std::path::PathBuf {
    cfg.spool
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into())
}

/// A broker on this board (a loopback address) acknowledges a row when it
/// has it, not when the fleet stored it: say so once at start, naming
/// `mqtt.retire_on`, unless rows already wait for receipts. An INFO line,
/// not a WARN (issue 36): the demo and the quick start talk to a local
/// broker that is the end of the line, and nothing there is to be acted
/// on; docs/fleet.md tells a board behind a local relay what to do.
fn note_local_broker_pubacks(cfg: &Config) {
    if cfg.mqtt.retire_on == crate::mqtt::RetireOn::Receipt {
        return;
    }
    let host = cfg.mqtt.host.trim_start_matches('[').trim_end_matches(']');
    let local = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if local {
        log::info!(
            "mqtt.url points at a broker on this board ({}): its PUBACK proves only that the local broker holds a row, not that the fleet stored it (a local broker restarted, or its bridge queue full, loses rows it acknowledged); rows are retired on that PUBACK. Set mqtt.retire_on = \"receipt\" where a sink sends receipts",
            cfg.mqtt.host
        );
    }
}

/// Warn about secrets files that group or others can read.
pub(super) fn warn_loose_secrets(cfg: &Config) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn derived(max_spool_bytes: u64) -> crate::flash::probe::Derived {
        crate::flash::probe::Derived {
            commit_window_ms: 200,
            checkpoint_wal_bytes: 1_000_000,
            retry_min_ms: 10,
            retry_max_ms: 1000,
            max_spool_bytes,
        }
    }

    fn config() -> Config {
        let text = "device_id = \"t\"\n[spool]\npath = \"/tmp/unused.db\"\n";
        crate::config::parse(text, "t.toml", &[]).expect("a minimal config")
    }

    fn spool(max_bytes: u64) -> crate::config::SpoolConfig {
        let mut cfg = config();
        cfg.spool.capacity.max_bytes = max_bytes;
        cfg.spool
    }

    /// Issue 36: the start-up log gave the probe's 42 GB bound while
    /// `spool.max_bytes` held the spool to 1 GiB.
    #[test]
    fn the_bounds_logged_are_the_bounds_in_force_with_where_they_come_from() {
        const GIB: u64 = 1 << 30;
        let d = derived(42_000_000_000);
        let configured = spool(GIB);
        let mut cfg = config();
        cfg.spool = configured.clone();
        apply_tuning(&mut cfg, &d);
        let line = bounds_in_force(&configured, Some(&d), &cfg.spool);
        assert!(
            line.contains(
                "spool bound 1073741824 bytes (spool.max_bytes; the probe proposed 42000000000)"
            ),
            "{line}"
        );
        assert!(
            line.contains("commit window 200 ms (the storage probe)"),
            "{line}"
        );
        // Unset, the probe's bound is the bound, and says so.
        let configured = spool(0);
        cfg.spool = configured.clone();
        apply_tuning(&mut cfg, &d);
        let line = bounds_in_force(&configured, Some(&d), &cfg.spool);
        assert!(
            line.contains("spool bound 42000000000 bytes (the storage probe"),
            "{line}"
        );
        // A probe bound under the configured one wins, and says so.
        let small = derived(GIB / 2);
        let configured = spool(GIB);
        cfg.spool = configured.clone();
        apply_tuning(&mut cfg, &small);
        let line = bounds_in_force(&configured, Some(&small), &cfg.spool);
        assert!(
            line.contains("spool bound 536870912 bytes (the storage probe: half the free space, under spool.max_bytes 1073741824)"),
            "{line}"
        );
        // No probe: the configured values, or the defaults.
        let line = bounds_in_force(&spool(0), None, &spool(0));
        assert!(line.contains("spool bound: none"), "{line}");
        assert!(line.contains("(default)"), "{line}");
    }
}
