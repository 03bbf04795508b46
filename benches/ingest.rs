//! Ingest socket throughput, printed (no pass/fail): requests/s answered
//! `ok` for 1 and 8 concurrent clients on a `batched` and on a `full`
//! stream, and the ratio 8/1; the `full` stream once more with every sync
//! made slower, as on slow flash.
//!
//! Each client sends one request at a time over the Unix socket and waits
//! for its reply (the way a sensor script writes), so a client's rate is
//! one over the time from its line to its `ok`: a `batched` reading waits
//! for its commit window (`spool.commit_window_ms`), a `full` one for its
//! fsync. Concurrent clients can only go faster when their readings share
//! commits (the window for `batched`, group commit for `full`).
//!
//! Every run has its own spool and agent (the release binary, or
//! `EDGESPOOL_AGENT_BIN`; no sources; a real mosquitto takes the events).
//! `INGEST_SECS` (default 5) is how long each run counts replies after a
//! half-second warm-up, `INGEST_RUNS` (default 3) how many runs each
//! figure is the median of, `INGEST_WINDOW_MS` (default 200, the default
//! commit window) the `batched` stream's window, `INGEST_STREAMS` (default
//! `batched,full,full-slow`) which rows run, `INGEST_SYNC_DELAY_US` (default
//! 5000: an SD card's sync; 1000 for eMMC) what `full-slow` adds to each
//! `fsync`/`fdatasync` of the agent.
//!
//! Why `full-slow`: group commit pays where a sync costs more than the CPU
//! of a request. On a disk whose sync takes about 0.1 ms (a virtio disk,
//! an SSD) eight clients are bound by the CPU of two cores (the agent's
//! threads, the broker, the clients), not by syncs; on an SD card or eMMC a
//! sync takes 1-10 ms. The delay comes from the power-cut simulator's
//! `LD_PRELOAD` wrapper (`tests/it/support/powercut.rs`): the syncing
//! thread sleeps after the real sync, blocked as on a slow device, so the
//! agent's own CPU cost is unchanged.
//!
//! Run: `cargo bench --bench ingest` (needs mosquitto, and `cc` for the
//! full-slow row: `cross/setup-debian.sh`).

#[path = "../tests/it/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{agent::AgentProc, broker::Broker, env_u64, powercut::PowerCut, wait_for};

fn main() {
    let secs = env_u64("INGEST_SECS", 5);
    let runs = env_u64("INGEST_RUNS", 3).max(1);
    let window = env_u64("INGEST_WINDOW_MS", 200);
    let delay_us = env_u64("INGEST_SYNC_DELAY_US", 5000);
    let broker = Broker::start();
    let rows = std::env::var("INGEST_STREAMS").unwrap_or_else(|_| "batched,full,full-slow".into());
    // The sync wrapper is built (with `cc`) only for a full-slow row.
    let shim_dir = tempfile::tempdir().expect("tempdir");
    let slow_env = if rows.split(',').any(|r| r == "full-slow") {
        PowerCut::new(shim_dir.path(), &shim_dir.path().join("unused.db")).slow_sync_env(delay_us)
    } else {
        Vec::new()
    };
    println!(
        "edgespool ingest bench: socket requests/s, one request at a time per client, {secs} s per run, median of {runs}; batched window {window} ms; full-slow: +{delay_us} us per sync; {} cores; agent {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        support::agent::bin().display()
    );
    println!(
        "{:<10} {:>12} {:>12} {:>8}",
        "stream", "1 client", "8 clients", "8/1"
    );
    for row in rows.split(',') {
        let (stream, env): (&str, &[(&str, String)]) = match row {
            "batched" => ("batched", &[]),
            "full" => ("full", &[]),
            "full-slow" => ("full", &slow_env),
            other => {
                println!("{other:<10} (unknown row: batched, full or full-slow)");
                continue;
            }
        };
        let rate = |clients: usize| {
            let mut all: Vec<f64> = (0..runs)
                .map(|_| run(&broker, (stream, env), clients, secs, window))
                .collect();
            all.sort_by(f64::total_cmp);
            all[all.len() / 2]
        };
        let one = rate(1);
        let eight = rate(8);
        println!(
            "{row:<10} {one:>12.0} {eight:>12.0} {:>8.2}",
            eight / one.max(f64::MIN_POSITIVE)
        );
    }
}

/// A board with one ingest stream of each durability and no sources.
fn board(dir: &Path, url: &str, window_ms: u64) -> PathBuf {
    let path = dir.join("board.toml");
    let text = format!(
        r#"device_id = "bench-board"
[spool]
path = "{db}"
commit_window_ms = {window_ms}
tune_from_probe = false
[mqtt]
url = "{url}"
topic_prefix = "bench/ingest/{suffix}"
[ingest]
socket = "{sock}"
max_rate_per_sec = 1000000
max_connections_per_peer = 16
[[ingest.streams]]
name = "batched"
[[ingest.streams]]
name = "full"
durability = "full"
"#,
        db = dir.join("spool.db").display(),
        sock = dir.join("ingest.sock").display(),
        suffix = support::unique_suffix(),
    );
    std::fs::write(&path, text).expect("write bench config");
    path
}

/// One run: a fresh agent (with `env`), `clients` clients on `stream` for
/// `secs` seconds after a warm-up; the replies counted per second.
fn run(
    broker: &Broker,
    (stream, env): (&str, &[(&str, String)]),
    clients: usize,
    secs: u64,
    window_ms: u64,
) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = board(dir.path(), &broker.url(), window_ms);
    let sock = dir.path().join("ingest.sock");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut agent = AgentProc::spawn_with_env(&cfg, &["sources=[]".into()], dir.path(), &env);
    let up = wait_for(Duration::from_secs(30), || {
        UnixStream::connect(&sock).is_ok()
    });
    assert!(up, "ingest socket never answered\n{}", agent.log_tail(30));
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let replies = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (sock, stream) = (sock.clone(), stream.to_owned());
            let (counting, stop, replies) = (counting.clone(), stop.clone(), replies.clone());
            std::thread::spawn(move || {
                client(&sock, &stream, c, (&counting, &stop, &replies));
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    counting.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let n = replies.load(Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("client thread");
    }
    agent.terminate(Duration::from_secs(20));
    n as f64 / elapsed
}

/// One client: a request, its reply, the next, until `stop`; each `ok`
/// counted once `counting` is set. Panics on a refusal (the bench's load
/// is within every bound).
fn client(
    sock: &Path,
    stream: &str,
    c: usize,
    (counting, stop, replies): (&AtomicBool, &AtomicBool, &AtomicU64),
) {
    let s = UnixStream::connect(sock).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    let mut reply = String::new();
    let mut i: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let line = format!("{{\"stream\":\"{stream}\",\"fields\":{{\"client\":{c},\"n\":{i}}}}}\n");
        w.write_all(line.as_bytes()).expect("send");
        reply.clear();
        r.read_line(&mut reply).expect("reply");
        assert!(reply.starts_with("{\"ok\":true"), "refused: {reply}");
        if counting.load(Ordering::Relaxed) {
            replies.fetch_add(1, Ordering::Relaxed);
        }
        i += 1;
    }
}
