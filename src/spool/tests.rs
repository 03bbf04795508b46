//! The spool's tests: two real connections on one real file where it matters.

use super::delivery::SQL_MARK;
use super::schema::{MIGRATION_1, MIGRATION_2, MIGRATION_3, MIGRATION_4};
use super::*;
use crate::event::envelope::{self, EventIdGen, Format};
use crate::event::reading::{FieldValue, ReplayPosition};
use rusqlite::params;

fn ev(stream: &str, x: f64) -> NewEvent {
    NewEvent {
        replay: None,
        stream: stream.into(),
        ts_ms: 1,
        clock_trusted: true,
        mono: None,
        fields: vec![("x".into(), FieldValue::Num(x))],
        key: None,
        reply: None,
    }
}

fn open(dir: &Path) -> Spool {
    Spool::open(&dir.join("spool.db"), &SpoolOptions::default()).unwrap()
}

fn replayed(trace: &str, lap: u64, line: u64) -> NewEvent {
    let mut e = ev("air", line as f64);
    e.replay = Some(ReplayPosition {
        trace_id: trace.into(),
        fingerprint: "f".into(),
        lap,
        line,
        offset: line * 10,
        shift_ms: 0,
        pass: Default::default(),
        segment: None,
    });
    e
}

fn event_ids(s: &Spool) -> Vec<String> {
    s.query_all("SELECT event_id FROM event_states ORDER BY id", [], |r| {
        r.get(0)
    })
    .unwrap()
}

#[test]
fn replayed_rows_get_derived_ids_and_their_position_commits_with_them() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let mut ids = EventIdGen::new().unwrap();
    let batch: Vec<NewEvent> = (2..5).map(|l| replayed("fp:a", 0, l)).collect();
    assert_eq!(
        s.append(&batch, &mut ids, "dev", Format::Json, 0).unwrap(),
        3
    );
    // Each id derives from the row's position and its payload as encoded
    // with the all-zero id (the JSON names the id once, as its hyphenated text).
    let rows: Vec<(String, Vec<u8>)> = s
        .query_all(
            "SELECT event_id, payload FROM event_states ORDER BY id",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    let zero = envelope::ZERO_EVENT_ID.hyphenated();
    let want: Vec<String> = (2..5)
        .zip(&rows)
        .map(|(l, (id, payload))| {
            let body = String::from_utf8(payload.clone())
                .unwrap()
                .replace(id, &zero);
            let row = envelope::replay_row_id("dev", "air", "fp:a", 0, l);
            envelope::derived_event_id(&row, body.as_bytes()).hyphenated()
        })
        .collect();
    assert_eq!(event_ids(&s), want);
    assert_eq!(s.replay_position("air").unwrap(), batch[2].replay);
    assert_eq!(s.replay_position("other").unwrap(), None);

    // A second reader of the same trace (a reload racing the old
    // thread): rows already stored are not appended again.
    let overlap: Vec<NewEvent> = (3..6).map(|l| replayed("fp:a", 0, l)).collect();
    assert_eq!(
        s.append(&overlap, &mut ids, "dev", Format::Json, 0)
            .unwrap(),
        1
    );
    let skipped: i64 = s
        .conn
        .query_row(
            "SELECT value FROM counters WHERE name = 'replay_rows_already_spooled'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(skipped, 2);
    // The next lap, and another trace, are new rows.
    let more = [replayed("fp:a", 1, 2), replayed("fp:b", 0, 2)];
    assert_eq!(
        s.append(&more, &mut ids, "dev", Format::Json, 0).unwrap(),
        2
    );
    let all = event_ids(&s);
    assert_eq!(all.len(), 6);
    let distinct: std::collections::HashSet<&String> = all.iter().collect();
    assert_eq!(distinct.len(), 6);
    drop(s);
    let s = open(d.path());
    assert_eq!(s.replay_position("air").unwrap(), more[1].replay);
    // An unreadable stored value counts as none.
    s.conn
        .execute(
            "UPDATE agent_state SET value = 'junk' WHERE key = 'replay_position.air'",
            [],
        )
        .unwrap();
    assert_eq!(s.replay_position("air").unwrap(), None);
}

#[test]
fn open_puts_the_spool_in_wal_mode_and_reads_pragmas_back() {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    let p = s.pragmas();
    assert_eq!(p.journal_mode, "wal");
    assert_eq!(p.synchronous, 1);
    assert_eq!(p.busy_timeout_ms, 5000);
    assert_eq!(p.journal_size_limit, 4 * 1024 * 1024);
}

#[test]
fn a_rollback_journal_database_is_converted_to_wal() {
    // field case F07 (b): a spool created in DELETE mode by an older build.
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    {
        let c = Connection::open(&path).unwrap();
        let m: String = c
            .query_row("PRAGMA journal_mode=DELETE", [], |r| r.get(0))
            .unwrap();
        assert_eq!(m, "delete");
        c.execute_batch("CREATE TABLE t(x)").unwrap();
    }
    let s = Spool::open(&path, &SpoolOptions::default()).unwrap();
    assert_eq!(s.pragmas().journal_mode, "wal");
}

#[test]
fn sequences_are_per_stream_and_survive_reopen() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    {
        let mut s = open(d.path());
        s.append(
            &[ev("a", 1.0), ev("b", 2.0), ev("a", 3.0)],
            &mut ids,
            "d",
            Format::Json,
            0,
        )
        .unwrap();
    }
    let mut s = open(d.path());
    s.append(&[ev("a", 4.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let rows = s.sendable(0, 10).unwrap();
    let seqs: Vec<(String, i64)> = rows
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
            (r.stream.clone(), v["seq"].as_i64().unwrap())
        })
        .collect();
    assert_eq!(
        seqs,
        vec![
            ("a".into(), 1),
            ("b".into(), 1),
            ("a".into(), 2),
            ("a".into(), 3)
        ]
    );
    assert!(rows.iter().all(|r| r.digest_ok()));
}

#[test]
fn only_retire_makes_a_row_acked_and_purge_only_removes_acked_rows() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    s.append(
        &[ev("a", 1.0), ev("a", 2.0), ev("a", 3.0)],
        &mut ids,
        "d",
        Format::Json,
        0,
    )
    .unwrap();
    let rows = s.sendable(0, 10).unwrap();
    s.mark_sent(&[rows[0].id, rows[1].id]).unwrap();
    assert_eq!(s.retire(&[rows[0].id]).unwrap(), 1);
    // Retiring twice changes nothing.
    assert_eq!(s.retire(&[rows[0].id]).unwrap(), 0);
    // Purge with a cutoff far in the future removes only the ACKED row.
    assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 1);
    let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, vec![rows[1].id, rows[2].id]);
    // mark_sent on an acked row does not resurrect it.
    s.retire(&[rows[1].id]).unwrap();
    s.mark_sent(&[rows[1].id]).unwrap();
    let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, vec![rows[2].id]);
}

fn states(s: &Spool) -> Vec<(i64, String)> {
    let mut st = s
        .conn
        .prepare("SELECT id, state FROM event_states ORDER BY id")
        .unwrap();
    let rows = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    rows
}

fn mark(s: &Spool) -> (i64, i64) {
    s.conn
        .query_row(SQL_MARK, [], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
}

#[test]
fn record_delivery_marks_attempts_then_retires_in_one_transaction() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    s.append(
        &[ev("a", 1.0), ev("a", 2.0)],
        &mut ids,
        "d",
        Format::Json,
        0,
    )
    .unwrap();
    let rows = s.sendable(0, 10).unwrap();
    let (a, b) = (rows[0].id, rows[1].id);
    assert_eq!(s.record_delivery(&[a, b], &[a]).unwrap(), 1);
    let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, vec![b]);
    assert_eq!(
        states(&s),
        vec![(a, "ACKED".to_owned()), (b, "SENT".to_owned())]
    );
    assert_eq!(mark(&s), (a, b));
}

#[test]
fn the_oldest_unacknowledged_row_skips_acked_above_and_failed_rows() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    assert_eq!(s.oldest_unacked_ms().unwrap(), None);
    for (i, at) in [100, 200, 300].into_iter().enumerate() {
        s.append(&[ev("a", i as f64)], &mut ids, "d", Format::Json, at)
            .unwrap();
    }
    let r: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    let created = |s: &Spool| s.oldest_unacked_ms().unwrap();
    let first = created(&s);
    assert!(first.is_some());
    // Row 2 acknowledged out of order, row 1 FAILED: row 3 is the oldest.
    s.retire(&[r[1]]).unwrap();
    s.mark_failed(r[0], "too big", "oversized").unwrap();
    let third: i64 = s
        .conn
        .query_row("SELECT created_ms FROM events WHERE id = ?1", [r[2]], |x| {
            x.get(0)
        })
        .unwrap();
    assert_eq!(created(&s), Some(third));
    s.retire(&[r[2]]).unwrap();
    assert_eq!(created(&s), None);
}

#[test]
fn out_of_order_acks_wait_above_the_mark_and_fold_in_once_contiguous() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let evs: Vec<NewEvent> = (0..5).map(|i| ev("a", i as f64)).collect();
    s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    let r: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    // PUBACKs for rows 2 and 4 first: nothing below them is retired.
    assert_eq!(s.retire(&[r[1], r[3]]).unwrap(), 2);
    assert_eq!(mark(&s).0, 0);
    let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, vec![r[0], r[2], r[4]]);
    // Row 3 fails by policy; then row 1 is acknowledged: the mark moves
    // over 1, 2 (acked above), 3 (FAILED) and 4, and stops before 5.
    s.mark_failed(r[2], "too big", "oversized").unwrap();
    assert_eq!(s.retire(&[r[0]]).unwrap(), 1);
    assert_eq!(mark(&s).0, r[3]);
    let above: i64 = s
        .conn
        .query_row("SELECT count(*) FROM acked_above", [], |r| r.get(0))
        .unwrap();
    assert_eq!(above, 0, "folded entries are removed");
    let st = states(&s);
    assert_eq!(st[2].1, "FAILED");
    assert_eq!(st[4].1, "PENDING");
    // A PUBACK for a row below the mark, or for no row, retires nothing.
    assert_eq!(s.retire(&[r[0], 9999]).unwrap(), 0);
    // The FAILED row is never purged; the others are, except the newest.
    assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 3);
    assert_eq!(s.requeue_failed(Some("a")).unwrap(), 1);
    let left: Vec<OutRow> = s.sendable(0, 10).unwrap();
    assert_eq!(left.len(), 2);
    assert!(left[1].id > r[4], "requeued after every row");
    assert!(left.iter().all(|r| r.digest_ok()));
}

#[test]
fn sequences_continue_after_reopen_without_persisting() {
    // An append writes no `streams` page; a restart catches up from rows.
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    {
        let mut s = open(d.path());
        s.append(
            &[ev("a", 1.0), ev("a", 2.0)],
            &mut ids,
            "d",
            Format::Json,
            0,
        )
        .unwrap();
        s.persist_seqs().unwrap();
        s.append(&[ev("a", 3.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
    }
    let mut s = open(d.path());
    s.append(&[ev("a", 4.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let seqs: Vec<i64> = {
        let mut st = s
            .conn
            .prepare("SELECT seq FROM events ORDER BY id")
            .unwrap();
        let v = st
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        v
    };
    assert_eq!(seqs, vec![1, 2, 3, 4]);
}

#[test]
fn a_start_reads_at_most_ten_thousand_rows_to_catch_up_sequences() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let evs: Vec<NewEvent> = (0..1000).map(|i| ev("a", i as f64)).collect();
    for _ in 0..11 {
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    }
    let through: i64 = s
        .conn
        .query_row(
            "SELECT value FROM spool_meta WHERE key = 'seq_through_id'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(through >= 10_000, "seq_through_id {through}");
    assert!(s.appended_since_persist() < 10_000);
}

#[test]
fn the_sequence_numbers_ride_the_append_that_reaches_their_bound() {
    // Every PERSIST_SEQS_EVERY rows the sequence numbers are written in the
    // append's own transaction (issue 35): no commit of their own, so no
    // failure of their own either.
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    s.append(&[ev("a", 0.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let commits = s.wal().commits();
    let evs: Vec<NewEvent> = (1..10_000).map(|i| ev("a", i as f64)).collect();
    assert_eq!(
        s.append(&evs, &mut ids, "d", Format::Json, 0).ok(),
        Some(9_999)
    );
    assert_eq!(
        s.wal().commits(),
        commits + 1,
        "one commit, the rows and the numbers"
    );
    assert_eq!(s.appended_since_persist(), 0);
    let through: i64 = s
        .conn
        .query_row(
            "SELECT value FROM spool_meta WHERE key = 'seq_through_id'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(through, 10_000);
    drop(s);
    // The next start reads nothing to catch up: the stream goes on at 10,001.
    let mut s = open(d.path());
    s.append(&[ev("a", 0.5)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let last: i64 = s
        .conn
        .query_row("SELECT max(seq) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(last, 10_001);
}

#[test]
fn free_pages_are_given_back_in_bounded_steps() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let evs: Vec<NewEvent> = (0..3000).map(|i| ev("a", i as f64)).collect();
    s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    let all: Vec<i64> = s.sendable(0, 5000).unwrap().iter().map(|r| r.id).collect();
    s.retire(&all).unwrap();
    while s.purge_acked(i64::MAX, 1000).unwrap() > 0 {}
    let (live, free) = s.usage().unwrap();
    assert!(free > live, "live {live} free {free}");
    let freed = s.shrink_step(0, 10).unwrap();
    assert_eq!(freed, 10, "one bounded step");
    while s.shrink_step(0, 1000).unwrap() > 0 {}
    let (_, free) = s.usage().unwrap();
    assert!(free <= live, "free {free} live {live}");
}

#[test]
fn row_ids_are_never_reused_after_retention() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    s.append(
        &[ev("a", 1.0), ev("a", 2.0)],
        &mut ids,
        "d",
        Format::Json,
        0,
    )
    .unwrap();
    let rows = s.sendable(0, 10).unwrap();
    let top = rows[1].id;
    s.retire(&[rows[0].id, top]).unwrap();
    // The newest row stays: its id keeps new ids above every id used.
    assert_eq!(s.purge_acked(i64::MAX, 10).unwrap(), 1);
    s.append(&[ev("a", 3.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let next = s.sendable(0, 10).unwrap()[0].id;
    assert!(next > top, "id {next} reused (top was {top})");
}

#[test]
fn a_schema_1_spool_is_migrated_and_keeps_its_rows_and_payloads() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    {
        let c = Connection::open(&path).unwrap();
        let m: String = c
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .unwrap();
        assert_eq!(m, "wal");
        c.execute_batch(&MIGRATION_1.replace("AUTOINCREMENT", ""))
            .unwrap();
        // Schema 1 kept the payload in the events row.
        c.execute_batch(
            "INSERT INTO events (id, event_id, stream, seq, payload, digest, state, created_ms)
             VALUES (7, 'e7', 'a', 1, x'00', x'00', 'PENDING', 0); PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let s = Spool::open(&path, &SpoolOptions::default()).unwrap();
    let sql: String = s
        .conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE name = 'events'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(sql.contains("stream_id"), "{sql}");
    let rows = s.sendable(0, 10).unwrap();
    assert_eq!(rows[0].id, 7);
    assert_eq!(rows[0].payload, vec![0u8]);
    let vacuum: i64 = s
        .conn
        .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
        .unwrap();
    assert_eq!(vacuum, 2, "converted to incremental auto_vacuum");
}

#[test]
fn a_schema_4_spool_keeps_every_row_state_through_the_migration() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    {
        let c = Connection::open(&path).unwrap();
        let _: String = c
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .unwrap();
        c.execute_batch(MIGRATION_1).unwrap();
        c.execute_batch(MIGRATION_2).unwrap();
        c.execute_batch(MIGRATION_3).unwrap();
        c.execute_batch(MIGRATION_4).unwrap();
        for (id, state) in [
            (1, "ACKED"),
            (2, "SENT"),
            (3, "ACKED"),
            (4, "FAILED"),
            (5, "PENDING"),
        ] {
            c.execute(
                "INSERT INTO events (id, event_id, stream, seq, digest, state, created_ms, fail_reason)
                 VALUES (?1, 'e' || ?1, 'a', ?1, x'00', ?2, 0, CASE WHEN ?2 = 'FAILED' THEN 'too big' END)",
                params![id, state],
            )
            .unwrap();
            c.execute(
                "INSERT INTO payloads (id, payload) VALUES (?1, x'01')",
                params![id],
            )
            .unwrap();
        }
        c.execute_batch("INSERT INTO stream_seq VALUES ('a', 5); PRAGMA user_version = 4;")
            .unwrap();
    }
    let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
    let got: Vec<(i64, String)> = states(&s);
    let want: Vec<(i64, String)> = [
        (1, "ACKED"),
        (2, "SENT"),
        (3, "ACKED"),
        (4, "FAILED"),
        (5, "PENDING"),
    ]
    .iter()
    .map(|(i, st)| (*i, st.to_string()))
    .collect();
    assert_eq!(got, want);
    let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
    assert_eq!(left, vec![2, 5]);
    // Sequences continue from the old table.
    let mut ids = EventIdGen::new().unwrap();
    s.append(&[ev("a", 6.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let seq: i64 = s
        .conn
        .query_row("SELECT seq FROM events ORDER BY id DESC LIMIT 1", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(seq, 6);
}

#[test]
fn purge_is_bounded_per_batch() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let evs: Vec<NewEvent> = (0..25).map(|i| ev("a", i as f64)).collect();
    s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    let all: Vec<i64> = s.sendable(0, 100).unwrap().iter().map(|r| r.id).collect();
    s.retire(&all).unwrap();
    assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
    assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
    // 25 rows: the newest stays.
    assert_eq!(s.purge_acked(6, 10).unwrap(), 4);
    assert_eq!(s.purge_acked(6, 10).unwrap(), 0);
}

#[test]
fn a_second_connection_writes_while_the_first_holds_no_transaction() {
    // Two real connections on one file, as the agent runs them.
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut a = open(d.path());
    let mut b = open(d.path());
    a.append(&[ev("a", 1.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let rows = b.sendable(0, 10).unwrap();
    b.retire(&[rows[0].id]).unwrap();
    a.append(&[ev("a", 2.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    assert_eq!(b.sendable(0, 10).unwrap().len(), 1);
    // No agent statement pins the WAL: a TRUNCATE checkpoint completes.
    let c = a.checkpoint(CheckpointMode::Truncate).unwrap();
    assert_eq!(c.busy, 0);
}

/// Frames in the WAL now, as a PASSIVE checkpoint reports them.
fn wal_log_frames(s: &Spool) -> i64 {
    s.raw()
        .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(1))
        .unwrap()
}

#[test]
fn a_restart_checkpoint_starts_the_wal_over_and_its_wait_for_a_reader_is_bounded() {
    // Real connections on one file: the spool, and a reader holding a snapshot.
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let evs: Vec<NewEvent> = (0..2000).map(|i| ev("a", i as f64)).collect();
    s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    let filled = s.wal().frames_since_checkpoint();
    assert!(filled > 10, "the append wrote {filled} frames");
    let reader = Connection::open(d.path().join("spool.db")).unwrap();
    reader
        .execute_batch("BEGIN; SELECT count(*) FROM events;")
        .unwrap();
    // A reader in the WAL (on the newest snapshot, so every frame can be
    // copied back): the RESTART's wait for it to leave gives up at its
    // bound, not at the 5 s busy timeout, and reports busy.
    let t = std::time::Instant::now();
    let r = s
        .checkpoint_within(CheckpointMode::Restart, Duration::from_millis(30))
        .unwrap();
    assert_eq!(r.busy, 1, "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let timeout: i64 = s
        .raw()
        .query_row("PRAGMA busy_timeout", [], |row| row.get(0))
        .unwrap();
    assert_eq!(timeout, 5000, "the busy timeout is put back");
    // The next write goes on at the WAL's end.
    s.append(&[ev("a", 1.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let pinned = wal_log_frames(&s);
    assert!(pinned as u64 > filled, "{pinned} frames after {filled}");
    // Reader gone: the RESTART completes and the next write starts the WAL
    // from its beginning.
    reader.execute_batch("COMMIT").unwrap();
    let r = s
        .checkpoint_within(CheckpointMode::Restart, Duration::ZERO)
        .unwrap();
    assert_eq!((r.busy, r.checkpointed_frames), (0, r.log_frames), "{r:?}");
    s.append(&[ev("a", 2.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let log = wal_log_frames(&s);
    assert!(
        log < 10,
        "{log} frames in the WAL after a restart and one append"
    );
}

#[test]
fn immediate_write_waits_for_another_writer_instead_of_failing_busy() {
    // field case F03: an external writer holds the write lock for a while.
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    let mut ids = EventIdGen::new().unwrap();
    let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
    s.append(&[ev("a", 1.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    let holder = std::thread::spawn({
        let path = path.clone();
        move || {
            let c = Connection::open(&path).unwrap();
            c.execute_batch("BEGIN IMMEDIATE; UPDATE counters SET value = value;")
                .unwrap();
            std::thread::sleep(Duration::from_millis(700));
            c.execute_batch("COMMIT").unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    // A read snapshot first (as a deferred transaction would take), then the write.
    let _ = s.sendable(0, 10).unwrap();
    s.append(&[ev("a", 2.0)], &mut ids, "d", Format::Json, 0)
        .unwrap();
    holder.join().unwrap();
    assert_eq!(s.sendable(0, 10).unwrap().len(), 2);
}

#[test]
fn damaged_file_is_reported_as_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
    match Spool::open(&path, &SpoolOptions::default()) {
        Err(SpoolError::Corrupt { .. }) => {}
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn runs_are_recorded_and_an_unended_run_is_marked_killed() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let r1 = s.begin_run(1, 10, "v").unwrap();
    let r2 = s.begin_run(2, 11, "v").unwrap();
    s.end_run(r2, 3, "ok", None).unwrap();
    let runs = s.runs(10).unwrap();
    assert_eq!(runs[0].id, r2);
    assert_eq!(runs[0].exit_status.as_deref(), Some("ok"));
    assert_eq!(runs[1].id, r1);
    assert_eq!(
        runs[1].exit_status.as_deref(),
        Some("killed (no clean stop recorded)")
    );
}

#[test]
fn counting_rows_by_stream_and_state_writes_no_temporary_file() {
    // SQLite keeps its temporary files in /var/tmp (the first of its
    // candidates that exists): where that is tmpfs, nothing would count.
    let var_tmp = std::ffi::CString::new("/var/tmp").unwrap();
    // SAFETY: statfs fills the zeroed struct we own; the path is a C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statfs(var_tmp.as_ptr(), &mut st) }, 0);
    assert_ne!(st.f_type as i64, 0x0102_1994, "/var/tmp is tmpfs here");
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    // 60,000 rows in two streams: a GROUP BY over them spilled its sort to
    // a temporary file of over a megabyte at every count.
    for i in 0..60 {
        let evs: Vec<NewEvent> = (0..1000)
            .map(|j| ev(if j % 2 == 0 { "a" } else { "b" }, f64::from(i * 1000 + j)))
            .collect();
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
    }
    s.conn
        .execute(
            "UPDATE delivery_mark SET acked_through = 20000, sent_through = 30000",
            [],
        )
        .unwrap();
    let before = crate::os::proc_io::proc_write_bytes().unwrap();
    let stats = s.stats(0).unwrap();
    let backlog = s.backlog_by_stream(0).unwrap();
    let wrote = crate::os::proc_io::proc_write_bytes().unwrap() - before;
    assert_eq!(
        stats.by_stream_state,
        vec![
            ("a".to_owned(), "ACKED".to_owned(), 10_000),
            ("a".to_owned(), "PENDING".to_owned(), 15_000),
            ("a".to_owned(), "SENT".to_owned(), 5_000),
            ("b".to_owned(), "ACKED".to_owned(), 10_000),
            ("b".to_owned(), "PENDING".to_owned(), 15_000),
            ("b".to_owned(), "SENT".to_owned(), 5_000),
        ]
    );
    assert_eq!(backlog.iter().map(|b| b.rows).sum::<u64>(), 40_000);
    assert!(wrote < 64 * 1024, "counting wrote {wrote} bytes");
}
