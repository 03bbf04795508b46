//! Shared helpers for the integration tests, the network-loss rig and the
//! benches (which include this tree by path): a real mosquitto broker, a
//! TCP fault proxy, a recording MQTT subscriber, a test board's config,
//! the agent and the sink binaries as child processes, the agent's wall
//! clock stepped by libfaketime, a PostgreSQL
//! server and read-only access to the agent's SQLite spool.
#![allow(dead_code)]

pub mod agent;
pub mod board;
pub mod broker;
pub mod faketime;
pub mod fleet;
pub mod keys;
#[cfg(feature = "pg-sink")]
pub mod postgres;
pub mod powercut;
pub mod proxy;
pub mod publisher;
pub mod sink;
pub mod spool;
pub mod subscriber;

use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Poll `f` every 50 ms until it returns true or `timeout` has passed.
/// Returns the last result of `f` (it is always called at least once, and
/// once more right at the deadline).
pub fn wait_for(timeout: Duration, f: impl FnMut() -> bool) -> bool {
    poll(timeout, Duration::from_millis(50), f)
}

/// [`wait_for`], polling every `every` (a check that costs a process or a
/// query of a large file is not run 20 times a second).
pub fn poll(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(every.min(deadline - now));
    }
}

/// Run `cmd` to its end with stdout and stderr captured; panics naming
/// `what`, with its stderr, unless it exited 0.
pub fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// SIGTERM `child`, give it `grace` to exit by itself, then SIGKILL it;
/// reaps it either way. Returns its exit status if it stopped in time
/// (or had already exited), None if it had to be killed.
pub fn terminate(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Ok(Some(status)) = child.try_wait() {
        return Some(status);
    }
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) on our own child, not reaped yet (try_wait above
        // saw it running), so the pid cannot name another process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let mut status = None;
    if wait_for(grace, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    }) {
        return status;
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A TCP port on 127.0.0.1 that was free a moment ago: bind to port 0, read
/// the port the kernel chose, and release it.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port");
    listener
        .local_addr()
        .expect("local_addr of the port-probing listener")
        .port()
}

/// A string unique within this machine for the life of the test run
/// (pid + process-wide counter + clock), for client ids and file names.
pub fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{}-{:08x}", std::process::id(), n, nanos)
}

/// The number in the environment variable `name`, else `default` (unset
/// or not a number): the knobs of the rig and the benches.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The last `max_lines` lines of `text` (for panic messages).
pub fn tail(text: &str, max_lines: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(max_lines);
    lines[start..].join("\n")
}
