//! Backups and moves: `edgespool export` copies a live spool while the real
//! agent takes readings from an ingest socket client; the copy, restored
//! into a new spool directory, is delivered to a real mosquitto subscriber
//! under the same event ids; an export of a 100k-row spool never holds
//! ingest up for its read (replies keep coming about every commit window;
//! the figures are printed); and a bare copy of `spool.db` without
//! its `-wal`, taken while the agent ran, is named at ERROR when an agent
//! opens it.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::add_ingest;
use crate::support::broker::Broker;
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use crate::{prefix, write_config};
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The commit window of these boards (`write_config`).
const COMMIT_WINDOW: Duration = Duration::from_millis(50);

/// A board with no sources but the ingest socket (stream `load`), in `dir`.
fn board(dir: &Path, url: &str, prefix: &str) -> PathBuf {
    let cfg = write_config(dir, url, prefix, 1000);
    add_ingest(&cfg, "[[ingest.streams]]\nname = \"load\"\n");
    cfg
}

fn spawn(cfg: &Path, dir: &Path) -> AgentProc {
    AgentProc::spawn(cfg, &["sources=[]".into()], dir)
}

/// A broker URL nobody answers: the agent keeps every row PENDING. The
/// port stays bound (and never answers CONNECT) for the test's life, which
/// is its process's under nextest: a port merely found free was once taken
/// by another test's mosquitto, which acknowledged rows the agent then
/// purged, and the export held 96,003 of 100,000.
fn nowhere() -> String {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = held.local_addr().expect("local_addr").port();
    std::mem::forget(held);
    format!("mqtt://127.0.0.1:{port}")
}

/// One answered request of the load client.
#[derive(Clone)]
struct Answered {
    sent: Instant,
    took: Duration,
    event_id: String,
}

/// A client sending one reading at a time over the ingest socket, each
/// after the reply to the one before (the reply comes after the commit),
/// until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<Mutex<Vec<Answered>>>,
    count: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl Load {
    fn start(sock: &Path, agent: &AgentProc) -> Load {
        assert!(
            wait_for(Duration::from_secs(20), || UnixStream::connect(sock)
                .is_ok()),
            "the ingest socket never answered\n{}",
            agent.log_tail(30)
        );
        let s = UnixStream::connect(sock).expect("connect the ingest socket");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let (stop, answered, count) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(AtomicUsize::new(0)),
        );
        let (st, an, co) = (stop.clone(), answered.clone(), count.clone());
        let thread = std::thread::spawn(move || {
            let mut w = s.try_clone().expect("clone");
            let mut r = BufReader::new(s);
            let mut n = 0u64;
            while !st.load(Ordering::Relaxed) {
                n += 1;
                let sent = Instant::now();
                let line = format!("{{\"stream\":\"load\",\"fields\":{{\"n\":{n}}}}}\n");
                if w.write_all(line.as_bytes()).is_err() {
                    return;
                }
                let mut reply = String::new();
                if r.read_line(&mut reply).unwrap_or(0) == 0 {
                    return;
                }
                let took = sent.elapsed();
                let v: serde_json::Value = serde_json::from_str(&reply).expect("reply is JSON");
                assert_eq!(v["ok"], true, "{reply}");
                let event_id = v["event_id"].as_str().expect("event_id").to_owned();
                an.lock().expect("lock").push(Answered {
                    sent,
                    took,
                    event_id,
                });
                co.fetch_add(1, Ordering::Relaxed);
            }
        });
        Load {
            stop,
            answered,
            count,
            thread: Some(thread),
        }
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    fn wait_count(&self, n: usize, agent: &AgentProc) {
        assert!(
            wait_for(Duration::from_secs(60), || self.count() >= n),
            "only {} of {n} readings answered\n{}",
            self.count(),
            agent.log_tail(30)
        );
    }

    fn finish(mut self) -> Vec<Answered> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the load client panicked");
        }
        let a = self.answered.lock().expect("lock").clone();
        a
    }
}

/// `edgespool export --config CFG --to TO`: (success, stdout, stderr).
fn export(cfg: &Path, to: &Path) -> (bool, String, String) {
    let (status, out, err) = run_cli(&[
        "export",
        "--config",
        &cfg.display().to_string(),
        "--to",
        &to.display().to_string(),
    ]);
    (status.success(), out, err)
}

/// Event ids of the `load` rows in the spool file at `db`.
fn load_ids(db: &Path) -> Vec<String> {
    crate::support::spool::rows(db)
        .into_iter()
        .filter(|r| r.stream == "load")
        .map(|r| r.event_id)
        .collect()
}

fn quick_check(db: &Path) -> String {
    crate::support::spool::open(db)
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .expect("quick_check")
}

#[test]
fn an_export_under_ingest_load_restored_in_a_new_spool_directory_delivers_every_exported_row_under_its_event_id(
) {
    let live = tempfile::tempdir().expect("tempdir");
    let pfx = prefix("export");
    let cfg = board(live.path(), &nowhere(), &pfx);
    let agent = spawn(&cfg, live.path());
    let load = Load::start(&live.path().join("run/ingest.sock"), &agent);
    load.wait_count(300, &agent);
    let backups = tempfile::tempdir().expect("tempdir");
    let copy = backups.path().join("spool-backup.db");
    let before_export = Instant::now();
    let (ok, out, err) = export(&cfg, &copy);
    assert!(ok, "export failed: {out}{err}\n{}", agent.log_tail(20));
    println!("{}", out.trim());
    let during = load.count();
    load.wait_count(during + 100, &agent);
    let answered = load.finish();

    let mode = std::fs::metadata(&copy)
        .expect("the copy")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640, "mode {:o}", mode & 0o777);
    assert_eq!(quick_check(&copy), "ok");
    let leftovers: Vec<_> = std::fs::read_dir(backups.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "only the copy is left: {leftovers:?}");
    // Never over an existing file: refused by name, the copy untouched.
    let len = std::fs::metadata(&copy).expect("copy").len();
    let (ok2, _, err2) = export(&cfg, &copy);
    assert!(
        !ok2 && err2.contains("exists; refusing to overwrite"),
        "{err2}"
    );
    assert_eq!(std::fs::metadata(&copy).expect("copy").len(), len);

    // The copy is one committed state: every reading answered before the
    // export began is in it, and nothing that was never answered.
    let exported = load_ids(&copy);
    let exported_set: HashSet<&String> = exported.iter().collect();
    let all: HashSet<&String> = answered.iter().map(|a| &a.event_id).collect();
    for a in answered.iter().filter(|a| a.sent + a.took < before_export) {
        assert!(
            exported_set.contains(&a.event_id),
            "answered before the export, not in it"
        );
    }
    assert!(
        exported.iter().all(|id| all.contains(id)),
        "the copy holds an id never answered"
    );
    assert!(
        exported.len() < answered.len(),
        "ingest went on after the export"
    );
    drop(agent);

    // Restored: the file alone, as spool.db, in a new spool directory.
    let broker = Broker::start();
    let sub = Subscriber::events(broker.port(), &pfx);
    assert!(sub.wait_subscribed(Duration::from_secs(30)));
    let restored = tempfile::tempdir().expect("tempdir");
    std::fs::copy(&copy, restored.path().join("spool.db")).expect("restore the copy");
    let cfg2 = board(restored.path(), &broker.url(), &pfx);
    let agent2 = spawn(&cfg2, restored.path());
    let want: HashSet<String> = exported.iter().cloned().collect();
    let delivered = |d: &[crate::support::subscriber::Delivery]| -> HashSet<String> {
        d.iter()
            .map(crate::event_id)
            .filter(|id| want.contains(id))
            .collect()
    };
    assert!(
        sub.wait_until(Duration::from_secs(90), |d| delivered(d).len()
            == want.len()),
        "{} of {} exported rows arrived\n{}",
        delivered(&sub.deliveries()).len(),
        want.len(),
        agent2.log_tail(30)
    );
    let stored = crate::support::spool::rows(&copy);
    let r = crate::received(&sub.deliveries());
    for row in stored.iter().filter(|r| r.stream == "load") {
        let p = r.payloads.get(&row.event_id).expect("delivered");
        assert!(
            p.contains(&row.payload),
            "{}: another payload arrived",
            row.event_id
        );
    }
    assert!(
        !agent2.log_text().contains("has no -wal"),
        "a restored export was taken for a file without its -wal\n{}",
        agent2.log_tail(30)
    );
    println!(
        "export under load: {} readings answered, {} in the copy, all delivered from the restored spool",
        answered.len(),
        exported.len()
    );
}

/// 100,000 rows written with the agent's own spool code.
fn hundred_thousand_rows(db: &Path) {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let mut s = Spool::open(db, &SpoolOptions::default()).expect("spool");
    let mut ids = EventIdGen::new().expect("ids");
    // About 800 bytes a row (80 MB in all): the read takes long enough that
    // an export holding the write lock would keep ingest waiting far
    // longer than the bound below.
    let note = "pump 3 on, 2.5 bar; ".repeat(35);
    for batch in 0..100 {
        let evs: Vec<NewEvent> = (0..1000)
            .map(|i| NewEvent {
                replay: None,
                stream: "load".into(),
                ts_ms: 1_796_000_000_000 + batch * 1000 + i,
                clock_trusted: true,
                mono: None,
                fields: vec![
                    ("n".into(), FieldValue::Num((batch * 1000 + i) as f64)),
                    ("t".into(), FieldValue::Text(note.clone())),
                ],
                key: None,
                reply: None,
            })
            .collect();
        s.append(&evs, &mut ids, "it-board", Format::Json, 1)
            .expect("append");
    }
}

#[test]
fn an_export_of_a_100k_row_spool_never_holds_ingest_up_for_its_read() {
    let live = tempfile::tempdir().expect("tempdir");
    let db = live.path().join("spool.db");
    hundred_thousand_rows(&db);
    let cfg = board(live.path(), &nowhere(), &prefix("export-100k"));
    let agent = spawn(&cfg, live.path());
    let load = Load::start(&live.path().join("run/ingest.sock"), &agent);
    load.wait_count(200, &agent);
    let copy = live.path().join("backup.db");
    let (t0, (ok, out, err)) = (Instant::now(), export(&cfg, &copy));
    let t1 = Instant::now();
    assert!(ok, "export failed: {out}{err}");
    let after = load.count();
    load.wait_count(after + 50, &agent);
    let answered = load.finish();
    let rows = crate::support::spool::total(&copy);
    assert!(rows >= 100_000, "{rows} rows in the copy");
    // The longest wait for a reply that overlapped the export, and the
    // longest before it (the same machine, the same agent, no export).
    let overlapped = |a: &&Answered| a.sent < t1 && a.sent + a.took > t0;
    let during = answered
        .iter()
        .filter(overlapped)
        .map(|a| a.took)
        .max()
        .unwrap_or_default();
    // (After the first 100: the agent's start-up check of the file runs then.)
    let before = answered
        .iter()
        .skip(100)
        .filter(|a| a.sent + a.took <= t0)
        .map(|a| a.took)
        .max()
        .unwrap_or_default();
    let answered_during = answered.iter().filter(overlapped).count();
    // Where in the export the longest wait began (ms from its start).
    let at = answered
        .iter()
        .filter(overlapped)
        .max_by_key(|a| a.took)
        .map_or(0, |a| a.sent.saturating_duration_since(t0).as_millis());
    println!(
        "export of {rows} rows: {} ms (`{}`); longest ingest reply during it {} ms (from +{at} ms; {answered_during} readings answered meanwhile), before it {} ms; commit window {} ms",
        (t1 - t0).as_millis(),
        out.trim(),
        during.as_millis(),
        before.as_millis(),
        COMMIT_WINDOW.as_millis()
    );
    assert!(answered_during >= 2, "ingest stood still during the export");
    // Readings committed while the export ran (sent and answered inside
    // it): an export holding the write lock for its read would let none
    // through until it let go. How long a reply waited is a figure, printed
    // above, not a bound: a timed assertion fails on a loaded machine.
    let inside = answered
        .iter()
        .filter(|a| a.sent >= t0 && a.sent + a.took <= t1)
        .count();
    assert!(
        inside >= 1,
        "no reading was committed while the export ran ({answered_during} overlapped it)"
    );
}

#[test]
fn a_bare_copy_of_spool_db_taken_while_the_agent_ran_is_named_at_error_when_opened() {
    bare_copy_is_named_at_error(false);
}

/// `edgespool status` opens the copy read-only first, and SQLite then
/// creates an empty `-wal` beside it: a `-wal` with no frames is no `-wal`.
#[test]
fn a_bare_copy_looked_at_with_status_first_is_still_named_at_error_when_opened() {
    bare_copy_is_named_at_error(true);
}

/// A copy of `spool.db` alone, taken while an agent ran (`status --spool`
/// run on it first when `status_first`), opened by an agent: named at ERROR.
fn bare_copy_is_named_at_error(status_first: bool) {
    let live = tempfile::tempdir().expect("tempdir");
    let pfx = prefix(if status_first {
        "bare-copy-status"
    } else {
        "bare-copy"
    });
    let cfg = board(live.path(), &nowhere(), &pfx);
    let agent = spawn(&cfg, live.path());
    let load = Load::start(&live.path().join("run/ingest.sock"), &agent);
    load.wait_count(200, &agent);
    let moved = tempfile::tempdir().expect("tempdir");
    let db = moved.path().join("spool.db");
    std::fs::copy(live.path().join("spool.db"), &db).expect("copy spool.db alone");
    let answered = load.finish();
    drop(agent);
    if status_first {
        let (st, out, err) = run_cli(&["status", "--spool", &db.display().to_string()]);
        assert!(st.success(), "{out}{err}");
        let wal = moved.path().join("spool.db-wal");
        assert_eq!(
            std::fs::metadata(&wal).map(|m| m.len()).ok(),
            Some(0),
            "status left an empty -wal beside the copy"
        );
    }
    let cfg2 = board(moved.path(), &nowhere(), &pfx);
    let agent2 = spawn(&cfg2, moved.path());
    let named = format!("spool {} has no -wal", db.display());
    assert!(
        wait_for(Duration::from_secs(30), || agent2
            .logged("ERROR", "spool", &named)),
        "no ERROR naming the copy\n{}",
        agent2.log_tail(30)
    );
    assert!(
        agent2.log_text().contains("edgespool export"),
        "the ERROR says what to use"
    );
    let kept = load_ids(&db).len();
    println!(
        "bare copy: {} readings answered before it, {kept} in the file (the rest were in the -wal)",
        answered.len()
    );
}
