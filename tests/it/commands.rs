//! Commands over MQTT: at most once (F13, F14), rejections, config push
//! (F15, F16). Side effects are counted from marker files written by `exec`
//! handlers declared in the test's board config.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::faketime::{self, FakeClock};
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::counter;
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use edgespool::event::signature::SigningKey;
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod flood;
mod operator;
mod replay;

/// The rig's `device_id`.
const BOARD: &str = "cmd-board";

/// The command `v` signed with `key` for the board `device_id`
/// ([`edgespool::commands::signed::sign`]).
fn signed(key: &SigningKey, device_id: &str, v: Value) -> Value {
    edgespool::commands::signed::sign(key, device_id, &v).expect("a command to sign")
}

/// A broker, a proxy in front of it for the agent, a subscriber on the
/// agent's events, and a config with exec handlers writing marker files.
struct Rig {
    broker: Broker,
    proxy: Proxy,
    dir: tempfile::TempDir,
    cfg: PathBuf,
    prefix: String,
    sub: Subscriber,
    client_id: String,
    extra: Extra,
    /// The operator's key: its public half is in the board config's
    /// `commands.operator_public_keys`.
    operator: SigningKey,
}

/// Additions to the rig's board config and broker.
#[derive(Default)]
struct Extra {
    /// Lines for `[spool]`.
    spool: &'static str,
    /// Lines for `[commands]` (`allow_unsigned = true` unless these name
    /// `allow_unsigned`: most tests send unsigned commands).
    commands: &'static str,
    /// More `[[commands.handlers]]` (`{d}` is the test directory).
    handlers: &'static str,
    /// Lines for mosquitto.conf.
    broker: &'static str,
}

impl Rig {
    fn new(test: &str) -> Rig {
        Rig::with(test, Extra::default())
    }

    fn with(test: &str, extra: Extra) -> Rig {
        let broker = Broker::start_with_config(extra.broker);
        let proxy = Proxy::start(broker.port());
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = crate::prefix(test);
        let sub = Subscriber::events(broker.port(), &prefix);
        let cfg = dir.path().join("board.toml");
        let rig = Rig {
            broker,
            proxy,
            dir,
            cfg,
            prefix,
            sub,
            client_id: format!("cmd-board-{}", crate::support::unique_suffix()),
            extra,
            operator: SigningKey::generate().expect("an operator key").0,
        };
        std::fs::write(&rig.cfg, rig.config_text(30)).expect("write config");
        rig
    }

    /// Pin `mqtt.protocol = "3.1.1"`: oversized commands reach a 3.1.1
    /// client (MQTT 5 brokers drop them for a client that announced a
    /// smaller Maximum Packet Size, §3.1.2.11.4).
    fn v311(self) -> Rig {
        crate::v311(self.cfg.clone());
        self
    }

    fn marker(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn config_text(&self, keep_alive: u64) -> String {
        let d = self.dir.path().display();
        format!(
            r#"device_id = "cmd-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 50
{spool_extra}
[mqtt]
url = "{url}"
client_id = "{client_id}"
topic_prefix = "{prefix}"
keep_alive_secs = {keep_alive}
reconnect_min_ms = 100
reconnect_max_ms = 800
connect_timeout_secs = 2
[[sources]]
name = "system"
kind = "system"
interval_ms = 1000
[commands]
operator_public_keys = ["{operator}"]
{allow_unsigned}
{commands_extra}
[[commands.handlers]]
name = "count-slow"
program = "/bin/sh"
args = ["-c", "echo run >> {d}/counter; sleep 3"]
timeout_ms = 20000
[[commands.handlers]]
name = "count"
program = "/bin/sh"
args = ["-c", "echo run >> {d}/counter-fast"]
[[commands.handlers]]
name = "echo"
program = "/bin/echo"
args = ["{{word}}"]
[commands.handlers.params.word]
type = "string"
max_len = 32
{handlers_extra}
"#,
            url = self.proxy.url(),
            prefix = self.prefix,
            client_id = self.client_id,
            spool_extra = self.extra.spool,
            operator = self.operator.public().hex(),
            allow_unsigned = if self.extra.commands.contains("allow_unsigned") {
                ""
            } else {
                "allow_unsigned = true"
            },
            commands_extra = self.extra.commands,
            handlers_extra = self.extra.handlers.replace("{d}", &d.to_string()),
        )
    }

    fn spawn(&self) -> AgentProc {
        AgentProc::spawn(&self.cfg, &[], self.dir.path())
    }

    /// Spawn the agent and wait until it has subscribed to the command topic
    /// (up to 60 s: on a loaded machine the start-up storage probe's fsyncs
    /// alone took over 20 s once).
    fn spawn_ready(&self) -> AgentProc {
        let agent = self.spawn();
        assert!(
            agent.wait_log(Duration::from_secs(60), "subscribed to commands"),
            "{}",
            agent.log_tail(20)
        );
        agent
    }

    fn db(&self) -> PathBuf {
        self.dir.path().join("spool.db")
    }

    /// Publish a command at QoS 1 (retained if asked) and wait for its PUBACK.
    fn send(&self, payload: &[u8], retain: bool) {
        publish(
            self.broker.port(),
            &format!("{}/commands", self.prefix),
            payload,
            retain,
        );
    }

    fn send_json(&self, v: Value) {
        self.send(v.to_string().as_bytes(), false);
    }

    /// `v` signed with the operator's key for this rig's board.
    fn signed(&self, v: Value) -> Value {
        signed(&self.operator, BOARD, v)
    }

    /// Result events received so far (payload `fields`, with `result` parsed).
    fn results(&self) -> Vec<Value> {
        self.sub
            .deliveries()
            .iter()
            .filter(|d| d.topic.ends_with("/events/_commands"))
            .map(|d| {
                let mut f = d.json()["fields"].clone();
                let parsed: Value = serde_json::from_str(f["result"].as_str().unwrap_or("null"))
                    .unwrap_or(Value::Null);
                f["result"] = parsed;
                f
            })
            .collect()
    }

    fn wait_result(&self, command_id: &str, reply: &str, agent: &mut AgentProc) -> Value {
        let found = wait_for(Duration::from_secs(30), || {
            self.results()
                .iter()
                .any(|r| r["command_id"] == command_id && r["reply"] == reply)
        });
        assert!(
            found,
            "no {reply} for {command_id}: {:?}\n{}",
            self.results(),
            agent.log_tail(40)
        );
        self.results()
            .into_iter()
            .find(|r| r["command_id"] == command_id && r["reply"] == reply)
            .expect("found")
    }
}

fn lines(p: &Path) -> usize {
    std::fs::read_to_string(p)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// A short-lived QoS 1 publisher that returns once the PUBACK arrived.
pub fn publish(port: u16, topic: &str, payload: &[u8], retain: bool) {
    let mut o = MqttOptions::new(
        format!("cmd-sender-{}", crate::support::unique_suffix()),
        "127.0.0.1",
        port,
    );
    o.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = Client::new(o, 10);
    client
        .publish(topic, QoS::AtLeastOnce, retain, payload.to_vec())
        .expect("queue publish");
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => {
                let _ = client.disconnect();
                return;
            }
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => panic!("command publisher: {e}"),
        }
    }
    panic!("no PUBACK for the command");
}

#[test]
fn ping_round_trip_reports_a_completed_result() {
    let rig = Rig::new("ping");
    let mut agent = rig.spawn_ready();
    let t = Instant::now();
    rig.send_json(json!({"command_id": "p-1", "name": "ping"}));
    let r = rig.wait_result("p-1", "result", &mut agent);
    println!(
        "command receipt to result delivery: {} ms",
        t.elapsed().as_millis()
    );
    assert_eq!(r["state"], "completed");
    assert_eq!(r["result"]["pong"], true);
    agent.terminate(Duration::from_secs(15));
}

/// field case F14, variants D (identical resend), E (different body) and a
/// duplicate while the first still runs.
#[test]
fn duplicates_are_answered_from_the_store_and_conflicts_rejected() {
    let rig = Rig::new("dups");
    let mut agent = rig.spawn_ready();
    let c2 = json!({"command_id": "c-2", "name": "count-slow"});
    rig.send_json(c2.clone());
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter")
    ) == 1));
    rig.send_json(c2.clone()); // while running
    let busy = rig.wait_result("c-2", "in_progress", &mut agent);
    assert_eq!(busy["state"], "running");
    let first = rig.wait_result("c-2", "result", &mut agent);
    assert_eq!(first["state"], "completed");
    rig.send_json(c2.clone()); // D: identical resend after completion
    let dup = rig.wait_result("c-2", "duplicate", &mut agent);
    assert_eq!(
        dup["result"], first["result"],
        "the stored result is answered again"
    );
    assert_eq!(dup["state"], "completed");
    // E: same id, different body.
    rig.send_json(json!({"command_id": "c-2", "name": "count", "args": {}}));
    let conflict = rig.wait_result("c-2", "conflict", &mut agent);
    assert!(
        conflict["result"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("conflict: request hash mismatch"),
        "{conflict}"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        lines(&rig.marker("counter")),
        1,
        "the command ran more than once"
    );
    agent.terminate(Duration::from_secs(15));
    let (_, status, _) =
        crate::support::agent::run_cli(&["status", "--spool", rig.db().to_str().expect("utf-8")]);
    assert!(status.contains("commands_duplicates"), "{status}");
    assert!(status.contains("commands_conflicts"), "{status}");
}

/// field case F14, variants A (kill -9 after execution), F (kill -9
/// mid-execution: reported interrupted, not re-run).
#[test]
fn a_command_killed_mid_run_is_reported_interrupted_and_never_rerun() {
    let rig = Rig::new("interrupt");
    let mut agent = rig.spawn_ready();
    rig.send_json(json!({"command_id": "c-f", "name": "count-slow"}));
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter")
    ) == 1));
    agent.kill9(); // F: mid-execution (the handler sleeps 3 s after writing)
    let mut agent = rig.spawn();
    let r = rig.wait_result("c-f", "result", &mut agent);
    assert_eq!(r["state"], "interrupted");
    assert_eq!(r["retry_safe"], false);
    // The broker or an operator delivers it again: answered from the store.
    rig.send_json(json!({"command_id": "c-f", "name": "count-slow"}));
    rig.wait_result("c-f", "duplicate", &mut agent);
    // A: kill -9 right after a run completed.
    rig.send_json(json!({"command_id": "c-a", "name": "count"}));
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter-fast")
    ) == 1));
    agent.kill9();
    let mut agent = rig.spawn();
    rig.send_json(json!({"command_id": "c-a", "name": "count"}));
    rig.wait_result("c-a", "result", &mut agent);
    rig.wait_result("c-a", "duplicate", &mut agent);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(lines(&rig.marker("counter")), 1);
    assert_eq!(lines(&rig.marker("counter-fast")), 1);
    agent.terminate(Duration::from_secs(15));
}

/// field case F14, variants B (network drop mid-execution) and C (broker
/// restart before the result is published): one run, result delivered.
#[test]
fn network_loss_and_broker_restart_during_a_command_do_not_repeat_it() {
    let mut rig = Rig::new("netloss");
    let mut agent = rig.spawn_ready();
    rig.send_json(json!({"command_id": "c-b", "name": "count-slow"}));
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter")
    ) == 1));
    rig.proxy.set_mode(Mode::Blackhole);
    std::thread::sleep(Duration::from_secs(4));
    rig.proxy.set_mode(Mode::Forward);
    rig.proxy.reset_all();
    rig.wait_result("c-b", "result", &mut agent);
    // C: the broker restarts (no persistence) while the next command runs.
    rig.send_json(json!({"command_id": "c-c", "name": "count-slow"}));
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter")
    ) == 2));
    rig.broker.kill();
    rig.proxy.set_mode(Mode::Refuse);
    rig.broker.restart();
    assert!(rig.sub.wait_subscribed(Duration::from_secs(15)));
    rig.proxy.set_mode(Mode::Forward);
    rig.wait_result("c-c", "result", &mut agent);
    assert_eq!(lines(&rig.marker("counter")), 2, "a command ran twice");
    agent.terminate(Duration::from_secs(15));
}

/// field case F13: a retained command is delivered again on every
/// subscription; it runs once.
#[test]
fn a_retained_command_runs_once_across_agent_and_broker_restarts() {
    let mut rig = Rig::new("retained");
    rig.send(
        json!({"command_id": "c-1", "name": "count"})
            .to_string()
            .as_bytes(),
        true,
    );
    for _ in 0..3 {
        let mut agent = rig.spawn_ready();
        assert!(wait_for(Duration::from_secs(10), || lines(
            &rig.marker("counter-fast")
        ) >= 1));
        std::thread::sleep(Duration::from_millis(500));
        agent.terminate(Duration::from_secs(15));
    }
    // The broker restarts without persistence: the retained message is gone;
    // publish it again, as an operator tool would.
    rig.broker.kill();
    rig.broker.restart();
    assert!(rig.sub.wait_subscribed(Duration::from_secs(15)));
    rig.send(
        json!({"command_id": "c-1", "name": "count"})
            .to_string()
            .as_bytes(),
        true,
    );
    let mut agent = rig.spawn();
    assert!(
        agent.wait_log(Duration::from_secs(20), "duplicate delivery (retained)"),
        "{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        1,
        "the retained command ran more than once"
    );
    // Clear the retained message.
    rig.send(b"", true);
}

#[test]
fn malformed_oversized_and_non_utf8_commands_get_rejected_results() {
    let rig = Rig::new("malformed").v311();
    let mut agent = rig.spawn_ready();
    rig.send(&[0xff, 0xfe, 0xfd], false);
    rig.send(b"{not json", false);
    rig.send(
        json!({"command_id": "m-1", "name": "ping", "extra": 1})
            .to_string()
            .as_bytes(),
        false,
    );
    let big = json!({"command_id": "m-2", "name": "ping", "args": {"x": "y".repeat(70_000)}});
    rig.send(big.to_string().as_bytes(), false);
    rig.send_json(json!({"command_id": "m-3", "name": "no-such-command"}));
    // Wait for each answer, not for a count: the oversized one makes the
    // agent reconnect, and the broker may deliver the earlier ones again
    // (malformed messages keep no record, so each delivery is answered).
    let wanted = [
        "not UTF-8",
        "exceeds commands.max_payload_bytes",
        "unknown field `extra`",
        "unknown command \"no-such-command\"",
    ];
    assert!(
        wait_for(Duration::from_secs(60), || {
            let rs = rig.results();
            wanted.iter().all(|w| {
                rs.iter()
                    .any(|r| r["result"]["error"].as_str().is_some_and(|e| e.contains(w)))
            })
        }),
        "{:?}\n{}",
        rig.results(),
        agent.log_tail(30)
    );
    let rs = rig.results();
    let errors: Vec<String> = rs
        .iter()
        .map(|r| r["result"]["error"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(errors.iter().any(|e| e.contains("not UTF-8")), "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("exceeds commands.max_payload_bytes")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("unknown field `extra`")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("unknown command \"no-such-command\"")),
        "{errors:?}"
    );
    assert!(
        rs.iter().any(|r| r["command_id"] == "m-1"),
        "the readable id is echoed back"
    );
    assert!(agent.is_running());
    agent.terminate(Duration::from_secs(15));
    let (_, status, _) =
        crate::support::agent::run_cli(&["status", "--spool", rig.db().to_str().expect("utf-8")]);
    assert!(status.contains("commands_malformed"), "{status}");
}

#[test]
fn exec_handler_arguments_cannot_inject_shell_or_paths() {
    let rig = Rig::new("inject");
    let mut agent = rig.spawn_ready();
    let pwned = rig.marker("pwned");
    let attempts = [
        format!("x; touch {}", pwned.display()),
        format!("$(touch {})", pwned.display()),
        "--help".to_owned(),
        "../../etc/passwd".to_owned(), // hostile input
        "/etc/passwd".to_owned(),
        "a b".to_owned(),
    ];
    for (i, a) in attempts.iter().enumerate() {
        rig.send_json(
            json!({"command_id": format!("inj-{i}"), "name": "echo", "args": {"word": a}}),
        );
    }
    rig.send_json(
        json!({"command_id": "inj-ok", "name": "echo", "args": {"word": "hello.world-1"}}),
    );
    let ok = rig.wait_result("inj-ok", "result", &mut agent);
    assert_eq!(ok["state"], "completed");
    assert_eq!(ok["result"]["stdout"], "hello.world-1\n");
    for i in 0..attempts.len() {
        let r = rig.wait_result(&format!("inj-{i}"), "result", &mut agent);
        assert_eq!(r["state"], "rejected", "{r}");
        assert!(
            r["result"]["error"].as_str().unwrap_or("").contains("word"),
            "{r}"
        );
    }
    assert!(!pwned.exists());
    agent.terminate(Duration::from_secs(15));
}

/// Handlers run confined: the agent's environment (here a secret) never
/// reaches them, they start in `/`, under their limits, as their `user`, and
/// an argument that would be an option is refused before anything runs.
#[test]
fn exec_handlers_run_confined_and_never_see_the_agents_environment() {
    let rig = Rig::new("confined");
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let mut text = rig.config_text(30);
    text.push_str(
        r#"[[commands.handlers]]
name = "show-env"
program = "/usr/bin/env"
env = { GREETING = "hello" }
[[commands.handlers]]
name = "where"
program = "/bin/sh"
args = ["-c", "pwd; ulimit -n; ulimit -t"]
max_open_files = 32
cpu_secs = 5
[[commands.handlers]]
name = "echo-n"
program = "/bin/echo"
args = ["{n}"]
[commands.handlers.params.n]
type = "int"
min = -10
max = 10
"#,
    );
    if root {
        text.push_str(
            "[[commands.handlers]]
name = \"whoami\"
program = \"/usr/bin/id\"
args = [\"-u\"]
user = \"nobody\"
",
        );
    }
    std::fs::write(&rig.cfg, text).expect("write config");
    let secret = "hunter2-do-not-leak";
    let mut agent = AgentProc::spawn_with_env(
        &rig.cfg,
        &[],
        rig.dir.path(),
        &[("EDGESPOOL_TEST_SECRET", secret)],
    );
    assert!(
        agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
        "{}",
        agent.log_tail(20)
    );

    rig.send_json(json!({"command_id": "env-1", "name": "show-env"}));
    let r = rig.wait_result("env-1", "result", &mut agent);
    assert_eq!(r["state"], "completed", "{r}");
    assert_eq!(
        r["result"]["stdout"], "GREETING=hello\nLANG=C.UTF-8\nPATH=/usr/sbin:/usr/bin:/sbin:/bin\n",
        "{r}"
    );
    assert!(!r.to_string().contains(secret), "{r}");

    rig.send_json(json!({"command_id": "where-1", "name": "where"}));
    let r = rig.wait_result("where-1", "result", &mut agent);
    assert_eq!(r["result"]["stdout"], "/\n32\n5\n", "{r}");

    rig.send_json(json!({"command_id": "neg-1", "name": "echo-n", "args": {"n": -3}}));
    let r = rig.wait_result("neg-1", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    let error = r["result"]["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("args.n: -3 would begin argument"), "{r}");
    rig.send_json(json!({"command_id": "neg-2", "name": "echo-n", "args": {"n": 3}}));
    let r = rig.wait_result("neg-2", "result", &mut agent);
    assert_eq!(r["result"]["stdout"], "3\n", "{r}");

    if root {
        let nobody = std::fs::read_to_string("/etc/passwd")
            .expect("/etc/passwd")
            .lines()
            .find_map(|l| {
                l.strip_prefix("nobody:x:")
                    .map(|rest| rest.split(':').next().unwrap_or("").to_owned())
            })
            .expect("nobody in /etc/passwd");
        rig.send_json(json!({"command_id": "who-1", "name": "whoami"}));
        let r = rig.wait_result("who-1", "result", &mut agent);
        assert_eq!(r["state"], "completed", "{r}");
        assert_eq!(r["result"]["stdout"], format!("{nobody}\n"), "{r}");
    } else {
        println!("not root: the user switch is not exercised");
    }
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn a_command_past_its_ttl_is_answered_expired_and_not_run() {
    let rig = Rig::new("ttl");
    let mut agent = rig.spawn_ready();
    let issued = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
        - 60_000;
    rig.send_json(
        json!({"command_id": "old-1", "name": "count", "ttl_secs": 5, "issued_at_ms": issued}),
    );
    let r = rig.wait_result("old-1", "result", &mut agent);
    assert_eq!(r["state"], "expired");
    assert_eq!(lines(&rig.marker("counter-fast")), 0);
    agent.terminate(Duration::from_secs(15));
}

/// 1,000 deliveries of one command, with the agent killed in between: one run.
#[test]
fn a_thousand_redeliveries_with_kills_in_between_run_the_command_once() {
    let rig = Rig::new("thousand");
    let topic = format!("{}/commands", rig.prefix);
    let payload = json!({"command_id": "k-1", "name": "count"}).to_string();
    let mut o = MqttOptions::new(
        format!("bulk-{}", crate::support::unique_suffix()),
        "127.0.0.1",
        rig.broker.port(),
    );
    o.set_inflight(100);
    let (client, mut conn) = Client::new(o, 200);
    let pump = std::thread::spawn(move || pump_pubacks(&mut conn, 1000));
    let mut delivered = 0;
    for round in 0..4 {
        let mut agent = rig.spawn_ready();
        for _ in 0..250 {
            client
                .publish(topic.clone(), QoS::AtLeastOnce, false, payload.clone())
                .expect("publish");
        }
        delivered += 250;
        std::thread::sleep(Duration::from_millis(300 + 200 * round));
        agent.kill9();
    }
    let acks = pump.join().expect("pump");
    assert_eq!(acks, 1000);
    let mut agent = rig.spawn();
    let r = rig.wait_result("k-1", "result", &mut agent);
    std::thread::sleep(Duration::from_secs(2));
    agent.terminate(Duration::from_secs(15));
    let conn = crate::support::spool::open(&rig.db());
    let dups: i64 = conn
        .query_row(
            "SELECT duplicates FROM commands WHERE command_id = 'k-1'",
            [],
            |r| r.get(0),
        )
        .expect("record");
    let runs = lines(&rig.marker("counter-fast"));
    println!("1000 deliveries sent: {delivered}; duplicates answered from the store: {dups}; executions: {runs}; outcome {}", r["state"]);
    // A kill can land while the one run is under way (on a loaded or slow
    // board it does): the command is then answered interrupted and never run
    // again, and its handler may or may not have got as far as its mark.
    match r["state"].as_str() {
        Some("completed") => assert_eq!(runs, 1, "completed, run {runs} times: {r}"),
        Some("interrupted") => assert!(runs <= 1, "interrupted, run {runs} times: {r}"),
        _ => panic!("unexpected outcome: {r}"),
    }
    assert!(dups >= 1);
}

fn sha(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).expect("metadata").ino()
}

/// The confirmed config push in the rig's state directory (beside the spool).
fn kept_push(rig: &Rig) -> Option<String> {
    std::fs::read_to_string(rig.dir.path().join("config-push.toml")).ok()
}

/// field cases F15 (d) and F16: identical pushes change nothing, a keepalive
/// change reconnects once and is kept once the new connection proves it, a
/// bad push is rejected with its key path and the running config stays; the
/// spool file and the board's own config file are never touched.
#[test]
fn config_push_applies_live_without_touching_the_spool_and_rejects_bad_configs() {
    let rig = Rig::new("push");
    let mut agent = rig.spawn_ready();
    let db = rig.db();
    let ino = inode(&db);
    let local = std::fs::read_to_string(&rig.cfg).expect("cfg");
    let same = "[mqtt]\nkeep_alive_secs = 30\n";
    for i in 0..3 {
        rig.send_json(json!({"command_id": format!("same-{i}"), "name": "apply-config", "args": {"config": same, "sha256": sha(same)}}));
        let r = rig.wait_result(&format!("same-{i}"), "result", &mut agent);
        assert_eq!(r["state"], "completed", "{r}");
        assert_eq!(r["result"]["applied"], json!([]), "{r}");
    }
    let connects = agent.log_text().matches("mqtt: connected").count();
    let ka = "[mqtt]\nkeep_alive_secs = 45\n";
    rig.send_json(json!({"command_id": "ka", "name": "apply-config", "args": {"config": ka, "sha256": sha(ka)}}));
    let r = rig.wait_result("ka", "result", &mut agent);
    assert_eq!(
        r["result"]["applied"],
        json!(["mqtt (reconnecting once)"]),
        "{r}"
    );
    assert!(agent.wait_log(Duration::from_secs(15), "config push confirmed"));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        agent.log_text().matches("mqtt: connected").count(),
        connects + 1,
        "reconnected other than once"
    );
    assert_eq!(
        kept_push(&rig).as_deref(),
        Some(ka),
        "the confirmed push is kept"
    );
    // F16 (a): a typo is refused with the key path; nothing changes.
    let typo = "[spool]\ncommit_windw_ms = 50\n";
    rig.send_json(json!({"command_id": "typo", "name": "apply-config", "args": {"config": typo, "sha256": sha(typo)}}));
    let r = rig.wait_result("typo", "result", &mut agent);
    assert_eq!(r["state"], "rejected");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("spool.commit_windw_ms"),
        "{r}"
    );
    assert_eq!(kept_push(&rig).as_deref(), Some(ka));
    // A wrong checksum is rejected before anything else.
    rig.send_json(json!({"command_id": "sum", "name": "apply-config", "args": {"config": ka, "sha256": "00"}}));
    let r = rig.wait_result("sum", "result", &mut agent);
    assert_eq!(r["state"], "rejected");
    assert_eq!(inode(&db), ino, "the spool file was replaced");
    assert_eq!(
        std::fs::read_to_string(&rig.cfg).expect("cfg"),
        local,
        "a push wrote the board's own config file"
    );
    assert!(agent.is_running());
    // The push survives a restart.
    agent.terminate(Duration::from_secs(15));
    let mut agent = rig.spawn_ready();
    assert!(
        agent.log_text().contains("with the confirmed config push"),
        "{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}

/// An overlay push that would run a program, move the board to another
/// broker or widen the push policy is refused naming each key, and nothing
/// runs; the kept push keeps its file mode.
#[test]
fn an_overlay_push_cannot_run_a_program_or_move_the_broker() {
    use std::os::unix::fs::PermissionsExt;
    let rig = Rig::new("pushattack");
    let mut agent = rig.spawn_ready();
    let pwned = rig.marker("pwned");
    let evil = format!(
        "[mqtt]\nurl = \"mqtt://127.0.0.1:9\"\n[commands.config_push]\nmode = \"off\"\n[[sources]]\nname = \"x\"\nkind = \"exec\"\ncommand = [\"/bin/sh\", \"-c\", \"id > {}\"]\ninterval_ms = 100\n",
        pwned.display()
    );
    rig.send_json(json!({"command_id": "evil", "name": "apply-config", "args": {"config": evil, "sha256": sha(&evil)}}));
    let r = rig.wait_result("evil", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    let err = r["result"]["error"].as_str().unwrap_or("").to_owned();
    for key in ["mqtt.url", "commands.config_push.mode", "sources"] {
        assert!(err.contains(key), "{key} not named: {err}");
    }
    // A whole config with a signature is refused too in overlay mode.
    rig.send_json(json!({"command_id": "evil-sig", "name": "apply-config", "args": {"config": evil, "sha256": sha(&evil), "signature": "00"}}));
    assert_eq!(
        rig.wait_result("evil-sig", "result", &mut agent)["state"],
        "rejected"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(!pwned.exists(), "a pushed program ran");
    // A kept push keeps the mode an operator gave its file.
    let ok = "[spool]\npurge_batch_rows = 7\n";
    rig.send_json(json!({"command_id": "ok-1", "name": "apply-config", "args": {"config": ok, "sha256": sha(ok)}}));
    assert_eq!(
        rig.wait_result("ok-1", "result", &mut agent)["state"],
        "completed"
    );
    let file = rig.dir.path().join("config-push.toml");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let ok2 = "[spool]\npurge_batch_rows = 8\n";
    rig.send_json(json!({"command_id": "ok-2", "name": "apply-config", "args": {"config": ok2, "sha256": sha(ok2)}}));
    assert_eq!(
        rig.wait_result("ok-2", "result", &mut agent)["state"],
        "completed"
    );
    assert_eq!(kept_push(&rig).as_deref(), Some(ok2));
    let mode = std::fs::metadata(&file).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the push changed the file's mode");
    agent.terminate(Duration::from_secs(15));
}

/// In `signed` mode a whole config signed by a listed key is applied; one
/// that points the board at an unreachable broker comes back to the old
/// config within `confirm_secs`, and the board reconnects to the old broker.
/// A signature by another key is refused.
#[test]
fn a_signed_push_to_an_unreachable_broker_reverts_within_confirm_secs() {
    use ring::signature::{Ed25519KeyPair, KeyPair};
    let rig = Rig::new("pushsigned");
    let rng = ring::rand::SystemRandom::new();
    let key =
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).expect("key").as_ref())
            .expect("key");
    let other =
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).expect("key").as_ref())
            .expect("key");
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let policy = format!(
        "[commands.config_push]\nmode = \"signed\"\nconfirm_secs = 5\npublic_keys = [\"{}\"]\n",
        hex(key.public_key().as_ref())
    );
    std::fs::write(&rig.cfg, format!("{}{policy}", rig.config_text(30))).expect("cfg");
    let mut agent = rig.spawn_ready();
    let dead = rig
        .config_text(30)
        .replace(&rig.proxy.url(), "mqtt://127.0.0.1:9")
        + "[signed]\nserial = 1\n";
    assert_ne!(dead, rig.config_text(30));
    let forged = hex(other.sign(dead.as_bytes()).as_ref());
    rig.send_json(json!({"command_id": "forged", "name": "apply-config", "args": {"config": dead, "sha256": sha(&dead), "signature": forged}}));
    let r = rig.wait_result("forged", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    let connects = agent.log_text().matches("mqtt: connected").count();
    let sig = hex(key.sign(dead.as_bytes()).as_ref());
    let t = std::time::Instant::now();
    rig.send_json(json!({"command_id": "dead", "name": "apply-config", "args": {"config": dead, "sha256": sha(&dead), "signature": sig}}));
    // Its result can only reach the broker once the board is back on it.
    let r = rig.wait_result("dead", "result", &mut agent);
    assert_eq!(r["state"], "completed", "{r}");
    assert!(
        agent.wait_log(Duration::from_secs(20), "config push reverted"),
        "{}",
        agent.log_tail(20)
    );
    let reverted_after = t.elapsed();
    assert!(
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .matches("mqtt: connected")
            .count()
            > connects),
        "did not reconnect to the old broker: {}",
        agent.log_tail(20)
    );
    println!(
        "signed push to a dead broker: reverted {} ms after the push (confirm_secs = 5)",
        reverted_after.as_millis()
    );
    assert!(reverted_after < Duration::from_secs(20));
    assert_eq!(kept_push(&rig), None, "an unconfirmed push was kept");
    rig.send_json(json!({"command_id": "after", "name": "ping"}));
    assert_eq!(
        rig.wait_result("after", "result", &mut agent)["state"],
        "completed"
    );
    agent.terminate(Duration::from_secs(15));
    agent.terminate(Duration::from_secs(15));
}

/// A signing key and a rig whose board accepts configs it signs.
fn signed_rig(test: &str) -> (Rig, ring::signature::Ed25519KeyPair) {
    use ring::signature::{Ed25519KeyPair, KeyPair};
    let rig = Rig::new(test);
    let rng = ring::rand::SystemRandom::new();
    let key =
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).expect("key").as_ref())
            .expect("key");
    let policy = format!(
        "[commands.config_push]\nmode = \"signed\"\nconfirm_secs = 10\npublic_keys = [\"{}\"]\n",
        hex(key.public_key().as_ref())
    );
    std::fs::write(&rig.cfg, format!("{}{policy}", rig.config_text(30))).expect("cfg");
    (rig, key)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Push `text` signed by `key` as command `id`; the result event.
fn push_signed(
    rig: &Rig,
    agent: &mut AgentProc,
    key: &ring::signature::Ed25519KeyPair,
    id: &str,
    text: &str,
) -> Value {
    let sig = hex(key.sign(text.as_bytes()).as_ref());
    rig.send_json(json!({"command_id": id, "name": "apply-config", "args": {"config": text, "sha256": sha(text), "signature": sig}}));
    rig.wait_result(id, "result", agent)
}

/// Issue 21 (2, 9): a signed config replayed later (an older or the same
/// serial), one signed for another board, and an unsigned overlay over a
/// signed config in force are all refused, naming why; the serial survives a
/// restart, and an older signed config put back in the state directory is
/// not run at the next start.
#[test]
fn signed_configs_cannot_be_replayed_moved_to_another_board_or_discarded_by_an_overlay() {
    let (rig, key) = signed_rig("signedreplay");
    let mut agent = rig.spawn_ready();
    // The policy the board's own file gives it, kept in every signed config.
    let own = std::fs::read_to_string(&rig.cfg).expect("cfg");
    let signed = |serial: u64, purge: u32| {
        own.replace(
            "commit_window_ms = 50",
            &format!("commit_window_ms = 50\npurge_batch_rows = {purge}"),
        ) + &format!("[signed]\nserial = {serial}\n")
    };
    let v2 = signed(2, 222);
    let r = push_signed(&rig, &mut agent, &key, "s2", &v2);
    assert_eq!(r["state"], "completed", "{r}");
    assert_eq!(kept_push(&rig).as_deref(), Some(v2.as_str()));
    let v1 = signed(1, 111);
    for (id, text, want) in [
        ("s1", v1.clone(), "signed.serial 1 is not above 2"),
        ("s2-again", v2.clone(), "signed.serial 2 is not above 2"),
        (
            "victim",
            signed(5, 555).replace("device_id = \"cmd-board\"", "device_id = \"gw-victim\""),
            "the signed config is for device \"gw-victim\"; this board is \"cmd-board\"",
        ),
        ("noserial", own.clone(), "must carry [signed] serial"),
    ] {
        let r = push_signed(&rig, &mut agent, &key, id, &text);
        assert_eq!(r["state"], "rejected", "{id}: {r}");
        let err = r["result"]["error"].as_str().unwrap_or_default().to_owned();
        assert!(err.contains(want), "{id}: {err}");
    }
    let overlay = "[spool]\npurge_batch_rows = 9\n";
    rig.send_json(json!({"command_id": "ov", "name": "apply-config", "args": {"config": overlay, "sha256": sha(overlay)}}));
    let r = rig.wait_result("ov", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("a signed config is in force"),
        "{r}"
    );
    assert_eq!(
        kept_push(&rig).as_deref(),
        Some(v2.as_str()),
        "the overlay discarded the signed config"
    );
    // The serial is kept in the spool: a restart does not forget it.
    agent.terminate(Duration::from_secs(15));
    let mut agent = rig.spawn_ready();
    assert!(
        agent.log_text().contains("with the confirmed config push"),
        "{}",
        agent.log_tail(20)
    );
    let r = push_signed(&rig, &mut agent, &key, "s2-restart", &v2);
    assert_eq!(r["state"], "rejected", "{r}");
    agent.terminate(Duration::from_secs(15));
    // An older signed config, validly signed, put back in the state directory.
    std::fs::write(rig.dir.path().join("config-push.toml"), &v1).expect("plant");
    std::fs::write(
        rig.dir.path().join("config-push.sig"),
        hex(key.sign(v1.as_bytes()).as_ref()),
    )
    .expect("plant");
    let mut agent = rig.spawn_ready();
    let log = agent.log_text();
    assert!(
        log.contains("config-push.toml is ignored")
            && log.contains("serial 1, and the serial this board kept is 2"),
        "{}",
        agent.log_tail(20)
    );
    rig.send_json(json!({"command_id": "after", "name": "ping"}));
    assert_eq!(
        rig.wait_result("after", "result", &mut agent)["state"],
        "completed"
    );
    agent.terminate(Duration::from_secs(15));
    // The spool moved aside (as a damaged one is): the kept push in the
    // state directory still says serial 2, so serial 1 stays refused.
    std::fs::write(rig.dir.path().join("config-push.toml"), &v2).expect("restore");
    std::fs::write(
        rig.dir.path().join("config-push.sig"),
        hex(key.sign(v2.as_bytes()).as_ref()),
    )
    .expect("restore");
    for ext in ["", "-wal", "-shm"] {
        let f = format!("{}{ext}", rig.db().display());
        let _ = std::fs::rename(&f, format!("{f}.aside"));
    }
    let mut agent = rig.spawn_ready();
    let r = push_signed(&rig, &mut agent, &key, "s1-reset", &v1);
    assert_eq!(r["state"], "rejected", "{r}");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("signed.serial 1 is not above 2"),
        "{r}"
    );
    agent.terminate(Duration::from_secs(15));
}

/// Issue 21 (7): pushed tuning is bounded tighter than the local file: an
/// hour-long reconnect backoff and keep-alive, and a 10 ms sampling
/// interval, are refused naming the bound; the connection is not touched.
#[test]
fn pushed_tuning_that_would_keep_the_board_away_or_flood_it_is_refused() {
    let rig = Rig::new("pushbounds");
    let mut agent = rig.spawn_ready();
    let connects = agent.log_text().matches("mqtt: connected").count();
    let away =
        "[mqtt]\nreconnect_min_ms = 3600000\nreconnect_max_ms = 3600000\nkeep_alive_secs = 3600\n";
    rig.send_json(json!({"command_id": "away", "name": "apply-config", "args": {"config": away, "sha256": sha(away)}}));
    let r = rig.wait_result("away", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    let err = r["result"]["error"].as_str().unwrap_or_default().to_owned();
    for want in [
        "mqtt.reconnect_min_ms = 3600000 (a push may set 100..=60000)",
        "mqtt.reconnect_max_ms = 3600000 (a push may set 1000..=300000)",
        "mqtt.keep_alive_secs = 3600 (a push may set 5..=600)",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    rig.send_json(json!({"command_id": "fast", "name": "set-interval", "args": {"source": "system", "interval_ms": 10}}));
    let r = rig.wait_result("fast", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("100..=86400000"),
        "{r}"
    );
    assert_eq!(kept_push(&rig), None);
    assert_eq!(
        agent.log_text().matches("mqtt: connected").count(),
        connects,
        "a refused push reconnected"
    );
    agent.terminate(Duration::from_secs(15));
}

/// field case F15 (b): a config file broken between runs falls back to the
/// last-known-good copy, loudly, and the agent runs.
#[test]
fn a_broken_config_file_at_start_falls_back_to_the_last_good_copy() {
    let rig = Rig::new("lastgood");
    let mut agent = rig.spawn_ready();
    agent.terminate(Duration::from_secs(15));
    for broken in ["", "device_id = \"x\"\n[spool\n", "\0\0\0\0\0\0"] {
        std::fs::write(&rig.cfg, broken).expect("write broken config");
        let mut agent = rig.spawn_ready();
        // Logged by the main thread once the spool is open, which under load
        // can come after the MQTT thread's "subscribed to commands".
        assert!(
            agent.wait_log(Duration::from_secs(10), "config invalid: "),
            "{}",
            agent.log_text()
        );
        let log = agent.log_text();
        assert!(log.contains("running last-known-good"), "{log}");
        assert!(wait_for(Duration::from_secs(10), || rig
            .sub
            .deliveries()
            .iter()
            .any(|d| d.topic.ends_with("/events/_agent"))));
        agent.terminate(Duration::from_secs(15));
    }
}

#[test]
fn sighup_and_set_interval_change_sampling_live() {
    let rig = Rig::new("interval");
    let mut agent = rig.spawn_ready();
    rig.send_json(json!({"command_id": "si", "name": "set-interval", "args": {"source": "system", "interval_ms": 100}}));
    let r = rig.wait_result("si", "result", &mut agent);
    assert_eq!(r["result"]["interval_ms"], 100, "{r}");
    let before = rig
        .sub
        .deliveries()
        .iter()
        .filter(|d| d.topic.ends_with("/events/system"))
        .count();
    std::thread::sleep(Duration::from_secs(2));
    let after = rig
        .sub
        .deliveries()
        .iter()
        .filter(|d| d.topic.ends_with("/events/system"))
        .count();
    assert!(
        after - before >= 10,
        "only {} readings in 2 s at 100 ms",
        after - before
    );
    rig.send_json(json!({"command_id": "si-bad", "name": "set-interval", "args": {"source": "nope", "interval_ms": 100}}));
    let r = rig.wait_result("si-bad", "result", &mut agent);
    assert_eq!(r["state"], "rejected");
    // SIGHUP re-reads the file: the file still says 1000 ms.
    agent.signal(libc::SIGHUP);
    assert!(
        agent.wait_log(Duration::from_secs(10), "config reloaded"),
        "{}",
        agent.log_tail(20)
    );
    assert!(agent.is_running());
    agent.terminate(Duration::from_secs(15));
}

/// field case F15 (a): the agent is SIGKILLed at random points while a config
/// push is being applied; after every cut the kept push is the whole old one
/// or the whole new one (or none yet), never empty or partial, the board's
/// own config file is untouched, and the agent starts.
#[test]
fn a_kill_during_config_push_leaves_the_old_or_the_new_config_whole() {
    let rig = Rig::new("pushkill");
    let local = std::fs::read_to_string(&rig.cfg).expect("cfg");
    let old = "[spool]\npurge_batch_rows = 7\n".to_owned();
    let new = "[spool]\npurge_batch_rows = 8\n".to_owned();
    let mut kills_mid_apply = 0;
    for round in 0..12u64 {
        let mut agent = rig.spawn();
        assert!(
            agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
            "round {round}: {}",
            agent.log_tail(20)
        );
        let text = if round % 2 == 0 { &new } else { &old };
        rig.send_json(json!({"command_id": format!("push-{round}"), "name": "apply-config", "args": {"config": text, "sha256": sha(text)}}));
        // Kill somewhere between the receipt and well after the apply.
        std::thread::sleep(Duration::from_millis(round * 17 % 120));
        agent.kill9();
        let kept = kept_push(&rig);
        assert!(
            kept.is_none() || kept.as_ref() == Some(&old) || kept.as_ref() == Some(&new),
            "round {round}: the kept push is neither old nor new: {kept:?}"
        );
        if kept.as_ref() != Some(text) {
            kills_mid_apply += 1;
        }
        assert_eq!(std::fs::read_to_string(&rig.cfg).expect("cfg"), local);
    }
    println!("config push kills: 12 rounds, {kills_mid_apply} killed before the new push was kept");
    // The agent still starts on whatever is there.
    let mut agent = rig.spawn_ready();
    agent.terminate(Duration::from_secs(15));
}

/// field case F15 (c): with the state directory's filesystem full, a pushed
/// config cannot be kept; it is rejected, nothing is applied, the agent runs.
#[test]
fn a_config_push_onto_a_full_disk_is_rejected_and_leaves_the_file_whole() {
    let rig = Rig::new("pushfull");
    let fs = crate::storage::SmallFs::mount(rig.dir.path(), "8m");
    let cfg = rig.dir.path().join("board-small.toml");
    let text = rig.config_text(30).replace(
        &format!("path = \"{}/spool.db\"", rig.dir.path().display()),
        &format!(
            "path = \"{}/spool.db\"\ntune_from_probe = false",
            fs.dir.display()
        ),
    );
    std::fs::write(&cfg, &text).expect("config");
    let mut agent = AgentProc::spawn(&cfg, &[], rig.dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
        "{}",
        agent.log_tail(20)
    );
    // Grow the WAL by what the commands below write (a command's receipt
    // and its result) many times over, then checkpoint, so that their
    // commits reuse its blocks once the disk is full. (Readings cannot grow
    // it: the 8 MB filesystem is under the free-space reserve, so they are
    // refused from the start.)
    for k in 0..12 {
        let id = format!("grow-{k}");
        rig.send_json(json!({"command_id": id, "name": "ping"}));
        rig.wait_result(&id, "result", &mut agent);
    }
    // The blocks are reused only after a checkpoint that copied the whole
    // WAL: one that a delivery read overlapped (busy, or fewer frames
    // checkpointed than logged) leaves the next commits appending to the
    // WAL's end, which the full disk then refuses (seen under qemu).
    let mut whole = false;
    for k in 0..20 {
        let id = format!("ck-{k}");
        rig.send_json(json!({"command_id": id, "name": "checkpoint"}));
        let r = rig.wait_result(&id, "result", &mut agent);
        let res = &r["result"];
        if res["busy"] == 0 && res["log_frames"] == res["checkpointed_frames"] {
            whole = true;
            break;
        }
    }
    assert!(whole, "no whole checkpoint in 20 tries");
    let mut n = 0;
    while std::fs::write(fs.dir.join(format!("filler-{n}")), vec![0u8; 4096]).is_ok() && n < 4096 {
        n += 1;
    }
    let push = "[spool]\npurge_batch_rows = 7\n";
    rig.send_json(json!({"command_id": "full-1", "name": "apply-config", "args": {"config": push, "sha256": sha(push)}}));
    let r = rig.wait_result("full-1", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "{r}");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("cannot write the config push"),
        "{r}"
    );
    assert!(!fs.dir.join("config-push.toml").exists());
    assert_eq!(std::fs::read_to_string(&cfg).expect("config"), text);
    rig.send_json(json!({"command_id": "full-ping", "name": "ping"}));
    assert_eq!(
        rig.wait_result("full-ping", "result", &mut agent)["state"],
        "completed"
    );
    agent.terminate(Duration::from_secs(15));
    drop(fs);
}

/// Drive a bulk publisher's event loop until `n` PUBACKs arrived or
/// [`PUMP_DEADLINE`] passed; returns the PUBACKs counted. A quiet gap is no
/// reason to stop (a slow machine has long ones): only the overall deadline,
/// a connection error (panics) or a closed event loop end it.
fn pump_pubacks(conn: &mut rumqttc::Connection, n: usize) -> usize {
    let deadline = Instant::now() + PUMP_DEADLINE;
    let mut acks = 0;
    while acks < n && Instant::now() < deadline {
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acks += 1,
            Ok(Ok(_)) | Err(rumqttc::RecvTimeoutError::Timeout) => {}
            Ok(Err(e)) => panic!("bulk publisher: {e}"),
            Err(rumqttc::RecvTimeoutError::Disconnected) => break,
        }
    }
    acks
}

/// How long a bulk publisher waits for all its PUBACKs, in all.
const PUMP_DEADLINE: Duration = Duration::from_secs(180);

/// Publish every payload at QoS 1 as fast as the broker takes them (100 in
/// flight) and return once every PUBACK arrived.
fn publish_all(port: u16, topic: &str, payloads: Vec<Vec<u8>>) {
    let n = payloads.len();
    let mut o = MqttOptions::new(
        format!("bulk-{}", crate::support::unique_suffix()),
        "127.0.0.1",
        port,
    );
    o.set_inflight(100);
    o.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = Client::new(o, 200);
    let pump = std::thread::spawn(move || pump_pubacks(&mut conn, n));
    for p in payloads {
        client
            .publish(topic, QoS::AtLeastOnce, false, p)
            .expect("queue publish");
    }
    assert_eq!(pump.join().expect("pump"), n, "not every PUBACK arrived");
    let _ = client.disconnect();
}

/// Result events so far, without parsing them (cheap enough to poll with
/// thousands received).
fn result_count(rig: &Rig) -> usize {
    rig.sub
        .deliveries()
        .iter()
        .filter(|d| d.topic.ends_with("/events/_commands"))
        .count()
}

/// `write_bytes` of `/proc/<pid>/io`: what the process made the kernel
/// write to storage; `None` where it cannot be read.
fn proc_write_bytes(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("write_bytes: "))
        .and_then(|v| v.trim().parse().ok())
}

/// Live bytes in the spool: pages in use times the page size.
fn live_bytes(db: &Path) -> i64 {
    let c = crate::support::spool::open(db);
    let q = |sql: &str| c.query_row(sql, [], |r| r.get::<_, i64>(0)).expect(sql);
    (q("PRAGMA page_count") - q("PRAGMA freelist_count")) * q("PRAGMA page_size")
}

/// Send a command and wait for its answer; returns it and how long it took.
fn round_trip(rig: &Rig, agent: &mut AgentProc, cmd: Value) -> (Value, Duration) {
    let id = cmd["command_id"].as_str().expect("command_id").to_owned();
    let t = Instant::now();
    rig.send_json(cmd);
    let r = rig.wait_result(&id, "result", agent);
    (r, t.elapsed())
}

#[test]
fn ping_status_checkpoint_and_flush_answer_while_a_30_s_exec_handler_runs() {
    let rig = Rig::with(
        "long-handler",
        Extra {
            handlers: r#"
[[commands.handlers]]
name = "sleep30"
program = "/bin/sh"
args = ["-c", "echo start >> {d}/slow; sleep 30; echo end >> {d}/slow"]
timeout_ms = 60000
"#,
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    rig.send_json(json!({"command_id": "long-1", "name": "sleep30"}));
    assert!(
        wait_for(Duration::from_secs(10), || lines(&rig.marker("slow")) == 1),
        "{}",
        agent.log_tail(20)
    );
    // Another exec handler waits for its lane: exec handlers run one at a time.
    rig.send_json(json!({"command_id": "queued-1", "name": "count"}));
    let mut worst = Duration::ZERO;
    for (i, name) in ["ping", "status", "checkpoint", "flush", "ping"]
        .iter()
        .enumerate()
    {
        let (r, took) = round_trip(
            &rig,
            &mut agent,
            json!({"command_id": format!("quick-{i}"), "name": name}),
        );
        assert_eq!(r["state"], "completed", "{r}");
        println!(
            "{name} answered in {} ms while sleep30 ran",
            took.as_millis()
        );
        worst = worst.max(took);
    }
    assert!(
        worst < Duration::from_secs(5),
        "a built-in waited {worst:?} behind the exec handler"
    );
    assert_eq!(
        lines(&rig.marker("slow")),
        1,
        "the handler is still running"
    );
    assert!(
        !rig.results()
            .iter()
            .any(|r| r["command_id"] == "long-1" && r["reply"] == "result"),
        "the long handler has not finished yet"
    );
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        0,
        "a second exec handler ran beside the first"
    );
    agent.terminate(Duration::from_secs(15));
}

/// 10,000 distinct junk commands, published as fast as the broker takes
/// them: malformed, non-UTF-8, unknown names over 400 scopes, bad handler
/// arguments (queued for the exec lane), a flood in one scope (rate limit)
/// and 60 KB bodies. Answers at receipt stay within
/// `commands.max_answers_per_minute` (600: the rest are acknowledged,
/// dropped and counted), the spool within its cap, the records within
/// theirs, and `ping` still answers.
#[test]
fn ten_thousand_junk_commands_leave_the_spool_within_its_caps_and_ping_answering() {
    let rig = Rig::with(
        "junk",
        Extra {
            spool: "max_bytes = 16777216",
            commands: "max_records = 1000\nmax_queued = 20",
            // Queue everything for the agent: the test counts on every junk
            // command reaching it (mosquitto drops beyond 1000 by default).
            broker: "max_queued_messages 20000\n",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    let big = "y".repeat(60_000);
    let payloads: Vec<Vec<u8>> = (0..10_000)
        .map(|i| {
            if i % 97 == 0 {
                return json!({"command_id": format!("big-{i}"), "scope": format!("b{i}"), "name": "junk", "args": {"x": big}}).to_string().into_bytes();
            }
            match i % 5 {
                0 => format!("{{\"command_id\":\"j-{i}\",\"name\":").into_bytes(),
                1 => json!({"command_id": format!("j-{i}"), "scope": format!("s{}", i % 400), "name": "no-such"}).to_string().into_bytes(),
                2 => json!({"command_id": format!("j-{i}"), "scope": format!("e{}", i % 400), "name": "echo", "args": {"word": "a b"}}).to_string().into_bytes(),
                3 => json!({"command_id": format!("j-{i}"), "scope": "flood", "name": "no-such"}).to_string().into_bytes(),
                _ => vec![0xff, 0xfe, (i % 251) as u8, (i / 251) as u8],
            }
        })
        .collect();
    let db = rig.db();
    let written = |agent: &AgentProc| proc_write_bytes(agent.pid());
    let before = written(&agent);
    let t = Instant::now();
    publish_all(
        rig.broker.port(),
        &format!("{}/commands", rig.prefix),
        payloads,
    );
    let published = t.elapsed();
    // Every message answered, or dropped unanswered and counted (the count
    // reaches the spool within 10 s).
    let settled = || result_count(&rig) as i64 + counter(&db, "commands_unanswered");
    let all = wait_for(Duration::from_secs(180), || {
        std::thread::sleep(Duration::from_millis(950));
        settled() >= 10_000
    });
    let answered = t.elapsed();
    assert!(
        all,
        "only {} of 10,000 junk commands answered or counted unanswered\n{}",
        settled(),
        agent.log_tail(30)
    );
    let (answers, unanswered) = (result_count(&rig), counter(&db, "commands_unanswered"));
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for r in rig.results() {
        *kinds
            .entry(format!("{}/{}", r["reply"], r["state"]))
            .or_default() += 1;
    }
    let flood_bytes = written(&agent).zip(before).map(|(b, a)| b - a);
    println!(
        "{answers} answers {kinds:?}, {unanswered} dropped unanswered in {answered:?}; \
         the agent wrote {flood_bytes:?} bytes meanwhile"
    );
    // Each message answered or counted at least once (a message the broker
    // delivered again after a reconnect is counted again).
    assert!(answers as i64 + unanswered >= 10_000);
    // Answers at receipt: a burst of commands.max_answers_per_minute (600),
    // then 10 a second; and the commands accepted to run (here echo with
    // arguments its handler then rejects) spend commands.max_per_minute
    // instead: another 600, then 10 a second.
    let per_budget = 600 + 10 * answered.as_secs() as usize + 10;
    assert!(
        answers <= 2 * per_budget,
        "{answers} answers at receipt in {answered:?}: over commands.max_answers_per_minute \
         and commands.max_per_minute together ({kinds:?})"
    );
    assert!(unanswered > 0, "the flood was never over the answer budget");
    assert!(agent.log_text().contains("commands.max_answers_per_minute"));
    let (ping, latency) = round_trip(
        &rig,
        &mut agent,
        json!({"command_id": "after-junk", "name": "ping"}),
    );
    assert_eq!(ping["state"], "completed");
    assert!(agent.is_running());
    let (records, longest, file) = {
        let c = crate::support::spool::open(&db);
        let records: i64 = c
            .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
            .expect("records");
        let longest: i64 = c
            .query_row(
                "SELECT coalesce(max(length(request)), 0) FROM commands
                 WHERE state NOT IN ('received', 'running')",
                [],
                |r| r.get(0),
            )
            .expect("longest request");
        (records, longest, std::fs::metadata(&db).expect("db").len())
    };
    let live = live_bytes(&db);
    println!(
        "10,000 junk commands: published in {} ms, all answered after {} s; ping then took {} ms; \
         {records} command records (cap 1000), longest kept request {longest} chars; \
         spool file {file} bytes, live {live} bytes (cap 16777216); \
         malformed {}, rejected {}, rate_limited {}, held_back {}",
        published.as_millis(),
        answered.as_secs(),
        latency.as_millis(),
        counter(&db, "commands_malformed"),
        counter(&db, "commands_rejected"),
        counter(&db, "commands_rate_limited"),
        counter(&db, "commands_held_back"),
    );
    assert!(
        records <= 1000,
        "{records} records over commands.max_records"
    );
    assert!(
        longest <= 256,
        "a finished record kept {longest} characters of request"
    );
    assert!(
        live <= 16 * 1024 * 1024,
        "{live} live bytes over spool.max_bytes"
    );
    assert!(counter(&db, "commands_rate_limited") > 0);
    let malformed = (0..10_000)
        .filter(|i| i % 97 != 0 && (i % 5 == 0 || i % 5 == 4))
        .count() as i64;
    let counted = counter(&db, "commands_malformed");
    assert!(
        counted > 0 && counted <= malformed,
        "{counted} malformed answered of {malformed}"
    );
    assert!(latency < Duration::from_secs(5), "ping took {latency:?}");
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn an_empty_retained_message_clears_a_retained_command_without_a_result_or_a_warning() {
    let rig = Rig::new("retained-clear");
    rig.send(
        json!({"command_id": "rc-1", "name": "count"})
            .to_string()
            .as_bytes(),
        true,
    );
    let mut agent = rig.spawn_ready();
    rig.wait_result("rc-1", "result", &mut agent);
    let answers = result_count(&rig);
    // Clear it the MQTT way while the agent is subscribed: the broker
    // forwards the empty message (with the retain flag cleared).
    rig.send(b"", true);
    assert!(
        agent.wait_log(
            Duration::from_secs(10),
            "a retained command was cleared; ignored"
        ),
        "{}",
        agent.log_tail(20)
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(result_count(&rig), answers, "the clear was answered");
    agent.terminate(Duration::from_secs(15));
    // No retained command left: a restart neither runs nor answers anything.
    let mut agent = rig.spawn_ready();
    std::thread::sleep(Duration::from_secs(2));
    agent.terminate(Duration::from_secs(15));
    assert_eq!(result_count(&rig), answers);
    assert_eq!(lines(&rig.marker("counter-fast")), 1);
    let warnings: Vec<String> = std::fs::read_dir(rig.dir.path())
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("agent-"))
        .flat_map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("WARN") && l.contains("command"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(counter(&rig.db(), "commands_retained_cleared"), 1);
    assert_eq!(counter(&rig.db(), "commands_malformed"), 0);
}

/// Boards without an RTC boot in 1970 and NTP steps their clock forward
/// and back: records are purged on the agent's monotonic clock, so one
/// execution per (scope, command_id) holds across clock steps (forward 30
/// days, back to 1970, forward ten years), restarts and a broker restart.
#[test]
fn one_run_per_command_across_clock_steps_restarts_and_a_broker_restart() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let mut rig = Rig::with(
        "clock-steps",
        Extra {
            commands: "max_per_minute_per_scope = 60000",
            ..Extra::default()
        },
    );
    let clock = FakeClock::new(rig.dir.path().join("faketime"), "+0");
    let env = clock.env();
    let spawn = |rig: &Rig| {
        let agent = AgentProc::spawn_with_env(&rig.cfg, &[], rig.dir.path(), &env);
        assert!(
            agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
            "{}",
            agent.log_tail(20)
        );
        agent
    };
    let answers = |rig: &Rig, id: &str, reply: &str| {
        rig.results()
            .iter()
            .filter(|r| r["command_id"] == id && r["reply"] == reply)
            .count()
    };
    // Send `id` and wait for one more `reply` to it.
    let ask = |rig: &Rig, agent: &mut AgentProc, id: &str, reply: &str| {
        let before = answers(rig, id, reply);
        rig.send_json(json!({"command_id": id, "name": "count"}));
        assert!(
            wait_for(Duration::from_secs(30), || answers(rig, id, reply) > before),
            "no new {reply} for {id}\n{}",
            agent.log_tail(30)
        );
    };
    let wall_of_ping = |rig: &Rig, agent: &mut AgentProc, id: &str| -> i64 {
        let (r, _) = round_trip(rig, agent, json!({"command_id": id, "name": "ping"}));
        r["result"]["ts_ms"].as_i64().expect("ts_ms")
    };
    let real_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64
    };
    let day_ms = 86_400_000;

    // Records beyond the newest 100 are the ones a purge may take: bury the
    // commands under 150 newer ones each.
    let bury = |rig: &Rig, agent: &mut AgentProc, tag: &str| {
        for i in 0..150 {
            rig.send_json(json!({"command_id": format!("{tag}-{i}"), "name": "ping"}));
        }
        rig.wait_result(&format!("{tag}-149"), "result", agent);
    };
    let mut agent = spawn(&rig);
    ask(&rig, &mut agent, "c-1", "result");
    bury(&rig, &mut agent, "after-c-1");
    // Forward 30 days, past the 7-day record retention on a wall clock.
    clock.step("+30d");
    assert!(wall_of_ping(&rig, &mut agent, "t-1") > real_ms() + 29 * day_ms);
    ask(&rig, &mut agent, "c-1", "duplicate");
    agent.terminate(Duration::from_secs(15));
    let mut agent = spawn(&rig); // purges at start, with the clock 30 days ahead
    ask(&rig, &mut agent, "c-1", "duplicate");
    // Back to 1970, as after a reboot without an RTC.
    let secs = real_ms() / 1000 - 10 * 86_400;
    clock.step(&format!("-{secs}"));
    assert!(wall_of_ping(&rig, &mut agent, "t-2") < 30 * day_ms);
    ask(&rig, &mut agent, "c-2", "result");
    bury(&rig, &mut agent, "after-c-2");
    ask(&rig, &mut agent, "c-1", "duplicate");
    agent.terminate(Duration::from_secs(15));
    let mut agent = spawn(&rig);
    ask(&rig, &mut agent, "c-1", "duplicate");
    ask(&rig, &mut agent, "c-2", "duplicate");
    // Forward ten years while running: the 1970 receipts look 56 years old.
    clock.step("+3650d");
    assert!(wall_of_ping(&rig, &mut agent, "t-3") > real_ms() + 3000 * day_ms);
    ask(&rig, &mut agent, "c-2", "duplicate");
    agent.terminate(Duration::from_secs(15));
    let mut agent = spawn(&rig);
    ask(&rig, &mut agent, "c-1", "duplicate");
    ask(&rig, &mut agent, "c-2", "duplicate");
    // The broker restarts without persistence: a fresh session.
    rig.broker.kill();
    rig.broker.restart();
    assert!(rig.sub.wait_subscribed(Duration::from_secs(15)));
    assert!(
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .matches("subscribed to commands")
            .count()
            >= 2),
        "{}",
        agent.log_tail(20)
    );
    ask(&rig, &mut agent, "c-1", "duplicate");
    ask(&rig, &mut agent, "c-2", "duplicate");
    // And back to the real time.
    clock.step("+0");
    ask(&rig, &mut agent, "c-1", "duplicate");
    agent.terminate(Duration::from_secs(15));
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        2,
        "a command ran more than once across the clock steps"
    );
    assert_eq!(answers(&rig, "c-1", "result"), 1);
    assert_eq!(answers(&rig, "c-2", "result"), 1);
    let records: i64 = crate::support::spool::open(&rig.db())
        .query_row(
            "SELECT count(*) FROM commands WHERE command_id IN ('c-1', 'c-2')",
            [],
            |r| r.get(0),
        )
        .expect("records");
    assert_eq!(records, 2, "a record was purged");
}

/// A command over the incoming packet limit drops the connection once; it
/// is then taken on a one-off connection with a larger limit and rejected.
/// One larger than any limit is dropped with the broker session. Neither
/// leaves the board deaf.
#[test]
fn oversized_commands_are_rejected_or_dropped_without_leaving_the_board_deaf() {
    let rig = Rig::new("oversize").v311();
    let mut agent = rig.spawn_ready();
    let topic = format!("{}/commands", rig.prefix);
    let over = json!({"command_id": "o-1", "name": "ping", "args": {"x": "y".repeat(100_000)}});
    publish_all(
        rig.broker.port(),
        &topic,
        vec![over.to_string().into_bytes()],
    );
    let r = rig.wait_result("", "result", &mut agent);
    assert_eq!(r["state"], "rejected");
    assert!(
        r["result"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("exceeds commands.max_payload_bytes"),
        "{r}"
    );
    assert!(agent.log_text().contains("taking it on one connection"));
    let (p, _) = round_trip(
        &rig,
        &mut agent,
        json!({"command_id": "o-ping-1", "name": "ping"}),
    );
    assert_eq!(p["state"], "completed");
    // Larger than anything the agent takes (4 MB): dropped with the session.
    let mut o = MqttOptions::new(
        format!("huge-{}", crate::support::unique_suffix()),
        "127.0.0.1",
        rig.broker.port(),
    );
    o.set_max_packet_size(8 << 20, 8 << 20);
    let (client, mut conn) = Client::new(o, 10);
    client
        .publish(&topic, QoS::AtLeastOnce, false, vec![b'x'; 4 << 20])
        .expect("queue publish");
    let acked = wait_for(Duration::from_secs(20), || {
        matches!(
            conn.recv_timeout(Duration::from_millis(200)),
            Ok(Ok(Event::Incoming(Incoming::PubAck(_))))
        )
    });
    assert!(acked);
    let _ = client.disconnect();
    // Subscribed again after the discarded session (a command published in
    // between has no session to wait in at the broker).
    assert!(
        wait_for(Duration::from_secs(20), || {
            let log = agent.log_text();
            log.split("discarding the broker session once")
                .nth(1)
                .is_some_and(|after| after.contains("subscribed to commands"))
        }),
        "{}",
        agent.log_tail(20)
    );
    let (p, _) = round_trip(
        &rig,
        &mut agent,
        json!({"command_id": "o-ping-2", "name": "ping"}),
    );
    assert_eq!(p["state"], "completed");
    agent.terminate(Duration::from_secs(15));
}

/// More held-back commands than the inbox keeps in memory (4 MiB): the
/// ones not kept stay unacknowledged at the broker and are redelivered
/// after the agent reconnects; every command is answered once.
#[test]
fn commands_held_back_beyond_the_inbox_are_redelivered_after_a_reconnect() {
    let rig = Rig::with(
        "inbox",
        Extra {
            commands: "max_queued = 1\nmax_per_minute_per_scope = 1000",
            ..Extra::default()
        },
    );
    let mut agent = rig.spawn_ready();
    // Keep the exec lane busy for 3 s, with one more waiting.
    rig.send_json(json!({"command_id": "busy-1", "name": "count-slow"}));
    rig.send_json(json!({"command_id": "busy-2", "name": "count-slow"}));
    assert!(wait_for(Duration::from_secs(10), || lines(
        &rig.marker("counter")
    ) == 1));
    // 100 commands of 60 KB for the same lane: 6 MB, more than the inbox.
    let pad = "p".repeat(60_000);
    let payloads: Vec<Vec<u8>> = (0..100)
        .map(|i| {
            json!({"command_id": format!("big-{i}"), "name": "echo", "args": {"word": "w", "pad": pad}})
                .to_string()
                .into_bytes()
        })
        .collect();
    publish_all(
        rig.broker.port(),
        &format!("{}/commands", rig.prefix),
        payloads,
    );
    let answered = |rig: &Rig| {
        let rs = rig.results();
        (0..100)
            .map(|i| {
                rs.iter()
                    .filter(|r| r["command_id"] == format!("big-{i}") && r["reply"] == "result")
                    .count()
            })
            .collect::<Vec<_>>()
    };
    assert!(
        wait_for(Duration::from_secs(60), || answered(&rig)
            .iter()
            .all(|&n| n >= 1)),
        "{:?}\n{}",
        answered(&rig),
        agent.log_tail(30)
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        answered(&rig).iter().all(|&n| n == 1),
        "{:?}",
        answered(&rig)
    );
    let log = agent.log_text();
    assert!(
        log.contains("the command inbox is full") || log.contains("not kept"),
        "{log}"
    );
    assert!(
        log.contains("reconnecting so the broker redelivers the ones not kept"),
        "{}",
        agent.log_tail(30)
    );
    let r = rig.wait_result("big-7", "result", &mut agent);
    assert_eq!(r["state"], "rejected", "unknown argument `pad`: {r}");
    assert_eq!(lines(&rig.marker("counter")), 2);
    agent.terminate(Duration::from_secs(15));
    println!(
        "held back: {} (parked or not kept)",
        counter(&rig.db(), "commands_held_back")
    );
}

/// MQTT 5 session expiry (`mqtt.session_expiry_secs`, 7 days by default): a
/// command sent while the agent is stopped waits in its session at the
/// broker and runs after the restart. The control: with a session expiry
/// of 0 the broker ends the session at the disconnect (MQTT 5
/// §3.1.2.11.2), and a command sent meanwhile never arrives.
#[test]
fn a_command_sent_while_the_agent_is_down_waits_in_its_session_under_mqtt_5() {
    let rig = Rig::new("offline-cmd");
    for (expiry, id, kept) in [("604800", "off-kept", true), ("0", "off-lost", false)] {
        let sets = vec![format!("mqtt.session_expiry_secs={expiry}")];
        let ready = |agent: &AgentProc| {
            assert!(
                agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
                "{}",
                agent.log_tail(20)
            );
        };
        let mut agent = AgentProc::spawn(&rig.cfg, &sets, rig.dir.path());
        ready(&agent);
        agent.terminate(Duration::from_secs(15));
        rig.send_json(json!({"command_id": id, "name": "ping"}));
        let mut agent = AgentProc::spawn(&rig.cfg, &sets, rig.dir.path());
        ready(&agent);
        if kept {
            let r = rig.wait_result(id, "result", &mut agent);
            assert_eq!(r["state"], "completed");
        } else {
            std::thread::sleep(Duration::from_secs(5));
            assert!(
                rig.results().iter().all(|r| r["command_id"] != id),
                "a command survived a session that expired at the disconnect"
            );
        }
        agent.terminate(Duration::from_secs(15));
    }
}

/// Under MQTT 5 the agent announces its incoming limit in CONNECT (Maximum
/// Packet Size, §3.1.2.11.4), and the broker discards a larger command
/// for it instead of sending it: no result comes back for it, the
/// connection is never dropped, and the next command is answered.
#[test]
fn an_oversized_command_under_mqtt_5_is_discarded_by_the_broker_and_the_board_keeps_answering() {
    let rig = Rig::new("oversize5");
    let mut agent = rig.spawn_ready();
    let over = json!({"command_id": "o5-1", "name": "ping", "args": {"x": "y".repeat(100_000)}});
    rig.send(over.to_string().as_bytes(), false);
    let (p, _) = round_trip(
        &rig,
        &mut agent,
        json!({"command_id": "o5-ping", "name": "ping"}),
    );
    assert_eq!(p["state"], "completed");
    assert!(rig.results().iter().all(|r| r["command_id"] != "o5-1"));
    assert_eq!(
        agent.log_text().matches("mqtt: connected to").count(),
        1,
        "{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}

/// Live processes that belong to a run: descendants of `agent` (by the
/// parent chain), processes in session `sid`, and processes whose command
/// line contains `text`; never this test process or the agent itself.
fn processes_of(agent: u32, sid: u32, text: &str) -> Vec<(u32, String)> {
    // pid -> (ppid, session, zombie, description)
    let mut table = std::collections::HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        // Fields after "(comm)": state ppid pgrp session ...
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = after.split_whitespace().collect();
        let num = |i: usize| {
            fields
                .get(i)
                .and_then(|s| s.parse::<u32>().ok())
                .unwrap_or(0)
        };
        let zombie = fields.first().is_none_or(|s| *s == "Z" || *s == "X");
        table.insert(pid, (num(1), num(3), zombie, cmdline.trim().to_owned()));
    }
    let descends = |mut pid: u32| {
        for _ in 0..64 {
            match table.get(&pid) {
                Some((ppid, ..)) if *ppid == agent => return true,
                Some((ppid, ..)) if *ppid > 1 => pid = *ppid,
                _ => return false,
            }
        }
        false
    };
    let mut found: Vec<(u32, String)> = table
        .iter()
        .filter(|(pid, (_, session, zombie, cmdline))| {
            **pid != std::process::id()
                && **pid != agent
                && !zombie
                && (descends(**pid) || *session == sid || cmdline.contains(text))
        })
        .map(|(pid, (.., cmdline))| (*pid, cmdline.clone()))
        .collect();
    found.sort();
    found
}

/// Finding 12: a handler helper that calls `setsid` left the process group
/// the runner killed at the timeout and lived on. Now the run's whole tree
/// dies at the timeout: the shell, the helper in its own session and its
/// `sleep`; no process of the run is left in /proc and no marker is ever
/// written. A process of the test's own (not the run's) lives on, and so
/// does the broker.
#[test]
fn a_setsid_helper_of_a_timed_out_handler_dies_with_it() {
    let rig = Rig::with(
        "setsid",
        Extra {
            handlers: r#"[[commands.handlers]]
name = "escape"
program = "/bin/sh"
args = ["-c", "echo $$ > {d}/top.pid; setsid sh -c 'echo $$ > {d}/helper.pid; sleep 60; touch {d}/MARKER' & setsid sh -c 'sleep 2; touch {d}/MARKER-SOON' & sleep 60"]
timeout_ms = 1000
"#,
            ..Extra::default()
        },
    );
    let mut bystander = std::process::Command::new("/bin/sleep")
        .arg("60")
        .spawn()
        .expect("spawn a bystander");
    let mut agent = rig.spawn_ready();
    let started = Instant::now();
    rig.send_json(json!({"command_id": "esc-1", "name": "escape"}));
    let r = rig.wait_result("esc-1", "result", &mut agent);
    println!("result after {:?}: {r}", started.elapsed());
    assert_eq!(r["state"], "failed", "{r}");
    let error = r["result"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("timed out after 1s"), "{r}");

    let pid_of = |name: &str| {
        std::fs::read_to_string(rig.marker(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .trim()
            .parse::<u32>()
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let (top, helper) = (pid_of("top.pid"), pid_of("helper.pid"));
    let text = format!("{}/MARKER", rig.dir.path().display());
    let agent_pid = agent.pid();
    // The result is published once the run is over: a little grace only
    // for /proc to catch up.
    wait_for(Duration::from_secs(2), || {
        processes_of(agent_pid, helper, &text).is_empty()
    });
    let left = processes_of(agent_pid, helper, &text);
    println!("processes of the run left: {left:?}");
    for (pid, _) in &left {
        // Do not leave them behind for the other tests.
        // SAFETY: kill(2) with SIGKILL on a pid just read from /proc.
        unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
    }
    assert!(
        left.is_empty(),
        "processes of the run left after the timeout: {left:?}"
    );
    for pid in [top, helper] {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            stat.is_empty() || stat.contains(") Z"),
            "{pid} is alive: {stat}"
        );
    }
    std::thread::sleep(Duration::from_secs(3));
    assert!(!rig.marker("MARKER-SOON").exists(), "a helper ran on");
    assert!(!rig.marker("MARKER").exists(), "a helper ran on");

    assert!(
        matches!(bystander.try_wait(), Ok(None)),
        "a process outside the run was killed"
    );
    let _ = bystander.kill();
    let _ = bystander.wait();
    // The broker (the test's child, not the agent's) still answers.
    rig.send_json(json!({"command_id": "ping-after", "name": "ping"}));
    let r = rig.wait_result("ping-after", "result", &mut agent);
    assert_eq!(r["state"], "completed", "{r}");
    agent.terminate(Duration::from_secs(15));
}

/// Finding 12: programs inherited every descriptor the agent was started
/// with that was not close-on-exec. The test starts the agent with a file
/// on descriptor 7; neither a handler's program nor an exec source's sees
/// it (nor any descriptor above 2 but the one `ls` opens itself).
#[test]
fn a_descriptor_the_agent_was_started_with_reaches_no_handler_and_no_source() {
    let rig = Rig::with(
        "fds",
        Extra {
            handlers: r#"[[commands.handlers]]
name = "fds"
program = "/bin/ls"
args = ["-l", "/proc/self/fd"]
[[sources]]
name = "fdprobe"
kind = "exec"
program = "/bin/sh"
args = ["-c", "ls -l /proc/self/fd > {d}/source-fds.tmp && mv {d}/source-fds.tmp {d}/source-fds; echo 1"]
interval_ms = 200
"#,
            ..Extra::default()
        },
    );
    let inherited = rig.marker("inherited-by-the-agent");
    let file = std::fs::File::create(&inherited).expect("create the file for fd 7");
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    let mut agent = AgentProc::spawn_customized(&rig.cfg, &[], rig.dir.path(), &[], |cmd| {
        // SAFETY: dup2 and fcntl are async-signal-safe and touch only the
        // child's descriptor table.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(cmd, move || {
                if fd == 7 {
                    if libc::fcntl(7, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 7) != 7 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    drop(file);
    assert!(
        agent.wait_log(Duration::from_secs(20), "subscribed to commands"),
        "{}",
        agent.log_tail(20)
    );
    // The agent really holds it (else this test would prove nothing).
    let held = std::fs::read_link(format!("/proc/{}/fd/7", agent.pid())).expect("agent fd 7");
    assert_eq!(held, inherited, "the agent's fd 7");

    rig.send_json(json!({"command_id": "fds-1", "name": "fds"}));
    let r = rig.wait_result("fds-1", "result", &mut agent);
    let listing = r["result"]["stdout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    println!("the handler's descriptors:\n{listing}");
    let source_fds = rig.marker("source-fds");
    assert!(
        wait_for(Duration::from_secs(20), || source_fds.exists()),
        "{}",
        agent.log_tail(20)
    );
    let source_listing = std::fs::read_to_string(&source_fds).expect("source listing");
    println!("the source's descriptors:\n{source_listing}");
    agent.terminate(Duration::from_secs(15));

    assert_eq!(r["state"], "completed", "{r}");
    for (who, text) in [("handler", &listing), ("source", &source_listing)] {
        let inherited = inherited.display().to_string();
        assert!(!text.contains(&inherited), "the {who} got fd 7:\n{text}");
        let fds: Vec<u32> = text
            .lines()
            .filter_map(|l| l.split_once(" -> ")?.0.rsplit(' ').next()?.parse().ok())
            .collect();
        // 0-2, and 3: the directory `ls` itself opened to list.
        assert_eq!(fds, [0, 1, 2, 3], "the {who}'s descriptors:\n{text}");
    }
}
