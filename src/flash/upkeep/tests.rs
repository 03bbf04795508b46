//! The upkeep driven with time passed in, on a real spool file in a
//! temporary directory: no sleeps, an hour later is `now + 1 h`.

use super::*;
use crate::event::envelope::{EventIdGen, Format};
use crate::event::reading::FieldValue;
use crate::flash::maintenance::Refusal;
use crate::flash::write_budget::BudgetSettings;
use crate::spool::{NewEvent, SpoolOptions};

/// Wall time the rows are appended at, Unix ms.
const APPENDED_MS: i64 = 1_800_000_000_000;

fn settings() -> UpkeepSettings {
    UpkeepSettings {
        acked_retention: Duration::from_secs(3600),
        purge_batch_rows: 1000,
        checkpoint_interval: Duration::from_secs(30),
        checkpoint_wal_bytes: 64 * 1024 * 1024,
        capacity: Capacity {
            max_bytes: 0,
            min_free_bytes: 0,
        },
        budget: BudgetSettings {
            bytes_per_day: None,
            base_window: Duration::from_millis(200),
            max_window: Duration::from_secs(10),
        },
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    spool: Spool,
    upkeep: Upkeep,
    /// Monotonic time of the upkeep's start.
    t0: Instant,
}

fn fixture(s: UpkeepSettings) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spool.db");
    let spool = Spool::open(&path, &SpoolOptions::default()).unwrap();
    let t0 = Instant::now();
    let upkeep = Upkeep::new(&path, s, t0, APPENDED_MS);
    Fixture {
        _dir: dir,
        spool,
        upkeep,
        t0,
    }
}

fn reading(x: f64) -> NewEvent {
    NewEvent {
        replay: None,
        stream: "s".into(),
        ts_ms: APPENDED_MS,
        clock_trusted: true,
        mono: None,
        fields: vec![("x".into(), FieldValue::Num(x))],
        key: None,
        reply: None,
    }
}

impl Fixture {
    /// Append `n` rows at [`APPENDED_MS`] and acknowledge the first `acked`.
    fn rows(&mut self, n: usize, acked: usize) {
        let mut ids = EventIdGen::new().unwrap();
        let batch: Vec<NewEvent> = (0..n).map(|i| reading(i as f64)).collect();
        self.spool
            .append(&batch, &mut ids, "dev", Format::Json, APPENDED_MS)
            .unwrap();
        let acked: Vec<i64> = (1..=acked as i64).collect();
        self.spool.retire(&acked).unwrap();
    }

    fn tick(&mut self, after: Duration, wall_ms: i64) -> Pass {
        let now = self.t0 + after;
        self.upkeep
            .tick(&mut self.spool, now, wall_ms, &Load::default())
    }

    /// Rows in the spool, read on a connection of its own.
    fn count(&self) -> i64 {
        rusqlite::Connection::open(self.upkeep.path())
            .unwrap()
            .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
            .unwrap()
    }
}

const HOUR_MS: i64 = 3_600_000;

#[test]
fn a_pass_with_nothing_to_do_comes_back_after_the_period() {
    let mut f = fixture(settings());
    let pass = f.tick(Duration::from_secs(5), APPENDED_MS + 5_000);
    assert_eq!(
        pass,
        Pass {
            wake_in: MAX_PERIOD,
            fatal: None,
            purged: 0,
            checkpoint: None
        }
    );
    // A short checkpoint interval sets the period.
    let mut s = settings();
    s.checkpoint_interval = Duration::from_secs(2);
    let f = fixture(s);
    assert_eq!(f.upkeep.period(), Duration::from_secs(2));
}

#[test]
fn acknowledged_rows_past_retention_go_and_unacknowledged_ones_stay() {
    let mut f = fixture(settings());
    f.rows(10, 6);
    // Within retention: nothing goes.
    let pass = f.tick(Duration::from_secs(60), APPENDED_MS + 60_000);
    assert_eq!(pass.purged, 0);
    // An hour and a bit later, and a checkpoint interval since the last
    // retention: the acknowledged rows go, never an unacknowledged one.
    let later = Duration::from_secs(3700);
    let pass = f.tick(later, APPENDED_MS + 3_700_000);
    assert_eq!(pass.purged, 6);
    assert_eq!(f.count(), 4);
    assert_eq!(pass.fatal, None);
}

#[test]
fn retention_rides_with_the_checkpoint_cadence() {
    let mut f = fixture(settings());
    f.rows(10, 4);
    let first = f.tick(Duration::from_secs(3700), APPENDED_MS + 3_700_000);
    assert_eq!(first.purged, 4);
    f.spool.retire(&[5, 6]).unwrap();
    // Five seconds on, the rows newly acknowledged wait for the cadence...
    let soon = f.tick(Duration::from_secs(3705), APPENDED_MS + 3_705_000);
    assert_eq!(soon.purged, 0);
    // ...and go a checkpoint interval after the last retention.
    let due = f.tick(Duration::from_secs(3731), APPENDED_MS + 3_731_000);
    assert_eq!(due.purged, 2);
}

#[test]
fn a_wall_clock_stepped_years_ahead_deletes_nothing_by_itself() {
    let mut f = fixture(settings());
    f.rows(10, 10);
    let ten_years = 10 * 365 * 24 * HOUR_MS;
    let pass = f.tick(Duration::from_secs(60), APPENDED_MS + ten_years);
    assert_eq!(pass.purged, 0);
    assert_eq!(f.count(), 10);
    // Real time (monotonic) decides: an hour on, they go (all but the
    // newest row, which retention always keeps).
    let pass = f.tick(Duration::from_secs(3700), APPENDED_MS + ten_years);
    assert_eq!(pass.purged, 9);
}

#[test]
fn a_replaced_spool_file_stops_the_writer() {
    let mut f = fixture(settings());
    let path = f.upkeep.path().to_path_buf();
    std::fs::rename(&path, path.with_extension("old")).unwrap();
    std::fs::write(&path, b"").unwrap();
    let pass = f.tick(Duration::from_secs(5), APPENDED_MS);
    assert!(
        matches!(&pass.fatal, Some(Fatal::Replaced(m)) if m.contains("removed or replaced")),
        "{pass:?}"
    );
}

#[test]
fn a_damage_found_by_the_integrity_check_stops_the_writer() {
    let mut f = fixture(settings());
    let verdict: crate::spool::integrity::Verdict = Default::default();
    f.upkeep.watch_integrity(verdict.clone());
    assert_eq!(f.tick(Duration::from_secs(5), APPENDED_MS).fatal, None);
    *verdict.lock().unwrap() = Some("page 7: btree damaged".into());
    let pass = f.tick(Duration::from_secs(10), APPENDED_MS);
    assert!(
        matches!(&pass.fatal, Some(Fatal::Damaged(m)) if m.contains("page 7")),
        "{pass:?}"
    );
}

#[test]
fn a_time_driven_checkpoint_comes_once_an_interval_after_a_write() {
    let mut f = fixture(settings());
    f.rows(3, 0);
    assert_eq!(
        f.upkeep
            .committed(&mut f.spool, f.t0 + Duration::from_secs(29), (0, 0)),
        None
    );
    let done = f
        .upkeep
        .committed(&mut f.spool, f.t0 + Duration::from_secs(30), (0, 0))
        .expect("due at the interval");
    assert_eq!(done.mode, crate::spool::CheckpointMode::Passive);
    assert!(done.result.is_some_and(|r| r.busy == 0));
    assert!(!done.blocked);
    assert_eq!(f.upkeep.checkpoints(), 1);
    let record = f.upkeep.last_checkpoint().expect("recorded");
    assert_eq!(record["mode"], "passive");
    // Nothing written since: never due again, however late.
    assert_eq!(f.upkeep.committed(&mut f.spool, f.t0 + HOUR, (0, 0)), None);
}

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn over_capacity_readings_are_refused_and_the_answer_holds_a_second() {
    let mut s = settings();
    s.capacity.max_bytes = 1;
    let mut f = fixture(s);
    let now = f.t0 + Duration::from_secs(1);
    let refused = f.upkeep.admit(&mut f.spool, now);
    assert!(
        matches!(
            refused,
            Some(Refusing::Capacity(Refusal::SpoolFull { max: 1, .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(refused.map(|r| r.reason()), Some("spool_full"));
    // The answer holds for a second, even once the limit is lifted...
    f.upkeep.settings.capacity.max_bytes = 0;
    let half = now + Duration::from_millis(500);
    assert_eq!(f.upkeep.admit(&mut f.spool, half), refused);
    // ...and a second later it is judged again: readings are taken.
    let later = now + Duration::from_millis(1500);
    assert_eq!(f.upkeep.admit(&mut f.spool, later), None);
    assert_eq!(f.upkeep.refusal(), None);
}

#[test]
fn a_reload_of_the_capacity_judges_it_again_at_once() {
    let mut s = settings();
    s.capacity.max_bytes = 1;
    let mut f = fixture(s.clone());
    let now = f.t0 + Duration::from_secs(1);
    assert!(f.upkeep.admit(&mut f.spool, now).is_some());
    s.capacity.max_bytes = 0;
    let applied = f.upkeep.reconfigure(s, &f.spool);
    assert_eq!(applied, vec!["spool (capacity, checkpoint threshold)"]);
    assert_eq!(f.upkeep.admit(&mut f.spool, now), None);
}

#[test]
fn after_a_full_disk_readings_wait_for_room() {
    let mut s = settings();
    // A reserve no disk has: the way back stays shut.
    s.capacity.min_free_bytes = u64::MAX / 2;
    let mut f = fixture(s);
    f.upkeep.hit_disk_full();
    assert!(f.upkeep.disk_full());
    let now = f.t0 + Duration::from_secs(1);
    assert_eq!(f.upkeep.admit(&mut f.spool, now), Some(Refusing::DiskFull));
    assert!(f.upkeep.disk_full());
    // With the reserve back to nothing, the TRUNCATE and the headroom
    // (1 MiB) let it through.
    f.upkeep.settings.capacity.min_free_bytes = 0;
    assert_eq!(f.upkeep.admit(&mut f.spool, now), None);
    assert!(!f.upkeep.disk_full());
}

#[test]
fn refusals_are_logged_every_thirty_seconds_at_most() {
    let mut f = fixture(settings());
    let t = f.t0;
    assert!(f.upkeep.refusal_log_due(t));
    assert!(!f.upkeep.refusal_log_due(t + Duration::from_secs(30)));
    assert!(f.upkeep.refusal_log_due(t + Duration::from_secs(31)));
}

#[test]
fn a_reload_of_the_window_starts_it_again() {
    let mut f = fixture(settings());
    assert_eq!(f.upkeep.window(), Duration::from_millis(200));
    let mut s = settings();
    s.budget.base_window = Duration::from_millis(500);
    let applied = f.upkeep.reconfigure(s.clone(), &f.spool);
    assert_eq!(
        applied,
        vec!["spool (commit window, retention, checkpoints)"]
    );
    assert_eq!(f.upkeep.window(), Duration::from_millis(500));
    s.budget.bytes_per_day = Some(100_000_000);
    assert_eq!(
        f.upkeep.reconfigure(s.clone(), &f.spool),
        vec!["spool (write budget)"]
    );
    assert!(f.upkeep.reconfigure(s, &f.spool).is_empty());
}

#[test]
fn a_wide_window_stretches_the_checkpoint_interval() {
    let mut s = settings();
    s.budget.base_window = Duration::from_secs(10);
    let f = fixture(s);
    assert_eq!(f.upkeep.checkpoint_interval(), Duration::from_secs(120));
    assert!(f.upkeep.checkpoint_stretched());
    let f = fixture(settings());
    assert!(!f.upkeep.checkpoint_stretched());
}

#[test]
fn a_reader_pinning_the_wal_holds_the_next_batch_and_the_pass_comes_back_soon() {
    // field case F02 on top of F01: a retention batch that cannot start the
    // WAL over stops the pass, which comes back at the quick period.
    let mut s = settings();
    s.purge_batch_rows = 2;
    let mut f = fixture(s);
    f.rows(10, 8);
    let reader = rusqlite::Connection::open(f.upkeep.path()).unwrap();
    reader.execute_batch("BEGIN").unwrap();
    let _: i64 = reader
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    let pass = f.tick(
        HOUR + Duration::from_secs(100),
        APPENDED_MS + HOUR_MS + 100_000,
    );
    assert_eq!(pass.purged, 2, "one batch, then the reader holds the rest");
    assert_eq!(pass.wake_in, AGAIN);
    reader.execute_batch("COMMIT").unwrap();
    drop(reader);
    // The reader left: the next (quick) pass takes the rest.
    let pass = f.tick(
        HOUR + Duration::from_secs(101),
        APPENDED_MS + HOUR_MS + 101_000,
    );
    assert_eq!(pass.purged, 6);
}

#[test]
fn the_write_record_names_the_window_and_the_checkpoints() {
    let mut f = fixture(settings());
    f.rows(3, 0);
    f.upkeep
        .committed(&mut f.spool, f.t0 + Duration::from_secs(30), (0, 0));
    let r = f.upkeep.write_record(f.t0 + HOUR, &f.spool, 3, 1);
    assert_eq!(r["commit_window_ms"], 200);
    assert_eq!(r["checkpoints_total"], 1);
    assert_eq!(r["fsyncs_estimated_total"], 3);
    assert_eq!(r["readings_total"], 3);
    assert_eq!(r["window_secs"], 3600);
    assert_eq!(r["checkpoint_interval_secs"], 30);
}
