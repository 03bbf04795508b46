//! MQTT 5 against a real mosquitto (2.0.11 here), the default
//! `mqtt.protocol`: what it lets the agent see that 3.1.1 hides.
//!
//! - A publish the broker's ACL denies is answered with PUBACK reason code
//!   0x87 (not authorized): the row waits and is sent again with backoff
//!   (10 s, doubling), counted, never retired as delivered and never FAILED
//!   for what the broker says (under 3.1.1 the same broker sends a plain
//!   PUBACK; `refusals.rs` pins that).
//! - The broker's Maximum Packet Size comes in CONNACK: a larger row is not
//!   sent on that connection (no setting, no dropped connection), judged
//!   again on the next, never FAILED for it.
//! - Every event PUBLISH carries its event id as the user property
//!   `event_id`.
//! - A broker that does not speak MQTT 5 gets a refusal naming
//!   `mqtt.protocol` (aedes 1.2, in `aedes.rs`).

use crate::refusals::{
    allow, assert_acked_rows_were_received, assert_no_retirement_without_puback, broker_with_acl,
    log_lines, seed, small_big_small, status_json, wait_degraded_with,
};
use crate::support::agent::AgentProc;
use crate::support::board::Board;
use crate::support::broker::Broker;
use crate::support::proxy::Proxy;
use crate::support::spool::{await_states, count_in_state};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::time::{Duration, Instant};

/// The ACL denies the events topic: each row's PUBACK carries 0x87. The
/// rows wait (health says so, naming the reason) and are sent again on
/// the same connection after 10 s, then twice as long each time: a
/// refusal is an answer, not a reason to reconnect. Whatever the number of
/// connections, none goes FAILED (issue 33: the broker's word never FAILs
/// the backlog), nothing is ACKED, and the status message (allowed) still
/// gets through.
#[test]
fn a_publish_denied_by_acl_is_refused_by_its_puback_and_sent_again_never_failed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("v5deny");
    let broker = broker_with_acl(
        dir.path(),
        serde_json::json!([
            allow("publishClientSend", &format!("{prefix}/status")),
            allow("subscribePattern", &format!("{prefix}/#")),
        ]),
    );
    let proxy = Proxy::start(broker.port());
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/#"));
    let cfg = crate::write_config(dir.path(), &proxy.url(), &prefix, 1000);
    let db = dir.path().join("spool.db");
    seed(&db, &(0..5).map(|i| format!("row {i}")).collect::<Vec<_>>());
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    wait_degraded_with(
        &db,
        &agent,
        &[
            "5 rows held back by the broker",
            "refused in their PUBACK (the broker refused the publish: not authorized (PUBACK reason code 0x87))",
        ],
        Duration::from_secs(60),
    );
    let denied = || broker.log_text().matches("Denied PUBLISH").count();
    // Sent again on this same connection once the wait is over.
    assert!(
        wait_for(Duration::from_secs(30), || denied() >= 10),
        "{} denials\n{}",
        denied(),
        agent.log_tail(30)
    );
    assert_eq!(log_lines(&agent, "INFO", "mqtt: connected to").len(), 1);
    assert!(!log_lines(
        &agent,
        "WARN",
        "refused by the broker (the broker refused the publish: not authorized"
    )
    .is_empty());
    // More connections change nothing: nothing FAILED, nothing ACKED.
    for n in 2..=4 {
        proxy.reset_all();
        assert!(
            wait_for(Duration::from_secs(30), || log_lines(
                &agent,
                "INFO",
                "mqtt: connected to"
            )
            .len()
                >= n),
            "{}",
            agent.log_tail(30)
        );
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(count_in_state(&db, "FAILED"), 0);
    assert_eq!(count_in_state(&db, "ACKED"), 0);
    assert!(
        wait_for(Duration::from_secs(10), || status_json(&db)["counters"]
            ["events_deferred_puback_not_authorized"]
            .as_i64()
            >= Some(10)),
        "{}",
        status_json(&db)["counters"]
    );
    // The allowed retained status arrived; no event did.
    assert!(wait_for(Duration::from_secs(10), || sub
        .deliveries()
        .iter()
        .any(|d| d.topic.ends_with("/status"))));
    agent.terminate(Duration::from_secs(15));
    assert!(sub
        .deliveries()
        .iter()
        .all(|d| !d.topic.contains("/events/")));
}

/// mosquitto's `max_packet_size` reaches the agent as CONNACK's Maximum
/// Packet Size: the one larger row is not sent, with no
/// `mqtt.max_packet_bytes` and no dropped connection, and the rest are
/// ACKED. It is that connection's word: the row waits for the next one,
/// judged again there, and never goes FAILED for it (issue 33).
#[test]
fn the_brokers_maximum_packet_size_from_connack_holds_a_larger_row_back_before_sending() {
    let broker = Broker::start_with_config("max_packet_size 2000\n");
    let proxy = Proxy::start(broker.port());
    let prefix = crate::prefix("v5pkt");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    seed(&db, &small_big_small());
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    await_states(&db, &agent, Duration::from_secs(60), "ACKED == 10", |s| {
        s.n("ACKED") == 10
    });
    wait_degraded_with(
        &db,
        &agent,
        &[
            "1 rows held back by the broker",
            "over its maximum packet size on this connection",
            "exceeds the broker's maximum packet size (CONNACK) 2000",
        ],
        Duration::from_secs(30),
    );
    for n in 2..=3 {
        proxy.reset_all();
        assert!(
            wait_for(Duration::from_secs(30), || log_lines(
                &agent,
                "INFO",
                "maximum packet size 2000 bytes"
            )
            .len()
                >= n),
            "connection {n} did not come\n{}",
            agent.log_tail(30)
        );
    }
    assert!(
        wait_for(Duration::from_secs(10), || status_json(&db)["counters"]
            ["events_deferred_packet_too_large"]
            .as_i64()
            >= Some(3)),
        "{}",
        status_json(&db)["counters"]
    );
    assert_eq!(count_in_state(&db, "FAILED"), 0, "a CONNACK FAILED the row");
    assert!(!log_lines(&agent, "WARN", "waits for the next connection").is_empty());
    assert!(!broker.log_text().contains("oversize packet"));
    assert_eq!(log_lines(&agent, "INFO", "mqtt: connected to").len(), 3);
    agent.terminate(Duration::from_secs(15));
    assert_eq!(crate::received(&sub.deliveries()).times.len(), 10);
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// Every event PUBLISH carries `event_id` as a user property, equal to the
/// envelope's `event_id`, read by an MQTT 5 subscriber.
#[test]
fn every_event_carries_its_event_id_as_a_user_property() {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("v5prop");
    let mut o = MqttOptions::new("edgespool-test-v5-sub", "127.0.0.1", broker.port());
    o.set_keep_alive(Duration::from_secs(5));
    let (client, mut conn) = Client::new(o, 16);
    client
        .subscribe(format!("{prefix}/events/#"), QoS::AtLeastOnce)
        .expect("subscribe");
    let mut got: Vec<(serde_json::Value, Vec<(String, String)>)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut agent = None;
    while got.len() < 5 && Instant::now() < deadline {
        match conn.recv_timeout(Duration::from_millis(500)) {
            Ok(Ok(Event::Incoming(Packet::SubAck(_)))) if agent.is_none() => {
                let cfg = crate::write_config(dir.path(), &broker.url(), &prefix, 200);
                agent = Some(AgentProc::spawn(&cfg, &[], dir.path()));
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                let body = serde_json::from_slice(&p.payload).expect("JSON payload");
                let props = p.properties.map(|p| p.user_properties).unwrap_or_default();
                got.push((body, props));
            }
            _ => {}
        }
    }
    let mut agent = agent.expect("the subscriber never got its SUBACK");
    agent.terminate(Duration::from_secs(15));
    assert!(
        got.len() >= 5,
        "{} events\n{}",
        got.len(),
        agent.log_tail(20)
    );
    for (body, props) in &got {
        let id = body["event_id"].as_str().expect("event_id in the envelope");
        assert_eq!(
            props,
            &vec![("event_id".to_owned(), id.to_owned())],
            "{body}"
        );
    }
}

/// mosquitto's `max_keepalive` reaches an MQTT 5 client as CONNACK's Server
/// Keep Alive: the agent's 60 s becomes the broker's 10 s, the `connected`
/// line says so, and the connection survives an idle gap of twice that
/// (the pings go at the broker's interval).
#[test]
fn the_brokers_server_keep_alive_replaces_ours_and_the_connection_holds() {
    let broker = Broker::start_with_config("max_keepalive 10\n");
    let prefix = crate::prefix("v5ka");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000);
    seed(&db, &(0..5).map(|i| format!("r{i}")).collect::<Vec<_>>());
    let mut agent = AgentProc::spawn(
        &cfg,
        &["sources=[]".into(), "mqtt.keep_alive_secs=60".into()],
        dir.path(),
    );
    await_states(&db, &agent, Duration::from_secs(60), "ACKED == 5", |s| {
        s.n("ACKED") == 5
    });
    let connected = log_lines(&agent, "INFO", "mqtt: connected to");
    assert!(
        connected.len() == 1 && connected[0].contains("keep_alive=10 s"),
        "{connected:?}"
    );
    // Idle past 1.5 x 10 s: an absence, so a minimum wait, not a guess.
    std::thread::sleep(Duration::from_secs(20));
    assert_eq!(
        log_lines(&agent, "INFO", "mqtt: connected to").len(),
        1,
        "{}",
        agent.log_tail(20)
    );
    assert_eq!(status_json(&db)["health"]["state"], "ok");
    agent.terminate(Duration::from_secs(15));
}

/// A command subscription the ACL denies: under MQTT 5 the SUBACK carries
/// 0x87 (not authorized), which health and the ERROR line name; telemetry
/// keeps flowing.
#[test]
fn a_denied_command_subscription_is_named_by_its_mqtt_5_reason_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("v5subdeny");
    let broker = broker_with_acl(
        dir.path(),
        serde_json::json!([
            allow("publishClientSend", &format!("{prefix}/#")),
            allow("subscribePattern", &format!("{prefix}/events/#")),
        ]),
    );
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = crate::write_config(dir.path(), &broker.url(), &prefix, 200);
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let topic = format!("{prefix}/commands");
    wait_degraded_with(
        &db,
        &agent,
        &["commands unavailable", &topic, "SUBACK 0x87 not authorized"],
        Duration::from_secs(60),
    );
    assert!(!log_lines(&agent, "ERROR", "(SUBACK 0x87 not authorized)").is_empty());
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 10
            && count_in_state(&db, "ACKED") >= 10),
        "telemetry stopped: {}\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// A broker that accepted the agent's MQTT 5 CONNECT once, then restarts
/// under the running agent. The proxy stands for what often lies between a
/// board and its broker (a port forward, a container's published port, a
/// load balancer): while mosquitto is down it takes each TCP connection and
/// closes it before any CONNACK, which is also what a broker shutting down
/// or starting does to a CONNECT it gets in that moment. That is not a
/// broker without MQTT 5: the agent says "restarting or unreachable" at
/// WARN, never the `mqtt.protocol = "3.1.1"` advice, and delivery resumes
/// once mosquitto is back (issue 26, 2).
#[test]
fn a_restarting_mqtt_5_broker_gets_no_advice_to_switch_to_3_1_1_and_delivery_resumes() {
    let mut broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    let prefix = crate::prefix("v5restart");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 200);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    await_states(&db, &agent, Duration::from_secs(60), "ACKED >= 5", |s| {
        s.n("ACKED") >= 5
    });
    broker.kill();
    let away = "it has accepted MQTT 5 before, so it is restarting or unreachable";
    assert!(
        wait_for(Duration::from_secs(30), || !log_lines(&agent, "WARN", away)
            .is_empty()),
        "no connection closed before its CONNACK was named\n{}",
        agent.log_tail(30)
    );
    broker.restart();
    let acked = count_in_state(&db, "ACKED");
    await_states(
        &db,
        &agent,
        Duration::from_secs(60),
        "delivery did not resume",
        |s| s.n("ACKED") >= acked + 5,
    );
    assert!(log_lines(&agent, "INFO", "mqtt: connected to").len() >= 2);
    assert_eq!(status_json(&db)["health"]["state"], "ok");
    agent.terminate(Duration::from_secs(15));
    let log = agent.log_text();
    assert!(
        !log.contains("mqtt.protocol"),
        "the 3.1.1 advice was given to a restarting broker\n{log}"
    );
}
