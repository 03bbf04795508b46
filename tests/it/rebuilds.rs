//! Watchdog rebuilds against a broker that stalls: every rebuild ends the
//! connection's poller thread within a bound, so 50 rebuilds leave the
//! agent's thread count and resident memory flat (issue 37, item 4).
//!
//! The stall is a small TCP proxy of this file's own in front of a real
//! mosquitto: it forwards everything the agent sends and, from the broker,
//! only the CONNACK. After that the broker's bytes (PUBACKs, PINGRESPs) are
//! swallowed, and when the broker closes its side (it does on the agent's
//! DISCONNECT) the agent's side stays open: a link that went quiet without a
//! FIN. `support::proxy`'s `DropPubacks` is not enough here: it passes the
//! broker's close on, and that alone wakes an old poller.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::proxy::split_packets;
use crate::support::spool;
use crate::{prefix, write_config};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Rebuilds the test waits for.
const REBUILDS: i64 = 50;
/// Threads the agent may have over the count after its first rebuild: the
/// poller of the connection of the moment may be up or not when sampled.
const THREADS_OVER: usize = 2;
/// Resident memory the agent may gain from its 5th rebuild to its 50th:
/// the backlog grows (a reading every 250 ms, none retired) and SQLite's
/// page cache with it, about 0.7 MiB here. Each poller left behind held
/// about 200 KiB (its stack, its event loop's buffers): 3 to 5 MiB gained
/// when 13 to 28 of them were.
const RSS_OVER_KIB: u64 = 2 * 1024;

/// A proxy that passes the CONNACK and then nothing more from the broker.
struct Stall {
    port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Stall {
    fn start(upstream: u16) -> Stall {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the stall proxy");
        let port = listener.local_addr().expect("stall proxy address").port();
        listener
            .set_nonblocking(true)
            .expect("stall proxy listener non-blocking");
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let stop = stop.clone();
                            std::thread::spawn(move || relay(client, upstream, &stop));
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })
        };
        Stall {
            port,
            stop,
            accept: Some(accept),
        }
    }

    fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// One agent connection: its bytes to the broker; the broker's first packet
/// back, then none. Ends when the agent closes its side (or the test ends).
fn relay(client: TcpStream, upstream: u16, stop: &Arc<AtomicBool>) {
    let Ok(broker) = TcpStream::connect(("127.0.0.1", upstream)) else {
        return;
    };
    let _ = client.set_read_timeout(Some(Duration::from_millis(100)));
    let _ = broker.set_read_timeout(Some(Duration::from_millis(100)));
    let back = {
        let (mut from, mut to) = match (broker.try_clone(), client.try_clone()) {
            (Ok(b), Ok(c)) => (b, c),
            _ => return,
        };
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            let mut pending = Vec::new();
            let mut passed = false;
            while !stop.load(Ordering::Relaxed) {
                match from.read(&mut buf) {
                    // The broker closed: the agent is not told.
                    Ok(0) => return,
                    Ok(n) if !passed => {
                        pending.extend_from_slice(&buf[..n]);
                        if let Some(connack) = split_packets(&mut pending).into_iter().next() {
                            passed = true;
                            if to.write_all(&connack).is_err() {
                                return;
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(_) => return,
                }
            }
        })
    };
    let (mut from, mut to) = (&client, &broker);
    let mut buf = vec![0u8; 16 * 1024];
    // Once the broker is gone the agent's bytes are read and dropped, and
    // its side stays open, as on a link that went quiet.
    let mut broker_gone = false;
    while !stop.load(Ordering::Relaxed) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if !broker_gone && to.write_all(&buf[..n]).is_err() {
                    broker_gone = true;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = broker.shutdown(Shutdown::Both);
    let _ = back.join();
    let _ = client.shutdown(Shutdown::Both);
}

/// Threads of process `pid` now (`/proc/PID/task`).
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The names of process `pid`'s threads, counted (`/proc/PID/task/*/comm`).
fn thread_names(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut names = std::collections::BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        *names.entry(name.trim().to_owned()).or_insert(0) += 1;
    }
    names
}

/// Resident memory of process `pid`, KiB (`VmRSS` in `/proc/PID/status`).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The spool's count of watchdog rebuilds (0 before the table exists).
fn rebuilds(db: &Path) -> i64 {
    if !db.exists() {
        return 0;
    }
    spool::open(db)
        .query_row(
            "SELECT value FROM counters WHERE name = 'mqtt_watchdog_rebuilds'",
            [],
            |r| r.get(0),
        )
        .unwrap_or(0)
}

/// One sample of the agent.
#[derive(Debug, Clone, Copy)]
struct Sample {
    rebuilds: i64,
    threads: usize,
    rss_kib: u64,
}

#[test]
fn fifty_watchdog_rebuilds_against_a_stalled_broker_leave_threads_and_memory_flat() {
    let broker = Broker::start();
    let stall = Stall::start(broker.port());
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write_config(dir.path(), &stall.url(), &prefix("rebuilds"), 250);
    let db = dir.path().join("spool.db");
    // A 1 s watchdog and quick reconnects; a long keep-alive, so that no
    // ping (whose answer the stall swallows) ends a connection for us: only
    // the watchdog does, and only the rebuild's own ending of the poller
    // can keep the thread count flat.
    let sets = [
        "mqtt.ack_timeout_secs=1".to_owned(),
        "mqtt.keep_alive_secs=600".to_owned(),
        "mqtt.reconnect_max_ms=200".to_owned(),
    ];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    let pid = agent.pid();
    let mut samples: Vec<Sample> = Vec::new();
    let mut named_first = false;
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let s = Sample {
            rebuilds: rebuilds(&db),
            threads: threads(pid),
            rss_kib: rss_kib(pid),
        };
        samples.push(s);
        if s.rebuilds >= 1 && !named_first {
            named_first = true;
            println!(
                "threads by name at the first rebuild: {:?}",
                thread_names(pid)
            );
        }
        if s.rebuilds >= REBUILDS {
            break;
        }
        assert!(
            Instant::now() < deadline && agent.is_running(),
            "{} watchdog rebuilds of {REBUILDS} in 300 s (or the agent exited)\n{}",
            s.rebuilds,
            agent.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "threads by name at the {REBUILDS}th rebuild: {:?}",
        thread_names(pid)
    );
    // Stopping stays bounded too.
    let stopped = agent.terminate(Duration::from_secs(15));
    let at = |n: i64| {
        samples
            .iter()
            .find(|s| s.rebuilds >= n)
            .copied()
            .expect("a sample at every count up to the last")
    };
    let first = at(1);
    let fifth = at(5);
    let last = samples.last().copied().expect("samples");
    let after_first = samples.iter().filter(|s| s.rebuilds >= 1);
    let max_threads = after_first.clone().map(|s| s.threads).max().unwrap_or(0);
    let max_rss = samples
        .iter()
        .filter(|s| s.rebuilds >= 5)
        .map(|s| s.rss_kib)
        .max()
        .unwrap_or(0);
    println!("rebuilds  threads  rss_kib");
    for n in [1, 5, 10, 20, 30, 40, REBUILDS] {
        let s = at(n);
        println!("{:>8}  {:>7}  {:>7}", s.rebuilds, s.threads, s.rss_kib);
    }
    println!(
        "threads after the first rebuild: {} (max {max_threads}); rss after the 5th: {} KiB, \
         at the {REBUILDS}th: {} KiB (max {max_rss} KiB, {:+} KiB)",
        first.threads,
        fifth.rss_kib,
        last.rss_kib,
        max_rss as i64 - fifth.rss_kib as i64
    );
    assert!(
        max_threads <= first.threads + THREADS_OVER,
        "threads grew from {} after the first rebuild to {max_threads} over {REBUILDS} rebuilds",
        first.threads
    );
    assert!(
        max_rss <= fifth.rss_kib + RSS_OVER_KIB,
        "resident memory grew from {} KiB at the 5th rebuild to {max_rss} KiB by the {REBUILDS}th",
        fifth.rss_kib
    );
    let left = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("did not stop in time"))
        .count();
    assert_eq!(left, 0, "threads left behind\n{}", agent.log_tail(40));
    assert!(
        stopped.is_some_and(|s| s.success()),
        "the agent did not stop cleanly: {stopped:?}\n{}",
        agent.log_tail(40)
    );
}
