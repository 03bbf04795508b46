//! Real-broker refusals under MQTT 3.1.1 (`mqtt.protocol = "3.1.1"`, pinned
//! in every test; `mqtt5.rs` has what MQTT 5 changes): each test starts its own mosquitto
//! (2.0.11 here) with a generated config that refuses something, and checks
//! what the agent reports (health reason, log level), that the rows it can
//! still send keep flowing, and that nothing is retired without a PUBACK
//! (the spool's ACKED rows never outnumber the PUBACKs the broker logged
//! sending to the agent).
//!
//! What mosquitto 2.0.11 does with a 3.1.1 client (measured, and pinned by
//! these tests):
//! - ACL by the dynamic-security plugin: a denied SUBSCRIBE gets SUBACK 0x80;
//!   a denied PUBLISH gets a plain PUBACK (logged `Denied PUBLISH`). Its
//!   `acl_file` never refuses a SUBSCRIBE at all (it grants it and filters
//!   delivery), so these tests use the plugin.
//! - `max_keepalive` applies to MQTT 5 clients only: a 3.1.1 client with a
//!   longer keep-alive is accepted, and held to its own.
//! - `max_packet_size`: a larger packet closes the connection (no answer).
//!   It compares Remaining Length + 1 with the limit, leaving out the 1 to 4
//!   Remaining Length bytes; `mqtt.max_packet_bytes` counts the whole packet,
//!   so set to the same number it is at most 4 bytes stricter.
//! - a wrong password: CONNACK return code 5, not authorized.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::Board;
use crate::support::broker::{password_file, Broker};
use crate::support::spool::{await_states, count_by_state, count_in_state, rows_in_state};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The agent's client id under `crate::write_config` (`edgespool-<device_id>`).
const CLIENT_ID: &str = "edgespool-it-board";

/// `status --json`, parsed.
pub(crate) fn status_json(db: &Path) -> serde_json::Value {
    let out = run_cli(&["status", "--json", "--spool", db.to_str().expect("utf-8")]).1;
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("status --json ({e}): {out}"))
}

/// Health reasons from `status --json` when degraded, else empty (also
/// before the agent has created the spool).
pub(crate) fn health_reasons(db: &Path) -> Vec<String> {
    if !db.exists() || crate::support::spool::total(db) == 0 {
        return Vec::new();
    }
    let v = status_json(db);
    if v["health"]["state"] != "degraded" {
        return Vec::new();
    }
    v["health"]["reasons"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Wait until health is degraded with a reason containing every one of
/// `parts`; panics with the status and the agent's log tail otherwise.
pub(crate) fn wait_degraded_with(
    db: &Path,
    agent: &AgentProc,
    parts: &[&str],
    within: Duration,
) -> String {
    let mut found = None;
    let ok = wait_for(within, || {
        found = health_reasons(db)
            .into_iter()
            .find(|r| parts.iter().all(|p| r.contains(p)));
        found.is_some()
    });
    assert!(
        ok,
        "no health reason with {parts:?}: {}\n{}",
        status_json(db)["health"],
        agent.log_tail(30)
    );
    found.unwrap_or_default()
}

/// PUBACKs mosquitto logged sending to the agent (data rows and the status
/// message): an upper bound on what the agent may have retired.
pub(crate) fn pubacks_sent(broker: &Broker) -> i64 {
    broker
        .log_text()
        .lines()
        .filter(|l| l.contains(&format!("Sending PUBACK to {CLIENT_ID} ")))
        .count() as i64
}

/// I2 against the broker's own log: no row is ACKED without a PUBACK.
pub(crate) fn assert_no_retirement_without_puback(db: &Path, broker: &Broker) {
    let acked = count_in_state(db, "ACKED");
    let pubacks = pubacks_sent(broker);
    assert!(
        acked <= pubacks,
        "{acked} rows ACKED but the broker sent {pubacks} PUBACKs"
    );
}

/// The agent's log lines at `level` (`ERROR`, `WARN`, ...) containing `text`.
pub(crate) fn log_lines(agent: &AgentProc, level: &str, text: &str) -> Vec<String> {
    agent
        .log_text()
        .lines()
        .filter(|l| l.contains(&format!(" {level} ")) && l.contains(text))
        .map(str::to_owned)
        .collect()
}

/// Append one event per entry of `texts` to stream `s` before the agent
/// starts (payload size follows the text's length).
pub(crate) fn seed(db: &Path, texts: &[String]) {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let mut s = Spool::open(db, &SpoolOptions::default()).expect("spool");
    let mut ids = EventIdGen::new().expect("ids");
    let evs: Vec<NewEvent> = texts
        .iter()
        .map(|t| NewEvent {
            stream: "s".into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("t".into(), FieldValue::Text(t.clone()))],
            replay: None,
            key: None,
            reply: None,
        })
        .collect();
    // Appended now: retention deletes ACKED rows by their append time.
    let now = edgespool::event::envelope::wall_clock_ms().0;
    s.append(&evs, &mut ids, "it-board", Format::Json, now)
        .expect("append");
}

/// Five small events, one of about 3,000 bytes, five small.
pub(crate) fn small_big_small() -> Vec<String> {
    let mut t: Vec<String> = (0..5).map(|i| format!("small {i}")).collect();
    t.push("x".repeat(3000));
    t.extend((5..10).map(|i| format!("small {i}")));
    t
}

/// mosquitto's dynamic-security plugin (Debian ships it with mosquitto).
fn dynsec_plugin() -> PathBuf {
    std::fs::read_dir("/usr/lib")
        .expect("read /usr/lib")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("mosquitto_dynamic_security.so"))
        .find(|p| p.is_file())
        .expect("mosquitto_dynamic_security.so under /usr/lib/<arch>/ (package mosquitto)")
}

/// A broker whose ACL comes from the dynamic-security plugin: anonymous
/// clients (the agent and the test subscriber) get `acls`, a JSON array of
/// `{"acltype", "topic", "allow"}`; everything else is denied, except
/// receiving and unsubscribing. Config and ACL live in `dir`.
pub(crate) fn broker_with_acl(dir: &Path, acls: serde_json::Value) -> Broker {
    let cfg = dir.join("dynsec.json");
    let doc = serde_json::json!({
        "defaultACLAccess": {
            "publishClientSend": false,
            "publishClientReceive": true,
            "subscribe": false,
            "unsubscribe": true
        },
        "clients": [],
        "groups": [{"groupname": "anon", "roles": [{"rolename": "board"}]}],
        "anonymousGroup": "anon",
        "roles": [{"rolename": "board", "acls": acls}]
    });
    std::fs::write(&cfg, doc.to_string()).expect("write dynsec.json");
    Broker::start_with_config(&format!(
        "plugin {}\nplugin_opt_config_file {}\n",
        dynsec_plugin().display(),
        cfg.display()
    ))
}

pub(crate) fn allow(acltype: &str, topic: &str) -> serde_json::Value {
    serde_json::json!({"acltype": acltype, "topic": topic, "allow": true})
}

/// Every ACKED row reached the subscriber (the broker had it), allowing
/// the subscriber a moment behind the agent's PUBACK.
pub(crate) fn assert_acked_rows_were_received(db: &Path, sub: &Subscriber) {
    let ok = wait_for(Duration::from_secs(20), || {
        let got: std::collections::HashSet<String> =
            sub.deliveries().iter().map(crate::event_id).collect();
        rows_in_state(db, "ACKED")
            .iter()
            .all(|r| got.contains(&r.event_id))
    });
    assert!(ok, "an ACKED row never reached the subscriber");
}

/// The broker's ACL denies the command subscription (SUBACK 0x80): health
/// says `commands unavailable` with the reason, logged at ERROR, and
/// telemetry keeps flowing and is retired on its PUBACKs.
#[test]
fn a_command_subscription_denied_by_acl_degrades_health_and_telemetry_keeps_flowing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("subdeny");
    let broker = broker_with_acl(
        dir.path(),
        serde_json::json!([
            allow("publishClientSend", &format!("{prefix}/#")),
            allow("subscribePattern", &format!("{prefix}/events/#")),
        ]),
    );
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = crate::v311(crate::write_config(dir.path(), &broker.url(), &prefix, 200));
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let topic = format!("{prefix}/commands");
    let reason = wait_degraded_with(
        &db,
        &agent,
        &["commands unavailable", &topic, "SUBACK 0x80", "ACL"],
        Duration::from_secs(60),
    );
    println!("health reason: {reason}");
    let errors = log_lines(&agent, "ERROR", "refused the command subscription");
    assert!(!errors.is_empty(), "{}", agent.log_tail(30));
    println!("log: {}", errors[0]);
    assert!(
        !agent.log_text().contains("] mqtt: subscribed to commands"),
        "{}",
        agent.log_tail(30)
    );
    // Telemetry keeps flowing after the refusal, and is retired.
    let seen = sub.count();
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= seen + 10
            && db.exists()
            && count_in_state(&db, "ACKED") >= 10),
        "telemetry stopped: {} delivered, {:?}\n{}",
        sub.count(),
        count_by_state(&db),
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
    assert!(!log_lines(&agent, "WARN", "health degraded: commands unavailable").is_empty());
}

/// mosquitto 2.0.11's `max_keepalive` applies to MQTT 5 only: a 3.1.1
/// client with a longer keep-alive is accepted and held to its own, so the
/// agent keeps one connection through an idle gap longer than the broker's
/// 1.5 x `max_keepalive`, delivers, stays `ok`, and logs the keep-alive in
/// force. (3.1.1 has no server keep-alive to report.)
#[test]
fn a_broker_max_keepalive_below_ours_is_not_enforced_on_3_1_1_and_the_agent_keeps_working() {
    let broker = Broker::start_with_config("max_keepalive 10\n");
    let prefix = crate::prefix("keepalive");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000).v311();
    let sub = Subscriber::events(broker.port(), &prefix);
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
        connected.len() == 1 && connected[0].contains("keep_alive=60 s"),
        "{connected:?}"
    );
    assert!(
        broker
            .log_text()
            .contains(&format!("as {CLIENT_ID} (p2, c0, k60)")),
        "the broker did not take keep-alive 60 from a 3.1.1 client:\n{}",
        crate::support::tail(&broker.log_text(), 20)
    );
    // Idle (no sources, nothing in flight) past 1.5 x max_keepalive: a
    // broker enforcing 10 s would have closed the connection by now. This
    // waits for an absence, so it is a minimum, not a guess at speed.
    std::thread::sleep(Duration::from_secs(20));
    assert_eq!(
        log_lines(&agent, "INFO", "mqtt: connected to").len(),
        1,
        "{}",
        agent.log_tail(20)
    );
    assert!(!broker.log_text().contains("exceeded timeout"));
    assert!(!agent.log_text().contains("mqtt: disconnected"));
    assert_eq!(
        status_json(&db)["health"]["state"],
        "ok",
        "{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// `mqtt.max_packet_bytes` set to the broker's `max_packet_size`: the one
/// event whose PUBLISH is larger goes FAILED at once, before it is sent,
/// with a reason naming its size and the limit (logged at ERROR, in
/// `status` and in health); every other row is delivered on one connection.
#[test]
fn with_max_packet_bytes_set_the_oversized_row_fails_at_once_and_the_rest_are_acked() {
    let broker = Broker::start_with_config("max_packet_size 2000\n");
    let prefix = crate::prefix("pktlimit");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000).v311();
    let sub = Subscriber::events(broker.port(), &prefix);
    seed(&db, &small_big_small());
    let mut agent = AgentProc::spawn(
        &cfg,
        &["sources=[]".into(), "mqtt.max_packet_bytes=2000".into()],
        dir.path(),
    );
    await_states(
        &db,
        &agent,
        Duration::from_secs(60),
        "ACKED == 10 && FAILED == 1",
        |s| s.n("ACKED") == 10 && s.n("FAILED") == 1,
    );
    let failed = rows_in_state(&db, "FAILED");
    assert!(failed[0].payload.len() > 2000, "the wrong row failed");
    let v = status_json(&db);
    let why = v["failed"][0]["reason"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("PUBLISH packet of ")
            && why.ends_with("exceeds mqtt.max_packet_bytes 2000"),
        "{v}"
    );
    assert!(!log_lines(&agent, "ERROR", "exceeds mqtt.max_packet_bytes 2000").is_empty());
    assert_eq!(v["counters"]["events_failed_packet_too_large"], 1, "{v}");
    wait_degraded_with(
        &db,
        &agent,
        &["1 rows FAILED in the spool"],
        Duration::from_secs(30),
    );
    // Never sent: no connection was dropped for it.
    assert!(!broker.log_text().contains("oversize packet"));
    assert_eq!(log_lines(&agent, "INFO", "mqtt: connected to").len(), 1);
    agent.terminate(Duration::from_secs(15));
    assert!(sub.deliveries().iter().all(|d| d.payload.len() < 2000));
    assert_eq!(crate::received(&sub.deliveries()).times.len(), 10);
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// Without `mqtt.max_packet_bytes` the agent cannot know the broker's
/// limit: mosquitto closes the connection on the oversized PUBLISH (3.1.1
/// has no refusal for it); the agent then sends one row at a time, and the
/// row alone in flight at `fail_after_disconnects` (3) quick drops is set
/// aside, never FAILED for what the broker does: the rows behind it are
/// delivered, health names it, and it is tried again alone (10 s later,
/// then twice as long each time it costs the connection again).
#[test]
fn without_max_packet_bytes_the_broker_drops_the_connection_and_the_row_is_set_aside_after_three_drops(
) {
    let broker = Broker::start_with_config("max_packet_size 2000\n");
    let prefix = crate::prefix("pktdrop");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000).v311();
    let sub = Subscriber::events(broker.port(), &prefix);
    seed(&db, &small_big_small());
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    await_states(&db, &agent, Duration::from_secs(120), "ACKED == 10", |s| {
        s.n("ACKED") == 10
    });
    let drops = || {
        broker
            .log_text()
            .matches("disconnected due to oversize packet")
            .count()
    };
    assert!(drops() >= 3, "{} drops", drops());
    // Delivery's own line ("row N set aside: ..."), not health's, which
    // names rows "set aside after ..." and may come first: acknowledgements
    // ride the writer's commits, so ACKED shows up to a commit later.
    let set_aside = log_lines(&agent, "WARN", "set aside: ");
    assert_eq!(set_aside.len(), 1, "{}", agent.log_tail(30));
    assert!(
        set_aside[0].contains("rows of ") && set_aside[0].contains("sent alone in 10 s"),
        "{}",
        set_aside[0]
    );
    wait_degraded_with(
        &db,
        &agent,
        &[
            "1 rows held back by the broker",
            "set aside after the connection dropped",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(
        count_in_state(&db, "FAILED"),
        0,
        "the broker's word FAILED it"
    );
    // Tried again, alone, and again set aside: never FAILED.
    let before = drops();
    assert!(
        wait_for(Duration::from_secs(30), || drops() > before),
        "the set-aside row was not tried again\n{}",
        agent.log_tail(30)
    );
    assert!(wait_for(Duration::from_secs(10), || log_lines(
        &agent,
        "WARN",
        "set aside: "
    )
    .len()
        >= 2));
    assert_eq!(count_in_state(&db, "FAILED"), 0);
    assert!(
        wait_for(Duration::from_secs(10), || status_json(&db)["counters"]
            ["events_deferred_disconnects"]
            .as_i64()
            >= Some(2)),
        "{}",
        status_json(&db)["counters"]
    );
    agent.terminate(Duration::from_secs(15));
    assert!(sub.deliveries().iter().all(|d| d.payload.len() < 2000));
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// A wrong password: mosquitto answers CONNACK 5 (not authorized). The
/// agent logs the login refusal at ERROR (once a minute while it repeats),
/// health turns `degraded` naming it, nothing is retired; with the right
/// password in the file (read again at each connect) the rows flow.
#[test]
fn a_wrong_password_is_logged_as_a_login_refusal_and_nothing_is_retired() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pw_db = dir.path().join("mosquitto.passwd");
    password_file(&pw_db, &[("board", "right-secret")]);
    let broker = Broker::start_with_config(&format!(
        "allow_anonymous false\npassword_file {}\n",
        pw_db.display()
    ));
    let prefix = crate::prefix("badlogin");
    let cfg = crate::v311(crate::write_config(dir.path(), &broker.url(), &prefix, 500));
    let db = dir.path().join("spool.db");
    let pw_file = dir.path().join("board.password");
    std::fs::write(&pw_file, "wrong-secret\n").expect("write password file");
    let private = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600);
    std::fs::set_permissions(&pw_file, private).expect("chmod 600 the password file");
    let mut agent = AgentProc::spawn(
        &cfg,
        &[
            "mqtt.username=board".into(),
            // Health's grace: twice the keep-alive, at least 30 s.
            "mqtt.keep_alive_secs=5".into(),
            format!("mqtt.password_file={}", pw_file.display()),
        ],
        dir.path(),
    );
    let reason = wait_degraded_with(
        &db,
        &agent,
        &[
            "not connected to",
            "the broker refused the login",
            "not authorized",
        ],
        Duration::from_secs(90),
    );
    println!("health reason: {reason}");
    let errors = log_lines(&agent, "ERROR", "the broker refused the login");
    assert!(!errors.is_empty(), "{}", agent.log_tail(30));
    println!("log: {}", errors[0]);
    // Rate-limited: once a minute, not once per attempt (every < 1 s here).
    assert!(errors.len() <= 2, "{} ERROR lines", errors.len());
    assert!(broker.log_text().contains("not authorised"));
    assert_eq!(count_in_state(&db, "ACKED"), 0);
    assert!(
        count_in_state(&db, "PENDING") > 0,
        "{:?}",
        count_by_state(&db)
    );
    assert_eq!(pubacks_sent(&broker), 0);
    // The right password: the next connect reads it, and the rows flow.
    std::fs::write(&pw_file, "right-secret\n").expect("write password file");
    await_states(&db, &agent, Duration::from_secs(60), "ACKED >= 10", |s| {
        s.n("ACKED") >= 10
    });
    assert!(
        wait_for(Duration::from_secs(60), || status_json(&db)["health"]
            ["state"]
            == "ok"),
        "{}",
        status_json(&db)["health"]
    );
    agent.terminate(Duration::from_secs(15));
    assert_no_retirement_without_puback(&db, &broker);
}

/// What MQTT 3.1.1 cannot detect: the broker's ACL denies the event topic,
/// yet mosquitto sends an ordinary PUBACK (its log says `Denied PUBLISH`),
/// so the agent retires rows no subscriber ever gets and health stays `ok`.
/// This pins the limitation the README states; MQTT 5 would carry reason
/// code 0x87 (not authorized) in the PUBACK.
#[test]
fn a_publish_denied_by_acl_is_acknowledged_under_3_1_1_and_the_agent_cannot_tell() {
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("pubdeny");
    let broker = broker_with_acl(
        dir.path(),
        serde_json::json!([
            allow("publishClientSend", &format!("{prefix}/status")),
            allow("subscribePattern", &format!("{prefix}/#")),
        ]),
    );
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = crate::v311(crate::write_config(dir.path(), &broker.url(), &prefix, 200));
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    await_states(&db, &agent, Duration::from_secs(60), "ACKED >= 10", |s| {
        s.n("ACKED") >= 10
    });
    assert!(broker.log_text().contains("Denied PUBLISH"));
    // Retired on a real PUBACK each...
    assert_no_retirement_without_puback(&db, &broker);
    // ...yet nothing reached the subscriber, and the agent cannot know.
    assert_eq!(sub.count(), 0);
    assert!(
        wait_for(Duration::from_secs(30), || status_json(&db)["health"]
            ["state"]
            == "ok"),
        "{}",
        status_json(&db)["health"]
    );
    agent.terminate(Duration::from_secs(15));
    assert_eq!(sub.count(), 0);
}

/// The agent's own retained `online` status must never cost the connection:
/// with `mqtt.max_packet_bytes` below its size (a broker with a small
/// `max_packet_size`) it is not sent, with one WARN, and the events, which
/// fit, are all delivered on one connection.
#[test]
fn a_status_message_over_max_packet_bytes_is_skipped_and_events_flow() {
    let broker = Broker::start_with_config("max_packet_size 220\n");
    let prefix = crate::prefix("pktstatus");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000).v311();
    let sub = Subscriber::events(broker.port(), &prefix);
    let small: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    seed(&db, &small);
    let mut agent = AgentProc::spawn(
        &cfg,
        &["sources=[]".into(), "mqtt.max_packet_bytes=220".into()],
        dir.path(),
    );
    await_states(&db, &agent, Duration::from_secs(60), "ACKED == 10", |s| {
        s.n("ACKED") == 10
    });
    assert_eq!(
        log_lines(&agent, "WARN", "the retained online status").len(),
        1,
        "{}",
        agent.log_tail(30)
    );
    assert!(!broker.log_text().contains("oversize packet"));
    assert_eq!(log_lines(&agent, "INFO", "mqtt: connected to").len(), 1);
    agent.terminate(Duration::from_secs(15));
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}

/// Oversized readings that keep coming, without `mqtt.max_packet_bytes`:
/// the first costs `fail_after_disconnects` (3) dropped connections; its
/// size, larger than anything the broker acknowledged, is then taken as the
/// broker's limit, so the later ones wait at once (held, never FAILED)
/// instead of costing 3 reconnects each, and the small rows behind them
/// keep flowing. One row probes the limit now and then (10 s, then twice as
/// long each time it costs the connection).
#[test]
fn after_one_oversized_row_costs_the_connection_later_ones_wait_at_once() {
    let broker = Broker::start_with_config("max_packet_size 2000\n");
    let prefix = crate::prefix("pktlearn");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 1000).v311();
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut texts = Vec::new();
    for i in 0..5 {
        texts.extend((0..4).map(|j| format!("small {i}.{j}")));
        texts.push(format!("{i}{}", "x".repeat(3000)));
    }
    seed(&db, &texts);
    let spawned = std::time::Instant::now();
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    await_states(&db, &agent, Duration::from_secs(120), "ACKED == 20", |s| {
        s.n("ACKED") == 20
    });
    let t = std::time::Instant::now();
    wait_degraded_with(
        &db,
        &agent,
        &[
            "5 rows held back by the broker",
            "the broker dropped the connection on",
        ],
        Duration::from_secs(30),
    );
    // One WARN when the limit is learned, and one more for each probe that
    // cost the connection again: probes come 10 s after, then twice as long
    // each time (10, 30, 70 s ... after the first). Without the learned
    // limit each of the 5 oversized rows is set aside on its own: 5 within
    // seconds.
    let since = spawned.elapsed().as_secs();
    let probes_by_now = (1..8).filter(|k| 10 * ((1u64 << k) - 1) <= since).count();
    let warns = log_lines(&agent, "WARN", "bytes or more wait").len();
    assert!(
        (1..=1 + probes_by_now).contains(&warns),
        "{warns} WARNs in {since} s\n{}",
        agent.log_tail(30)
    );
    // The first oversized row costs the drops it always did (a few with
    // several rows in flight, until one-row probing starts, then 3 alone in
    // flight), and a probe costs one every 10 s or more; the four after it
    // cost none: without the learned limit each costs 3 more, 15 or more
    // in all. The counter below is the exact check.
    let drops = broker.log_text().matches("oversize packet").count();
    let probes = 1 + t.elapsed().as_secs() as usize / 10;
    assert!((3..=8 + probes).contains(&drops), "{drops} oversize drops");
    assert!(
        wait_for(Duration::from_secs(10), || status_json(&db)["counters"]
            ["events_deferred_held"]
            .as_i64()
            >= Some(4)),
        "{}",
        status_json(&db)["counters"]
    );
    assert_eq!(count_in_state(&db, "FAILED"), 0);
    agent.terminate(Duration::from_secs(15));
    assert_eq!(crate::received(&sub.deliveries()).times.len(), 20);
    assert_acked_rows_were_received(&db, &sub);
    assert_no_retirement_without_puback(&db, &broker);
}
