//! The files the agent makes in its state directory are 0640 or stricter
//! (directories 0750) whatever the umask it runs under: the spool, its
//! `-wal` and `-shm` (SQLite gives them the database file's mode), the lock,
//! the storage profile, the last-known-good config, the clean-stop stamp;
//! and the ingest socket's directory is 0755. Through the real binary,
//! under umask 022 (a shell's) and 000.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::wait_for;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every entry under `dir` with its permission bits.
fn modes(dir: &Path, out: &mut Vec<(PathBuf, bool, u32)>) {
    for e in std::fs::read_dir(dir).expect("read dir") {
        let p = e.expect("entry").path();
        let m = std::fs::symlink_metadata(&p).expect("metadata");
        out.push((p.clone(), m.is_dir(), m.permissions().mode() & 0o7777));
        if m.is_dir() {
            modes(&p, out);
        }
    }
}

/// The entries of `state` over 0640 (files) or 0750 (directories).
fn too_open(state: &Path) -> (Vec<String>, Vec<String>) {
    let mut all = Vec::new();
    modes(state, &mut all);
    let names = all
        .iter()
        .map(|(p, _, _)| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let bad = all
        .iter()
        .filter(|(_, dir, m)| {
            if *dir {
                m & !0o750 != 0
            } else {
                m & !0o640 != 0
            }
        })
        .map(|(p, _, m)| format!("{} {m:o}", p.display()))
        .collect();
    (names, bad)
}

#[test]
fn state_files_are_0640_or_stricter_under_umask_022_and_000() {
    let broker = Broker::start();
    for umask in [0o022, 0o000] {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        std::fs::DirBuilder::new()
            .mode(0o750)
            .create(&state)
            .expect("state dir");
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o750)).expect("chmod");
        let cfg = dir.path().join("board.toml");
        std::fs::write(
            &cfg,
            format!(
                "device_id = \"modes\"\n[spool]\npath = \"{}/spool/spool.db\"\ncommit_window_ms = 50\n[mqtt]\nurl = \"{}\"\n[[sources]]\nname = \"system\"\nkind = \"system\"\ninterval_ms = 200\n[ingest]\nsocket = \"{}/run/ingest.sock\"\nstream_patterns = [\"m.*\"]\n",
                state.display(),
                broker.url(),
                dir.path().display()
            ),
        )
        .expect("config");
        let state_s = state.to_str().expect("utf-8").to_owned();
        let mut agent = AgentProc::spawn_customized(
            &cfg,
            &[],
            &dir.path().join("logs"),
            &[("STATE_DIRECTORY", &state_s)],
            |cmd| {
                // SAFETY: umask(2) is async-signal-safe and cannot fail.
                unsafe {
                    cmd.pre_exec(move || {
                        libc::umask(umask);
                        Ok(())
                    });
                }
            },
        );
        let spool = state.join("spool");
        let want = [
            spool.join("spool.db"),
            spool.join("spool.db-wal"),
            spool.join("spool.db-shm"),
            spool.join("spool.db.lock"),
            spool.join("storage-profile.json"),
            state.join("board.toml.last-good"),
        ];
        let db = spool.join("spool.db");
        assert!(
            wait_for(Duration::from_secs(20), || want.iter().all(|p| p.exists())
                && db.exists()
                && crate::support::spool::total(&db) > 0),
            "umask {umask:03o}: not all of {want:?} appeared\n{}",
            agent.log_tail(30)
        );
        let (names, bad) = too_open(&state);
        assert!(bad.is_empty(), "umask {umask:03o}, running: {bad:?}");
        // The socket's directory: 0755 (clients reach the socket, whose
        // own mode, 0660, says who may connect); nobody else writes there.
        let run = dir.path().join("run");
        let sock = run.join("ingest.sock");
        assert!(wait_for(Duration::from_secs(10), || sock.exists()));
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode(&run), 0o755, "umask {umask:03o}: {}", run.display());
        assert_eq!(mode(&sock) & 0o777, 0o660, "umask {umask:03o}: the socket");
        assert!(names.len() >= want.len(), "{names:?}");
        assert!(agent
            .terminate(Duration::from_secs(20))
            .is_some_and(|s| s.success()));
        assert!(spool.join("spool.db.clean").exists(), "no clean-stop stamp");
        let (_, bad) = too_open(&state);
        assert!(bad.is_empty(), "umask {umask:03o}, stopped: {bad:?}");
    }
}
