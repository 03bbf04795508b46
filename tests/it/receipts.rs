//! Receipt mode (`mqtt.retire_on = "receipt"`, issue 22) against a real
//! mosquitto and the real agent, with the receipts published by the test
//! as a sink (or an attacker) would: a PUBACK retires nothing; only a
//! receipt naming a row's own stream and event id does; malformed and
//! forged receipts retire nothing and are counted; a row without a receipt
//! is published again after `mqtt.receipt_timeout_secs`, with the same id
//! and bytes; a broker that refuses the receipts subscription retires
//! nothing (the rows wait in the spool), with health saying so.

use crate::commands::publish;
use crate::refusals::{allow, broker_with_acl, status_json};
use crate::support::agent::AgentProc;
use crate::support::board::{edit_config, Board};
use crate::support::broker::Broker;
use crate::support::spool::{count_in_state, rows};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// A test board (a reading every 300 ms) in receipt mode with a short
/// receipt timeout.
fn receipt_board(url: &str, prefix: &str, timeout_secs: u64) -> Board {
    let board = Board::new(url, prefix, 300);
    receipt_mode(&board.cfg, timeout_secs);
    board
}

/// Put the test board config `cfg` in receipt mode.
fn receipt_mode(cfg: &Path, timeout_secs: u64) {
    edit_config(cfg, |t| {
        t.replacen(
            "[mqtt]\n",
            &format!(
                "[mqtt]\n{}receipt_timeout_secs = {timeout_secs}\n",
                crate::support::keys::receipt_mode_toml()
            ),
            1,
        )
    });
}

/// The receipts record the agent stored for `status`.
fn receipts_state(db: &Path) -> serde_json::Value {
    status_json(db)["agent_state"]["receipts"]["value"].clone()
}

/// event id -> (stream, payloads seen) of what the subscriber received.
fn received(sub: &Subscriber) -> HashMap<String, (String, Vec<Vec<u8>>)> {
    let mut out: HashMap<String, (String, Vec<Vec<u8>>)> = HashMap::new();
    for d in sub.deliveries() {
        let v = d.json();
        let id = v["event_id"].as_str().unwrap_or_default().to_owned();
        let stream = v["stream"].as_str().unwrap_or_default().to_owned();
        out.entry(id)
            .or_insert_with(|| (stream, Vec::new()))
            .1
            .push(d.payload.clone());
    }
    out
}

#[test]
fn a_row_is_retired_only_by_a_receipt_naming_its_own_event_id() {
    let broker = Broker::start();
    let prefix = crate::prefix("receipts");
    let sub = Subscriber::events(broker.port(), &prefix);
    let Board { dir, cfg, db } = receipt_board(&broker.url(), &prefix, 10);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || sub.count() >= 6),
        "nothing delivered: {}",
        agent.log_tail(30)
    );
    // PUBACKed (the subscriber has them), and not one retired.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "a PUBACK retired a row in receipt mode"
    );
    let topic = format!("{prefix}/receipts");
    let got = received(&sub);
    let id = got.keys().next().expect("one event");
    // Malformed receipts and forged ones retire nothing: what anyone who
    // can publish on the receipts topic (a local program on a board's own
    // broker, the broker itself) could send (issue 33).
    use crate::support::keys::{signed_receipts, signed_receipts_by};
    let (stream, payloads) = &got[id];
    let bytes = payloads[0].as_slice();
    let stranger = edgespool::event::signature::SigningKey::generate()
        .expect("keygen")
        .0;
    let mut forged: Vec<Vec<u8>> = vec![
        br#"not json"#.to_vec(),
        br#"{"v":2,"stored":{}}"#.to_vec(),
        vec![b' '; edgespool::event::receipts::MAX_RECEIPT_BYTES + 1],
        // The unsigned form that retired 20 of 20 rows before issue 33.
        format!(r#"{{"v":1,"stored":{{"{stream}":["{id}"]}}}}"#).into_bytes(),
    ];
    // Signed by a key the board does not list, for another board, and by
    // the fleet's key for other bytes under this id: signature-checked,
    // and still nothing.
    forged.extend(signed_receipts_by(
        &stranger,
        "it-board",
        &[(stream, id, bytes)],
    ));
    forged.extend(signed_receipts("gw-other", &[(stream, id, bytes)]));
    forged.extend(signed_receipts("it-board", &[(stream, id, b"other bytes")]));
    // A trusted one naming its id under another stream, and an id no row has.
    forged.extend(signed_receipts(
        "it-board",
        &[
            ("other", id, bytes),
            (stream, "00000000-0000-4000-8000-000000000000", bytes),
        ],
    ));
    for p in &forged {
        publish(broker.port(), &topic, p, false);
    }
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "a malformed, unsigned, forged or wrong-digest receipt retired a row"
    );
    // They keep coming: health says so, naming the reasons.
    let reasons = || status_json(&db)["health"]["reasons"].to_string();
    assert!(
        wait_for(Duration::from_secs(20), || reasons()
            .contains("receipts refused: ")),
        "health after forged receipts: {}",
        reasons()
    );
    assert!(reasons().contains("unsigned 1"), "{}", reasons());
    // A receipt for three of them retires exactly those three.
    let chosen: Vec<(String, String, Vec<u8>)> = got
        .iter()
        .take(3)
        .map(|(id, (s, p))| (s.clone(), id.clone(), p[0].clone()))
        .collect();
    let events: Vec<(&str, &str, &[u8])> = chosen
        .iter()
        .map(|(s, i, p)| (s.as_str(), i.as_str(), p.as_slice()))
        .collect();
    for p in signed_receipts("it-board", &events) {
        publish(broker.port(), &topic, &p, false);
    }
    assert!(
        wait_for(Duration::from_secs(10), || count_in_state(&db, "ACKED")
            == 3),
        "ACKED {} after a receipt for 3 rows\n{}",
        count_in_state(&db, "ACKED"),
        agent.log_tail(30)
    );
    let acked: Vec<String> = rows(&db)
        .into_iter()
        .filter(|r| r.state == "ACKED")
        .map(|r| r.event_id)
        .collect();
    for (_, id, _) in &chosen {
        assert!(acked.contains(id), "{id} was receipted and not retired");
    }
    // Without a receipt, rows are sent again after the timeout, same bytes.
    let t = Instant::now();
    assert!(
        wait_for(Duration::from_secs(60), || received(&sub)
            .values()
            .any(|(_, p)| p.len() >= 2)),
        "nothing sent again for a missing receipt\n{}",
        agent.log_tail(30)
    );
    println!(
        "receipt timeout 10 s: the first row was sent again {} ms into the wait",
        t.elapsed().as_millis()
    );
    for (id, (_, payloads)) in received(&sub) {
        assert!(
            payloads.windows(2).all(|w| w[0] == w[1]),
            "event {id} sent again with other bytes"
        );
    }
    assert!(agent
        .log_text()
        .contains("within 10 s of their PUBACK; sending them again"));
    assert!(
        wait_for(Duration::from_secs(20), || {
            let r = receipts_state(&db);
            let refused = &r["refused"];
            refused["malformed"].as_u64() >= Some(3)
                && refused["unsigned"].as_u64() >= Some(1)
                && refused["untrusted_key"].as_u64() >= Some(1)
                && refused["other_board"].as_u64() >= Some(1)
                && r["wrong_digest"].as_u64() >= Some(1)
                && r["unmatched_ids"].as_u64() >= Some(2)
                && r["resent"].as_u64() >= Some(1)
        }),
        "receipt counts: {}",
        receipts_state(&db)
    );
    let r = receipts_state(&db);
    println!("receipts record: {r}");
    assert!(r["awaiting"].as_u64() >= Some(1), "{r}");
    // Sent again and still not stored: twice the timeout after their first
    // PUBACK health says receipts stopped (a re-send does not reset the wait).
    let health = || status_json(&db)["health"]["reasons"].to_string();
    assert!(
        wait_for(Duration::from_secs(45), || health()
            .contains("receipts stopped")),
        "health: {}\n{}",
        health(),
        agent.log_tail(20)
    );
    println!("health: {}", health());
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn a_refused_receipts_subscription_retires_nothing_and_degrades_health() {
    // A SUBACK is the broker's word: a broker (or a local user on the
    // board broker's port) that refuses the receipts subscription must not
    // get rows retired without a receipt. It used to retire them on their
    // PUBACK (20 of 20 with no sink anywhere).
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("receiptdeny");
    let broker = broker_with_acl(
        dir.path(),
        serde_json::json!([
            allow("publishClientSend", &format!("{prefix}/#")),
            allow("subscribePattern", &format!("{prefix}/events/#")),
            allow("subscribePattern", &format!("{prefix}/commands")),
        ]),
    );
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = crate::write_config(dir.path(), &broker.url(), &prefix, 300);
    receipt_mode(&cfg, 10);
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let health = || status_json(&db)["health"]["reasons"].to_string();
    // Telemetry reaches the broker and health names the refusal.
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 5
            && db.exists()
            && health().contains("receipts unavailable")),
        "{} delivered; health: {}\n{}",
        sub.count(),
        health(),
        agent.log_tail(30)
    );
    assert!(
        agent.logged("ERROR", "mqtt", "refused the subscription to"),
        "{}",
        agent.log_tail(30)
    );
    // Every delivered row was PUBACKed by now; none is retired for it.
    let delivered = sub.count();
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "rows retired with no receipt ({delivered} delivered)\n{}",
        agent.log_tail(30)
    );
    println!("health: {}; {delivered} delivered, 0 ACKED", health());
    agent.terminate(Duration::from_secs(15));
}

/// `mosquitto_pub` as `login` (`None`: anonymous) publishing `payload` at
/// QoS 1; whether it exited 0 (connected and published, or at least tried).
pub(crate) fn mosquitto_pub(
    port: u16,
    login: Option<(&str, &str)>,
    topic: &str,
    payload: &[u8],
) -> bool {
    let mut c = std::process::Command::new("mosquitto_pub");
    c.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-q",
        "1",
        "-t",
        topic,
        "-s",
    ]);
    if let Some((user, password)) = login {
        c.args(["-u", user, "-P", password]);
    }
    let mut child = c
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run mosquitto_pub (package mosquitto-clients)");
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        let _ = stdin.write_all(payload);
    }
    child.wait().map(|s| s.success()).unwrap_or(false)
}

/// docs/fleet.md's fleet layout against forged receipts (an attack from the
/// review of issue 22). gw1 runs in receipt mode, logged in as gw1; no sink
/// runs. Another device (`evil`) and an anonymous client publish receipts
/// naming gw1's own event ids (read from its spool: a perfect guess) on
/// `edgespool/gw1/receipts`: the broker refuses the anonymous client and
/// denies evil's publish, and nothing is retired. Then a sink logged in as
/// the sinks' user stores the events, and its receipts retire them.
#[test]
fn under_the_fleet_acl_only_the_sinks_receipts_retire_rows() {
    use crate::support::fleet;
    use crate::support::sink::SinkProc;
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = fleet::broker(dir.path(), "");
    let cfg = crate::write_config(dir.path(), &broker.url(), "edgespool/gw1", 300);
    receipt_mode(&cfg, 10);
    let password_file = fleet::password_file(dir.path(), "gw1");
    edit_config(&cfg, |t| {
        t.replacen("device_id = \"it-board\"", "device_id = \"gw1\"", 1)
            .replacen(
                "[mqtt]\n",
                &format!(
                    "[mqtt]\nusername = \"gw1\"\npassword_file = \"{}\"\n",
                    password_file.display()
                ),
                1,
            )
    });
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(30), "connected"),
        "the agent did not connect as gw1\n{}",
        agent.log_tail(30)
    );
    // Delivered (PUBACKed by the broker), waiting for receipts.
    assert!(
        wait_for(Duration::from_secs(30), || receipts_state(&db)["awaiting"]
            .as_u64()
            >= Some(3)),
        "no rows delivered: {}\n{}",
        receipts_state(&db),
        agent.log_tail(30)
    );
    let named: Vec<(String, String, Vec<u8>)> = rows(&db)
        .into_iter()
        .map(|r| (r.stream, r.event_id, r.payload))
        .collect();
    let events: Vec<(&str, &str, &[u8])> = named
        .iter()
        .map(|(s, i, p)| (s.as_str(), i.as_str(), p.as_slice()))
        .collect();
    let topic = "edgespool/gw1/receipts";
    // Even a receipt the fleet's key signed (a replay of a real one, say)
    // never reaches the board from another device or an anonymous client:
    // the broker's ACL is the second wall.
    for p in crate::support::keys::signed_receipts("gw1", &events) {
        assert!(
            !mosquitto_pub(broker.port(), None, topic, &p),
            "an anonymous client was let in"
        );
        mosquitto_pub(broker.port(), Some(("evil", "evil-secret")), topic, &p);
    }
    assert!(
        broker.wait_log(Duration::from_secs(10), "Denied PUBLISH"),
        "the broker did not deny evil's receipt:\n{}",
        crate::support::tail(&broker.log_text(), 20)
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        count_in_state(&db, "ACKED"),
        0,
        "a receipt from another device or an anonymous client retired a row"
    );
    // The sinks' user: its receipts retire them.
    let login = fleet::sink_login(dir.path());
    let mut args: Vec<&str> = login.iter().map(String::as_str).collect();
    args.extend(["--client-id", "fleet-sink"]);
    let sink_db = dir.path().join("fleet.db");
    let sink_db = sink_db.to_str().expect("UTF-8 path");
    args.extend(["--db", sink_db]);
    let mut sink = SinkProc::launch_args(
        broker.port(),
        "edgespool/+/events/#",
        "fleet-sink",
        dir.path(),
        &args,
    );
    assert!(
        wait_for(Duration::from_secs(60), || count_in_state(&db, "ACKED")
            >= named.len() as i64),
        "ACKED {} of {} with the sink running\n{}\n{}",
        count_in_state(&db, "ACKED"),
        named.len(),
        agent.log_tail(20),
        crate::support::tail(&sink.log_text(), 20)
    );
    sink.terminate();
    agent.terminate(Duration::from_secs(15));
}

/// Found by a newcomer reading the code (issue 37's reading test): a reload
/// changed the receipt settings in the MQTT thread, health and status
/// while the delivery thread kept the ones it started with, so a key
/// rotated by SIGHUP never reached the signature check. The receipt
/// settings now take effect at the next start, and the reload says so.
#[test]
fn a_reload_that_rotates_the_receipt_key_is_named_as_needing_a_restart() {
    let broker = Broker::start();
    let prefix = crate::prefix("rcptreload");
    let sub = Subscriber::events(broker.port(), &prefix);
    let Board { dir, cfg, db } = receipt_board(&broker.url(), &prefix, 10);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || sub.count() >= 1),
        "nothing delivered: {}",
        agent.log_tail(30)
    );
    let fleet = crate::support::keys::fleet_key().key.public().hex();
    let next = edgespool::event::signature::SigningKey::generate()
        .expect("keygen")
        .0;
    edit_config(&cfg, |t| t.replacen(&fleet, &next.public().hex(), 1));
    agent.signal(libc::SIGHUP);
    let line = agent.await_line(Duration::from_secs(10), "take effect at the next restart");
    assert!(line.contains("receipt_public_keys"), "{line}");
    // The running agent still trusts the key it started with.
    let got = received(&sub);
    let (id, (stream, payloads)) = got.iter().next().expect("one event");
    let topic = format!("{prefix}/receipts");
    for p in crate::support::keys::signed_receipts(
        "it-board",
        &[(stream.as_str(), id.as_str(), payloads[0].as_slice())],
    ) {
        publish(broker.port(), &topic, &p, false);
    }
    assert!(
        wait_for(Duration::from_secs(10), || count_in_state(&db, "ACKED")
            >= 1),
        "the start's key no longer retires rows after the reload\n{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}
