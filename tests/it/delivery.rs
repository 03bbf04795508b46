//! Delivery end to end: real readings → spool → mosquitto → subscriber, and
//! retirement only on PUBACK.

use crate::support::agent::AgentProc;
use crate::support::board::{append_config, edit_config, Board};
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{await_states, count_by_state, count_in_state, rows, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use crate::{assert_first_seen_in_order, assert_invariants, prefix, received};
use std::time::Duration;

#[test]
fn readings_from_the_system_source_reach_a_subscriber_and_every_row_ends_acked() {
    let broker = Broker::start();
    let prefix = prefix("e2e");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 100);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        sub.wait_count(Duration::from_secs(20), 10),
        "no deliveries; agent log:\n{}",
        agent.log_tail(40)
    );
    agent.terminate_clean(Duration::from_secs(15));
    // Stopped: what is SENT stays SENT (no PUBACK seen), nothing retired by the stop.
    let after_stop = count_by_state(&db);
    // Drain the rest with a run that takes no readings.
    crate::drain(&cfg, dir.path(), &db);
    let deliveries = sub.deliveries();
    assert_invariants(&db, &deliveries);
    let all = rows(&db);
    assert!(
        all.iter().all(|r| r.state == "ACKED"),
        "{:?}",
        count_by_state(&db)
    );
    assert!(all.len() as i64 >= after_stop.values().sum::<i64>());
    // The envelope carries what the wire format promises.
    let v = deliveries[0].json();
    for key in [
        "event_id",
        "device_id",
        "stream",
        "seq",
        "ts_ms",
        "clock_trusted",
        "fields",
    ] {
        assert!(!v[key].is_null(), "envelope lacks {key}: {v}");
    }
    assert_eq!(v["device_id"], "it-board");
    assert!(
        v["fields"]["uptime_secs"].as_f64().unwrap_or(0.0) > 0.0,
        "{v}"
    );
    assert!(deliveries[0].topic.ends_with("/events/system"));
}

#[test]
fn backlog_built_while_the_broker_is_unreachable_drains_in_sequence_order() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let prefix = prefix("backlog");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 20);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(20), || db.exists() && total(&db) >= 100),
        "backlog did not grow\n{}",
        agent.log_tail(30)
    );
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "rows retired while the broker was unreachable"
    );
    assert_eq!(sub.count(), 0);
    proxy.set_mode(Mode::Forward);
    assert!(
        sub.wait_count(Duration::from_secs(30), 100),
        "backlog not delivered\n{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    crate::drain(&cfg, dir.path(), &db);
    let deliveries = sub.deliveries();
    assert_invariants(&db, &deliveries);
    assert_first_seen_in_order(&received(&deliveries));
}

#[test]
fn swallowed_pubacks_retire_nothing_and_rows_are_resent_with_the_same_bytes() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::DropPubacks);
    let prefix = prefix("noacks");
    let Board { dir, cfg, .. } = Board::new(&proxy.url(), &prefix, 200);
    let sub = Subscriber::events(broker.port(), &prefix);
    let prom = dir.path().join("edgespool.prom");
    append_config(
        &cfg,
        &format!("[metrics]\ntextfile = \"{}\"\n", prom.display()),
    );
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &["mqtt.ack_timeout_secs=2".into()], dir.path());
    // The watchdog (2 s without a PUBACK) rebuilds the client and replays:
    // wait for an event id delivered at least twice.
    let resent = wait_for(Duration::from_secs(30), || {
        received(&sub.deliveries()).times.values().any(|&n| n >= 2)
    });
    assert!(resent, "nothing was re-sent\n{}", agent.log_tail(40));
    assert!(proxy.pubacks_dropped() > 0);
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "a row was retired without its PUBACK: {:?}",
        count_by_state(&db)
    );
    assert!(
        agent.log_text().contains("watchdog: no PUBACK"),
        "{}",
        agent.log_tail(40)
    );
    // Each rebuild is counted: `status` (JSON and text) and the metrics.
    let rebuilds = || {
        crate::refusals::status_json(&db)["counters"]["mqtt_watchdog_rebuilds"]
            .as_i64()
            .unwrap_or(0)
    };
    assert!(
        wait_for(Duration::from_secs(20), || rebuilds() >= 1),
        "no watchdog rebuild counted\n{}",
        agent.log_tail(40)
    );
    let human =
        crate::support::agent::run_cli(&["status", "--spool", db.to_str().expect("utf-8")]).1;
    assert!(
        human
            .lines()
            .any(|l| l.trim().starts_with("mqtt_watchdog_rebuilds") && !l.trim().ends_with(" 0")),
        "{human}"
    );
    let metric = || {
        std::fs::read_to_string(&prom)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("edgespool_mqtt_watchdog_rebuilds_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        wait_for(Duration::from_secs(20), || metric() >= 1.0),
        "the metrics textfile shows no watchdog rebuild\n{}",
        std::fs::read_to_string(&prom).unwrap_or_default()
    );
    // Let the acknowledgements through: everything retires.
    proxy.set_mode(Mode::Forward);
    agent.terminate(Duration::from_secs(15));
    // Never more counted than the rebuilds the log names.
    let named = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("watchdog: no PUBACK"))
        .count() as i64;
    assert!(
        (1..=named).contains(&rebuilds()),
        "{} counted, {named} logged",
        rebuilds()
    );
    crate::drain(&cfg, dir.path(), &db);
    assert_invariants(&db, &sub.deliveries());
}

#[test]
fn oversized_payload_is_marked_failed_and_never_published() {
    let broker = Broker::start();
    let prefix = prefix("oversize");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 200);
    let sub = Subscriber::events(broker.port(), &prefix);
    // 1024 bytes is the smallest limit the config allows: a small exec
    // source stays under it, one printing a 2 KB JSON object does not.
    let big = format!("{{\"blob\":\"{}\"}}", "x".repeat(2000));
    edit_config(&cfg, |t| {
        t.replace(
            "name = \"system\"\nkind = \"system\"",
            "name = \"small\"\nkind = \"exec\"\nprogram = \"/bin/echo\"\nargs = [\"42\"]",
        ) + &format!(
            "[[sources]]\nname = \"big\"\nkind = \"exec\"\nprogram = \"/bin/echo\"\nargs = [{big:?}]\ninterval_ms = 200\n"
        )
    });
    let mut agent = AgentProc::spawn(&cfg, &["mqtt.max_payload_bytes=1024".into()], dir.path());
    await_states(&db, &agent, Duration::from_secs(20), "FAILED >= 2", |s| {
        s.n("FAILED") >= 2
    });
    // Small readings keep flowing past the failed ones.
    assert!(sub.wait_count(Duration::from_secs(10), 3));
    agent.terminate(Duration::from_secs(15));
    assert!(sub.deliveries().iter().all(|d| !d.topic.ends_with("/big")));
    assert!(sub.deliveries().iter().any(|d| d.topic.ends_with("/small")));
    assert!(agent.log_text().contains("exceeds mqtt.max_payload_bytes"));
}
