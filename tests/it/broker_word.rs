//! What a broker says (or a man in the middle says for it) never FAILs the
//! backlog for good, and never switches the command channel off for long
//! (issue 33, item 7). Each test plays the hostile side with the TCP proxy
//! in front of a real mosquitto, against the real agent binary:
//!
//! - a CONNACK announcing a tiny Maximum Packet Size on every connection;
//! - a link that drops the connection after every event PUBLISH;
//! - two resets right after the command SUBSCRIBE (a flaky link, or an
//!   attacker who can reset TCP twice);
//! - a broker that really closes every connection on the command SUBSCRIBE.
//!
//! Each prints its figure (rows FAILED, commands off) for the issue's note.

use crate::refusals::{log_lines, seed, status_json, wait_degraded_with};
use crate::support::agent::AgentProc;
use crate::support::board::Board;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{await_states, count_in_state, counter};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::Path;
use std::time::{Duration, Instant};

/// Twenty small events, of one size (about 250 bytes as a PUBLISH).
fn twenty() -> Vec<String> {
    (0..20).map(|i| format!("row {i:02}")).collect()
}

/// The events the subscriber got, by distinct event id.
fn distinct(sub: &Subscriber) -> usize {
    crate::received(&sub.deliveries()).times.len()
}

/// A man in the middle writes Maximum Packet Size 128 into every CONNACK:
/// no event fits. Today's agent deferred each row to the next connection
/// and FAILED all of them on the third. Now they wait on every connection,
/// counted, health naming the broker's limit; once CONNACKs are honest
/// again every row is delivered.
#[test]
fn a_hostile_connack_maximum_packet_size_fails_no_row_however_many_connections() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_connack_max_packet(Some(128));
    let prefix = crate::prefix("connack128");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    seed(&db, &twenty());
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    let mut failed = Vec::new();
    for n in 1..=6 {
        assert!(
            wait_for(Duration::from_secs(30), || log_lines(
                &agent,
                "INFO",
                "maximum packet size 128 bytes"
            )
            .len()
                >= n),
            "connection {n} did not come\n{}",
            agent.log_tail(30)
        );
        // The delivery thread judges the backlog against this connection's
        // limit within moments of its CONNACK.
        std::thread::sleep(Duration::from_millis(1500));
        failed.push(count_in_state(&db, "FAILED"));
        proxy.reset_all();
    }
    println!("hostile CONNACK (128 bytes): rows FAILED after connections 1..=6: {failed:?} of 20");
    assert_eq!(failed, vec![0; 6], "the broker's word FAILED rows");
    assert_eq!(count_in_state(&db, "ACKED"), 0);
    assert!(
        counter(&db, "events_deferred_packet_too_large") >= 20,
        "{}",
        status_json(&db)["counters"]
    );
    wait_degraded_with(
        &db,
        &agent,
        &["rows held back by the broker", "maximum packet size"],
        Duration::from_secs(30),
    );
    // Honest CONNACKs again: the next connection delivers every row.
    proxy.set_connack_max_packet(None);
    proxy.reset_all();
    await_states(&db, &agent, Duration::from_secs(30), "ACKED == 20", |s| {
        s.n("ACKED") == 20
    });
    agent.terminate(Duration::from_secs(15));
    assert_eq!(distinct(&sub), 20);
}

/// A link that closes the connection on every event PUBLISH (a hostile
/// broker or relay). Today's agent took the first row alone in flight at
/// three drops for a poison row, FAILED it, learned its size as the
/// broker's limit and FAILED every row at least as large at once: the
/// whole backlog within a few connections. Now the row is set aside and
/// retried alone with a growing backoff, the rest wait behind the limit it
/// taught, nothing goes FAILED, health names the drops; once the link
/// behaves, every row is delivered.
#[test]
fn a_link_that_drops_the_connection_after_every_event_fails_no_row() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_close_on_publish_to(Some("/events/"));
    let prefix = crate::prefix("dropall");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    seed(&db, &twenty());
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    let t = Instant::now();
    let all_failed = wait_for(Duration::from_secs(30), || {
        count_in_state(&db, "FAILED") == 20
    });
    let (failed, drops) = (count_in_state(&db, "FAILED"), proxy.closed_on_packet());
    println!(
        "drop after every event: {failed} of 20 rows FAILED after {drops} dropped connections ({} ms)",
        t.elapsed().as_millis()
    );
    assert!(!all_failed && failed == 0, "the broker's drops FAILED rows");
    assert!(drops >= 4, "the link dropped only {drops} connections");
    assert!(
        !log_lines(&agent, "WARN", "set aside").is_empty(),
        "{}",
        agent.log_tail(30)
    );
    wait_degraded_with(
        &db,
        &agent,
        &["rows held back by the broker", "dropped the connection"],
        Duration::from_secs(30),
    );
    // The link behaves again: the next probe goes through and the backlog
    // follows.
    proxy.set_close_on_publish_to(None);
    await_states(&db, &agent, Duration::from_secs(90), "ACKED == 20", |s| {
        s.n("ACKED") == 20
    });
    agent.terminate(Duration::from_secs(15));
    assert_eq!(distinct(&sub), 20);
    assert_eq!(count_in_state(&db, "FAILED"), 0);
}

/// Send an unsigned `ping` on the board's command topic (through the
/// broker, not the proxy).
fn ping(broker: &Broker, prefix: &str, id: &str) {
    let body = format!(r#"{{"command_id":"{id}","name":"ping"}}"#);
    crate::commands::publish(
        broker.port(),
        &format!("{prefix}/commands"),
        body.as_bytes(),
        false,
    );
}

/// Whether the subscriber got the result of command `id`.
fn answered(sub: &Subscriber, id: &str) -> bool {
    sub.deliveries()
        .iter()
        .any(|d| d.topic.ends_with("/events/_commands") && d.json()["fields"]["command_id"] == id)
}

/// Until `ping` `id` is answered (sent again every 2 s: a command sent
/// while the agent is not subscribed reaches nobody), at most `within`.
fn ping_until_answered(
    broker: &Broker,
    sub: &Subscriber,
    prefix: &str,
    id: &str,
    within: Duration,
) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < within {
        ping(broker, prefix, id);
        if wait_for(Duration::from_secs(2), || answered(sub, id)) {
            return Some(t.elapsed());
        }
    }
    None
}

fn status_text(db: &Path) -> String {
    crate::support::agent::run_cli(&["status", "--spool", db.to_str().expect("utf-8")]).1
}

/// Two connections reset right after the command SUBSCRIBE (a flaky link,
/// or an attacker who can reset TCP twice). Today's agent concluded the
/// broker closes connections on the subscription and connected without it
/// for 10 minutes. Now two drops are not a verdict: the next connection
/// subscribes, and a command sent then is answered.
#[test]
fn two_resets_right_after_the_command_subscribe_leave_commands_on() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.close_next_subscribes(2);
    let prefix = crate::prefix("subreset");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    let sets = ["sources=[]".into(), "commands.allow_unsigned=true".into()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || proxy.closed_on_packet() >= 2),
        "{}",
        agent.log_tail(30)
    );
    let t = Instant::now();
    let off = ping_until_answered(&broker, &sub, &prefix, "p-1", Duration::from_secs(40));
    println!(
        "two resets after SUBSCRIBE: commands answered again after {:?} (searched 40 s; {})",
        off.map(|d| d.as_millis()),
        log_lines(&agent, "ERROR", "command subscription")
            .first()
            .map_or("no ERROR", String::as_str)
    );
    assert!(
        off.is_some(),
        "no answer to a command {} s after two resets\n{}",
        t.elapsed().as_secs(),
        agent.log_tail(30)
    );
    assert!(
        log_lines(&agent, "ERROR", "connecting without it").is_empty(),
        "{}",
        agent.log_tail(30)
    );
    assert!(!status_text(&db).contains("commands unavailable"));
    agent.terminate(Duration::from_secs(15));
}

/// A broker that closes every connection on the command SUBSCRIBE (aedes
/// does on an ACL deny): telemetry flows without it, health says commands
/// are unavailable and why, and the subscription is tried again within
/// seconds, not minutes: once the broker takes it, commands come back
/// within the bound.
#[test]
fn a_broker_that_closes_on_the_command_subscribe_gets_it_retried_within_seconds() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::CloseOnSubscribe);
    let prefix = crate::prefix("subkills");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 200);
    let sub = Subscriber::events(broker.port(), &prefix);
    let sets = ["commands.allow_unsigned=true".into()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || sub.count() >= 10),
        "telemetry did not flow: {} delivered\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = status_text(&db);
            s.contains("health: degraded") && s.contains("commands unavailable")
        }),
        "{}",
        status_text(&db)
    );
    let judged = proxy.closed_on_packet();
    // Tried again within seconds: more SUBSCRIBEs reach the broker's side
    // within half a minute.
    assert!(
        wait_for(Duration::from_secs(30), || proxy.closed_on_packet()
            >= judged + 2),
        "the subscription was not tried again: {} closes\n{}",
        proxy.closed_on_packet(),
        agent.log_tail(30)
    );
    proxy.set_mode(Mode::Forward);
    let t = Instant::now();
    let back = ping_until_answered(&broker, &sub, &prefix, "p-2", Duration::from_secs(90));
    println!(
        "broker closing on SUBSCRIBE: {} closes; commands back {:?} ms after it stopped",
        proxy.closed_on_packet(),
        back.map(|d| d.as_millis())
    );
    assert!(
        back.is_some(),
        "commands did not come back within {} s\n{}",
        t.elapsed().as_secs(),
        agent.log_tail(30)
    );
    assert!(wait_for(Duration::from_secs(20), || !status_text(&db)
        .contains("commands unavailable")));
    agent.terminate(Duration::from_secs(15));
}
