//! Delivery priority after an outage: a 200,000-row telemetry backlog, the
//! broker back, and what must not wait behind it (issue: the link under
//! pressure). A real mosquitto, the real binary, a real SIGKILL of it
//! mid-drain (a process kill: the page cache survives, not a power cut).
use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

/// Rows of `tele` in the backlog; `dash` has one for every nine of them.
const BACKLOG: usize = 200_000;
const DASH: usize = BACKLOG / 9;

/// `n` telemetry rows on stream `tele`, about 330 bytes of JSON each,
/// appended in transactions of 10,000 by the agent's own spool code (what
/// the agent would have stored while the broker was unreachable).
fn build_backlog(db: &Path, n: usize) {
    let mut spool = Spool::open(db, &SpoolOptions::default()).expect("open the spool");
    let mut ids = EventIdGen::new().expect("event ids");
    let t0 = 1_700_000_000_000i64;
    for chunk in 0..n.div_ceil(10_000) {
        let evs: Vec<NewEvent> = (chunk * 10_000..((chunk + 1) * 10_000).min(n))
            .map(|i| {
                let fields = (0..8)
                    .map(|f| {
                        (
                            format!("sensor_{f}"),
                            FieldValue::Num(i as f64 + f as f64 / 8.0),
                        )
                    })
                    .collect();
                // One row in ten is of `dash`, a live_first stream.
                let stream = if i % 10 == 9 { "dash" } else { "tele" };
                NewEvent::new(stream, t0 + i as i64 * 1000, true, fields)
            })
            .collect();
        spool
            .append(&evs, &mut ids, "prio-board", Format::Json, t0)
            .expect("append the backlog");
    }
}

fn config(dir: &Path, url: &str, prefix: &str) -> std::path::PathBuf {
    let d = dir.display();
    std::fs::write(dir.join("alarm"), "1\n").expect("write the alarm file");
    let text = format!(
        r#"device_id = "prio-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 200
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 500
connect_timeout_secs = 2
[agent]
summary_interval_secs = 2
[[sources]]
name = "alarm"
kind = "file"
path = "{d}/alarm"
interval_ms = 250
durability = "full"
[[sources]]
name = "dash"
kind = "file"
path = "{d}/alarm"
interval_ms = 250
live_first = true
[commands]
"#
    );
    let path = dir.join("board.toml");
    std::fs::write(&path, text).expect("write the config");
    path
}

/// Send a `ping` command and wait for its result on the `_commands`
/// subscriber; returns the time from the command's PUBACK at the sender
/// (the broker has it) to the result's arrival, which bounds the time from
/// the agent's receipt to the result reaching a subscriber.
fn ping_latency(broker: &Broker, prefix: &str, results: &Subscriber, id: &str) -> Duration {
    let before = results.count();
    let body = serde_json::json!({"command_id": id, "name": "ping"}).to_string();
    crate::commands::publish(
        broker.port(),
        &format!("{prefix}/commands"),
        body.as_bytes(),
        false,
    );
    let sent = Instant::now();
    // Polled every 5 ms: the figure is good to about that.
    let arrived = |d: &[crate::support::subscriber::Delivery]| {
        d[before.min(d.len())..]
            .iter()
            .any(|x| x.json()["fields"]["command_id"] == id)
    };
    let mut got = false;
    while !got && sent.elapsed() < Duration::from_secs(60) {
        got = results.wait_until(Duration::ZERO, arrived);
        if !got {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let took = sent.elapsed();
    assert!(got, "no result for command {id} within 60 s");
    took
}

/// Distinct `tele` event ids seen and the arrival index of the last one,
/// read incrementally (each delivery parsed once).
#[derive(Default)]
struct Tele {
    ids: RefCell<HashSet<String>>,
    next: Cell<usize>,
    last: Cell<usize>,
}

impl Tele {
    fn update(&self, d: &[crate::support::subscriber::Delivery]) -> usize {
        let mut ids = self.ids.borrow_mut();
        for (i, x) in d.iter().enumerate().skip(self.next.get()) {
            if x.topic.ends_with("/events/tele") {
                ids.insert(crate::event_id(x));
                self.last.set(i);
            }
        }
        self.next.set(d.len());
        ids.len()
    }

    fn seen(&self, sub: &Subscriber) -> usize {
        let n = Cell::new(0);
        sub.wait_until(Duration::ZERO, |d| {
            n.set(self.update(d));
            true
        });
        n.get()
    }
}

#[test]
fn a_command_result_and_a_full_reading_overtake_a_200000_row_backlog_across_a_kill() {
    let broker = Broker::start_with_options("max_queued_messages 0\n", false);
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("priority");
    let db = dir.path().join("spool.db");
    let t = Instant::now();
    build_backlog(&db, BACKLOG + DASH);
    println!(
        "backlog of {BACKLOG} tele and {DASH} dash rows written in {:?}",
        t.elapsed()
    );
    let sub = Subscriber::events(broker.port(), &prefix);
    let results = Subscriber::start(broker.port(), &format!("{prefix}/events/_commands"));
    let cfg = config(dir.path(), &proxy.url(), &prefix);

    // The agent starts with the broker unreachable, then the link comes back.
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(30), "spool "),
        "{}",
        agent.log_tail(30)
    );
    std::thread::sleep(Duration::from_secs(1));
    proxy.set_mode(Mode::Forward);
    let drain_start_ms = edgespool::event::envelope::wall_clock_ms().0;
    let drain_start = Instant::now();
    assert!(
        sub.wait_count(Duration::from_secs(60), 5_000),
        "the drain did not start: {}",
        agent.log_tail(30)
    );
    let first = ping_latency(&broker, &prefix, &results, "prio-1");
    let tele = Tele::default();
    let tele_at_first = tele.seen(&sub);
    println!("command result during the drain: {} ms after the command's PUBACK ({tele_at_first} of {BACKLOG} telemetry rows delivered)", first.as_millis());

    // SIGKILL mid-drain, restart, another command.
    assert!(
        sub.wait_count(Duration::from_secs(120), BACKLOG / 2),
        "{}",
        agent.log_tail(30)
    );
    agent.kill9();
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(30), "subscribed to commands"),
        "{}",
        agent.log_tail(30)
    );
    let second = ping_latency(&broker, &prefix, &results, "prio-2");
    let tele_at_second = tele.seen(&sub);
    println!("command result after the kill: {} ms ({tele_at_second} of {BACKLOG} telemetry rows delivered)", second.as_millis());

    // Every row arrives.
    let all = sub.wait_until(Duration::from_secs(300), |d| tele.update(d) >= BACKLOG);
    let drained = drain_start.elapsed();
    let (n, last_tele) = (tele.seen(&sub), tele.last.get());
    assert!(
        all,
        "{n} of {BACKLOG} telemetry rows arrived\n{}",
        agent.log_tail(40)
    );
    println!(
        "drained {BACKLOG} rows in {:.1} s ({:.0} rows/s, including the kill and restart); {} deliveries in all",
        drained.as_secs_f64(),
        BACKLOG as f64 / drained.as_secs_f64(),
        sub.count()
    );
    // The last `dash` backlog rows may still be on their way (live_first
    // sends them after fresh readings): every backlog row is acknowledged
    // in the spool before the clean stop, which leaves a row still in
    // flight SENT for the next run.
    let acked = wait_for(Duration::from_secs(60), || {
        unsettled_backlog(&db).is_some_and(|n| n == 0)
    });
    assert!(
        acked,
        "{:?} backlog rows not acknowledged or FAILED 60 s after the telemetry arrived\n{}",
        unsettled_backlog(&db),
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(20));

    // The command results did not wait for the backlog.
    assert!(
        first < Duration::from_secs(1),
        "first command result took {first:?}"
    );
    assert!(
        second < Duration::from_secs(1),
        "second command result took {second:?}"
    );
    assert!(
        tele_at_first < BACKLOG,
        "the first result came after the backlog"
    );
    assert!(
        tele_at_second < BACKLOG,
        "the second result came after the backlog"
    );

    // A `full` reading taken during the drain arrived before the backlog
    // finished.
    let deliveries = sub.deliveries();
    let early_alarm = deliveries.iter().enumerate().find(|(i, d)| {
        d.topic.ends_with("/events/alarm")
            && d.json()["ts_ms"]
                .as_i64()
                .is_some_and(|ts| ts >= drain_start_ms)
            && *i < last_tele
    });
    assert!(
        early_alarm.is_some(),
        "no alarm reading taken during the drain arrived before the last telemetry row (index {last_tele})"
    );
    let alarms_during = deliveries[..last_tele]
        .iter()
        .filter(|d| d.topic.ends_with("/events/alarm"))
        .count();
    println!("alarm readings delivered before the backlog finished: {alarms_during}");

    // live_first: a fresh `dash` reading arrived before `dash`'s own backlog
    // was through, and the backlog still arrived whole.
    let dash: Vec<(usize, String, i64)> = deliveries
        .iter()
        .enumerate()
        .filter(|(_, d)| d.topic.ends_with("/events/dash"))
        .map(|(i, d)| {
            (
                i,
                crate::event_id(d),
                d.json()["ts_ms"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    let backlog: HashSet<&str> = dash
        .iter()
        .filter(|d| d.2 < drain_start_ms - 60_000)
        .map(|d| d.1.as_str())
        .collect();
    assert_eq!(backlog.len(), DASH, "dash backlog rows delivered");
    let last_backlog = dash
        .iter()
        .filter(|d| d.2 < drain_start_ms - 60_000)
        .map(|d| d.0)
        .max();
    let first_fresh = dash
        .iter()
        .filter(|d| d.2 >= drain_start_ms)
        .map(|d| d.0)
        .min();
    println!("dash (live_first): first fresh reading at delivery {first_fresh:?}, last backlog row at {last_backlog:?}");
    assert!(
        first_fresh.zip(last_backlog).is_some_and(|(f, l)| f < l),
        "no fresh dash reading arrived before dash's backlog finished"
    );

    // No backlog row left unacknowledged (readings taken since may still be
    // in flight at the clean stop: they stay SENT for the next run), none
    // FAILED; with every backlog row at the subscriber, none was retired
    // without reaching the broker.
    assert_eq!(
        unsettled_backlog(&db),
        Some(0),
        "backlog rows not acknowledged, or rows FAILED"
    );
}

/// Backlog rows not ACKED, and rows FAILED, read from the spool (a WAL
/// reader beside the agent); `None` if the spool cannot be read.
fn unsettled_backlog(db: &Path) -> Option<i64> {
    let conn = rusqlite::Connection::open(db).ok()?;
    conn.busy_timeout(Duration::from_secs(5)).ok()?;
    conn.query_row(
        "SELECT count(*) FROM event_states WHERE (id <= ?1 AND state <> 'ACKED') OR state = 'FAILED'",
        [(BACKLOG + DASH) as i64],
        |r| r.get(0),
    )
    .ok()
}
