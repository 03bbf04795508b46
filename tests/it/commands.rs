//! Commands over MQTT: at most once (F13, F14), rejections, config push
//! (F15, F16). Side effects are counted from marker files written by `exec`
//! handlers declared in the test's board config.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
}

impl Rig {
    fn new(test: &str) -> Rig {
        let broker = Broker::start();
        let proxy = Proxy::start(broker.port());
        let dir = tempfile::tempdir().expect("tempdir");
        let prefix = crate::prefix(test);
        let sub = Subscriber::start(broker.port(), &format!("{prefix}/events/#"));
        let cfg = dir.path().join("board.toml");
        let rig = Rig {
            broker,
            proxy,
            dir,
            cfg,
            prefix,
            sub,
            client_id: format!("cmd-board-{}", crate::support::unique_suffix()),
        };
        std::fs::write(&rig.cfg, rig.config_text(30)).expect("write config");
        rig
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
"#,
            url = self.proxy.url(),
            prefix = self.prefix,
            client_id = self.client_id,
        )
    }

    fn spawn(&self) -> AgentProc {
        AgentProc::spawn(&self.cfg, &[], self.dir.path())
    }

    /// Spawn the agent and wait until it has subscribed to the command topic.
    fn spawn_ready(&self) -> AgentProc {
        let agent = self.spawn();
        assert!(
            wait_for(Duration::from_secs(20), || agent
                .log_text()
                .contains("subscribed to commands")),
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
    let deadline = Instant::now() + Duration::from_secs(10);
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
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .contains("duplicate delivery (retained)")),
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
    let rig = Rig::new("malformed");
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
    assert!(
        wait_for(Duration::from_secs(20), || rig
            .results()
            .iter()
            .filter(|r| r["state"] == "rejected")
            .count()
            >= 5),
        "{:?}",
        rig.results()
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
        "../../etc/passwd".to_owned(),
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
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .contains("subscribed to commands")),
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
    let pump = std::thread::spawn(move || {
        let mut acks = 0;
        while acks < 1000 {
            match conn.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acks += 1,
                Ok(Ok(_)) => {}
                _ => break,
            }
        }
        acks
    });
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
    rig.wait_result("k-1", "result", &mut agent);
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
    println!("1000 deliveries sent: {delivered}; duplicates answered from the store: {dups}; executions: {}", lines(&rig.marker("counter-fast")));
    assert_eq!(
        lines(&rig.marker("counter-fast")),
        1,
        "executed more than once"
    );
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
    assert!(wait_for(Duration::from_secs(15), || agent
        .log_text()
        .contains("config push confirmed")));
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
        .replace(&rig.proxy.url(), "mqtt://127.0.0.1:9");
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
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .contains("config push reverted")),
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
        let log = agent.log_text();
        assert!(log.contains("config invalid: "), "{log}");
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
        wait_for(Duration::from_secs(10), || agent
            .log_text()
            .contains("config reloaded")),
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
            wait_for(Duration::from_secs(20), || agent
                .log_text()
                .contains("subscribed to commands")),
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
        wait_for(Duration::from_secs(20), || agent
            .log_text()
            .contains("subscribed to commands")),
        "{}",
        agent.log_tail(20)
    );
    // Let the WAL grow, then checkpoint so later commits reuse its blocks.
    std::thread::sleep(Duration::from_secs(3));
    rig.send_json(json!({"command_id": "ck", "name": "checkpoint"}));
    rig.wait_result("ck", "result", &mut agent);
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
