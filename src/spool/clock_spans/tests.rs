//! Spans of rows appended before the clock was set, with time passed in:
//! what retention keeps and from when, and what a commit writes.

use super::*;
use crate::event::envelope::{EventIdGen, Format};
use crate::event::reading::FieldValue;
use crate::spool::{NewEvent, Riders, Spool, SpoolOptions};
use std::path::Path;

/// 2026-12-05, a wall clock time sync has set.
const SET_MS: i64 = 1_796_500_000_000;
const DAY_MS: i64 = 86_400_000;

fn ev(x: f64) -> NewEvent {
    NewEvent::new("t", 1, false, vec![("x".into(), FieldValue::Num(x))])
}

fn open(dir: &Path) -> Spool {
    Spool::open(&dir.join("spool.db"), &SpoolOptions::default()).unwrap()
}

/// `rows` readings in one commit at `now_ms`, read at `clock`.
fn commit(s: &mut Spool, ids: &mut EventIdGen, rows: usize, clock: Option<WallClock>, now_ms: i64) {
    let evs: Vec<NewEvent> = (0..rows).map(|i| ev(i as f64)).collect();
    let riders = Riders {
        clock,
        ..Default::default()
    };
    s.append_riding(&evs, ids, ("d", Format::Json), now_ms, &riders)
        .unwrap();
}

fn retire_all(s: &mut Spool) {
    let all: Vec<i64> = s
        .sendable(0, 10_000)
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    s.retire(&all).unwrap();
}

fn rows(s: &Spool) -> i64 {
    s.raw()
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap()
}

/// `(first_id, last_id, settled_ms)` of every span.
fn spans(s: &Spool) -> Vec<(i64, Option<i64>, Option<i64>)> {
    s.query_all(
        "SELECT first_id, last_id, settled_ms FROM clock_spans ORDER BY first_id",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
    .unwrap()
}

#[test]
fn the_clock_is_judged_by_the_readings_stamp_rule() {
    let synced = Sync::Synchronized { maxerror_us: 4000 };
    let unsynced = Sync::Unsynchronized {
        maxerror_us: 16_000_000,
    };
    assert_eq!(WallClock::judge(true, synced), WallClock::Settled);
    assert_eq!(WallClock::judge(true, Sync::Unknown), WallClock::Settled);
    // A fake-hwclock's stale time is past the floor, and not vouched for.
    assert_eq!(WallClock::judge(true, unsynced), WallClock::Unsettled);
    for s in [synced, unsynced, Sync::Unknown] {
        assert_eq!(WallClock::judge(false, s), WallClock::Unsettled, "{s:?}");
    }
}

/// The outage case: a board offline with its clock unset (1970) takes its
/// readings, the clock is set, they are delivered and acknowledged; the
/// next retention pass must keep them a whole retention from when the
/// clock was set (main's spool purged them at once: their append time was
/// 56 years before the cutoff).
#[test]
fn rows_appended_before_the_clock_was_set_are_kept_a_retention_from_when_it_was_set() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let unset = Some(WallClock::Unsettled);
    for i in 0..5 {
        commit(&mut s, &mut ids, 10, unset, 60_000 + i * 1000);
    }
    assert_eq!(
        spans(&s),
        vec![(1, None, None)],
        "one span, from the first row"
    );
    retire_all(&mut s);
    // While the clock is unset, nothing of the span goes by age, whatever
    // the cutoff says.
    assert_eq!(s.purge_acked(SET_MS, 1000).unwrap(), 0);
    // The clock is set: the anchor's commit closes the span.
    commit(&mut s, &mut ids, 1, Some(WallClock::Settled), SET_MS);
    assert_eq!(spans(&s), vec![(1, Some(50), Some(SET_MS))]);
    retire_all(&mut s);
    assert_eq!(s.oldest_unacked_ms().unwrap(), None);
    // A retention pass right after: the rows count from SET_MS.
    assert_eq!(s.purge_acked(SET_MS - DAY_MS, 1000).unwrap(), 0);
    assert_eq!(
        s.purge_acked(SET_MS, 1000).unwrap(),
        0,
        "not older than SET_MS"
    );
    assert_eq!(rows(&s), 51);
    // A retention after it: they go (the newest row stays), and the span
    // is forgotten in the same commit.
    assert_eq!(s.purge_acked(SET_MS + 1, 1000).unwrap(), 50);
    assert_eq!(rows(&s), 1);
    assert!(spans(&s).is_empty());
}

#[test]
fn rows_appended_before_a_span_still_go_by_their_own_age() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    // A day with a set clock, then a reboot into 1970 without time sync.
    commit(&mut s, &mut ids, 10, Some(WallClock::Settled), SET_MS);
    commit(&mut s, &mut ids, 10, Some(WallClock::Unsettled), 5_000);
    retire_all(&mut s);
    assert_eq!(s.purge_acked(SET_MS + 1, 1000).unwrap(), 10);
    assert_eq!(rows(&s), 10, "the span's rows stay");
    // The spool bound takes the oldest acknowledged rows whatever their
    // span (its behaviour is not changed): the newest row stays.
    assert_eq!(s.purge_acked(i64::MAX, 1000).unwrap(), 9);
    assert_eq!(spans(&s).len(), 1, "the open span stays open");
}

#[test]
fn a_span_stays_open_across_runs_and_closes_at_the_first_settled_commit() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    {
        let mut s = open(d.path());
        commit(&mut s, &mut ids, 3, Some(WallClock::Unsettled), 5_000);
    }
    let mut s = open(d.path());
    // Another boot in 1970: the open span goes on (nothing more written).
    commit(&mut s, &mut ids, 3, Some(WallClock::Unsettled), 2_000);
    assert_eq!(spans(&s), vec![(1, None, None)]);
    // An appender that does not say opens or closes nothing.
    commit(&mut s, &mut ids, 1, None, SET_MS);
    assert_eq!(spans(&s), vec![(1, None, None)]);
    // A later start with a set clock: its first commit closes the span,
    // even one with no readings (what rides it alone).
    commit(&mut s, &mut ids, 0, Some(WallClock::Settled), SET_MS + 5);
    assert_eq!(spans(&s), vec![(1, Some(7), Some(SET_MS + 5))]);
    // An unset clock again (a reboot without time sync) opens a new one.
    commit(&mut s, &mut ids, 2, Some(WallClock::Unsettled), 9_000);
    assert_eq!(spans(&s).len(), 2);
    assert_eq!(spans(&s)[1], (8, None, None));
}

#[test]
fn a_waiting_row_from_before_the_clock_was_set_counts_from_when_it_was() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    commit(&mut s, &mut ids, 2, Some(WallClock::Unsettled), 5_000);
    assert_eq!(s.oldest_unacked_ms().unwrap(), Some(5_000));
    assert!(s.clock_set_for_waiting().unwrap().is_empty(), "not set yet");
    commit(&mut s, &mut ids, 1, Some(WallClock::Settled), SET_MS);
    assert_eq!(s.oldest_unacked_ms().unwrap(), Some(SET_MS));
    // status says these rows' age counts from when the clock was set.
    assert_eq!(
        s.clock_set_for_waiting().unwrap(),
        vec![("t".to_owned(), SET_MS)]
    );
    let st = s.stats(SET_MS + 60_000).unwrap();
    assert_eq!(st.oldest_unacked_age_ms, Some(60_000), "not 56 years");
    let backlog = s.backlog_by_stream(SET_MS + 60_000).unwrap();
    let t = backlog.iter().find(|b| b.stream == "t").unwrap();
    assert_eq!(t.oldest_unacked_age_ms, Some(60_000));
}

/// The rule of issue 35: frames written to the WAL by each commit of one
/// reading, per kind of clock note.
fn frames_per_commit(clock: Option<WallClock>, commits: usize) -> Vec<u64> {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let opts = SpoolOptions {
        wal_autocheckpoint_pages: 0,
        ..Default::default()
    };
    let mut s = Spool::open(&d.path().join("spool.db"), &opts).unwrap();
    // The stream's row and the first pages exist before measuring.
    commit(&mut s, &mut ids, 1, None, SET_MS);
    let mut out = Vec::new();
    for i in 0..commits {
        let before = s.wal().frames_since_checkpoint();
        commit(&mut s, &mut ids, 1, clock, SET_MS + i as i64);
        out.push(s.wal().frames_since_checkpoint() - before);
    }
    out
}

#[test]
fn a_commit_writes_what_it_wrote_before_and_a_span_costs_one_page_once() {
    let plain = frames_per_commit(None, 20);
    let settled = frames_per_commit(Some(WallClock::Settled), 20);
    assert_eq!(settled, plain, "a set clock: not a frame more per commit");
    let unset = frames_per_commit(Some(WallClock::Unsettled), 20);
    assert_eq!(unset[1..], plain[1..], "an unset clock: nothing per commit");
    assert_eq!(unset[0], plain[0] + 1, "the span's start: one page, once");
    println!(
        "frames per commit of one reading: {plain:?}; the first with an unset clock {}",
        unset[0]
    );
}

#[test]
fn a_schema_12_spool_migrates_and_an_unmigrated_one_reads_without_spans() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("spool.db");
    let mut ids = EventIdGen::new().unwrap();
    {
        let mut s = open(d.path());
        commit(&mut s, &mut ids, 2, None, 5_000);
        s.raw()
            .execute_batch("DROP TABLE clock_spans; PRAGMA user_version = 12;")
            .unwrap();
    }
    // `status` beside an agent not yet restarted after the upgrade.
    let ro = Spool::open_read_only(&path).unwrap();
    assert_eq!(ro.schema_version().unwrap(), 12);
    assert_eq!(ro.oldest_unacked_ms().unwrap(), Some(5_000));
    assert!(ro.stats(6_000).is_ok());
    drop(ro);
    let mut s = open(d.path());
    assert_eq!(s.schema_version().unwrap(), 13);
    assert!(spans(&s).is_empty(), "rows from before keep their own time");
    commit(&mut s, &mut ids, 1, Some(WallClock::Unsettled), 6_000);
    assert_eq!(spans(&s), vec![(3, None, None)]);
}

#[test]
fn a_span_takes_the_rows_another_connection_appended_since_the_last_commit() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut writer = open(d.path());
    commit(&mut writer, &mut ids, 2, Some(WallClock::Settled), SET_MS);
    // The command thread's connection appends a result, saying nothing of
    // the clock (it was unset by then).
    let mut commands = open(d.path());
    commit(&mut commands, &mut ids, 1, None, 3_000);
    commit(&mut writer, &mut ids, 2, Some(WallClock::Unsettled), 4_000);
    assert_eq!(spans(&writer), vec![(3, None, None)], "from the result on");
    // A connection opened now starts after every row there is.
    let mut later = open(d.path());
    commit(
        &mut later,
        &mut ids,
        1,
        Some(WallClock::Settled),
        SET_MS + 9,
    );
    assert_eq!(spans(&later), vec![(3, Some(5), Some(SET_MS + 9))]);
}

/// A board without RTC keeps its retention by age while its clock is still
/// the unset one (before the floor: `Unsettled` now): an open span's rows
/// age by that same clock; once the clock is past the floor (`Settled`
/// now: set by time sync, or stepped by anything else), the open span
/// holds until a commit with a vouched-for clock closes it.
#[test]
fn an_open_span_ages_by_its_own_clock_while_that_clock_is_still_unset() {
    let d = tempfile::tempdir().unwrap();
    let mut ids = EventIdGen::new().unwrap();
    let mut s = open(d.path());
    let unset = Some(WallClock::Unsettled);
    for i in 0..5 {
        commit(&mut s, &mut ids, 10, unset, 60_000 + i * 1000);
    }
    retire_all(&mut s);
    // The clock is set now, and no commit has closed the span yet: held.
    assert_eq!(
        s.purge_acked_at(SET_MS, 1000, WallClock::Settled).unwrap(),
        0
    );
    // Still unset now: a cutoff read off the unset clock takes the rows
    // older than it (the first two commits), not the younger ones.
    assert_eq!(
        s.purge_acked_at(61_500, 1000, WallClock::Unsettled)
            .unwrap(),
        20
    );
    assert_eq!(rows(&s), 30);
    assert_eq!(spans(&s), vec![(1, None, None)], "the span stays open");
    // The span closes at the first settled commit; its rows count from then.
    commit(&mut s, &mut ids, 1, Some(WallClock::Settled), SET_MS);
    retire_all(&mut s);
    assert_eq!(
        s.purge_acked_at(SET_MS - 1, 1000, WallClock::Unsettled)
            .unwrap(),
        0
    );
    assert_eq!(
        s.purge_acked_at(SET_MS + 1, 1000, WallClock::Settled)
            .unwrap(),
        30
    );
}
