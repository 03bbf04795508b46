//! Batched publishes: one PUBLISH carries many rows, and only its PUBACK
//! retires them. A real mosquitto, the real binary, a proxy that withholds
//! PUBACKs, and a real SIGKILL mid-drain (a process kill, not a power cut).
use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::sink::{sqlite_received, SinkProc, BROKER_EXTRA};
use crate::support::subscriber::{Delivery, Subscriber};
use crate::support::{tail, wait_for};
use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::Path;
use std::time::Duration;

const BACKLOG: usize = 20_000;

fn build_backlog(db: &Path, n: usize) -> HashSet<String> {
    let mut spool = Spool::open(db, &SpoolOptions::default()).expect("open the spool");
    let mut ids = EventIdGen::new().expect("event ids");
    let evs: Vec<NewEvent> = (0..n)
        .map(|i| {
            let fields = (0..8)
                .map(|f| {
                    (
                        format!("sensor_{f}"),
                        FieldValue::Num(20.0 + (i % 97) as f64 / 8.0 + f as f64),
                    )
                })
                .collect();
            NewEvent::new("tele", 1_700_000_000_000 + i as i64 * 1000, true, fields)
        })
        .collect();
    spool
        .append(
            &evs,
            &mut ids,
            "batch-board",
            Format::Json,
            1_700_000_000_000,
        )
        .expect("append the backlog");
    let conn = rusqlite::Connection::open(db).expect("open");
    let mut st = conn
        .prepare("SELECT event_id FROM event_states")
        .expect("prepare");
    let ids = st
        .query_map([], |r| r.get::<_, String>(0))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect();
    ids
}

fn config(dir: &Path, url: &str, prefix: &str, compression: &str) -> std::path::PathBuf {
    let d = dir.display();
    std::fs::write(dir.join("tele"), "21.5\n").expect("write the sensor file");
    let text = format!(
        r#"device_id = "batch-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 200
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 500
connect_timeout_secs = 2
ack_timeout_secs = 4
[[sources]]
name = "tele"
kind = "file"
path = "{d}/tele"
interval_ms = 200
batch_max_events = 50
batch_max_ms = 500
compression = "{compression}"
"#
    );
    let path = dir.join("board.toml");
    std::fs::write(&path, text).expect("write the config");
    path
}

/// The event ids in one delivery: a single event, or every event of a
/// batch (plain, lz4 or zstd, per docs/fleet.md's format). Panics on a
/// payload that does not follow it.
fn unpack(d: &Delivery) -> Vec<String> {
    if d.topic.contains("/events/") {
        return vec![crate::event_id(d)];
    }
    if !d.topic.contains("/batches/") {
        return Vec::new(); // the retained status
    }
    let plain = if d.topic.ends_with("/lz4") {
        let mut out = Vec::new();
        lz4_flex::frame::FrameDecoder::new(&d.payload[..])
            .read_to_end(&mut out)
            .expect("an lz4 frame");
        out
    } else if d.topic.ends_with("/zstd") {
        zstd_frame(&d.payload)
    } else {
        d.payload.clone()
    };
    let v: serde_json::Value = serde_json::from_slice(&plain).expect("a JSON batch");
    v["batch"]
        .as_array()
        .expect("a batch array")
        .iter()
        .map(|e| e["event_id"].as_str().expect("event_id").to_owned())
        .collect()
}

#[cfg(feature = "zstd")]
fn zstd_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    ruzstd::decoding::StreamingDecoder::new(payload)
        .expect("a zstd frame")
        .read_to_end(&mut out)
        .expect("a zstd frame");
    out
}

#[cfg(not(feature = "zstd"))]
fn zstd_frame(_: &[u8]) -> Vec<u8> {
    panic!("a zstd batch from a build without zstd")
}

/// Event ids and batch sizes seen so far, read incrementally.
#[derive(Default)]
struct Seen {
    ids: RefCell<HashSet<String>>,
    batches: RefCell<Vec<usize>>,
    next: std::cell::Cell<usize>,
}

impl Seen {
    fn update(&self, d: &[Delivery]) -> usize {
        let mut ids = self.ids.borrow_mut();
        for x in &d[self.next.get()..] {
            let got = unpack(x);
            if x.topic.contains("/batches/") {
                self.batches.borrow_mut().push(got.len());
            }
            ids.extend(got);
        }
        self.next.set(d.len());
        ids.len()
    }

    fn has_all(&self, want: &HashSet<String>) -> bool {
        want.is_subset(&self.ids.borrow())
    }
}

fn acked_through(db: &Path) -> i64 {
    let conn = rusqlite::Connection::open(db).expect("open");
    conn.query_row("SELECT acked_through FROM delivery_mark", [], |r| r.get(0))
        .expect("read the acknowledged mark")
}

fn drain_batched(compression: &str) {
    let broker = Broker::start_with_options("max_queued_messages 0\n", false);
    let proxy = Proxy::start(broker.port());
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix(&format!("batches-{compression}"));
    let db = dir.path().join("spool.db");
    let want = build_backlog(&db, BACKLOG);
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/#"));
    let cfg = config(dir.path(), &proxy.url(), &prefix, compression);

    // PUBACKs withheld: batches reach the broker, no row is retired.
    proxy.set_mode(Mode::DropPubacks);
    let mark0 = acked_through(&db);
    let agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || proxy.pubacks_dropped() >= 3),
        "no PUBACK withheld: {}",
        agent.log_tail(30)
    );
    let forwarded = proxy.publishes_forwarded();
    assert_eq!(
        acked_through(&db),
        mark0,
        "rows retired without their PUBACK"
    );
    println!("{compression}: {forwarded} publishes forwarded with their PUBACKs withheld; the acknowledged mark stayed at {mark0}");

    // PUBACKs flow; a SIGKILL once a quarter has arrived, then a restart.
    proxy.set_mode(Mode::Forward);
    let seen = Seen::default();
    assert!(
        sub.wait_until(Duration::from_secs(120), |d| seen.update(d) >= BACKLOG / 4),
        "{}",
        agent.log_tail(30)
    );
    let mut agent = agent;
    agent.kill9();
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let all = sub.wait_until(Duration::from_secs(180), |d| {
        seen.update(d);
        seen.has_all(&want)
    });
    let n = seen.ids.borrow().len();
    assert!(
        all,
        "{n} distinct events seen, not every one of the {BACKLOG}\n{}",
        agent.log_tail(40)
    );
    agent.terminate(Duration::from_secs(20));
    // Every backlog row is acknowledged (readings taken since may still
    // wait for their batch: a clean stop leaves them for the next run).
    let conn = rusqlite::Connection::open(&db).expect("open");
    let unacked: i64 = conn
        .query_row(
            "SELECT count(*) FROM event_states WHERE id <= ?1 AND state <> 'ACKED'",
            [BACKLOG as i64],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(unacked, 0, "backlog rows not acknowledged");
    let batches = seen.batches.borrow();
    let events_in_batches: usize = batches.iter().sum();
    assert!(batches.contains(&50), "no full batch of 50: {batches:?}");
    assert!(
        batches.iter().all(|&b| (2..=50).contains(&b)),
        "{batches:?}"
    );
    println!(
        "{compression}: {} batches carried {events_in_batches} events ({} distinct, backlog {BACKLOG}); {} deliveries in all",
        batches.len(),
        n,
        sub.count()
    );
}

#[test]
fn a_batched_backlog_drains_across_a_kill_and_only_pubacks_retire_its_rows() {
    drain_batched("none");
}

#[test]
fn an_lz4_batched_backlog_drains_across_a_kill() {
    drain_batched("lz4");
}

#[cfg(feature = "zstd")]
#[test]
fn a_zstd_batched_backlog_drains_across_a_kill() {
    drain_batched("zstd");
}

/// `tele` rows (batched, lz4) and `pump` rows (single events), appended in
/// alternating chunks; returns event id -> the payload the spool stored.
fn build_mixed_backlog(db: &Path, tele: usize, pump: usize) -> HashMap<String, Vec<u8>> {
    let mut spool = Spool::open(db, &SpoolOptions::default()).expect("open the spool");
    let mut ids = EventIdGen::new().expect("event ids");
    let t0 = 1_800_000_000_000i64;
    let (mut t, mut p) = (0, 0);
    while t < tele || p < pump {
        let mut evs = Vec::new();
        for (stream, done, total, step) in
            [("tele", &mut t, tele, 1000), ("pump", &mut p, pump, 300)]
        {
            let end = (*done + step).min(total);
            evs.extend((*done..end).map(|i| {
                let fields = (0..8)
                    .map(|f| {
                        (
                            format!("{stream}_{f}"),
                            FieldValue::Num(i as f64 + f as f64 / 8.0),
                        )
                    })
                    .collect();
                NewEvent::new(stream, t0 + i as i64 * 1000, true, fields)
            }));
            *done = end;
        }
        spool
            .append(&evs, &mut ids, "batch-board", Format::Json, t0)
            .expect("append the backlog");
    }
    let conn = rusqlite::Connection::open(db).expect("open");
    let mut st = conn
        .prepare("SELECT event_id, payload FROM event_states")
        .expect("prepare");
    let rows = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect();
    rows
}

fn sink_count(db: &Path) -> i64 {
    rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| c.query_row("SELECT count(*) FROM received", [], |r| r.get(0)))
        .unwrap_or(0)
}

/// The first four numbers of the sink's last `sink: first N duplicates N
/// mismatches N unreadable N ...` line (more counters may follow).
fn sink_totals(log: &str) -> [u64; 4] {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("sink: first "))
        .unwrap_or_else(|| panic!("no totals line in the sink log:\n{}", tail(log, 20)));
    let rest = &line[line.find("sink: first ").expect("found above")..];
    let nums: Vec<u64> = rest
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    nums.get(..4)
        .and_then(|n| n.try_into().ok())
        .unwrap_or_else(|| panic!("unexpected totals line {line:?}: {nums:?}"))
}

/// The agent drains a backlog of lz4 batches (`tele`) beside single events
/// (`pump`) into the real `edgespool sink` (SQLite store, `<prefix>/events/#`,
/// which subscribes the batches too), with a SIGKILL of the agent mid-drain
/// (a process kill: the page cache survives; not a power cut). The sink
/// holds every event once, with the spool's bytes, and counts re-sends as
/// duplicates.
#[test]
fn the_sink_stores_an_lz4_batched_and_a_single_stream_once_across_an_agent_kill() {
    const TELE: usize = 10_000;
    const PUMP: usize = 3_000;
    let broker = Broker::start_with_config(BROKER_EXTRA);
    let dir = tempfile::tempdir().expect("tempdir");
    // Ends with the device id: the sink takes the device from the topic.
    let prefix = format!("{}/batch-board", crate::prefix("batches-sink"));
    let spool_db = dir.path().join("spool.db");
    let want = build_mixed_backlog(&spool_db, TELE, PUMP);
    assert_eq!(want.len(), TELE + PUMP);

    let sink_db = dir.path().join("sink.db");
    let filter = format!("{prefix}/events/#");
    let mut sink =
        SinkProc::spawn_sqlite(broker.port(), &filter, &sink_db, "mixed-sink", dir.path());
    sink.wait_subscribed();

    let d = dir.path().display();
    let cfg = dir.path().join("board.toml");
    let text = format!(
        r#"device_id = "batch-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 200
[mqtt]
url = "mqtt://127.0.0.1:{}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 500
connect_timeout_secs = 2
[ingest]
socket = "{d}/ingest.sock"
[[ingest.streams]]
name = "tele"
batch_max_events = 50
batch_max_ms = 500
compression = "lz4"
[[ingest.streams]]
name = "pump"
"#,
        broker.port()
    );
    std::fs::write(&cfg, text).expect("write the config");

    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    // The kill once a third of the rows are acknowledged in the spool (the
    // agent's side: the sink lags behind the broker).
    let third = (TELE + PUMP) as i64 / 3;
    assert!(
        wait_for(Duration::from_secs(120), || acked_through(&spool_db)
            >= third),
        "the agent acknowledged through row {}\n{}\n{}",
        acked_through(&spool_db),
        agent.log_tail(30),
        tail(&sink.log_text(), 20)
    );
    agent.kill9();
    // Let the broker hand the sink what it got before the kill (the sink
    // count still for a second), then: events the sink holds whose rows
    // the kill left unacknowledged in the spool must each be sent again by
    // the restarted agent, so the sink must count at least that many
    // duplicates.
    let mut last = -1;
    wait_for(Duration::from_secs(20), || {
        std::thread::sleep(Duration::from_secs(1));
        let now = sink_count(&sink_db);
        std::mem::replace(&mut last, now) == now
    });
    let unacked: HashSet<String> = {
        let c = rusqlite::Connection::open(&spool_db).expect("open the spool");
        let mut st = c
            .prepare("SELECT event_id FROM event_states WHERE state <> 'ACKED'")
            .expect("prepare");
        let ids = st
            .query_map([], |r| r.get(0))
            .expect("query")
            .map(|r| r.expect("row"))
            .collect();
        ids
    };
    assert!(
        !unacked.is_empty(),
        "the kill came after the drain: nothing left unacknowledged"
    );
    let at_kill = sqlite_received(&sink_db);
    let resent = at_kill.keys().filter(|id| unacked.contains(*id)).count();
    println!(
        "SIGKILL with {} events at the sink and {} rows unacknowledged in the spool; {resent} of them already at the sink (each must come again)",
        at_kill.len(),
        unacked.len()
    );

    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let all = wait_for(Duration::from_secs(240), || {
        sink_count(&sink_db) as usize >= want.len()
            && crate::support::spool::count_by_state(&spool_db)
                .keys()
                .all(|s| s == "ACKED")
    });
    assert!(
        all,
        "the sink stored {} of {} events; spool {:?}\n{}",
        sink_count(&sink_db),
        want.len(),
        crate::support::spool::count_by_state(&spool_db),
        agent.log_tail(40)
    );
    agent.terminate(Duration::from_secs(20));
    // Every PUBACK the agent got left the sink's broker queue; wait for the
    // sink to commit what is still in flight to it, then stop it.
    std::thread::sleep(Duration::from_secs(2));
    sink.terminate();

    let got = sqlite_received(&sink_db);
    assert_eq!(
        got.len(),
        want.len(),
        "events stored (one row per event id)"
    );
    for (id, payload) in &want {
        let (stored, _) = got
            .get(id)
            .unwrap_or_else(|| panic!("event {id} not at the sink"));
        assert_eq!(
            stored, payload,
            "event {id}: the sink's bytes differ from the spool's"
        );
    }
    let deliveries: i64 = got.values().map(|v| v.1).sum();
    let [first, duplicates, mismatches, unreadable] = sink_totals(&sink.log_text());
    println!(
        "sink: {first} first deliveries, {duplicates} duplicates, {mismatches} mismatches, {unreadable} unreadable; {deliveries} deliveries stored for {} events",
        got.len()
    );
    assert_eq!(first as usize, want.len());
    // The topics of the first deliveries: `pump` alone, `tele` in lz4 batches.
    let topics: HashMap<String, i64> = {
        let c = rusqlite::Connection::open(&sink_db).expect("open the sink store");
        let mut st = c
            .prepare("SELECT topic, count(*) FROM received GROUP BY topic")
            .expect("prepare");
        let rows = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("query")
            .map(|r| r.expect("row"))
            .collect();
        rows
    };
    println!("first deliveries by topic: {topics:?}");
    let on = |t: &str| topics.get(&format!("{prefix}/{t}")).copied().unwrap_or(0);
    assert_eq!(on("events/pump"), PUMP as i64, "{topics:?}");
    assert!(on("batches/tele/lz4") >= TELE as i64 / 2, "{topics:?}");
    assert_eq!(
        on("batches/tele/lz4") + on("events/tele"),
        TELE as i64,
        "{topics:?}"
    );
    assert_eq!((mismatches, unreadable), (0, 0));
    assert_eq!(
        duplicates as i64,
        deliveries - got.len() as i64,
        "the sink's duplicate count matches its per-event delivery counts"
    );
    assert!(
        duplicates as usize >= resent,
        "{resent} events re-sent after the kill, {duplicates} duplicates counted"
    );
}

/// A broker whose packet limit is below a full batch, under MQTT 3.1.1
/// (no Maximum Packet Size in CONNACK) and with `mqtt.max_packet_bytes`
/// left at its default: mosquitto drops the connection on each oversized
/// batch. Rows one at a time never found a culprit (each fits alone), so
/// every return to batching cost another dropped connection: 33 for 2,020
/// rows, 49 for 3,000 (measured by hand before the batch bound). Now each
/// drop with a batch in flight halves the batch bound: a handful of drops,
/// then batches that fit, and every row delivered.
#[test]
fn batches_over_a_3_1_1_brokers_packet_limit_shrink_instead_of_dropping_the_connection_each_time() {
    const ROWS: usize = 2_000;
    let broker = Broker::start_with_options("max_queued_messages 0\nmax_packet_size 2000\n", false);
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("batches-cap");
    let db = dir.path().join("spool.db");
    let want = build_backlog(&db, ROWS);
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/#"));
    let cfg = config(dir.path(), &broker.url(), &prefix, "none");
    let sets = ["mqtt.protocol=3.1.1".to_owned()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    let seen = Seen::default();
    let all = sub.wait_until(Duration::from_secs(180), |d| {
        seen.update(d);
        seen.has_all(&want)
    });
    assert!(all, "not every row delivered\n{}", agent.log_tail(40));
    agent.terminate(Duration::from_secs(20));
    let drops = broker.log_text().matches("oversize packet").count();
    let batches = seen.batches.borrow();
    println!(
        "packet limit 2000: {drops} connections dropped for oversized packets; {} batches (largest {:?} events) for {ROWS} rows",
        batches.len(),
        batches.iter().max()
    );
    assert!(
        (1..=8).contains(&drops),
        "{drops} dropped connections\n{}",
        agent.log_tail(40)
    );
    assert!(!batches.is_empty(), "batching gave up altogether");
}
