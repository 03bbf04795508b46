//! The command line of the real binary: per-command help three ways, the
//! overview, and usage errors that name the option and the command (exit 2).

use crate::support::agent::run_cli;

/// (command, options its help must list, an option of another command).
const COMMANDS: &[(&str, &[&str], &str)] = &[
    (
        "run",
        &["--config FILE", "--set KEY=VALUE", "--check-spool"],
        "--json",
    ),
    (
        "check-config",
        &["--config FILE", "--set KEY=VALUE", "--sample"],
        "--spool",
    ),
    (
        "test",
        &["--config FILE", "--set KEY=VALUE"],
        "--check-spool",
    ),
    (
        "status",
        &["--config FILE", "--spool PATH", "--json"],
        "--url",
    ),
    (
        "probe-storage",
        &["--config FILE", "--dir DIR", "--json"],
        "--spool",
    ),
    (
        "sink",
        &[
            "--url mqtt://HOST:PORT",
            "--postgres CONNINFO",
            "--pg-ca FILE",
            "--pg-key FILE",
            "--stats",
        ],
        "--check-spool",
    ),
];

fn ok_stdout(args: &[&str]) -> String {
    let (status, out, err) = run_cli(args);
    assert_eq!(status.code(), Some(0), "edgespool {args:?}: {err}");
    assert!(err.is_empty(), "edgespool {args:?} wrote to stderr: {err}");
    out
}

#[test]
fn cli_help_of_each_command_is_the_same_three_ways_and_its_own() {
    let mut seen = Vec::new();
    for (name, opts, foreign) in COMMANDS {
        let long = ok_stdout(&[name, "--help"]);
        assert_eq!(ok_stdout(&[name, "-h"]), long, "{name} -h");
        assert_eq!(ok_stdout(&["help", name]), long, "help {name}");
        assert!(long.starts_with(&format!("edgespool {name}: ")), "{long}");
        assert!(
            long.contains(&format!("usage:\n  edgespool {name} ")),
            "{long}"
        );
        assert!(
            long.contains(&format!("example:\n  edgespool {name} ")),
            "{long}"
        );
        for o in *opts {
            assert!(long.contains(o), "{name} --help lacks {o}:\n{long}");
        }
        assert!(
            !long.contains(&format!("{foreign} ")),
            "{name} --help lists {foreign}:\n{long}"
        );
        seen.push(long);
    }
    seen.dedup();
    assert_eq!(seen.len(), COMMANDS.len(), "two commands share a help text");
}

#[test]
fn cli_help_alone_is_the_overview_of_every_command() {
    let overview = ok_stdout(&["help"]);
    assert_eq!(ok_stdout(&["--help"]), overview);
    assert_eq!(ok_stdout(&["-h"]), overview);
    for (name, _, _) in COMMANDS {
        assert!(
            overview.contains(&format!("\n  edgespool {name} ")),
            "{name}:\n{overview}"
        );
    }
    assert!(overview.contains("edgespool help [COMMAND]"), "{overview}");
}

#[test]
fn cli_unknown_option_names_itself_and_the_command_and_exits_2() {
    let (status, out, err) = run_cli(&["status", "--jsn"]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.starts_with("edgespool status: unknown option --jsn\n"),
        "{err}"
    );
    assert!(
        err.contains("usage:\n  edgespool status (--config FILE | --spool PATH)"),
        "{err}"
    );
    assert!(err.contains("edgespool help status"), "{err}");
    // An option of another command has no effect here: refused as well.
    for (name, _, foreign) in COMMANDS {
        let (status, _, err) = run_cli(&[name, foreign, "x"]);
        assert_eq!(status.code(), Some(2), "{name} {foreign}: {err}");
        assert!(
            err.starts_with(&format!("edgespool {name}: unknown option {foreign}\n")),
            "{err}"
        );
    }
    let (status, _, err) = run_cli(&["run", "-x"]);
    assert_eq!(status.code(), Some(2));
    assert!(
        err.starts_with("edgespool run: unknown option -x\n"),
        "{err}"
    );
    let (status, _, err) = run_cli(&["status", "--spool"]);
    assert_eq!(status.code(), Some(2));
    assert!(
        err.starts_with("edgespool status: --spool needs a value (PATH)\n"),
        "{err}"
    );
    let (status, _, err) = run_cli(&["sink", "--db", "x.db", "--batch-max", "lots"]);
    assert_eq!(status.code(), Some(2));
    assert!(
        err.starts_with("edgespool sink: --batch-max: \"lots\" is not a number"),
        "{err}"
    );
}

#[test]
fn cli_unknown_command_is_a_usage_error_and_help_says_so_too() {
    let (status, out, err) = run_cli(&["frobnicate", "--json"]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.starts_with("edgespool: unknown command \"frobnicate\"\n"),
        "{err}"
    );
    assert!(err.contains("edgespool help"), "{err}");
    let (status, _, err) = run_cli(&["help", "frobnicate"]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("help: unknown command \"frobnicate\""),
        "{err}"
    );
    let (status, _, err) = run_cli(&[]);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.starts_with("edgespool: missing command\n"), "{err}");
    let (status, out, _) = run_cli(&["--version"]);
    assert_eq!(status.code(), Some(0));
    assert!(out.starts_with("edgespool "), "{out}");
    // `-V` as well, as most tools take it.
    let (status, short, err) = run_cli(&["-V"]);
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(short, out);
}

/// `status --config` while the file is invalid or gone: the agent runs its
/// last-known-good copy then (field case F15), and status reads the spool
/// that copy names, saying so on stderr, instead of failing just when the
/// operator needs it. The text has units and no JSON; `--json` has a
/// numeric `running_pid`.
#[test]
fn status_reads_the_last_known_good_copys_spool_while_the_config_file_is_invalid() {
    use crate::support::agent::AgentProc;
    use std::time::Duration;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = crate::write_config(
        dir.path(),
        "mqtt://127.0.0.1:9",
        &crate::prefix("status-lkg"),
        100,
    );
    let cfg_s = cfg.to_str().expect("utf-8");
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        crate::support::wait_for(Duration::from_secs(20), || {
            run_cli(&["status", "--config", cfg_s])
                .1
                .contains("\nagent: running (pid ")
        }),
        "{}",
        agent.log_tail(20)
    );
    let good = std::fs::read_to_string(&cfg).expect("config");
    for (broken, said) in [
        (Some("device_id = 3\n"), "config invalid: "),
        (None, "does not exist"),
    ] {
        match broken {
            Some(text) => std::fs::write(&cfg, text).expect("write"),
            None => std::fs::remove_file(&cfg).expect("remove"),
        }
        let (st, out, err) = run_cli(&["status", "--config", cfg_s]);
        assert!(st.success(), "{err}");
        assert!(err.contains(said), "{err}");
        assert!(
            err.contains("reading the spool named by the last-known-good copy "),
            "{err}"
        );
        assert!(
            out.starts_with(&format!("spool: {}\n", db.display())),
            "{out}"
        );
        assert!(
            out.contains(&format!("\nagent: running (pid {}), up ", agent.pid())),
            "{out}"
        );
        assert!(
            !out.contains('{') && !out.contains("commands_clock_ms"),
            "{out}"
        );
        let (st, json, err) = run_cli(&["status", "--json", "--config", cfg_s]);
        assert!(st.success(), "{err}");
        let v: serde_json::Value = serde_json::from_str(&json).expect("status --json");
        assert_eq!(v["running_pid"], agent.pid(), "{json}");
    }
    std::fs::write(&cfg, good).expect("write");
    agent.terminate(Duration::from_secs(15));
    // Without a copy there is nothing to fall back to: named, exit 2.
    let lone = dir.path().join("lone.toml");
    let (st, _, err) = run_cli(&["status", "--config", lone.to_str().expect("utf-8")]);
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(
        err.starts_with(&format!("config file {} does not exist\n", lone.display())),
        "{err}"
    );
}

/// `test` judges the spool's directory as `run` does (one function,
/// `agent::check_places`): a world-writable directory, or one another user
/// owns, passed `test` and then stopped `run`, the commonest install mistake.
#[test]
fn test_refuses_the_spool_directory_run_refuses_in_the_same_words() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = crate::write_config(
        dir.path(),
        "mqtt://127.0.0.1:9",
        &crate::prefix("test-dirs"),
        100,
    );
    let cfg_s = cfg.to_str().expect("utf-8");
    let spool_dir = dir.path().join("spool");
    std::fs::create_dir(&spool_dir).expect("mkdir");
    let spool = format!("spool.path={}/spool.db", spool_dir.display());
    let (st, out, err) = run_cli(&["test", "--config", cfg_s, "--set", &spool]);
    assert!(st.success(), "{out}{err}");
    assert!(
        out.contains(&format!(
            "spool directory {}: run can use it as uid ",
            spool_dir.display()
        )),
        "{out}"
    );
    let root = edgespool::os::fsguard::files::euid() == 0;
    let cases = [
        (
            Some(0o777),
            None,
            "is writable by group or others (mode 777)",
        ),
        // Another user's (the service's, seen by root), or one this uid
        // cannot write.
        match root {
            true => (
                None,
                Some(54_321),
                "is owned by uid 54321, not by root or this agent",
            ),
            false => (Some(0o500), None, "is not writable by this agent"),
        },
    ];
    for (mode, owner, said) in cases {
        if let Some(mode) = mode {
            std::fs::set_permissions(&spool_dir, std::fs::Permissions::from_mode(mode))
                .expect("chmod");
        }
        if let Some(uid) = owner {
            std::os::unix::fs::chown(&spool_dir, Some(uid), None).expect("chown");
        }
        let (st, _, err) = run_cli(&["test", "--config", cfg_s, "--set", &spool]);
        assert_eq!(st.code(), Some(1), "{err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("run would refuse: "))
            .unwrap_or_else(|| panic!("{err}"));
        assert!(line.contains(said), "{line}");
        assert!(
            err.ends_with("test: 1 failed: directories (as run judges them)\n"),
            "{err}"
        );
        // `run` refuses it in the same words.
        let refusal = line
            .trim_start_matches("run would refuse: ")
            .split(" (checked as root")
            .next()
            .unwrap_or_default();
        let (st, _, run_err) = run_cli(&["run", "--config", cfg_s, "--set", &spool]);
        assert_eq!(st.code(), Some(1), "{run_err}");
        assert!(run_err.contains(refusal), "{refusal:?} in {run_err}");
        std::fs::set_permissions(&spool_dir, std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        if owner.is_some() {
            std::os::unix::fs::chown(&spool_dir, Some(0), None).expect("chown");
        }
    }
}

/// The sink's settings file: a problem is told with the file, the line and
/// the key; a setting a run lacks is named by its key in that file (not the
/// flag `--client-id`); a file that is not there is said as such.
#[test]
fn sink_settings_problems_name_the_file_the_line_and_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sink-fleet.toml");
    let path_s = path.to_str().expect("utf-8");
    std::fs::write(
        &path,
        "[sink]\nurl = \"mqtt://127.0.0.1:1\"\ntopic = \"t/+/events/#\"\n\
         [sink.postgres]\nconninfo = \"host=127.0.0.1 user=sink\"\n",
    )
    .expect("write");
    let (st, _, err) = run_cli(&["sink", "--config", path_s]);
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(
        err.starts_with(&format!(
            "config invalid: {path_s}:1: sink.client_id: required key is missing: with PostgreSQL"
        )),
        "{err}"
    );
    assert!(
        err.contains("(or --client-id)") && !err.contains("usage:"),
        "{err}"
    );
    // Without a file, the flag, as a usage error.
    let (st, _, err) = run_cli(&[
        "sink",
        "--postgres",
        "host=127.0.0.1 user=sink",
        "--url",
        "mqtt://127.0.0.1:1",
        "--topic",
        "t/#",
    ]);
    assert_eq!(st.code(), Some(2), "{err}");
    assert!(
        err.starts_with("edgespool sink: PostgreSQL needs --client-id ID"),
        "{err}"
    );
    std::fs::write(
        &path,
        "[sink]\nurl = \"mqtt://127.0.0.1:1\"\nbatch_ms = \"fast\"\n",
    )
    .expect("write");
    let (st, _, err) = run_cli(&["sink", "--config", path_s]);
    assert_eq!(st.code(), Some(2), "{err}");
    assert_eq!(
        err,
        format!(
            "config invalid: {path_s}:3: sink.batch_ms: expected a whole number of milliseconds, 0 or more, got \"fast\"\n"
        )
    );
    let gone = dir.path().join("sink-gone.toml");
    let (st, _, err) = run_cli(&["sink", "--config", gone.to_str().expect("utf-8")]);
    assert_eq!(st.code(), Some(2), "{err}");
    assert_eq!(
        err,
        format!("sink settings file {} does not exist\n", gone.display())
    );
}
