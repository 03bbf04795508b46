//! Rollbacks of the spool under the real agent: a replay source and keyed
//! ingest-socket readings whose newest commits were published and then
//! undone. The consumer (a subscriber on a real mosquitto) must never see
//! one event id with two payloads (I3).
//!
//! Each rollback here is a SIGKILL of the agent followed by removing the
//! spool's `-wal` (and `-shm`) file. This simulates a lost WAL, which is
//! what a power cut under `synchronous = NORMAL` does to the newest
//! commits: every commit since the last checkpoint is gone, although the
//! broker and the consumer already hold what they published. A plain
//! SIGKILL undoes nothing (the page cache survives), so it would not test
//! this. The boards below turn the agent's own checkpoints off
//! (`wal_autocheckpoint_pages = 0`, a day between timed checkpoints, a
//! 1 GiB WAL threshold) so that the commits of the killed run are in the
//! WAL only; a clean stop before it (SIGTERM: a TRUNCATE checkpoint) makes
//! what came before it durable, so the rollback is partial, as after a
//! power cut.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::spool::{count_in_state, rows, total};
use crate::support::subscriber::{Delivery, Subscriber};
use crate::support::wait_for;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `[spool]` settings that leave every commit of a run in the WAL until a
/// clean stop.
fn spool_section(db: &Path) -> String {
    format!(
        r#"[spool]
path = "{}"
commit_window_ms = 50
wal_autocheckpoint_pages = 0
checkpoint_interval_secs = 86400
checkpoint_wal_bytes = 1073741824
tune_from_probe = false
"#,
        db.display()
    )
}

fn mqtt_section(broker: &Broker, prefix: &str) -> String {
    format!(
        r#"[mqtt]
url = "{}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
"#,
        broker.url()
    )
}

/// The rollback: SIGKILL, then the `-wal` and `-shm` files removed (a lost
/// WAL, see the module doc).
fn kill_and_lose_the_wal(agent: &mut AgentProc, db: &Path) {
    agent.kill9();
    for ext in ["-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{ext}", db.display()));
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("remove {}: {e}", p.display()),
        }
    }
}

/// Event ids delivered with more than one distinct payload.
fn ids_with_two_payloads(deliveries: &[Delivery]) -> Vec<String> {
    let r = crate::received(deliveries);
    let mut two: Vec<String> = r
        .payloads
        .into_iter()
        .filter(|(_, p)| p.len() > 1)
        .map(|(id, _)| id)
        .collect();
    two.sort();
    two
}

/// Distinct event ids delivered.
fn distinct(deliveries: &[Delivery]) -> BTreeSet<String> {
    deliveries.iter().map(crate::event_id).collect()
}

/// A trace of `rows` rows one second apart from 2024-05-01T08:00:00Z.
fn trace(path: &Path, rows: usize) {
    let mut text = String::from("ts,level\n");
    for k in 0..rows {
        text.push_str(&format!("{},{k}\n", 1_714_550_400 + k));
    }
    std::fs::write(path, text).expect("write trace");
}

/// A replay rolled back after the consumer got its newest rows: the rows
/// come again under their ids with the same bytes (the trace's time, not
/// the clock's), so no id has two payloads, and every row arrives.
#[test]
fn a_replay_rolled_back_by_a_lost_wal_sends_its_rows_again_with_the_same_bytes() {
    const ROWS: usize = 400;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("rollback-replay");
    let sub = Subscriber::events(broker.port(), &prefix);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let csv = dir.path().join("trace.csv");
    trace(&csv, ROWS);
    let db = dir.path().join("spool.db");
    let cfg = dir.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "it-rollback"
{}{}[[sources]]
name = "levels"
kind = "replay"
path = "{}"
timestamp_columns = ["ts"]
timestamp_format = "%s"
speed = 50.0
interval_ms = 50
"#,
            spool_section(&db),
            mqtt_section(&broker, &prefix),
            csv.display()
        ),
    )
    .expect("write config");

    // Run 1, stopped cleanly: its rows are durable.
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| distinct(d).len() >= 40),
        "{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    let durable = total(&db);
    // Run 2: more rows published, then rolled back.
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| distinct(d).len()
            >= durable as usize + 100),
        "{}",
        agent.log_tail(30)
    );
    kill_and_lose_the_wal(&mut agent, &db);
    let held = distinct(&sub.deliveries());
    let kept: HashSet<String> = rows(&db).into_iter().map(|r| r.event_id).collect();
    let undone = held.iter().filter(|id| !kept.contains(*id)).count();
    println!(
        "rollback: {durable} rows durable, {} held by the consumer, {undone} of them undone in the spool",
        held.len()
    );
    assert!(
        undone >= 50,
        "the rollback undid only {undone} published rows"
    );

    // Run 3: resumes from the last durable row and plays to the end.
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(120), || agent
            .log_text()
            .contains("replay finished")
            && count_in_state(&db, "PENDING") + count_in_state(&db, "SENT")
                == 0),
        "{}",
        agent.log_tail(30)
    );
    assert!(
        sub.wait_until(Duration::from_secs(60), |d| distinct(d).len() >= ROWS),
        "{} distinct ids received",
        distinct(&sub.deliveries()).len()
    );
    agent.terminate(Duration::from_secs(15));
    assert!(
        agent.log_text().contains("resuming"),
        "{}",
        agent.log_tail(30)
    );

    let deliveries = sub.deliveries();
    let two = ids_with_two_payloads(&deliveries);
    println!(
        "{} deliveries, {} distinct ids, {} ids with two payloads",
        deliveries.len(),
        distinct(&deliveries).len(),
        two.len()
    );
    assert!(
        two.is_empty(),
        "{} event ids with two payloads, e.g. {:?}",
        two.len(),
        &two[..two.len().min(3)]
    );
    crate::assert_invariants(&db, &deliveries);
    // Every row once, under one id, its time the trace's.
    let mut by_row: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    for d in &deliveries {
        let v = d.json();
        assert_eq!(v["ts_ms"], v["fields"]["trace_ts_ms"], "{v}");
        assert_eq!(v["clock_trusted"], true, "{v}");
        let ts = v["ts_ms"].as_i64().expect("ts_ms");
        by_row.entry(ts).or_default().insert(crate::event_id(d));
    }
    assert_eq!(by_row.len(), ROWS);
    assert!(by_row.values().all(|ids| ids.len() == 1));
    let resent = crate::received(&deliveries)
        .times
        .values()
        .filter(|n| **n > 1)
        .count();
    assert!(
        resent >= undone,
        "{resent} rows delivered twice, {undone} undone"
    );
}

/// One request and its reply over the ingest socket.
struct Client {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Client {
    fn connect(sock: &Path) -> Client {
        let s = UnixStream::connect(sock).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let w = s.try_clone().expect("clone");
        Client {
            r: BufReader::new(s),
            w,
        }
    }

    /// The event id the agent stored `key` under (`ts_ms` given or not).
    fn store(&mut self, key: &str, value: u32, ts_ms: Option<i64>) -> String {
        let ts = ts_ms.map_or(String::new(), |t| format!(",\"ts_ms\":{t}"));
        let line = format!(
            "{{\"stream\":\"pump\",\"fields\":{{\"level\":{value}}}{ts},\"key\":\"{key}\"}}\n"
        );
        self.w.write_all(line.as_bytes()).expect("send");
        let mut reply = String::new();
        self.r.read_line(&mut reply).expect("reply");
        let v: Value = serde_json::from_str(&reply).expect("reply is JSON");
        assert_eq!(v["ok"], true, "{v}");
        v["event_id"].as_str().expect("event_id").to_owned()
    }
}

/// The requests of one group: `key<i>`, level `i`, the producer's time
/// (`Some`: the same at every send) or none.
fn group(c: &mut Client, name: &str, given: bool) -> Vec<String> {
    (0..5)
        .map(|i| {
            let ts = given.then_some(1_796_000_000_000 + i64::from(i));
            c.store(&format!("{name}{i}"), i, ts)
        })
        .collect()
}

/// Keyed socket readings rolled back after the consumer got them, then sent
/// again by their client (who cannot know what the spool forgot). Group
/// `a` (with `ts_ms`) is resent in its first order: the same ids, the same
/// bytes. Group `c` (with `ts_ms`) is resent before group `b` this time, so
/// it gets other `seq`s, and group `b` (no `ts_ms`: the agent's clock) new
/// times: both are new events under new ids. Under ids derived from the key
/// alone both would be a second payload under the first id.
#[test]
fn keyed_ingest_readings_rolled_back_by_a_lost_wal_never_give_one_id_two_payloads() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("rollback-keys");
    let sub = Subscriber::events(broker.port(), &prefix);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let db = dir.path().join("spool.db");
    let sock = dir.path().join("run/ingest.sock");
    let cfg = dir.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            "device_id = \"it-rollback\"\n{}{}[ingest]\nsocket = \"{}\"\n[[ingest.streams]]\nname = \"pump\"\n",
            spool_section(&db),
            mqtt_section(&broker, &prefix),
            sock.display()
        ),
    )
    .expect("write config");
    let start = || {
        let agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
        let up = wait_for(Duration::from_secs(20), || {
            UnixStream::connect(&sock).is_ok()
        });
        assert!(up, "no ingest socket\n{}", agent.log_tail(30));
        agent
    };
    let arrived = |want: &[String]| {
        sub.wait_until(Duration::from_secs(30), |d| {
            let got = distinct(d);
            want.iter().all(|id| got.contains(id))
        })
    };

    // Run 1, stopped cleanly: one durable reading.
    let mut agent = start();
    let base = Client::connect(&sock).store("k", 0, Some(1_796_000_000_000));
    assert!(arrived(std::slice::from_ref(&base)));
    agent.terminate(Duration::from_secs(15));
    // Run 2: three groups stored and delivered, then rolled back.
    let mut agent = start();
    let mut c = Client::connect(&sock);
    let (a, b, cc) = (
        group(&mut c, "a", true),
        group(&mut c, "b", false),
        group(&mut c, "c", true),
    );
    assert!(
        arrived(&[a.clone(), b.clone(), cc.clone()].concat()),
        "{}",
        agent.log_tail(30)
    );
    drop(c);
    kill_and_lose_the_wal(&mut agent, &db);
    let kept: HashSet<String> = rows(&db).into_iter().map(|r| r.event_id).collect();
    assert!(kept.contains(&base), "the clean stop's reading is durable");
    let undone = [&a, &b, &cc]
        .iter()
        .flat_map(|g| g.iter())
        .filter(|id| !kept.contains(*id))
        .count();
    assert_eq!(undone, 15, "the rollback undid every reading of run 2");

    // Run 3: the client sends them again.
    let mut agent = start();
    let mut c = Client::connect(&sock);
    let a2 = group(&mut c, "a", true);
    let c2 = group(&mut c, "c", true);
    let b2 = group(&mut c, "b", false);
    // While remembered, a retry gets the id just given and stores nothing.
    assert_eq!(group(&mut c, "b", false), b2);
    assert!(
        arrived(&[a2.clone(), b2.clone(), c2.clone()].concat()),
        "{}",
        agent.log_tail(30)
    );
    drop(c);
    agent.terminate(Duration::from_secs(15));

    let deliveries = sub.deliveries();
    let two = ids_with_two_payloads(&deliveries);
    println!(
        "{} deliveries, {} distinct ids, {} ids with two payloads",
        deliveries.len(),
        distinct(&deliveries).len(),
        two.len()
    );
    assert!(two.is_empty(), "event ids with two payloads: {two:?}");
    crate::assert_invariants(&db, &deliveries);
    assert_eq!(a2, a, "resent in the same order with ts_ms: the same ids");
    for (was, now, what) in [(&cc, &c2, "c"), (&b, &b2, "b")] {
        let same: Vec<_> = was.iter().filter(|id| now.contains(*id)).collect();
        assert!(same.is_empty(), "group {what} kept ids {same:?}");
    }
    // Group a came twice, byte for byte.
    let times = crate::received(&deliveries).times;
    assert!(a.iter().all(|id| times.get(id).copied().unwrap_or(0) >= 2));
}
