//! Bounded child processes: a program run with fixed arguments, its output
//! captured within limits, killed with everything it started if it runs
//! too long.
//!
//! This module owns starting, draining, waiting for, killing and reaping the
//! programs the agent runs (exec sources, exec command handlers). It does not
//! interpret their output or decide what a failure means; callers do.
//!
//! Its one rule: **a run never outlives its timeout, nor its end: when the
//! program has exited and its output is collected, or at the timeout, every
//! process it started is killed; its output is bounded, it is never run
//! through a shell, and it gets nothing of the agent it was not given.**
//!
//! - The program is executed directly (`execve`), so arguments are passed as
//!   they are: no globbing, quoting, expansion or command separators.
//! - It runs in a kill scope of its own ([`scope`]): a supervisor forked
//!   from the agent is a child subreaper and the program's parent, so every
//!   process of the run, including one that calls `setsid` or double-forks,
//!   stays under it; when the run ends or times out all of them are killed
//!   and reaped, and no process outside the run is ever signalled.
//! - Both pipes are drained by reader threads that keep at most a fixed
//!   number of bytes and read and discard the rest ([`pipes`]), so a chatty
//!   child never blocks on a full pipe and never grows our memory.
//! - The timeout runs from start until the program has exited *and* both
//!   pipes are closed; a helper still holding one is killed at the timeout.
//!   Waiting needs no process-wide SIGCHLD handler: the supervisor reports
//!   the program's exit status on a pipe.
//! - A killed run is reaped; a process that refuses to die (uninterruptible
//!   sleep on a hung bus) is left to a background thread after a short
//!   grace so the caller goes on.
//! - Every child is confined ([`Confinement`]), all set between fork and
//!   exec ([`spawn`]): its environment is only the one it is given (the
//!   agent's never reaches it), every descriptor above 2 is closed whatever
//!   the agent inherited, and it gets its working directory, resource
//!   limits and user where the caller names them.

mod fds;
mod pipes;
mod scope;
mod spawn;
mod users;

pub(crate) use pipes::Captured;
pub use users::{can_switch_user, lookup_group, lookup_user};

use pipes::{start_readers, Pipe, Stream};
use scope::Scope;
use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

/// How often a killed run is looked at again; short enough that a kill
/// takes little longer than needed, long enough to cost nothing on a small
/// CPU.
const POLL: Duration = Duration::from_millis(10);
/// Caps the deadline so `Instant + timeout` cannot overflow however large the
/// requested timeout.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// After SIGKILL a process normally goes at once; one stuck in uninterruptible
/// sleep (a hung bus) may not, and must not stall the caller.
const REAP_GRACE: Duration = Duration::from_secs(2);
/// After a kill, how long the readers get to pick up what was still in the
/// pipes. Once the run is dead the pipes close at once; this only bounds
/// the wait when something outside the run still holds one.
const DRAIN_GRACE: Duration = Duration::from_millis(200);

/// `PATH` of a child unless its environment names one: the system
/// directories only, never the agent's own `PATH`.
pub const CHILD_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";
/// `LANG` of a child unless its environment names one: UTF-8 without
/// translated messages, so output is the same on every board. Where the
/// C library has no `C.UTF-8` locale, programs fall back to `C`.
pub const CHILD_LANG: &str = "C.UTF-8";

/// The whole environment of a child: `PATH` = [`CHILD_PATH`], `LANG` =
/// [`CHILD_LANG`], and `extra` (which may replace either), sorted by name.
/// Nothing is inherited from the agent.
pub fn child_env(extra: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut env: BTreeMap<&str, &str> = BTreeMap::new();
    env.insert("PATH", CHILD_PATH);
    env.insert("LANG", CHILD_LANG);
    for (name, value) in extra {
        env.insert(name, value);
    }
    env.into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Resource limits a confined child gets before it execs (`setrlimit`).
///
/// Each one is the lower of the value here and the agent's own hard limit
/// (an unprivileged agent cannot raise it). The hard limit is set as well as
/// the soft one, so a program not running as root cannot raise it again
/// (root can: give the handler a `user` to make the limits stick).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_CPU`: seconds of CPU time (user + system) the process may
    /// use. At this the kernel sends it SIGXCPU (which ends it unless it is
    /// handled), one second later SIGKILL. Counted per process: helpers it
    /// starts each get their own allowance.
    pub cpu_secs: u64,
    /// `RLIMIT_AS`: bytes of virtual address space. Allocations and
    /// mappings beyond it fail (`ENOMEM`); it bounds reserved memory, not
    /// only resident memory. Values the board cannot represent mean no limit.
    pub max_memory_bytes: u64,
    /// `RLIMIT_NOFILE`: open file descriptors, counting stdin, stdout and
    /// stderr (one more than the highest descriptor number it may open).
    pub max_open_files: u64,
}

/// The user a confined child runs as. Set in the child before exec, in
/// this order: supplementary groups to just `gid` (`setgroups`), `setgid`,
/// `setuid`, so no group or privilege of the agent is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credentials {
    /// User id (`setuid`).
    pub uid: libc::uid_t,
    /// Group id (`setgroups([gid])`, `setgid`).
    pub gid: libc::gid_t,
}

/// What a child gets instead of what the agent has. Whatever it says, a
/// child keeps no descriptor above 2 and runs in its own kill scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// Its whole environment, in this order; nothing is inherited (see
    /// [`child_env`]).
    pub env: Vec<(String, String)>,
    /// Its working directory (absolute), entered after the switch to
    /// [`Confinement::credentials`], so it must be reachable by that user;
    /// `None`: the agent's.
    pub cwd: Option<PathBuf>,
    /// Its resource limits; `None`: the agent's.
    pub limits: Option<Limits>,
    /// The user it runs as; `None`: the agent's own.
    pub credentials: Option<Credentials>,
}

impl Confinement {
    /// The least a child gets: [`child_env`] with nothing added, the
    /// agent's working directory, limits and user.
    pub fn base() -> Confinement {
        Confinement {
            env: child_env(&BTreeMap::new()),
            cwd: None,
            limits: None,
            credentials: None,
        }
    }
}

/// What a program that ran to completion produced.
#[derive(Debug)]
pub struct Output {
    /// How it ended: an exit code or a signal.
    pub status: ExitStatus,
    /// The first `max_output_bytes` of its stdout.
    pub stdout: Vec<u8>,
    /// More came on stdout than was kept.
    pub stdout_truncated: bool,
    /// The first `max_output_bytes` of its stderr.
    pub stderr: Vec<u8>,
    /// More came on stderr than was kept.
    pub stderr_truncated: bool,
    /// From start until it had exited and both pipes were closed.
    pub duration: Duration,
}

/// Why a program did not run to completion.
#[derive(Debug)]
pub enum RunError {
    /// It could not be started: not found, not executable, its set-up
    /// (limits, user, working directory) failed, or the threads draining
    /// its output could not be created.
    Spawn {
        /// The program that was to be run.
        program: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// It had not exited and closed both pipes by the timeout. Every
    /// process of the run was killed and reaped.
    Timeout {
        /// The program that was run.
        program: PathBuf,
        /// The timeout that was requested.
        after: Duration,
        /// Stdout captured before the kill (bounded; may be empty).
        stdout: Vec<u8>,
        /// Stderr captured before the kill (bounded; may be empty).
        stderr: Vec<u8>,
    },
    /// Waiting for it or reading its output failed.
    Io {
        /// The program that was run.
        program: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Spawn { program, source } => {
                write!(f, "cannot run {}: {source}", program.display())
            }
            RunError::Timeout { program, after, .. } => write!(
                f,
                "{} timed out after {after:?} and was killed",
                program.display()
            ),
            RunError::Io { program, source } => {
                write!(f, "I/O error while running {}: {source}", program.display())
            }
        }
    }
}

// The cause is already part of the one-line Display message, so `source()` is
// left empty to keep error reporters from printing it twice.
impl std::error::Error for RunError {}

/// Run `program` (an absolute path; no `PATH` lookup) with `args` (no
/// shell), confined as [`Confinement::base`] says, stdin null, every
/// process of the run killed after `timeout`; stdout and stderr each kept
/// up to `max_output_bytes` (the rest drained and discarded, flagged
/// truncated).
///
/// Blocks for at most about `timeout`, plus up to ~2 s more only if a killed
/// program refuses to die. A non-zero exit or a death by signal is not an
/// error here: it is in [`Output::status`].
///
/// # Errors
///
/// [`RunError::Spawn`] if it cannot be started, [`RunError::Timeout`] if it
/// (or a helper holding its stdout or stderr) is still running at the
/// timeout, [`RunError::Io`] if waiting for it or reading a pipe fails.
pub fn run_bounded(
    program: &Path,
    args: &[String],
    timeout: Duration,
    max_output_bytes: usize,
) -> Result<Output, RunError> {
    run_confined(
        program,
        args,
        timeout,
        max_output_bytes,
        &Confinement::base(),
    )
}

/// [`run_bounded`], with the child confined as `confinement` says: only its
/// environment and, where given, its working directory, its resource
/// limits and its user, all set between fork and exec.
///
/// A death by the CPU limit shows in [`Output::status`] as signal SIGXCPU
/// (or SIGKILL if the program handled SIGXCPU).
///
/// # Errors
///
/// As [`run_bounded`]. A failure to set up the child (limits, user, working
/// directory; e.g. a directory the user cannot enter) is a
/// [`RunError::Spawn`] carrying the OS error; the program did not run.
pub fn run_confined(
    program: &Path,
    args: &[String],
    timeout: Duration,
    max_output_bytes: usize,
    confinement: &Confinement,
) -> Result<Output, RunError> {
    let mut running = Running::start(
        program,
        args,
        timeout,
        (max_output_bytes, max_output_bytes),
        confinement,
    )?;
    let status = running.wait()?;
    let stdout = running.stdout()?;
    let stderr = running.stderr()?;
    let duration = running.started.elapsed();
    // Ends the run: a helper that holds neither pipe dies here.
    drop(running);
    Ok(Output {
        status,
        stdout: stdout.bytes,
        stdout_truncated: stdout.truncated,
        stderr: stderr.bytes,
        stderr_truncated: stderr.truncated,
        duration,
    })
}

/// A started program, for callers that need the steps of
/// [`run_confined`] separately (an exec source wants only stderr of a
/// program that failed, and only stdout of one that succeeded, with separate
/// limits).
///
/// Every step shares the deadline set at [`Running::start`]; a step that
/// meets it kills the run and returns [`RunError::Timeout`]. Dropping a
/// `Running` ends the run: every process of it still there is killed and
/// reaped.
pub(crate) struct Running {
    program: PathBuf,
    timeout: Duration,
    started: Instant,
    deadline: Instant,
    scope: Scope,
    status: Option<ExitStatus>,
    stdout: Pipe,
    stderr: Pipe,
}

impl Running {
    /// Start `program` confined as `confinement` says, in its own kill
    /// scope, stdin null, and begin draining its stdout and stderr, keeping
    /// at most `stdout_keep` and `stderr_keep` bytes.
    pub(crate) fn start(
        program: &Path,
        args: &[String],
        timeout: Duration,
        (stdout_keep, stderr_keep): (usize, usize),
        confinement: &Confinement,
    ) -> Result<Running, RunError> {
        let started = Instant::now();
        let deadline = started + timeout.min(MAX_TIMEOUT);
        let spawn_err = |source| RunError::Spawn {
            program: program.to_path_buf(),
            source,
        };
        let plan = spawn::plan(program, args, confinement).map_err(spawn_err)?;
        let mut scope =
            start_in_thread(move || spawn::start(plan), drop, deadline).map_err(spawn_err)?;
        let readers = match scope.supervisor() {
            Some(child) => start_readers(child, stdout_keep, stderr_keep),
            None => Err(io::Error::other("the run ended before it started")),
        };
        // On an error, dropping `scope` ends the run.
        let (stdout, stderr) = readers.map_err(spawn_err)?;
        Ok(Running {
            program: program.to_path_buf(),
            timeout,
            started,
            deadline,
            scope,
            status: None,
            stdout,
            stderr,
        })
    }

    /// Waits for the program to exit, until the deadline.
    pub(crate) fn wait(&mut self) -> Result<ExitStatus, RunError> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        if self.scope.ended() {
            // Already killed by an earlier step that timed out.
            return Err(self.timed_out());
        }
        match self.scope.wait(self.deadline) {
            Ok(Some(status)) => {
                self.status = Some(status);
                Ok(status)
            }
            Ok(None) => Err(self.timed_out()),
            Err(source) => {
                self.scope.end();
                Err(RunError::Io {
                    program: self.program.clone(),
                    source,
                })
            }
        }
    }

    /// Stdout, once every writer has closed it, until the deadline. A helper
    /// the program left behind may hold it open; it is killed at the deadline.
    pub(crate) fn stdout(&mut self) -> Result<Captured, RunError> {
        let result = self.stdout.finish(self.deadline);
        self.collect(result, Stream::Stdout)
    }

    /// Stderr, as [`Running::stdout`].
    pub(crate) fn stderr(&mut self) -> Result<Captured, RunError> {
        let result = self.stderr.finish(self.deadline);
        self.collect(result, Stream::Stderr)
    }

    fn collect(
        &mut self,
        finished: Option<io::Result<()>>,
        stream: Stream,
    ) -> Result<Captured, RunError> {
        match finished {
            Some(Ok(())) => Ok(match stream {
                Stream::Stdout => self.stdout.snapshot(),
                Stream::Stderr => self.stderr.snapshot(),
            }),
            Some(Err(source)) => Err(RunError::Io {
                program: self.program.clone(),
                source,
            }),
            None => Err(self.timed_out()),
        }
    }

    /// Kills the run, gives the readers a moment to pick up what was left
    /// in the pipes, and returns the timeout error with what was captured.
    fn timed_out(&mut self) -> RunError {
        self.scope.end();
        let grace = Instant::now() + DRAIN_GRACE;
        // Their results do not matter: whatever was kept is returned.
        let _ = self.stdout.finish(grace);
        let _ = self.stderr.finish(grace);
        RunError::Timeout {
            program: self.program.clone(),
            after: self.timeout,
            stdout: self.stdout.snapshot().bytes,
            stderr: self.stderr.snapshot().bytes,
        }
    }
}

/// Runs `start` (a fork, then the wait until the child has exec'd) on a
/// thread of its own, giving up at `deadline`.
///
/// `Command::spawn` returns only once the child has exec'd or failed: it
/// reads a close-on-exec pipe until every holder of its write end is
/// gone, and [`spawn::start`] waits the same way on its exec probe. In a
/// multi-threaded process another child forked in that moment holds them
/// too, and a forked child that never reaches exec holds them for good.
/// If `start` has not returned by the deadline the caller gets an error
/// and goes on, and the thread, should it ever return, hands what it
/// started to `abandon` (which must kill and reap it).
fn start_in_thread<T: Send + 'static>(
    start: impl FnOnce() -> io::Result<T> + Send + 'static,
    abandon: impl FnOnce(T) + Send + 'static,
    deadline: Instant,
) -> io::Result<T> {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("proc-spawn".to_owned())
        .spawn(move || {
            if let Err(mpsc::SendError(Ok(started))) = tx.send(start()) {
                // The caller gave up: this child must not run unobserved.
                abandon(started);
            }
        })?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(started) => started,
        Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the child did not start (fork without exec) before the timeout",
        )),
        Err(RecvTimeoutError::Disconnected) => Err(io::Error::other(
            "the spawning thread ended without a result",
        )),
    }
}

/// True when the tests run under qemu-user (set by `cross/test-arm.sh`):
/// qemu reports an `execve` that fails in the child as exit status 127
/// instead of a spawn error, so the tests of that case only mean something
/// natively.
#[cfg(test)]
pub(crate) fn under_qemu() -> bool {
    std::env::var_os("EDGESPOOL_UNDER_QEMU").is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::Command;

    fn sh(script: &str, timeout: Duration, max: usize) -> Result<Output, RunError> {
        run_bounded(
            Path::new("/bin/sh"),
            &["-c".to_owned(), script.to_owned()],
            timeout,
            max,
        )
    }

    /// Waits a little for `/proc/<pid>` to go: a process reparented to init
    /// is reaped by init, not by us.
    fn gone(pid: &str) -> bool {
        let proc_dir = format!("/proc/{}", pid.trim());
        let give_up = Instant::now() + Duration::from_secs(2);
        while Path::new(&proc_dir).exists() && Instant::now() < give_up {
            thread::sleep(Duration::from_millis(20));
        }
        !Path::new(&proc_dir).exists()
    }

    #[test]
    fn captures_stdout_stderr_and_status() {
        let out = sh(
            "printf out; printf err >&2; exit 3",
            Duration::from_secs(5),
            64,
        )
        .unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"out");
        assert_eq!(out.stderr, b"err");
        assert!(!out.stdout_truncated && !out.stderr_truncated);
        assert!(out.duration < Duration::from_secs(5));
    }

    #[test]
    fn args_are_passed_verbatim() {
        let out = run_bounded(
            Path::new("/bin/echo"),
            &["$(id)".to_owned(), "a b;c".to_owned(), "*".to_owned()],
            Duration::from_secs(5),
            64,
        )
        .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, b"$(id) a b;c *\n");
    }

    #[test]
    fn stdin_is_null() {
        // With an inherited stdin `cat` could block until the timeout.
        let out = sh("cat; echo done", Duration::from_secs(5), 64).unwrap();
        assert_eq!(out.stdout, b"done\n");
    }

    #[test]
    fn output_is_bounded_per_stream() {
        let out = sh(
            "printf 0123456789; printf abcd >&2",
            Duration::from_secs(5),
            4,
        )
        .unwrap();
        assert_eq!(out.stdout, b"0123");
        assert!(out.stdout_truncated);
        assert_eq!(out.stderr, b"abcd");
        assert!(!out.stderr_truncated, "exactly full is not truncated");

        let out = run_bounded(
            Path::new("/bin/echo"),
            &["1".to_owned()],
            Duration::from_secs(5),
            0,
        )
        .unwrap();
        assert!(out.stdout.is_empty() && out.stdout_truncated);
        assert!(out.stderr.is_empty() && !out.stderr_truncated);
    }

    #[test]
    fn huge_output_is_drained_not_deadlocked() {
        // Far more than a pipe buffer on both streams; a reader that stopped
        // at the limit would leave the child blocked until the timeout.
        let out = sh(
            "head -c 1000000 /dev/zero | tr '\\0' x; head -c 1000000 /dev/zero >&2",
            Duration::from_secs(20),
            16,
        )
        .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, b"xxxxxxxxxxxxxxxx");
        assert_eq!(out.stderr, [0u8; 16]);
        assert!(out.stdout_truncated && out.stderr_truncated);
    }

    #[test]
    fn killed_by_signal_is_a_status_not_an_error() {
        let out = sh("kill -9 $$", Duration::from_secs(5), 64).unwrap();
        assert_eq!(out.status.signal(), Some(9));
        assert_eq!(out.status.code(), None);
    }

    #[test]
    fn missing_or_unexecutable_program_is_spawn_error() {
        if under_qemu() {
            return;
        }
        let err = run_bounded(
            Path::new("/nonexistent/probe"),
            &[],
            Duration::from_secs(5),
            64,
        )
        .unwrap_err();
        assert!(
            matches!(&err, RunError::Spawn { program, .. } if program == Path::new("/nonexistent/probe")),
            "{err:?}"
        );
        assert!(err.to_string().contains("/nonexistent/probe"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-executable");
        std::fs::write(&file, "#!/bin/sh\necho 1\n").unwrap();
        let err = run_bounded(&file, &[], Duration::from_secs(5), 64).unwrap_err();
        assert!(matches!(err, RunError::Spawn { .. }), "{err:?}");
    }

    #[test]
    fn timeout_kills_reaps_and_keeps_partial_output() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!(
            "echo $$ > '{}'; printf before; printf oops >&2; exec sleep 5",
            pid_file.display()
        );
        let started = Instant::now();
        let err = sh(&script, Duration::from_millis(300), 64).unwrap_err();
        let took = started.elapsed();
        match &err {
            RunError::Timeout {
                program,
                after,
                stdout,
                stderr,
            } => {
                assert_eq!(program, Path::new("/bin/sh"));
                assert_eq!(*after, Duration::from_millis(300));
                assert_eq!(stdout, b"before");
                assert_eq!(stderr, b"oops");
            }
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_secs(3), "{took:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("timed out") && msg.contains("/bin/sh"),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        // A zombie would still have its /proc entry; a reaped child has none.
        assert!(
            !Path::new(&format!("/proc/{}", pid.trim())).exists(),
            "child {pid} not reaped"
        );
    }

    #[test]
    fn helper_holding_a_pipe_times_out_and_dies() {
        for redirect in ["", ">/dev/null", "2>/dev/null"] {
            let dir = tempfile::tempdir().unwrap();
            let pid_file = dir.path().join("pid");
            // The shell exits at once but its background sleep keeps stdout
            // and/or stderr open.
            let script = format!(
                "sleep 5 {redirect} & echo $! > '{}'; echo 1",
                pid_file.display()
            );
            let started = Instant::now();
            let err = sh(&script, Duration::from_millis(300), 64).unwrap_err();
            match &err {
                RunError::Timeout { stdout, .. } => assert_eq!(stdout, b"1\n", "{redirect}"),
                other => panic!("{redirect}: {other:?}"),
            }
            assert!(started.elapsed() < Duration::from_secs(3), "{redirect}");
            let pid = std::fs::read_to_string(&pid_file).unwrap();
            assert!(gone(&pid), "{redirect}: helper {pid} still running");
        }
    }

    #[test]
    fn huge_timeout_does_not_overflow() {
        let out =
            run_bounded(Path::new("/bin/echo"), &["1".to_owned()], Duration::MAX, 64).unwrap();
        assert_eq!(out.stdout, b"1\n");
    }

    #[test]
    fn a_forked_child_that_does_not_reach_exec_fails_the_spawn_at_the_deadline() {
        let marker = tempfile::tempdir().unwrap();
        let ran = marker.path().join("ran");
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(format!("sleep 1; touch {}", ran.display()));
        // SAFETY: the hook only sleeps (nanosleep is async-signal-safe).
        unsafe {
            command.pre_exec(|| {
                let pause = libc::timespec {
                    tv_sec: 3,
                    tv_nsec: 0,
                };
                libc::nanosleep(&pause, std::ptr::null_mut());
                Ok(())
            });
        }
        let started = Instant::now();
        let err = start_in_thread(
            move || command.spawn(),
            scope::kill_and_reap,
            Instant::now() + Duration::from_millis(300),
        )
        .expect_err("the child sleeps before exec");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        // Once the spawn returns, the abandoned child is killed before it
        // can do anything; it never runs unobserved.
        thread::sleep(Duration::from_secs(5));
        assert!(!ran.exists(), "an abandoned child ran its program");
    }

    #[test]
    fn dropping_an_unwaited_run_kills_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!(
            "sleep 5 & echo $! > '{0}.tmp' && mv '{0}.tmp' '{0}'; wait",
            pid_file.display()
        );
        let running = Running::start(
            Path::new("/bin/sh"),
            &["-c".to_owned(), script],
            Duration::from_secs(10),
            (64, 64),
            &Confinement::base(),
        )
        .unwrap();
        let shell = running.scope.pid();
        let give_up = Instant::now() + Duration::from_secs(5);
        while !pid_file.exists() && Instant::now() < give_up {
            thread::sleep(Duration::from_millis(10));
        }
        let helper = std::fs::read_to_string(&pid_file).unwrap();
        drop(running);
        assert!(
            !Path::new(&format!("/proc/{shell}")).exists(),
            "shell {shell} not reaped"
        );
        assert!(gone(&helper), "helper {helper} still running");
    }

    #[test]
    fn steps_after_a_timeout_keep_reporting_it() {
        let mut running = Running::start(
            Path::new("/bin/sleep"),
            &["5".to_owned()],
            Duration::from_millis(50),
            (64, 64),
            &Confinement::base(),
        )
        .unwrap();
        assert!(matches!(running.wait(), Err(RunError::Timeout { .. })));
        assert!(matches!(running.wait(), Err(RunError::Timeout { .. })));
        // The pipes closed when the group died.
        let out = running.stdout().unwrap();
        assert!(out.bytes.is_empty() && !out.truncated);
    }

    #[test]
    fn users_and_groups_are_looked_up_by_name() {
        assert_eq!(lookup_user("root").unwrap(), Some((0, 0)));
        assert_eq!(lookup_group("root").unwrap(), Some(0));
        assert_eq!(lookup_user("no-such-user-edgespool").unwrap(), None);
        assert_eq!(lookup_group("no-such-group-edgespool").unwrap(), None);
        assert_eq!(lookup_user("").unwrap(), None);
        assert_eq!(lookup_user("ro\0ot").unwrap(), None);
    }

    #[test]
    fn a_confined_child_not_running_as_root_cannot_raise_its_limits() {
        // Root could raise them (CAP_SYS_RESOURCE), so run as nobody if we
        // are root.
        let credentials = if can_switch_user() {
            let (uid, gid) = lookup_user("nobody").unwrap().expect("user nobody");
            Some(Credentials { uid, gid })
        } else {
            None
        };
        let confinement = Confinement {
            env: vec![("PATH".to_owned(), "/usr/bin:/bin".to_owned())],
            cwd: Some(PathBuf::from("/")),
            limits: Some(Limits {
                cpu_secs: 5,
                max_memory_bytes: 1 << 30,
                max_open_files: 32,
            }),
            credentials,
        };
        let out = run_confined(
            Path::new("/bin/sh"),
            &["-c".to_owned(), "ulimit -n 33 || echo refused".to_owned()],
            Duration::from_secs(5),
            256,
            &confinement,
        )
        .unwrap();
        assert_eq!(out.stdout, b"refused\n", "{out:?}");
    }

    /// Whether `pid` is gone or a zombie, waiting up to 2 s.
    fn dead(pid: &str) -> bool {
        let stat = format!("/proc/{}/stat", pid.trim());
        let give_up = Instant::now() + Duration::from_secs(2);
        loop {
            let dead = match std::fs::read_to_string(&stat) {
                Ok(s) => s
                    .rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z')),
                Err(_) => true,
            };
            if dead || Instant::now() >= give_up {
                return dead;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to 5 s for `file` to hold a line.
    fn read_pid(file: &Path) -> String {
        let give_up = Instant::now() + Duration::from_secs(5);
        loop {
            match std::fs::read_to_string(file) {
                Ok(s) if s.ends_with('\n') => return s.trim().to_owned(),
                _ if Instant::now() >= give_up => panic!("{} never written", file.display()),
                _ => thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    #[test]
    fn a_setsid_helper_dies_with_its_timed_out_run() {
        if under_qemu() {
            // qemu-user has no PR_SET_CHILD_SUBREAPER: a helper that left the
            // group with setsid goes to init once its shell is killed first.
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (pid, marker) = (dir.path().join("pid"), dir.path().join("MARKER"));
        let script = format!(
            "setsid sh -c 'echo $$ > {}; sleep 1; touch {}' & sleep 60",
            pid.display(),
            marker.display()
        );
        let started = Instant::now();
        let err = sh(&script, Duration::from_millis(300), 64).unwrap_err();
        assert!(matches!(err, RunError::Timeout { .. }), "{err:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        let helper = read_pid(&pid);
        // Reaped by the supervisor before the run returned.
        assert!(
            !Path::new(&format!("/proc/{helper}")).exists(),
            "helper {helper} outlived the timeout"
        );
        thread::sleep(Duration::from_secs(2));
        assert!(!marker.exists(), "the helper ran on");
    }

    #[test]
    fn a_helper_left_behind_is_killed_when_the_run_ends() {
        if under_qemu() {
            // qemu-user has no PR_SET_CHILD_SUBREAPER: an orphan goes to init.
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (pid, marker) = (dir.path().join("pid"), dir.path().join("MARKER"));
        // It holds neither pipe, so the run is complete at once: it used to
        // live on unseen.
        let script = format!(
            "setsid sh -c 'echo $$ > {}; sleep 1; touch {}' >/dev/null 2>&1 & \
             while [ ! -s {} ]; do sleep 0.01; done; echo done",
            pid.display(),
            marker.display(),
            pid.display()
        );
        let out = sh(&script, Duration::from_secs(10), 64).unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(out.stdout, b"done\n");
        let helper = read_pid(&pid);
        assert!(
            !Path::new(&format!("/proc/{helper}")).exists(),
            "helper {helper} outlived its run"
        );
        thread::sleep(Duration::from_secs(2));
        assert!(!marker.exists(), "the helper ran on");
    }

    #[test]
    fn only_the_runs_own_processes_are_killed() {
        let dir = tempfile::tempdir().unwrap();
        // A process of our own, and another run going on at the same time,
        // each with a helper in a session of its own.
        let mut bystander = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let other_pid = dir.path().join("other");
        let other_script = format!(
            "setsid sleep 30 >/dev/null 2>&1 & echo $! > {}; sleep 1; echo other-ok",
            other_pid.display()
        );
        let other = thread::spawn(move || sh(&other_script, Duration::from_secs(20), 64));
        let other_helper = read_pid(&other_pid);
        let err = sh(
            "setsid sleep 30 & setsid sh -c 'sleep 30' & sleep 30",
            Duration::from_millis(200),
            64,
        )
        .unwrap_err();
        assert!(matches!(err, RunError::Timeout { .. }), "{err:?}");
        assert!(
            matches!(bystander.try_wait(), Ok(None)),
            "the bystander was killed"
        );
        // The other run's helper lives until its own run ends.
        let stat = std::fs::read_to_string(format!("/proc/{other_helper}/stat")).unwrap();
        assert!(!stat.contains(") Z"), "{stat}");
        let out = other.join().unwrap().unwrap();
        assert_eq!(out.stdout, b"other-ok\n");
        // Under qemu-user (no subreaper) it went to init when its shell exited.
        if !under_qemu() {
            assert!(dead(&other_helper), "the other run's helper outlived it");
        } else if let Ok(pid) = other_helper.parse::<libc::pid_t>() {
            if pid > 1 && !dead(&other_helper) {
                // SAFETY: kill(2) on the helper this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = bystander.kill();
        let _ = bystander.wait();
    }

    #[test]
    fn descriptors_above_2_are_never_inherited() {
        // A descriptor that is not close-on-exec, as the agent may have been
        // given one when started: high, so no descriptor `ls` opens takes it.
        let file = tempfile::NamedTempFile::new().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(file.as_file());
        // SAFETY: dup2 onto a number nothing in this test process uses.
        assert_eq!(unsafe { libc::dup2(fd, 57) }, 57);
        let out = run_bounded(
            Path::new("/bin/ls"),
            &["/proc/self/fd".to_owned()],
            Duration::from_secs(5),
            4096,
        )
        .unwrap();
        // SAFETY: our own descriptor.
        unsafe { libc::close(57) };
        // 0-2, and 3: the directory ls opened to list itself.
        assert_eq!(String::from_utf8_lossy(&out.stdout), "0\n1\n2\n3\n");
    }

    #[test]
    fn a_child_gets_only_the_environment_it_is_given() {
        let out =
            run_bounded(Path::new("/usr/bin/env"), &[], Duration::from_secs(5), 4096).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("LANG={CHILD_LANG}\nPATH={CHILD_PATH}\n")
        );
        let mut extra = BTreeMap::new();
        extra.insert("PATH".to_owned(), "/bin".to_owned());
        extra.insert("A_B".to_owned(), "x=y z".to_owned());
        assert_eq!(
            child_env(&extra),
            [
                ("A_B".to_owned(), "x=y z".to_owned()),
                ("LANG".to_owned(), CHILD_LANG.to_owned()),
                ("PATH".to_owned(), "/bin".to_owned()),
            ]
        );
    }
}
