//! Faults: SIGKILL of the agent mid-publish, the broker killed and restarted
//! without persistence (field case F08).

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{count_by_state, count_in_state, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use crate::{assert_invariants, prefix, received, write_config};
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
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = prefix("sigkill");
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/events/#"));
    let cfg = write_config(dir.path(), &proxy.url(), &prefix, 20);
    let db = dir.path().join("spool.db");
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
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = prefix("f08");
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/events/#"));
    let cfg = write_config(dir.path(), &proxy.url(), &prefix, 20);
    let db = dir.path().join("spool.db");
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
