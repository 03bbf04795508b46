//! Bytes on the wire per reading, printed (no pass/fail on figures): the
//! real release agent (`target/release/edgespool`, built if missing)
//! publishing to a real mosquitto on a free loopback port through a
//! counting TCP proxy written here (one thread per direction). The proxy
//! counts TCP payload bytes both ways and frames the MQTT packets (fixed
//! header and Remaining Length, MQTT 5 §2.1) to count PUBLISH and PUBACK.
//!
//! Rows: JSON and postcard single events, JSON batches (`batch_max_events
//! = 50`) plain, lz4 and zstd, postcard batches with zstd; each at 1
//! reading/s and 100 readings/s. The readings (8 numeric fields, the same
//! values for every row) go in through the ingest socket at that rate. The
//! count starts once the agent's connection is up (CONNECT/CONNACK,
//! SUBSCRIBE/SUBACK, the retained status) and stops once every reading is
//! acknowledged in the spool; `keep_alive_secs = 600`, so no PINGREQ falls
//! inside it. An `edgespool sink` per row subscribes `<prefix>/events/#`
//! (and with it the batches) and must store every reading: the only
//! assertion.
//!
//! Then the delivery rate: a 50,000-row backlog in the row's format,
//! written with the library while no broker is reachable (no agent
//! running), then the agent started (through a counting proxy, for the
//! bytes per row of a drain) and timed until no row is PENDING or SENT.
//!
//! Last, receipt mode against puback mode (issue 22): a backlog of
//! `WIRE_RECEIPT_BACKLOG` rows (100,000) drained through a real `edgespool
//! sink` (SQLite store, receipts on) in each mode, JSON single events and
//! JSON batches, each pair run twice in turn (puback, receipt, puback,
//! receipt), timed from the agent's start to no row PENDING or SENT (in
//! receipt mode a row stays SENT until its receipt); the sink must have
//! stored every row.
//!
//! Then (part `compare`) the drain comparison of `common/drains.rs` on a
//! backlog of `WIRE_BACKLOG` rows: the bare rumqttc client and the agent's
//! single-event drain in both protocols, the agent's batched drain (50,
//! plain and lz4), rows/s, the ratio to the bare client and agent CPU
//! seconds per 100,000 rows.
//!
//! Run: `cargo bench --bench wire` (needs /usr/sbin/mosquitto). The bench
//! itself may be built in the dev profile (`--profile dev`): it still runs
//! the release agent. Environment: `WIRE_AGENT` (the binary),
//! `WIRE_SLOW_SECS` (60: the 1/s run), `WIRE_FAST_SECS` (20: the 100/s
//! run), `WIRE_BACKLOG` (50000), `WIRE_RECEIPT_BACKLOG` (100000),
//! `WIRE_PARTS` (`rates,drain,receipts,compare`: which parts to run),
//! `WIRE_RECEIPT_WINDOW` (the receipt runs' `mqtt.receipt_window`; unset:
//! the agent's default).

#[path = "common/drains.rs"]
mod drains;
#[path = "../tests/it/support/mod.rs"]
mod support;

use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::agent::AgentProc;
use support::broker::Broker;
use support::sink::SinkProc;

/// The broker for the bench: no cap on messages in flight and none on
/// what is queued for a subscriber (mosquitto's defaults, 20 and 1000).
const BROKER_EXTRA: &str = "max_inflight_messages 0\nmax_queued_messages 0\n";

const BATCH_EVENTS: usize = 50;
const BATCH_MS: u64 = 10_000;
/// How long the agent and the sink get to stop after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// One row of the table: payload format and batching.
#[derive(Clone, Copy)]
struct Fmt {
    name: &'static str,
    postcard: bool,
    /// `compression` when batched (`batch_max_events = 50`).
    batch: Option<&'static str>,
}

const FORMATS: [Fmt; 6] = [
    Fmt {
        name: "json",
        postcard: false,
        batch: None,
    },
    Fmt {
        name: "postcard",
        postcard: true,
        batch: None,
    },
    Fmt {
        name: "batch-json",
        postcard: false,
        batch: Some("none"),
    },
    Fmt {
        name: "batch-json-lz4",
        postcard: false,
        batch: Some("lz4"),
    },
    Fmt {
        name: "batch-json-zstd",
        postcard: false,
        batch: Some("zstd"),
    },
    Fmt {
        name: "batch-postcard-zstd",
        postcard: true,
        batch: Some("zstd"),
    },
];

fn main() {
    let agent = agent_binary();
    let secs = support::env_u64;
    let slow = secs("WIRE_SLOW_SECS", 60).max(5);
    let fast = secs("WIRE_FAST_SECS", 20).max(2);
    let backlog = secs("WIRE_BACKLOG", 50_000).max(1) as usize;
    let receipt_backlog = secs("WIRE_RECEIPT_BACKLOG", 100_000).max(1) as usize;
    let parts =
        std::env::var("WIRE_PARTS").unwrap_or_else(|_| "rates,drain,receipts,compare".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    let dir = tempfile::Builder::new()
        .prefix("edgespool-wire-")
        .tempdir()
        .expect("create the bench directory");
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!("edgespool wire bench: agent {}", agent.display());
    println!("  machine: {cores} cores ({cpu}); mosquitto on 127.0.0.1:{}, MQTT 5 (the agent's default protocol)", broker.port());
    println!(
        "  readings: 8 numeric fields through the ingest socket, the same values for every format"
    );
    println!("  batches: batch_max_events = {BATCH_EVENTS}, batch_max_ms = {BATCH_MS} (at 1/s a batch closes on time with ~{} readings; at 100/s on size)", BATCH_MS / 1000);
    println!("  counting starts after the connection is up (CONNECT/CONNACK, SUBSCRIBE, retained status) and stops when every reading is acknowledged; keep_alive 600 s (no PINGREQ inside)");

    let mut rows = Vec::new();
    let rates: &[(u64, u64, u64)] = if part("rates") {
        &[(1, 1000, slow), (100, 10, fast)]
    } else {
        &[]
    };
    for &(rate, interval, run_secs) in rates {
        let n = (run_secs * 1000 / interval) as usize;
        println!("  running the six formats side by side at {rate}/s for {run_secs} s ({n} readings each)...");
        let results: Vec<Wire> = std::thread::scope(|s| {
            let handles: Vec<_> = FORMATS
                .iter()
                .map(|f| {
                    let (agent, dir, port) = (&agent, dir.path(), broker.port());
                    s.spawn(move || wire_run(agent, dir, port, *f, rate, interval, n))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a run thread panicked"))
                .collect()
        });
        for (f, w) in FORMATS.iter().zip(results) {
            rows.push((f.name, rate, w));
        }
    }
    let mut drains = Vec::new();
    let drain_formats: &[Fmt] = if part("drain") { &FORMATS } else { &[] };
    for &f in drain_formats {
        let d = drain_run(
            &agent,
            dir.path(),
            broker.port(),
            f,
            backlog,
            DrainMode::NO_SINK,
        );
        println!(
            "  drain {}: {backlog} rows in {:.2} s from spawn (first row acknowledged at {:.2} s)",
            f.name,
            d.took.as_secs_f64(),
            d.first_ack.as_secs_f64()
        );
        drains.push((f.name, d));
    }
    if !rows.is_empty() || !drains.is_empty() {
        print_table(&rows, &drains, backlog);
    }
    if part("receipts") {
        receipt_drains(&agent, dir.path(), broker.port(), receipt_backlog);
    }
    if part("compare") {
        println!();
        let figs = drains::compare(&drains::Setup {
            agent: &agent,
            dir: dir.path(),
            port: broker.port(),
            rows: backlog,
            stream: "tele",
            reading: &|i| {
                let fields = reading(i)
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), FieldValue::Num(v)))
                    .collect();
                NewEvent::new("tele", 1_800_000_000_000 + i as i64 * 1000, true, fields)
            },
        });
        drains::print(backlog, &figs);
    }
}

/// How a drain runs: with a sink storing the rows, and which proof retires
/// a row (`mqtt.retire_on`).
#[derive(Clone, Copy)]
struct DrainMode {
    sink: bool,
    receipt: bool,
    /// Run number, to keep each run's directory and topics apart.
    run: u32,
}

impl DrainMode {
    const NO_SINK: DrainMode = DrainMode {
        sink: false,
        receipt: false,
        run: 0,
    };

    fn tag(&self) -> String {
        match (self.sink, self.receipt) {
            (false, _) => "drain".into(),
            (true, false) => format!("drain-puback-{}", self.run),
            (true, true) => format!("drain-receipt-{}", self.run),
        }
    }
}

/// Receipt mode beside puback mode: the same backlog through a real sink,
/// each pair twice in turn; prints rows/s and the receipt/puback ratio.
fn receipt_drains(agent: &Path, base: &Path, port: u16, rows: usize) {
    println!();
    println!("  receipt mode against puback mode: a {rows}-row backlog drained through an edgespool sink (SQLite, receipts on), each mode twice in turn");
    let formats = [FORMATS[0], FORMATS[2]];
    let mut table = Vec::new();
    for f in formats {
        let mut figures = [Vec::new(), Vec::new()];
        for run in 1..=2 {
            for receipt in [false, true] {
                let mode = DrainMode {
                    sink: true,
                    receipt,
                    run,
                };
                let d = drain_run(agent, base, port, f, rows, mode);
                let stored = d.stored_per_sec.unwrap_or(0.0);
                println!(
                    "  {} {}: {rows} rows retired in {:.2} s from spawn ({:.0} rows/s), all stored by the sink at {:.0} rows/s",
                    f.name,
                    if receipt { "receipt" } else { "puback" },
                    d.took.as_secs_f64(),
                    d.rows_per_sec,
                    stored
                );
                println!("    sink: {}", d.sink_totals);
                figures[usize::from(receipt)].push((d.rows_per_sec, stored));
            }
        }
        table.push((f.name, figures));
    }
    println!();
    println!(
        "{:<12} {:<8} {:>18} {:>18} {:>16}",
        "format", "counted", "puback rows/s", "receipt rows/s", "receipt/puback"
    );
    for (name, [puback, receipt]) in table {
        for (what, pick) in [
            ("retired", (|f: &(f64, f64)| f.0) as fn(&(f64, f64)) -> f64),
            ("stored", |f: &(f64, f64)| f.1),
        ] {
            let show = |v: &[(f64, f64)]| {
                v.iter()
                    .map(|x| format!("{:.0}", pick(x)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let ratios = puback
                .iter()
                .zip(&receipt)
                .map(|(p, r)| format!("{:.2}", pick(r) / pick(p)))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "{name:<12} {what:<8} {:>18} {:>18} {:>16}",
                show(&puback),
                show(&receipt),
                ratios
            );
        }
    }
    println!("(retired: rows/s from the agent's spawn to no row PENDING or SENT; stored: to the sink's database holding every row; receipt/puback per pair of runs)");
}

/// What one rate run measured, over the counting window.
struct Wire {
    readings: usize,
    c2b: u64,
    b2c: u64,
    publishes: u64,
    pubacks: u64,
}

fn print_table(rows: &[(&str, u64, Wire)], drains: &[(&str, Drain)], backlog: usize) {
    println!();
    println!(
        "{:<20} {:>6} {:>12} {:>12} {:>11} {:>11} {:>14}",
        "format", "rate/s", "c->b B/rdg", "b->c B/rdg", "PUBLISH/rdg", "PUBACK/rdg", "drain rows/s"
    );
    for (name, rate, w) in rows {
        let per = |x: u64| x as f64 / w.readings as f64;
        let drain = drains
            .iter()
            .find(|d| d.0 == *name)
            .map_or(0.0, |d| d.1.rows_per_sec);
        println!(
            "{:<20} {:>6} {:>12.1} {:>12.2} {:>11.3} {:>11.3} {:>14.0}",
            name,
            rate,
            per(w.c2b),
            per(w.b2c),
            per(w.publishes),
            per(w.pubacks),
            drain
        );
    }
    println!("(B/rdg: TCP payload bytes per reading, client->broker and broker->client; drain: a {backlog}-row backlog in that format, agent start (process spawn, through the counting proxy) to no row PENDING or SENT, polled every 100 ms)");
    for (name, d) in drains {
        let after_first = (d.took - d.first_ack).as_secs_f64();
        println!(
            "  drain {name}: {:.0} rows/s from the first acknowledgement on ({after_first:.2} s); {:.1} TCP payload bytes client->broker per row",
            backlog as f64 / after_first.max(1e-3),
            d.bytes_per_row
        );
    }
}

// ------------------------------------------------------------------ readings

/// splitmix64: a fixed pseudo-random sequence (the same for every run).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Reading `i`: 8 fields of a plant sensor, smooth trends plus noise,
/// rounded as a sensor reports them.
fn reading(i: usize) -> Vec<(&'static str, f64)> {
    let t = i as f64;
    let noise = |k: u64| (mix(i as u64 * 8 + k) >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    let round = |x: f64, d: i32| (x * 10f64.powi(d)).round() / 10f64.powi(d);
    let volts = round(24.0 + 0.2 * noise(3), 3);
    let amps = round(1.2 + 0.3 * (t / 120.0).sin() + 0.05 * noise(4), 3);
    vec![
        (
            "temp_c",
            round(21.0 + 2.0 * (t / 600.0).sin() + 0.1 * noise(0), 2),
        ),
        (
            "rh_pct",
            round(45.0 + 5.0 * (t / 900.0).cos() + 0.5 * noise(1), 1),
        ),
        ("pressure_hpa", round(1013.2 + 0.3 * noise(2), 1)),
        ("supply_v", volts),
        ("current_a", amps),
        ("power_w", round(volts * amps, 2)),
        ("energy_wh", round(12_345.6 + t * 0.0083, 1)),
        ("rssi_dbm", (-67.0 + 6.0 * noise(5)).round()),
    ]
}

fn ingest_line(i: usize) -> String {
    let fields: Vec<String> = reading(i)
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v}"))
        .collect();
    format!(
        "{{\"stream\":\"tele\",\"fields\":{{{}}}}}\n",
        fields.join(",")
    )
}

// ----------------------------------------------------------------- the runs

fn config(dir: &Path, port: u16, f: Fmt, prefix: &str, retire_on: &str) -> PathBuf {
    let d = dir.display();
    let batch = match f.batch {
        Some(c) => format!(
            "batch_max_events = {BATCH_EVENTS}\nbatch_max_ms = {BATCH_MS}\ncompression = \"{c}\"\n"
        ),
        None => String::new(),
    };
    // One client id per agent: they share the broker, and a second
    // CONNECT under the same id takes the session over (MQTT 5 §3.1.4).
    let client = prefix.replace('/', "-");
    let text = format!(
        r#"device_id = "wire-bench"
[spool]
path = "{d}/spool.db"
tune_from_probe = false
commit_window_ms = 200
[mqtt]
url = "mqtt://127.0.0.1:{port}"
topic_prefix = "{prefix}"
client_id = "{client}"
payload_format = "{}"
keep_alive_secs = 600
reconnect_min_ms = 100
reconnect_max_ms = 500
retire_on = "{retire_on}"
receipt_public_keys = ["{fleet}"]
{window}[agent]
summary_interval_secs = 3600
[ingest]
socket = "{d}/ingest.sock"
[[ingest.streams]]
name = "tele"
{batch}"#,
        if f.postcard { "postcard" } else { "json" },
        fleet = support::keys::fleet_key().key.public().hex(),
        window = std::env::var("WIRE_RECEIPT_WINDOW")
            .map(|w| format!("receipt_window = {w}\n"))
            .unwrap_or_default(),
    );
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).expect("write the agent config");
    path
}

/// One format at one rate: sink, proxy, agent, `n` readings every
/// `interval_ms`; the bytes counted from the connection being up to the
/// last reading acknowledged.
fn wire_run(
    agent: &Path,
    base: &Path,
    port: u16,
    f: Fmt,
    rate: u64,
    interval_ms: u64,
    n: usize,
) -> Wire {
    let dir = base.join(format!("{}-{rate}", f.name));
    std::fs::create_dir_all(&dir).expect("run dir");
    // Ends with the device id: the sink takes the device from the topic.
    let prefix = format!("wire/{}-{rate}/wire-bench", f.name);
    let sink = Sink::start(agent, port, &prefix, &dir);
    let proxy = Proxy::start(port);
    let cfg = config(&dir, proxy.port, f, &prefix, "puback");
    let mut proc = AgentProc::spawn_bin(agent, &cfg, &dir, "info");
    // The connection is up: CONNACK came back and nothing moved for 1 s
    // (SUBSCRIBE/SUBACK and the retained status are done).
    let up = wait(Duration::from_secs(30), || proxy.b2c.bytes() >= 4);
    assert!(
        up,
        "{}: the agent did not connect:\n{}",
        f.name,
        proc.log_tail(30)
    );
    let mut last = proxy.snapshot();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_secs(1));
        let now = proxy.snapshot();
        if now == last {
            break;
        }
        last = now;
    }
    let start = last;
    let mut ingest = Ingest::connect(&dir.join("ingest.sock"));
    let t0 = Instant::now();
    for i in 0..n {
        let due = t0 + Duration::from_millis(i as u64 * interval_ms);
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        ingest.send(&ingest_line(i));
    }
    ingest.finish(n);
    let db = dir.join("spool.db");
    let acked = wait(Duration::from_secs(BATCH_MS / 1000 + 60), || {
        count(
            &db,
            "SELECT count(*) FROM event_states WHERE stream = 'tele' AND state = 'ACKED'",
        ) == n as i64
    });
    assert!(
        acked,
        "{}: not every reading acknowledged:\n{}",
        f.name,
        proc.log_tail(30)
    );
    std::thread::sleep(Duration::from_millis(300));
    let end = proxy.snapshot();
    proc.terminate(STOP_GRACE);
    sink.expect(n, f.name, Instant::now());
    Wire {
        readings: n,
        c2b: end.0 - start.0,
        b2c: end.1 - start.1,
        publishes: end.2 - start.2,
        pubacks: end.3 - start.3,
    }
}

/// A backlog of `rows` readings in `f`'s format, then the agent started:
/// rows/s from its start to no row PENDING or SENT, and client->broker
/// bytes per row (counted through the proxy).
fn drain_run(agent: &Path, base: &Path, port: u16, f: Fmt, rows: usize, mode: DrainMode) -> Drain {
    let dir = base.join(format!("{}-{}", f.name, mode.tag()));
    std::fs::create_dir_all(&dir).expect("drain dir");
    let db = dir.join("spool.db");
    let format = if f.postcard {
        Format::Postcard
    } else {
        Format::Json
    };
    {
        let mut spool = Spool::open(&db, &SpoolOptions::default()).expect("open the spool");
        let mut ids = EventIdGen::new().expect("event ids");
        let t0 = 1_800_000_000_000i64;
        for chunk in (0..rows).collect::<Vec<_>>().chunks(10_000) {
            let evs: Vec<NewEvent> = chunk
                .iter()
                .map(|&i| {
                    let fields = reading(i)
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), FieldValue::Num(v)))
                        .collect();
                    NewEvent::new("tele", t0 + i as i64 * 1000, true, fields)
                })
                .collect();
            spool
                .append(&evs, &mut ids, "wire-bench", format, t0)
                .expect("append the backlog");
        }
    }
    // Ends with the device id: the sink takes the device from the topic.
    let prefix = format!("wire/{}-{}/wire-bench", f.name, mode.tag());
    let sink = mode.sink.then(|| Sink::start(agent, port, &prefix, &dir));
    let proxy = Proxy::start(port);
    let retire = if mode.receipt { "receipt" } else { "puback" };
    let cfg = config(&dir, proxy.port, f, &prefix, retire);
    let t = Instant::now();
    let mut proc = AgentProc::spawn_bin(agent, &cfg, &dir, "info");
    let q = "SELECT count(*) FROM event_states WHERE state IN ('PENDING','SENT')";
    let mut first_ack = None;
    let done = wait(Duration::from_secs(600), || {
        let left = count(&db, q);
        if first_ack.is_none() && (0..rows as i64).contains(&left) {
            first_ack = Some(t.elapsed());
        }
        left == 0
    });
    let took = t.elapsed();
    assert!(
        done,
        "{}: the backlog did not drain:\n{}",
        f.name,
        proc.log_tail(30)
    );
    let acked = count(
        &db,
        "SELECT count(*) FROM event_states WHERE state = 'ACKED'",
    );
    assert_eq!(acked, rows as i64, "{}: rows acknowledged", f.name);
    let bytes = proxy.snapshot().0;
    // Stored: when the sink's database held every row (the agent may be
    // done first in puback mode, never in receipt mode).
    let (stored, sink_totals) = match sink {
        Some(sink) => {
            let (at, totals) = sink.expect(rows, f.name, t);
            (Some(at.max(took)), totals)
        }
        None => (None, String::new()),
    };
    proc.terminate(STOP_GRACE);
    let first = first_ack.unwrap_or(took);
    Drain {
        rows_per_sec: rows as f64 / took.as_secs_f64(),
        stored_per_sec: stored.map(|s| rows as f64 / s.as_secs_f64()),
        sink_totals,
        first_ack: first,
        took,
        bytes_per_row: bytes as f64 / rows as f64,
    }
}

/// A drain's figures.
struct Drain {
    /// Rows over the time from the agent's spawn to the last acknowledgement.
    rows_per_sec: f64,
    /// Rows over the time from the agent's spawn to the sink's database
    /// holding every row (with a sink).
    stored_per_sec: Option<f64>,
    /// The sink's last totals line (with a sink).
    sink_totals: String,
    /// From spawn to the first acknowledged row (as polled).
    first_ack: Duration,
    took: Duration,
    bytes_per_row: f64,
}

fn count(db: &Path, sql: &str) -> i64 {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return -1;
    };
    let _ = c.busy_timeout(Duration::from_secs(5));
    c.query_row(sql, [], |r| r.get(0)).unwrap_or(-1)
}

/// [`support::poll`] every 100 ms: a check here may read a large spool.
fn wait(limit: Duration, f: impl FnMut() -> bool) -> bool {
    support::poll(limit, Duration::from_millis(100), f)
}

// ---------------------------------------------------------------- processes

/// `WIRE_AGENT`, else the release binary next to this bench's target
/// directory (`cargo build --release --bin edgespool` when missing).
fn agent_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("WIRE_AGENT") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_edgespool"));
    if cfg!(not(debug_assertions)) {
        return built;
    }
    // target/debug/edgespool -> target/release/edgespool
    let target = built
        .parent()
        .and_then(Path::parent)
        .expect("the target directory")
        .to_path_buf();
    let release = target.join("release").join("edgespool");
    if !release.is_file() {
        println!(
            "building {} (cargo build --release --bin edgespool)...",
            release.display()
        );
        let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--release", "--bin", "edgespool"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .expect("run cargo");
        assert!(st.success(), "the release build failed");
    }
    release
}

/// `edgespool sink --db` on `<prefix>/events/#` (and so the batches).
struct Sink {
    proc: SinkProc,
    db: PathBuf,
}

impl Sink {
    fn start(agent: &Path, port: u16, prefix: &str, dir: &Path) -> Sink {
        let db = dir.join("sink.db");
        let url = format!("mqtt://127.0.0.1:{port}");
        let filter = format!("{prefix}/events/#");
        let id = format!("sink-{}", prefix.replace('/', "-"));
        let db_arg = db.to_str().expect("a UTF-8 path");
        let args = [
            "--url",
            &url,
            "--topic",
            &filter,
            "--db",
            db_arg,
            "--client-id",
            &id,
        ];
        let proc = SinkProc::launch_bin(agent, "sink", dir, &args);
        proc.wait_subscribed();
        Sink { proc, db }
    }

    /// Every reading stored (the bench's one assertion); returns when
    /// that was first seen, from `since` (polled every 100 ms).
    fn expect(mut self, n: usize, name: &str, since: Instant) -> (Duration, String) {
        let q = "SELECT count(*) FROM received";
        let ok = wait(Duration::from_secs(60), || count(&self.db, q) == n as i64);
        let at = since.elapsed();
        assert!(
            ok,
            "{name}: the sink stored {} of {n} readings:\n{}",
            count(&self.db, q),
            support::tail(&self.proc.log_text(), 30)
        );
        self.proc.stop(STOP_GRACE);
        let text = self.proc.log_text();
        let totals = text
            .lines()
            .rev()
            .find(|l| l.contains("receipts_dropped"))
            .and_then(|l| l.split("sink: ").nth(1))
            .unwrap_or("")
            .to_owned();
        (at, totals)
    }
}

// ------------------------------------------------------------------- ingest

/// A pipelined ingest connection: lines written on the schedule, replies
/// counted by a thread.
struct Ingest {
    stream: UnixStream,
    ok: Arc<AtomicU64>,
    refused: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Ingest {
    fn connect(sock: &Path) -> Ingest {
        let mut stream = None;
        wait(Duration::from_secs(30), || {
            stream = UnixStream::connect(sock).ok();
            stream.is_some()
        });
        let stream = stream.expect("connect to the ingest socket");
        let r = stream.try_clone().expect("clone the ingest socket");
        let ok = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (ok2, refused2) = (ok.clone(), refused.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("{\"ok\":true") {
                    ok2.fetch_add(1, Ordering::Relaxed);
                } else if let Ok(mut v) = refused2.lock() {
                    v.push(line);
                }
            }
        });
        Ingest {
            stream,
            ok,
            refused,
        }
    }

    fn send(&mut self, line: &str) {
        self.stream
            .write_all(line.as_bytes())
            .expect("write to the ingest socket");
    }

    /// Wait for `n` replies, all `ok`.
    fn finish(self, n: usize) {
        let replies = || {
            self.ok.load(Ordering::Relaxed) as usize + self.refused.lock().map_or(0, |v| v.len())
        };
        wait(Duration::from_secs(60), || replies() >= n);
        let ok = self.ok.load(Ordering::Relaxed) as usize;
        let refused = self.refused.lock().map(|v| v.clone()).unwrap_or_default();
        assert!(
            ok == n && refused.is_empty(),
            "{ok} of {n} readings accepted; refused: {refused:?}"
        );
    }
}

// -------------------------------------------------------------------- proxy

/// Bytes and MQTT packets counted in one direction, over all connections.
#[derive(Default)]
struct Counter {
    bytes: AtomicU64,
    /// Control packets by type (MQTT 5 §2.1.2): 3 PUBLISH, 4 PUBACK.
    packets: [AtomicU64; 16],
}

impl Counter {
    fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
    fn packets(&self, ty: usize) -> u64 {
        self.packets[ty].load(Ordering::Relaxed)
    }
}

/// Frames a byte stream into MQTT control packets: the first byte's high
/// nibble is the type, then a variable byte integer Remaining Length (MQTT 5
/// §1.5.5), then that many bytes.
enum Framer {
    Header,
    Length { ty: u8, value: usize, shift: u32 },
    Body { left: usize },
}

impl Framer {
    fn feed(&mut self, mut buf: &[u8], counter: &Counter) {
        while let Some(&b) = buf.first() {
            match self {
                Framer::Header => {
                    *self = Framer::Length {
                        ty: b >> 4,
                        value: 0,
                        shift: 0,
                    };
                    buf = &buf[1..];
                }
                Framer::Length { ty, value, shift } => {
                    *value |= usize::from(b & 0x7f) << *shift;
                    *shift += 7;
                    buf = &buf[1..];
                    if b & 0x80 == 0 {
                        counter.packets[usize::from(*ty)].fetch_add(1, Ordering::Relaxed);
                        *self = if *value == 0 {
                            Framer::Header
                        } else {
                            Framer::Body { left: *value }
                        };
                    }
                }
                Framer::Body { left } => {
                    let take = (*left).min(buf.len());
                    *left -= take;
                    buf = &buf[take..];
                    if *left == 0 {
                        *self = Framer::Header;
                    }
                }
            }
        }
    }
}

/// A TCP proxy to the broker counting what passes: a thread per direction
/// per connection.
struct Proxy {
    port: u16,
    c2b: Arc<Counter>,
    b2c: Arc<Counter>,
}

impl Proxy {
    fn start(broker: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let c2b = Arc::new(Counter::default());
        let b2c = Arc::new(Counter::default());
        let (up, down) = (c2b.clone(), b2c.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", broker)) else {
                    continue;
                };
                let (c2, s2) = match (client.try_clone(), server.try_clone()) {
                    (Ok(c), Ok(s)) => (c, s),
                    _ => continue,
                };
                let (up, down) = (up.clone(), down.clone());
                std::thread::spawn(move || pump(client, server, &up));
                std::thread::spawn(move || pump(s2, c2, &down));
            }
        });
        Proxy { port, c2b, b2c }
    }

    /// (client->broker bytes, broker->client bytes, PUBLISH sent, PUBACK received).
    fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.c2b.bytes(),
            self.b2c.bytes(),
            self.c2b.packets(3),
            self.b2c.packets(4),
        )
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, counter: &Counter) {
    let _ = from.set_nodelay(true);
    let _ = to.set_nodelay(true);
    let mut framer = Framer::Header;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        counter.bytes.fetch_add(n as u64, Ordering::Relaxed);
        framer.feed(&buf[..n], counter);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}
