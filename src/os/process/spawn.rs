//! Starting a program in a kill scope of its own: the agent forks a
//! *supervisor*, which makes itself a child subreaper and forks the
//! program.
//!
//! Its one rule: **between fork and exec only async-signal-safe system
//! calls run, on what was prepared before the fork**. The agent is
//! multi-threaded, so a forked child may find any lock (the allocator's
//! among them) held by a thread that does not exist in it: [`plan`] builds
//! every string, pointer array and limit first, and the children only read
//! them.
//!
//! - std's `Command` forks the supervisor (for its stdio pipes, its own
//!   process group and the `Child` to wait on). Its `pre_exec` hook never
//!   returns, so std never execs anything: in the hook the supervisor sets
//!   every signal to its default action, sets `PR_SET_CHILD_SUBREAPER`
//!   (kept for the supervisor's life, Linux 3.4) and forks the program.
//! - The program's child closes every descriptor from 3 up
//!   ([`close_inherited`]), sets its limits, drops to its user
//!   (`setgroups([gid])`, `setgid`, `setuid`), enters its directory and
//!   `execve`s with its own environment only; no `PATH` lookup.
//! - The supervisor closes its stdin, stdout and stderr (so the pipes close
//!   when the program and its helpers are done) and every other
//!   descriptor but the status pipe (so it holds none of the agent's
//!   sockets or files), then reaps: the program, and every orphan of the
//!   run, which the kernel hands to it rather than to init. When it has no
//!   child left it exits.
//!
//! Two pipes tell the agent what happened. The *exec probe* ends (EOF) once
//! the program has exec'd; if the set-up, the fork or the exec failed, it
//! carries the errno (4 bytes), as std's own does. The *status pipe*
//! carries the program's raw wait status, written by the supervisor when
//! it reaps the program; the agent owns only its read end (non-blocking).

use super::fds::close_inherited;
use super::scope::Scope;
use super::{Confinement, Credentials};
use std::ffi::{c_char, c_int, CString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The resource id `setrlimit` takes: glibc declares its own enum type.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type Resource = libc::c_int;

/// Everything the children need, built before the fork.
pub(super) struct Plan {
    /// The program, for std's `Command` and for messages.
    program: PathBuf,
    /// The program's path, as `execve` takes it.
    path: CString,
    /// `[program, args..., NULL]`, pointing into `strings`.
    argv: Vec<*const c_char>,
    /// `["NAME=value"..., NULL]`, pointing into `strings`.
    envp: Vec<*const c_char>,
    /// Owns what `argv` and `envp` point to; never changed once built.
    _strings: Vec<CString>,
    cwd: Option<CString>,
    limits: Vec<(Resource, libc::rlimit)>,
    credentials: Option<Credentials>,
    /// The supervisor makes itself a child subreaper ([`subreaper_available`]).
    subreaper: bool,
}

// SAFETY: the raw pointers point into the heap buffers of `_strings`, owned
// by the same plan and never changed after `plan` built them; moving the
// plan (or the `CString`s) does not move those buffers. Nothing writes
// through them.
unsafe impl Send for Plan {}
// SAFETY: as above; every use reads only.
unsafe impl Sync for Plan {}

/// The write ends of the two pipes, as the children see them.
#[derive(Clone, Copy)]
struct Ends {
    probe: RawFd,
    status: RawFd,
}

/// Builds the plan for running `program` with `args` as `confinement`
/// says.
///
/// # Errors
///
/// `InvalidInput` for a NUL byte in the program, an argument, the
/// environment or the working directory, or a variable name that is empty
/// or holds `=`; the OS error if a limit cannot be read.
pub(super) fn plan(program: &Path, args: &[String], c: &Confinement) -> io::Result<Plan> {
    let nul = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    };
    let path =
        CString::new(program.as_os_str().as_bytes()).map_err(|_| nul("the program's path"))?;
    let mut strings = Vec::with_capacity(1 + args.len() + c.env.len());
    strings.push(path.clone());
    for a in args {
        strings.push(CString::new(a.as_bytes()).map_err(|_| nul("an argument"))?);
    }
    let argc = strings.len();
    for (name, value) in &c.env {
        if name.is_empty() || name.contains('=') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is no environment variable name"),
            ));
        }
        let var =
            CString::new(format!("{name}={value}")).map_err(|_| nul("an environment variable"))?;
        strings.push(var);
    }
    let pointers = |s: &[CString]| -> Vec<*const c_char> {
        s.iter()
            .map(|s| s.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let (argv, envp) = strings.split_at(argc);
    let (argv, envp) = (pointers(argv), pointers(envp));
    let cwd = match &c.cwd {
        Some(d) => {
            Some(CString::new(d.as_os_str().as_bytes()).map_err(|_| nul("the working directory"))?)
        }
        None => None,
    };
    let limits = match c.limits {
        Some(l) => vec![
            child_limit(libc::RLIMIT_CPU, l.cpu_secs, 1)?,
            child_limit(libc::RLIMIT_AS, l.max_memory_bytes, 0)?,
            child_limit(libc::RLIMIT_NOFILE, l.max_open_files, 0)?,
        ],
        None => Vec::new(),
    };
    Ok(Plan {
        program: program.to_path_buf(),
        path,
        argv,
        envp,
        _strings: strings,
        cwd,
        limits,
        credentials: c.credentials,
        subreaper: subreaper_available(),
    })
}

/// Whether this kernel lets a process become a child subreaper (Linux 3.4;
/// qemu-user 7.2 refuses it with EINVAL), asked once with
/// `PR_GET_CHILD_SUBREAPER`. Without it the supervisor still kills every
/// process whose parent chain leads to it, but a helper whose parent has
/// exited goes to init and escapes its run; that is logged once.
fn subreaper_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let mut value: c_int = 0;
        // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer.
        let ok =
            unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut value as *mut c_int) } == 0;
        if !ok {
            log::warn!(
                "PR_SET_CHILD_SUBREAPER is not available ({}; an emulator such as qemu-user, or a \
                 kernel before 3.4): a helper of an exec source or handler that leaves with setsid \
                 and outlives its parent escapes the kill at the end of its run",
                io::Error::last_os_error()
            );
        }
        ok
    })
}

/// Forks the supervisor and, through it, the program; returns once the
/// program has exec'd (or the start failed). Blocks while a forked child
/// has not reached exec: run it where a deadline can give up on it.
///
/// # Errors
///
/// The fork failed, or the set-up or the exec of the program failed (the
/// OS error; the program did not run, and its supervisor was reaped).
pub(super) fn start(plan: Plan) -> io::Result<Scope> {
    let (probe_read, probe_write) = pipe()?;
    let (status_read, status_write) = pipe()?;
    set_nonblocking(&status_read)?;
    let ends = Ends {
        probe: probe_write.as_raw_fd(),
        status: status_write.as_raw_fd(),
    };
    let mut command = Command::new(&plan.program);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: the hook runs in the forked child and never returns; it only
    // reads the plan and makes async-signal-safe system calls (see
    // `supervise`). The descriptors in `ends` stay open in the agent until
    // `spawn` has returned, so they are valid in the child.
    unsafe {
        command.pre_exec(move || -> io::Result<()> { supervise(&plan, ends) });
    }
    let child = command.spawn()?;
    // The children hold their own copies; the probe ends only once ours is
    // closed too.
    drop(probe_write);
    drop(status_write);
    let scope = Scope::new(child, File::from(status_read));
    exec_result(File::from(probe_read))?;
    Ok(scope)
}

/// Waits until the program has exec'd (EOF) or a child reported an errno.
fn exec_result(mut probe: File) -> io::Result<()> {
    let mut buf = [0u8; 4];
    let mut got = 0;
    while let Some(rest) = buf.get_mut(got..).filter(|r| !r.is_empty()) {
        match probe.read(rest) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    match got {
        0 => Ok(()),
        4 => Err(io::Error::from_raw_os_error(i32::from_ne_bytes(buf))),
        _ => Err(io::Error::other(
            "the program's start was reported cut short",
        )),
    }
}

/// A pipe, both ends close-on-exec.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array we pass.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, plain integers.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The supervisor, in the child std forked (see the module doc). Never
/// returns.
///
/// # Safety
///
/// Only in a child forked by `Command::spawn`, from its `pre_exec` hook.
unsafe fn supervise(plan: &Plan, ends: Ends) -> ! {
    // SAFETY: the caller's contract; every call below is an
    // async-signal-safe system call on prepared values.
    unsafe {
        default_signals();
        let on: libc::c_ulong = 1;
        if plan.subreaper && libc::prctl(libc::PR_SET_CHILD_SUBREAPER, on) != 0 {
            fail(ends.probe);
        }
        let program = libc::fork();
        if program < 0 {
            fail(ends.probe);
        }
        if program == 0 {
            exec_program(plan, ends.probe);
        }
        // The agent may be gone when the status is written; that must not
        // kill the supervisor, whose children would go to init.
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        for fd in 0..3 {
            libc::close(fd);
        }
        close_inherited(ends.status);
        let mut status: c_int = 0;
        loop {
            let reaped = libc::waitpid(-1, &mut status, 0);
            if reaped == program {
                write_all(ends.status, &status.to_ne_bytes());
            } else if reaped < 0 && errno() != libc::EINTR {
                // ECHILD: the program and every process of the run are gone.
                break;
            }
        }
        libc::_exit(0)
    }
}

/// The program's child: close, limit, switch user, enter, exec.
///
/// # Safety
///
/// Only in the supervisor's child (see [`supervise`]).
unsafe fn exec_program(plan: &Plan, probe: RawFd) -> ! {
    // SAFETY: the caller's contract; plain system calls on prepared values.
    // std makes the same setgroups/setgid/setuid calls in the same place
    // for `CommandExt::uid`.
    unsafe {
        close_inherited(probe);
        for (resource, limit) in &plan.limits {
            if libc::setrlimit(*resource, limit) != 0 {
                fail(probe);
            }
        }
        if let Some(Credentials { uid, gid }) = plan.credentials {
            if libc::setgroups(1, &gid) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                fail(probe);
            }
        }
        if let Some(cwd) = &plan.cwd {
            if libc::chdir(cwd.as_ptr()) != 0 {
                fail(probe);
            }
        }
        libc::execve(plan.path.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr());
        fail(probe)
    }
}

/// Every signal but SIGKILL and SIGSTOP (which cannot be changed) to its
/// default action: the agent's handlers must not run in the supervisor,
/// and an ignored signal would stay ignored in the program.
unsafe fn default_signals() {
    for signal in 1..32 {
        if signal != libc::SIGKILL && signal != libc::SIGSTOP {
            // SAFETY: signal(2) with SIG_DFL installs no code of ours.
            unsafe { libc::signal(signal, libc::SIG_DFL) };
        }
    }
}

/// Reports errno on the exec probe and exits 127.
unsafe fn fail(probe: RawFd) -> ! {
    let code = errno();
    // SAFETY: write and _exit are async-signal-safe.
    unsafe {
        write_all(probe, &code.to_ne_bytes());
        libc::_exit(127)
    }
}

/// errno, read without allocating.
fn errno() -> c_int {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Writes all of `bytes` (at most a few; a pipe takes them at once) or
/// gives up on an error other than EINTR.
unsafe fn write_all(fd: RawFd, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: write(2) reads at most `bytes.len()` bytes of `bytes`.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        match usize::try_from(n) {
            Ok(n) => bytes = bytes.get(n..).unwrap_or_default(),
            Err(_) if errno() == libc::EINTR => {}
            Err(_) => return,
        }
    }
}

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
