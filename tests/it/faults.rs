//! Faults: SIGKILL of the agent mid-publish, the broker killed and restarted
//! without persistence (field case F08).

use crate::support::agent::AgentProc;
use crate::support::board::Board;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{count_by_state, count_in_state, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use crate::{assert_invariants, prefix, received};
use std::time::Duration;

fn random_ms(lo: u64, hi: u64) -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("getrandom");
    lo + u64::from_le_bytes(b) % (hi - lo)
}

#[test]
fn sigkill_while_publishing_loses_nothing_and_never_changes_a_payload() {
    // A local broker acknowledges within a millisecond, so a kill at a random
    // instant rarely finds a row in flight. Odd rounds therefore withhold
    // PUBACKs (proxy) for a random while before the kill, so rows are SENT
    // and unacknowledged when the process dies; even rounds kill mid-stream.
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    let prefix = prefix("sigkill");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 20);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut kills = Vec::new();
    for round in 0..6 {
        proxy.set_mode(Mode::Forward);
        let mut agent = AgentProc::spawn(&cfg, &["mqtt.ack_timeout_secs=60".into()], dir.path());
        let before = if db.exists() { total(&db) } else { 0 };
        assert!(
            wait_for(Duration::from_secs(20), || db.exists()
                && total(&db) > before),
            "agent appended nothing\n{}",
            agent.log_tail(30)
        );
        if round % 2 == 1 {
            proxy.set_mode(Mode::DropPubacks);
        }
        let at = random_ms(100, 1500);
        std::thread::sleep(Duration::from_millis(at));
        agent.kill9();
        kills.push((round, at, count_by_state(&db)));
    }
    proxy.set_mode(Mode::Forward);
    // Some kills left rows unacknowledged, or the test proved nothing about replay.
    let left_unacked = kills
        .iter()
        .filter(|(_, _, c)| {
            c.get("SENT").copied().unwrap_or(0) + c.get("PENDING").copied().unwrap_or(0) > 0
        })
        .count();
    assert!(left_unacked >= 2, "{kills:?}");
    crate::drain(&cfg, dir.path(), &db);
    let deliveries = sub.deliveries();
    assert_invariants(&db, &deliveries);
    // Rows in flight at a kill were delivered again by a later run.
    assert!(received(&deliveries).times.values().any(|&n| n >= 2));
    // Killed runs are recorded as such.
    let (_, status, _) =
        crate::support::agent::run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
    assert!(
        status.contains("killed (no clean stop recorded)"),
        "{status}"
    );
}

/// The broker dies with publishes in flight and comes back with no session
/// (persistence off): rumqttc would drop its pending publishes silently; the
/// spool must replay them. PUBACKs are withheld by the proxy first, so every
/// row the broker ever saw is still unacknowledged in the spool and the
/// subscriber's view is the whole truth.
fn broker_restart_without_persistence_loses_nothing(clean_session: bool) {
    let mut broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    let prefix = prefix("f08");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 20);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut agent = AgentProc::spawn(
        &cfg,
        &[
            format!("mqtt.clean_session={clean_session}"),
            "mqtt.ack_timeout_secs=60".into(),
        ],
        dir.path(),
    );
    assert!(
        sub.wait_count(Duration::from_secs(20), 20),
        "{}",
        agent.log_tail(30)
    );
    proxy.set_mode(Mode::DropPubacks);
    assert!(wait_for(Duration::from_secs(10), || proxy
        .pubacks_dropped()
        >= 5));
    // Attempts are group-committed (every 20 ms or so): wait for the marks.
    assert!(
        wait_for(Duration::from_secs(10), || count_in_state(&db, "SENT") > 0),
        "{:?}",
        count_by_state(&db)
    );
    broker.kill();
    proxy.set_mode(Mode::Refuse);
    broker.restart();
    assert!(
        sub.wait_subscribed(Duration::from_secs(15)),
        "subscriber did not re-subscribe"
    );
    proxy.set_mode(Mode::Forward);
    assert!(
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .matches("mqtt: connected")
            .count()
            >= 2),
        "{}",
        agent.log_tail(30)
    );
    assert!(agent.log_text().contains("session_present=false"));
    assert!(
        agent.log_text().contains("unacknowledged rows for replay"),
        "{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    crate::drain(&cfg, dir.path(), &db);
    let deliveries = sub.deliveries();
    assert_invariants(&db, &deliveries);
    // Rows in flight at the crash were delivered again after it.
    assert!(received(&deliveries).times.values().any(|&n| n >= 2));
}

#[test]
fn broker_killed_and_restarted_without_persistence_loses_nothing_with_a_persistent_session() {
    // field case F08
    broker_restart_without_persistence_loses_nothing(false);
}

#[test]
fn broker_killed_and_restarted_without_persistence_loses_nothing_with_a_clean_session() {
    // field case F08
    broker_restart_without_persistence_loses_nothing(true);
}

/// With a commit window of W, a SIGKILL re-sends at most what the README
/// states ("Crash behaviour"): the rows in flight (`mqtt.inflight_window`)
/// plus the acknowledgements of the last record interval (rows acknowledged
/// within one window, whose record had not committed yet), each with the
/// same event id and bytes; a row whose acknowledgement was committed is
/// never sent again. This is a process kill, not a power cut: the page
/// cache survives, so every committed transaction does (a power cut may
/// also roll back the newest commits of `synchronous = NORMAL`).
///
/// The readings are `full`, so each commits at once and is published at
/// once, while its acknowledgement waits for the window like any other:
/// the first record commit comes about W after the first PUBACK, and the
/// kill lands well inside the next window, with acknowledgements received
/// and not yet recorded.
#[test]
fn a_sigkill_resends_at_most_the_inflight_window_and_one_windows_acks_and_never_a_recorded_one() {
    const WINDOW_MS: i64 = 8_000;
    const INFLIGHT: i64 = 16;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = prefix("ackwindow");
    let sub = Subscriber::events(broker.port(), &prefix);
    let value = dir.path().join("value");
    std::fs::write(&value, "21.5\n").expect("write the value file");
    let cfg = dir.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "it-board"
[spool]
path = "{spool}"
commit_window_ms = {WINDOW_MS}
tune_from_probe = false
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
connect_timeout_secs = 2
inflight_window = {INFLIGHT}
[[sources]]
name = "temp"
kind = "file"
path = "{value}"
field = "temp_c"
interval_ms = 100
durability = "full"
"#,
            spool = dir.path().join("spool.db").display(),
            url = broker.url(),
            value = value.display(),
        ),
    )
    .expect("write the config");
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    // A record commit has happened: some acknowledgements are on file.
    assert!(
        wait_for(Duration::from_secs(60), || db.exists()
            && count_in_state(&db, "ACKED") > 0),
        "no acknowledgement was recorded\n{}",
        agent.log_tail(30)
    );
    // Then rows acknowledged after it (not yet recorded): the subscriber
    // has ten more than the spool records as acknowledged.
    // A record commit between the count and the kill (the agent's own
    // state, a start-up commit) would leave nothing unrecorded: count again
    // until none came between (the next one is a window away).
    let mut recorded = count_in_state(&db, "ACKED") as usize;
    for _ in 0..10 {
        assert!(
            sub.wait_count(Duration::from_secs(30), recorded + 10),
            "{}",
            agent.log_tail(30)
        );
        let now = count_in_state(&db, "ACKED") as usize;
        if now == recorded {
            break;
        }
        recorded = now;
    }
    agent.kill9();
    let killed_ms = crate::support::spool::open(&db)
        .query_row("SELECT max(created_ms) FROM events", [], |r| {
            r.get::<_, i64>(0)
        })
        .expect("newest row");
    // What was on file at the kill: the recorded acknowledgements, and the
    // rows appended within one window before it.
    let acked: std::collections::HashSet<String> =
        crate::support::spool::rows_in_state(&db, "ACKED")
            .into_iter()
            .map(|r| r.event_id)
            .collect();
    let last_window: i64 = crate::support::spool::open(&db)
        .query_row(
            "SELECT count(*) FROM events WHERE created_ms > ?1",
            [killed_ms - WINDOW_MS],
            |r| r.get(0),
        )
        .expect("count the last window's rows");
    assert!(!acked.is_empty());
    crate::drain(&cfg, dir.path(), &db);
    let deliveries = sub.deliveries();
    assert_invariants(&db, &deliveries);
    let r = received(&deliveries);
    let resent: Vec<&String> = r
        .times
        .iter()
        .filter(|(_, &n)| n >= 2)
        .map(|(id, _)| id)
        .collect();
    let again: Vec<&&String> = resent.iter().filter(|id| acked.contains(**id)).collect();
    assert!(
        again.is_empty(),
        "rows whose acknowledgement was committed were sent again: {again:?}"
    );
    // Acknowledged and not recorded at the kill: these were sent again.
    assert!(
        !resent.is_empty(),
        "nothing was re-sent: the kill found no acknowledgement waiting for its record"
    );
    assert!(
        resent.len() as i64 <= INFLIGHT + last_window,
        "{} rows re-sent; the bound is the in-flight window ({INFLIGHT}) plus the {last_window} rows of the last window",
        resent.len()
    );
}
