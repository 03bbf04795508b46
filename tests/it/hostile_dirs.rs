//! Files in a directory another user can write (issue 21, item 4), tried
//! the way an attacker would against the real binary: symlinks planted at
//! the names the agent writes (`spool.db.clean`, `spool.db.lock`,
//! `.edgespool-probe-<pid>`, the last-known-good copy, the storage profile),
//! state files owned by another user (`nobody`, uid 65534), a `.damaged`
//! marker the agent did not write, directories others may write, and a
//! process already listening on the ingest socket path.
//!
//! Each victim is a root-owned file outside the directory: after the agent
//! ran it is unchanged, or the agent refused to start naming the path.

use crate::support::agent::{bin, AgentProc};
use crate::support::board::{add_ingest, edit_config, Board, NO_BROKER};
use crate::support::spool::total;
use crate::support::wait_for;
use crate::{prefix, write_config};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// uid and gid of the user `nobody`: "another user" on this machine.
const NOBODY: u32 = 65534;
/// A root-owned file outside the agent's directories, with known bytes.
struct Victim {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Victim {
    fn new() -> Victim {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("victim");
        std::fs::write(&path, "precious root-owned bytes\n").expect("write victim");
        Victim { _dir: dir, path }
    }

    fn assert_untouched(&self, agent_log: &str) {
        let bytes = std::fs::read(&self.path).expect("read victim");
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            "precious root-owned bytes\n",
            "the agent wrote through a planted symlink into {}\n{agent_log}",
            self.path.display()
        );
    }
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn symlink(target: &Path, link: &Path) {
    std::os::unix::fs::symlink(target, link)
        .unwrap_or_else(|e| panic!("symlink {} -> {}: {e}", link.display(), target.display()));
}

/// Wait until the agent has opened its spool (the pragma line).
fn wait_open(agent: &AgentProc) {
    assert!(
        agent.wait_log(Duration::from_secs(20), "journal_mode="),
        "the agent never opened its spool\n{}",
        agent.log_tail(30)
    );
}

/// A config whose only source runs `/bin/sh` to create `marker`: what an
/// attacker's last-known-good copy would make root run.
fn marker_config(spool: &Path, marker: &Path) -> String {
    format!(
        r#"device_id = "attacker"
[spool]
path = "{}"
[mqtt]
url = "{NO_BROKER}"
[[sources]]
name = "pwn"
kind = "exec"
program = "/bin/sh"
args = ["-c", "touch {}; echo '{{\"v\":1}}'"]
interval_ms = 100
"#,
        spool.display(),
        marker.display()
    )
}

#[test]
fn a_clean_stamp_planted_as_a_symlink_while_the_agent_runs_never_reaches_its_target() {
    let victim = Victim::new();
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("stamp_link"), 200);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    wait_open(&agent);
    // Planted while the agent runs: the stop writes the stamp.
    let stamp = dir.path().join("spool.db.clean");
    symlink(&victim.path, &stamp);
    agent.terminate_clean(Duration::from_secs(15));
    victim.assert_untouched(&agent.log_text());
    let m = std::fs::symlink_metadata(&stamp).expect("stamp written");
    assert!(
        m.is_file(),
        "the stamp is not a regular file of the agent's"
    );
    assert_eq!(m.uid(), 0);
}

#[test]
fn a_lock_file_planted_as_a_symlink_is_refused_by_name_and_its_target_untouched() {
    let victim = Victim::new();
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("lock_link"), 200);
    let real = dir.path().canonicalize().expect("canonical dir");
    let lock = real.join("spool.db.lock");
    symlink(&victim.path, &lock);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let status = agent.wait(Duration::from_secs(20));
    let log = agent.log_text();
    victim.assert_untouched(&log);
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{log}");
    assert!(
        log.contains(&lock.display().to_string()) && log.contains("symbolic link"),
        "the refusal does not name the lock file\n{log}"
    );
}

#[test]
fn a_probe_scratch_file_planted_as_a_symlink_never_reaches_its_target() {
    let victim = Victim::new();
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("probe_link"), 200);
    let log_path = dir.path().join("agent.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    // The scratch file is named after the agent's pid: plant it from a
    // shell that then becomes the agent (exec keeps the pid; so does a
    // qemu-user runner, EDGESPOOL_AGENT_RUNNER).
    let runner = std::env::var("EDGESPOOL_AGENT_RUNNER").unwrap_or_default();
    let mut child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"ln -s "$0" "$1/.edgespool-probe-$$" || exit 99; shift; exec "$@""#)
        .arg(&victim.path)
        .arg(dir.path())
        .args(runner.split_whitespace())
        .arg(bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "debug")
        .stdout(log.try_clone().expect("clone log"))
        .stderr(log)
        .spawn()
        .expect("spawn the agent through sh");
    let text = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let probed = wait_for(Duration::from_secs(30), || {
        text().contains("storage probe") || matches!(child.try_wait(), Ok(Some(_)))
    });
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let _ = child.wait();
    victim.assert_untouched(&text());
    assert!(probed, "no storage probe line\n{}", text());
    assert!(
        text().contains("storage probe (measured now)"),
        "the probe did not run\n{}",
        text()
    );
    assert!(
        text().contains(".edgespool-probe-") && text().contains("symbolic link"),
        "the planted scratch file is not named in a warning\n{}",
        text()
    );
}

#[test]
fn a_last_good_copy_planted_as_a_symlink_is_never_run_nor_written_through() {
    let victim_dir = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = victim_dir.path().join("ran-as-root");
    // The attacker's config, in a file of theirs outside the directory.
    let theirs = victim_dir.path().join("their.toml");
    let their_text = marker_config(&dir.path().join("spool.db"), &marker);
    std::fs::write(&theirs, &their_text).expect("write");
    chown(&theirs, NOBODY);
    let cfg = dir.path().join("board.toml");
    let last_good = dir.path().join("board.toml.last-good");
    symlink(&theirs, &last_good);
    // A power cut left the board's own config empty.
    std::fs::write(&cfg, "").expect("empty config");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let status = agent.wait(Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let log = agent.log_text();
    assert!(!marker.exists(), "the planted last-good copy ran\n{log}");
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(
        agent.logged("WARN", "config", &last_good.display().to_string())
            && log.contains("symbolic link"),
        "the planted copy is not named in a warning\n{log}"
    );
    // A good config at the next start replaces the link, never its target.
    let good = write_config(dir.path(), NO_BROKER, &prefix("lastgood_link"), 200);
    let mut agent = AgentProc::spawn(&good, &[], dir.path());
    wait_open(&agent);
    agent.terminate(Duration::from_secs(15));
    assert_eq!(std::fs::read_to_string(&theirs).expect("read"), their_text);
    let m = std::fs::symlink_metadata(&last_good).expect("last-good");
    assert!(m.is_file() && m.uid() == 0, "{m:?}");
    assert_eq!(m.mode() & 0o022, 0, "mode {:o}", m.mode());
}

#[test]
fn a_last_good_copy_owned_by_another_user_is_not_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("ran-as-root");
    let cfg = dir.path().join("board.toml");
    let last_good = dir.path().join("board.toml.last-good");
    std::fs::write(
        &last_good,
        marker_config(&dir.path().join("spool.db"), &marker),
    )
    .expect("write");
    chmod(&last_good, 0o640);
    chown(&last_good, NOBODY);
    std::fs::write(&cfg, "").expect("empty config");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let status = agent.wait(Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let log = agent.log_text();
    assert!(
        !marker.exists(),
        "a last-good copy owned by nobody ran\n{log}"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(
        agent.logged("WARN", "config", &last_good.display().to_string())
            && log.contains("owned by uid 65534"),
        "the untrusted copy is not named in a warning with its owner\n{log}"
    );
}

/// A stored profile for `dir`'s filesystem with a commit window no probe
/// would derive, as `probe-storage` writes it.
fn tuned_profile(dir: &Path) -> Vec<u8> {
    let (st, out, err) = crate::support::agent::run_cli(&[
        "probe-storage",
        "--dir",
        dir.to_str().expect("utf-8"),
        "--json",
    ]);
    assert!(st.success(), "{err}");
    let mut v: serde_json::Value = serde_json::from_str(&out).expect("profile json");
    v["derived"]["commit_window_ms"] = 4321.into();
    serde_json::to_vec_pretty(&v).expect("json")
}

/// Run the agent in `dir` until its probe line, then stop it; the line.
fn probe_line(cfg: &Path, dir: &Path) -> (String, String) {
    let mut agent = AgentProc::spawn(cfg, &[], dir);
    let seen = wait_for(Duration::from_secs(30), || {
        agent.log_text().contains("storage probe (")
    });
    agent.terminate(Duration::from_secs(15));
    let log = agent.log_text();
    assert!(seen, "no storage probe line\n{log}");
    let line = log
        .lines()
        .find(|l| l.contains("storage probe ("))
        .unwrap_or_default()
        .to_owned();
    (line, log)
}

#[test]
fn a_storage_profile_planted_as_a_symlink_is_measured_again_by_name_and_its_target_untouched() {
    let outside = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let theirs = outside.path().join("tuned.json");
    let tuned = tuned_profile(outside.path());
    std::fs::write(&theirs, &tuned).expect("write");
    chown(&theirs, NOBODY);
    let cfg = write_config(dir.path(), NO_BROKER, &prefix("profile_link"), 200);
    // No commit_window_ms: the profile decides it.
    edit_config(&cfg, |t| t.replace("commit_window_ms = 50\n", ""));
    let profile = dir.path().join("storage-profile.json");
    symlink(&theirs, &profile);
    let (line, log) = probe_line(&cfg, dir.path());
    assert!(
        line.contains("measured now") && !line.contains("commit window 4321 ms"),
        "the planted profile was used: {line}"
    );
    assert!(
        log.contains(&format!("{} is ignored", profile.display())) && log.contains("symbolic link"),
        "the planted profile is not named in a warning\n{log}"
    );
    assert_eq!(std::fs::read(&theirs).expect("read"), tuned);
    assert_eq!(std::fs::metadata(&theirs).expect("stat").uid(), NOBODY);
    let m = std::fs::symlink_metadata(&profile).expect("profile");
    assert!(m.is_file() && m.uid() == 0, "{m:?}");
}

#[test]
fn a_storage_profile_owned_by_another_user_or_damaged_is_measured_again_by_name() {
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("profile_owner"), 200);
    edit_config(&cfg, |t| t.replace("commit_window_ms = 50\n", ""));
    let profile = dir.path().join("storage-profile.json");
    std::fs::write(&profile, tuned_profile(dir.path())).expect("write");
    chmod(&profile, 0o644);
    chown(&profile, NOBODY);
    let (line, log) = probe_line(&cfg, dir.path());
    assert!(
        line.contains("measured now") && !line.contains("commit window 4321 ms"),
        "a profile owned by nobody was used: {line}"
    );
    assert!(
        log.contains(&format!("{} is ignored", profile.display()))
            && log.contains("owned by uid 65534"),
        "the untrusted profile is not named in a warning\n{log}"
    );
    let m = std::fs::symlink_metadata(&profile).expect("profile");
    assert!(
        m.is_file() && m.uid() == 0,
        "rewritten keeping the planted owner: {m:?}"
    );
    // A power cut left it full of NULs: measured again, by name.
    std::fs::write(&profile, [0u8; 512]).expect("write");
    let (line, log) = probe_line(&cfg, dir.path());
    assert!(line.contains("measured now"), "{line}");
    assert!(
        log.contains(&format!("{} is ignored", profile.display())) && log.contains("damaged"),
        "the damaged profile is not named in a warning\n{log}"
    );
}

#[test]
fn directories_others_can_write_or_own_are_refused_naming_the_path_and_the_fix() {
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("dirs"), 200);
    let spool_dir = dir.path().join("shared");
    std::fs::create_dir(&spool_dir).expect("mkdir");
    let spool = spool_dir.join("spool.db");
    let set = [format!("spool.path={}", spool.display())];
    let refused = |why: &str, fix: &str| {
        let mut agent = AgentProc::spawn(&cfg, &set, dir.path());
        let status = agent.wait(Duration::from_secs(10));
        let log = agent.log_text();
        assert_eq!(status.and_then(|s| s.code()), Some(1), "{why}\n{log}");
        assert!(
            log.contains(&spool_dir.display().to_string()) && log.contains(fix),
            "{why}: the refusal does not name the directory and `{fix}`\n{log}"
        );
        assert!(!spool.exists(), "{why}: a spool was created");
    };
    chmod(&spool_dir, 0o777);
    refused("world-writable", "chmod go-w");
    chmod(&spool_dir, 0o770);
    refused("group-writable", "chmod go-w");
    // Sticky keeps others from renaming the agent's files, not from
    // planting names it has yet to create (a -wal before the first start).
    chmod(&spool_dir, 0o1777);
    refused("world-writable and sticky", "chmod go-w");
    chmod(&spool_dir, 0o700);
    chown(&spool_dir, NOBODY);
    refused("owned by nobody", "chown");
    // The config's directory too: a group that may write it may plant a
    // last-known-good copy.
    chown(&spool_dir, 0);
    chmod(dir.path(), 0o770);
    let mut agent = AgentProc::spawn(&cfg, &set, dir.path());
    let status = agent.wait(Duration::from_secs(10));
    let log = agent.log_text();
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{log}");
    assert!(
        log.contains(&format!("config directory {}", dir.path().display()))
            && log.contains("chmod go-w"),
        "{log}"
    );
    // The same directories, mode 0700 and owned by root: fine.
    chmod(dir.path(), 0o700);
    let mut agent = AgentProc::spawn(&cfg, &set, dir.path());
    wait_open(&agent);
    assert_eq!(
        agent
            .terminate(Duration::from_secs(15))
            .and_then(|s| s.code()),
        Some(0)
    );
}

#[test]
fn a_damaged_marker_the_agent_did_not_write_is_ignored_by_name_and_the_spool_kept() {
    let Board { dir, cfg, db } = Board::new(NO_BROKER, &prefix("marker"), 50);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(wait_for(Duration::from_secs(20), || db.exists() && total(&db) > 5));
    agent.terminate(Duration::from_secs(15));
    let rows = total(&db);
    let marker = dir.path().join("spool.db.damaged");
    std::fs::write(&marker, "quick_check: planted by someone else").expect("plant");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    wait_open(&agent);
    std::thread::sleep(Duration::from_millis(500));
    agent.terminate(Duration::from_secs(15));
    let log = agent.log_text();
    let aside = std::fs::read_dir(dir.path())
        .expect("read dir")
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().contains(".corrupt-"));
    assert!(!aside, "a planted marker moved the spool aside\n{log}");
    assert!(total(&db) >= rows, "rows lost\n{log}");
    assert!(
        agent.logged("WARN", "spool", &marker.display().to_string()),
        "the planted marker is not named in a warning\n{log}"
    );
}

#[test]
fn a_process_already_listening_on_the_ingest_socket_is_named_and_keeps_its_clients() {
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &prefix("squat"), 1000);
    let sock = add_ingest(&cfg, "[[ingest.streams]]\nname = \"pump\"\n");
    std::fs::create_dir_all(sock.parent().expect("dir")).expect("mkdir");
    // Someone else got there first (this test process plays them).
    let squatter = UnixListener::bind(&sock).expect("bind");
    squatter.set_nonblocking(true).expect("nonblocking");
    let ino = std::fs::symlink_metadata(&sock).expect("stat").ino();
    let mut agent = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    let me = format!("pid {}", std::process::id());
    let named = agent.wait_log(Duration::from_secs(20), &me) || !agent.is_running();
    let log = agent.log_text();
    assert!(
        named && log.contains(&me) && log.contains(&sock.display().to_string()),
        "the conflict does not name the listening process\n{log}"
    );
    wait_open(&agent);
    assert!(agent.is_running(), "the agent did not start\n{log}");
    // A client's reading goes to whoever listens, never answered by the agent.
    let mut client = UnixStream::connect(&sock).expect("connect");
    client
        .write_all(b"{\"stream\":\"pump\",\"fields\":{\"v\":1}}\n")
        .expect("send");
    client
        .set_read_timeout(Some(Duration::from_millis(1500)))
        .expect("timeout");
    let mut got = String::new();
    let received = wait_for(Duration::from_secs(5), || {
        while let Ok((s, _)) = squatter.accept() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let mut line = String::new();
            let _ = BufReader::new(s).read_line(&mut line);
            got.push_str(&line);
        }
        got.contains("pump")
    });
    assert!(received, "the squatter never saw the client's line");
    let mut reply = [0u8; 64];
    let n = client.read(&mut reply).unwrap_or(0);
    assert_eq!(n, 0, "someone answered: {:?}", &reply[..n]);
    assert!(
        agent.logged("ERROR", "ingest", "pid"),
        "{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    // The agent neither removed nor replaced the socket file.
    let m = std::fs::symlink_metadata(&sock).expect("the socket is still there");
    assert_eq!(m.ino(), ino);
}
