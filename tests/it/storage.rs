//! Storage under pressure: a full disk (F06), the spool size limit (I6), a
//! reader pinning the WAL (F01), with a large purge to do (F02), the spool
//! file replaced under the agent.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::{edit_config, Board, NO_BROKER};
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{count_by_state, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A small tmpfs mounted for one test (the tests run as root, as CI does),
/// mode 0755: a tmpfs's root is 1777 by default, and the agent refuses a
/// spool directory others can write, sticky or not.
pub(crate) struct SmallFs {
    pub(crate) dir: PathBuf,
}

impl SmallFs {
    pub(crate) fn mount(parent: &Path, size: &str) -> SmallFs {
        let dir = parent.join("small-fs");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(
            st.success(),
            "mounting a tmpfs needs root (CI runs as root)"
        );
        SmallFs { dir }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// A config whose `big` source produces ~`kb` KB readings every 10 ms.
fn big_config(
    dir: &Path,
    spool: &Path,
    url: &str,
    prefix: &str,
    kb: usize,
    extra_spool: &str,
) -> PathBuf {
    let blob = format!("{{\"blob\":\"{}\"}}", "x".repeat(kb * 1024));
    let cfg = dir.join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "store-board"
[spool]
path = "{}"
commit_window_ms = 50
checkpoint_interval_secs = 1
{extra_spool}
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 500
connect_timeout_secs = 2
max_payload_bytes = 1048576
[[sources]]
name = "big"
kind = "exec"
program = "/bin/echo"
args = [{blob:?}]
interval_ms = 10
"#,
            spool.display()
        ),
    )
    .expect("write config");
    cfg
}

fn counter(db: &Path, name: &str) -> i64 {
    let conn = crate::support::spool::open(db);
    conn.query_row("SELECT value FROM counters WHERE name = ?1", [name], |r| {
        r.get(0)
    })
    .unwrap_or(0)
}

/// field case F06: the writer keeps running while the disk is full, counts
/// what it refused, and resumes by itself when space returns.
#[test]
fn a_full_disk_refuses_readings_counted_and_writing_resumes_when_space_returns() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = SmallFs::mount(dir.path(), "6m");
    let filler = fs.dir.join("filler");
    std::fs::write(&filler, vec![0u8; 2 * 1024 * 1024]).expect("filler");
    let filler2 = fs.dir.join("filler2");
    std::fs::write(&filler2, vec![0u8; 1024 * 1024]).expect("filler2");
    let db = fs.dir.join("spool.db");
    let prefix = crate::prefix("diskfull");
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = big_config(
        dir.path(),
        &db,
        &proxy.url(),
        &prefix,
        8,
        "min_free_bytes = 0\nmax_bytes = 0",
    );
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    // While the disk is full even the counters cannot be stored: the log
    // says it at once, the counters land when space returns.
    assert!(
        agent.wait_log(Duration::from_secs(60), "ingest: disk full"),
        "never hit SQLITE_FULL: {:?}\n{}",
        count_by_state(&db),
        agent.log_tail(30)
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(agent.is_running(), "the agent died on a full disk");
    let stored_while_full = total(&db);
    // Space returns: writing resumes without a restart.
    std::fs::remove_file(&filler).expect("remove filler");
    assert!(
        wait_for(Duration::from_secs(20), || total(&db)
            > stored_while_full + 5),
        "writing did not resume: {} rows\n{}",
        total(&db),
        agent.log_tail(30)
    );
    let dropped = counter(&db, "readings_dropped_disk_full");
    assert!(dropped > 0, "refused readings were not counted");
    assert_eq!(
        counter(&db, "readings_dropped_disk_full.big"),
        dropped,
        "the per-stream count differs from the total"
    );
    agent.terminate(Duration::from_secs(15));
    // The operator frees more room, the broker comes back: the spool drains
    // and every stored row arrives.
    std::fs::remove_file(&filler2).expect("remove filler2");
    proxy.set_mode(Mode::Forward);
    crate::drain(&cfg, dir.path(), &db);
    crate::assert_invariants(&db, &sub.deliveries());
    drop(fs);
}

/// I6: at the spool size limit new readings are refused and counted; no
/// unacknowledged row is ever deleted; acknowledged rows make room.
#[test]
fn at_the_spool_limit_new_readings_are_refused_and_no_unacked_row_is_deleted() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("spool.db");
    let prefix = crate::prefix("cap");
    let sub = Subscriber::events(broker.port(), &prefix);
    let cfg = big_config(
        dir.path(),
        &db,
        &proxy.url(),
        &prefix,
        16,
        "max_bytes = 1048576",
    );
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || db.exists()
            && counter(&db, "readings_dropped_spool_full") > 0),
        "{}",
        agent.log_tail(30)
    );
    let rows_at_limit = total(&db);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        total(&db),
        rows_at_limit,
        "rows were added or deleted while over the limit"
    );
    assert!(counter(&db, "readings_dropped_spool_full.big") > 0);
    let first_id: i64 = crate::support::spool::rows(&db)[0].id;
    assert_eq!(first_id, 1, "an unacknowledged row was deleted");
    assert!(wait_for(Duration::from_secs(10), || {
        let (_, out, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
        out.contains("health: degraded") && out.contains("refusing readings: spool holds")
    }));
    // The broker comes back: acknowledged rows are dropped oldest first to make room.
    proxy.set_mode(Mode::Forward);
    assert!(
        wait_for(Duration::from_secs(30), || counter(
            &db,
            "events_purged_for_space"
        ) > 0),
        "{}",
        agent.log_tail(30)
    );
    let max_before: i64 = crate::support::spool::rows(&db)
        .last()
        .map(|r| r.id)
        .unwrap_or(0);
    assert!(wait_for(
        Duration::from_secs(20),
        || crate::support::spool::rows(&db)
            .last()
            .map(|r| r.id)
            .unwrap_or(0)
            > max_before
    ));
    agent.terminate(Duration::from_secs(15));
    // Every row that was ever purged had been received (acknowledged) first.
    let received = crate::received(&sub.deliveries());
    let purged = counter(&db, "events_purged_for_space");
    assert!(received.times.len() as i64 >= purged);
}

/// field case F01: a reader holding a snapshot blocks checkpoints; the agent
/// says so (health, counter), keeps ingesting and delivering, and the WAL
/// shrinks back once the reader is gone.
#[test]
fn a_reader_pinning_the_wal_degrades_health_and_the_wal_shrinks_once_it_leaves() {
    let broker = Broker::start();
    let prefix = crate::prefix("pin");
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 20);
    let sub = Subscriber::events(broker.port(), &prefix);
    let wal = dir.path().join("spool.db-wal");
    let sets = [
        "spool.checkpoint_wal_bytes=65536".to_owned(),
        "spool.journal_size_limit_bytes=65536".to_owned(),
    ];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(wait_for(Duration::from_secs(10), || db.exists() && total(&db) > 10));
    let reader = rusqlite::Connection::open(&db).expect("reader");
    reader
        .execute_batch("BEGIN; SELECT count(*) FROM events;")
        .expect("hold a read snapshot");
    let _: i64 = reader
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .expect("read");
    let delivered_before = sub.count();
    assert!(
        wait_for(Duration::from_secs(20), || {
            let (_, out, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
            out.contains("health: degraded") && out.contains("checkpoint blocked")
        }),
        "{}",
        agent.log_tail(30)
    );
    assert!(counter(&db, "wal_checkpoint_blocked") > 0);
    let pinned_wal = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    assert!(
        pinned_wal > 65536,
        "WAL did not grow while pinned ({pinned_wal} bytes)"
    );
    assert!(
        sub.count() > delivered_before,
        "delivery stopped while the WAL was pinned"
    );
    reader.execute_batch("COMMIT").expect("release");
    drop(reader);
    assert!(
        wait_for(Duration::from_secs(20), || std::fs::metadata(&wal)
            .map(|m| m.len())
            .unwrap_or(0)
            <= 65536),
        "WAL stayed at {} bytes after the reader left\n{}",
        std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0),
        agent.log_tail(20)
    );
    assert!(wait_for(Duration::from_secs(20), || {
        let (_, out, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
        out.contains("health: ok")
    }));
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn a_spool_file_replaced_under_the_agent_stops_it_for_the_supervisor() {
    let Board { dir, cfg, db } = Board::new(NO_BROKER, &crate::prefix("replaced"), 50);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(wait_for(Duration::from_secs(10), || db.exists() && total(&db) > 0));
    let copy = dir.path().join("copy.db");
    std::fs::copy(&db, &copy).expect("copy");
    std::fs::rename(&copy, &db).expect("replace");
    let status = agent.wait(Duration::from_secs(20));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "{}",
        agent.log_tail(20)
    );
    assert!(agent
        .log_text()
        .contains("was removed or replaced under the running agent"));
}

/// field case F02: a large retention purge runs in bounded batches with
/// checkpoints between them, so the WAL stays a fraction of what one big
/// delete transaction writes, and exactly the old acknowledged rows go.
#[test]
fn a_large_retention_purge_keeps_the_wal_bounded_and_removes_exactly_the_old_rows() {
    const OLD: usize = 40_000;
    const KEEP: usize = 2_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("spool.db");
    old_acked_rows(&db, OLD, KEEP);
    let naive_wal = one_transaction_purge_wal(&db);
    let cfg = crate::write_config(
        dir.path(),
        "mqtt://127.0.0.1:9",
        &crate::prefix("purge"),
        1000,
    );
    let wal = dir.path().join("spool.db-wal");
    let mut agent = AgentProc::spawn(
        &cfg,
        &[
            "sources=[]".into(),
            "spool.acked_retention_secs=3600".into(),
            "spool.purge_batch_rows=5000".into(),
        ],
        dir.path(),
    );
    let mut peak = 0u64;
    let done = wait_for(Duration::from_secs(60), || {
        peak = peak.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        counter(&db, "events_purged_acked") >= OLD as i64
    });
    assert!(
        done,
        "purge incomplete: {}\n{}",
        counter(&db, "events_purged_acked"),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    println!("retention purge of {OLD} rows: peak WAL {peak} bytes in batches of 5000; one big delete wrote {naive_wal} bytes of WAL");
    assert_eq!(
        counter(&db, "events_purged_acked"),
        OLD as i64,
        "the retention counter"
    );
    assert_eq!(total(&db), KEEP as i64, "exactly the old rows are gone");
    assert!(
        peak * 3 < naive_wal,
        "peak WAL {peak} is not well below the single-transaction {naive_wal}"
    );
}

/// F01 meeting F02: a reader that pins the WAL while retention has a large
/// purge to do holds the purge at one batch (the WAL grows by one batch,
/// not by every batch a pass has time for); once it leaves, the purge
/// finishes, each batch starting the WAL over.
#[test]
fn a_reader_pinning_the_wal_holds_a_large_purge_at_one_batch_until_it_leaves() {
    const OLD: usize = 40_000;
    const KEEP: usize = 2_000;
    const BATCH: i64 = 5_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("spool.db");
    old_acked_rows(&db, OLD, KEEP);
    let naive_wal = one_transaction_purge_wal(&db);
    let reader = rusqlite::Connection::open(&db).expect("reader");
    reader
        .execute_batch("BEGIN; SELECT count(*) FROM events;")
        .expect("hold a read snapshot");
    let cfg = crate::write_config(
        dir.path(),
        "mqtt://127.0.0.1:9",
        &crate::prefix("pinpurge"),
        1000,
    );
    let wal = dir.path().join("spool.db-wal");
    let wal_len = || std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    // A long checkpoint interval: the one batch per interval a pinned WAL
    // still gets does not come during the test.
    let mut agent = AgentProc::spawn(
        &cfg,
        &[
            "sources=[]".into(),
            "spool.acked_retention_secs=3600".into(),
            "spool.purge_batch_rows=5000".into(),
            "spool.checkpoint_interval_secs=3600".into(),
        ],
        dir.path(),
    );
    // The first batch, then a later pass finding the reader still there.
    assert!(
        wait_for(Duration::from_secs(30), || {
            agent.logged("INFO", "flash", "retention and free-page steps held")
        }),
        "purged {}\n{}",
        counter(&db, "events_purged_acked"),
        agent.log_tail(30)
    );
    let pinned_wal = wal_len();
    assert_eq!(
        counter(&db, "events_purged_acked"),
        BATCH,
        "batches kept coming into a WAL a reader pins (WAL {pinned_wal} bytes)\n{}",
        agent.log_tail(30)
    );
    assert!(
        pinned_wal * 3 < naive_wal,
        "pinned WAL {pinned_wal} bytes against {naive_wal} for the whole purge"
    );
    reader.execute_batch("COMMIT").expect("release");
    drop(reader);
    let mut peak = 0u64;
    assert!(
        wait_for(Duration::from_secs(60), || {
            peak = peak.max(wal_len());
            counter(&db, "events_purged_acked") >= OLD as i64
        }),
        "purge did not resume: {}\n{}",
        counter(&db, "events_purged_acked"),
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    println!("pinned: WAL {pinned_wal} bytes after one batch; after the reader left, peak WAL {peak} bytes; one big delete wrote {naive_wal}");
    assert_eq!(total(&db), KEEP as i64, "exactly the old rows are gone");
    assert!(
        peak * 3 < naive_wal,
        "peak WAL {peak} bytes after the reader left, against {naive_wal}"
    );
}

/// A spool of `old + keep` acknowledged rows of about 250 bytes, the first
/// `old` appended long ago (retention counts from the append), the rest
/// just now; the WAL checkpointed away.
fn old_acked_rows(db: &Path, old: usize, keep: usize) {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let mut s = Spool::open(db, &SpoolOptions::default()).expect("open");
    let mut ids = EventIdGen::new().expect("ids");
    let ev = |i: usize| NewEvent {
        replay: None,
        stream: "old".into(),
        ts_ms: i as i64,
        clock_trusted: true,
        mono: None,
        fields: vec![
            ("x".into(), FieldValue::Num(i as f64)),
            ("pad".into(), FieldValue::Text("p".repeat(200))),
        ],
        key: None,
        reply: None,
    };
    let now = edgespool::event::envelope::wall_clock_ms().0;
    for chunk in 0..(old + keep) / 1000 {
        let batch: Vec<NewEvent> = (0..1000).map(|i| ev(chunk * 1000 + i)).collect();
        let at = if chunk * 1000 < old { 1_000 } else { now };
        s.append(&batch, &mut ids, "d", Format::Json, at)
            .expect("append");
    }
    let all: Vec<i64> = s
        .sendable(0, old + keep)
        .expect("rows")
        .iter()
        .map(|r| r.id)
        .collect();
    s.retire(&all).expect("retire");
    s.checkpoint(edgespool::spool::CheckpointMode::Truncate)
        .expect("checkpoint");
}

/// The naive purge, on a copy of `db`: one transaction deleting every row
/// `old_acked_rows` made old. Returns the WAL bytes it wrote.
fn one_transaction_purge_wal(db: &Path) -> u64 {
    let naive = db.with_file_name("naive.db");
    std::fs::copy(db, &naive).expect("copy");
    let c = rusqlite::Connection::open(&naive).expect("open copy");
    let _: String = c
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .expect("wal");
    c.execute_batch("PRAGMA wal_autocheckpoint=0; BEGIN IMMEDIATE; DELETE FROM events WHERE created_ms < 2000; COMMIT;")
        .expect("naive delete");
    std::fs::metadata(db.with_file_name("naive.db-wal"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// A deliberately slowed spool device (an injected fsync delay in the storage
/// probe) gets different derived knobs, and delivery still holds.
#[test]
fn a_slower_device_gets_a_longer_commit_window_and_delivery_still_holds() {
    let broker = Broker::start();
    let prefix = crate::prefix("slowdev");
    let sub = Subscriber::events(broker.port(), &prefix);
    let Board { dir, cfg, db } = Board::new(&broker.url(), &prefix, 50);
    // No commit_window_ms in this config: the probe decides it.
    edit_config(&cfg, |t| t.replace("commit_window_ms = 50\n", ""));
    let mut agent = AgentProc::spawn_with_env(
        &cfg,
        &[],
        dir.path(),
        &[(edgespool::flash::probe::DELAY_ENV, "20")],
    );
    let line = agent.await_line(Duration::from_secs(20), "storage probe (measured now)");
    println!("{line}");
    let window: u64 = line
        .split("commit window ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("window in the log line");
    assert!(
        window >= 200,
        "a 20 ms fsync should give a window of at least 200 ms, got {window}"
    );
    assert!(sub.wait_count(Duration::from_secs(20), 20));
    agent.terminate(Duration::from_secs(15));
    crate::drain(&cfg, dir.path(), &db);
    crate::assert_invariants(&db, &sub.deliveries());
}

/// What an operator's cleanup (`rm /var/lib/edgespool/*-shm`, a tmpfiles
/// rule, a script that "clears lock files") does to a running agent: the
/// spool's `-shm` file (the WAL index) is removed under it. The agent keeps
/// running on the index it mapped, and says at WARN which file went and
/// what that means for any other process that opens the spool. Issue 26, 4.
#[test]
fn a_shm_file_removed_under_the_agent_is_named_in_a_warning_and_the_agent_runs_on() {
    let Board { dir, cfg, db } = Board::new(NO_BROKER, &crate::prefix("shm"), 50);
    let shm = dir.path().join("spool.db-shm");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        // The first summary: the spool is open for good (the -shm of a
        // connection closed during the start is gone with it).
        wait_for(Duration::from_secs(10), || shm.exists()
            && agent.log_text().contains("summary: ")),
        "{}",
        agent.log_tail(20)
    );
    std::fs::remove_file(&shm).expect("remove -shm");
    // Not reading the spool here: that would build a new -shm.
    let named = format!(
        "spool -shm file {} was removed under the running agent",
        shm.display()
    );
    assert!(
        wait_for(Duration::from_secs(20), || agent
            .logged("WARN", "flash", &named)),
        "{}",
        agent.log_tail(20)
    );
    let line = agent
        .log_text()
        .lines()
        .find(|l| l.contains(&named))
        .unwrap_or_default()
        .to_owned();
    assert!(
        line.contains("stop the agent cleanly and start it again"),
        "{line}"
    );
    // Once, not at every upkeep pass (one a second here): two more
    // summaries (one each 2 s) are four passes.
    let summaries = || agent.log_text().matches("summary: ").count();
    let seen = summaries();
    assert!(
        wait_for(Duration::from_secs(20), || summaries() >= seen + 2),
        "{}",
        agent.log_tail(20)
    );
    assert_eq!(agent.log_text().matches(&named).count(), 1);
    assert!(agent.is_running(), "{}", agent.log_tail(20));
    agent.terminate(Duration::from_secs(15));
    assert!(total(&db) > 0);
}

/// A `storage-profile.json` a power cut or a stray write left damaged
/// (empty, NUL-filled, not JSON, JSON of another shape) is not used: each
/// start names the file and what is wrong with it in a WARN, measures the
/// storage again and stores a good profile, which the next start uses.
#[test]
fn a_damaged_storage_profile_is_named_with_the_reason_and_measured_again() {
    let Board { dir, cfg, .. } = Board::new(NO_BROKER, &crate::prefix("profile"), 200);
    let profile = dir.path().join("storage-profile.json");
    let start = || {
        let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
        let seen = wait_for(Duration::from_secs(30), || {
            agent.log_text().contains("storage probe (")
        });
        agent.terminate(Duration::from_secs(15));
        assert!(seen, "no storage probe line\n{}", agent.log_tail(20));
        agent.log_text()
    };
    start();
    assert!(profile.exists());
    let cases: [(&[u8], &str); 4] = [
        (b"", "it is damaged: empty"),
        (
            &[0u8; 4096],
            "it is damaged: NUL-filled (4096 bytes of zeros",
        ),
        (b"{\"device\": 2049, \"fs_ty", "it is damaged: not JSON ("),
        (
            b"{\"device\": 2049}",
            "it is damaged: JSON, but not a storage profile (",
        ),
    ];
    for (bytes, why) in cases {
        std::fs::write(&profile, bytes).expect("write profile");
        let log = start();
        let named = format!("storage profile {} is ignored: {why}", profile.display());
        assert!(
            log.lines()
                .any(|l| l.contains(" WARN ") && l.contains(&named)),
            "{why:?} not named\n{log}"
        );
        assert!(log.contains("storage probe (measured now)"), "{log}");
        // Stored again, and believed at the next start.
        let log = start();
        assert!(log.contains("storage probe (stored profile)"), "{log}");
        assert!(!log.contains("is ignored"), "{log}");
    }
}
