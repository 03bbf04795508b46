//! The whole recorded AirQualityUCI trace (data/ in the repository), replayed through
//! the real agent into a real broker: every reading the trace holds arrives.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::spool::{await_states, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[test]
fn the_whole_air_quality_trace_is_replayed_and_delivered() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let trace = root.join("data/AirQualityUCI.csv");
    assert!(trace.exists(), "{} is missing", trace.display());
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("replay");
    let sub = Subscriber::events(broker.port(), &prefix);
    let db = dir.path().join("spool.db");
    let sets = vec![
        format!("spool.path={}", db.display()),
        format!("mqtt.url={}", broker.url()),
        format!("mqtt.topic_prefix={prefix}"),
        format!("sources.0.path={}", trace.display()),
        "sources.0.speed=0".to_owned(),
        "sources.0.interval_ms=20".to_owned(),
        "spool.commit_window_ms=50".to_owned(),
    ];
    let cfg = root.join("board-configs/airquality-replay.toml");
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    let line = agent.await_line(Duration::from_secs(120), "replay finished");
    println!("{line}");
    assert!(
        line.contains("9471 rows read, 9326 readings, 16701 cells skipped, 145 rows skipped"),
        "{line}"
    );
    await_states(
        &db,
        &agent,
        Duration::from_secs(120),
        "total == 9326 && PENDING + SENT == 0",
        |s| total(&db) == 9326 && s.n("PENDING") + s.n("SENT") == 0,
    );
    agent.terminate(Duration::from_secs(15));
    let deliveries = sub.deliveries();
    crate::assert_invariants(&db, &deliveries);
    let r = crate::received(&deliveries);
    assert_eq!(r.times.len(), 9326);
    crate::assert_first_seen_in_order(&r);
    let first = deliveries[0].json();
    assert_eq!(first["fields"]["trace_ts_ms"], 1_078_941_600_000i64);
    assert_eq!(first["fields"]["co_gt"], 2.6);
}

/// A trace of `rows` rows one second apart, with a quoted header (a cell
/// holding the delimiter and a doubled quote) and quoted cells.
fn quoted_trace(path: &Path, rows: usize) {
    let mut text = String::from("\"Date\",\"Time\",\"Level, \"\"raw\"\"\",\"T\"\r\n");
    for k in 0..rows {
        let (h, m, s) = (k / 3600, (k / 60) % 60, k % 60);
        text.push_str(&format!(
            "\"2024-05-01\",{:02}:{m:02}:{s:02},\"{k}\",{}.5\r\n",
            10 + h,
            k % 40
        ));
    }
    std::fs::write(path, text).expect("write trace");
}

/// Every delivered replay reading: trace_ts_ms → the event ids it came with.
fn ids_by_row(
    deliveries: &[crate::support::subscriber::Delivery],
) -> BTreeMap<i64, BTreeSet<String>> {
    let mut by_row: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    for d in deliveries {
        let v = d.json();
        let ts = v["fields"]["trace_ts_ms"].as_i64().expect("trace_ts_ms");
        let id = v["event_id"].as_str().expect("event_id").to_owned();
        by_row.entry(ts).or_default().insert(id);
    }
    by_row
}

/// A small deterministic generator (splitmix64) for kill moments: the seed
/// is printed, and `EDGESPOOL_TEST_SEED=N` replays a failing run.
struct Rng(u64);

impl Rng {
    fn from_env_or_clock(test: &str) -> Rng {
        let seed = std::env::var("EDGESPOOL_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        println!("{test}: seed {seed} (rerun with EDGESPOOL_TEST_SEED={seed})");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` milliseconds.
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo))
    }
}

/// Replay killed at random points 5 times: every row arrives upstream,
/// each under exactly one id.
///
/// Each kill is a SIGKILL of the agent process at a random moment after its
/// start (seed printed): a process kill, not a power cut, so the page cache
/// survives and every commit the agent made is in the spool at restart.
/// A kill may land before the spool opens, while rows are appended, or
/// while they are published; after each restart the replay resumes after
/// the last row it stored. Each of the trace's rows is then received under
/// exactly one event id (a row published again after a kill keeps its id),
/// none is missing, and the spool holds each row once.
#[test]
fn a_replay_killed_at_five_random_moments_delivers_every_row_under_one_id() {
    const ROWS: usize = 600;
    let mut rng = Rng::from_env_or_clock("replay-kill");
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("replay-kill");
    let sub = Subscriber::events(broker.port(), &prefix);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let trace = dir.path().join("trace.csv");
    quoted_trace(&trace, ROWS);
    let db = dir.path().join("spool.db");
    let cfg = dir.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "it-replay"
[spool]
path = "{db}"
commit_window_ms = 50
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
[[sources]]
name = "levels"
kind = "replay"
path = "{trace}"
timestamp_columns = ["Date", "Time"]
timestamp_format = "%Y-%m-%d %H:%M:%S"
timezone = "+02:00"
speed = 100.0
interval_ms = 50
"#,
            db = db.display(),
            url = broker.url(),
            trace = trace.display()
        ),
    )
    .expect("write config");

    // At 100 trace seconds per second the 600 rows take about 6 s of
    // running time; five kills 0.1..2.5 s after each start mostly land
    // mid-trace (the counts are printed, not asserted: the resume is
    // checked either way).
    let mut resumed = 0;
    for round in 1..=5 {
        let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
        let after = rng.millis(100, 2500);
        std::thread::sleep(after);
        agent.kill9();
        let stored = if db.exists() { total(&db) } else { 0 };
        println!(
            "round {round}: SIGKILL {} ms after start, {stored} of {ROWS} rows stored",
            after.as_millis()
        );
        if agent.log_text().contains("resuming") {
            resumed += 1;
        }
    }
    println!("{resumed} of 5 runs resumed after a stored row");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    await_states(
        &db,
        &agent,
        Duration::from_secs(180),
        "replay finished && PENDING + SENT == 0",
        |s| agent.log_text().contains("replay finished") && s.n("PENDING") + s.n("SENT") == 0,
    );
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| ids_by_row(d).len() >= ROWS),
        "{} rows received",
        ids_by_row(&sub.deliveries()).len()
    );
    agent.terminate(Duration::from_secs(15));

    let deliveries = sub.deliveries();
    crate::assert_invariants(&db, &deliveries);
    let by_row = ids_by_row(&deliveries);
    let twice: Vec<_> = by_row.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "rows under two ids: {:?}",
        &twice[..twice.len().min(3)]
    );
    // None missing: the distinct rows are the trace's rows, 14:00 + k s at
    // +02:00 (2024-05-01T08:00:00Z = 1714550400 s).
    let want: BTreeSet<i64> = (0..ROWS as i64)
        .map(|k| (1_714_550_400 + k) * 1000)
        .collect();
    let got: BTreeSet<i64> = by_row.keys().copied().collect();
    assert_eq!(got, want);
    let distinct: BTreeSet<String> = deliveries.iter().map(crate::event_id).collect();
    assert_eq!(distinct.len(), ROWS, "distinct event ids received");
    println!(
        "{} deliveries, {} distinct event ids, {ROWS} rows",
        deliveries.len(),
        distinct.len()
    );
    // The spool holds each row once: nothing was appended twice.
    let rows = crate::support::spool::rows(&db);
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!((rows.len(), ids.len()), (ROWS, ROWS));
    let first = deliveries
        .iter()
        .map(|d| d.json())
        .find(|v| v["fields"]["trace_ts_ms"] == 1_714_550_400_000i64)
        .expect("first row");
    assert_eq!(first["fields"]["level_raw"], 0);
}

/// Lines `from..to` of a followed log: `ts,seq` with ts = 2024-05-01T08:00Z
/// + seq seconds, so each line's `seq` field names it.
fn log_lines(from: u64, to: u64) -> String {
    (from..to)
        .map(|k| format!("{},{k}\n", 1_714_550_400 + k))
        .collect()
}

fn append(file: &mut std::fs::File, text: &str) {
    use std::io::Write;
    file.write_all(text.as_bytes()).expect("append to the log");
}

/// Every delivered followed line: its `seq` → the event ids it came with.
fn ids_by_seq(
    deliveries: &[crate::support::subscriber::Delivery],
) -> BTreeMap<u64, BTreeSet<String>> {
    let mut by_seq: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for d in deliveries {
        let v = d.json();
        let seq = v["fields"]["seq"].as_u64().expect("seq field");
        let id = v["event_id"].as_str().expect("event_id").to_owned();
        by_seq.entry(seq).or_default().insert(id);
    }
    by_seq
}

/// A board config in `dir` following `dir/log.csv` (`ts,seq` lines, epoch
/// seconds) into `dir/spool.db`: (log, spool, config).
fn follow_config(dir: &Path, broker: &Broker, prefix: &str) -> (PathBuf, PathBuf, PathBuf) {
    let log = dir.join("log.csv");
    let db = dir.join("spool.db");
    let cfg = dir.join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "it-follow"
[spool]
path = "{db}"
commit_window_ms = 50
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
[[sources]]
name = "log"
kind = "replay"
path = "{log}"
follow = true
timestamp_columns = ["ts"]
timestamp_format = "%s"
interval_ms = 50
"#,
            db = db.display(),
            url = broker.url(),
            log = log.display()
        ),
    )
    .expect("write config");
    (log, db, cfg)
}

/// `follow = true`: a log written while the agent runs, rotated once
/// (rename + create, with lines still written to the renamed file first),
/// truncated once, a line written in two halves, and the agent SIGKILLed
/// once with lines appended while it is down (a process kill, not a power
/// cut: the page cache survives). Every line written arrives, each under
/// exactly one event id, and the spool holds each line once.
#[test]
fn a_followed_log_rotated_truncated_and_killed_delivers_every_line_once() {
    use std::fs::OpenOptions;
    const LINES: u64 = 240;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("replay-follow");
    let sub = Subscriber::events(broker.port(), &prefix);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let (log, db, cfg) = follow_config(dir.path(), &broker, &prefix);
    let stored = |n: i64| wait_for(Duration::from_secs(60), || db.exists() && total(&db) >= n);
    let open = |p: &Path| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .expect("open the log")
    };

    let mut first = open(&log);
    append(&mut first, &format!("ts,seq\n{}", log_lines(0, 50)));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(stored(1), "{}", agent.log_tail(30));
    // Growth, in bursts, one line in two halves a few polls apart.
    for k in (50..100).step_by(10) {
        append(&mut first, &log_lines(k, k + 10));
        std::thread::sleep(Duration::from_millis(30));
    }
    let half = log_lines(100, 101);
    append(&mut first, &half[..6]);
    std::thread::sleep(Duration::from_millis(300));
    append(&mut first, &half[6..]);
    // Rotation: rename; the writer still appends to the renamed file; then
    // the new file at the path.
    std::fs::rename(&log, dir.path().join("log.csv.1")).expect("rotate");
    append(&mut first, &log_lines(101, 110));
    drop(first);
    let mut second = open(&log);
    append(&mut second, &format!("ts,seq\n{}", log_lines(110, 125)));
    // Killed mid-way through the new file; lines keep coming while it is down.
    assert!(stored(112), "{}", agent.log_tail(30));
    agent.kill9();
    println!("killed with {} rows stored", total(&db));
    append(&mut second, &log_lines(125, 180));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    // Truncation (copytruncate style) once every line so far is read: what
    // a truncation cuts before it is read is gone by design.
    assert!(stored(180), "{}", agent.log_tail(30));
    second.set_len(0).expect("truncate");
    append(&mut second, &format!("ts,seq\n{}", log_lines(180, 220)));
    for k in (220..LINES).step_by(5) {
        std::thread::sleep(Duration::from_millis(20));
        append(&mut second, &log_lines(k, k + 5));
    }
    await_states(
        &db,
        &agent,
        Duration::from_secs(60),
        "total >= LINES as i64 && PENDING + SENT == 0",
        |s| total(&db) >= LINES as i64 && s.n("PENDING") + s.n("SENT") == 0,
    );
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| ids_by_seq(d).len() as u64
            >= LINES),
        "{} lines received",
        ids_by_seq(&sub.deliveries()).len()
    );
    agent.terminate(Duration::from_secs(15));
    let text = agent.log_text();
    assert!(text.contains("resuming"), "{}", agent.log_tail(30));
    assert!(
        text.contains("truncated: segment 1 ended at line 71"),
        "{}",
        agent.log_tail(30)
    );
    let first_log = std::fs::read_to_string(dir.path().join("agent-1.log")).expect("first log");
    assert!(
        first_log.contains("rotated (another file now at the path): segment 0 ended at line 111"),
        "{first_log}"
    );

    let deliveries = sub.deliveries();
    crate::assert_invariants(&db, &deliveries);
    let by_seq = ids_by_seq(&deliveries);
    let twice: Vec<_> = by_seq.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(
        twice.is_empty(),
        "lines under two ids: {:?}",
        &twice[..twice.len().min(3)]
    );
    let want: BTreeSet<u64> = (0..LINES).collect();
    let got: BTreeSet<u64> = by_seq.keys().copied().collect();
    assert_eq!(got, want);
    let distinct: BTreeSet<String> = deliveries.iter().map(crate::event_id).collect();
    assert_eq!(distinct.len() as u64, LINES, "distinct event ids received");
    let rows = crate::support::spool::rows(&db);
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!((rows.len() as u64, ids.len() as u64), (LINES, LINES));
    println!(
        "{} deliveries, {} distinct event ids, {LINES} lines written",
        deliveries.len(),
        distinct.len()
    );
}

/// A log rotated while the agent is stopped (SIGKILL: a process kill, not a
/// power cut): at restart the stored file is found under its new name by
/// its inode, read to its end from the stored row, then the new file at the
/// path from its first row. Every line arrives under exactly one id.
#[test]
fn a_log_rotated_while_the_agent_is_down_is_finished_then_the_new_file_followed() {
    use std::fs::OpenOptions;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("replay-follow-down");
    let sub = Subscriber::events(broker.port(), &prefix);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let (log, db, cfg) = follow_config(dir.path(), &broker, &prefix);
    let stored = |n: i64| wait_for(Duration::from_secs(60), || db.exists() && total(&db) >= n);
    let open = |p: &Path| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .expect("open the log")
    };
    let mut old = open(&log);
    append(&mut old, &format!("ts,seq\n{}", log_lines(0, 40)));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(stored(40), "{}", agent.log_tail(30));
    agent.kill9();
    // While it is down: more lines to the old file, rotated, a new file.
    append(&mut old, &log_lines(40, 60));
    std::fs::rename(&log, dir.path().join("log.csv.1")).expect("rotate");
    append(&mut old, &log_lines(60, 70));
    drop(old);
    let mut new = open(&log);
    append(&mut new, &format!("ts,seq\n{}", log_lines(70, 100)));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    await_states(
        &db,
        &agent,
        Duration::from_secs(60),
        "total >= 100 && PENDING + SENT == 0",
        |s| total(&db) >= 100 && s.n("PENDING") + s.n("SENT") == 0,
    );
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| ids_by_seq(d).len() >= 100),
        "{} lines received",
        ids_by_seq(&sub.deliveries()).len()
    );
    agent.terminate(Duration::from_secs(15));
    assert!(
        agent.log_text().contains(&format!(
            "was rotated while stopped: finishing segment 0 in {} after line 41",
            dir.path().join("log.csv.1").display()
        )),
        "{}",
        agent.log_tail(30)
    );
    let deliveries = sub.deliveries();
    crate::assert_invariants(&db, &deliveries);
    let by_seq = ids_by_seq(&deliveries);
    assert!(
        by_seq.values().all(|ids| ids.len() == 1),
        "a line under two ids"
    );
    assert_eq!(
        by_seq.keys().copied().collect::<Vec<u64>>(),
        (0..100).collect::<Vec<u64>>()
    );
    let rows = crate::support::spool::rows(&db);
    let ids: BTreeSet<&str> = rows.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!((rows.len(), ids.len()), (100, 100));
}
