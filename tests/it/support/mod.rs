//! Shared helpers for the integration tests: a real mosquitto broker, a TCP
//! fault proxy, a recording MQTT subscriber, a wrapper around the agent
//! binary and read-only access to the agent's SQLite spool.
#![allow(dead_code)]

pub mod agent;
pub mod broker;
pub mod fleet;
#[cfg(feature = "pg-sink")]
pub mod postgres;
pub mod powercut;
pub mod proxy;
pub mod publisher;
pub mod sink;
pub mod spool;
pub mod subscriber;

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Poll `f` every 50 ms until it returns true or `timeout` has passed.
/// Returns the last result of `f` (it is always called at least once, and
/// once more right at the deadline).
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50).min(deadline - now));
    }
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

/// The last `max_lines` lines of `text` (for panic messages).
pub fn tail(text: &str, max_lines: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(max_lines);
    lines[start..].join("\n")
}
