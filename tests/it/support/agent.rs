//! Running the real `edgespool` binary.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{tail, wait_for};

/// How long `run_cli` lets a command run before killing it and panicking.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(30);

/// Path of the binary under test: `EDGESPOOL_AGENT_BIN` if set (an ARM
/// build, say), else the one cargo built for these tests.
pub fn bin() -> PathBuf {
    let bin = std::env::var_os("EDGESPOOL_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_edgespool")));
    assert!(
        bin.is_file(),
        "agent binary {} does not exist (EDGESPOOL_AGENT_BIN?)",
        bin.display()
    );
    bin
}

/// A command that runs the binary under test: `EDGESPOOL_AGENT_RUNNER`
/// (e.g. `qemu-arm -L /usr/arm-linux-gnueabihf`) in front of it when set.
/// Signals sent to the runner reach the emulated agent (qemu-user forwards
/// them; SIGKILL kills both, as one process).
///
/// `device_id = "@machine-id"` reads `tests/fixtures/machine-id`
/// (`EDGESPOOL_MACHINE_ID_FILE`), not this machine's: the shipped config
/// validates where `/etc/machine-id` is missing (a container). A test that
/// makes boards of its own sets the variable again.
pub fn command() -> Command {
    let mut cmd = match std::env::var("EDGESPOOL_AGENT_RUNNER") {
        Ok(r) if !r.trim().is_empty() => {
            let mut parts = r.split_whitespace();
            let mut cmd = Command::new(parts.next().unwrap_or("env"));
            cmd.args(parts).arg(bin());
            cmd
        }
        _ => Command::new(bin()),
    };
    cmd.env(
        edgespool::os::identity::MACHINE_ID_ENV,
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/machine-id"),
    );
    cmd
}

/// The RUST_LOG given to spawned agents: EDGESPOOL_TEST_LOG if set, else debug.
pub fn agent_log_filter() -> String {
    std::env::var("EDGESPOOL_TEST_LOG").unwrap_or_else(|_| "debug".to_string())
}

pub struct AgentProc {
    child: Child,
    /// Directory the agent's log file lives in (as passed to `spawn`).
    pub dir: PathBuf,
    /// `<dir>/agent-<n>.log`, receiving both stdout and stderr.
    pub log_path: PathBuf,
    /// Set once the process has been reaped.
    status: Option<ExitStatus>,
}

impl AgentProc {
    /// Spawn `<bin> run --config <config_path> [--set k=v]...` with
    /// RUST_LOG=debug (or EDGESPOOL_TEST_LOG), stdout and stderr going to
    /// `<dir>/agent-<n>.log`, where n is the first number (from 1) whose log
    /// does not exist yet in `dir`.
    pub fn spawn(config_path: &Path, sets: &[String], dir: &Path) -> AgentProc {
        AgentProc::spawn_with_env(config_path, sets, dir, &[])
    }

    /// Like [`AgentProc::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        config_path: &Path,
        sets: &[String],
        dir: &Path,
        envs: &[(&str, &str)],
    ) -> AgentProc {
        AgentProc::spawn_customized(config_path, sets, dir, envs, |_| {})
    }

    /// Like [`AgentProc::spawn_with_env`], with `customize` applied to the
    /// command last (a `pre_exec` hook that hands the agent a descriptor,
    /// say).
    pub fn spawn_customized(
        config_path: &Path,
        sets: &[String],
        dir: &Path,
        envs: &[(&str, &str)],
        customize: impl FnOnce(&mut Command),
    ) -> AgentProc {
        let log = agent_log_filter();
        AgentProc::launch(command(), config_path, sets, dir, envs, &log, customize)
    }

    /// The binary `bin` (a bench's release build, say) run as the agent
    /// with RUST_LOG=`log`, no runner in front, otherwise as
    /// [`AgentProc::spawn`].
    pub fn spawn_bin(bin: &Path, config_path: &Path, dir: &Path, log: &str) -> AgentProc {
        AgentProc::launch(Command::new(bin), config_path, &[], dir, &[], log, |_| {})
    }

    fn launch(
        mut cmd: Command,
        config_path: &Path,
        sets: &[String],
        dir: &Path,
        envs: &[(&str, &str)],
        log_filter: &str,
        customize: impl FnOnce(&mut Command),
    ) -> AgentProc {
        std::fs::create_dir_all(dir)
            .unwrap_or_else(|e| panic!("create agent dir {}: {e}", dir.display()));
        let (log_path, log) = claim_log_file(dir);
        let log_err = log
            .try_clone()
            .unwrap_or_else(|e| panic!("clone handle of {}: {e}", log_path.display()));
        cmd.arg("run").arg("--config").arg(config_path);
        for set in sets {
            cmd.arg("--set").arg(set);
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.env("RUST_LOG", log_filter)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        customize(&mut cmd);
        let program = cmd.get_program().to_owned();
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "spawn {} run --config {}: {e}",
                program.to_string_lossy(),
                config_path.display()
            )
        });
        AgentProc {
            child,
            dir: dir.to_path_buf(),
            log_path,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True while the process has not exited (reaps it if it has).
    pub fn is_running(&mut self) -> bool {
        self.poll_exit().is_none()
    }

    /// The exit status, if the process has exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.poll_exit()
    }

    /// A real SIGKILL, then reap. A no-op if the process has already exited.
    pub fn kill9(&mut self) {
        if self.poll_exit().is_some() {
            return;
        }
        self.signal(libc::SIGKILL);
        let status = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("reap agent pid {}: {e}", self.pid()));
        self.status = Some(status);
    }

    /// SIGTERM, then wait up to `timeout` for the process to exit. Returns its
    /// exit status, or None if it had to be SIGKILLed. If it had already
    /// exited, returns that status without signalling.
    pub fn terminate(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if let Some(status) = self.poll_exit() {
            return Some(status);
        }
        self.signal(libc::SIGTERM);
        match self.wait(timeout) {
            Some(status) => Some(status),
            None => {
                self.kill9();
                None
            }
        }
    }

    /// Wait up to `timeout` for the process to exit on its own.
    pub fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.poll_exit() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Send a signal (e.g. libc::SIGHUP) to the running process.
    pub fn signal(&mut self, sig: libc::c_int) {
        if self.poll_exit().is_some() {
            return;
        }
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits in pid_t");
        // SAFETY: plain kill(2) on our own, not yet reaped child, so the pid
        // cannot have been reused by another process.
        let rc = unsafe { libc::kill(pid, sig) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            // ESRCH cannot happen for an unreaped child, but a zombie is fine.
            assert_eq!(
                err.raw_os_error(),
                Some(libc::ESRCH),
                "kill({pid}, {sig}) failed: {err}"
            );
        }
    }

    /// Everything the agent has written to stdout and stderr so far.
    pub fn log_text(&self) -> String {
        match std::fs::read(&self.log_path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("<cannot read {}: {e}>", self.log_path.display()),
        }
    }

    /// Whether a log line at `level` (`WARN`, `ERROR`, ...) from the part
    /// `part` of the agent (`agent`, `mqtt`: the target `edgespool::<part>`
    /// or a module inside it) says `text`.
    pub fn logged(&self, level: &str, part: &str, text: &str) -> bool {
        let target = format!("edgespool::{part}");
        self.log_text().lines().any(|l| {
            let Some(at) = l.find(&format!("{level} ")) else {
                return false;
            };
            let rest = l[at + level.len()..].trim_start();
            let in_part = rest
                .strip_prefix(&target)
                .is_some_and(|r| r.starts_with(']') || r.starts_with("::") || r.starts_with(':'));
            in_part && l.contains(text)
        })
    }

    /// Wait up to `timeout` until the log holds `text`.
    pub fn wait_log(&self, timeout: Duration, text: &str) -> bool {
        wait_for(timeout, || self.log_text().contains(text))
    }

    /// Wait up to `timeout` for a log line holding `text` and return the
    /// first such line; panics with the log's tail if none came.
    pub fn await_line(&self, timeout: Duration, text: &str) -> String {
        let mut line = None;
        let found = wait_for(timeout, || {
            line = self
                .log_text()
                .lines()
                .find(|l| l.contains(text))
                .map(str::to_owned);
            line.is_some()
        });
        assert!(
            found,
            "no log line with {text:?} within {timeout:?}:\n{}",
            self.log_tail(30)
        );
        line.unwrap_or_default()
    }

    /// SIGTERM, then assert the agent stopped by itself within `timeout`
    /// and exited 0 (panics with the log tail otherwise).
    pub fn terminate_clean(&mut self, timeout: Duration) {
        let status = self.terminate(timeout);
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(0),
            "{}",
            self.log_tail(40)
        );
    }

    /// The last `lines` lines of the log (for assertion messages).
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log_text(), lines)
    }

    fn poll_exit(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("try_wait on agent pid {}: {e}", self.child.id()));
        }
        self.status
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if self.status.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Create `<dir>/agent-<n>.log` for the first n (from 1) not taken yet.
fn claim_log_file(dir: &Path) -> (PathBuf, File) {
    for n in 1..10_000 {
        let path = dir.join(format!("agent-{n}.log"));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return (path, file),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("create {}: {e}", path.display()),
        }
    }
    panic!("no free agent-<n>.log name in {}", dir.display());
}

/// Run `<bin> <args>` to completion (30 s at most, then kill and panic),
/// returning (exit status, stdout, stderr).
pub fn run_cli(args: &[&str]) -> (ExitStatus, String, String) {
    run_cli_with(args, &[], CLI_TIMEOUT)
}

/// Like [`run_cli`], with extra environment variables and a chosen timeout.
pub fn run_cli_with(
    args: &[&str],
    envs: &[(&str, &str)],
    timeout: Duration,
) -> (ExitStatus, String, String) {
    let mut cmd = command();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {} {args:?}: {e}", bin().display()));
    // Drain both pipes on their own threads so a chatty child cannot block.
    let out = drain(child.stdout.take().expect("piped stdout"));
    let err = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let stderr = err.join().unwrap_or_default();
                panic!(
                    "`edgespool {}` did not finish within {timeout:?}; stderr tail:\n{}",
                    args.join(" "),
                    tail(&stderr, 30)
                );
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("try_wait on `edgespool {}`: {e}", args.join(" ")),
        }
    };
    let stdout = out.join().expect("stdout reader thread panicked");
    let stderr = err.join().expect("stderr reader thread panicked");
    (status, stdout, stderr)
}

fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}
