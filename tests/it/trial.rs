//! `edgespool test`: one reading per source shown as it would be sent, and
//! nothing written, through the real binary on the shipped board configs
//! and on broken ones.

use crate::support::agent::run_cli;
use edgespool::source::SourceKind;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn board_configs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("board-configs");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("board-configs/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("toml"))
        .collect();
    out.sort();
    assert!(out.len() >= 4, "expected at least 4 board configs");
    out
}

/// A shipped config loaded here as the binary under test loads it: its
/// `device_id = "@machine-id"` from `tests/fixtures/machine-id`
/// ([`crate::support::agent::command`]), not this machine's.
fn load_shipped(cfg: &Path) -> edgespool::config::Config {
    let text = std::fs::read_to_string(cfg).expect("shipped config");
    let sets = if text.contains("\ndevice_id = \"@machine-id\"") {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/machine-id");
        let id = edgespool::os::identity::from_machine_id(&fixture).expect("fixture machine id");
        vec![format!("device_id=\"{id}\"")]
    } else {
        Vec::new()
    };
    edgespool::config::load(cfg, &sets).expect("shipped config is valid")
}

/// Every file in `dir`, sorted (to show nothing was created there).
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `test --config FILE --set spool.path=<empty dir>/spool.db [extra]`;
/// (exit code, stdout, stderr). The spool's directory must stay empty.
fn run_test(cfg: &Path, extra: &[String]) -> (Option<i32>, String, String) {
    let spool_dir = tempfile::tempdir().expect("tempdir");
    let spool = format!("spool.path={}/spool.db", spool_dir.path().display());
    let mut args = vec![
        "test",
        "--config",
        cfg.to_str().expect("utf-8"),
        "--set",
        &spool,
    ];
    for s in extra {
        args.push("--set");
        args.push(s);
    }
    let (status, out, err) = run_cli(&args);
    assert!(
        listing(spool_dir.path()).is_empty(),
        "{}: test wrote {:?}",
        cfg.display(),
        listing(spool_dir.path())
    );
    (status.code(), out, err)
}

/// The sources of a shipped config that cannot be read on this machine: the
/// `file` sources whose file does not exist here (a SoC thermal zone, a
/// 1-Wire sensor). Every other kind reads anywhere (the `exec` examples use
/// coreutils, the replay example the shared trace).
fn unreadable_here(cfg: &Path) -> Vec<(usize, String)> {
    let c = load_shipped(cfg);
    c.sources
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(&s.kind, SourceKind::File { path, .. } if std::fs::read(path).is_err()))
        .map(|(i, s)| (i, s.name.clone()))
        .collect()
}

/// Shipped configs as they are: every source that cannot be read on this
/// machine is named, and only those; exit 1 if there is one, else 0. The
/// 1-Wire placeholder of the Pi Zero config never exists, so at least one
/// config fails here.
#[test]
fn test_names_exactly_the_sources_of_each_shipped_config_this_machine_cannot_read() {
    let mut failing_configs = 0;
    for cfg in board_configs() {
        let c = load_shipped(&cfg);
        let bad = unreadable_here(&cfg);
        let (code, out, err) = run_test(&cfg, &[]);
        let named: BTreeSet<String> = err
            .lines()
            .filter_map(|l| l.strip_prefix("source "))
            .filter_map(|l| l.split(" (").next())
            .map(str::to_owned)
            .collect();
        let want: BTreeSet<String> = bad.iter().map(|(_, n)| n.clone()).collect();
        assert_eq!(named, want, "{}:\n{out}{err}", cfg.display());
        if bad.is_empty() {
            assert_eq!(code, Some(0), "{}:\n{out}{err}", cfg.display());
        } else {
            failing_configs += 1;
            assert_eq!(code, Some(1), "{}:\n{out}{err}", cfg.display());
            let names: Vec<String> = bad.iter().map(|(_, n)| format!("source {n}")).collect();
            let last = err.lines().last().unwrap_or_default();
            assert_eq!(
                last,
                format!("test: {} failed: {}", bad.len(), names.join(", ")),
                "{}",
                cfg.display()
            );
        }
        // The others are shown, each as its JSON envelope.
        let shown = out.lines().filter(|l| l.starts_with("source ")).count();
        assert_eq!(
            shown,
            c.sources.len() - bad.len(),
            "{}:\n{out}",
            cfg.display()
        );
        println!(
            "{}: {} sources, unreadable here: {want:?}",
            cfg.display(),
            c.sources.len()
        );
    }
    assert!(
        failing_configs >= 1,
        "the 1-Wire placeholder exists on this machine?"
    );
}

/// Shipped configs with each unreadable file source pointed (`--set`) at a
/// fixture: every source gives a reading, printed as the envelope that
/// would be sent, exit 0, nothing written.
#[test]
fn test_reads_every_source_of_every_shipped_config_given_fixtures() {
    let fixtures = tempfile::tempdir().expect("tempdir");
    let sensor = fixtures.path().join("sensor");
    std::fs::write(&sensor, "21500\n").expect("fixture");
    for cfg in board_configs() {
        let c = load_shipped(&cfg);
        let sets: Vec<String> = unreadable_here(&cfg)
            .iter()
            .map(|(i, _)| format!("sources.{i}.path={}", sensor.display()))
            .collect();
        let (code, out, err) = run_test(&cfg, &sets);
        assert_eq!(code, Some(0), "{}:\n{out}{err}", cfg.display());
        let lines: Vec<&str> = out.lines().collect();
        for (i, s) in c.sources.iter().enumerate() {
            let head = format!(
                "source {} (sources[{i}]) -> {}/events/{} (",
                s.name, c.mqtt.topic_prefix, s.name
            );
            let at = lines
                .iter()
                .position(|l| l.starts_with(&head))
                .unwrap_or_else(|| panic!("{}: no {head:?} in\n{out}", cfg.display()));
            let v: serde_json::Value =
                serde_json::from_str(lines[at + 1].trim()).expect("the envelope is JSON");
            assert_eq!(v["device_id"], c.device_id.as_str());
            assert_eq!(v["stream"], s.name.as_str());
            assert_eq!(v["seq"], 0);
            assert!(
                v["fields"].as_object().is_some_and(|f| !f.is_empty()),
                "{}",
                lines[at + 1]
            );
            if sets.iter().any(|x| x.starts_with(&format!("sources.{i}."))) {
                assert_eq!(v["fields"]["temp_c"], 21.5, "{}", lines[at + 1]);
            }
        }
        assert!(
            out.contains(&format!(
                "test: ok ({} {} gave a reading",
                c.sources.len(),
                if c.sources.len() == 1 {
                    "source"
                } else {
                    "sources"
                }
            )),
            "{out}"
        );
    }
}

/// A broken config: a bad key exits 2 naming it; sources that fail (a
/// missing sensor file, a missing replay file) exit 1 naming each, while
/// the good one is still shown; an existing spool file is left unchanged
/// and no -wal, -shm or lock file appears beside it.
#[test]
fn test_on_a_broken_config_names_the_key_or_each_failed_source_and_writes_nothing() {
    let d = tempfile::tempdir().expect("tempdir");
    let db = d.path().join("spool.db");
    let before = b"not a spool: must stay exactly these bytes".to_vec();
    std::fs::write(&db, &before).expect("spool stand-in");
    let cfg = d.path().join("board.toml");
    let write = |sources: &str| {
        std::fs::write(
            &cfg,
            format!(
                "device_id = \"broken\"\n[spool]\npath = \"{}\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:1\"\n{sources}",
                db.display()
            ),
        )
        .expect("write config")
    };
    write("[[sources]]\nname = \"sys\"\nkind = \"system\"\nintervall_ms = 1000\n");
    let (status, out, err) = run_cli(&["test", "--config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(2), "{out}{err}");
    assert!(
        err.contains("sources[0].intervall_ms: unknown key"),
        "{err}"
    );
    assert!(out.is_empty(), "nothing sampled for a bad config: {out}");

    write(&format!(
        "[[sources]]\nname = \"sys\"\nkind = \"system\"\n\
         [[sources]]\nname = \"w1\"\nkind = \"file\"\npath = \"{dir}/28-000000000000/temperature\"\n\
         [[sources]]\nname = \"trace\"\nkind = \"replay\"\npath = \"{dir}/gone.csv\"\ntimestamp_columns = [\"ts\"]\ntimestamp_format = \"%s\"\n",
        dir = d.path().display()
    ));
    let (status, out, err) = run_cli(&["test", "--config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(1), "{out}{err}");
    assert!(
        out.contains("source sys (sources[0]) -> edgespool/broken/events/sys ("),
        "{out}"
    );
    assert!(
        err.contains("source w1 (sources[1]): no reading: ") && err.contains("28-000000000000"),
        "{err}"
    );
    assert!(
        err.contains("source trace (sources[2]): no reading: ") && err.contains("gone.csv"),
        "{err}"
    );
    assert_eq!(
        err.lines().last(),
        Some("test: 2 failed: source w1, source trace"),
        "{err}"
    );
    assert_eq!(std::fs::read(&db).expect("spool stand-in"), before);
    let mut files = listing(d.path());
    files.retain(|f| f.starts_with("spool.db"));
    assert_eq!(files, ["spool.db"], "no -wal, -shm or lock file");
}

/// The real binary on a config whose sources take no sample (an mqtt
/// bridge whose local broker accepts TCP) or have no row yet (a followed
/// replay holding only its header): exit 0, and the summary counts only
/// the sources that gave a reading. An `ingest.socket_group` naming no
/// group fails the listener (exit 1), as it would fail the agent's start.
#[test]
fn test_counts_sources_without_a_sample_apart_and_checks_the_socket_group() {
    let d = tempfile::tempdir().expect("tempdir");
    // Stands in for the local broker: `test` only opens a TCP connection.
    let broker = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = broker.local_addr().expect("addr").port();
    let csv = d.path().join("growing.csv");
    std::fs::write(&csv, "ts,temp_c\n").expect("header only");
    let cfg = d.path().join("board.toml");
    let write = |ingest: &str| {
        std::fs::write(
            &cfg,
            format!(
                "device_id = \"t\"\n[spool]\npath = \"{dir}/spool.db\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:1\"\n\
                 [[sources]]\nname = \"sys\"\nkind = \"system\"\n\
                 [[sources]]\nname = \"plant\"\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{port}\"\ntopics = [\"plant/#\"]\n\
                 [[sources]]\nname = \"trace\"\nkind = \"replay\"\npath = \"{csv}\"\ntimestamp_columns = [\"ts\"]\ntimestamp_format = \"%s\"\nfollow = true\n\
                 {ingest}",
                dir = d.path().display(),
                csv = csv.display()
            ),
        )
        .expect("write config")
    };
    write("");
    let (code, out, err) = run_test(&cfg, &[]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("source trace (sources[2]): no rows yet; following"),
        "{out}"
    );
    assert!(
        out.contains(
            "test: ok (1 source gave a reading, 1 takes none (mqtt), 1 has no rows yet (follow);"
        ),
        "{out}"
    );

    let ingest = |group: &str| {
        format!(
            "[ingest]\nsocket = \"{}/run/i.sock\"\nsocket_group = \"{group}\"\n[[ingest.streams]]\nname = \"pump\"\n",
            d.path().display()
        )
    };
    write(&ingest("no-such-group-edgespool"));
    let (code, out, err) = run_test(&cfg, &[]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("listener ingest.socket: ingest.socket_group \"no-such-group-edgespool\": no such group"),
        "{err}"
    );
    assert!(err.contains("failed: listener ingest.socket"), "{err}");
    // The group "root" (gid 0) exists on every Linux system.
    write(&ingest("root"));
    let (code, out, err) = run_test(&cfg, &[]);
    assert_eq!(code, Some(0), "{out}{err}");
    drop(broker);
}
