//! The `edgespool sink` binary as a child process, and the broker settings
//! a fleet of sinks needs.

use super::{tail, wait_for};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The broker settings docs/fleet.md's fleet layout asks for: room for a
/// whole batch in flight per sink, and no limit on what is queued for a
/// sink that is down (mosquitto's default, 1000, drops QoS 1 beyond it).
pub const BROKER_EXTRA: &str = "max_inflight_messages 1000\nmax_queued_messages 0\n";

/// A sink process.
pub struct SinkProc {
    pub child: Child,
    pub log: PathBuf,
}

impl SinkProc {
    pub fn spawn(
        port: u16,
        filter: &str,
        conninfo: &str,
        id: &str,
        group: &str,
        dir: &Path,
    ) -> SinkProc {
        SinkProc::spawn_with(port, filter, conninfo, id, group, dir, &[])
    }

    /// As [`SinkProc::spawn`], with more arguments.
    pub fn spawn_with(
        port: u16,
        filter: &str,
        conninfo: &str,
        id: &str,
        group: &str,
        dir: &Path,
        extra: &[&str],
    ) -> SinkProc {
        let mut args = vec!["--postgres", conninfo, "--client-id", id, "--share", group];
        args.extend_from_slice(extra);
        SinkProc::launch(port, filter, id, dir, &args)
    }

    /// A sink storing into the SQLite file `db`, under client id `id` (a
    /// persistent session: a sink started again with the same id gets what
    /// the broker holds unacknowledged).
    pub fn spawn_sqlite(port: u16, filter: &str, db: &Path, id: &str, dir: &Path) -> SinkProc {
        SinkProc::spawn_sqlite_with(port, filter, db, id, dir, &[])
    }

    /// As [`SinkProc::spawn_sqlite`], with more arguments.
    pub fn spawn_sqlite_with(
        port: u16,
        filter: &str,
        db: &Path,
        id: &str,
        dir: &Path,
        extra: &[&str],
    ) -> SinkProc {
        let db = db.to_str().expect("UTF-8 path");
        let mut args = vec!["--db", db, "--client-id", id];
        args.extend_from_slice(extra);
        SinkProc::launch(port, filter, id, dir, &args)
    }

    /// `edgespool sink --url .. --topic FILTER ARGS..` (the store and the
    /// client id among `args`), logging to `dir/ID-N.log`.
    pub fn launch_args(port: u16, filter: &str, id: &str, dir: &Path, args: &[&str]) -> SinkProc {
        SinkProc::launch(port, filter, id, dir, args)
    }

    /// `edgespool sink --url .. --topic FILTER ARGS..`, logging to
    /// `dir/ID-N.log` (the first N not taken).
    fn launch(port: u16, filter: &str, id: &str, dir: &Path, args: &[&str]) -> SinkProc {
        let url = format!("mqtt://127.0.0.1:{port}");
        let mut all = vec!["--url", &url, "--topic", filter];
        all.extend_from_slice(args);
        SinkProc::launch_only(id, dir, &all, &[])
    }

    /// `edgespool sink ARGS..` and nothing else (a `--config` run), with
    /// `envs` set, logging to `dir/ID-N.log` (the first N not taken).
    pub fn launch_only(id: &str, dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> SinkProc {
        SinkProc::launch_cmd(super::agent::command(), id, dir, args, envs)
    }

    /// [`SinkProc::launch_only`] of the binary `bin` (a bench's release
    /// build, say), with no runner in front.
    pub fn launch_bin(bin: &Path, id: &str, dir: &Path, args: &[&str]) -> SinkProc {
        SinkProc::launch_cmd(Command::new(bin), id, dir, args, &[])
    }

    fn launch_cmd(
        mut cmd: Command,
        id: &str,
        dir: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> SinkProc {
        let n = (1..)
            .find(|n| !dir.join(format!("{id}-{n}.log")).exists())
            .expect("a free log name");
        let log = dir.join(format!("{id}-{n}.log"));
        let f = std::fs::File::create(&log).expect("sink log");
        // Receipts are signed by the test fleet's key, unless the test says
        // otherwise (`--no-receipts`, its own `--receipt-key`, a `--config`
        // file, a report).
        let own = [
            "--no-receipts",
            "--receipt-key",
            "--config",
            "--stats",
            "-c",
        ];
        let key = super::keys::fleet_key()
            .file
            .to_str()
            .expect("UTF-8 path")
            .to_owned();
        let key_args: Vec<&str> = if args.iter().any(|a| own.contains(a)) {
            Vec::new()
        } else {
            vec!["--receipt-key", &key]
        };
        let child = cmd
            .arg("sink")
            .args(args)
            .args(&key_args)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("clone log"))
            .stderr(f)
            .spawn()
            .expect("start the sink");
        SinkProc { child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the sink logged its SUBACK.
    pub fn wait_subscribed(&self) {
        assert!(
            self.subscribed(Duration::from_secs(30)),
            "sink did not subscribe:\n{}",
            tail(&self.log_text(), 20)
        );
    }

    /// Wait up to `timeout` until the sink logged its SUBACK.
    pub fn subscribed(&self, timeout: Duration) -> bool {
        wait_for(timeout, || self.log_text().contains("sink: subscribed"))
    }

    /// The exit status, once the sink ended (within `timeout`).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        wait_for(timeout, || {
            status = self.child.try_wait().ok().flatten();
            status.is_some()
        });
        status
    }

    pub fn kill(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// SIGTERM, then SIGKILL if it has not stopped within 15 s.
    pub fn terminate(&mut self) {
        self.stop(Duration::from_secs(15));
    }

    /// SIGTERM, then SIGKILL if it has not stopped within `grace`.
    pub fn stop(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        super::terminate(&mut self.child, grace)
    }
}

impl Drop for SinkProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `edgespool sink --stats ARGS..` (ARGS name the store): its report;
/// panics with stderr unless it exits 0.
pub fn stats(args: &[&str]) -> String {
    let mut all = vec!["sink", "--stats"];
    all.extend_from_slice(args);
    let (status, out, err) = super::agent::run_cli(&all);
    assert_eq!(status.code(), Some(0), "sink --stats {args:?}: {err}");
    out
}

/// [`stats`] with `--json`, parsed.
pub fn stats_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = stats(&all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("sink --stats JSON ({e}): {out}"))
}

/// event id -> (payload, deliveries) in the SQLite store of a sink at
/// `db` (empty before the sink has created it).
pub fn sqlite_received(db: &Path) -> std::collections::HashMap<String, (Vec<u8>, i64)> {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return Default::default();
    };
    let Ok(mut st) = c.prepare("SELECT event_id, payload, deliveries FROM received") else {
        return Default::default();
    };
    st.query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .and_then(|rows| rows.collect())
        .unwrap_or_default()
}
