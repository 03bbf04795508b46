//! Issue 21, item 1: a sender on the command topic cannot lock the operator
//! out. 10,000 junk commands of every shape, from 1,000 invented scopes,
//! published as fast as the broker takes them, with `commands.max_records`
//! at its minimum (1000); then the operator's `apply-config` and `ping`,
//! signed by its key (`commands.operator_public_keys`), are answered within 5 s,
//! again right after a restart (the broker redelivering the junk not yet
//! acknowledged), and once all the junk is answered.

use super::{counter, lines, publish_all, Extra, Rig};
use crate::support::agent::AgentProc;
use crate::support::wait_for;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// How long an operator command may take to be answered.
const BOUND: Duration = Duration::from_secs(5);
/// How long the test waits for an answer before calling it missing (long
/// enough to tell "slow" from "never").
const PATIENCE: Duration = Duration::from_secs(30);

/// The junk: pings, `status`, unknown names, malformed JSON, non-UTF-8, exec
/// handler names with bad and good arguments, agent built-ins with bad
/// arguments and `apply-config` with a wrong checksum in invented scopes,
/// duplicates and conflicts.
fn junk(i: usize) -> Vec<u8> {
    let scope = format!("j{}", i % 1000);
    let id = format!("junk-{i}");
    let v = match i % 10 {
        0 => json!({"command_id": id, "scope": scope, "name": "ping"}),
        1 => json!({"command_id": id, "scope": scope, "name": "status"}),
        2 => json!({"command_id": id, "scope": scope, "name": "no-such"}),
        3 => return format!("{{\"command_id\":\"{id}\",\"name\":").into_bytes(),
        4 => return vec![0xff, 0xfe, (i % 251) as u8, (i / 251) as u8],
        5 => json!({"command_id": id, "scope": scope, "name": "echo", "args": {"word": "a b"}}),
        6 if i % 20 == 6 => json!({"command_id": id, "scope": scope, "name": "count"}),
        6 => json!({"command_id": id, "scope": scope, "name": "set-interval",
                     "args": {"source": "nope", "interval_ms": 1000}}),
        7 => json!({"command_id": id, "scope": scope, "name": "apply-config",
                     "args": {"config": "[agent]\nsummary_interval_secs = 9\n", "sha256": "00"}}),
        8 => json!({"command_id": format!("dup-{}", i % 50), "scope": "j0", "name": "ping"}),
        _ => json!({"command_id": format!("dup-{}", i % 50), "scope": "j0", "name": "no-such"}),
    };
    v.to_string().into_bytes()
}

/// The answer with `reply` to `command_id`, if it has arrived. Payloads are
/// filtered as bytes first: thousands of answers arrive.
fn answer(rig: &Rig, command_id: &str, reply: &str) -> Option<Value> {
    let needle = format!("\"command_id\":\"{command_id}\"");
    rig.sub
        .deliveries()
        .iter()
        .filter(|d| d.topic.ends_with("/events/_commands"))
        .filter(|d| std::str::from_utf8(&d.payload).is_ok_and(|s| s.contains(needle.as_str())))
        .map(|d| {
            let mut f = d.json()["fields"].clone();
            let parsed: Value =
                serde_json::from_str(f["result"].as_str().unwrap_or("null")).unwrap_or(Value::Null);
            f["result"] = parsed;
            f
        })
        .find(|f| f["command_id"] == command_id && f["reply"] == reply)
}

/// Send `cmd` and wait for its result; how long it took (`None`: no
/// answer within [`PATIENCE`]).
fn timed(rig: &Rig, cmd: Value) -> (Option<Value>, Duration) {
    timed_reply(rig, cmd, "result")
}

/// The operator's two commands, answered within [`BOUND`] each.
fn operator_answers(rig: &Rig, agent: &mut AgentProc, round: &str, interval: u32) {
    let tag = round.replace(' ', "-");
    let overlay = format!("[agent]\nsummary_interval_secs = {interval}\n");
    let push = rig.signed(
        json!({"command_id": format!("op-push-{tag}"), "scope": "ops",
                      "name": "apply-config",
                      "args": {"config": overlay, "sha256": super::sha(&overlay)}}),
    );
    let ping = rig.signed(
        json!({"command_id": format!("op-ping-{tag}"), "scope": "ops",
                                 "name": "ping"}),
    );
    for (what, cmd) in [("apply-config", push), ("ping", ping)] {
        let (r, took) = timed(rig, cmd);
        println!(
            "{round}: operator {what} answered in {} ms{}",
            took.as_millis(),
            if r.is_some() { "" } else { " (NOT answered)" }
        );
        let r = r.unwrap_or_else(|| {
            let log = agent.log_text();
            let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
            panic!(
                "{round}: operator {what} not answered within {PATIENCE:?}\nwarnings:\n{}\n{}",
                warnings.join("\n"),
                agent.log_tail(30)
            )
        });
        assert_eq!(r["state"], "completed", "{round}: {what}: {r}");
        assert!(took < BOUND, "{round}: operator {what} took {took:?}");
    }
}

#[test]
fn ten_thousand_junk_commands_never_lock_the_operator_out_even_across_a_restart() {
    let rig = Rig::with(
        "flood",
        Extra {
            commands: "max_records = 1000",
            // Keep every junk command for the agent (mosquitto drops beyond
            // 1000 queued by default).
            broker: "max_queued_messages 40000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let topic = format!("{}/commands", rig.prefix);
    let t = Instant::now();
    publish_all(rig.broker.port(), &topic, (0..10_000).map(junk).collect());
    let backlog = 10_000 - super::result_count(&rig);
    println!(
        "10,000 junk commands published in {} ms, {backlog} not answered yet",
        t.elapsed().as_millis()
    );
    operator_answers(&rig, &mut agent, "after the flood", 11);
    // Restart with the junk still being worked through: the broker
    // redelivers what was not acknowledged.
    agent.terminate(Duration::from_secs(15));
    let mut agent = rig.spawn_ready();
    operator_answers(&rig, &mut agent, "after a restart", 13);
    // Every junk command is answered in the end, the records stay within
    // their cap, and the operator is still answered at once.
    // (Or dropped unanswered over commands.max_answers_per_minute, and
    // counted: within 10 s, and at each clean stop.)
    let db = rig.db();
    let settled = || super::result_count(&rig) as i64 + counter(&db, "commands_unanswered");
    // A liveness bound (the time taken is printed): a debug aarch64 agent
    // under qemu, beside the other flood test, had settled 9,934 of the
    // 10,004 at 300 s on a loaded machine.
    let drained = wait_for(Duration::from_secs(450), || {
        std::thread::sleep(Duration::from_millis(950));
        settled() >= 10_004
    });
    println!(
        "{} answers and {} dropped unanswered after {} s",
        super::result_count(&rig),
        counter(&db, "commands_unanswered"),
        t.elapsed().as_secs()
    );
    assert!(
        drained,
        "the junk was not all answered or counted\n{}",
        agent.log_tail(30)
    );
    operator_answers(&rig, &mut agent, "after the junk", 17);
    assert!(agent.is_running());
    agent.terminate(Duration::from_secs(15));

    // I4 under the flood: no command that ran with a side effect was
    // answered `result` twice (two result rows: two event ids), and the
    // exec handler ran no more often than it was recorded running. (A
    // `ping` or a rejected command may be answered afresh once its record
    // made room: nothing ran. A result row in flight at the restart may
    // arrive twice under its one event id: I3, not a second result.)
    let mut ids: std::collections::BTreeMap<(String, String), Vec<String>> =
        std::collections::BTreeMap::new();
    for d in rig
        .sub
        .deliveries()
        .iter()
        .filter(|d| d.topic.ends_with("/events/_commands"))
    {
        let v = d.json();
        let r = &v["fields"];
        let ran = r["reply"] == "result"
            && r["state"] != "rejected"
            && r["name"] != "ping"
            && r["name"] != "status";
        if ran {
            let key = (
                r["scope"].as_str().unwrap_or("").to_owned(),
                r["command_id"].as_str().unwrap_or("").to_owned(),
            );
            ids.entry(key)
                .or_default()
                .push(v["event_id"].as_str().unwrap_or("").to_owned());
        }
    }
    let answered: usize = ids.values().map(Vec::len).sum();
    let twice: Vec<_> = ids
        .iter_mut()
        .filter_map(|(k, v)| {
            v.sort();
            v.dedup();
            (v.len() > 1).then(|| (k.clone(), v.clone()))
        })
        .collect();
    let results = ids;
    let (ran, completed) = {
        let c = crate::support::spool::open(&db);
        let q = |states: &str| -> i64 {
            c.query_row(
                &format!(
                    "SELECT count(*) FROM commands WHERE name = 'count' AND state IN ({states})"
                ),
                [],
                |r| r.get(0),
            )
            .expect("count records")
        };
        (
            q("'running', 'completed', 'failed', 'interrupted'"),
            q("'completed'"),
        )
    };
    let runs = lines(&rig.marker("counter-fast")) as i64;
    let records: i64 = crate::support::spool::open(&db)
        .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
        .expect("records");
    assert!(
        records <= 1000,
        "{records} records over commands.max_records"
    );
    println!(
        "{answered} result deliveries of commands that ran ({} commands); `count` ran {runs} times, \
         {completed} completed, {ran} recorded as having started; {records} records; \
         malformed {}, rejected {}, rate_limited {}, no_room {}, held_back {}",
        results.len(),
        counter(&db, "commands_malformed"),
        counter(&db, "commands_rejected"),
        counter(&db, "commands_rate_limited"),
        counter(&db, "commands_no_room"),
        counter(&db, "commands_held_back"),
    );
    assert!(twice.is_empty(), "commands with two result rows: {twice:?}");
    assert!(
        completed <= runs && runs <= ran,
        "count ran {runs} times; {completed} completed, {ran} started"
    );
}

/// The records' share of commands no operator key signed, filled with
/// commands that ran (an exec handler's record must outlive the redelivery
/// window; `allow_unsigned` is on in this rig): a new unsigned command is
/// answered `no_room` and not recorded, a duplicate still gets its stored
/// answer, and the operator's signed commands (and an unsigned push) still
/// find room, before and after a restart; no record of a command that ran
/// is deleted.
#[test]
fn with_the_other_scopes_share_of_records_full_the_operator_still_has_room() {
    let rig = Rig::with(
        "records-share",
        Extra {
            commands: "max_records = 1000\n\
                       max_per_minute = 600000\nmax_per_minute_per_scope = 60000",
            broker: "max_queued_messages 40000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let topic = format!("{}/commands", rig.prefix);
    let flushes: Vec<Vec<u8>> = (0..800)
        .map(|i| {
            json!({"command_id": format!("f-{i}"), "scope": "fleet", "name": "count"})
                .to_string()
                .into_bytes()
        })
        .collect();
    let t = Instant::now();
    publish_all(rig.broker.port(), &topic, flushes);
    // A liveness bound, not a speed target: under qemu-arm a static armv7
    // agent answered 798 of the 800 in 180 s on a loaded machine and all in
    // 126 s on the retry; the time taken is printed below.
    let all = wait_for(Duration::from_secs(400), || {
        std::thread::sleep(Duration::from_millis(450));
        super::result_count(&rig) >= 800
    });
    assert!(all, "{} answers\n{}", super::result_count(&rig), {
        agent.log_tail(30)
    });
    println!(
        "800 exec commands from another scope answered after {} ms",
        t.elapsed().as_millis()
    );
    let rs = rig.results();
    let completed = rs
        .iter()
        .filter(|r| r["reply"] == "result" && r["state"] == "completed")
        .count();
    let no_room = rs.iter().filter(|r| r["reply"] == "no_room").count();
    assert_eq!((completed, no_room), (750, 50), "three quarters of 1000");
    let refused = rs
        .iter()
        .find(|r| r["reply"] == "no_room")
        .expect("a no_room answer");
    assert!(
        refused["result"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("not recorded: send it again later"),
        "{refused}"
    );
    for round in ["full", "full-restarted"] {
        // Another scope: no room for a new command, the stored answer for
        // a known one.
        let (r, _) = timed_reply(
            &rig,
            json!({"command_id": format!("late-{round}"), "scope": "fleet", "name": "count"}),
            "no_room",
        );
        assert!(r.is_some(), "{round}: no no_room answer");
        let (r, _) = timed_reply(
            &rig,
            json!({"command_id": "f-0", "scope": "fleet", "name": "count"}),
            "duplicate",
        );
        assert!(r.is_some(), "{round}: no stored answer for f-0");
        // The operator's signed commands, and an unsigned push, still have room.
        let overlay = "[agent]\nsummary_interval_secs = 20\n";
        let push = json!({"command_id": format!("push-{round}"), "scope": "fleet",
                          "name": "apply-config",
                          "args": {"config": overlay, "sha256": super::sha(overlay)}});
        for cmd in [
            rig.signed(
                json!({"command_id": format!("op-flush-{round}"), "scope": "ops", "name": "flush"}),
            ),
            rig.signed(
                json!({"command_id": format!("op-ping-{round}"), "scope": "ops", "name": "ping"}),
            ),
            push,
        ] {
            let (r, took) = timed(&rig, cmd.clone());
            println!(
                "{round}: {} answered in {} ms",
                cmd["command_id"],
                took.as_millis()
            );
            let r =
                r.unwrap_or_else(|| panic!("{round}: {cmd} not answered\n{}", agent.log_tail(30)));
            assert_eq!(r["state"], "completed", "{r}");
            assert!(took < BOUND, "{round}: {cmd} took {took:?}");
        }
        agent.terminate(Duration::from_secs(15));
        agent = rig.spawn_ready();
    }
    agent.terminate(Duration::from_secs(15));
    let c = crate::support::spool::open(&rig.db());
    let q = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).expect(sql) };
    assert_eq!(
        q("SELECT count(*) FROM commands WHERE scope = 'fleet' AND name = 'count'"),
        750,
        "a record of a command that ran was deleted, or one refused was kept"
    );
    assert_eq!(lines(&rig.marker("counter-fast")), 750, "I4: one run each");
    assert!(q("SELECT count(*) FROM commands") <= 1000);
    assert_eq!(counter(&rig.db(), "commands_no_room"), 52);
}

/// Send `cmd` and wait for its answer with `reply`.
fn timed_reply(rig: &Rig, cmd: Value, reply: &str) -> (Option<Value>, Duration) {
    let id = cmd["command_id"].as_str().expect("command_id").to_owned();
    let t = Instant::now();
    rig.send_json(cmd);
    let mut got = None;
    wait_for(PATIENCE, || {
        got = answer(rig, &id, reply);
        got.is_some()
    });
    (got, t.elapsed())
}
