//! Finding F3: an operator-signed command captured off the broker and
//! replayed to a board whose wall clock is untrusted (a board without an
//! RTC back in 1970 before NTP), once the board's record of it is gone,
//! must not run again. Tried as an attacker would, against the real agent,
//! a real mosquitto and the real spool file: the clock stepped by
//! libfaketime (the monotonic clocks run on, as NTP leaves them), the
//! record deleted or aged out on the agent clock, the same signed bytes
//! sent again.

use super::operator::ask;
use super::{lines, signed, Extra, Rig, BOARD};
use crate::support::agent::AgentProc;
use crate::support::faketime::{self, FakeClock};
use crate::support::wait_for;
use edgespool::event::signature::SigningKey;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const MIN_MS: i64 = 60_000;

/// The board's clock, played by libfaketime, and what the kernel says of
/// time sync (`EDGESPOOL_CLOCK_SYNC_FILE`).
struct Clock {
    fake: FakeClock,
    sync: PathBuf,
}

impl Clock {
    /// A clock `offset` from the real one ("+0", "-600"), time sync saying
    /// `sync` (`synchronized` or `unsynchronized`).
    fn new(rig: &Rig, offset: &str, sync: &str) -> Clock {
        let path = rig.dir.path().join("clock-sync");
        let c = Clock {
            fake: FakeClock::new(rig.dir.path().join("faketime"), offset).with_sync_file(&path),
            sync: path,
        };
        c.say(sync);
        c
    }

    fn say(&self, sync: &str) {
        std::fs::write(&self.sync, sync).expect("write the clock-sync file");
    }

    /// Back to ten days after the epoch, as after a reboot without an RTC.
    fn to_1970(&self) {
        let secs = real_ms() / 1000 - 10 * 86_400;
        self.fake.step(&format!("-{secs}"));
        self.say("unsynchronized");
    }

    /// Start the agent on this clock and wait for its command subscription.
    fn spawn(&self, rig: &Rig) -> AgentProc {
        let agent = AgentProc::spawn_with_env(&rig.cfg, &[], rig.dir.path(), &self.fake.env());
        assert!(
            agent.wait_log(Duration::from_secs(60), "subscribed to commands"),
            "{}",
            agent.log_tail(20)
        );
        agent
    }
}

fn real_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

/// The operator's `count` (an exec handler: a marker line per run) with
/// `issued_at_ms` and `ttl_secs` under its signature.
fn count(rig: &Rig, id: &str, issued_at_ms: i64, ttl_secs: u64) -> Value {
    rig.signed(json!({"command_id": id, "scope": "ops", "name": "count",
                      "issued_at_ms": issued_at_ms, "ttl_secs": ttl_secs}))
}

/// Send `cmd` and return its answer's state and error text.
fn state_of(rig: &Rig, agent: &AgentProc, cmd: &Value) -> (String, String) {
    let (r, _) = ask(rig, cmd);
    let r = r.unwrap_or_else(|| panic!("no answer to {cmd}\n{}", agent.log_tail(30)));
    let error = r["result"]["error"].as_str().unwrap_or_default().to_owned();
    (r["state"].as_str().unwrap_or_default().to_owned(), error)
}

/// Run a statement on the stopped agent's spool (the record deleted, the
/// agent clock moved): what an attacker waits for, played fast.
fn on_spool(rig: &Rig, sql: &str) {
    let c = rusqlite::Connection::open(rig.db()).expect("open the spool");
    c.execute_batch(sql).expect("the statement");
}

/// An agent_state value of the spool, if any.
fn state_value(rig: &Rig, key: &str) -> Option<i64> {
    let c = crate::support::spool::open(&rig.db());
    c.query_row("SELECT value FROM agent_state WHERE key = ?1", [key], |r| {
        r.get::<_, String>(0)
    })
    .ok()
    .and_then(|v| v.parse().ok())
}

/// The core case. A (issued t0, 60 s) runs; B (issued t0 + 10 min, 600 s)
/// runs; A's record is gone; the board restarts in 1970; A's signed bytes
/// are sent again: `expired`, not run. A command the operator signs now
/// still runs on that clock.
#[test]
fn a_signed_command_replayed_after_its_record_is_gone_is_expired_on_an_untrusted_clock() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let rig = Rig::with("replay-f3", Extra::default());
    // The board's clock ten minutes behind the real one, so A and B are
    // issued on it ten minutes apart and each runs in its time.
    let clock = Clock::new(&rig, "-600", "unsynchronized");
    let mut agent = clock.spawn(&rig);
    let t0 = real_ms() - 10 * MIN_MS;
    let a = count(&rig, "a", t0, 60);
    assert_eq!(state_of(&rig, &agent, &a).0, "completed");
    clock.fake.step("+0");
    let b = count(&rig, "b", t0 + 10 * MIN_MS, 600);
    assert_eq!(state_of(&rig, &agent, &b).0, "completed");
    agent.terminate(Duration::from_secs(15));
    assert_eq!(lines(&rig.marker("counter-fast")), 2);

    on_spool(&rig, "DELETE FROM commands WHERE command_id = 'a'");
    clock.to_1970();
    let mut agent = clock.spawn(&rig);
    let (state, why) = state_of(&rig, &agent, &a);
    assert_eq!(state, "expired", "{why}\n{}", agent.log_tail(30));
    assert!(why.contains("a time this board knows has passed"), "{why}");
    assert!(
        agent
            .log_text()
            .contains("a time this board knows has passed"),
        "{}",
        agent.log_tail(30)
    );
    assert_eq!(lines(&rig.marker("counter-fast")), 2, "the replay ran");
    // The operator's next command, issued now, runs on the 1970 clock.
    let c = count(&rig, "c", real_ms(), 60);
    assert_eq!(state_of(&rig, &agent, &c).0, "completed");
    assert_eq!(lines(&rig.marker("counter-fast")), 3);
    agent.terminate(Duration::from_secs(15));

    // A clock past 2026 yet three days behind (fake-hwclock, a slow RTC;
    // time sync has not vouched for it): the floor still decides. Before,
    // the floor was read only below 2026 and this replay ran.
    on_spool(&rig, "DELETE FROM commands WHERE command_id = 'a'");
    clock.fake.step("-259200");
    clock.say("unsynchronized");
    let mut agent = clock.spawn(&rig);
    let (state, why) = state_of(&rig, &agent, &a);
    assert_eq!(state, "expired", "{why}\n{}", agent.log_tail(30));
    assert!(why.contains("a time this board knows has passed"), "{why}");
    assert_eq!(lines(&rig.marker("counter-fast")), 3, "the replay ran");
    agent.terminate(Duration::from_secs(15));
}

/// One signed command alone, its record aged out for real (past
/// `record_retention_secs` on the agent clock, under 150 newer records):
/// the time the agent ran since carries its own issue time forward, so
/// its replay on a 1970 clock is `expired`.
#[test]
fn a_lone_signed_command_aged_out_on_the_agent_clock_is_expired_when_replayed_in_1970() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let rig = Rig::with(
        "replay-aged",
        Extra {
            commands: "record_retention_secs = 3600\nmax_per_minute_per_scope = 60000",
            ..Extra::default()
        },
    );
    let clock = Clock::new(&rig, "+0", "unsynchronized");
    let mut agent = clock.spawn(&rig);
    let a = count(&rig, "a", real_ms(), 60);
    assert_eq!(state_of(&rig, &agent, &a).0, "completed");
    for i in 0..150 {
        rig.send_json(json!({"command_id": format!("ping-{i}"), "name": "ping"}));
    }
    rig.wait_result("ping-149", "result", &mut agent);
    agent.terminate(Duration::from_secs(15));

    // Two hours of the agent running, with nothing to do.
    on_spool(
        &rig,
        "UPDATE agent_state SET value = CAST(value AS INTEGER) + 7200000 \
         WHERE key = 'commands_clock_ms'",
    );
    clock.to_1970();
    let mut agent = clock.spawn(&rig);
    let gone = wait_for(Duration::from_secs(30), || {
        let c = crate::support::spool::open(&rig.db());
        c.query_row(
            "SELECT count(*) FROM commands WHERE command_id = 'a'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .is_ok_and(|n| n == 0)
    });
    assert!(
        gone,
        "the start-up purge kept A's record\n{}",
        agent.log_tail(30)
    );
    let (state, why) = state_of(&rig, &agent, &a);
    assert_eq!(state, "expired", "{why}\n{}", agent.log_tail(30));
    assert_eq!(lines(&rig.marker("counter-fast")), 1, "the replay ran");
    agent.terminate(Duration::from_secs(15));
}

/// Only a signature by an operator key moves the floor: an unsigned command
/// and one signed by a stranger, both issued a century ahead, leave it
/// where it was, and the operator's commands still run on a 1970 clock. A
/// signed issue time far ahead of a synchronized clock counts a minute
/// past it at most.
#[test]
fn neither_an_unsigned_nor_a_strangers_command_moves_the_time_floor() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let rig = Rig::with("replay-floor", Extra::default());
    let clock = Clock::new(&rig, "+0", "synchronized");
    let mut agent = clock.spawn(&rig);
    let century = real_ms() + 100 * 365 * 86_400_000;
    let unsigned = json!({"command_id": "u", "scope": "ops", "name": "count",
                          "issued_at_ms": century, "ttl_secs": 60});
    assert_eq!(state_of(&rig, &agent, &unsigned).0, "completed");
    let stranger = SigningKey::generate().expect("a key").0;
    let forged = signed(
        &stranger,
        BOARD,
        json!({"command_id": "s", "scope": "ops", "name": "count",
               "issued_at_ms": century, "ttl_secs": 60}),
    );
    let (state, why) = state_of(&rig, &agent, &forged);
    assert_eq!(state, "rejected", "{why}");
    assert_eq!(state_value(&rig, "commands_signed_issued_ms"), None);
    assert_eq!(state_value(&rig, "commands_signed_offset_ms"), None);
    // The operator's mistake, a year ahead: counted a minute ahead.
    let now = real_ms();
    let ahead = count(&rig, "ahead", now + 365 * 86_400_000, 60);
    assert_eq!(state_of(&rig, &agent, &ahead).0, "completed");
    let issued = state_value(&rig, "commands_signed_issued_ms").expect("raised");
    assert!(issued <= real_ms() + MIN_MS, "{issued} vs {now}");
    agent.terminate(Duration::from_secs(15));

    clock.to_1970();
    let mut agent = clock.spawn(&rig);
    let d = count(&rig, "d", real_ms(), 300);
    assert_eq!(state_of(&rig, &agent, &d).0, "completed");
    assert_eq!(lines(&rig.marker("counter-fast")), 3);
    agent.terminate(Duration::from_secs(15));
}
