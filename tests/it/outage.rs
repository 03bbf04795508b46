//! The outage budget of the real agent: readings sent over the ingest
//! socket at a known rate show up in `status --json` and `/metrics` as that
//! rate, with the hold time that rate gives against a known
//! `spool.max_bytes`; and a delivery rate measured through a link capped by
//! the fault proxy is kept, with its time, once the link goes down, the
//! backlog's drain time following from it.

use crate::metrics::sample;
use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::{add_ingest, edit_config};
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::{free_port, wait_for};
use crate::{prefix, write_config};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The moving averages' window the tests run with (seconds).
const WINDOW_SECS: u64 = 6;

/// A board config with no sources, the ingest socket with stream `pump`,
/// and the metrics listener on `metrics`.
fn config(dir: &Path, url: &str, name: &str, metrics: SocketAddr) -> PathBuf {
    let path = write_config(dir, url, &prefix(name), 1000);
    edit_config(&path, |t| {
        t.replacen(
            "[agent]\n",
            &format!("[agent]\nrate_window_secs = {WINDOW_SECS}\n"),
            1,
        )
    });
    add_ingest(
        &path,
        &format!("[[ingest.streams]]\nname = \"pump\"\n[metrics]\nlisten = \"{metrics}\"\n"),
    );
    path
}

fn metrics_addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().expect("addr")
}

/// A socket client that sends `line` and reads its reply (an `ok`).
struct Client {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Client {
    fn connect(sock: &Path) -> Client {
        let s = UnixStream::connect(sock).expect("connect to the ingest socket");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        Client {
            w: s.try_clone().expect("clone"),
            r: BufReader::new(s),
        }
    }

    /// Send `n` readings pipelined, then read their `n` replies.
    fn send_many(&mut self, n: usize, i0: usize) {
        let mut text = String::new();
        for i in 0..n {
            text.push_str(&reading(i0 + i));
            text.push('\n');
        }
        self.w.write_all(text.as_bytes()).expect("send");
        for _ in 0..n {
            self.ok();
        }
    }

    fn ok(&mut self) {
        let mut line = String::new();
        self.r.read_line(&mut line).expect("reply");
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(v["ok"], true, "{v}");
    }
}

/// The `i`th reading: the same fields every time, so every row has one size.
fn reading(i: usize) -> String {
    format!(
        r#"{{"stream":"pump","fields":{{"pressure_bar":2.5,"n":{}}}}}"#,
        100_000 + i
    )
}

/// `status --json` of the spool in `dir`; `None` while the agent has not
/// created it yet (its socket listens a moment before).
fn status_json(dir: &Path) -> Option<Value> {
    let db = dir.join("spool.db");
    let (st, out, _) = run_cli(&["status", "--json", "--spool", db.to_str().expect("utf-8")]);
    if !st.success() {
        return None;
    }
    Some(serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json: {e}: {out}")))
}

/// The stored budget once one was stored after `after_ms` (Unix ms), and
/// the time it was stored.
fn budget_after(dir: &Path, after_ms: i64, agent: &AgentProc) -> (Value, i64) {
    let mut got = None;
    let found = wait_for(Duration::from_secs(30), || {
        let Some(v) = status_json(dir) else {
            return false;
        };
        let rec = &v["outage_budget"];
        match rec["updated_ms"].as_i64() {
            Some(at) if at > after_ms => {
                got = Some((rec["value"].clone(), at));
                true
            }
            _ => false,
        }
    });
    assert!(
        found,
        "no outage_budget stored after {after_ms}\n{}",
        agent.log_tail(30)
    );
    got.expect("found")
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// GET /metrics, the body.
fn metrics(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    let _ = std::io::Read::read_to_string(&mut s, &mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// `got` within `tol` (a fraction) of `want`.
fn near(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * want.abs()
}

/// 25 readings/s over the socket for longer than the window: `status
/// --json` and `/metrics` give pump's rate as the readings the test saw
/// committed (their replies) in the agent's window (within 10 %, or a
/// fifth of a second of readings at each end), its bytes as that rate
/// times the stored size of one row, and the hold time as the room before
/// `spool.max_bytes` over that rate; the human view shows it as one
/// readable line.
#[test]
fn status_and_metrics_give_the_ingest_rate_and_hold_time_of_a_known_reading_rate() {
    const RATE: f64 = 25.0;
    const MAX_BYTES: u64 = 8 * 1024 * 1024;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = metrics_addr();
    let cfg = config(dir.path(), &broker.url(), "outage-rate", addr);
    let sock = dir.path().join("run/ingest.sock");
    let agent = AgentProc::spawn(
        &cfg,
        &["sources=[]".into(), format!("spool.max_bytes={MAX_BYTES}")],
        dir.path(),
    );
    assert!(
        wait_for(Duration::from_secs(20), || UnixStream::connect(&sock)
            .is_ok()),
        "{}",
        agent.log_tail(30)
    );
    let stop = Arc::new(AtomicBool::new(false));
    // The pace is the input under test: reading i is written when it is
    // due (i / RATE s), not after the reply to the one before (each reply
    // waits for its commit window). A reader notes when each reply came:
    // a reply follows its reading's commit, so the replies received in the
    // agent's window are the readings it should have counted there (a
    // stalled commit on a loaded machine moves both alike).
    let replies: Arc<Mutex<Vec<i64>>> = Arc::default();
    let Client { mut r, mut w } = Client::connect(&sock);
    let reader = {
        let replies = Arc::clone(&replies);
        std::thread::spawn(move || {
            let mut line = String::new();
            while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                assert!(line.contains("\"ok\":true"), "{line}");
                replies.lock().expect("replies").push(now_ms());
                line.clear();
            }
        })
    };
    let sender = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let due = start + Duration::from_secs_f64(i as f64 / RATE);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                w.write_all(format!("{}\n", reading(i)).as_bytes())
                    .expect("send");
                i += 1;
            }
            let _ = w.shutdown(std::net::Shutdown::Write);
            i
        })
    };
    // A record whose whole window lies inside the sending (plus a second).
    let from = now_ms() + (WINDOW_SECS as i64 + 2) * 1000;
    let (b, at) = budget_after(dir.path(), from, &agent);
    let body = metrics(addr);
    stop.store(true, Ordering::Relaxed);
    let sent = sender.join().expect("sender");
    reader.join().expect("reader");
    let replies = replies.lock().expect("replies").clone();
    assert_eq!(replies.len(), sent, "every reading stored");
    assert!(sent as f64 > RATE * WINDOW_SECS as f64, "sent {sent}");
    // What the test saw in a window of `span` s ending at `end_ms`, as a
    // rate, and the tolerance: 10 %, or a fifth of a second of readings at
    // each end (commit windows, the reader's own latency).
    let span = b["ingest"]["span_secs"].as_f64().expect("span");
    let seen = |end_ms: i64| {
        let start_ms = end_ms - (span * 1000.0) as i64;
        let n = replies
            .iter()
            .filter(|&&t| t > start_ms && t <= end_ms)
            .count();
        let tol = (0.1f64).max(2.0 * 0.2 * RATE / n.max(1) as f64);
        (n as f64 / span, tol)
    };
    let (rate, tol) = seen(at);

    let pump = &b["ingest"]["streams"]["pump"];
    let readings = pump["readings_per_sec"].as_f64().expect("pump readings/s");
    eprintln!("ingest: agent {readings:.2} readings/s, the test saw {rate:.2}/s, sent {RATE}/s");
    assert!(
        near(readings, rate, tol),
        "pump at {readings}/s, the test saw {rate}/s (tolerance {tol}): {b}"
    );
    assert!(span >= WINDOW_SECS as f64, "{b}");
    assert_eq!(b["window_secs"].as_f64(), Some(WINDOW_SECS as f64));
    // Every pump row stores about the same bytes: the byte rate is that
    // times the rate.
    let conn = crate::support::spool::open(&dir.path().join("spool.db"));
    let row_bytes: f64 = conn
        .query_row(
            "SELECT avg(length(payload) + length(event_id) + length(digest)) FROM events e
             JOIN streams s ON s.id = e.stream_id WHERE s.name = 'pump'",
            [],
            |r| r.get(0),
        )
        .expect("row bytes");
    let bytes = pump["bytes_per_sec"].as_f64().expect("bytes/s");
    // (within 1 %: the envelope's seq and timestamps differ in digits).
    assert!(
        near(bytes, readings * row_bytes, 0.01),
        "{bytes} B/s, rows of {row_bytes} B: {b}"
    );
    // Hold: the room before max_bytes (acknowledged rows count as room)
    // over the rate the test saw times what a row costs.
    let sp = &b["spool"];
    let f = |k: &str| sp[k].as_f64().unwrap_or_else(|| panic!("spool.{k}: {b}"));
    assert_eq!(f("max_bytes") as u64, MAX_BYTES);
    let per_row = b["spool_bytes_per_row"].as_f64().expect("bytes per row");
    assert!(near(per_row, f("used_bytes") / f("rows"), 1e-9), "{b}");
    let room = f("max_bytes") - f("used_bytes") + (f("rows") - f("backlog_rows")) * per_row;
    let want = room / (rate * per_row);
    assert_eq!(b["hold"]["bound"], "max_bytes", "{b}");
    let hold = b["hold"]["secs"].as_f64().expect("hold secs");
    assert!(
        near(hold, want, tol + 0.05),
        "hold {hold} s, want {want} s: {b}"
    );
    // The metrics (of the same summary or the next) say the same of their own window.
    let m_at = sample(&body, "edgespool_metrics_timestamp_seconds ").expect("timestamp");
    let (m_want, m_tol) = seen((m_at * 1000.0) as i64);
    let m_rate = sample(
        &body,
        "edgespool_ingest_readings_per_second{stream=\"pump\"}",
    )
    .unwrap_or_else(|| panic!("{body}"));
    assert!(
        near(m_rate, m_want, m_tol),
        "metrics pump rate {m_rate}, the test saw {m_want}"
    );
    let m_hold = sample(&body, "edgespool_outage_hold_seconds{bound=\"max_bytes\"}")
        .unwrap_or_else(|| panic!("{body}"));
    assert!(
        near(m_hold, room / (m_want * per_row), m_tol + 0.1),
        "metrics hold {m_hold}, want about {want}"
    );
    assert_eq!(
        sample(&body, "edgespool_rate_window_seconds "),
        Some(WINDOW_SECS as f64)
    );
    // The human view: one readable line, not JSON.
    let db = dir.path().join("spool.db");
    let (_, text, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
    let line = text
        .lines()
        .find(|l| l.starts_with("outage budget ("))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(" readings/s (") && line.contains("the spool holds "),
        "{line}"
    );
    assert!(line.contains("before spool.max_bytes (8.0 MiB)"), "{line}");
    assert!(!line.contains('{'), "{line}");
    assert!(text.contains("\n  pump "), "{text}");
    drop(agent);
}

/// Through a link capped at 48 kB/s, 2,000 rows spooled while offline
/// drain at a rate the test measures itself from the acknowledged rows;
/// once the link is refused the agent keeps that delivery rate (within
/// 30%), says it is not current and when it was measured, and gives the
/// backlog's drain time as backlog / that rate.
#[test]
fn status_keeps_the_last_delivery_rate_offline_and_drains_the_backlog_at_it() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    proxy.set_rate(48_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = metrics_addr();
    let url = format!("mqtt://127.0.0.1:{}", proxy.port());
    let cfg = config(dir.path(), &url, "outage-drain", addr);
    let sock = dir.path().join("run/ingest.sock");
    let db = dir.path().join("spool.db");
    let agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    assert!(
        wait_for(Duration::from_secs(20), || UnixStream::connect(&sock)
            .is_ok()),
        "{}",
        agent.log_tail(30)
    );
    let mut c = Client::connect(&sock);
    for k in 0..20 {
        c.send_many(100, k * 100);
    }
    // Offline, nothing delivered yet: a backlog and no delivery rate.
    let (b0, _) = budget_after(dir.path(), now_ms(), &agent);
    assert!(b0["delivery"].is_null(), "{b0}");
    assert!(b0["drain_secs"].is_null(), "never divides by zero: {b0}");
    let (_, text, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
    assert!(text.contains("drain time not measured yet"), "{text}");

    proxy.set_mode(Mode::Forward);
    let acked = || crate::support::spool::count_in_state(&db, "ACKED") as f64;
    let mut t1 = (Instant::now(), 0.0);
    assert!(
        wait_for(Duration::from_secs(60), || {
            t1 = (Instant::now(), acked());
            t1.1 >= 300.0
        }),
        "{}",
        agent.log_tail(30)
    );
    let mut t2 = t1;
    assert!(
        wait_for(Duration::from_secs(60), || {
            t2 = (Instant::now(), acked());
            t2.1 >= 1300.0
        }),
        "{}",
        agent.log_tail(30)
    );
    let measured = (t2.1 - t1.1) / (t2.0 - t1.0).as_secs_f64();
    let disconnects = || agent.log_text().matches("mqtt: disconnected").count();
    let before = disconnects();
    proxy.set_mode(Mode::Refuse);
    let offline_ms = now_ms();
    assert!(
        wait_for(Duration::from_secs(20), || disconnects() > before),
        "{}",
        agent.log_tail(30)
    );
    let (b, _) = budget_after(dir.path(), now_ms() + 1000, &agent);
    let d = &b["delivery"];
    let rate = d["rows_per_sec"].as_f64().unwrap_or_else(|| panic!("{b}"));
    eprintln!("delivery: agent {rate:.1} rows/s, the test counted {measured:.1} rows/s");
    assert!(
        near(rate, measured, 0.3),
        "agent {rate} rows/s, test {measured}: {b}"
    );
    assert_eq!(b["delivery_current"], false, "{b}");
    let at = d["measured_at_ms"].as_i64().expect("measured_at_ms");
    assert!(
        at <= offline_ms + 1500,
        "measured at {at}, offline at {offline_ms}"
    );
    let backlog = b["spool"]["backlog_rows"].as_f64().expect("backlog");
    assert!(backlog > 0.0, "rows were left when the link went down: {b}");
    let drain = b["drain_secs"].as_f64().expect("drain");
    assert!(
        near(drain, backlog / rate, 1e-9),
        "{drain} vs {backlog}/{rate}"
    );
    let (_, text, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
    let line = text
        .lines()
        .find(|l| l.starts_with("outage budget ("))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(" rows drains in "), "{line}");
    assert!(line.contains("(last measured "), "{line}");
    let body = metrics(addr);
    let m =
        sample(&body, "edgespool_delivery_rows_per_second ").unwrap_or_else(|| panic!("{body}"));
    assert!(near(m, rate, 1e-6) || near(m, measured, 0.3), "{m}");
    assert!(
        sample(&body, "edgespool_backlog_drain_seconds ").is_some(),
        "{body}"
    );
    drop(agent);
}
