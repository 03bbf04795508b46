//! Throughput and footprint figures, printed (no pass/fail):
//!
//! (a) durable append rate: the spool's `append` against raw rusqlite batched
//!     inserts of rows of the same size with the same pragmas;
//! (b) end-to-end delivery rate (spool → QoS 1 → PUBACK → retired) against a
//!     bare rumqttc QoS 1 publisher with the same in-flight window, both to
//!     the same local mosquitto;
//! (c) bytes written per reading, from /proc/self/io during (a);
//! (d) peak RSS of the real agent binary taking 1,000 readings/s.
//!
//! Run: `cargo bench --bench throughput` (needs mosquitto; `cross/setup-debian.sh`).
//! `BENCH_ROWS` sets the row count (default 20000).

#[path = "../tests/it/support/mod.rs"]
mod support;
use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::broker::Broker;

/// The broker for the bench: no cap on messages in flight and room for
/// every row queued (mosquitto's defaults, 20 and 1000, would pace the
/// publisher and drop what a slow subscriber has not taken).
const BROKER_EXTRA: &str = "max_inflight_messages 0\nmax_queued_messages 100000\n";

const BATCH: usize = 100;
const WINDOW: usize = 32;

fn main() {
    let rows = support::env_u64("BENCH_ROWS", 20_000) as usize;
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    println!("edgespool throughput bench: {rows} rows, batch {BATCH}, window {WINDOW}, mosquitto on port {}", broker.port());

    // BENCH_ONLY=b runs just the delivery comparison (for profiling).
    let only_b = std::env::var("BENCH_ONLY").is_ok_and(|v| v == "b");
    if only_b {
        let db = dir.path().join("only-b.db");
        let len = fill_spool(&db, rows);
        let ours = delivery_rate(&db, broker.port(), rows);
        let bare = bare_publisher_rate(broker.port(), rows, len);
        println!(
            "(b) edgespool {ours:.0} rows/s, bare {bare:.0}, ratio {:.2}",
            ours / bare
        );
        return;
    }
    // (a) + (c): three alternating runs each, medians.
    let mut a_ours = Vec::new();
    let mut a_raw = Vec::new();
    let (mut io_ours, mut io_raw) = ((0, 0), (0, 0));
    for i in 0..3 {
        let (r, io) = append_rate(&dir.path().join(format!("a{i}.db")), rows);
        a_ours.push(r);
        io_ours = io;
        let (r, io) = raw_insert_rate(&dir.path().join(format!("raw{i}.db")), rows);
        a_raw.push(r);
        io_raw = io;
    }
    let (ours, raw) = (median(a_ours), median(a_raw));
    println!("(a) durable append (median of 3): edgespool {ours:.0} rows/s, raw rusqlite {raw:.0} rows/s, ratio {:.2}", ours / raw);
    println!(
        "(c) durability batched (100 readings per commit), storage writes per reading: {:.0} bytes to the block layer (write_bytes), {:.0} bytes through write(2) (wchar); raw rusqlite: {:.0} / {:.0}",
        io_ours.0 as f64 / rows as f64,
        io_ours.1 as f64 / rows as f64,
        io_raw.0 as f64 / rows as f64,
        io_raw.1 as f64 / rows as f64
    );

    // (c) for the full durability class: one reading per commit, synchronous FULL.
    let (full_rate, io_full) = full_append_rate(&dir.path().join("full.db"), 2000);
    println!(
        "(c) durability full (one reading per fsynced commit): {full_rate:.0} readings/s, {:.0} bytes to the block layer per reading (write_bytes), {:.0} through write(2)",
        io_full.0 as f64 / 2000.0,
        io_full.1 as f64 / 2000.0
    );

    // (b)
    let mut b_ours = Vec::new();
    let mut b_bare = Vec::new();
    let mut payload_len = 0;
    for i in 0..3 {
        let db = dir.path().join(format!("deliver{i}.db"));
        payload_len = fill_spool(&db, rows);
        b_ours.push(delivery_rate(&db, broker.port(), rows));
        b_bare.push(bare_publisher_rate(broker.port(), rows, payload_len));
    }
    let (ours, bare) = (median(b_ours), median(b_bare));
    println!(
        "(b) end-to-end delivery ({payload_len}-byte payloads, median of 3): edgespool {ours:.0} rows/s retired on PUBACK, bare rumqttc {bare:.0} PUBACKs/s, ratio {:.2}",
        ours / bare
    );

    // (d)
    let (hwm_kb, rate) = agent_peak_rss(dir.path(), broker.port());
    println!(
        "(d) agent binary at {rate:.0} readings/s for 10 s: peak RSS (VmHWM) {:.1} MB",
        hwm_kb as f64 / 1024.0
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn reading(i: usize) -> NewEvent {
    NewEvent {
        replay: None,
        stream: "bench".into(),
        ts_ms: 1_800_000_000_000 + i as i64,
        clock_trusted: true,
        mono: None,
        fields: vec![
            ("load1".into(), FieldValue::Num(0.25 + i as f64 * 1e-6)),
            ("mem_available_bytes".into(), FieldValue::Num(123_456_789.0)),
            ("temp_c".into(), FieldValue::Num(41.5)),
            ("uptime_secs".into(), FieldValue::Num(1234.5)),
        ],
        key: None,
        reply: None,
    }
}

/// (write_bytes, wchar) from /proc/self/io.
fn proc_io() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (get("write_bytes:"), get("wchar:"))
}

fn sync_fs() {
    // SAFETY: sync(2) has no preconditions; it flushes dirty pages so
    // write_bytes is attributed before we read it.
    unsafe { libc::sync() };
}

fn append_rate(path: &std::path::Path, rows: usize) -> (f64, (u64, u64)) {
    let mut spool = Spool::open(path, &SpoolOptions::default()).expect("open spool");
    let mut ids = EventIdGen::new().expect("ids");
    let batch: Vec<NewEvent> = (0..BATCH).map(reading).collect();
    sync_fs();
    let io0 = proc_io();
    let t = Instant::now();
    for _ in 0..rows / BATCH {
        spool
            .append(&batch, &mut ids, "bench", Format::Json, 0)
            .expect("append");
    }
    let rate = rows as f64 / t.elapsed().as_secs_f64();
    spool
        .checkpoint(edgespool::spool::CheckpointMode::Truncate)
        .expect("checkpoint");
    sync_fs();
    let io1 = proc_io();
    (rate, (io1.0 - io0.0, io1.1 - io0.1))
}

fn full_append_rate(path: &std::path::Path, rows: usize) -> (f64, (u64, u64)) {
    let opts = SpoolOptions {
        synchronous: edgespool::spool::Synchronous::Full,
        ..SpoolOptions::default()
    };
    let mut spool = Spool::open(path, &opts).expect("open spool");
    let mut ids = EventIdGen::new().expect("ids");
    sync_fs();
    let io0 = proc_io();
    let t = Instant::now();
    for i in 0..rows {
        spool
            .append(&[reading(i)], &mut ids, "bench", Format::Json, 0)
            .expect("append");
    }
    let rate = rows as f64 / t.elapsed().as_secs_f64();
    spool
        .checkpoint(edgespool::spool::CheckpointMode::Truncate)
        .expect("checkpoint");
    sync_fs();
    let io1 = proc_io();
    (rate, (io1.0 - io0.0, io1.1 - io0.1))
}

fn raw_insert_rate(path: &std::path::Path, rows: usize) -> (f64, (u64, u64)) {
    // The spool's own schema and pragmas (created by opening it once), then
    // plain rusqlite inserts of precomputed rows into the same table.
    drop(Spool::open(path, &SpoolOptions::default()).expect("create schema"));
    let mut conn = rusqlite::Connection::open(path).expect("open raw");
    let _: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .expect("wal");
    conn.execute_batch("PRAGMA synchronous=NORMAL; PRAGMA journal_size_limit=4194304; PRAGMA wal_autocheckpoint=1000;")
        .expect("pragmas");
    conn.busy_timeout(Duration::from_secs(5)).expect("busy");
    // A payload of the size the spool stores, precomputed: the baseline does
    // no encoding, hashing or id work at all.
    let payload = vec![b'x'; 260];
    let digest = [7u8; 32];
    sync_fs();
    let io0 = proc_io();
    let t = Instant::now();
    let mut n = 0i64;
    for _ in 0..rows / BATCH {
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .expect("tx");
        {
            let mut st = tx
                .prepare_cached("INSERT INTO events (stream_id, seq, event_id, created_ms, digest, payload) VALUES (1, ?1, ?2, 0, ?3, ?4)")
                .expect("prepare");
            for _ in 0..BATCH {
                n += 1;
                st.execute(rusqlite::params![
                    n,
                    format!("{n:036}"),
                    digest.as_slice(),
                    payload
                ])
                .expect("insert");
            }
        }
        tx.commit().expect("commit");
    }
    let rate = rows as f64 / t.elapsed().as_secs_f64();
    let _: (i64, i64, i64) = conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .expect("checkpoint");
    sync_fs();
    let io1 = proc_io();
    (rate, (io1.0 - io0.0, io1.1 - io0.1))
}

fn fill_spool(path: &std::path::Path, rows: usize) -> usize {
    let mut spool = Spool::open(path, &SpoolOptions::default()).expect("open spool");
    let mut ids = EventIdGen::new().expect("ids");
    let batch: Vec<NewEvent> = (0..BATCH).map(reading).collect();
    for _ in 0..rows / BATCH {
        spool
            .append(&batch, &mut ids, "bench", Format::Json, 0)
            .expect("append");
    }
    spool.sendable(0, 1).expect("read")[0].payload.len()
}

fn delivery_rate(db: &std::path::Path, port: u16, rows: usize) -> f64 {
    let cfg = edgespool::config::parse(
        &format!(
            "device_id='bench'\n[spool]\npath='{}'\n[mqtt]\nurl='mqtt://127.0.0.1:{port}'\ninflight_window={WINDOW}\nclient_id='bench-agent'\n",
            db.display()
        ),
        "bench",
        &[],
    )
    .expect("config");
    let spool = Spool::open(db, &cfg.spool.options).expect("open");
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let (link, mqtt) = edgespool::mqtt::new(cfg.mqtt.clone(), tx, stop.clone(), None);
    let stats = Arc::new(edgespool::delivery::DeliveryStats::default());
    let dcfg = edgespool::delivery::DeliveryConfig {
        topic_prefix: cfg.mqtt.topic_prefix.clone(),
        window: WINDOW,
        max_payload_bytes: cfg.mqtt.max_payload_bytes,
        max_packet_bytes: cfg.mqtt.max_packet_bytes,
        fail_after_disconnects: cfg.mqtt.fail_after_disconnects,
        protocol: cfg.mqtt.protocol,
        min_share_pct: cfg.mqtt.min_share_pct,
        live_streams: Default::default(),
        batching: Default::default(),
        retire_on: cfg.mqtt.retire_on,
        receipt_timeout: cfg.mqtt.receipt_timeout,
        receipt_window: cfg.mqtt.receipt_window,
        device_id: cfg.device_id.clone(),
        receipt_keys: cfg.mqtt.receipt_public_keys.clone(),
        backfill: None,
    };
    // No writer here: delivery commits its own records.
    let ledger = edgespool::delivery::ledger::Ledger::new(None);
    let t = Instant::now();
    let h1 = std::thread::spawn(move || mqtt.run());
    let h2 = {
        let (stop, shared) = (stop.clone(), (stats.clone(), ledger));
        std::thread::spawn(move || edgespool::delivery::run(spool, dcfg, link, rx, stop, shared))
    };
    while (stats.retired.load(Ordering::Relaxed) as usize) < rows {
        assert!(t.elapsed() < Duration::from_secs(300), "delivery stalled");
        std::thread::sleep(Duration::from_millis(5));
    }
    let rate = rows as f64 / t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = h2.join();
    let _ = h1.join();
    rate
}

fn bare_publisher_rate(port: u16, rows: usize, payload_len: usize) -> f64 {
    let mut o = MqttOptions::new("bench-bare", "127.0.0.1", port);
    o.set_inflight(WINDOW as u16);
    o.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = Client::new(o, WINDOW);
    let payload = vec![b'x'; payload_len];
    let t = Instant::now();
    let publisher = std::thread::spawn(move || {
        for _ in 0..rows {
            client
                .publish("bench/bare", QoS::AtLeastOnce, false, payload.clone())
                .expect("publish");
        }
        client
    });
    let mut acks = 0;
    while acks < rows {
        match conn.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acks += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("bare publisher: {e}"),
            Err(RecvTimeoutError::Timeout) => panic!("bare publisher stalled at {acks}"),
            Err(RecvTimeoutError::Disconnected) => panic!("bare publisher closed"),
        }
    }
    let rate = rows as f64 / t.elapsed().as_secs_f64();
    let _ = publisher.join();
    rate
}

/// Run the real agent with ten `file` sources at 10 ms (1,000 readings/s)
/// for 10 s; return its VmHWM (kB) and the measured reading rate.
fn agent_peak_rss(dir: &std::path::Path, port: u16) -> (u64, f64) {
    let mut cfg = format!(
        "device_id='bench'\n[spool]\npath='{}/rss.db'\ncommit_window_ms=100\n[mqtt]\nurl='mqtt://127.0.0.1:{port}'\nclient_id='bench-rss'\n",
        dir.display()
    );
    for i in 0..10 {
        cfg.push_str(&format!(
            "[[sources]]\nname='up{i}'\nkind='file'\npath='/proc/uptime'\ninterval_ms=10\n"
        ));
    }
    // /proc/uptime holds two numbers; use a file with one instead.
    let one = dir.join("one-number");
    std::fs::write(&one, "42.5\n").expect("write");
    let cfg = cfg.replace("/proc/uptime", &one.display().to_string());
    let path = dir.join("rss.toml");
    std::fs::write(&path, cfg).expect("write config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgespool"))
        .args(["run", "--config"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn agent");
    std::thread::sleep(Duration::from_secs(10));
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    let conn = rusqlite::Connection::open(dir.join("rss.db")).expect("open rss.db");
    let n: i64 = conn
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap_or(0);
    (hwm, n as f64 / 10.0)
}
