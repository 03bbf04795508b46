//! Flash writes of the agent beside a minimal SQLite writer, printed (no
//! pass/fail): the figures of docs/flash.md and of the README's planning
//! table.
//!
//! For each row the bench starts the real agent binary in a fresh directory
//! on disk, against a mosquitto it runs on a free loopback port, with one
//! `file` source (payloads of about 175 bytes). Beside it, for the same
//! interval, runs a minimal SQLite writer with the same durability, window
//! and checkpoint cadence: this bench binary re-executed as a child (so its
//! `/proc/<pid>/io` is its own), WAL, one `events` table of payloads and a
//! one-row acknowledged high-water mark written in the same transaction as
//! the next readings, one commit per commit window (one per reading for
//! `full`), a PASSIVE checkpoint at the agent's cadence, and, when the
//! agent's wide window stretched that cadence (its commits then sync the
//! WAL), `synchronous = FULL` commits. It starts once the agent has warmed up
//! (at the window and cadence the agent has then, read from its metrics), a
//! lead of two checkpoint intervals (at least 60 s) before the interval, and
//! is the ceiling the agent is compared with; in a budget row it takes the
//! agent's window again whenever the budget moves it (read every 15 s).
//!
//! Rows run side by side (`FLASH_PARALLEL` at a time, all by default): the
//! figures are bytes each process sent to the block layer, not timings, so
//! a loaded machine changes none of them (it is named in the header, with
//! its load).
//!
//! Over the measurement interval (after the warm-up), from outside each
//! process:
//! - bytes written: the `write_bytes` delta of `/proc/<pid>/io`;
//! - fsyncs: `fsync`/`fdatasync` calls traced by `strace -f -ttt` (with
//!   `--seccomp-bpf` when supported), counted by timestamp;
//! - readings: PUBLISHes the broker delivers to the bench's QoS 1 subscriber
//!   on the source's topic (the minimal writer counts its own);
//! - commits: from `commits_total` in the agent's `write_budget` records
//!   (read with `edgespool status --json` every 15 s), as the rate between
//!   the records nearest the interval's ends;
//! - the agent's one projection of MB/day as `status` (the `write_budget`
//!   record, and the outage budget) and the metrics
//!   (`edgespool_flash_projected_bytes_per_day`, from `metrics.listen`) show
//!   it at the end, beside the measured figure; the window in force at the
//!   end and its changes during the interval; health changes over the whole
//!   run (polled every 15 s).
//!
//! Rows: `<rate>[full][w[<s>]|b[<MB>]][r]`: readings a second (1..=100), `full`
//! durability, then the agent's default settings (the probe's window),
//! `w`: `spool.commit_window_ms = 10000` (`w<s>`: that many seconds), or `b<MB>`:
//! `spool.write_budget_mb_per_day = <MB>` (`b` alone: 100) with
//! `spool.max_commit_window_ms = 300000` (the operator accepts a five-minute
//! loss window; the agent chooses its own); an `r` last runs receipt mode
//! beside an `edgespool sink` (SQLite store in the run's directory, not
//! counted).
//!
//! Run: `cargo bench --bench flash` (needs mosquitto and strace;
//! `cross/setup-debian.sh` installs mosquitto). Environment:
//! - `FLASH_SECS` measurement seconds per row (default 1800: several
//!   checkpoint intervals of five minutes);
//! - `FLASH_WARMUP` warm-up seconds before it (default 1800: a budget
//!   settles within it);
//! - `FLASH_RATES` rows to run (default
//!   `1w,10w,1,10,100,1b100,10b100,100b100,1b300,10b300,100b300,1b1000,10b1000,100b1000`);
//! - `FLASH_PARALLEL` rows at a time (default: all);
//! - `FLASH_CEILING_MS` the `b` rows' `spool.max_commit_window_ms` (default
//!   300000);
//! - `FLASH_AGENT` another agent binary to measure (an older build, say);
//! - `FLASH_DIR` where the per-row directories go (default `/var/tmp`; must
//!   not be tmpfs, where `write_bytes` stays 0).
//!
//! A quick look: `FLASH_SECS=120 FLASH_WARMUP=60 FLASH_RATES=1w,10w cargo bench --bench flash --profile dev`.

#[path = "../tests/it/support/mod.rs"]
mod support;
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use support::broker::Broker;
use support::sink::SinkProc;

/// The broker for the bench: room for every reading queued for the
/// subscriber (mosquitto's default, 1000, drops QoS 1 beyond it).
const BROKER_EXTRA: &str = "max_queued_messages 100000\n";

/// Set in the environment of the re-executed bench binary: run the minimal writer.
const MINIMAL_ENV: &str = "EDGESPOOL_FLASH_MINIMAL";
/// The source's name, so the stream's topic is `<prefix>/events/temperature`.
const STREAM: &str = "temperature";
/// Commit window when the agent's startup line cannot be read.
const FALLBACK_WINDOW_MS: u64 = 50;
/// The agent's checkpoint interval (`spool.checkpoint_interval_secs`'s
/// default), which a wide window stretches.
const CHECKPOINT_SECS: u64 = 30;
/// The loss window of the `w` rows, ms.
const LOSS_WINDOW_MS: u64 = 10_000;
/// The loss window the operator accepts in the `b` rows, ms
/// (`FLASH_CEILING_MS` sets another).
const BUDGET_CEILING_MS: u64 = 300_000;

/// The agent binary: `FLASH_AGENT`, or the one this bench was built with
/// (another build, an older one say, to compare with).
fn agent_exe() -> PathBuf {
    std::env::var_os("FLASH_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_edgespool")))
}

/// The `b` rows' `spool.max_commit_window_ms`.
fn budget_ceiling_ms() -> u64 {
    std::env::var("FLASH_CEILING_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(BUDGET_CEILING_MS)
}
/// The write budget of a `b` row without a figure, MB/day.
const BUDGET_MB_PER_DAY: u64 = 100;
/// How long a child gets to stop after being asked.
const STOP_GRACE: Duration = Duration::from_secs(20);
/// `statfs` magic of tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;

fn main() {
    if std::env::var_os(MINIMAL_ENV).is_some() {
        minimal_writer();
        return;
    }
    let settings = Settings::from_env();
    let tracer = Tracer::detect();
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    println!(
        "edgespool flash bench: warm-up {} s, measurement {} s per row, {} rows at a time, runs under {}, mosquitto on port {}",
        settings.warmup.as_secs(),
        settings.measure.as_secs(),
        settings.parallel,
        settings.base.display(),
        broker.port()
    );
    println!("machine: {}", machine(&settings.base));
    match &tracer {
        Some(t) => println!(
            "fsyncs: counted by `strace -f -ttt{}`",
            if t.seccomp { " --seccomp-bpf" } else { "" }
        ),
        None => println!("fsyncs n/a (strace not found)"),
    }
    println!(
        "readings: PUBLISHes the broker delivered to the bench's QoS 1 subscriber on edgespool/<device>/events/{STREAM} during the interval (minimal writer: readings it took)"
    );
    let mut rows = Vec::new();
    let port = broker.port();
    for chunk in settings.rates.chunks(settings.parallel.max(1)) {
        let done: Vec<(RateSpec, Result<Row, String>)> = std::thread::scope(|sc| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|spec| {
                    println!("-- {}: running ...", spec.label());
                    let (s, t) = (&settings, tracer.as_ref());
                    (*spec, sc.spawn(move || measure_rate(*spec, s, port, t)))
                })
                .collect();
            handles
                .into_iter()
                .map(|(spec, h)| {
                    (
                        spec,
                        h.join()
                            .unwrap_or_else(|_| Err("the row's thread panicked".into())),
                    )
                })
                .collect()
        });
        for (spec, r) in done {
            match r {
                Ok(row) => {
                    row.print_notes();
                    rows.push(row);
                }
                Err(e) => println!("-- {}: failed: {e}", spec.label()),
            }
        }
    }
    println!("load at the end: {}", loadavg());
    print_tables(&rows);
}

/// The machine, for the figures' record: architecture, CPU, cores, the
/// filesystem and device under `dir`, and the load now.
fn machine(dir: &Path) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "cpu n/a".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    // The mount holding `dir`: the longest mount point that prefixes it.
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mount = std::fs::read_to_string("/proc/mounts")
        .ok()
        .and_then(|t| {
            t.lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() >= 3 && dir.starts_with(f[1]))
                        .then(|| (f[1].len(), format!("{} on {}", f[2], f[0])))
                })
                .max_by_key(|(n, _)| *n)
                .map(|(_, m)| m)
        })
        .unwrap_or_else(|| "filesystem n/a".into());
    format!(
        "{} {cpu}, {cores} cores, {mount}; load {}",
        std::env::consts::ARCH,
        loadavg()
    )
}

/// The 1, 5 and 15 minute load averages.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|t| t.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

// ---------------------------------------------------------------- settings

/// One row of the table: a reading rate, a durability and the settings.
#[derive(Debug, Clone, Copy)]
struct RateSpec {
    per_sec: u32,
    full: bool,
    /// `mqtt.retire_on = "receipt"`, with a sink sending the receipts.
    receipt: bool,
    /// Default, fixed 10 s or budgeted commit window.
    window: Window,
}

impl RateSpec {
    /// `<n>[full][w|b[MB]][r]` (see the module doc).
    fn parse(s: &str) -> RateSpec {
        let s = s.trim();
        let (s, receipt) = match s.strip_suffix('r') {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let (s, window) = if let Some((rest, secs)) = s.rsplit_once('w') {
            let ms = if secs.is_empty() {
                LOSS_WINDOW_MS
            } else {
                secs.parse::<u64>().map(|v| v * 1000).unwrap_or_else(|_| {
                    panic!("FLASH_RATES: {s:?}: the window after `w` is whole seconds")
                })
            };
            assert!(
                (1000..=60_000).contains(&ms),
                "FLASH_RATES: {s:?}: a fixed window is 1..=60 s (`spool.commit_window_ms`'s bounds; wider ones come from a budget, `b`)"
            );
            (rest, Window::Fixed(ms))
        } else if let Some((rest, mb)) = s.rsplit_once('b') {
            let mb = if mb.is_empty() {
                BUDGET_MB_PER_DAY
            } else {
                mb.parse().unwrap_or_else(|_| {
                    panic!("FLASH_RATES: {s:?}: the budget after `b` is MB a day")
                })
            };
            (rest, Window::Budget(mb))
        } else {
            (s, Window::Default)
        };
        let (num, full) = match s.strip_suffix("full") {
            Some(n) => (n, true),
            None => (s, false),
        };
        let per_sec: u32 = num
            .parse()
            .unwrap_or_else(|_| {
                panic!("FLASH_RATES: {s:?} is not a rate (1, 10, 100, 1full; then `w` for a 10 s window (`w<s>` another) or `b<MB>` for a budget; an `r` last for receipt mode)")
            });
        assert!(
            (1..=100).contains(&per_sec),
            "FLASH_RATES: {s:?}: the agent's sources run at most every 10 ms (1..=100 readings/s)"
        );
        RateSpec {
            per_sec,
            full,
            receipt,
            window,
        }
    }

    fn label(&self) -> String {
        format!(
            "{}{}{}{}",
            self.per_sec,
            if self.full { "full" } else { "" },
            match self.window {
                Window::Default => String::new(),
                Window::Fixed(LOSS_WINDOW_MS) => "w".into(),
                Window::Fixed(ms) => format!("w{}", ms / 1000),
                Window::Budget(mb) => format!("b{mb}"),
            },
            if self.receipt { "r" } else { "" }
        )
    }

    fn interval_ms(&self) -> u64 {
        1000 / u64::from(self.per_sec)
    }

    /// The `[spool]` lines of the agent's config for this row.
    fn spool_keys(&self) -> String {
        match self.window {
            Window::Default => String::new(),
            Window::Fixed(ms) => format!("commit_window_ms = {ms}\n"),
            Window::Budget(mb) => format!(
                "write_budget_mb_per_day = {mb}\nmax_commit_window_ms = {}\n",
                budget_ceiling_ms()
            ),
        }
    }

    /// The settings as the planning table names them.
    fn settings(&self) -> String {
        match self.window {
            Window::Default => "default".into(),
            Window::Fixed(ms) => format!("`spool.commit_window_ms = {ms}`"),
            Window::Budget(mb) => format!(
                "`write_budget_mb_per_day = {mb}`, `max_commit_window_ms = {}`",
                budget_ceiling_ms()
            ),
        }
    }
}

/// How a row sets the agent's commit window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    /// The storage probe's (the default settings).
    Default,
    /// `spool.commit_window_ms` = this, ms (`w`: `LOSS_WINDOW_MS`).
    Fixed(u64),
    /// `spool.write_budget_mb_per_day` = this, the window chosen by the
    /// agent up to `BUDGET_CEILING_MS`.
    Budget(u64),
}

struct Settings {
    warmup: Duration,
    measure: Duration,
    rates: Vec<RateSpec>,
    parallel: usize,
    base: PathBuf,
}

impl Settings {
    fn from_env() -> Settings {
        let num = |key: &str, default: u64| {
            std::env::var(key)
                .ok()
                .map(|v| {
                    v.parse::<u64>()
                        .unwrap_or_else(|_| panic!("{key}={v:?} is not a number"))
                })
                .unwrap_or(default)
        };
        let rates = std::env::var("FLASH_RATES").unwrap_or_else(|_| {
            "1w,10w,1,10,100,1b100,10b100,100b100,1b300,10b300,100b300,1b1000,10b1000,100b1000"
                .into()
        });
        let base = PathBuf::from(std::env::var("FLASH_DIR").unwrap_or_else(|_| "/var/tmp".into()));
        assert!(
            !on_tmpfs(&base),
            "{} is tmpfs: write_bytes stays 0 there; set FLASH_DIR to a directory on disk",
            base.display()
        );
        let rates: Vec<RateSpec> = rates
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(RateSpec::parse)
            .collect();
        Settings {
            warmup: Duration::from_secs(num("FLASH_WARMUP", 1800)),
            measure: Duration::from_secs(num("FLASH_SECS", 1800).max(1)),
            parallel: num("FLASH_PARALLEL", rates.len() as u64).max(1) as usize,
            rates,
            base,
        }
    }
}

fn on_tmpfs(path: &Path) -> bool {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path without NUL");
    // SAFETY: statfs is plain old data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a struct of the right type.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    assert!(
        rc == 0,
        "statfs {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    st.f_type as i64 == TMPFS_MAGIC
}

// ---------------------------------------------------------------- one row

/// Counters read at one instant of a run.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    wall: f64,
    at: Instant,
    agent_bytes: u64,
    agent_ctxsw: u64,
    minimal_bytes: u64,
    minimal: MinimalCounts,
    delivered: u64,
}

/// The agent's one projection of MB/day as each report shows it, at the
/// end of the interval.
#[derive(Debug, Clone, Default)]
struct Projections {
    /// `status --json`: the `write_budget` record's `projected_mb_per_day`.
    status: Option<f64>,
    /// `status --json`: the outage budget's `flash_mb_per_day`.
    outage: Option<f64>,
    /// The metrics: `edgespool_flash_projected_bytes_per_day` / 10^6.
    metrics: Option<f64>,
    /// The health reason's figure, when over the budget.
    health: Option<f64>,
}

/// What one row measured.
struct Row {
    spec: RateSpec,
    /// The agent's window from its startup line (the probe's).
    window_ms: u64,
    window_from_log: bool,
    /// The minimal writer's commit window, ms, and checkpoint interval, s.
    minimal_window_ms: u64,
    minimal_checkpoint_secs: u64,
    /// Whether the minimal writer's commits synced (a stretched cadence).
    minimal_synced: bool,
    /// The agent's window at the end of the interval, and the widest it
    /// chose in the run (`write_budget` record).
    end_window_ms: Option<u64>,
    chosen_max_ms: Option<u64>,
    /// Window changes during the interval (from the polls).
    window_changes: u32,
    /// Health changes over the whole run, and of them the write budget
    /// reason's (from the polls).
    health_changes: u32,
    budget_changes: u32,
    projections: Projections,
    payload_len: usize,
    stored_payload_len: Option<f64>,
    /// Spool bytes each row added in the interval cost (pages in use).
    spool_bytes_per_row: Option<f64>,
    a: Snapshot,
    b: Snapshot,
    /// Commits in the interval and the span of the records they come from.
    agent_commits: Option<(f64, f64)>,
    agent_fsyncs: Option<u64>,
    minimal_fsyncs: Option<u64>,
    agent_wal: u64,
    last_checkpoint: Option<String>,
    /// Rows not ACKED when the interval ended, of all rows.
    unretired: Option<(i64, i64)>,
    complaints: Vec<String>,
}

fn measure_rate(
    spec: RateSpec,
    s: &Settings,
    port: u16,
    tracer: Option<&Tracer>,
) -> Result<Row, String> {
    let dir = tempfile::Builder::new()
        .prefix(&format!("edgespool-flash-{}-", spec.label()))
        .tempdir_in(&s.base)
        .expect("create the run's temp dir");
    let metrics_port = free_port();
    let run = RunDir::create(dir.path(), spec, port, metrics_port);
    let device = format!("flash-{}", spec.label());
    let sub = Subscriber::start(
        port,
        &format!("edgespool/{device}/events/#"),
        &format!("edgespool/{device}/events/{STREAM}"),
    )?;
    let mut sink = if spec.receipt {
        Some(start_sink(&run, port, &device)?)
    } else {
        None
    };
    let agent_cmd = {
        let mut c = Command::new(agent_exe());
        c.args(["run", "--config"])
            .arg(&run.config)
            .env("RUST_LOG", "info");
        c
    };
    let mut agent = Traced::spawn("agent", tracer, agent_cmd, &run.agent_trace, false)?;
    let log = AgentLog::follow(agent.child.stderr.take().expect("agent stderr is piped"));
    let (window_ms, window_from_log) =
        match log.commit_window(&mut agent, Duration::from_secs(120))? {
            Some(ms) => (ms, true),
            None => (FALLBACK_WINDOW_MS, false),
        };
    // The first reading is published once its window commits.
    let first_within = Duration::from_secs(30)
        + match spec.window {
            Window::Fixed(ms) => Duration::from_millis(ms),
            _ => Duration::ZERO,
        };
    let payload_len = sub
        .first_payload_len(&mut agent, first_within)
        .map_err(|e| format!("{e}; agent log:\n{}", log.tail()))?;
    let mut budget = Budget::default();
    // The agent alone, then the minimal writer at the window and cadence
    // the agent has by then, a lead of two checkpoint intervals before the
    // interval.
    let lead = Duration::from_secs(600)
        .min(s.warmup / 2)
        .max(Duration::from_secs(60).min(s.warmup));
    watch(s.warmup - lead, &mut agent, None, &mut budget, &run)?;
    budget.poll(&run);
    // The window in force now, from the metrics (served from memory): the
    // `write_budget` record in `status` rides the agent's next commit, so
    // just after a widening it still names the old window for up to one
    // new window.
    let (m_window, m_ckpt) = match (spec.window, live_window_ms(metrics_port)) {
        (Window::Fixed(ms), _) => (ms, checkpoint_secs(ms)),
        (_, Some(ms)) => (ms, checkpoint_secs(ms)),
        _ => budget
            .window_and_cadence()
            .unwrap_or((window_ms, checkpoint_secs(window_ms))),
    };
    let synced = !spec.full && m_ckpt > CHECKPOINT_SECS;
    let mut minimal = Minimal::spawn(tracer, &run, spec, (m_window, m_ckpt, synced), payload_len)?;
    watch(lead, &mut agent, Some(&mut minimal), &mut budget, &run)?;
    let a = snapshot(&agent, &mut minimal, &sub)?;
    let use_a = spool_use(&run.spool);
    budget.poll(&run);
    budget.interval_started();
    watch(s.measure, &mut agent, Some(&mut minimal), &mut budget, &run)?;
    let b = snapshot(&agent, &mut minimal, &sub)?;
    let use_b = spool_use(&run.spool);
    let report = status_json(&run);
    budget.poll_report(report.as_ref());
    let projections = Projections {
        status: report
            .as_ref()
            .and_then(|r| find_state(r.get("agent_state")?, "write_budget"))
            .and_then(|(v, _)| v.get("projected_mb_per_day")?.as_f64()),
        outage: report
            .as_ref()
            .and_then(|r| find_state(r.get("agent_state")?, "outage_budget"))
            .and_then(|(v, _)| v.get("flash_mb_per_day")?.as_f64()),
        metrics: metrics_value(metrics_port, "edgespool_flash_projected_bytes_per_day")
            .map(|b| b / 1e6),
        health: report.as_ref().and_then(health_projection),
    };
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let agent_wal = size(&wal_of(&run.spool));
    let state = |key: &str| {
        report
            .as_ref()
            .and_then(|r| find_state(r.get("agent_state")?, key))
            .map(|(v, _)| v)
    };
    let last_checkpoint = state("last_checkpoint").map(|v| v.to_string());
    let record = state("write_budget");
    let field = |k: &str| record.as_ref().and_then(|v| v.get(k)?.as_u64());
    let (end_window_ms, chosen_max_ms) = (field("commit_window_ms"), field("commit_window_max_ms"));
    let unretired = unretired_rows(&run.spool);
    agent.stop();
    minimal.stop();
    if let Some(sink) = sink.as_mut() {
        sink.stop(STOP_GRACE);
    }
    drop(sub);
    let count = |path: &Path| {
        tracer
            .map(|_| count_fsyncs(path, a.wall, b.wall))
            .transpose()
    };
    Ok(Row {
        spec,
        window_ms,
        window_from_log,
        minimal_window_ms: m_window,
        minimal_checkpoint_secs: m_ckpt,
        minimal_synced: synced,
        end_window_ms,
        chosen_max_ms,
        window_changes: budget.window_changes,
        health_changes: budget.health_changes,
        budget_changes: budget.budget_changes,
        projections,
        payload_len,
        stored_payload_len: stored_payload_len(&run.spool),
        spool_bytes_per_row: bytes_per_row(use_a, use_b),
        a,
        b,
        agent_commits: budget.commits_in(a.wall, b.wall),
        agent_fsyncs: count(&run.agent_trace)?,
        minimal_fsyncs: count(&run.minimal_trace)?,
        agent_wal,
        last_checkpoint,
        unretired,
        complaints: log.complaints(),
    })
}

/// The agent's time-driven checkpoint interval at a `window_ms` window
/// (`flash::write_budget::checkpoint_interval` at the default 30 s).
fn checkpoint_secs(window_ms: u64) -> u64 {
    (window_ms * 12 / 1000).clamp(CHECKPOINT_SECS, 300)
}

/// The agent's commit window in force, ms, from its metrics (served from
/// memory, so it changes the moment the budget widens or narrows it).
fn live_window_ms(metrics_port: u16) -> Option<u64> {
    metrics_value(metrics_port, "edgespool_commit_window_seconds")
        .filter(|s| *s > 0.0)
        .map(|s| (s * 1000.0).round() as u64)
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("find a free port")
        .port()
}

/// The value of the unlabelled sample `name` in the agent's `/metrics`.
fn metrics_value(port: u16, name: &str) -> Option<f64> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// `projected N MB/day` in a write budget health reason.
fn health_projection(report: &serde_json::Value) -> Option<f64> {
    let reasons = report.get("health")?.get("reasons")?.as_array()?;
    reasons.iter().find_map(|r| {
        r.as_str()?
            .strip_prefix("write budget exceeded: projected ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Sleep `d`, checking every second that the children still run and
/// polling the agent's status now and then.
fn watch(
    d: Duration,
    agent: &mut Traced,
    mut minimal: Option<&mut Minimal>,
    budget: &mut Budget,
    run: &RunDir,
) -> Result<(), String> {
    let end = Instant::now() + d;
    loop {
        agent.check_alive()?;
        if let Some(m) = minimal.as_mut() {
            m.proc.check_alive()?;
            m.follow_if_due(run.metrics_port)?;
        }
        budget.poll_if_due(run);
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(Duration::from_secs(1)));
    }
}

fn snapshot(agent: &Traced, minimal: &mut Minimal, sub: &Subscriber) -> Result<Snapshot, String> {
    let wall = unix_secs();
    let at = Instant::now();
    let agent_bytes = agent.write_bytes()?;
    let minimal_bytes = minimal.proc.write_bytes()?;
    let counts = minimal.mark()?;
    let delivered = sub.delivered.load(Ordering::Relaxed);
    let agent_ctxsw = context_switches(agent.pid);
    Ok(Snapshot {
        wall,
        at,
        agent_bytes,
        agent_ctxsw,
        minimal_bytes,
        minimal: counts,
        delivered,
    })
}

/// What the polls of `edgespool status --json` collect: `commits_total` of
/// the `write_budget` records, the window and cadence, and changes of the
/// window (during the interval) and of health (over the run).
#[derive(Default)]
struct Budget {
    /// (Unix ms the agent recorded it, commits_total), oldest first.
    records: Vec<(i64, u64)>,
    polled: Option<Instant>,
    /// The window and checkpoint interval of the last record.
    window: Option<(u64, u64)>,
    in_interval: bool,
    window_changes: u32,
    /// The last health seen: its state and whether a write budget reason
    /// was among its reasons.
    health: Option<(String, bool)>,
    health_changes: u32,
    budget_changes: u32,
}

impl Budget {
    /// Often enough to see every change of a record written once a state
    /// period (a minute and more).
    const EVERY: Duration = Duration::from_secs(15);

    fn poll_if_due(&mut self, run: &RunDir) {
        if self.polled.is_none_or(|t| t.elapsed() >= Self::EVERY) {
            self.poll(run);
        }
    }

    fn poll(&mut self, run: &RunDir) {
        let report = status_json(run);
        self.poll_report(report.as_ref());
    }

    fn poll_report(&mut self, report: Option<&serde_json::Value>) {
        self.polled = Some(Instant::now());
        let Some(report) = report else {
            return;
        };
        if let Some(h) = report.get("health") {
            let state = h["state"].as_str().unwrap_or("").to_owned();
            let over = h["reasons"].as_array().is_some_and(|r| {
                r.iter()
                    .any(|r| r.as_str().is_some_and(|r| r.starts_with("write budget")))
            });
            if let Some((s0, o0)) = &self.health {
                self.health_changes += u32::from(*s0 != state);
                self.budget_changes += u32::from(*o0 != over);
            }
            self.health = Some((state, over));
        }
        let Some((v, Some(at))) = report
            .get("agent_state")
            .and_then(|s| find_state(s, "write_budget"))
        else {
            return;
        };
        let w = v["commit_window_ms"].as_u64();
        let c = v["checkpoint_interval_secs"].as_u64();
        if let (Some(w), Some(c)) = (w, c) {
            if self.in_interval && self.window.is_some_and(|(w0, _)| w0 != w) {
                self.window_changes += 1;
            }
            self.window = Some((w, c));
        }
        let Some(c) = v.get("commits_total").and_then(serde_json::Value::as_u64) else {
            return;
        };
        if self.records.last().is_none_or(|&(t, _)| t < at) {
            self.records.push((at, c));
        }
    }

    /// The agent's window (ms) and checkpoint interval (s) at the last poll.
    fn window_and_cadence(&self) -> Option<(u64, u64)> {
        self.window
    }

    fn interval_started(&mut self) {
        self.in_interval = true;
    }

    /// Commits in `[t0, t1]` (Unix s) at the rate between the last records
    /// at or before each end (the first record if none precedes `t0`), and
    /// the seconds between those records; None without two such records.
    fn commits_in(&self, t0: f64, t1: f64) -> Option<(f64, f64)> {
        let (t0_ms, t1_ms) = ((t0 * 1000.0) as i64, (t1 * 1000.0) as i64);
        let r0 = self
            .records
            .iter()
            .rev()
            .find(|r| r.0 <= t0_ms)
            .or(self.records.first())?;
        let r1 = self.records.iter().rev().find(|r| r.0 <= t1_ms)?;
        if r1.0 <= r0.0 {
            return None;
        }
        let span = (r1.0 - r0.0) as f64 / 1000.0;
        let delta = r1.1.checked_sub(r0.1)? as f64;
        Some((delta / span * (t1 - t0), span))
    }
}

/// Paths and files of one row's run, all under its own temp dir.
struct RunDir {
    config: PathBuf,
    spool: PathBuf,
    agent_trace: PathBuf,
    minimal_db: PathBuf,
    minimal_trace: PathBuf,
    status_out: PathBuf,
    /// Receipt mode: the sink's SQLite store (its log beside it).
    sink_db: PathBuf,
    /// The agent's metrics listener (the window in force, live).
    metrics_port: u16,
}

impl RunDir {
    fn create(dir: &Path, spec: RateSpec, port: u16, metrics_port: u16) -> RunDir {
        for sub in ["agent", "minimal", "trace", "sink"] {
            std::fs::create_dir(dir.join(sub)).expect("create a run subdirectory");
        }
        let value = dir.join("value");
        std::fs::write(&value, "21.5\n").expect("write the source's value file");
        let spool = dir.join("agent/spool.db");
        let config = dir.join("agent.toml");
        let durability = if spec.full {
            "durability = \"full\"\n"
        } else {
            ""
        };
        let retire = if spec.receipt {
            support::keys::receipt_mode_toml()
        } else {
            String::new()
        };
        // The metrics listener serves from memory: no file written.
        let text = format!(
            "device_id = \"flash-{label}\"\n\n[spool]\npath = \"{spool}\"\n{spool_keys}\n[mqtt]\nurl = \"mqtt://127.0.0.1:{port}\"\n{retire}\n[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n\n[[sources]]\nname = \"{STREAM}\"\nkind = \"file\"\npath = \"{value}\"\nfield = \"temp_c\"\ninterval_ms = {interval}\n{durability}",
            label = spec.label(),
            spool = spool.display(),
            spool_keys = spec.spool_keys(),
            value = value.display(),
            interval = spec.interval_ms(),
        );
        std::fs::write(&config, text).expect("write the agent's config");
        RunDir {
            config,
            spool,
            agent_trace: dir.join("trace/agent.txt"),
            minimal_db: dir.join("minimal/minimal.db"),
            minimal_trace: dir.join("trace/minimal.txt"),
            status_out: dir.join("trace/status.json"),
            sink_db: dir.join("sink/sink.db"),
            metrics_port,
        }
    }
}

/// Rows not ACKED, and all rows, in the agent's spool (read beside it).
fn unretired_rows(spool: &Path) -> Option<(i64, i64)> {
    let conn = rusqlite::Connection::open(spool).ok()?;
    conn.busy_timeout(Duration::from_secs(5)).ok()?;
    conn.query_row(
        "SELECT count(*) FILTER (WHERE state <> 'ACKED'), count(*) FROM event_states",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .ok()
}

/// Receipt mode: `edgespool sink` on the run's device, storing in SQLite
/// and sending receipts, logging into the run's `sink` directory.
fn start_sink(run: &RunDir, port: u16, device: &str) -> Result<SinkProc, String> {
    let filter = format!("edgespool/{device}/events/#");
    let dir = run.sink_db.parent().expect("the sink directory");
    let id = format!("{device}-sink");
    let mut sink = SinkProc::spawn_sqlite(port, &filter, &run.sink_db, &id, dir);
    if sink.subscribed(Duration::from_secs(30)) {
        return Ok(sink);
    }
    sink.stop(STOP_GRACE);
    Err(format!("the sink did not subscribe:\n{}", sink.log_text()))
}

fn wal_of(db: &Path) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push("-wal");
    PathBuf::from(s)
}

fn unix_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

// ---------------------------------------------------------------- agent status

/// `edgespool status --spool PATH --json`, parsed; None when it fails.
fn status_json(run: &RunDir) -> Option<serde_json::Value> {
    let out = std::fs::File::create(&run.status_out).expect("create the status output file");
    let mut child = Command::new(agent_exe())
        .args(["status", "--json", "--spool"])
        .arg(&run.spool)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn edgespool status");
    let deadline = Instant::now() + Duration::from_secs(20);
    let ok = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
        }
    };
    if !ok {
        return None;
    }
    let text = std::fs::read_to_string(&run.status_out).ok()?;
    serde_json::from_str(&text).ok()
}

/// `agent_state` as `[[key, value, at], ...]`, `[{key, value, ...}, ...]`,
/// `{key: {value, updated_ms}}` or `{key: value}`; a string value holding
/// JSON is parsed.
fn find_state(states: &serde_json::Value, key: &str) -> Option<(serde_json::Value, Option<i64>)> {
    use serde_json::Value;
    let (value, at) = match states {
        Value::Array(entries) => entries.iter().find_map(|e| match e {
            Value::Array(t) if t.first().and_then(Value::as_str) == Some(key) => {
                Some((t.get(1)?.clone(), t.get(2).and_then(Value::as_i64)))
            }
            Value::Object(o) if o.get("key").and_then(Value::as_str) == Some(key) => Some((
                o.get("value")?.clone(),
                ["updated_ms", "at_ms", "at"]
                    .iter()
                    .find_map(|k| o.get(*k).and_then(Value::as_i64)),
            )),
            _ => None,
        })?,
        Value::Object(o) => match o.get(key)? {
            // {key: {"value": ..., "updated_ms": ...}}
            Value::Object(e) if e.contains_key("value") => (
                e.get("value")?.clone(),
                e.get("updated_ms").and_then(Value::as_i64),
            ),
            v => (v.clone(), None),
        },
        _ => return None,
    };
    let value = match value {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        v => v,
    };
    Some((value, at))
}

/// Mean stored payload length in the agent's spool: `events.payload`
/// (schema 5 on), else an older schema's `payloads(payload)` table.
fn stored_payload_len(spool: &Path) -> Option<f64> {
    let conn =
        rusqlite::Connection::open_with_flags(spool, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .ok()?;
    ["events", "payloads"].iter().find_map(|table| {
        conn.query_row(
            &format!("SELECT avg(length(payload)) FROM {table}"),
            [],
            |r| r.get(0),
        )
        .ok()
        .flatten()
    })
}

/// The spool's pages in use (`page_count - freelist_count`, in bytes) and
/// its row count, at one moment: two of them give the spool bytes one more
/// row costs, for the planning table's hours of outage per GB. (The bundled
/// SQLite is built without the `dbstat` table, see .cargo/config.toml.)
fn spool_use(spool: &Path) -> Option<(i64, i64)> {
    let conn =
        rusqlite::Connection::open_with_flags(spool, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .ok()?;
    let q = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).ok();
    let pages = q("PRAGMA page_count")? - q("PRAGMA freelist_count")?;
    Some((
        pages * q("PRAGMA page_size")?,
        q("SELECT count(*) FROM events")?,
    ))
}

/// Spool bytes per row added between two [`spool_use`] readings.
fn bytes_per_row(a: Option<(i64, i64)>, b: Option<(i64, i64)>) -> Option<f64> {
    let ((ba, ra), (bb, rb)) = (a?, b?);
    (rb > ra).then(|| (bb - ba) as f64 / (rb - ra) as f64)
}

// ---------------------------------------------------------------- processes

/// How to run a child under strace, if strace is here.
struct Tracer {
    seccomp: bool,
}

impl Tracer {
    fn detect() -> Option<Tracer> {
        let works = |extra: &[&str]| {
            Command::new("strace")
                .args(["-f", "-qq"])
                .args(extra)
                .args(["-e", "trace=fsync", "-o", "/dev/null", "true"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if works(&["--seccomp-bpf"]) {
            Some(Tracer { seccomp: true })
        } else if works(&[]) {
            Some(Tracer { seccomp: false })
        } else {
            None
        }
    }

    /// `cmd` wrapped in strace writing to `out`, with the same args and env.
    fn wrap(&self, cmd: &Command, out: &Path) -> Command {
        let mut c = Command::new("strace");
        c.args(["-f", "-qq", "-ttt"]);
        if self.seccomp {
            c.arg("--seccomp-bpf");
        }
        c.args(["-e", "trace=fsync,fdatasync", "-e", "signal=none", "-o"])
            .arg(out)
            .arg(cmd.get_program())
            .args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        c
    }
}

/// A child process, maybe under strace; `pid` is the measured process (the
/// tracee when traced). Dropping it kills both.
struct Traced {
    name: &'static str,
    child: Child,
    pid: i32,
    traced: bool,
}

impl Traced {
    fn spawn(
        name: &'static str,
        tracer: Option<&Tracer>,
        cmd: Command,
        trace_out: &Path,
        piped_stdio: bool,
    ) -> Result<Traced, String> {
        let mut cmd = match tracer {
            Some(t) => t.wrap(&cmd, trace_out),
            None => cmd,
        };
        cmd.stdin(if piped_stdio {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(if piped_stdio {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(if piped_stdio {
            Stdio::inherit()
        } else {
            Stdio::piped()
        });
        let child = cmd.spawn().map_err(|e| format!("spawn {name}: {e}"))?;
        let outer = child.id() as i32;
        let mut t = Traced {
            name,
            child,
            pid: outer,
            traced: tracer.is_some(),
        };
        if t.traced {
            t.pid = tracee_of(outer, Instant::now() + Duration::from_secs(10))
                .ok_or_else(|| format!("{name}: no traced process appeared under strace"))?;
        }
        Ok(t)
    }

    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(format!("{} exited early ({st})", self.name)),
            Err(e) => Err(format!("{}: wait failed: {e}", self.name)),
        }
    }

    fn write_bytes(&self) -> Result<u64, String> {
        let text = std::fs::read_to_string(format!("/proc/{}/io", self.pid))
            .map_err(|e| format!("{}: read /proc/{}/io: {e}", self.name, self.pid))?;
        text.lines()
            .find_map(|l| l.strip_prefix("write_bytes:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("{}: no write_bytes in /proc/{}/io", self.name, self.pid))
    }

    /// SIGTERM to the measured process, then wait (bounded) for the child.
    fn stop(&mut self) {
        // SAFETY: kill(2) on a pid this bench started.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        self.wait_or_kill(Instant::now() + STOP_GRACE);
    }

    fn wait_or_kill(&mut self, deadline: Instant) {
        loop {
            match self.child.try_wait() {
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(Some(_)) => {
                    // The tracee exits before strace does; kill it anyway in
                    // case strace died first and left it running.
                    if self.traced {
                        // SAFETY: kill(2) on the tracee this bench started.
                        unsafe { libc::kill(self.pid, libc::SIGKILL) };
                    }
                    return;
                }
                _ => {
                    eprintln!("{}: did not stop in time; killing it", self.name);
                    // SAFETY: kill(2) on the tracee this bench started.
                    unsafe { libc::kill(self.pid, libc::SIGKILL) };
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
            }
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on the process this bench started.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
            let _ = self.child.kill();
            self.wait_or_kill(Instant::now() + Duration::from_secs(5));
        }
    }
}

/// The process strace forked for the command (ppid = strace), once it has
/// exec'd (its name is no longer strace's).
fn tracee_of(strace_pid: i32, deadline: Instant) -> Option<i32> {
    while Instant::now() < deadline {
        let found = std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (comm, rest) = stat.rsplit_once(')')?;
            let ppid: i32 = rest.split_whitespace().nth(1)?.parse().ok()?;
            (ppid == strace_pid && !comm.ends_with("(strace")).then_some(pid)
        });
        if found.is_some() {
            return found;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Voluntary plus involuntary context switches over all threads of `pid`.
fn context_switches(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// `fsync`/`fdatasync` calls in an strace `-f -ttt` file with a timestamp in
/// `[t0, t1]` (call starts only; `<... resumed>` lines are not counted).
fn count_fsyncs(path: &Path, t0: f64, t1: f64) -> Result<u64, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    Ok(text
        .lines()
        .filter(|line| {
            let mut tok = line.split_whitespace();
            let (_pid, ts, call) = (tok.next(), tok.next(), tok.next().unwrap_or(""));
            let in_range = ts
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(|t| (t0..=t1).contains(&t));
            in_range && (call.starts_with("fsync(") || call.starts_with("fdatasync("))
        })
        .count() as u64)
}

// ---------------------------------------------------------------- agent log

/// The agent's stderr, read on a thread: the commit window from its
/// `storage probe` line, warnings and errors, and the last lines.
struct AgentLog {
    window: Receiver<Option<u64>>,
    lines: Arc<Mutex<VecDeque<String>>>,
    complaints: Arc<Mutex<Vec<String>>>,
}

impl AgentLog {
    fn follow(stderr: std::process::ChildStderr) -> AgentLog {
        let (tx, window) = mpsc::channel();
        let lines = Arc::new(Mutex::new(VecDeque::new()));
        let complaints = Arc::new(Mutex::new(Vec::new()));
        let (l, c) = (lines.clone(), complaints.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("storage probe") {
                    let _ = tx.send(parse_window(&line));
                }
                if line.contains(" WARN ") || line.contains(" ERROR ") {
                    let mut c = c.lock().expect("complaints lock");
                    if c.len() < 20 {
                        c.push(line.clone());
                    }
                }
                let mut l = l.lock().expect("log lock");
                l.push_back(line);
                if l.len() > 40 {
                    l.pop_front();
                }
            }
        });
        AgentLog {
            window,
            lines,
            complaints,
        }
    }

    /// The commit window the agent logged at startup; None if it logged a
    /// probe failure. Errors if the agent dies or stays silent until `limit`.
    fn commit_window(&self, agent: &mut Traced, limit: Duration) -> Result<Option<u64>, String> {
        let deadline = Instant::now() + limit;
        loop {
            match self.window.recv_timeout(Duration::from_millis(200)) {
                Ok(w) => return Ok(w),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "agent closed stderr before its storage probe line:\n{}",
                        self.tail()
                    ))
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            agent
                .check_alive()
                .map_err(|e| format!("{e}:\n{}", self.tail()))?;
            if Instant::now() > deadline {
                eprintln!("agent logged no storage probe line in {limit:?}; assuming {FALLBACK_WINDOW_MS} ms");
                return Ok(None);
            }
        }
    }

    fn tail(&self) -> String {
        let l = self.lines.lock().expect("log lock");
        l.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    fn complaints(&self) -> Vec<String> {
        self.complaints.lock().expect("complaints lock").clone()
    }
}

/// `N` from `... -> commit window N ms ...`.
fn parse_window(line: &str) -> Option<u64> {
    line.split_once("commit window ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

// ---------------------------------------------------------------- broker

/// A QoS 1 subscriber on its own thread, counting PUBLISHes on one topic.
struct Subscriber {
    delivered: Arc<AtomicU64>,
    first_len: Arc<Mutex<Option<usize>>>,
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Subscriber {
    fn start(port: u16, filter: &str, topic: &str) -> Result<Subscriber, String> {
        static N: AtomicU64 = AtomicU64::new(0);
        let id = format!(
            "flash-sub-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let mut o = MqttOptions::new(id, "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(30));
        let (client, mut conn) = Client::new(o, 64);
        client
            .subscribe(filter, QoS::AtLeastOnce)
            .map_err(|e| format!("subscribe: {e}"))?;
        let delivered = Arc::new(AtomicU64::new(0));
        let first_len = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready) = mpsc::channel();
        let (d, f, s, topic) = (
            delivered.clone(),
            first_len.clone(),
            stop.clone(),
            topic.to_owned(),
        );
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match conn.recv_timeout(Duration::from_millis(500)) {
                    Ok(Ok(Event::Incoming(Incoming::SubAck(_)))) => {
                        let _ = ready_tx.send(());
                    }
                    Ok(Ok(Event::Incoming(Incoming::Publish(p)))) if p.topic == topic => {
                        d.fetch_add(1, Ordering::Relaxed);
                        f.lock()
                            .expect("payload lock")
                            .get_or_insert(p.payload.len());
                    }
                    Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(200)),
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            let _ = client.disconnect();
        });
        let sub = Subscriber {
            delivered,
            first_len,
            stop,
            handle: Some(handle),
        };
        ready
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| "subscriber got no SUBACK in 10 s".to_owned())?;
        Ok(sub)
    }

    /// Length of the first delivered payload, waiting up to `limit`.
    fn first_payload_len(&self, agent: &mut Traced, limit: Duration) -> Result<usize, String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(n) = *self.first_len.lock().expect("payload lock") {
                return Ok(n);
            }
            agent.check_alive()?;
            if Instant::now() > deadline {
                return Err(format!("no reading reached the subscriber in {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------- minimal writer

/// Commits and readings the minimal writer reports.
#[derive(Debug, Clone, Copy, Default)]
struct MinimalCounts {
    commits: u64,
    readings: u64,
}

impl MinimalCounts {
    fn parse(line: &str) -> Option<MinimalCounts> {
        let get = |k: &str| {
            line.split_whitespace()
                .find_map(|t| t.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
        };
        Some(MinimalCounts {
            commits: get("commits")?,
            readings: get("readings")?,
        })
    }
}

/// The minimal writer child: a mark on its stdin makes it print its counts, a
/// window line moves its window;
/// closing stdin stops it.
struct Minimal {
    proc: Traced,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Its window, ms, and checkpoint interval, s: the agent's, followed
    /// when a budget moves it ([`Minimal::follow_if_due`]); `None` for a
    /// fixed window and `full` rows, which never move.
    follows: Option<(u64, u64)>,
    /// When the agent's window was last read.
    followed_at: Instant,
}

impl Minimal {
    fn spawn(
        tracer: Option<&Tracer>,
        run: &RunDir,
        spec: RateSpec,
        (window_ms, checkpoint_secs, synced): (u64, u64, bool),
        payload_len: usize,
    ) -> Result<Minimal, String> {
        let exe = std::env::current_exe().expect("path of the bench binary");
        let mut cmd = Command::new(exe);
        let mode = match (spec.full, synced) {
            (true, _) => "full",
            (false, true) => "synced",
            (false, false) => "normal",
        };
        cmd.env(MINIMAL_ENV, "1").arg(&run.minimal_db).args([
            spec.per_sec.to_string(),
            window_ms.to_string(),
            mode.to_owned(),
            payload_len.to_string(),
            checkpoint_secs.to_string(),
        ]);
        let mut proc = Traced::spawn("minimal writer", tracer, cmd, &run.minimal_trace, true)?;
        let stdin = proc.child.stdin.take();
        let stdout = proc
            .child
            .stdout
            .take()
            .expect("minimal writer stdout is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let follows = (matches!(spec.window, Window::Budget(_)) && !spec.full)
            .then_some((window_ms, checkpoint_secs));
        Ok(Minimal {
            proc,
            stdin,
            lines,
            follows,
            followed_at: Instant::now(),
        })
    }

    /// Every 15 s, a budget row's minimal writer takes the agent's window
    /// in force (and the checkpoint cadence it stretches): a ceiling at the
    /// same window all through the interval, not only the one it started at.
    fn follow_if_due(&mut self, metrics_port: u16) -> Result<(), String> {
        let Some(now_at) = self.follows else {
            return Ok(());
        };
        if self.followed_at.elapsed() < Duration::from_secs(15) {
            return Ok(());
        }
        self.followed_at = Instant::now();
        let Some(ms) = live_window_ms(metrics_port) else {
            return Ok(());
        };
        let next = (ms, checkpoint_secs(ms));
        if next == now_at {
            return Ok(());
        }
        let stdin = self
            .stdin
            .as_mut()
            .ok_or("minimal writer already stopped")?;
        writeln!(stdin, "window {} {}", next.0, next.1)
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("minimal writer: write window: {e}"))?;
        self.follows = Some(next);
        Ok(())
    }

    fn mark(&mut self) -> Result<MinimalCounts, String> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or("minimal writer already stopped")?;
        writeln!(stdin, "mark")
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("minimal writer: write mark: {e}"))?;
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| "minimal writer did not answer a mark in 10 s".to_owned())?;
        MinimalCounts::parse(&line).ok_or_else(|| format!("minimal writer said {line:?}"))
    }

    /// Close its stdin (it commits what it holds and exits) and wait, bounded.
    fn stop(&mut self) {
        self.stdin = None;
        self.proc.wait_or_kill(Instant::now() + STOP_GRACE);
    }
}

/// The minimal writer's main: `<db> <readings/s> <window ms>
/// <normal|synced|full> <payload bytes> <checkpoint s>`: `full` commits
/// each reading, synced; `synced` each window, synced (`synchronous =
/// FULL`); `normal` each window under `synchronous = NORMAL`.
fn minimal_writer() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [db, rate, window_ms, sync, len, ckpt] = args.as_slice() else {
        panic!("minimal writer: expected <db> <readings/s> <window ms> <normal|synced|full> <payload bytes> <checkpoint s>, got {args:?}");
    };
    let rate: f64 = rate.parse().expect("minimal writer: readings/s");
    let mut window = Duration::from_millis(window_ms.parse().expect("minimal writer: window ms"));
    let full = sync == "full";
    let len: usize = len.parse().expect("minimal writer: payload bytes");
    let mut checkpoint = Duration::from_secs(ckpt.parse().expect("minimal writer: checkpoint s"));
    let mut w = MinimalDb::open(Path::new(db), full || sync == "synced");

    let (tx, marks) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            let msg = match line.split_whitespace().collect::<Vec<_>>()[..] {
                ["window", ms, secs] => match (ms.parse(), secs.parse()) {
                    (Ok(ms), Ok(secs)) => ToMinimal::Window(ms, secs),
                    _ => panic!("minimal writer: bad window line {line:?}"),
                },
                _ => ToMinimal::Mark,
            };
            if tx.send(msg).is_err() {
                break;
            }
        }
    });
    let period = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    let (mut next_reading, mut next_commit, mut next_ckpt) =
        (start, start + window, start + checkpoint);
    let mut out = std::io::stdout();
    loop {
        let now = Instant::now();
        if now >= next_reading {
            w.take_reading(len);
            next_reading += period;
            if full {
                w.commit();
            }
        }
        if !full && now >= next_commit {
            w.commit();
            next_commit = now + window;
        }
        if now >= next_ckpt {
            w.checkpoint();
            next_ckpt += checkpoint;
        }
        let due = if full {
            next_reading
        } else {
            next_reading.min(next_commit)
        }
        .min(next_ckpt);
        match marks.recv_timeout(due.saturating_duration_since(Instant::now())) {
            Ok(ToMinimal::Mark) => {
                writeln!(out, "mark commits={} readings={}", w.commits, w.readings)
                    .and_then(|_| out.flush())
                    .expect("minimal writer: write to stdout");
            }
            // The agent's budget moved its window: the same here, from now
            // (a checkpoint interval past the agent's default syncs commits,
            // as the agent's does).
            Ok(ToMinimal::Window(ms, secs)) => {
                let now = Instant::now();
                window = Duration::from_millis(ms);
                checkpoint = Duration::from_secs(secs);
                next_commit = next_commit.min(now + window);
                next_ckpt = now + checkpoint;
                if !full {
                    w.set_synced(secs > CHECKPOINT_SECS);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    w.commit();
    let _ = writeln!(out, "end commits={} readings={}", w.commits, w.readings);
}

/// What the bench tells the minimal writer on its stdin: `mark` (print the
/// counts) or `window <ms> <checkpoint s>` (take the agent's new window).
enum ToMinimal {
    Mark,
    Window(u64, u64),
}

/// The minimal writer's database and buffer.
struct MinimalDb {
    conn: rusqlite::Connection,
    buffer: Vec<Vec<u8>>,
    /// Highest id of the previous commit: acknowledged by the next one.
    acked_upto: i64,
    commits: u64,
    readings: u64,
}

impl MinimalDb {
    fn open(path: &Path, full: bool) -> MinimalDb {
        let conn = rusqlite::Connection::open(path).expect("minimal writer: open its database");
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .expect("minimal writer: set WAL");
        assert_eq!(mode, "wal", "minimal writer: WAL did not take effect");
        conn.execute_batch(&format!(
            "PRAGMA synchronous={};
             PRAGMA wal_autocheckpoint=0;
             CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY, payload BLOB);
             CREATE TABLE IF NOT EXISTS acked (one INTEGER PRIMARY KEY CHECK (one = 1), hwm INTEGER NOT NULL);
             INSERT OR IGNORE INTO acked (one, hwm) VALUES (1, 0);",
            if full { "FULL" } else { "NORMAL" }
        ))
        .expect("minimal writer: schema and pragmas");
        MinimalDb {
            conn,
            buffer: Vec::new(),
            acked_upto: 0,
            commits: 0,
            readings: 0,
        }
    }

    fn take_reading(&mut self, len: usize) {
        self.readings += 1;
        let mut p = format!("{{\"seq\":{},\"value\":21.5}}", self.readings).into_bytes();
        p.resize(len, b' ');
        self.buffer.push(p);
    }

    /// One transaction: the acknowledgement of everything the previous
    /// commit appended, then the buffered readings.
    fn commit(&mut self) {
        if self.buffer.is_empty() {
            return;
        }
        let tx = self.conn.transaction().expect("minimal writer: begin");
        tx.execute("UPDATE acked SET hwm = ?1 WHERE one = 1", [self.acked_upto])
            .expect("minimal writer: record the acknowledgement");
        let mut last = self.acked_upto;
        {
            let mut st = tx
                .prepare_cached("INSERT INTO events (payload) VALUES (?1)")
                .expect("minimal writer: prepare insert");
            for p in self.buffer.drain(..) {
                st.execute([p]).expect("minimal writer: insert");
                last = tx.last_insert_rowid();
            }
        }
        tx.commit().expect("minimal writer: commit");
        self.acked_upto = last;
        self.commits += 1;
    }

    /// `synchronous = FULL` (a stretched checkpoint cadence) or `NORMAL`.
    fn set_synced(&mut self, synced: bool) {
        self.conn
            .execute_batch(if synced {
                "PRAGMA synchronous=FULL"
            } else {
                "PRAGMA synchronous=NORMAL"
            })
            .expect("minimal writer: set synchronous");
    }

    fn checkpoint(&mut self) {
        self.conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
            .expect("minimal writer: checkpoint");
    }
}

// ---------------------------------------------------------------- report

impl Row {
    fn secs(&self) -> f64 {
        (self.b.at - self.a.at).as_secs_f64()
    }

    fn agent_readings(&self) -> u64 {
        self.b.delivered - self.a.delivered
    }

    fn minimal_readings(&self) -> u64 {
        self.b.minimal.readings - self.a.minimal.readings
    }

    /// MB (10^6 bytes) a day each wrote over the interval: (agent, minimal).
    fn mb_per_day(&self) -> (f64, f64) {
        let secs = self.secs();
        let per_day = |d: u64| d as f64 / secs * 86_400.0 / 1e6;
        (
            per_day(self.b.agent_bytes - self.a.agent_bytes),
            per_day(self.b.minimal_bytes - self.a.minimal_bytes),
        )
    }

    /// Agent over minimal writer, bytes per reading (each its own readings).
    fn ratio(&self) -> Option<f64> {
        let ab = (self.b.agent_bytes - self.a.agent_bytes) as f64;
        let mb = (self.b.minimal_bytes - self.a.minimal_bytes) as f64;
        let (na, nm) = (self.agent_readings(), self.minimal_readings());
        (mb > 0.0 && na > 0 && nm > 0).then(|| (ab / na as f64) / (mb / nm as f64))
    }

    /// The loss window at the end of the interval, ms.
    fn loss_window_ms(&self) -> u64 {
        match self.spec.window {
            Window::Fixed(ms) => ms,
            _ => self.end_window_ms.unwrap_or(self.window_ms),
        }
    }

    fn print_notes(&self) {
        let label = self.spec.label();
        let stored = self
            .stored_payload_len
            .map_or("n/a".into(), |n| format!("{n:.0} B"));
        let window = if self.window_from_log {
            "from the agent's log"
        } else {
            "fallback"
        };
        println!(
            "-- {label}: payload {} B delivered (stored mean {stored}), commit window at start {} ms ({window}); the minimal writer started at {} ms, checkpoints every {} s{}{}",
            self.payload_len,
            self.window_ms,
            self.minimal_window_ms,
            self.minimal_checkpoint_secs,
            if self.minimal_synced { ", commits synced" } else { "" },
            if matches!(self.spec.window, Window::Budget(_)) && !self.spec.full {
                ", then followed the agent's window"
            } else {
                ""
            }
        );
        if let Some((_, span)) = self.agent_commits {
            println!("-- {label}: agent commits from write_budget records {span:.0} s apart");
        }
        if let Some(c) = &self.last_checkpoint {
            println!("-- {label}: agent's last_checkpoint record: {c}");
        }
        if let Some((left, all)) = self.unretired {
            println!("-- {label}: rows not yet retired when the interval ended: {left} of {all}");
        }
        for c in &self.complaints {
            println!("-- {label}: agent log: {c}");
        }
    }
}

fn per(n: Option<f64>, readings: u64) -> String {
    match n {
        Some(n) if readings > 0 => format!("{:.2}", n / readings as f64),
        _ => "n/a".into(),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.0}"))
}

fn print_tables(rows: &[Row]) {
    println!();
    println!(
        "{:<8} {:>9} {:>9} {:>6} | {:>9} {:>7} {:>6} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>6}",
        "row",
        "MB/day",
        "minimal",
        "ratio",
        "window",
        "changes",
        "health",
        "budget",
        "status",
        "outage",
        "metrics",
        "health",
        "off"
    );
    for r in rows {
        let (agent, minimal) = r.mb_per_day();
        let p = &r.projections;
        let off = p.status.map_or("n/a".into(), |s| {
            format!("{:+.0}%", (s / agent - 1.0) * 100.0)
        });
        println!(
            "{:<8} {:>9.0} {:>9.0} {:>6} | {:>7}ms {:>7} {:>6} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>6}",
            r.spec.label(),
            agent,
            minimal,
            r.ratio().map_or("n/a".into(), |x| format!("{x:.2}")),
            r.loss_window_ms(),
            r.window_changes,
            r.health_changes,
            r.budget_changes,
            opt(p.status),
            opt(p.outage),
            opt(p.metrics),
            opt(p.health),
            off
        );
    }
    println!("(MB/day: 10^6 bytes a day the process sent to the block layer over the interval; minimal: the minimal writer at the same window, durability and checkpoint cadence; ratio: agent/minimal bytes per reading; window: the agent's at the end of the interval, changes: its changes during the interval; health, budget: changes of health's state and of its write budget reason over the whole run; status, outage, metrics, health: the agent's projection of MB/day as each shows it at the end (health only when over the budget); off: the projection against the measured MB/day)");
    println!();
    println!(
        "{:<8} {:>8} | {:>9} {:>8} {:>8} | {:>8} {:>9} {:>8} {:>8} | {:>9} {:>9} {:>8}",
        "row",
        "readings",
        "B/reading",
        "commit/r",
        "fsync/r",
        "minimal",
        "B/reading",
        "commit/r",
        "fsync/r",
        "widest",
        "agent wal",
        "ctxsw/s"
    );
    for r in rows {
        let secs = r.secs();
        let (na, nm) = (r.agent_readings(), r.minimal_readings());
        let ab = (r.b.agent_bytes - r.a.agent_bytes) as f64;
        let mb = (r.b.minimal_bytes - r.a.minimal_bytes) as f64;
        let mc = (r.b.minimal.commits - r.a.minimal.commits) as f64;
        println!(
            "{:<8} {:>8} | {:>9.0} {:>8} {:>8} | {:>8} {:>9.0} {:>8} {:>8} | {:>9} {:>9} {:>8.1}",
            r.spec.label(),
            na,
            ab / na.max(1) as f64,
            per(r.agent_commits.map(|(c, _)| c), na),
            per(r.agent_fsyncs.map(|n| n as f64), na),
            nm,
            mb / nm.max(1) as f64,
            per(Some(mc), nm),
            per(r.minimal_fsyncs.map(|n| n as f64), nm),
            r.chosen_max_ms.map_or("n/a".into(), |ms| format!("{ms}ms")),
            r.agent_wal,
            (r.b.agent_ctxsw.saturating_sub(r.a.agent_ctxsw)) as f64 / secs,
        );
    }
    println!("(readings: delivered to the subscriber in the interval; minimal: readings the minimal writer took in it; widest: the widest window the agent chose in the run; agent wal: the -wal file's bytes at the end; ctxsw/s: the agent's context switches per second, several times higher under strace)");
    print_planning(rows);
}

/// The planning table (README, "Planning a board"): MB/day, the loss
/// window and hours of outage a GB of spool holds, at each row's rate.
fn print_planning(rows: &[Row]) {
    println!();
    println!("planning: | readings/s | settings | loss window | flash MB/day | outage a GB of spool holds |");
    for r in rows {
        let (mb_day, _) = r.mb_per_day();
        let hours = match r.spool_bytes_per_row {
            Some(b) if b > 0.0 => format!(
                "{:.0} h ({b:.0} B a row)",
                1e9 / (b * f64::from(r.spec.per_sec)) / 3600.0
            ),
            _ => "n/a".into(),
        };
        let ms = r.loss_window_ms();
        let window = if ms >= 1000 {
            format!("{:.0} s", ms as f64 / 1000.0)
        } else {
            format!("{ms} ms")
        };
        println!(
            "planning: | {}{} | {} | {window} | {mb_day:.0} | {hours} |",
            r.spec.per_sec,
            if r.spec.full { " full" } else { "" },
            r.spec.settings(),
        );
    }
}
