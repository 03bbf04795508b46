//! Board configs: every shipped config validates; every bad fixture fails
//! with the exact key path it expects, through the real `check-config`.

use crate::support::agent::run_cli;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn every_shipped_board_config_passes_check_config() {
    let mut n = 0;
    for entry in std::fs::read_dir(root().join("board-configs")).expect("board-configs/") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let (status, out, err) = run_cli(&["check-config", path.to_str().expect("utf-8 path")]);
        assert!(status.success(), "{}: {out}{err}", path.display());
        n += 1;
    }
    assert!(n >= 4, "expected at least 4 board configs, found {n}");
}

/// field case F16: each fixture's first line says `# expect: <key path>`.
#[test]
fn each_bad_config_fixture_fails_with_its_key_path() {
    let dir = root().join("tests/fixtures/bad-configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("fixtures") {
        let path = entry.expect("dir entry").path();
        let text = std::fs::read_to_string(&path).expect("fixture text");
        let want = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{} lacks '# expect: key'", path.display()))
            .trim()
            .to_owned();
        let (status, out, err) = run_cli(&["check-config", path.to_str().expect("utf-8 path")]);
        assert_eq!(status.code(), Some(2), "{}: {out}{err}", path.display());
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.contains(&format!(": {want}: ")),
            "{}: expected key {want:?} in {first:?}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 10, "only {n} fixtures");
}

/// Issue 36 item 3: the shipped configs are quiet (unsigned commands with
/// a side effect are refused by default, so there is nothing to warn
/// about); the caution appears only when `allow_unsigned` opens the
/// channel and no operator key is listed, naming both keys and the fix.
#[test]
fn only_an_open_command_channel_without_an_operator_key_gets_a_caution() {
    for entry in std::fs::read_dir(root().join("board-configs")).expect("board-configs/") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let (status, _, err) = run_cli(&["check-config", path.to_str().expect("utf-8 path")]);
        assert!(status.success(), "{}: {err}", path.display());
        assert!(!err.contains("caution"), "{}: {err}", path.display());
    }
    let cfg = root().join("board-configs/edgespool.toml");
    let cfg = cfg.to_str().expect("utf-8");
    let (status, _, err) = run_cli(&["check-config", cfg, "--set", "commands.allow_unsigned=true"]);
    assert!(status.success(), "{err}");
    for needed in [
        "caution: ",
        "commands.allow_unsigned = true",
        "commands.operator_public_keys",
        "edgespool keygen",
    ] {
        assert!(err.contains(needed), "{needed:?} not in {err}");
    }
    let key = format!("commands.operator_public_keys=[\"{}\"]", "ab".repeat(32));
    for sets in [
        vec!["commands.allow_unsigned=true", key.as_str()],
        vec!["commands.allow_unsigned=true", "commands.enabled=false"],
    ] {
        let mut args = vec!["check-config", cfg];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let (status, _, err) = run_cli(&args);
        assert!(status.success(), "{sets:?}: {err}");
        assert!(!err.contains("caution"), "{sets:?}: {err}");
    }
}

#[test]
fn a_bad_set_override_is_rejected_and_names_the_key() {
    let cfg = root().join("board-configs/local-demo.toml");
    let (status, _, err) = run_cli(&[
        "check-config",
        cfg.to_str().expect("utf-8"),
        "--set",
        "mqtt.keep_alive_sec=10",
    ]);
    assert_eq!(status.code(), Some(2));
    assert!(err.contains("mqtt.keep_alive_sec:"), "{err}");
    assert!(err.contains("did you mean `keep_alive_secs`"), "{err}");
}

#[test]
fn run_with_an_invalid_config_exits_2_without_creating_a_spool() {
    let d = tempfile::tempdir().expect("tempdir");
    let cfg = d.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            "device_id = \"x\"\n[spool]\npath = \"{}/spool.db\"\nretenton_days = 3\n",
            d.path().display()
        ),
    )
    .expect("write");
    let (status, _, err) = run_cli(&["run", "--config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("spool.retenton_days"), "{err}");
    assert!(!d.path().join("spool.db").exists());
}

/// A board config in `dir` with one source, given as TOML lines.
fn one_source_config(dir: &Path, source: &str) -> std::path::PathBuf {
    let cfg = dir.join("board.toml");
    let text = format!(
        "device_id = \"x\"\n[spool]\npath = \"{}/spool.db\"\n[[sources]]\nname = \"s\"\n{source}\n",
        dir.display()
    );
    std::fs::write(&cfg, text).expect("write config");
    cfg
}

#[test]
fn check_config_fails_on_a_missing_replay_file_or_a_header_without_the_column() {
    let d = tempfile::tempdir().expect("tempdir");
    let trace = d.path().join("trace.csv");
    let replay = |extra: &str| {
        format!(
            "kind = \"replay\"\npath = \"{}\"\ntimestamp_columns = [\"Date\"]\ntimestamp_format = \"%Y-%m-%d\"\n{extra}",
            trace.display()
        )
    };
    let cfg = one_source_config(d.path(), &replay(""));
    let (status, _, err) = run_cli(&["check-config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("sources[0].path: ") && err.contains("trace.csv"),
        "{err}"
    );

    std::fs::write(&trace, "\"Date\";\"T\"\n2024-05-01;1\n").expect("trace");
    let cfg = one_source_config(
        d.path(),
        &replay("delimiter = \";\"\ncolumns = { \"RH\" = \"rh\" }"),
    );
    let (status, _, err) = run_cli(&["check-config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("sources[0].columns: ") && err.contains("trace.csv") && err.contains("\"RH\""),
        "{err}"
    );

    let cfg = one_source_config(
        d.path(),
        &replay("delimiter = \";\"\ncolumns = { \"T\" = \"t\" }"),
    );
    let (status, out, err) = run_cli(&["check-config", cfg.to_str().expect("utf-8"), "--sample"]);
    assert!(status.success(), "{out}{err}");
    assert!(
        out.contains("source s (sources[0]) -> ")
            && out.contains("\"fields\":{\"trace_ts_ms\":1714521600000,\"t\":1}"),
        "{out}"
    );
}

#[test]
fn check_config_sample_names_a_source_that_gives_no_reading() {
    let d = tempfile::tempdir().expect("tempdir");
    let cfg = one_source_config(
        d.path(),
        "kind = \"file\"\npath = \"/sys/bus/w1/devices/28-000000000000/temperature\"",
    );
    let (status, _, err) = run_cli(&["check-config", cfg.to_str().expect("utf-8")]);
    assert!(
        status.success(),
        "without --sample the path is not opened: {err}"
    );
    let (status, _, err) = run_cli(&["check-config", cfg.to_str().expect("utf-8"), "--sample"]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("source s (sources[0]): no reading") && err.contains("28-000000000000"),
        "{err}"
    );
}

/// A 10 GB `spool.journal_size_limit_bytes` (an extra zero) is refused by
/// both `check-config` and `run`, naming the key, the value and the range;
/// `run` creates no spool.
#[test]
fn a_journal_size_limit_over_1_gib_is_refused_by_check_config_and_run() {
    let d = tempfile::tempdir().expect("tempdir");
    let cfg = d.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            "device_id = \"x\"\n[spool]\npath = \"{}/spool.db\"\njournal_size_limit_bytes = 10737418240\n",
            d.path().display()
        ),
    )
    .expect("write");
    let cfg = cfg.to_str().expect("utf-8");
    let want = "spool.journal_size_limit_bytes: must be 0..=1073741824 (1 GiB) (got 10737418240)";
    let (status, _, err) = run_cli(&["check-config", cfg]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains(want), "{err}");
    let (status, _, err) = run_cli(&["run", "--config", cfg]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains(want), "{err}");
    assert!(!d.path().join("spool.db").exists());
}

/// The config file and its last-known-good copy both unusable (a power cut
/// that took both: the file truncated, the copy NUL-filled): `run` exits 2
/// with the config's error, and a WARN names the copy and why it was not
/// run either. A start with a good config then replaces the copy, naming
/// the damage it replaces.
#[test]
fn a_damaged_last_good_copy_is_named_when_it_cannot_stand_in_and_when_it_is_replaced() {
    let d = tempfile::tempdir().expect("tempdir");
    let cfg = d.path().join("board.toml");
    let lg = d.path().join("board.toml.last-good");
    std::fs::write(&cfg, "device_id = \"x\"\n[spool").expect("write");
    edgespool::config::file::write_atomic(&lg, &[0u8; 256]).expect("write last-good");
    let cfg_s = cfg.to_str().expect("utf-8");
    let (status, _, err) = run_cli(&["run", "--config", cfg_s]);
    assert_eq!(status.code(), Some(2), "{err}");
    let named = format!(
        "last-known-good copy {} is ignored: it is not a valid config either",
        lg.display()
    );
    assert!(
        err.lines()
            .any(|l| l.contains(" WARN ") && l.contains(&named)),
        "{err}"
    );
    // A good config: the copy is replaced, by name.
    std::fs::write(
        &cfg,
        format!(
            "device_id = \"x\"\n[spool]\npath = \"{}/spool.db\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:9\"\n",
            d.path().display()
        ),
    )
    .expect("write");
    let named = format!(
        "last-known-good copy {} is damaged (it is NUL-filled (256 bytes of zeros)); replacing it",
        lg.display()
    );
    let mut agent = crate::support::agent::AgentProc::spawn(&cfg, &[], d.path());
    let seen = crate::support::wait_for(std::time::Duration::from_secs(30), || {
        agent.log_text().contains("storage probe (")
    });
    agent.terminate(std::time::Duration::from_secs(15));
    assert!(seen, "{}", agent.log_tail(20));
    assert!(
        agent
            .log_text()
            .lines()
            .any(|l| l.contains(" WARN ") && l.contains(&named)),
        "{}",
        agent.log_tail(20)
    );
    assert_eq!(
        std::fs::read_to_string(&lg).expect("last-good"),
        std::fs::read_to_string(&cfg).expect("config")
    );
}
