//! Backlog figures for the real agent binary, printed (no pass/fail):
//!
//! 1. startup with a backlog: from spawning `edgespool run` on a spool that
//!    already holds `BACKLOG_ROWS` unacknowledged rows to the first PUBLISH
//!    at a subscriber (connected and subscribed before the agent starts), and
//!    to the agent's first log line naming the spool file;
//! 2. drain: rows/s until every row reached the subscriber (distinct event
//!    ids), the peak `-wal` size (sampled every 50 ms) and the longest gap
//!    between two consecutive messages (a stall shows there);
//! 3. file size after the drain with `acked_retention_secs = 0`: spool and
//!    `-wal` sizes every 5 s for up to `RETAIN_SECS`, until retention has removed
//!    the acknowledged rows and the file is at most twice its live data plus
//!    8 MiB (and the peak `-wal` size meanwhile);
//! 4. idle wakeups: context switches per second of every agent thread with
//!    one reading a minute, next to an idle `mosquitto_sub` and idle rumqttc
//!    sync clients;
//! 5. delivery ratio on the backlog: the drain rate of (2) against a bare
//!    rumqttc sync publisher (QoS 1, the agent's default in-flight window,
//!    same payload size, same broker) sending the same number of messages;
//! 6. delivery ratio on a fresh stream: the agent with fast `file` sources
//!    against the bare publisher at the same offered rate: delivered/s and
//!    end-to-end latency (reading `ts_ms` to arrival) p50/p99.
//!
//! The backlog is built with the library (`Spool::open` + `append`, batches
//! of 1,000 readings of about 175 bytes of JSON each); the agent is observed
//! only from outside (its process, its files, the broker and `edgespool
//! status --json`), so the figures survive changes to the spool schema.
//!
//! 7. the drain comparison of `common/drains.rs` on a backlog of
//!    `COMPARE_ROWS` rows: the bare rumqttc client and the agent's
//!    single-event drain in both protocols, the agent's batched drain (50,
//!    plain and lz4), rows/s, the ratio to the bare client and agent CPU
//!    seconds per 100,000 rows.
//!
//! Run: `cargo bench --bench backlog` (needs /usr/sbin/mosquitto). A quick
//! run: `BACKLOG_ROWS=20000 RETAIN_SECS=20 IDLE_SECS=5 FRESH_SECS=5 cargo bench
//! --bench backlog --profile dev`.
//! Environment: `BACKLOG_ROWS` (1000000), `RETAIN_SECS` (300), `IDLE_SECS` (30),
//! `FRESH_SECS` (20), `COMPARE_ROWS` (`BACKLOG_ROWS`; 0 skips (7)), `FRESH_SOURCES` (10 sources at 10 ms: 1,000 readings/s),
//! `DRAIN_TIMEOUT_SECS` (60 + rows / 500), `BACKLOG_DIR` (/var/tmp; must be
//! on disk, not tmpfs), `BACKLOG_RUST_LOG` (the agents' `RUST_LOG`, `info`;
//! `info,edgespool::flash=debug` logs every checkpoint's outcome),
//! `BACKLOG_LOG_OUT` (a path prefix: each agent's log, seconds since its
//! spawn on every line, is written to `PREFIX.PID` when it stops).

#[path = "common/drains.rs"]
mod drains;
#[path = "../tests/it/support/mod.rs"]
mod support;

use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use rumqttc::{Client, Connection, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use support::broker::Broker;

/// The broker for the bench: no cap on messages in flight and room for
/// the backlog queued (mosquitto's defaults, 20 and 1000, would pace the
/// drain and drop what a slow subscriber has not taken).
const BROKER_EXTRA: &str = "max_inflight_messages 0\nmax_queued_messages 100000\n";

const AGENT: &str = env!("CARGO_BIN_EXE_edgespool");
/// Readings per `append` call while building the backlog.
const BATCH: usize = 1000;
/// The agent's default `mqtt.inflight_window` (src/config/mod.rs).
const WINDOW: usize = 32;
/// The agent's default `mqtt.keep_alive_secs`.
const KEEP_ALIVE: Duration = Duration::from_secs(30);
/// The agent's default `spool.journal_size_limit_bytes`.
const JOURNAL_LIMIT: u64 = 4 * 1024 * 1024;
const MIB: f64 = 1024.0 * 1024.0;
const DEVICE: &str = "bench-device";

fn main() {
    let s = Settings::from_env();
    let base = std::env::var("BACKLOG_DIR").unwrap_or_else(|_| "/var/tmp".into());
    let dir = tempfile::Builder::new()
        .prefix("edgespool-backlog-")
        .tempdir_in(&base)
        .expect("create the bench directory");
    warn_if_tmpfs(dir.path());
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    println!(
        "edgespool backlog bench: {} rows, spool dir {}, mosquitto on port {}, agent {AGENT}",
        s.rows,
        dir.path().display(),
        broker.port()
    );
    // One stored storage profile for every spool of this run (it is kept per
    // directory), so no agent start below pays for a first probe.
    let probe = run_bounded(
        Command::new(AGENT)
            .args(["probe-storage", "--dir"])
            .arg(dir.path()),
        Duration::from_secs(120),
    );
    if !probe.as_ref().is_some_and(|(st, _)| st.success()) {
        println!("  (probe-storage failed; the first agent start will probe itself)");
    }
    let one = dir.path().join("one-number");
    std::fs::write(&one, "42.5\n").expect("write the file source's number");

    let spool = dir.path().join("spool-backlog.db");
    let t = Instant::now();
    fill_spool(&spool, s.rows);
    let fill = t.elapsed();
    println!(
        "  filled {} rows in {:.1} s ({:.0} rows/s), spool file {:.1} MiB",
        s.rows,
        fill.as_secs_f64(),
        s.rows as f64 / fill.as_secs_f64(),
        file_len(&spool) as f64 / MIB
    );
    let backlog = backlog_run(&s, dir.path(), broker.port(), &spool);
    let bare = bare_backlog(broker.port(), s.rows, backlog.drain.payload_len);
    let idle = idle_wakeups(&s, dir.path(), broker.port(), &one);
    let fresh = fresh_stream(&s, dir.path(), broker.port(), &one);
    let compared = (s.compare_rows > 0).then(|| {
        let base = wall_ms() as i64 - s.compare_rows as i64 * 10;
        drains::compare(&drains::Setup {
            agent: Path::new(AGENT),
            dir: dir.path(),
            port: broker.port(),
            rows: s.compare_rows,
            stream: "bench",
            reading: &|i| reading(i, base),
        })
    });
    println!();
    print_summary(&s, &backlog, &bare, &idle, &fresh);
    if let Some(figs) = compared {
        drains::print(s.compare_rows, &figs);
    }
}

struct Settings {
    rows: usize,
    retain: Duration,
    idle: Duration,
    fresh: Duration,
    fresh_sources: usize,
    drain_timeout: Duration,
    compare_rows: usize,
}

impl Settings {
    fn from_env() -> Settings {
        let num = |name: &str, default: u64| -> u64 {
            std::env::var(name)
                .ok()
                .map(|v| v.replace('_', ""))
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let rows = num("BACKLOG_ROWS", 1_000_000).max(1) as usize;
        Settings {
            rows,
            retain: Duration::from_secs(num("RETAIN_SECS", 300)),
            idle: Duration::from_secs(num("IDLE_SECS", 30).max(1)),
            fresh: Duration::from_secs(num("FRESH_SECS", 20).max(1)),
            fresh_sources: num("FRESH_SOURCES", 10).clamp(1, 100) as usize,
            drain_timeout: Duration::from_secs(num("DRAIN_TIMEOUT_SECS", 60 + rows as u64 / 500)),
            compare_rows: num("COMPARE_ROWS", rows as u64) as usize,
        }
    }
}

// ---------------------------------------------------------------- processes

/// Log lines with the time since spawn they were read at.
type LogLines = Arc<Mutex<Vec<(Duration, String)>>>;

/// The real agent binary, its stderr collected line by line; stopped with
/// SIGTERM (then SIGKILL after 15 s) when dropped.
struct Agent {
    child: Child,
    spawned: Instant,
    log: LogLines,
    reader: Option<JoinHandle<()>>,
}

impl Agent {
    fn spawn(config: &Path) -> Agent {
        let spawned = Instant::now();
        let mut child = Command::new(AGENT)
            .args(["run", "--config"])
            .arg(config)
            .env(
                "RUST_LOG",
                std::env::var("BACKLOG_RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the agent binary");
        let stderr = child.stderr.take().expect("the agent's stderr pipe");
        let log = LogLines::default();
        let reader = {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    lock(&log).push((spawned.elapsed(), line));
                }
            })
        };
        Agent {
            child,
            spawned,
            log,
            reader: Some(reader),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn first_line(&self, needle: &str) -> Option<(Duration, String)> {
        lock(&self.log)
            .iter()
            .find(|(_, l)| l.contains(needle))
            .cloned()
    }

    fn lines(&self) -> Vec<(Duration, String)> {
        lock(&self.log).clone()
    }

    /// Panic with the tail of the agent's log if it has exited.
    fn assert_alive(&mut self, during: &str) {
        if !self.alive() {
            let tail: Vec<String> = self
                .lines()
                .iter()
                .rev()
                .take(15)
                .map(|(_, l)| l.clone())
                .collect();
            panic!(
                "the agent exited during {during}; last log lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }

    /// SIGTERM, wait up to 15 s, then SIGKILL. Returns the exit status and
    /// how long the stop took (None if it had already exited).
    fn stop(&mut self) -> Option<(ExitStatus, Duration)> {
        if !self.alive() {
            return None;
        }
        let t = Instant::now();
        let stopped = support::terminate(&mut self.child, Duration::from_secs(15));
        if stopped.is_none() {
            println!("  (agent did not stop within 15 s of SIGTERM; killed it)");
        }
        // Killed: the status of the kill, which terminate has reaped.
        let status = stopped.or_else(|| self.child.wait().ok());
        status.map(|st| (st, t.elapsed()))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        if let Some(h) = self.reader.take() {
            join_within(h, Duration::from_secs(2));
        }
        if let Ok(p) = std::env::var("BACKLOG_LOG_OUT") {
            let text: String = lock(&self.log)
                .iter()
                .map(|(t, l)| format!("{:.3} {l}\n", t.as_secs_f64()))
                .collect();
            let _ = std::fs::write(format!("{p}.{}", self.child.id()), text);
        }
    }
}

/// Run `cmd` with its stdout collected; killed after `timeout`.
fn run_bounded(cmd: &mut Command, timeout: Duration) -> Option<(ExitStatus, String)> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut out = child.stdout.take()?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let text = reader.join().unwrap_or_default();
    status.map(|st| (st, text))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------- the spool

/// One reading shaped like a `file` source's (`{"value": x}`): about 175
/// bytes of JSON envelope with the device id and the event id.
fn reading(i: usize, base_ms: i64) -> NewEvent {
    NewEvent {
        replay: None,
        stream: "bench".into(),
        ts_ms: base_ms + i as i64 * 10,
        clock_trusted: true,
        mono: None,
        fields: vec![("value".into(), FieldValue::Num((i % 1000) as f64 / 8.0))],
        key: None,
        reply: None,
    }
}

/// Append `rows` readings (10 ms apart, the newest now) in batches of [`BATCH`].
fn fill_spool(path: &Path, rows: usize) {
    let mut spool = Spool::open(path, &SpoolOptions::default()).expect("open the spool to fill it");
    let mut ids = EventIdGen::new().expect("event id generator");
    let base = wall_ms() as i64 - rows as i64 * 10;
    let mut done = 0;
    let mut next_report = Instant::now() + Duration::from_secs(15);
    while done < rows {
        let n = BATCH.min(rows - done);
        let batch: Vec<NewEvent> = (done..done + n).map(|i| reading(i, base)).collect();
        spool
            .append(&batch, &mut ids, DEVICE, Format::Json, wall_ms() as i64)
            .expect("append a batch to the spool");
        done += n;
        if Instant::now() >= next_report {
            println!("  .. filling: {done} rows");
            next_report += Duration::from_secs(15);
        }
    }
}

fn wal_path(db: &Path) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push("-wal");
    PathBuf::from(s)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Live data in the spool, `(page_count - freelist_count) * page_size`, read
/// on a read-only connection, one statement at a time.
fn live_data_bytes(db: &Path) -> Option<u64> {
    use rusqlite::{Connection, OpenFlags};
    let c = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()?;
    c.busy_timeout(Duration::from_secs(5)).ok()?;
    let q = |p: &str| {
        c.query_row(&format!("PRAGMA {p}"), [], |r| r.get::<_, i64>(0))
            .ok()
    };
    let (pages, free, size) = (q("page_count")?, q("freelist_count")?, q("page_size")?);
    Some(((pages - free).max(0) * size) as u64)
}

/// Rows by state from `edgespool status --spool PATH --json`.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    unacked: i64,
    acked: i64,
    failed: i64,
}

/// `totals` (an array of [state, count] pairs, or an object {state: count})
/// and the recorded `last_checkpoint`, if any.
fn status(db: &Path) -> (Option<Totals>, Option<String>) {
    let Some((st, out)) = run_bounded(
        Command::new(AGENT)
            .args(["status", "--json", "--spool"])
            .arg(db),
        Duration::from_secs(60),
    ) else {
        return (None, None);
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&out) else {
        return (None, None);
    };
    if !st.success() {
        return (None, None);
    }
    let mut counts: HashMap<String, i64> = HashMap::new();
    match &v["totals"] {
        serde_json::Value::Array(pairs) => {
            for p in pairs {
                if let (Some(s), Some(n)) = (p[0].as_str(), p[1].as_i64()) {
                    counts.insert(s.to_owned(), n);
                }
            }
        }
        serde_json::Value::Object(m) => {
            for (s, n) in m {
                counts.insert(s.clone(), n.as_i64().unwrap_or(0));
            }
        }
        _ => return (None, None),
    }
    let get = |k: &str| counts.get(k).copied().unwrap_or(0);
    let totals = Totals {
        unacked: get("PENDING") + get("SENT"),
        acked: get("ACKED"),
        failed: get("FAILED"),
    };
    let checkpoint = match &v["agent_state"] {
        serde_json::Value::Array(a) => a
            .iter()
            .find(|e| e[0] == "last_checkpoint")
            .and_then(|e| e[1].as_str().map(str::to_owned)),
        // {key: {"value": ..., "updated_ms": ...}}
        serde_json::Value::Object(o) => o.get("last_checkpoint").map(|e| e["value"].to_string()),
        _ => None,
    };
    (Some(totals), checkpoint)
}

fn write_config(dir: &Path, name: &str, spool: &Path, port: u16, body: &str) -> PathBuf {
    let text = format!(
        "device_id = \"{DEVICE}\"\n[spool]\npath = \"{}\"\n{body}\n",
        spool.display()
    )
    .replace(
        "[mqtt]",
        &format!("[mqtt]\nurl = \"mqtt://127.0.0.1:{port}\""),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).expect("write the agent config");
    path
}

fn wall_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as f64 / 1000.0)
        .unwrap_or(0.0)
}

fn warn_if_tmpfs(dir: &Path) {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("path without NUL");
    // SAFETY: statfs(2) with a valid NUL-terminated path and a zeroed out-struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type == libc::TMPFS_MAGIC {
        println!(
            "  WARNING: {} is on tmpfs; set BACKLOG_DIR to a disk directory",
            dir.display()
        );
    }
}

// ---------------------------------------------------------------- subscriber

/// What the subscriber saw since its last reset.
#[derive(Default)]
struct Arrivals {
    first: Option<Instant>,
    prev: Option<Instant>,
    last_new: Option<Instant>,
    ids: HashSet<u128>,
    messages: u64,
    unparsed: u64,
    payload_len: usize,
    /// Distinct ids after which gap tracking stops (the drain is over).
    target: usize,
    done: Option<Instant>,
    /// Gaps over 20 ms between consecutive messages: (gap, since first).
    gaps: Vec<(Duration, Duration)>,
    /// Reading `ts_ms` to arrival, ms (only when latencies are wanted).
    latencies: Vec<f64>,
    want_latency: bool,
}

impl Arrivals {
    fn record(&mut self, payload: &[u8]) {
        let now = Instant::now();
        let Some((id, ts_ms)) = parse_envelope(payload) else {
            self.unparsed += 1;
            return;
        };
        self.messages += 1;
        self.payload_len = payload.len();
        let first = *self.first.get_or_insert(now);
        if self.done.is_none() {
            if let Some(prev) = self.prev {
                let gap = now - prev;
                if gap > Duration::from_millis(20) && self.gaps.len() < 100_000 {
                    self.gaps.push((gap, prev - first));
                }
            }
        }
        self.prev = Some(now);
        if self.ids.insert(id) {
            self.last_new = Some(now);
            if self.want_latency {
                self.latencies.push(wall_ms() - ts_ms as f64);
            }
            if self.target > 0 && self.ids.len() >= self.target && self.done.is_none() {
                self.done = Some(now);
            }
        }
    }
}

/// `event_id` (hyphenated hex) and `ts_ms` from a JSON envelope.
fn parse_envelope(p: &[u8]) -> Option<(u128, i64)> {
    let find = |key: &[u8]| {
        p.windows(key.len())
            .position(|w| w == key)
            .map(|i| i + key.len())
    };
    let at = find(b"\"event_id\":\"")?;
    let hex: String = std::str::from_utf8(p.get(at..at + 36)?)
        .ok()?
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let id = u128::from_str_radix(&hex, 16).ok()?;
    let at = find(b"\"ts_ms\":")?;
    let end = p[at..].iter().position(|b| !b.is_ascii_digit())? + at;
    let ts = std::str::from_utf8(&p[at..end]).ok()?.parse().ok()?;
    Some((id, ts))
}

/// A rumqttc sync client subscribed at QoS 1, recording every message.
struct Subscriber {
    arrivals: Arc<Mutex<Arrivals>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Connect, subscribe to `filters` and wait for the SUBACKs.
    fn start(port: u16, filters: &[String], target: usize, want_latency: bool) -> Subscriber {
        let mut o = MqttOptions::new(
            format!("bench-sub-{}", support::free_port()),
            "127.0.0.1",
            port,
        );
        o.set_keep_alive(KEEP_ALIVE);
        o.set_max_packet_size(1 << 20, 1 << 20);
        let (client, conn) = Client::new(o, 64);
        for f in filters {
            client
                .subscribe(f.clone(), QoS::AtLeastOnce)
                .expect("queue the subscription");
        }
        let arrivals = Arc::new(Mutex::new(Arrivals {
            target,
            want_latency,
            ..Arrivals::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let subacks = Arc::new(Mutex::new(0usize));
        let handle = {
            let (a, s, n) = (arrivals.clone(), stop.clone(), subacks.clone());
            std::thread::spawn(move || subscriber_loop(client, conn, &a, &s, &n))
        };
        let subacked = support::poll(Duration::from_secs(10), Duration::from_millis(10), || {
            *lock(&subacks) >= filters.len()
        });
        assert!(subacked, "subscriber: no SUBACK within 10 s");
        Subscriber {
            arrivals,
            stop,
            handle: Some(handle),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Arrivals) -> R) -> R {
        f(&mut lock(&self.arrivals))
    }

    fn distinct(&self) -> usize {
        self.with(|a| a.ids.len())
    }

    /// Forget everything seen so far (keeps the settings).
    fn reset(&self) {
        self.with(|a| {
            *a = Arrivals {
                target: a.target,
                want_latency: a.want_latency,
                ..Arrivals::default()
            }
        });
    }

    /// Wait until `cond` holds, at most `timeout`; true if it did.
    fn wait_for(&self, timeout: Duration, cond: impl Fn(&Arrivals) -> bool) -> bool {
        support::poll(timeout, Duration::from_millis(2), || self.with(|a| cond(a)))
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

fn subscriber_loop(
    client: Client,
    mut conn: Connection,
    arrivals: &Mutex<Arrivals>,
    stop: &AtomicBool,
    subacks: &Mutex<usize>,
) {
    // A timeout shorter than a connect attempt would cancel it: 1 s.
    while !stop.load(Ordering::Relaxed) {
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => lock(arrivals).record(&p.payload),
            Ok(Ok(Event::Incoming(Incoming::SubAck(_)))) => *lock(subacks) += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                println!("  (subscriber: {e}; reconnecting)");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = client.try_disconnect();
}

// ---------------------------------------------------------------- samplers

/// Peak sizes seen by a [`SizeSampler`].
#[derive(Debug, Clone, Copy, Default)]
struct SizePeaks {
    wal_peak: u64,
    wal_peak_at: Duration,
    db_peak: u64,
    samples: u64,
    over_limit: u64,
}

/// Samples a spool's file and `-wal` sizes every `every` on its own thread.
struct SizeSampler {
    stop: Arc<AtomicBool>,
    peaks: Arc<Mutex<SizePeaks>>,
    handle: Option<JoinHandle<()>>,
}

impl SizeSampler {
    fn start(db: &Path, every: Duration) -> SizeSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peaks = Arc::new(Mutex::new(SizePeaks::default()));
        let (db, wal) = (db.to_path_buf(), wal_path(db));
        let handle = {
            let (stop, peaks) = (stop.clone(), peaks.clone());
            std::thread::spawn(move || {
                let t0 = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let (w, d) = (file_len(&wal), file_len(&db));
                    let mut p = lock(&peaks);
                    if w > p.wal_peak {
                        p.wal_peak = w;
                        p.wal_peak_at = t0.elapsed();
                    }
                    p.db_peak = p.db_peak.max(d);
                    p.samples += 1;
                    p.over_limit += u64::from(w > JOURNAL_LIMIT);
                    drop(p);
                    std::thread::sleep(every);
                }
            })
        };
        SizeSampler {
            stop,
            peaks,
            handle: Some(handle),
        }
    }

    fn peaks(&self) -> SizePeaks {
        *lock(&self.peaks)
    }
}

impl Drop for SizeSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------- (1)-(3)

struct Startup {
    first_publish: Duration,
    spool_line: Option<Duration>,
    timeline: Vec<(Duration, String)>,
}

struct Drain {
    secs: f64,
    rate: f64,
    rate_from_spawn: f64,
    payload_len: usize,
    duplicates: u64,
    peaks: SizePeaks,
    gaps: Vec<(Duration, Duration)>,
    status_at_end: Option<Totals>,
    checkpoint_at_end: Option<String>,
}

struct Retention {
    wal_peak: u64,
    start: (u64, u64, Option<u64>),
    end: (u64, u64, Option<u64>),
    retention_done: Option<Duration>,
    shrunk: Option<Duration>,
    watched: Duration,
    checkpoint: Option<String>,
}

struct Backlog {
    startup: Startup,
    drain: Drain,
    retention: Retention,
    stopped: Option<(ExitStatus, Duration)>,
    problems: Vec<String>,
}

fn backlog_run(s: &Settings, dir: &Path, port: u16, spool: &Path) -> Backlog {
    let cfg = write_config(
        dir,
        "backlog",
        spool,
        port,
        "acked_retention_secs = 0\n[mqtt]\n",
    );
    let filter = format!("edgespool/{DEVICE}/events/#");
    let sub = Subscriber::start(port, &[filter], s.rows, false);
    let sampler = SizeSampler::start(spool, Duration::from_millis(50));
    let mut agent = Agent::spawn(&cfg);
    let startup = wait_first_publish(&mut agent, &sub, spool);
    println!(
        "(1) first publish {:.0} ms after spawn (spool log line at {})",
        ms(startup.first_publish),
        startup
            .spool_line
            .map_or("-".into(), |d| format!("{:.0} ms", ms(d)))
    );
    let drain = drain(s, &mut agent, &sub, &sampler, spool);
    drop(sampler);
    println!(
        "(2) drained {} rows in {:.1} s: {:.0} rows/s, peak WAL {:.1} MiB",
        s.rows,
        drain.secs,
        drain.rate,
        drain.peaks.wal_peak as f64 / MIB
    );
    drop(sub);
    let retention = watch_retention(s, &mut agent, spool);
    let problems = agent
        .lines()
        .into_iter()
        .filter(|(_, l)| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(|(t, l)| format!("{:>8.1} s  {l}", t.as_secs_f64()))
        .collect();
    let stopped = agent.stop();
    Backlog {
        startup,
        drain,
        retention,
        stopped,
        problems,
    }
}

fn wait_first_publish(agent: &mut Agent, sub: &Subscriber, spool: &Path) -> Startup {
    let deadline = Instant::now() + Duration::from_secs(600);
    while sub.with(|a| a.first.is_none()) {
        agent.assert_alive("startup");
        assert!(
            Instant::now() < deadline,
            "no publish within 600 s of spawn"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let first = sub.with(|a| a.first).expect("first arrival");
    let first_publish = first - agent.spawned;
    let spool_line = agent
        .first_line(&spool.display().to_string())
        .map(|(t, _)| t);
    let timeline = agent
        .lines()
        .into_iter()
        .filter(|(t, _)| *t <= first_publish)
        .collect();
    Startup {
        first_publish,
        spool_line,
        timeline,
    }
}

fn drain(
    s: &Settings,
    agent: &mut Agent,
    sub: &Subscriber,
    sampler: &SizeSampler,
    spool: &Path,
) -> Drain {
    let deadline = Instant::now() + s.drain_timeout;
    let mut report = Instant::now() + Duration::from_secs(10);
    while sub.with(|a| a.done.is_none()) {
        agent.assert_alive("the drain");
        assert!(
            Instant::now() < deadline,
            "drain incomplete after {} s: {} of {} rows at the subscriber (DRAIN_TIMEOUT_SECS)",
            s.drain_timeout.as_secs(),
            sub.distinct(),
            s.rows
        );
        if Instant::now() >= report {
            println!(
                "  .. {:>8} rows at the subscriber, WAL {:.1} MiB now, peak {:.1} MiB",
                sub.distinct(),
                file_len(&wal_path(spool)) as f64 / MIB,
                sampler.peaks().wal_peak as f64 / MIB
            );
            report += Duration::from_secs(10);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let (first, done, messages, payload_len, mut gaps) = sub.with(|a| {
        (
            a.first.expect("first arrival"),
            a.done.expect("drain done"),
            a.messages,
            a.payload_len,
            std::mem::take(&mut a.gaps),
        )
    });
    gaps.sort_by_key(|g| std::cmp::Reverse(g.0));
    gaps.truncate(5);
    let secs = (done - first).as_secs_f64();
    let (status_at_end, checkpoint_at_end) = status(spool);
    Drain {
        secs,
        rate: s.rows as f64 / secs,
        rate_from_spawn: s.rows as f64 / (done - agent.spawned).as_secs_f64(),
        payload_len,
        duplicates: messages.saturating_sub(s.rows as u64),
        peaks: sampler.peaks(),
        gaps,
        status_at_end,
        checkpoint_at_end,
    }
}

/// After the drain: every 5 s, file / WAL / live data, until retention has
/// removed the acknowledged rows (all but 1% at most) and the file is at
/// most twice the live data plus 8 MiB, or `RETAIN_SECS` have passed.
fn watch_retention(s: &Settings, agent: &mut Agent, spool: &Path) -> Retention {
    let t0 = Instant::now();
    let sizes = || {
        (
            file_len(spool),
            file_len(&wal_path(spool)),
            live_data_bytes(spool),
        )
    };
    let sampler = SizeSampler::start(spool, Duration::from_millis(50));
    let start = sizes();
    let live0 = start.2.unwrap_or(start.0);
    let (mut retention_done, mut shrunk) = (None, None);
    println!("(3) after the drain (every 5 s: file, WAL, live data, rows acked/unacked):");
    let end = loop {
        agent.assert_alive("retention");
        let now = sizes();
        let (totals, _) = status(spool);
        let (file, wal, live) = now;
        let live_b = live.unwrap_or(file);
        println!(
            "  {:>5.0} s  file {:>8.1} MiB  wal {:>6.1} MiB  live {:>8}  rows {}",
            t0.elapsed().as_secs_f64(),
            file as f64 / MIB,
            wal as f64 / MIB,
            live.map_or("?".into(), |l| format!("{:.1} MiB", l as f64 / MIB)),
            totals.map_or("?".into(), |t| format!("{}/{}", t.acked, t.unacked))
        );
        // Retention has done its work once at most 1% of the rows remain
        // (a spool may keep its newest acknowledged row as a mark).
        let removed = match totals {
            Some(t) => t.acked + t.unacked <= (s.rows / 100) as i64,
            None => live_b < live0 / 10,
        };
        if removed && retention_done.is_none() {
            retention_done = Some(t0.elapsed());
        }
        if removed && file <= 2 * live_b + 8 * 1024 * 1024 {
            shrunk = Some(t0.elapsed());
            break now;
        }
        if t0.elapsed() + Duration::from_secs(5) > s.retain {
            break now;
        }
        std::thread::sleep(Duration::from_secs(5));
    };
    Retention {
        start,
        end,
        retention_done,
        shrunk,
        watched: t0.elapsed(),
        checkpoint: status(spool).1,
        wal_peak: sampler.peaks().wal_peak,
    }
}

// ---------------------------------------------------------------- (5), (6) bare

/// A payload of `len` bytes shaped like the agent's JSON envelope, with a
/// distinct event id and the wall-clock time of publishing as `ts_ms`.
fn bare_payload(i: usize, len: usize) -> Vec<u8> {
    let id = (0xba5e_u128 << 64) | i as u128;
    let hex = format!("{id:032x}");
    let head = format!(
        "{{\"event_id\":\"{}-{}-{}-{}-{}\",\"device_id\":\"bare\",\"stream\":\"bare\",\"seq\":{},\"ts_ms\":{},\"clock_trusted\":true,\"fields\":{{\"pad\":\"",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32],
        i + 1,
        wall_ms() as i64
    );
    let pad = len.saturating_sub(head.len() + 3);
    let mut p = head.into_bytes();
    p.resize(p.len() + pad, b'x');
    p.extend_from_slice(b"\"}}");
    p
}

/// Publish `count` messages of `len` bytes at QoS 1 with the agent's client
/// settings (sync `Client`, in-flight window, request channel, TCP_NODELAY),
/// paced at `rate` per second if given; returns the time from the first
/// publish call to the last PUBACK.
fn bare_publish(port: u16, topic: &str, count: usize, len: usize, rate: Option<f64>) -> Duration {
    let id = format!("bench-bare-{}", support::free_port());
    let (client, mut conn) = drains::bare_client(id, port, KEEP_ALIVE);
    let start = Instant::now();
    let publisher = {
        let (client, topic) = (client.clone(), topic.to_owned());
        std::thread::spawn(move || {
            for i in 0..count {
                if let Some(r) = rate {
                    let at = start + Duration::from_secs_f64(i as f64 / r);
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                }
                if client
                    .publish(
                        topic.as_str(),
                        QoS::AtLeastOnce,
                        false,
                        bare_payload(i, len),
                    )
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let slack = rate.map_or(Duration::ZERO, |r| {
        Duration::from_secs_f64(count as f64 / r)
    });
    let deadline = start + slack + Duration::from_secs(60 + count as u64 / 500);
    let mut acks = 0;
    while acks < count {
        assert!(
            Instant::now() < deadline,
            "bare publisher: {acks} of {count} PUBACKs by the deadline"
        );
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acks += 1,
            Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Err(e)) => panic!("bare publisher: {e}"),
            Err(RecvTimeoutError::Disconnected) => panic!("bare publisher: event loop closed"),
        }
    }
    let took = start.elapsed();
    let _ = client.try_disconnect();
    for _ in 0..10 {
        if !matches!(conn.recv_timeout(Duration::from_millis(100)), Ok(Ok(_))) {
            break;
        }
    }
    drop(conn);
    let _ = publisher.join();
    took
}

struct Bare {
    puback_rate: f64,
    sub_rate: f64,
}

fn bare_backlog(port: u16, rows: usize, len: usize) -> Bare {
    let topic = "bench/bare/events/bare".to_owned();
    let sub = Subscriber::start(port, std::slice::from_ref(&topic), rows, false);
    let took = bare_publish(port, &topic, rows, len, None);
    let all = sub.wait_for(Duration::from_secs(60), |a| a.done.is_some());
    let sub_rate = sub.with(|a| match (a.first, a.done) {
        (Some(f), Some(d)) if all => rows as f64 / (d - f).as_secs_f64(),
        _ => f64::NAN,
    });
    let puback_rate = rows as f64 / took.as_secs_f64();
    println!("(5) bare publisher: {rows} messages, {puback_rate:.0} PUBACKs/s, {sub_rate:.0} rows/s at the subscriber");
    Bare {
        puback_rate,
        sub_rate,
    }
}

struct Latency {
    delivered_per_sec: f64,
    p50: f64,
    p99: f64,
    max: f64,
    n: usize,
}

fn latency_of(sub: &Subscriber, over: Duration) -> Latency {
    sub.with(|a| {
        let mut l = a.latencies.clone();
        l.sort_by(f64::total_cmp);
        let q = |p: f64| {
            l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1)))
                .copied()
                .unwrap_or(f64::NAN)
        };
        Latency {
            delivered_per_sec: a.ids.len() as f64 / over.as_secs_f64(),
            p50: q(0.50),
            p99: q(0.99),
            max: l.last().copied().unwrap_or(f64::NAN),
            n: l.len(),
        }
    })
}

struct Fresh {
    offered: f64,
    commit_window: Option<String>,
    agent: Latency,
    bare: Latency,
}

fn fresh_stream(s: &Settings, dir: &Path, port: u16, one: &Path) -> Fresh {
    let spool = dir.join("spool-fresh.db");
    let mut body =
        "[mqtt]\ntopic_prefix = \"bench/fresh\"\nclient_id = \"bench-fresh\"\n".to_owned();
    for i in 0..s.fresh_sources {
        body.push_str(&format!(
            "[[sources]]\nname = \"fast{i}\"\nkind = \"file\"\npath = \"{}\"\ninterval_ms = 10\n",
            one.display()
        ));
    }
    let cfg = write_config(dir, "fresh", &spool, port, &body);
    let sub = Subscriber::start(port, &["bench/fresh/events/#".to_owned()], 0, true);
    let mut agent = Agent::spawn(&cfg);
    let warm = sub.wait_for(Duration::from_secs(60), |a| a.first.is_some());
    agent.assert_alive("the fresh stream");
    assert!(warm, "fresh stream: no message within 60 s");
    std::thread::sleep(Duration::from_secs(3));
    let rows0 = status(&spool).0;
    sub.reset();
    let t = Instant::now();
    std::thread::sleep(s.fresh);
    let agent_lat = latency_of(&sub, t.elapsed());
    let sub_len = sub.with(|a| a.payload_len);
    let rows1 = status(&spool).0;
    let over = t.elapsed().as_secs_f64();
    agent.assert_alive("the fresh stream");
    let commit_window = agent.first_line("commit window").and_then(|(_, l)| {
        l.split("-> commit window ")
            .nth(1)
            .map(|r| r.split(',').next().unwrap_or(r).to_owned())
    });
    agent.stop();
    let total = |t: Totals| (t.unacked + t.acked + t.failed) as f64;
    let offered = match (rows0, rows1) {
        (Some(a), Some(b)) => (total(b) - total(a)) / over,
        _ => s.fresh_sources as f64 * 100.0,
    };
    println!(
        "(6) agent: offered {offered:.0} readings/s, delivered {:.0}/s, latency p50 {:.1} ms p99 {:.1} ms",
        agent_lat.delivered_per_sec, agent_lat.p50, agent_lat.p99
    );
    drop(sub);
    let topic = "bench/fresh-bare/events/bare".to_owned();
    let sub = Subscriber::start(port, std::slice::from_ref(&topic), 0, true);
    let count = (offered * s.fresh.as_secs_f64()).round().max(1.0) as usize;
    let len = sub_len.max(1);
    let took = bare_publish(port, &topic, count, len, Some(offered.max(1.0)));
    sub.wait_for(Duration::from_secs(10), |a| a.ids.len() >= count);
    let bare = latency_of(&sub, took);
    println!(
        "(6) bare ({len}-byte payloads like the agent's): delivered {:.0}/s, latency p50 {:.1} ms p99 {:.1} ms",
        bare.delivered_per_sec, bare.p50, bare.p99
    );
    Fresh {
        offered,
        commit_window,
        agent: agent_lat,
        bare,
    }
}

// ---------------------------------------------------------------- (4) idle

/// Per thread: (name, voluntary + nonvoluntary context switches).
fn task_switches(task_dir: &str) -> HashMap<u32, (String, u64)> {
    let mut out = HashMap::new();
    let Ok(rd) = std::fs::read_dir(task_dir) else {
        return out;
    };
    for e in rd.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        let n: u64 = status
            .lines()
            .filter(|l| {
                l.starts_with("voluntary_ctxt_switches:")
                    || l.starts_with("nonvoluntary_ctxt_switches:")
            })
            .filter_map(|l| l.split(':').nth(1)?.trim().parse::<u64>().ok())
            .sum();
        out.insert(tid, (comm.trim().to_owned(), n));
    }
    out
}

/// Wakeups per second per thread between two snapshots (threads that
/// appeared count from zero; threads that ended are left out).
fn per_thread_rate(
    a: &HashMap<u32, (String, u64)>,
    b: &HashMap<u32, (String, u64)>,
    secs: f64,
) -> Vec<(u32, String, f64)> {
    let mut v: Vec<(u32, String, f64)> = b
        .iter()
        .map(|(tid, (name, n))| {
            let before = a.get(tid).map_or(0, |x| x.1);
            (*tid, name.clone(), n.saturating_sub(before) as f64 / secs)
        })
        .collect();
    v.sort_by(|x, y| y.2.total_cmp(&x.2).then(x.0.cmp(&y.0)));
    v
}

/// An idle rumqttc sync client polled on its own thread with
/// `recv_timeout(poll)`; returns its thread id, its client (to disconnect it,
/// which also ends a long poll) and the thread.
fn idle_client(port: u16, poll: Duration, stop: Arc<AtomicBool>) -> (u32, Client, JoinHandle<()>) {
    let mut o = MqttOptions::new(
        format!("bench-idle-{}", support::free_port()),
        "127.0.0.1",
        port,
    );
    o.set_keep_alive(KEEP_ALIVE);
    let (client, mut conn) = Client::new(o, 10);
    let _ = client.subscribe("bench/idle/nothing", QoS::AtLeastOnce);
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        // SAFETY: gettid(2) has no preconditions.
        let _ = tx.send(unsafe { libc::gettid() } as u32);
        // Ends at the next event after `stop` is set: the disconnect request
        // the caller sends is one.
        while !stop.load(Ordering::Relaxed) {
            if let Ok(Err(_)) = conn.recv_timeout(poll) {
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    });
    let tid = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("idle client thread id");
    (tid, client, h)
}

/// Join `h` if it ends within `timeout`; otherwise leave it behind.
fn join_within(h: JoinHandle<()>, timeout: Duration) {
    if support::poll(timeout, Duration::from_millis(10), || h.is_finished()) {
        let _ = h.join();
    }
}

struct Idle {
    agent_total: f64,
    agent_threads: Vec<(u32, String, f64)>,
    others: Vec<(String, f64)>,
}

fn idle_wakeups(s: &Settings, dir: &Path, port: u16, one: &Path) -> Idle {
    let spool = dir.join("spool-idle.db");
    let body = format!(
        "[mqtt]\ntopic_prefix = \"bench/idle\"\nclient_id = \"bench-idle\"\n[[sources]]\nname = \"idle\"\nkind = \"file\"\npath = \"{}\"\ninterval_ms = 60000\n",
        one.display()
    );
    let cfg = write_config(dir, "idle", &spool, port, &body);
    let sub = Subscriber::start(port, &["bench/idle/events/#".to_owned()], 0, false);
    let mut agent = Agent::spawn(&cfg);
    let connected = sub.wait_for(Duration::from_secs(60), |a| a.first.is_some());
    agent.assert_alive("the idle phase");
    assert!(
        connected,
        "idle agent: its first reading did not arrive within 60 s"
    );
    drop(sub);
    let mut sub_child = Command::new("mosquitto_sub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            "bench/idle/nothing",
            "-q",
            "1",
            "-k",
            "30",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok();
    let stop = Arc::new(AtomicBool::new(false));
    // A blocking client (the poll outlasts the keepalive, so only pings and
    // their answers wake it) and one polled like the agent's MQTT thread.
    let blocking = idle_client(port, Duration::from_secs(3600), stop.clone());
    let polling = idle_client(port, Duration::from_millis(500), stop.clone());
    std::thread::sleep(Duration::from_secs(10));
    let apath = format!("/proc/{}/task", agent.pid());
    let spath = sub_child.as_ref().map(|c| format!("/proc/{}/task", c.id()));
    let snap = || {
        (
            task_switches(&apath),
            spath.as_deref().map(task_switches),
            task_switches("/proc/self/task"),
        )
    };
    let (a0, s0, b0) = snap();
    let t = Instant::now();
    std::thread::sleep(s.idle);
    let (a1, s1, b1) = snap();
    let secs = t.elapsed().as_secs_f64();
    agent.assert_alive("the idle phase");
    agent.stop();
    stop.store(true, Ordering::Relaxed);
    let tids = (blocking.0, polling.0);
    if let Some(c) = sub_child.as_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    for (_, client, h) in [blocking, polling] {
        let _ = client.try_disconnect();
        join_within(h, Duration::from_secs(5));
    }
    let agent_threads = per_thread_rate(&a0, &a1, secs);
    let agent_total = agent_threads.iter().map(|t| t.2).sum();
    let mut others = Vec::new();
    if let (Some(s0), Some(s1)) = (s0, s1) {
        others.push((
            "mosquitto_sub -k 30 (idle)".to_owned(),
            per_thread_rate(&s0, &s1, secs).iter().map(|t| t.2).sum(),
        ));
    }
    let own = per_thread_rate(&b0, &b1, secs);
    for (tid, what) in [
        (tids.0, "rumqttc sync client, blocking recv (idle)"),
        (
            tids.1,
            "rumqttc sync client, recv_timeout(500 ms) loop (idle)",
        ),
    ] {
        let rate = own.iter().find(|t| t.0 == tid).map_or(f64::NAN, |t| t.2);
        others.push((what.to_owned(), rate));
    }
    println!("(4) idle agent: {agent_total:.1} wakeups/s over {secs:.0} s");
    Idle {
        agent_total,
        agent_threads,
        others,
    }
}

// ---------------------------------------------------------------- summary

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn sizes_text(s: (u64, u64, Option<u64>)) -> String {
    format!(
        "file {:.1} MiB, WAL {:.1} MiB, live data {}",
        s.0 as f64 / MIB,
        s.1 as f64 / MIB,
        s.2.map_or("?".into(), |l| format!("{:.1} MiB", l as f64 / MIB))
    )
}

fn print_summary(s: &Settings, b: &Backlog, bare: &Bare, idle: &Idle, f: &Fresh) {
    println!("==== edgespool backlog bench: {} rows ====", s.rows);
    print_backlog(s, b);
    println!(
        "4. Idle wakeups (one reading a minute, connected, over {} s after 10 s settling):",
        s.idle.as_secs()
    );
    println!(
        "   agent: {:.1} wakeups/s (voluntary + nonvoluntary context switches, all threads)",
        idle.agent_total
    );
    for (tid, name, r) in &idle.agent_threads {
        println!("     {name:<16} (tid {tid:>7}) {r:>7.2}/s");
    }
    for (what, r) in &idle.others {
        println!("   for comparison, {what}: {r:.2}/s");
    }
    let d = &b.drain;
    println!(
        "5. Delivery ratio, backlog ({} messages of {} bytes, QoS 1, window {WINDOW}): agent {:.0} rows/s, bare rumqttc {:.0} rows/s at the subscriber ({:.0} PUBACKs/s), ratio {:.2}",
        s.rows, d.payload_len, d.rate, bare.sub_rate, bare.puback_rate, d.rate / bare.sub_rate
    );
    println!(
        "6. Fresh stream ({} file sources at 10 ms, {} s; agent commit window {}): offered {:.0} readings/s",
        s.fresh_sources,
        s.fresh.as_secs(),
        f.commit_window.as_deref().unwrap_or("?"),
        f.offered
    );
    for (who, l) in [("agent", &f.agent), ("bare rumqttc", &f.bare)] {
        println!(
            "   {who:<13} delivered {:>7.0}/s, latency ts_ms -> subscriber p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} messages)",
            l.delivered_per_sec, l.p50, l.p99, l.max, l.n
        );
    }
    println!(
        "   ratio {:.2}",
        f.agent.delivered_per_sec / f.bare.delivered_per_sec
    );
    if f.agent.delivered_per_sec >= 0.95 * f.offered {
        println!("   note: the agent delivered the whole offered rate: the offered rate is the bottleneck here; this compares latency, not capacity (see 5)");
    }
}

fn print_backlog(s: &Settings, b: &Backlog) {
    let st = &b.startup;
    println!(
        "1. Startup with {} rows: first PUBLISH at the subscriber {:.0} ms after spawn",
        s.rows,
        ms(st.first_publish)
    );
    match st.spool_line {
        Some(t) => println!(
            "   first log line naming the spool file: {:.0} ms after spawn",
            ms(t)
        ),
        None => println!("   no log line named the spool file before the first publish"),
    }
    println!("   agent log up to the first publish:");
    for (t, l) in &st.timeline {
        println!(
            "   {:>8.0} ms  {}",
            ms(*t),
            l.chars().take(200).collect::<String>()
        );
    }
    let d = &b.drain;
    println!(
        "2. Drain: {} rows in {:.1} s from the first publish: {:.0} rows/s ({:.0} rows/s counting from spawn); {} duplicate deliveries",
        s.rows, d.secs, d.rate, d.rate_from_spawn, d.duplicates
    );
    println!(
        "   peak WAL {:.1} MiB at {:.1} s after spawn ({} of {} samples at 50 ms over the {:.0} MiB journal limit); peak file {:.1} MiB",
        d.peaks.wal_peak as f64 / MIB,
        d.peaks.wal_peak_at.as_secs_f64(),
        d.peaks.over_limit,
        d.peaks.samples,
        JOURNAL_LIMIT as f64 / MIB,
        d.peaks.db_peak as f64 / MIB
    );
    let gaps: Vec<String> = d
        .gaps
        .iter()
        .map(|(g, at)| format!("{:.0} ms at {:.1} s", ms(*g), at.as_secs_f64()))
        .collect();
    println!(
        "   longest gaps between consecutive messages (after the first): {}",
        if gaps.is_empty() {
            "none over 20 ms".into()
        } else {
            gaps.join(", ")
        }
    );
    if let Some(t) = d.status_at_end {
        println!(
            "   status at the end of the drain: {} unacknowledged, {} acked, {} failed",
            t.unacked, t.acked, t.failed
        );
    }
    if let Some(c) = &d.checkpoint_at_end {
        println!("   last checkpoint recorded by then: {c}");
    }
    let r = &b.retention;
    println!(
        "3. After the drain (acked_retention_secs = 0), watched {:.0} s:",
        r.watched.as_secs_f64()
    );
    println!("   start: {}", sizes_text(r.start));
    println!("   end:   {}", sizes_text(r.end));
    println!(
        "   peak WAL meanwhile (sampled every 50 ms): {:.1} MiB",
        r.wal_peak as f64 / MIB
    );
    match r.retention_done {
        Some(t) => println!(
            "   retention removed the acknowledged rows (at most 1% left) {:.0} s after the drain",
            t.as_secs_f64()
        ),
        None => println!("   more than 1% of the rows still in the spool at the end"),
    }
    match r.shrunk {
        Some(t) => println!(
            "   file at most 2 x live data + 8 MiB after {:.0} s",
            t.as_secs_f64()
        ),
        None => println!(
            "   the file did NOT shrink to 2 x live data + 8 MiB within {} s",
            s.retain.as_secs()
        ),
    }
    if let Some(c) = &r.checkpoint {
        println!("   last checkpoint recorded: {c}");
    }
    match b.stopped {
        Some((st, t)) => println!(
            "   agent stopped with {st} in {:.0} ms after SIGTERM",
            ms(t)
        ),
        None => println!("   agent had already exited"),
    }
    if !b.problems.is_empty() {
        println!(
            "   agent warnings/errors during the run ({}):",
            b.problems.len()
        );
        for p in b.problems.iter().take(10) {
            println!("   {}", p.chars().take(220).collect::<String>());
        }
    }
}
