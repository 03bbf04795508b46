//! Power cuts under concurrent ingest clients: every reading of a `full`
//! stream that got an `ok` is in the spool after a simulated power cut
//! ([`crate::support::powercut`]: what the last fsync of the WAL covered
//! survives, the rest is lost), however many clients' readings shared its
//! commit (issue 24, item 2: group commit).

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::powercut::PowerCut;
use crate::support::wait_for;
use serde_json::Value;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A board with a `full` stream `alarm` on the ingest socket and the
/// agent's checkpoints off, so every commit of the run is in the WAL (the
/// simulator's premise).
fn board(dir: &Path, url: &str, prefix: &str) -> PathBuf {
    let path = dir.join("board.toml");
    let text = format!(
        r#"device_id = "it-board"
[spool]
path = "{db}"
commit_window_ms = 50
wal_autocheckpoint_pages = 0
checkpoint_interval_secs = 86400
checkpoint_wal_bytes = 1073741824
tune_from_probe = false
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
[ingest]
socket = "{sock}"
# Eight clients of one uid at once, beside the readiness probe's connection
# whose thread may not have ended yet (with 8 the eighth client was once
# refused): room for both.
max_connections_per_peer = 16
[[ingest.streams]]
name = "alarm"
durability = "full"
"#,
        db = dir.join("spool.db").display(),
        sock = dir.join("run/ingest.sock").display(),
    );
    std::fs::write(&path, text).expect("write board config");
    path
}

/// One client: one request at a time on `alarm` until the connection
/// ends; every `ok` it got (its event id and `durable`) goes to `oks`.
fn client(sock: PathBuf, c: usize, oks: Arc<Mutex<Vec<(String, Value)>>>, n: Arc<AtomicUsize>) {
    let Ok(s) = UnixStream::connect(&sock) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
    let Ok(mut w) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    for i in 0.. {
        let line = format!("{{\"stream\":\"alarm\",\"fields\":{{\"client\":{c},\"n\":{i}}}}}\n");
        if w.write_all(line.as_bytes()).is_err() {
            return;
        }
        let mut reply = String::new();
        if !matches!(r.read_line(&mut reply), Ok(k) if k > 0) {
            return;
        }
        let v: Value = serde_json::from_str(&reply).expect("reply is JSON");
        assert_eq!(v["ok"], true, "client {c}: {v}");
        let id = v["event_id"].as_str().expect("event_id").to_owned();
        oks.lock().expect("oks").push((id, v["durable"].clone()));
        n.fetch_add(1, Ordering::Relaxed);
    }
}

/// 8 clients, one request at a time each, on a `full` stream; a power cut
/// mid-run. Every `ok` said `"durable":true`, every one of them is in the
/// spool after the cut, and the readings shared fsyncs (fewer WAL syncs
/// than oks).
#[test]
fn every_ok_of_eight_concurrent_clients_on_a_full_stream_survives_a_power_cut() {
    const CLIENTS: usize = 8;
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("spool.db");
    let sock = dir.path().join("run/ingest.sock");
    let cfg = board(dir.path(), &broker.url(), &crate::prefix("powercut"));
    let sim = PowerCut::new(dir.path(), &db);
    let env = sim.env();
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let sets = ["sources=[]".to_owned()];
    let mut agent = AgentProc::spawn_with_env(&cfg, &sets, dir.path(), &envs);
    let up = wait_for(Duration::from_secs(20), || {
        UnixStream::connect(&sock).is_ok()
    });
    assert!(up, "ingest socket never answered\n{}", agent.log_tail(30));

    let oks = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (sock, oks, count) = (sock.clone(), oks.clone(), count.clone());
            std::thread::spawn(move || client(sock, c, oks, count))
        })
        .collect();
    let busy = wait_for(Duration::from_secs(120), || {
        count.load(Ordering::Relaxed) >= 2_000
    });
    assert!(busy, "no 2,000 oks in 120 s\n{}", agent.log_tail(30));
    let cut = sim.cut(&mut agent);
    for h in clients {
        h.join().expect("client thread");
    }
    let oks = std::mem::take(&mut *oks.lock().expect("oks"));

    // Power back: the agent starts on what the cut left, and stops cleanly.
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    let up = wait_for(Duration::from_secs(30), || {
        UnixStream::connect(&sock).is_ok()
    });
    assert!(up, "no restart after the cut\n{}", agent.log_tail(30));
    assert!(agent
        .terminate(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    let stored: HashSet<String> = crate::support::spool::rows(&db)
        .into_iter()
        .filter(|r| r.stream == "alarm")
        .map(|r| r.event_id)
        .collect();
    let lost: Vec<&String> = oks
        .iter()
        .map(|(id, _)| id)
        .filter(|id| !stored.contains(*id))
        .collect();
    println!(
        "power cut: {} oks from {CLIENTS} clients, {} alarm rows after the cut; WAL {} -> {} bytes ({} syncs logged); {} ok'ed readings lost",
        oks.len(),
        stored.len(),
        cut.wal_before,
        cut.wal_after,
        cut.wal_syncs,
        lost.len()
    );
    assert!(cut.wal_syncs > 0, "the simulator saw no fsync of the WAL");
    // One fsync per reading would log at least one WAL sync per ok: the
    // clients' readings shared commits (group commit).
    assert!(
        cut.wal_syncs < oks.len(),
        "{} WAL fsyncs for {} oks: no reading shared a commit",
        cut.wal_syncs,
        oks.len()
    );
    assert!(
        oks.iter().all(|(_, d)| *d == Value::Bool(true)),
        "an ok on a full stream did not say durable"
    );
    assert!(
        lost.is_empty(),
        "{} readings answered ok were lost by the power cut, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
}
