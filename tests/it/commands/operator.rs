//! Issue 33 item 3 and issue 36 item 3: the operator is a key, not a name,
//! and a board is safe as shipped. Tried as an attacker would, against the
//! real agent and a real mosquitto: a sender naming the scope that once was
//! the operator's, 20,000 unsigned junk commands with side effects against
//! the default config, signatures by a stranger's key or moved to another
//! board, id or request, and a signed command replayed. Also issue 33 item
//! 7: a signed push names every local-only key it set and that was ignored.

use super::{counter, kept_push, lines, publish_all, result_count, sha, signed, Extra, Rig, BOARD};
use crate::support::agent::AgentProc;
use crate::support::wait_for;
use edgespool::event::signature::SigningKey;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// How long the operator's command may take to be answered.
const BOUND: Duration = Duration::from_secs(5);
/// How long a test waits for an answer before calling it missing.
const PATIENCE: Duration = Duration::from_secs(30);

/// Every answer to `command_id` so far (fields, `result` parsed). Payloads
/// are filtered as bytes first: many answers may have arrived.
fn answers(rig: &Rig, command_id: &str) -> Vec<Value> {
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
        .filter(|f| f["command_id"] == command_id)
        .collect()
}

/// Send `cmd` and wait for a new answer to its id; the answer and how long
/// it took (`None`: none within [`PATIENCE`]).
pub(super) fn ask(rig: &Rig, cmd: &Value) -> (Option<Value>, Duration) {
    let id = cmd["command_id"].as_str().expect("command_id").to_owned();
    let before = answers(rig, &id).len();
    let t = Instant::now();
    rig.send_json(cmd.clone());
    let mut got = None;
    wait_for(PATIENCE, || {
        got = answers(rig, &id).into_iter().nth(before);
        got.is_some()
    });
    (got, t.elapsed())
}

/// The operator's signed `count` (an exec handler: a side effect, a
/// marker line per run) is answered `completed` within [`BOUND`].
fn operator_runs(rig: &Rig, agent: &AgentProc, id: &str) {
    let cmd = rig.signed(json!({"command_id": id, "scope": "ops", "name": "count"}));
    let (r, took) = ask(rig, &cmd);
    println!(
        "operator's signed {id}: {} in {} ms",
        r.as_ref().map_or("NOT answered".to_owned(), |r| format!(
            "{} {}",
            r["reply"], r["state"]
        )),
        took.as_millis()
    );
    let r = r.unwrap_or_else(|| panic!("{id} not answered\n{}", agent.log_tail(30)));
    assert_eq!(
        (r["reply"].as_str(), r["state"].as_str()),
        (Some("result"), Some("completed")),
        "{r}"
    );
    assert!(took < BOUND, "{id} took {took:?}");
}

/// Command records in the spool.
fn records(rig: &Rig) -> i64 {
    crate::support::spool::open(&rig.db())
        .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
        .expect("records")
}

/// Attacker test 1: a sender naming `ops` (the operator's scope when a
/// scope was the operator) fills the room of other commands with 1,000 exec
/// commands that ran: three quarters of `max_records` and no more, then
/// `no_room`; the operator's signed command, in that same scope, still runs
/// at once. (Before, with `operator_scopes = ["ops"]`: the sender's 1,000
/// all ran in the operator's reserve, filled it, and the operator's own
/// command was held back, unanswered.)
#[test]
fn a_sender_naming_the_old_operator_scope_gets_no_reserved_room() {
    let rig = Rig::with(
        "opscope",
        Extra {
            commands:
                "max_records = 1000\nmax_per_minute = 600000\nmax_per_minute_per_scope = 60000",
            broker: "max_queued_messages 40000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let topic = format!("{}/commands", rig.prefix);
    let junk: Vec<Vec<u8>> = (0..1000)
        .map(|i| {
            json!({"command_id": format!("a-{i}"), "scope": "ops", "name": "count"})
                .to_string()
                .into_bytes()
        })
        .collect();
    let t = Instant::now();
    publish_all(rig.broker.port(), &topic, junk);
    let all = wait_for(Duration::from_secs(400), || {
        std::thread::sleep(Duration::from_millis(450));
        result_count(&rig) >= 1000
    });
    assert!(
        all,
        "{} answers\n{}",
        result_count(&rig),
        agent.log_tail(30)
    );
    let rs = rig.results();
    let ran = rs
        .iter()
        .filter(|r| r["reply"] == "result" && r["state"] == "completed")
        .count();
    let no_room = rs.iter().filter(|r| r["reply"] == "no_room").count();
    println!(
        "1,000 exec commands in scope \"ops\" answered in {} ms: {ran} ran, {no_room} no_room",
        t.elapsed().as_millis()
    );
    assert_eq!(
        (ran, no_room),
        (750, 250),
        "the other commands' three quarters, no more"
    );
    operator_runs(&rig, &agent, "op-after-fill");
    assert_eq!(lines(&rig.marker("counter-fast")), 751);
    // After a restart too.
    agent.terminate(Duration::from_secs(15));
    let mut agent = rig.spawn_ready();
    operator_runs(&rig, &agent, "op-after-restart");
    agent.terminate(Duration::from_secs(15));
}

/// One of 20,000 unsigned commands with a side effect, of every kind the
/// board has, in invented scopes and in `ops`.
fn unsigned_junk(i: usize) -> Vec<u8> {
    let scope = if i.is_multiple_of(7) {
        "ops".to_owned()
    } else {
        format!("j{}", i % 1000)
    };
    let id = format!("u-{i}");
    let overlay = "[agent]\nsummary_interval_secs = 9\n";
    let v = match i % 9 {
        0 => json!({"command_id": id, "scope": scope, "name": "count"}),
        1 => json!({"command_id": id, "scope": scope, "name": "echo", "args": {"word": "hi"}}),
        2 => json!({"command_id": id, "scope": scope, "name": "set-interval",
                     "args": {"source": "system", "interval_ms": 100}}),
        3 => json!({"command_id": id, "scope": scope, "name": "flush"}),
        4 => {
            json!({"command_id": id, "scope": scope, "name": "checkpoint", "args": {"mode": "truncate"}})
        }
        5 => json!({"command_id": id, "scope": scope, "name": "requeue-failed"}),
        6 => json!({"command_id": id, "scope": scope, "name": "reload-config"}),
        7 => json!({"command_id": id, "scope": scope, "name": "apply-config",
                     "args": {"config": overlay, "sha256": sha(overlay)}}),
        _ => json!({"command_id": id, "scope": scope, "name": "count-slow"}),
    };
    v.to_string().into_bytes()
}

/// Attacker test 2: with the default config (`allow_unsigned` off), 20,000
/// unsigned junk commands with side effects run nothing, are answered
/// within the answers budget (`rejected`, `unsigned`; the rest dropped
/// unanswered and counted), write records only that many (all droppable),
/// and the operator's signed command runs at once, before and after the
/// junk is worked through. (Before, same config: the junk ran, at the
/// global rate, and the operator's command was one of the junk.)
#[test]
fn twenty_thousand_unsigned_junk_commands_leave_the_operator_room_and_bounded_records() {
    let rig = Rig::with(
        "unsigned-flood",
        Extra {
            commands: "allow_unsigned = false",
            broker: "max_queued_messages 40000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let topic = format!("{}/commands", rig.prefix);
    let t = Instant::now();
    publish_all(
        rig.broker.port(),
        &topic,
        (0..20_000).map(unsigned_junk).collect(),
    );
    println!(
        "20,000 unsigned junk commands published in {} ms",
        t.elapsed().as_millis()
    );
    operator_runs(&rig, &agent, "op-during-flood");
    let db = rig.db();
    let settled = || result_count(&rig) as i64 + counter(&db, "commands_unanswered");
    let drained = wait_for(Duration::from_secs(300), || {
        std::thread::sleep(Duration::from_millis(950));
        settled() >= 20_001
    });
    let elapsed = t.elapsed();
    assert!(drained, "{} settled\n{}", settled(), agent.log_tail(30));
    operator_runs(&rig, &agent, "op-after-flood");
    agent.terminate(Duration::from_secs(15));
    let junk: Vec<Value> = rig
        .results()
        .into_iter()
        .filter(|r| {
            r["command_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("u-"))
        })
        .collect();
    let refused = junk
        .iter()
        .filter(|r| {
            r["reply"] == "result"
                && r["state"] == "rejected"
                && r["result"]["error"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("unsigned: "))
        })
        .count();
    // `ops` is sent a seventh of the junk: its scope's own rate (60 a
    // minute) answers the rest `rate_limited`, within the same budget.
    let rate_limited = junk.iter().filter(|r| r["reply"] == "rate_limited").count();
    let (recs, unsigned, unanswered) = (
        records(&rig),
        counter(&db, "commands_unsigned"),
        counter(&db, "commands_unanswered"),
    );
    println!(
        "after {} s: {} junk answers ({refused} rejected unsigned, {rate_limited} rate_limited), \
         {unanswered} dropped \
         unanswered, commands_unsigned {unsigned}; {recs} records; count ran {} times, \
         count-slow {}",
        elapsed.as_secs(),
        junk.len(),
        lines(&rig.marker("counter-fast")),
        lines(&rig.marker("counter")),
    );
    assert_eq!(
        refused + rate_limited,
        junk.len(),
        "every junk answer is an unsigned refusal or a rate limit"
    );
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        2,
        "only the operator's two ran"
    );
    assert_eq!(lines(&rig.marker("counter")), 0, "no junk count-slow ran");
    // The answers budget (600 a minute, a burst of 600) bounds what was
    // written: one record and one result event per answer.
    let budget = 600 + 10 * elapsed.as_secs() as i64;
    assert!(recs <= budget + 2, "{recs} records, budget {budget}");
    assert!(recs <= 10_000, "{recs} records over max_records");
    assert_eq!(unsigned, refused as i64);
    let droppable: i64 = crate::support::spool::open(&db)
        .query_row(
            "SELECT count(*) FROM commands WHERE command_id LIKE 'u-%' AND state <> 'rejected'",
            [],
            |r| r.get(0),
        )
        .expect("records");
    assert_eq!(droppable, 0, "a junk record that is not droppable");
}

/// Attacker test 3: signatures that verify with no listed key, for this
/// board, this scope, this id and this request give no operator room: by a
/// stranger's key, by the operator's key for another board, moved to
/// another id, or over another request. Each is refused (`unsigned`) even
/// with `allow_unsigned` on; once the other commands' share of records is
/// full, each is answered `no_room` like any other command, while the
/// operator's own signed command still runs.
#[test]
fn a_signature_for_another_key_board_id_or_request_gives_no_operator_room() {
    let rig = Rig::with(
        "forged",
        Extra {
            commands:
                "max_records = 1000\nmax_per_minute = 600000\nmax_per_minute_per_scope = 60000",
            broker: "max_queued_messages 40000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let stranger = SigningKey::generate().expect("key").0;
    let forged = |round: &str| -> Vec<(&'static str, Value)> {
        let base = |id: String| json!({"command_id": id, "scope": "ops", "name": "count"});
        let moved = {
            let mut v = rig.signed(base(format!("orig-{round}")));
            v["command_id"] = format!("moved-{round}").into();
            v
        };
        let other_request = {
            let mut v = rig.signed(base(format!("req-{round}")));
            v["name"] = "echo".into();
            v["args"] = json!({"word": "hi"});
            v
        };
        vec![
            (
                "a stranger's key",
                signed(&stranger, BOARD, base(format!("stranger-{round}"))),
            ),
            (
                "another board",
                signed(&rig.operator, "gw-other", base(format!("board-{round}"))),
            ),
            ("another command id", moved),
            ("another request", other_request),
        ]
    };
    for (what, cmd) in forged("open") {
        let (r, _) = ask(&rig, &cmd);
        let r = r.unwrap_or_else(|| panic!("{what}: no answer\n{}", agent.log_tail(30)));
        println!(
            "{what}, room free: {} {} {}",
            r["reply"], r["state"], r["result"]["error"]
        );
        let err = r["result"]["error"].as_str().unwrap_or_default();
        assert!(
            r["state"] == "rejected"
                && err.starts_with("unsigned: its signature verifies with none"),
            "{what}: {r}"
        );
    }
    let topic = format!("{}/commands", rig.prefix);
    let fill: Vec<Vec<u8>> = (0..760)
        .map(|i| {
            json!({"command_id": format!("f-{i}"), "scope": "fleet", "name": "count"})
                .to_string()
                .into_bytes()
        })
        .collect();
    let before = result_count(&rig);
    publish_all(rig.broker.port(), &topic, fill);
    let all = wait_for(Duration::from_secs(400), || {
        std::thread::sleep(Duration::from_millis(450));
        result_count(&rig) >= before + 760
    });
    assert!(
        all,
        "{} answers\n{}",
        result_count(&rig),
        agent.log_tail(30)
    );
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        750,
        "the other commands' share"
    );
    for (what, cmd) in forged("full") {
        let (r, _) = ask(&rig, &cmd);
        let r = r.unwrap_or_else(|| panic!("{what}: no answer\n{}", agent.log_tail(30)));
        println!("{what}, other share full: {} {}", r["reply"], r["state"]);
        assert_eq!(r["reply"], "no_room", "{what}: {r}");
    }
    operator_runs(&rig, &agent, "op-genuine");
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        751,
        "only the operator's ran"
    );
    agent.terminate(Duration::from_secs(15));
}

/// Attacker test 4: the operator's signed command, replayed as it was (and
/// after a restart), stripped of its signature, or moved to another scope,
/// runs once: the replays are answered `duplicate` from its record, the
/// moved one is refused (`unsigned`).
#[test]
fn a_signed_command_replayed_runs_once() {
    let rig = Rig::with(
        "replay",
        Extra {
            commands: "allow_unsigned = false",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let cmd = rig.signed(json!({"command_id": "r-1", "scope": "ops", "name": "count",
                                "issued_at_ms": now_ms, "ttl_secs": 3600}));
    let (r, _) = ask(&rig, &cmd);
    let r = r.unwrap_or_else(|| panic!("not answered\n{}", agent.log_tail(30)));
    assert_eq!(
        (r["reply"].as_str(), r["state"].as_str()),
        (Some("result"), Some("completed")),
        "{r}"
    );
    let mut stripped = cmd.clone();
    stripped.as_object_mut().map(|o| o.remove("signature"));
    for (what, replay) in [
        ("as sent", cmd.clone()),
        ("again", cmd.clone()),
        ("unsigned", stripped),
    ] {
        let (r, _) = ask(&rig, &replay);
        let r = r.unwrap_or_else(|| panic!("{what}: not answered\n{}", agent.log_tail(30)));
        println!("replayed {what}: {} {}", r["reply"], r["state"]);
        assert_eq!(r["reply"], "duplicate", "{what}: {r}");
    }
    let mut moved = cmd.clone();
    moved["scope"] = "ops-2".into();
    let (r, _) = ask(&rig, &moved);
    let r = r.unwrap_or_else(|| panic!("moved: not answered\n{}", agent.log_tail(30)));
    println!("moved to another scope: {} {}", r["reply"], r["state"]);
    assert_eq!(r["state"], "rejected", "{r}");
    agent.terminate(Duration::from_secs(15));
    let mut agent = rig.spawn_ready();
    let (r, _) = ask(&rig, &cmd);
    let r = r.unwrap_or_else(|| panic!("after a restart: not answered\n{}", agent.log_tail(30)));
    assert_eq!(r["reply"], "duplicate", "after a restart: {r}");
    agent.terminate(Duration::from_secs(15));
    assert_eq!(lines(&rig.marker("counter-fast")), 1, "I4: one run");
}

/// Issue 33 item 7: a signed whole config that sets local-only keys
/// (here who the operator is, and two paths the agent writes) is applied
/// without them, and its answer names each one and why; so does the log.
/// (Before: `applied: []` and nothing named.)
#[test]
fn a_signed_push_names_every_local_only_key_it_ignored() {
    let (rig, key) = super::signed_rig("push-ignored");
    let mut agent = rig.spawn_ready();
    let own = std::fs::read_to_string(&rig.cfg).expect("cfg");
    let d = rig.dir.path().display().to_string();
    let text = own
        .replace("allow_unsigned = true", "allow_unsigned = false")
        .replace(
            &format!("path = \"{d}/spool.db\""),
            &format!("path = \"{d}/elsewhere.db\""),
        )
        + &format!("[metrics]\ntextfile = \"{d}/m.prom\"\n[signed]\nserial = 1\n");
    let r = super::push_signed(&rig, &mut agent, &key, "s-ignored", &text);
    println!("signed push answer: {}", r["result"]);
    assert_eq!(r["state"], "completed", "{r}");
    let ignored = r["result"]["ignored"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let named: Vec<&str> = ignored.keys().map(String::as_str).collect();
    assert_eq!(
        named,
        ["commands.allow_unsigned", "metrics.textfile", "spool.path"],
        "{r}"
    );
    for (k, why) in &ignored {
        assert!(
            why.as_str().is_some_and(|w| w.starts_with("local only: ")),
            "{k}: {why}"
        );
    }
    assert!(
        agent.logged("WARN", "agent", "local-only keys")
            && agent
                .log_text()
                .contains("spool.path (the board's own file says what the agent writes"),
        "{}",
        agent.log_tail(20)
    );
    assert_eq!(kept_push(&rig).as_deref(), Some(text.as_str()));
    // Still the local values: unsigned commands with a side effect run.
    rig.send_json(json!({"command_id": "after", "name": "count"}));
    assert_eq!(
        rig.wait_result("after", "result", &mut agent)["state"],
        "completed"
    );
    assert!(!rig.marker("m.prom").exists());
    agent.terminate(Duration::from_secs(15));
}
