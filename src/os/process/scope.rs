//! A run's kill scope: its supervisor and every process under it.
//!
//! The supervisor ([`super::spawn`]) is a child subreaper, so every process
//! the run starts stays in its subtree whatever it does: one that calls
//! `setsid` (leaving the process group), double-forks or loses its parent
//! is handed to the supervisor, not to init. The subtree is therefore
//! exactly the run, and ending the run means ending that subtree.
//!
//! Its one rule: **when a run ends or times out, every process under its
//! supervisor is killed and reaped, and no other process is ever
//! signalled.** [`Scope::end`] reads `/proc`, sends SIGKILL to every live
//! process whose parent chain leads to the supervisor, and repeats until
//! none is left (one that forked meanwhile is found on the next pass: its
//! parent's death hands it to the supervisor); the supervisor reaps them
//! and, having no child left, exits; the agent reaps it.
//!
//! A pid read from `/proc` may be reused before the signal is sent. Each
//! signal therefore goes through a pidfd (`pidfd_open`, Linux 5.3) opened
//! after the scan and checked against the scanned process's start time, so
//! it reaches that process or none; where the kernel has no pidfds the
//! check comes right before a plain `kill`, leaving a window of
//! microseconds in which the pid would have to be freed and handed out
//! again.
//!
//! Why not make the agent the subreaper: orphans of concurrent runs (a
//! handler and several exec sources run at once) would all be adopted by
//! the agent, and once adopted nothing tells which run they came from.
//! Why not process groups alone: `setsid` leaves the group.
//!
//! Limits: a program running as the agent's own user can kill its
//! supervisor; its processes then go to init and only those still in the
//! run's process group are killed (give the program a `user`: the
//! supervisor keeps the agent's). The same holds where the kernel or an
//! emulator such as qemu-user refuses a subreaper: the run's group is
//! signalled at every end for that reason. A set-uid program the agent may
//! not signal is logged and left.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::thread;
use std::time::{Duration, Instant};

use super::{POLL, REAP_GRACE};

/// After the program has exited, how long the supervisor gets to notice
/// that nothing of the run is left and exit by itself, before `/proc` is
/// read: the usual end of a run costs no scan.
const SETTLE: Duration = Duration::from_millis(20);

/// A started run: its supervisor and the pipe on which it reports the
/// program's exit status. Dropping it ends it ([`Scope::end`]).
pub(super) struct Scope {
    /// `None` once reaped, or handed to a reaper thread.
    supervisor: Option<Child>,
    /// The supervisor's pid, also its process group id.
    pid: u32,
    /// Read end of the status pipe (non-blocking).
    status: File,
    /// The program's exit status has been read.
    reported: bool,
}

impl Scope {
    /// A scope around a freshly forked supervisor.
    pub(super) fn new(supervisor: Child, status: File) -> Scope {
        Scope {
            pid: supervisor.id(),
            supervisor: Some(supervisor),
            status,
            reported: false,
        }
    }

    /// The supervisor's pid (and process group id).
    #[cfg(test)]
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// The supervisor, for its stdout and stderr; `None` once ended.
    pub(super) fn supervisor(&mut self) -> Option<&mut Child> {
        self.supervisor.as_mut()
    }

    /// Whether [`Scope::end`] has run.
    pub(super) fn ended(&self) -> bool {
        self.supervisor.is_none()
    }

    /// The program's exit status, waiting for it until `deadline`;
    /// `Ok(None)` if the deadline passed first.
    ///
    /// # Errors
    ///
    /// The status pipe could not be read, or the supervisor closed it
    /// without a status (it was killed).
    pub(super) fn wait(&mut self, deadline: Instant) -> io::Result<Option<ExitStatus>> {
        let mut buf = [0u8; 4];
        loop {
            match self.status.read(&mut buf) {
                Ok(4) => {
                    self.reported = true;
                    return Ok(Some(ExitStatus::from_raw(i32::from_ne_bytes(buf))));
                }
                Ok(0) => {
                    return Err(io::Error::other(
                        "the run's supervisor ended without the program's exit status",
                    ))
                }
                Ok(_) => return Err(io::Error::other("the program's exit status was cut short")),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            readable(&self.status, left);
        }
    }

    /// Kills every process of the run and reaps the supervisor (see the
    /// module doc). Returns within about [`REAP_GRACE`]; a supervisor still
    /// there by then is killed and reaped by a background thread.
    pub(super) fn end(&mut self) {
        let Some(mut supervisor) = self.supervisor.take() else {
            return;
        };
        if self.reported && exits_within(self.pid, SETTLE) {
            // Without a subreaper (qemu-user) a helper whose shell has
            // exited went to init, out of the scan's reach; if it stayed in
            // the run's group, this still ends it. With one, nothing of the
            // run is left and the signal finds no process.
            kill_group(self.pid);
            reap(&mut supervisor);
            return;
        }
        let give_up = Instant::now() + REAP_GRACE;
        let mut refused = HashSet::new();
        let gone = loop {
            if exits_within(self.pid, Duration::ZERO) {
                break true;
            }
            let live = descendants(self.pid);
            for p in &live {
                if !kill_verified(p) {
                    refused.insert(p.pid);
                }
            }
            if Instant::now() >= give_up {
                break false;
            }
            thread::sleep(if live.is_empty() {
                Duration::from_millis(1)
            } else {
                POLL / 2
            });
        };
        if !refused.is_empty() {
            log::warn!(
                "processes {refused:?} of a run refused SIGKILL (EPERM: set-uid?) and were left"
            );
        }
        if !gone {
            kill_and_reap(supervisor);
            return;
        }
        // The supervisor may have been killed before the program was done,
        // or a helper may have gone to init (no subreaper): what is left of
        // the run is at least in its group. Its pid, still unreaped, cannot
        // have been given to another group.
        kill_group(self.pid);
        reap(&mut supervisor);
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        self.end();
    }
}

/// Waits up to `timeout` for `fd` to be readable (or closed).
fn readable(fd: &File, timeout: Duration) {
    let ms = timeout.as_millis().saturating_add(1);
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd we pass. Its result does
    // not matter: the caller reads again either way.
    unsafe {
        libc::poll(
            &mut pfd,
            1,
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX),
        );
    }
}

/// Whether process `pid` (our child) has exited, waiting up to `timeout`;
/// it is not reaped (`WNOWAIT`), so its pid stays taken.
fn exits_within(pid: u32, timeout: Duration) -> bool {
    let pid = libc::id_t::from(pid);
    let give_up = Instant::now() + timeout;
    loop {
        // SAFETY: an all-zero siginfo_t is valid; waitid writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid siginfo_t.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: si_pid is set (to 0 when nothing has exited) after waitid.
        if rc != 0 || unsafe { info.si_pid() } != 0 {
            // An error means there is no such child to wait for any more.
            return true;
        }
        if Instant::now() >= give_up {
            return false;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Reaps a child that has exited.
fn reap(child: &mut Child) {
    if let Err(e) = child.wait() {
        log::warn!("cannot reap child {}: {e}", child.id());
    }
}

/// One process read from `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Proc {
    pid: u32,
    ppid: u32,
    /// Clock ticks after boot at which it started: with the pid, it tells
    /// this process from a later one given the same pid.
    start: u64,
    /// Not a zombie (or dead): a signal can still do something.
    live: bool,
}

/// The live processes under `root` (not `root` itself), by parent chain.
fn descendants(root: u32) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let table: Vec<Proc> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(read_proc)
        .collect();
    under(&table, root)
}

/// The live processes of `table` under `root`.
fn under(table: &[Proc], root: u32) -> Vec<Proc> {
    let mut children: HashMap<u32, Vec<&Proc>> = HashMap::new();
    for p in table {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut found = Vec::new();
    let mut queue = vec![root];
    // Each pid is entered once: a pid cannot be its own ancestor, but a
    // table read while processes come and go is not a snapshot.
    let mut seen = HashSet::from([root]);
    while let Some(parent) = queue.pop() {
        for p in children.get(&parent).into_iter().flatten() {
            if seen.insert(p.pid) {
                queue.push(p.pid);
                if p.live {
                    found.push(**p);
                }
            }
        }
    }
    found
}

fn read_proc(pid: u32) -> Option<Proc> {
    let mut text = String::new();
    File::open(format!("/proc/{pid}/stat"))
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    parse_stat(pid, &text)
}

/// `pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
/// majflt cmajflt utime stime cutime cstime priority nice threads
/// itrealvalue starttime ...` (proc(5)); `comm` may hold spaces and
/// parentheses, so the fields are counted from its last `)`.
fn parse_stat(pid: u32, text: &str) -> Option<Proc> {
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?;
    Some(Proc {
        pid,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
        live: !matches!(*state, "Z" | "X" | "x"),
    })
}

/// SIGKILL to `p` if it is still the process that was scanned; false only
/// if it was refused (EPERM). One gone already is no failure.
fn kill_verified(p: &Proc) -> bool {
    let Ok(pid) = libc::pid_t::try_from(p.pid) else {
        return true;
    };
    if pid <= 1 {
        return true;
    }
    let still = || read_proc(p.pid).is_some_and(|now| now.start == p.start && now.live);
    let errno = || io::Error::last_os_error().raw_os_error();
    let flags: libc::c_uint = 0;
    // SAFETY: pidfd_open takes plain integers and returns a new descriptor.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, flags) };
    let sent = match libc::c_int::try_from(raw) {
        Ok(fd) if fd >= 0 => {
            // SAFETY: a new descriptor, ours alone.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // The pidfd now pins one process: signal it only if it is the
            // one that was scanned.
            if !still() {
                return true;
            }
            // SAFETY: pidfd_send_signal on our pidfd, without a siginfo.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    flags,
                )
            };
            rc == 0
        }
        // No pidfds in this kernel (or emulator): check, then kill.
        _ if errno() == Some(libc::ENOSYS) => {
            if !still() {
                return true;
            }
            // SAFETY: kill(2) takes plain integers.
            unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
        }
        // ESRCH: gone already.
        _ => return true,
    };
    sent || errno() != Some(libc::EPERM)
}

/// SIGKILL to process group `pgid`, the run's own (its supervisor's pid,
/// not yet reaped): what a scan of the supervisor's subtree cannot reach.
fn kill_group(pgid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
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

/// Kills and reaps a child (one that is no supervisor, or a supervisor
/// that would not go), so no zombie is left. One that does not die within
/// [`REAP_GRACE`] is handed to a thread that waits for it, so the caller
/// goes on.
pub(super) fn kill_and_reap(mut child: Child) {
    // An error only means the child has already exited.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: u32, ppid: u32, live: bool) -> Proc {
        Proc {
            pid,
            ppid,
            start: u64::from(pid) * 10,
            live,
        }
    }

    #[test]
    fn stat_lines_parse_whatever_the_command_name() {
        let line =
            "4242 (a b) (c)) S 17 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1 2 3\n";
        assert_eq!(
            parse_stat(4242, line),
            Some(Proc {
                pid: 4242,
                ppid: 17,
                start: 987654,
                live: true
            })
        );
        let zombie = "7 (sh) Z 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0\n";
        assert_eq!(parse_stat(7, zombie).map(|p| p.live), Some(false));
        assert_eq!(parse_stat(7, "7 (sh) S 1"), None);
        assert_eq!(parse_stat(7, "garbage"), None);
    }

    #[test]
    fn only_processes_under_the_root_are_found() {
        // 10 supervisor -> 11 program -> 12 helper -> 13 (zombie)
        // 10 -> 14 (an orphan it adopted); 20 another run -> 21; 1 -> 30.
        let table = [
            p(10, 1, true),
            p(11, 10, true),
            p(12, 11, true),
            p(13, 12, false),
            p(14, 10, true),
            p(20, 1, true),
            p(21, 20, true),
            p(30, 1, true),
        ];
        let mut found: Vec<u32> = under(&table, 10).iter().map(|p| p.pid).collect();
        found.sort_unstable();
        assert_eq!(found, [11, 12, 14]);
        assert!(under(&table, 99).is_empty());
        // A table read mid-change may hold a cycle; the walk still ends.
        let cycle = [p(5, 6, true), p(6, 5, true), p(7, 5, true)];
        let mut found: Vec<u32> = under(&cycle, 5).iter().map(|p| p.pid).collect();
        found.sort_unstable();
        assert_eq!(found, [6, 7]);
    }
}
