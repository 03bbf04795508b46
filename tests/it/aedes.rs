//! A second broker implementation: aedes 1.2 (Node.js, in memory), installed
//! from the npm registry by `cross/setup-debian.sh` into
//! `tests/fixtures/aedes/node_modules`. It refuses things differently from
//! mosquitto: it closes the connection on a denied SUBSCRIBE, and answers a
//! keep-alive above its limit with CONNACK code 6, which MQTT 3.1.1 does not
//! define (§3.2.2.3 stops at 5). It does not speak MQTT 5: the tests pin
//! `mqtt.protocol = "3.1.1"`, except the one that checks the refusal of 5.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::Board;
use crate::support::spool::count_in_state;
use crate::support::subscriber::Subscriber;
use crate::support::{free_port, wait_for};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An aedes broker on a free loopback port, killed on drop. What it prints
/// (denials, connection errors) is kept for the assertions.
struct Aedes {
    child: Child,
    port: u16,
    output: Arc<Mutex<String>>,
}

impl Aedes {
    fn start(options: &[&str]) -> Aedes {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/aedes");
        assert!(
            dir.join("node_modules/aedes").is_dir(),
            "aedes is not installed in {}: run cross/setup-debian.sh (npm ci there)",
            dir.display()
        );
        let port = free_port();
        let mut child = Command::new("node")
            .arg(dir.join("server.js"))
            .arg(port.to_string())
            .args(options)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start node (install nodejs: cross/setup-debian.sh)");
        let output = Arc::new(Mutex::new(String::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let shared = output.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut o = shared.lock().unwrap_or_else(|p| p.into_inner());
                o.push_str(&line);
                o.push('\n');
            }
        });
        let aedes = Aedes {
            child,
            port,
            output,
        };
        assert!(
            wait_for(Duration::from_secs(30), || aedes
                .output()
                .contains("listening")),
            "aedes did not start: {}",
            aedes.output()
        );
        aedes
    }

    fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    fn output(&self) -> String {
        self.output
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Aedes {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn status(db: &Path) -> String {
    run_cli(&["status", "--spool", db.to_str().expect("utf-8")]).1
}

/// Delivery works against a broker that is not mosquitto, and aedes'
/// answer to a denied command subscription (closing the connection) does
/// not stop telemetry: the agent connects without the subscription and says
/// `commands unavailable`.
#[test]
fn aedes_closing_on_the_command_subscription_does_not_stop_telemetry() {
    let prefix = crate::prefix("aedes-deny");
    let aedes = Aedes::start(&[&format!("deny-subscribe={prefix}/commands")]);
    let sub = Subscriber::events(aedes.port, &prefix);
    let Board { dir, cfg, db } = Board::new(&aedes.url(), &prefix, 200).v311();
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 10),
        "telemetry did not flow through aedes: {} delivered\n{}\n{}",
        sub.count(),
        aedes.output(),
        agent.log_tail(30)
    );
    assert!(
        aedes.output().contains("denied subscribe"),
        "{}",
        aedes.output()
    );
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = status(&db);
            s.contains("health: degraded") && s.contains("commands unavailable")
        }),
        "{}",
        status(&db)
    );
    assert!(count_in_state(&db, "ACKED") > 0);
    agent.terminate(Duration::from_secs(15));
}

/// A keep-alive above aedes' `keepaliveLimit` is refused with CONNACK 6:
/// the agent logs it at ERROR naming the keep-alive, health degrades with
/// the cause, nothing is retired; with a keep-alive within the limit the
/// same rows are delivered.
#[test]
fn aedes_refusing_the_keep_alive_is_named_and_nothing_is_retired() {
    // Health names a cause after max(2 x keep-alive, 30 s): 40 s here.
    let aedes = Aedes::start(&["keepalive-limit=10"]);
    let prefix = crate::prefix("aedes-ka");
    let Board { dir, cfg, db } = Board::new(&aedes.url(), &prefix, 200).v311();
    let sets = ["mqtt.keep_alive_secs=20".to_owned()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || {
            let log = agent.log_text();
            log.contains("ERROR") && log.contains("keep-alive")
        }),
        "the refusal was not named at ERROR\n{}\n{}",
        aedes.output(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(120), || {
            let s = status(&db);
            s.contains("health: degraded") && s.contains("keep-alive")
        }),
        "{}",
        status(&db)
    );
    assert_eq!(count_in_state(&db, "ACKED"), 0, "{}", status(&db));
    agent.terminate(Duration::from_secs(15));

    let sub = Subscriber::events(aedes.port, &prefix);
    let sets = ["mqtt.keep_alive_secs=10".to_owned()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 10),
        "rows did not flow with a keep-alive within the limit\n{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
}

/// aedes 1.2 does not speak MQTT 5, the default: it closes the connection
/// on the level-5 CONNECT without a CONNACK (it logs "unacceptable protocol
/// version"), and the agent says so at ERROR naming `mqtt.protocol`, with
/// health degraded by that cause and nothing retired.
#[test]
fn a_broker_without_mqtt_5_is_named_with_the_setting_to_change() {
    let aedes = Aedes::start(&[]);
    let prefix = crate::prefix("aedes-v5");
    let Board { dir, cfg, db } = Board::new(&aedes.url(), &prefix, 200);
    let sets = ["mqtt.keep_alive_secs=10".to_owned()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    let named = "without answering the MQTT 5 CONNECT: a broker that does not speak MQTT 5 does this; if so, set mqtt.protocol = \"3.1.1\"";
    assert!(
        wait_for(Duration::from_secs(60), || agent
            .log_text()
            .lines()
            .any(|l| l.contains(" ERROR ") && l.contains(named))),
        "the refusal was not named at ERROR\n{}\n{}",
        aedes.output(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(90), || {
            let s = status(&db);
            s.contains("health: degraded") && s.contains("mqtt.protocol")
        }),
        "{}",
        status(&db)
    );
    assert_eq!(count_in_state(&db, "ACKED"), 0, "{}", status(&db));
    agent.terminate(Duration::from_secs(15));
}
