//! `device_id = "@machine-id"` (the shipped config) and `"@hostname"`: two
//! boards installed with the same package and config are two boards, each
//! with an id that survives restarts; the id and where it came from are in
//! the first log line, `status` and the retained status topic; the raw
//! machine id is never published; a missing or damaged machine id is an
//! error naming the file and the fix. Through the real binary.

use crate::support::agent::{run_cli, run_cli_with, AgentProc, CLI_TIMEOUT};
use crate::support::broker::Broker;
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MACHINE_ID_ENV: &str = "EDGESPOOL_MACHINE_ID_FILE";
/// Two boards' /etc/machine-id and the ids systemd derives for edgespool
/// (`systemd-id128 machine-id --app-specific=59059745eaf64aef817b21555c34a3fb`).
const BOARDS: [(&str, &str); 2] = [
    ("0123456789abcdef0123456789abcdef", "es-f2d8805e11fc"),
    ("fedcba9876543210fedcba9876543210", "es-9e4021d22a13"),
];

fn shipped_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("board-configs/edgespool.toml")
}

/// A board's root: its machine-id file, the `--set`s that put its spool there.
fn board(root: &Path, machine_id: &str, url: &str) -> (PathBuf, Vec<String>) {
    std::fs::create_dir_all(root).expect("board root");
    let mid = root.join("machine-id");
    std::fs::write(&mid, format!("{machine_id}\n")).expect("machine-id");
    let sets = vec![
        format!("spool.path={}/spool.db", root.display()),
        format!("mqtt.url={url}"),
        "sources.0.interval_ms=300".to_owned(),
        "spool.commit_window_ms=50".to_owned(),
        "spool.tune_from_probe=false".to_owned(),
    ];
    (mid, sets)
}

fn with_sets<'a>(mut args: Vec<&'a str>, sets: &'a [String]) -> Vec<&'a str> {
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    args
}

#[test]
fn two_boards_with_the_same_package_config_get_two_ids_each_stable_across_restarts() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = Subscriber::start(broker.port(), "edgespool/#");
    assert!(sub.wait_subscribed(Duration::from_secs(10)));
    let cfg = shipped_config();
    for (n, (machine_id, want)) in BOARDS.iter().enumerate() {
        let root = dir.path().join(format!("board-{n}"));
        let (mid, sets) = board(&root, machine_id, &broker.url());
        let mid_s = mid.to_str().expect("utf-8");
        let env = [(MACHINE_ID_ENV, mid_s)];
        let args = with_sets(vec!["check-config", cfg.to_str().expect("utf-8")], &sets);
        let (st, out, err) = run_cli_with(&args, &env, CLI_TIMEOUT);
        assert!(st.success(), "{err}");
        assert!(
            out.contains(&format!("ok (device {want} from @machine-id: {mid_s}")),
            "{out}"
        );
        // Twice: a start, a stop, a start again (a reboot, an upgrade).
        for run in 0..2 {
            sub.clear();
            let mut agent = AgentProc::spawn_with_env(&cfg, &sets, &root, &env);
            let status_topic = format!("edgespool/{want}/status");
            let events = format!("edgespool/{want}/events/system");
            let seen = |sub: &Subscriber| {
                let d = sub.deliveries();
                let online = d.iter().any(|d| {
                    d.topic == status_topic && {
                        let v = d.json();
                        v["state"] == "online"
                            && v["device_id"] == *want
                            && v["device_id_source"] == "machine-id"
                    }
                });
                let event = d
                    .iter()
                    .any(|d| d.topic == events && d.json()["device_id"] == *want);
                online && event
            };
            assert!(
                wait_for(Duration::from_secs(20), || seen(&sub)),
                "board {n} run {run}: no online status and event as {want}; got {:?}\n{}",
                sub.deliveries()
                    .iter()
                    .map(|d| &d.topic)
                    .collect::<Vec<_>>(),
                agent.log_tail(30)
            );
            let first = agent
                .log_text()
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            assert!(
                first.contains(&format!(
                    "starting: device_id {want} (from @machine-id: {mid_s})"
                )),
                "first log line: {first}"
            );
            assert!(agent.terminate(Duration::from_secs(20)).is_some());
            // The clean stop's `offline` is this run's last message.
            assert!(wait_for(Duration::from_secs(10), || sub
                .deliveries()
                .iter()
                .any(
                    |d| d.topic == status_topic && d.json()["state"] == "offline"
                )));
            for d in sub.deliveries() {
                assert!(
                    d.topic.starts_with(&format!("edgespool/{want}/")),
                    "board {n} published on {}",
                    d.topic
                );
                let text = String::from_utf8_lossy(&d.payload);
                assert!(!text.contains(machine_id), "raw machine id in {text}");
            }
        }
        let spool = root.join("spool.db");
        let (st, out, err) = run_cli(&["status", "--spool", spool.to_str().expect("utf-8")]);
        assert!(st.success(), "{err}");
        assert!(
            out.contains(&format!("device_id: {want} (from @machine-id: {mid_s})")),
            "{out}"
        );
    }
}

#[test]
fn a_missing_empty_or_uninitialized_machine_id_is_an_error_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = shipped_config();
    let spool = format!("spool.path={}/spool.db", dir.path().display());
    for (name, text) in [
        ("missing", None),
        ("empty", Some("")),
        ("uninitialized", Some("uninitialized\n")),
        ("malformed", Some("0123456789abcdef-not-hex\n")),
    ] {
        let mid = dir.path().join(name);
        if let Some(t) = text {
            std::fs::write(&mid, t).expect("write");
        }
        let mid_s = mid.to_str().expect("utf-8");
        let (st, _, err) = run_cli_with(
            &[
                "run",
                "--config",
                cfg.to_str().expect("utf-8"),
                "--set",
                &spool,
            ],
            &[(MACHINE_ID_ENV, mid_s)],
            CLI_TIMEOUT,
        );
        assert_eq!(st.code(), Some(2), "{name}: {err}");
        assert!(
            err.contains("device_id: @machine-id: ")
                && err.contains(mid_s)
                && err.contains("systemd-machine-id-setup"),
            "{name}: {err}"
        );
        assert!(!dir.path().join("spool.db").exists(), "{name}");
    }
}

#[test]
fn hostname_gives_the_host_name_sanitized_or_refuses_localhost() {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let host = host.trim();
    let (st, out, err) = run_cli(&[
        "check-config",
        shipped_config().to_str().expect("utf-8"),
        "--set",
        "device_id=\"@hostname\"",
    ]);
    if host.eq_ignore_ascii_case("localhost") {
        assert_eq!(st.code(), Some(2), "{out}");
        assert!(err.contains("hostnamectl set-hostname"), "{err}");
        return;
    }
    let want: String = host
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    assert!(st.success(), "{err}");
    assert!(
        out.contains(&format!("ok (device {want} from @hostname,")),
        "{out}"
    );
    let (st, _, err) = run_cli(&[
        "check-config",
        shipped_config().to_str().expect("utf-8"),
        "--set",
        "device_id=\"@serial-number\"",
    ]);
    assert_eq!(st.code(), Some(2));
    assert!(err.contains("\"@machine-id\" or \"@hostname\""), "{err}");
}

/// A spool moved to another board (or a board whose machine id changed)
/// keeps rows that carry the old device id: the start says so at WARN,
/// naming both ids, and says nothing when the id is the one the spool knew.
#[test]
fn a_spool_last_run_under_another_device_id_is_named_at_start() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = shipped_config();
    let root = dir.path().join("board");
    let mut said = Vec::new();
    // Board 0, board 0 again, then the spool under board 1's machine id.
    for machine_id in [BOARDS[0].0, BOARDS[0].0, BOARDS[1].0] {
        let (mid, sets) = board(&root, machine_id, &broker.url());
        let mid_s = mid.to_str().expect("utf-8");
        let mut agent = AgentProc::spawn_with_env(&cfg, &sets, &root, &[(MACHINE_ID_ENV, mid_s)]);
        assert!(
            agent.wait_log(Duration::from_secs(20), "mqtt: connected"),
            "{}",
            agent.log_tail(20)
        );
        said.push(
            agent
                .log_text()
                .contains("this spool was last run as device_id"),
        );
        let log = agent.log_text();
        agent.terminate(Duration::from_secs(15));
        if machine_id == BOARDS[1].0 {
            let line = log
                .lines()
                .find(|l| l.contains("this spool was last run as device_id"))
                .unwrap_or_default();
            assert!(
                line.contains(BOARDS[0].1) && line.contains(BOARDS[1].1),
                "{line}"
            );
        }
    }
    assert_eq!(said, [false, false, true]);
}
