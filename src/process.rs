//! Bounded child processes: a program run with fixed arguments, its output
//! captured within limits, killed if it runs too long.
//!
//! This module owns starting, draining, waiting for, killing and reaping the
//! programs the agent runs (exec sources, exec command handlers). It does not
//! interpret their output or decide what a failure means; callers do.
//!
//! Its one rule: **a child never outlives its timeout, its output is
//! bounded, and it is never run through a shell.**
//!
//! - The program is executed directly (`execve`), so arguments are passed as
//!   they are: no globbing, quoting, expansion or command separators.
//! - It gets its own process group, so on timeout every helper it started is
//!   killed with it; otherwise a helper still holding one of our pipes would
//!   keep the reader waiting.
//! - Both pipes are drained by reader threads that keep at most a fixed
//!   number of bytes and read and discard the rest, so a chatty child never
//!   blocks on a full pipe and never grows our memory.
//! - The timeout runs from start until the child has exited *and* both pipes
//!   are closed. It is enforced by polling `try_wait`, which needs no
//!   process-wide SIGCHLD handler.
//! - A killed child is reaped; one that refuses to die (uninterruptible
//!   sleep on a hung bus) is handed to a background thread after a short
//!   grace so the caller goes on.
//! - A confined child ([`run_confined`], for command handlers) gets only the
//!   environment it is given, its own working directory, resource limits and
//!   optionally another user, all set between fork and exec; nothing of the
//!   agent's environment reaches it.

use std::ffi::CString;
use std::fmt;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

/// How often the child is polled; short enough that a timeout overshoots
/// by little, long enough to cost nothing on a small CPU.
const POLL: Duration = Duration::from_millis(10);
/// Caps the deadline so `Instant + timeout` cannot overflow however large the
/// requested timeout.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// After SIGKILL a process normally goes at once; one stuck in uninterruptible
/// sleep (a hung bus) may not, and must not stall the caller.
const REAP_GRACE: Duration = Duration::from_secs(2);
/// After a kill, how long the readers get to pick up what was still in the
/// pipes. Once the group is dead the pipes close at once; this only bounds
/// the wait when something outside the group still holds one.
const DRAIN_GRACE: Duration = Duration::from_millis(200);
/// Size of one read from a pipe.
const CHUNK: usize = 4096;
/// First buffer for a user or group lookup when the system suggests none.
const LOOKUP_BUF: usize = 16 * 1024;
/// A lookup needing more than this is treated as failed: no sane user or
/// group entry is this large.
const LOOKUP_BUF_MAX: usize = 1024 * 1024;

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

/// What a confined child gets instead of what the agent has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// Its whole environment, in this order; nothing is inherited.
    pub env: Vec<(String, String)>,
    /// Its working directory (absolute), entered after the switch to
    /// [`Confinement::credentials`], so it must be reachable by that user.
    pub cwd: PathBuf,
    /// Its resource limits.
    pub limits: Limits,
    /// The user it runs as; `None`: the agent's own.
    pub credentials: Option<Credentials>,
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
    /// It could not be started: not found, not executable, or the threads
    /// draining its output could not be created.
    Spawn {
        /// The program that was to be run.
        program: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// It had not exited and closed both pipes by the timeout. Its whole
    /// process group was killed and it was reaped.
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

/// Run `program` with `args` (no shell), stdin null, killed (whole process
/// group) after `timeout`; stdout and stderr each kept up to
/// `max_output_bytes` (the rest drained and discarded, flagged truncated).
/// It inherits the agent's environment, working directory, limits and user.
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
    run_child(program, args, timeout, max_output_bytes, None)
}

/// [`run_bounded`], with the child confined as `confinement` says: only its
/// environment, its working directory, its resource limits and, if given,
/// its user, all set between fork and exec.
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
    run_child(program, args, timeout, max_output_bytes, Some(confinement))
}

fn run_child(
    program: &Path,
    args: &[String],
    timeout: Duration,
    max_output_bytes: usize,
    confinement: Option<&Confinement>,
) -> Result<Output, RunError> {
    let mut running = Running::start_with(
        program,
        args,
        timeout,
        (max_output_bytes, max_output_bytes),
        confinement,
    )?;
    let status = running.wait()?;
    let stdout = running.stdout()?;
    let stderr = running.stderr()?;
    Ok(Output {
        status,
        stdout: stdout.bytes,
        stdout_truncated: stdout.truncated,
        stderr: stderr.bytes,
        stderr_truncated: stderr.truncated,
        duration: running.started.elapsed(),
    })
}

/// What was kept from one pipe.
#[derive(Debug, Clone, Default)]
pub(crate) struct Captured {
    /// The first bytes, up to the pipe's limit.
    pub(crate) bytes: Vec<u8>,
    /// More came than was kept.
    pub(crate) truncated: bool,
}

/// A started program, for callers that need the steps of
/// [`run_bounded`] separately (an exec source wants only stderr of a program
/// that failed, and only stdout of one that succeeded, with separate limits).
///
/// Every step shares the deadline set at [`Running::start`]; a step that
/// meets it kills the process group and returns [`RunError::Timeout`].
/// Dropping a `Running` whose child has not been reaped kills and reaps it.
pub(crate) struct Running {
    program: PathBuf,
    timeout: Duration,
    started: Instant,
    deadline: Instant,
    /// Also the process group id (the child leads its group).
    pid: u32,
    /// `None` once reaped, or once handed to [`kill_and_reap`].
    child: Option<Child>,
    status: Option<ExitStatus>,
    stdout: Pipe,
    stderr: Pipe,
}

impl Running {
    /// Start `program` in its own process group, stdin null, and begin
    /// draining its stdout and stderr, keeping at most `stdout_keep` and
    /// `stderr_keep` bytes.
    pub(crate) fn start(
        program: &Path,
        args: &[String],
        timeout: Duration,
        stdout_keep: usize,
        stderr_keep: usize,
    ) -> Result<Running, RunError> {
        Running::start_with(program, args, timeout, (stdout_keep, stderr_keep), None)
    }

    /// [`Running::start`], confined if `confinement` is given.
    fn start_with(
        program: &Path,
        args: &[String],
        timeout: Duration,
        (stdout_keep, stderr_keep): (usize, usize),
        confinement: Option<&Confinement>,
    ) -> Result<Running, RunError> {
        let started = Instant::now();
        let deadline = started + timeout.min(MAX_TIMEOUT);
        let spawn_err = |source| RunError::Spawn {
            program: program.to_path_buf(),
            source,
        };
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = match confinement {
            Some(c) => {
                confine(&mut command, c).map_err(spawn_err)?;
                spawn_forked(command, deadline).map_err(spawn_err)?
            }
            None => command.spawn().map_err(spawn_err)?,
        };
        let (stdout, stderr) = match start_readers(&mut child, stdout_keep, stderr_keep) {
            Ok(pipes) => pipes,
            Err(source) => {
                kill_and_reap(child);
                return Err(spawn_err(source));
            }
        };
        Ok(Running {
            program: program.to_path_buf(),
            timeout,
            started,
            deadline,
            pid: child.id(),
            child: Some(child),
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
        let Some(child) = self.child.as_mut() else {
            // Already killed by an earlier step that timed out.
            return Err(self.timed_out());
        };
        match wait_until(child, self.deadline) {
            Ok(Some(status)) => {
                self.status = Some(status);
                self.child = None;
                Ok(status)
            }
            Ok(None) => Err(self.timed_out()),
            Err(source) => {
                self.kill();
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

    /// Kills the group, gives the readers a moment to pick up what was left
    /// in the pipes, and returns the timeout error with what was captured.
    fn timed_out(&mut self) -> RunError {
        self.kill();
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

    /// Kills the process group, and the child if it is not yet reaped.
    fn kill(&mut self) {
        match self.child.take() {
            Some(child) => kill_and_reap(child),
            // The child is reaped but a helper in its group may live on.
            None => kill_group(self.pid),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            kill_and_reap(child);
        }
    }
}

#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// The bytes a reader thread keeps, shared so that what came before a kill
/// can be returned even if the pipe never closes.
struct Buffer {
    kept: Captured,
    /// Bytes still to keep; 0 once the owner has taken them.
    room: usize,
}

impl Buffer {
    fn push(&mut self, data: &[u8]) {
        let take = data.len().min(self.room);
        self.kept.bytes.extend_from_slice(&data[..take]);
        self.room -= take;
        if take < data.len() {
            self.kept.truncated = true;
        }
    }
}

/// One pipe being drained by a reader thread.
struct Pipe {
    buffer: Arc<Mutex<Buffer>>,
    /// The thread's end: `Ok` on EOF. It ends at the latest when the process
    /// group is killed, so it is never joined; the result arrives here.
    done: Receiver<io::Result<()>>,
    finished: bool,
}

impl Pipe {
    /// `None` if the deadline passed before EOF.
    fn finish(&mut self, deadline: Instant) -> Option<io::Result<()>> {
        if self.finished {
            return Some(Ok(()));
        }
        let result = match self
            .done
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Err(io::Error::other(
                "output reader ended without a result",
            ))),
        };
        if matches!(result, Some(Ok(()))) {
            self.finished = true;
        }
        result
    }

    /// A copy of what was kept so far; the reader discards anything that
    /// comes later. A copy, so that a timeout after one pipe was collected
    /// still returns both.
    fn snapshot(&self) -> Captured {
        let mut buffer = lock(&self.buffer);
        buffer.room = 0;
        buffer.kept.clone()
    }
}

/// A reader never panics while holding the lock, and the buffer is valid
/// after any push anyway, so a poisoned lock is used as it is.
fn lock(buffer: &Mutex<Buffer>) -> MutexGuard<'_, Buffer> {
    buffer.lock().unwrap_or_else(PoisonError::into_inner)
}

fn start_readers(
    child: &mut Child,
    stdout_keep: usize,
    stderr_keep: usize,
) -> io::Result<(Pipe, Pipe)> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("stdout was not captured"))?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| io::Error::other("stderr was not captured"))?;
    let out = spawn_reader("proc-stdout", stdout, stdout_keep)?;
    let err = spawn_reader("proc-stderr", stderr, stderr_keep)?;
    Ok((out, err))
}

fn spawn_reader<R: Read + Send + 'static>(name: &str, stream: R, keep: usize) -> io::Result<Pipe> {
    let buffer = Arc::new(Mutex::new(Buffer {
        kept: Captured::default(),
        room: keep,
    }));
    let (tx, done) = mpsc::channel();
    let shared = Arc::clone(&buffer);
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            // The receiver may have given up already; nothing to do then.
            let _ = tx.send(drain(stream, &shared));
        })?;
    Ok(Pipe {
        buffer,
        done,
        finished: false,
    })
}

/// Reads to EOF, keeping what the buffer has room for and discarding the
/// rest so the writer is never blocked on a full pipe.
fn drain<R: Read>(mut stream: R, buffer: &Mutex<Buffer>) -> io::Result<()> {
    let mut chunk = [0u8; CHUNK];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => lock(buffer).push(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Starts a command that forks (it has a `pre_exec` hook), giving up at
/// `deadline`.
///
/// `Command::spawn` returns only once the child has exec'd or failed: it
/// reads a close-on-exec socket until every holder of its write end is
/// gone. In a multi-threaded process another child forked in that moment
/// holds it too, and a forked child that never reaches exec holds it for
/// good. The spawn therefore runs on its own thread; if it has not returned
/// by the deadline the caller gets an error and goes on, and the thread,
/// should the spawn ever return, kills and reaps that child.
fn spawn_forked(mut command: Command, deadline: Instant) -> io::Result<Child> {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("proc-spawn".to_owned())
        .spawn(move || {
            let spawned = command.spawn();
            if let Err(mpsc::SendError(Ok(child))) = tx.send(spawned) {
                // The caller gave up: this child must not run unobserved.
                kill_and_reap(child);
            }
        })?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(spawned) => spawned,
        Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the child did not start (fork without exec) before the timeout",
        )),
        Err(RecvTimeoutError::Disconnected) => Err(io::Error::other(
            "the spawning thread ended without a result",
        )),
    }
}

/// `None` if the deadline passed first.
fn wait_until(child: &mut Child, deadline: Instant) -> io::Result<Option<ExitStatus>> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        thread::sleep(POLL.min(deadline - now));
    }
}

/// SIGKILL to the child's process group (the child leads it, see
/// `process_group(0)`), reaching helpers it started.
fn kill_group(pid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // kill(0) or kill(-1) would hit our own group or every process.
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Kills the child and its group and reaps it so no zombie is left. A child
/// that does not die within `REAP_GRACE` is handed to a thread that waits
/// for it, so the caller goes on.
fn kill_and_reap(mut child: Child) {
    kill_group(child.id());
    // In case the group signal could not be sent; an error only means the
    // child has already exited.
    let _ = child.kill();
    let give_up = Instant::now() + REAP_GRACE;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < give_up => thread::sleep(POLL),
            Ok(None) => break,
            Err(e) => {
                log::warn!("cannot reap killed child {}: {e}", child.id());
                return;
            }
        }
    }
    let pid = child.id();
    log::warn!("killed child {pid} has not exited; reaping it in the background");
    let spawned = thread::Builder::new()
        .name("proc-reaper".to_owned())
        .spawn(move || {
            let _ = child.wait();
        });
    if let Err(e) = spawned {
        log::warn!("cannot start reaper thread for child {pid}: {e}; it may stay a zombie");
    }
}

/// Sets up `command` to run confined: environment replaced, and a hook run
/// in the child between fork and exec that sets the limits, switches user
/// and enters the working directory.
///
/// Everything the hook needs is prepared here, before the fork: in the child
/// of a threaded process only async-signal-safe calls are allowed (no
/// allocation, no locks), and the hook makes only plain system calls.
fn confine(command: &mut Command, c: &Confinement) -> io::Result<()> {
    command.env_clear();
    command.envs(c.env.iter().map(|(k, v)| (k, v)));
    let cwd = CString::new(c.cwd.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "working directory contains a NUL byte",
        )
    })?;
    let limits = [
        child_limit(libc::RLIMIT_CPU, c.limits.cpu_secs, 1)?,
        child_limit(libc::RLIMIT_AS, c.limits.max_memory_bytes, 0)?,
        child_limit(libc::RLIMIT_NOFILE, c.limits.max_open_files, 0)?,
    ];
    let credentials = c.credentials;
    // SAFETY: the closure runs in the forked child before exec. It only reads
    // values prepared above and makes system calls that take no locks and
    // allocate nothing (setrlimit, setgroups, setgid, setuid, chdir); std
    // makes the same setgroups/setgid/setuid calls in the same place for
    // `CommandExt::uid`. `last_os_error` builds an error from errno without
    // allocating.
    unsafe {
        command.pre_exec(move || {
            for (resource, limit) in &limits {
                if libc::setrlimit(*resource, limit) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(Credentials { uid, gid }) = credentials {
                if libc::setgroups(1, &gid) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::chdir(cwd.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// The resource id `setrlimit` takes: glibc declares its own enum type.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type Resource = libc::c_int;

/// The limit a confined child sets for `resource`: soft `want`, hard
/// `want + extra_hard`, neither above the agent's own hard limit (which
/// the child inherits and, unprivileged, could not raise).
fn child_limit(
    resource: Resource,
    want: u64,
    extra_hard: u64,
) -> io::Result<(Resource, libc::rlimit)> {
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we pass.
    if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // Beyond what rlim_t holds (a 32-bit board) is no limit in effect.
    let as_rlim = |v: u64| libc::rlim_t::try_from(v).unwrap_or(libc::RLIM_INFINITY);
    // RLIM_INFINITY is the largest rlim_t, so `min` keeps a finite limit.
    let hard = as_rlim(want.saturating_add(extra_hard)).min(current.rlim_max);
    let soft = as_rlim(want).min(hard);
    Ok((
        resource,
        libc::rlimit {
            rlim_cur: soft,
            rlim_max: hard,
        },
    ))
}

/// Whether the agent can switch a child to another user: it runs as root.
pub fn can_switch_user() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() == 0 }
}

/// The uid and primary gid of user `name` in the system's user database
/// (`getpwnam_r`: /etc/passwd or whatever NSS is configured). `Ok(None)`:
/// there is no such user.
///
/// # Errors
///
/// The database could not be read (the OS error). The caller reports it on
/// the config key that named the user and keeps its config.
pub fn lookup_user(name: &str) -> io::Result<Option<(libc::uid_t, libc::gid_t)>> {
    let Ok(cname) = CString::new(name) else {
        return Ok(None);
    };
    // SAFETY: an all-zero passwd (integers and null pointers) is valid.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let found = lookup(libc::_SC_GETPW_R_SIZE_MAX, |buf, found| {
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call and `buf` is as long
        // as the length given; the entry's strings point into `buf`, which
        // is not read after this closure.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut entry,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        *found = !result.is_null();
        rc
    })?;
    Ok(found.then_some((entry.pw_uid, entry.pw_gid)))
}

/// The gid of group `name` in the system's group database (`getgrnam_r`).
/// `Ok(None)`: there is no such group.
///
/// # Errors
///
/// As [`lookup_user`].
pub fn lookup_group(name: &str) -> io::Result<Option<libc::gid_t>> {
    let Ok(cname) = CString::new(name) else {
        return Ok(None);
    };
    // SAFETY: an all-zero group (integers and null pointers) is valid.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let found = lookup(libc::_SC_GETGR_R_SIZE_MAX, |buf, found| {
        let mut result: *mut libc::group = std::ptr::null_mut();
        // SAFETY: as in lookup_user.
        let rc = unsafe {
            libc::getgrnam_r(
                cname.as_ptr(),
                &mut entry,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        *found = !result.is_null();
        rc
    })?;
    Ok(found.then_some(entry.gr_gid))
}

/// Runs a `get*nam_r` call with a buffer that grows while the call says
/// ERANGE. `call` returns the call's result code and sets whether an entry
/// was found.
fn lookup(
    size_hint: libc::c_int,
    mut call: impl FnMut(&mut [libc::c_char], &mut bool) -> libc::c_int,
) -> io::Result<bool> {
    // SAFETY: sysconf takes an integer; -1 means no suggestion.
    let hint = unsafe { libc::sysconf(size_hint) };
    let mut len = usize::try_from(hint)
        .ok()
        .filter(|&n| n > 0)
        .unwrap_or(LOOKUP_BUF)
        .min(LOOKUP_BUF_MAX);
    loop {
        let mut buf = vec![0; len];
        let mut found = false;
        match call(&mut buf, &mut found) {
            0 => return Ok(found),
            // Some C libraries say "not found" with an error code (see
            // getpwnam_r(3), NOTES).
            libc::ENOENT | libc::ESRCH => return Ok(false),
            libc::ERANGE if len < LOOKUP_BUF_MAX => len = (len * 2).min(LOOKUP_BUF_MAX),
            rc => return Err(io::Error::from_raw_os_error(rc)),
        }
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
    use std::os::unix::process::ExitStatusExt;

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
        let err = spawn_forked(command, Instant::now() + Duration::from_millis(300))
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
            64,
            64,
        )
        .unwrap();
        let shell = running.pid;
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
            64,
            64,
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
            cwd: PathBuf::from("/"),
            limits: Limits {
                cpu_secs: 5,
                max_memory_bytes: 1 << 30,
                max_open_files: 32,
            },
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
}
