//! Health that tells the truth: refusals and outages show as `degraded` with
//! their reason, logged at WARN, and data that can flow keeps flowing.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::Board;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{count_in_state, rows_in_state};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::Path;
use std::time::Duration;

fn status(db: &Path) -> String {
    run_cli(&["status", "--spool", db.to_str().expect("utf-8")]).1
}

/// A broker that answers the command subscription by closing the connection
/// (aedes does on an ACL deny) must not stop telemetry: after three such
/// closes in a row the agent connects without the subscription (trying it
/// again within seconds, `broker_word.rs`), delivers, and says `commands
/// unavailable`.
#[test]
fn telemetry_flows_when_the_broker_closes_connections_on_the_command_subscription() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::CloseOnSubscribe);
    let prefix = crate::prefix("subkill");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 200);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || sub.count() >= 10),
        "telemetry did not flow: {} delivered\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(20), || {
            let log = agent.log_text();
            log.contains("ERROR") && log.contains("connecting without it")
        }),
        "{}",
        agent.log_tail(30)
    );
    assert!(proxy.closed_on_packet() >= 3);
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = status(&db);
            s.contains("health: degraded") && s.contains("commands unavailable")
        }),
        "{}",
        status(&db)
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: commands unavailable"));
    agent.terminate(Duration::from_secs(15));
}

/// An event the broker answers by closing the connection (larger than its
/// packet limit) is set aside after `fail_after_disconnects` quick drops,
/// never FAILED for it: the rows behind it are delivered and health names
/// it. The board's own limit (`mqtt.max_packet_bytes`) FAILs it; lifted,
/// `requeue-failed` sends it again, same event id and bytes.
#[test]
fn an_event_the_broker_refuses_by_disconnecting_is_set_aside_and_the_rest_flow() {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_max_publish(2000);
    let prefix = crate::prefix("oversized");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    {
        let mut s = Spool::open(&db, &SpoolOptions::default()).expect("spool");
        let mut ids = EventIdGen::new().expect("ids");
        let ev = |text: String| NewEvent {
            replay: None,
            stream: "big".into(),
            ts_ms: 1,
            clock_trusted: true,
            fields: vec![("t".into(), FieldValue::Text(text))],
            key: None,
            reply: None,
        };
        let mut evs: Vec<NewEvent> = (0..5).map(|i| ev(format!("small {i}"))).collect();
        evs.push(ev("x".repeat(3000)));
        evs.extend((5..10).map(|i| ev(format!("small {i}"))));
        s.append(&evs, &mut ids, "it-board", Format::Json, 1)
            .expect("append");
    }
    // The test sends requeue-failed unsigned.
    let sets = ["sources=[]".into(), "commands.allow_unsigned=true".into()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 10),
        "only {} of the 10 small events arrived\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(20), || status(&db)
            .contains("set aside after the connection dropped")),
        "{}\n{}",
        status(&db),
        agent.log_tail(30)
    );
    assert!(proxy.closed_on_packet() >= 3);
    assert_eq!(
        count_in_state(&db, "FAILED"),
        0,
        "the broker's word FAILED it"
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: "));
    agent.terminate(Duration::from_secs(15));
    // The board's own limit says it can never go: FAILED at once, named.
    let mut sets_limited = sets.to_vec();
    sets_limited.push("mqtt.max_packet_bytes=2000".into());
    let mut agent = AgentProc::spawn(&cfg, &sets_limited, dir.path());
    assert!(
        wait_for(Duration::from_secs(20), || count_in_state(&db, "FAILED")
            == 1),
        "{:?}\n{}",
        crate::support::spool::count_by_state(&db),
        agent.log_tail(40)
    );
    let failed = rows_in_state(&db, "FAILED");
    assert!(failed[0].payload.len() > 2000, "the wrong row failed");
    assert!(
        wait_for(Duration::from_secs(20), || status(&db)
            .contains("rows FAILED in the spool")),
        "{}",
        status(&db)
    );
    let text = status(&db);
    assert!(
        text.contains("failed rows") && text.contains("exceeds mqtt.max_packet_bytes 2000"),
        "{text}"
    );
    agent.terminate(Duration::from_secs(15));
    assert!(
        sub.deliveries().iter().all(|d| d.payload.len() < 2000),
        "the oversized event was delivered"
    );
    // Both limits lifted, requeue-failed sends it again: appended as a new
    // row with the same event id and bytes, after every other row.
    proxy.set_max_publish(0);
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    crate::commands::publish(
        broker.port(),
        &format!("{prefix}/commands"),
        br#"{"command_id":"rq-1","name":"requeue-failed"}"#,
        false,
    );
    assert!(
        wait_for(Duration::from_secs(30), || sub
            .deliveries()
            .iter()
            .any(|d| d.payload == failed[0].payload)),
        "the requeued event did not arrive\n{}",
        agent.log_tail(30)
    );
    assert_eq!(count_in_state(&db, "FAILED"), 0);
    agent.terminate(Duration::from_secs(15));
}

/// The broker unreachable: `degraded: not connected ...` within the bound
/// (twice the keep-alive, at least 30 s), logged at WARN with the cause; `ok`
/// again once the broker is back.
#[test]
fn an_unreachable_broker_degrades_health_within_the_bound_and_recovers() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let prefix = crate::prefix("unreachable");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 500);
    let mut agent = AgentProc::spawn(&cfg, &["mqtt.keep_alive_secs=5".into()], dir.path());
    let t = std::time::Instant::now();
    assert!(
        wait_for(Duration::from_secs(60), || status(&db)
            .contains("health: degraded: not connected to")),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    let after = t.elapsed();
    println!(
        "unreachable broker: degraded after {} ms (bound 30 s + a maintenance pass)",
        after.as_millis()
    );
    assert!(
        after >= Duration::from_secs(25),
        "degraded before the bound: {after:?}"
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: not connected"));
    // For machines: health as an object, counts as objects.
    let json = run_cli(&["status", "--json", "--spool", db.to_str().expect("utf-8")]).1;
    let v: serde_json::Value = serde_json::from_str(&json).expect("status --json");
    assert_eq!(v["health"]["state"], "degraded", "{json}");
    assert!(v["health"]["reasons"][0]
        .as_str()
        .is_some_and(|r| r.starts_with("not connected")));
    assert!(v["health"]["since_ms"].as_i64().is_some(), "{json}");
    assert!(
        v["totals"]["PENDING"].as_i64().is_some_and(|n| n > 0),
        "{json}"
    );
    assert!(
        v["counters"].is_object() && v["agent_state"].is_object(),
        "{json}"
    );
    proxy.set_mode(Mode::Forward);
    assert!(
        wait_for(Duration::from_secs(30), || status(&db)
            .contains("health: ok")),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}

/// Under systemd (`JOURNAL_STREAM` set) each line starts with its syslog
/// priority and has no second timestamp; the journal stamps it.
#[test]
fn log_lines_fit_the_journal_when_journal_stream_is_set() {
    let broker = Broker::start();
    let prefix = crate::prefix("journal");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 500);
    let mut agent =
        AgentProc::spawn_with_env(&cfg, &[], dir.path(), &[("JOURNAL_STREAM", "8:4242")]);
    assert!(agent.wait_log(Duration::from_secs(20), "mqtt: connected"));
    agent.terminate(Duration::from_secs(15));
    let log = agent.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for l in &lines {
        assert!(
            ["<3>", "<4>", "<6>", "<7>"]
                .iter()
                .any(|p| l.starts_with(p)),
            "no priority prefix: {l}"
        );
        assert!(
            !l.contains("Z INFO") && !l.contains("Z DEBUG"),
            "a timestamp: {l}"
        );
    }
    // The target is the part, `edgespool::mqtt`, or a module inside it.
    let connected = |l: &&str| {
        l.strip_prefix("<6>edgespool::mqtt").is_some_and(|r| {
            let (module, text) = r.split_once(": ").unwrap_or((r, ""));
            (module.is_empty() || module.starts_with("::")) && text.starts_with("mqtt: connected")
        })
    };
    assert!(lines.iter().any(connected), "{log}");
}

/// The retained `<prefix>/status` says `online` (with version, config sha256
/// and backlog) once connected, and `offline` after a clean stop and after
/// `kill -9` (the broker publishes the will).
#[test]
fn the_retained_status_topic_says_online_then_offline_after_a_stop_or_a_kill() {
    let broker = Broker::start();
    let prefix = crate::prefix("status");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 500);
    let topic = format!("{prefix}/status");
    let last_state = |sub: &Subscriber| -> Option<serde_json::Value> {
        sub.deliveries()
            .iter()
            .rev()
            .find(|d| d.topic == topic)
            .and_then(|d| serde_json::from_slice(&d.payload).ok())
    };
    for how in ["stop", "kill"] {
        let sub = Subscriber::start(broker.port(), &topic);
        assert!(sub.wait_subscribed(Duration::from_secs(10)));
        let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
        assert!(
            wait_for(Duration::from_secs(20), || last_state(&sub)
                .is_some_and(|v| v["state"] == "online")),
            "{how}: no online status\n{}",
            agent.log_tail(20)
        );
        let online = last_state(&sub).expect("online");
        assert_eq!(online["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(
            online["config_sha256"].as_str().map(str::len),
            Some(64),
            "{online}"
        );
        assert!(online["backlog"].is_u64(), "{online}");
        if how == "stop" {
            agent.terminate(Duration::from_secs(15));
        } else {
            agent.kill9();
        }
        assert!(
            wait_for(Duration::from_secs(20), || last_state(&sub)
                .is_some_and(|v| v["state"] == "offline")),
            "{how}: no offline status"
        );
    }
}
