//! Exec sources against the real binary: what the program they run gets of
//! the agent (issue 21, finding 12). The agent is started with a secret in
//! its environment; the source's program writes its own `env` and `id` to
//! files the test reads back.

use crate::support::agent::AgentProc;
use crate::support::board::append_config;
use crate::support::broker::Broker;
use crate::support::wait_for;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SECRET: &str = "hunter2-exec-source-must-not-see-this";

/// A test directory any user may traverse, with `out/` any user may write
/// (a source running as `nobody` leaves its files there).
fn open_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod dir");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("mkdir out");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o1777)).expect("chmod out");
    (dir, out)
}

/// The test config plus `sources`, run with [`SECRET`] in the agent's
/// environment until `file` exists (then its text), or panic with the log.
fn run_until_written(dir: &Path, sources: &str, file: &Path) -> String {
    let broker = Broker::start();
    let prefix = crate::prefix("exec-source-env");
    let cfg = crate::write_config(dir, &broker.url(), &prefix, 1000);
    append_config(&cfg, sources);
    let mut agent = AgentProc::spawn_with_env(&cfg, &[], dir, &[("EDGESPOOL_TEST_SECRET", SECRET)]);
    assert!(
        wait_for(Duration::from_secs(30), || file.exists()
            || !agent.is_running()),
        "the source never wrote {}\n{}",
        file.display(),
        agent.log_tail(30)
    );
    let written = std::fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", file.display(), agent.log_tail(30)));
    agent.terminate(Duration::from_secs(15));
    written
}

/// The variable names in `env` output, without what `sh` adds itself (`PWD`).
fn names(env: &str) -> Vec<&str> {
    let mut names: Vec<&str> = env
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .filter(|k| *k != "PWD")
        .collect();
    names.sort_unstable();
    names
}

/// Finding 12: an exec source inherited the agent's whole environment (a
/// secret variable was readable). It gets `PATH` and `LANG` only, like a
/// handler: not the secret, not `RUST_LOG`, not `HOME`.
#[test]
fn an_exec_source_sees_none_of_the_agents_environment() {
    let (dir, out) = open_dir();
    let env_file = out.join("env");
    let sources = format!(
        r#"[[sources]]
name = "envprobe"
kind = "exec"
program = "/bin/sh"
args = ["-c", "{{ env; echo cwd=$(pwd -P); }} > {o}/env.tmp && mv {o}/env.tmp {o}/env; echo 1"]
interval_ms = 200
"#,
        o = out.display()
    );
    let env = run_until_written(dir.path(), &sources, &env_file);
    println!("the source's environment:\n{env}");
    assert!(!env.contains(SECRET), "the secret leaked:\n{env}");
    // Started in /, not in the directory the agent was started from.
    assert!(env.lines().any(|l| l == "cwd=/"), "{env}");
    let env: String = env
        .lines()
        .filter(|l| !l.starts_with("cwd="))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(names(&env), ["LANG", "PATH"], "{env}");
    assert!(
        env.lines()
            .any(|l| l == "PATH=/usr/sbin:/usr/bin:/sbin:/bin"),
        "{env}"
    );
    assert!(env.lines().any(|l| l == "LANG=C.UTF-8"), "{env}");
}

/// The new exec-source keys: `env` adds variables (and may replace `PATH`),
/// `user`/`group` run the program as another user when the agent is root.
#[test]
fn an_exec_source_gets_its_env_and_runs_as_its_user() {
    let (dir, out) = open_dir();
    let id_file = out.join("id");
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let user = if root {
        "user = \"nobody\"\ngroup = \"nogroup\"\n"
    } else {
        ""
    };
    let sources = format!(
        r#"[[sources]]
name = "idprobe"
kind = "exec"
program = "/bin/sh"
args = ["-c", "{{ id -u; id -g; id -G; env; }} > {o}/id.tmp && mv {o}/id.tmp {o}/id; echo 1"]
interval_ms = 200
env = {{ SENSOR_BUS = "i2c-1", PATH = "/usr/bin:/bin" }}
{user}"#,
        o = out.display()
    );
    let written = run_until_written(dir.path(), &sources, &id_file);
    println!("the source wrote:\n{written}");
    let lines: Vec<&str> = written.lines().collect();
    assert!(!written.contains(SECRET), "{written}");
    assert_eq!(names(&written), ["LANG", "PATH", "SENSOR_BUS"], "{written}");
    assert!(lines.contains(&"SENSOR_BUS=i2c-1"), "{written}");
    assert!(lines.contains(&"PATH=/usr/bin:/bin"), "{written}");
    if root {
        let (uid, gid) = (
            id_of("/etc/passwd", "nobody"),
            id_of("/etc/group", "nogroup"),
        );
        assert_eq!(
            lines[..3],
            [uid.as_str(), gid.as_str(), gid.as_str()],
            "{written}"
        );
        let owner = std::os::unix::fs::MetadataExt::uid(
            &std::fs::metadata(&id_file).expect("stat id file"),
        );
        assert_eq!(owner.to_string(), uid, "the file was written as nobody");
    } else {
        println!("not root: the user switch is not exercised");
    }
}

/// The id of `name` in `/etc/passwd` or `/etc/group` (the third field).
fn id_of(file: &str, name: &str) -> String {
    std::fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name}:x:"))
                .map(|rest| rest.split(':').next().unwrap_or("").to_owned())
        })
        .unwrap_or_else(|| panic!("{name} in {file}"))
}
