//! A spool file found without its `-wal`.
//!
//! Its one rule: **a spool whose commits were in a `-wal` that is not there
//! is named at ERROR with what to do, never silently given a fresh
//! schema.** In WAL mode a commit lands in `<spool>-wal` and reaches the
//! database file only at a checkpoint; a copy of `spool.db` alone, taken
//! while an agent runs, or a `-wal` removed after an unclean stop, misses
//! every commit since the last checkpoint. A clean stop checkpoints
//! everything and SQLite removes the `-wal` at the last close, so no `-wal`
//! is normal after one. An empty `-wal` counts as none: it holds no frames,
//! and a read-only open (`edgespool status`, `export`, the agent reading
//! the serial of a signed push) creates one beside a WAL-mode file when the
//! directory is writable, so the agent looks ([`look`]) before any open of
//! its own. That gives no false ERROR after a clean stop (the newest run has
//! its end) nor after an unclean one whose `-wal` held frames (it is not
//! empty). One narrow case does name a file that lost nothing: an agent
//! killed right after a TRUNCATE checkpoint (the disk-full recovery), before
//! its next commit. What tells the cases apart is in the file itself:
//!
//! - **Its schema is only in the lost `-wal`**: the header says WAL mode
//!   (bytes 18 and 19 are 2,
//!   <https://www.sqlite.org/fileformat.html#the_database_header>) but the
//!   schema cookie (offset 40) and `user_version` (offset 60) are 0, so no
//!   table ever reached the file. Opening it would create a fresh, empty
//!   spool in its place; instead it is moved aside as
//!   `<spool>.no-wal-<unix ms>` (with its empty `-wal` and `-shm`, if
//!   any), untouched (it can still be put back with its `-wal`), and a
//!   fresh spool starts.
//! - **The run marker names a run whose commits are gone**
//!   ([`super::run_marker`], `<spool>.run`, written at start and removed
//!   only after a clean stop's final checkpoint): the run is not in the file
//!   at all (a reader held the WAL from before it began, so no checkpoint
//!   copied even its start), or it is there without a stop. Whatever
//!   readers did, the marker says which run wrote last.
//! - **Its newest run never ended** (no marker: a copy in another
//!   directory): `runs` holds a run with no end and no exit status, which
//!   only a run still going (or killed) leaves; after a clean stop or a stop
//!   on an error the run has its end. The agent checkpoints right after it
//!   records a run's start, so even an early copy shows the run.
//!   `edgespool export` marks the live run in its copy, so a restored export
//!   is not taken for such a file.
//!
//! In both cases the rows the file holds are kept and delivered, what the
//! `-wal` held is gone, and health says so for the run.

use super::run_marker::{self, RunMarker};
use crate::spool::{wal_path, Spool};
use std::path::{Path, PathBuf};

/// What the spool's directory showed before any open (a read-write open
/// creates a `-wal`; so does a read-only one, empty, when the directory is
/// writable: `status`, `export`, the agent reading a kept serial).
#[derive(Debug, Clone, PartialEq)]
pub struct Before {
    /// The database file looked at.
    pub path: PathBuf,
    /// No `-wal` beside the database file, or an empty one (and the file
    /// exists). An empty `-wal` holds no frames: the file alone is what
    /// there is, as when the `-wal` is gone.
    pub wal_missing: bool,
    /// The header says WAL mode, and no schema reached the file.
    pub schema_only_in_wal: bool,
}

/// Look at `db` and its `-wal` before anything opens them.
pub fn look(db: &Path) -> Before {
    let exists = std::fs::symlink_metadata(db).is_ok_and(|m| m.is_file());
    let wal_missing = exists
        && match std::fs::symlink_metadata(wal_path(db)) {
            Err(_) => true,
            Ok(m) => m.is_file() && m.len() == 0,
        };
    let mut head = [0u8; 100];
    let read = wal_missing
        && std::fs::File::open(db)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok();
    let be32 = |at: usize| u32::from_be_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
    let schema_only_in_wal = read
        && head.starts_with(b"SQLite format 3\0")
        && head[18] == 2
        && head[19] == 2
        && be32(40) == 0
        && be32(60) == 0;
    Before {
        path: db.to_path_buf(),
        wal_missing,
        schema_only_in_wal,
    }
}

/// Move `db` (and an empty `-wal`, a `-shm`) aside as
/// `<db>.no-wal-<unix ms>`, at ERROR with what to do. Returns the new name.
/// Nothing moved aside before is ever replaced: a board without a real-time
/// clock can come back to the same wall-clock name, which then takes a
/// suffix (`-1`, `-2`, ...), and every move is a rename that fails on an
/// existing name ([`crate::os::fsguard::files::rename_noreplace`]).
///
/// Errors: no free name, or a rename failed (the agent then refuses to
/// start, naming it).
pub(super) fn move_aside(db: &Path) -> Result<String, String> {
    move_aside_at(db, crate::event::envelope::wall_clock_ms().0)
}

/// [`move_aside`] with the wall clock read by the caller (`now_ms`).
fn move_aside_at(db: &Path, now_ms: i64) -> Result<String, String> {
    let base = format!("{}.no-wal-{now_ms}", db.display());
    let aside = move_to_free_name(db, &base)?;
    log::error!(
        "spool {} has no {}-wal and no table of its own: it is a WAL-mode database whose every commit was in the -wal (a copy of the file alone, taken while an agent ran, or a -wal removed); opened, it would become an empty spool. Moved it to {aside} untouched; starting a fresh spool. If you have the -wal taken at the same moment: stop the agent, put {aside} back as {} with that file as {}-wal, and start it. To back up a running spool use `edgespool export --config FILE --to PATH`",
        db.display(),
        db.display(),
        db.display(),
        db.display()
    );
    Ok(aside)
}

/// Most suffixes [`move_to_free_name`] tries before it gives up.
const MAX_ASIDE_SUFFIX: u32 = 1000;

/// Rename `db` to `base`, or `base-1`, `base-2`, ... (the first name free
/// with its `-wal` and `-shm`), then its `-wal` and `-shm` beside it; never
/// over an existing name. Returns the name taken.
fn move_to_free_name(db: &Path, base: &str) -> Result<String, String> {
    use crate::os::fsguard::files::rename_noreplace;
    let taken = |name: &str| {
        ["", "-wal", "-shm"]
            .iter()
            .any(|s| std::fs::symlink_metadata(format!("{name}{s}")).is_ok())
    };
    let mut aside = None;
    for n in 0..=MAX_ASIDE_SUFFIX {
        let name = if n == 0 {
            base.to_owned()
        } else {
            format!("{base}-{n}")
        };
        if taken(&name) {
            continue;
        }
        match rename_noreplace(db, Path::new(&name)) {
            Ok(()) => {
                aside = Some(name);
                break;
            }
            // Taken between the look and the rename: the next one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot move spool {} aside: {e}", db.display())),
        }
    }
    let aside = aside.ok_or_else(|| {
        format!(
            "cannot move spool {} aside: {base} and its {MAX_ASIDE_SUFFIX} suffixed names are taken",
            db.display()
        )
    })?;
    for suffix in ["-wal", "-shm"] {
        let from = format!("{}{suffix}", db.display());
        if std::fs::symlink_metadata(&from).is_ok() {
            rename_noreplace(Path::new(&from), Path::new(&format!("{aside}{suffix}")))
                .map_err(|e| format!("cannot move {from} aside: {e}"))?;
        }
    }
    Ok(aside)
}

/// What a file opened without its `-wal` lost, as [`report_lost_commits`]
/// judged it.
#[derive(Debug, Clone)]
enum Lost {
    /// The run the marker names is not in the file: every commit it made
    /// was in the `-wal` (a reader held the WAL from before it began, so no
    /// checkpoint could copy it).
    RunAbsent(RunMarker),
    /// The run is in the file and never recorded a stop: the commits after
    /// the file's last checkpoint are gone.
    RunUnended(crate::spool::RunRecord),
}

/// Runs read from the file to find the marker's (the marker's run is the
/// newest, or not there at all).
const RUNS_LOOKED_AT: usize = 8;

/// After `s` was opened from a file that had no `-wal` (or an empty one):
/// whether commits are gone, from the run marker ([`run_marker`]) and the
/// `runs` table. With a marker: its run absent from the file, or present
/// without a stop, lost commits; present with its stop, nothing (killed
/// between the final checkpoint and the marker's removal). Without one (a
/// bare copy in another directory): the newest run without a stop. Each
/// finding is an ERROR naming the run and what to do, counted
/// `spool_opened_without_wal`; returns the short reason health gives for
/// the run.
pub(super) fn report_lost_commits(s: &mut Spool) -> Option<String> {
    let marker = run_marker::read(s.path());
    let runs = match s.runs(RUNS_LOOKED_AT) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "spool {} has no -wal and its runs cannot be read ({e}): cannot tell whether commits are gone",
                s.path().display()
            );
            return None;
        }
    };
    let unended = |r: &&crate::spool::RunRecord| r.ended_ms.is_none() && r.exit_status.is_none();
    let newest = runs.first();
    let lost = match marker {
        // A marker older than the newest run was left by a run whose own
        // marker could not be written: the file's runs say more.
        Some(m) if newest.is_none_or(|r| r.id <= m.run_id) => {
            match runs
                .iter()
                .find(|r| r.id == m.run_id && r.started_ms == m.started_ms)
            {
                None => Lost::RunAbsent(m),
                Some(r) if unended(&r) => Lost::RunUnended(r.clone()),
                Some(_) => return None,
            }
        }
        _ => Lost::RunUnended(newest.filter(unended)?.clone()),
    };
    let shown = s.path().display().to_string();
    let (what, short) = match &lost {
        Lost::RunAbsent(m) => (
            format!(
                "spool {shown} has no -wal, and the run that last wrote it (run {}, pid {}, started at {} ms, named by {}) is not in the file: every commit of that run was only in the -wal (a reader holding the WAL from before the run began keeps checkpoints from copying anything), which is gone. Its readings, and the deliveries it recorded, are lost; rows it delivered may be sent again",
                m.run_id,
                m.pid,
                m.started_ms,
                run_marker::path(s.path()).display()
            ),
            format!(
                "run {} committed only to the -wal, which was gone at start: its readings are lost",
                m.run_id
            ),
        ),
        Lost::RunUnended(run) => (
            format!(
                "spool {shown} has no -wal, but its newest run (run {}, pid {}, started at {} ms, version {}) never recorded a stop: the file was copied while that agent ran, without its -wal, or the -wal was lost after an unclean stop. Commits after the file's last checkpoint are not in it (readings published since may come again under new ids); the rows it holds are kept and delivered",
                run.id, run.pid, run.started_ms, run.version
            ),
            format!(
                "run {}'s commits after the file's last checkpoint were only in the -wal, which was gone at start",
                run.id
            ),
        ),
    };
    log::error!(
        "{what}. If this is a restored copy and you still have the original: stop this agent and restore from `edgespool export --config FILE --to PATH` instead (a bare copy of spool.db misses what its -wal held); never remove a -wal by hand"
    );
    let _ = s.count("spool_opened_without_wal", 1);
    Some(short)
}

#[cfg(test)]
mod tests {
    use crate::spool::integrity::open_spool_at;
    use crate::spool::{CheckpointMode, NewEvent, Spool, SpoolOptions};
    use std::path::Path;

    /// Options under which nothing reaches the database file before a close.
    fn no_checkpoints() -> SpoolOptions {
        SpoolOptions {
            wal_autocheckpoint_pages: 0,
            ..SpoolOptions::default()
        }
    }

    fn append(s: &mut Spool, n: usize) {
        let mut ids = crate::event::envelope::EventIdGen::new().unwrap();
        let evs: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent {
                stream: "s".into(),
                ts_ms: 1,
                clock_trusted: true,
                mono: None,
                fields: vec![("v".into(), crate::event::reading::FieldValue::Num(i as f64))],
                replay: None,
                key: None,
                reply: None,
            })
            .collect();
        s.append(&evs, &mut ids, "d", crate::event::envelope::Format::Json, 1)
            .unwrap();
    }

    fn counter(s: &Spool, name: &str) -> i64 {
        s.counters()
            .unwrap()
            .into_iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, v)| v)
    }

    fn rows(s: &Spool) -> i64 {
        s.stats(0)
            .unwrap()
            .by_stream_state
            .iter()
            .map(|(_, _, n)| n)
            .sum()
    }

    fn aside(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".no-wal-"))
            .collect()
    }

    #[test]
    fn a_backup_of_spool_db_alone_whose_schema_was_only_in_the_wal_is_moved_aside_not_emptied() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let mut s = Spool::open(&live, &no_checkpoints()).unwrap();
        append(&mut s, 5);
        let moved = tempfile::tempdir().unwrap();
        let db = moved.path().join("spool.db");
        std::fs::copy(&live, &db).unwrap();
        assert_eq!(
            std::fs::metadata(&db).unwrap().len(),
            4096,
            "the header page alone"
        );
        let copied = std::fs::read(&db).unwrap();
        let fresh = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        let names = aside(moved.path());
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(
            std::fs::read(moved.path().join(&names[0])).unwrap(),
            copied,
            "moved aside untouched"
        );
        assert_eq!(counter(&fresh, "spool_moved_aside_without_wal"), 1);
        // Opened again (now with its -wal), the fresh spool is left alone.
        drop(fresh);
        let again = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        assert_eq!(aside(moved.path()).len(), 1);
        assert_eq!(counter(&again, "spool_moved_aside_without_wal"), 1);
    }

    #[test]
    fn a_backup_of_spool_db_alone_from_a_running_agent_is_counted_and_its_rows_kept() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let mut s = Spool::open(&live, &no_checkpoints()).unwrap();
        s.begin_run(1, 42, "v").unwrap();
        append(&mut s, 5);
        s.checkpoint(CheckpointMode::Passive).unwrap();
        append(&mut s, 3); // only in the -wal
        let moved = tempfile::tempdir().unwrap();
        let db = moved.path().join("spool.db");
        std::fs::copy(&live, &db).unwrap();
        let opened = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        assert!(aside(moved.path()).is_empty());
        assert_eq!(rows(&opened), 5, "what reached the file is kept");
        assert_eq!(counter(&opened, "spool_opened_without_wal"), 1);
        // The live spool, with its -wal, is not reported.
        drop(s);
        let mut s = Spool::open(&live, &no_checkpoints()).unwrap();
        s.begin_run(2, 43, "v").unwrap();
        drop(opened);
        let o = open_spool_at(&live, &SpoolOptions::default()).unwrap();
        assert_eq!(counter(&o, "spool_opened_without_wal"), 0);
    }

    #[test]
    fn a_file_moved_aside_under_a_name_already_taken_takes_a_suffix_and_replaces_nothing() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let base = format!("{}.no-wal-5", db.display());
        std::fs::write(&base, b"first").unwrap();
        std::fs::write(format!("{base}-1-shm"), b"stale").unwrap();
        std::fs::write(&db, b"second").unwrap();
        std::fs::write(format!("{}-shm", db.display()), b"shm").unwrap();
        let aside = super::move_to_free_name(&db, &base).unwrap();
        assert_eq!(aside, format!("{base}-2"));
        assert_eq!(std::fs::read(&base).unwrap(), b"first");
        assert_eq!(std::fs::read(format!("{base}-1-shm")).unwrap(), b"stale");
        assert_eq!(std::fs::read(&aside).unwrap(), b"second");
        assert_eq!(std::fs::read(format!("{aside}-shm")).unwrap(), b"shm");
        assert!(!db.exists());
    }

    /// A board without a real-time clock comes back to the wall-clock names
    /// of earlier moves: every name of the next two seconds is taken.
    #[test]
    fn a_spool_moved_aside_at_a_wall_clock_name_already_used_replaces_nothing() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        // A board without a real-time clock back at the same wall-clock
        // time: the name and its next suffix are taken (the clock is given,
        // so a slow machine cannot move past the names made before).
        let now = 1_000;
        for name in [format!("{now}"), format!("{now}-2")] {
            std::fs::write(format!("{}.no-wal-{name}", db.display()), b"earlier").unwrap();
        }
        std::fs::write(format!("{}.no-wal-{now}-1-wal", db.display()), b"earlier").unwrap();
        std::fs::write(&db, b"this one").unwrap();
        let aside = super::move_aside_at(&db, now).unwrap();
        assert_eq!(std::fs::read(&aside).unwrap(), b"this one");
        // `-1` is taken through its -wal, `-2` by itself: the next free one.
        assert!(aside.ends_with(&format!("{now}-3")), "{aside}");
        let earlier = std::fs::read_dir(d.path())
            .unwrap()
            .filter(|e| std::fs::read(e.as_ref().unwrap().path()).unwrap() == b"earlier")
            .count();
        assert_eq!(earlier, 3, "an earlier file was replaced");
    }

    /// Issue 33, item 8: a reader holding the WAL from before a run began
    /// keeps even the run's start out of the file; with the `-wal` lost the
    /// file shows only an older run that ended cleanly. The run marker
    /// names the run whatever the reader did.
    #[test]
    fn a_run_a_reader_kept_out_of_the_file_is_named_by_its_marker_when_the_wal_is_lost() {
        use super::super::run_marker::{self, RunMarker};
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let mut s = Spool::open(&live, &SpoolOptions::default()).unwrap();
        let first = s.begin_run(1, 41, "v").unwrap();
        append(&mut s, 2);
        s.end_run(first, 2, "ok", None).unwrap();
        s.checkpoint(CheckpointMode::Truncate).unwrap();
        let reader = rusqlite::Connection::open(&live).unwrap();
        reader
            .execute_batch("BEGIN; SELECT count(*) FROM runs;")
            .unwrap();
        let run = s.begin_run(3, 42, "v").unwrap();
        let marker = RunMarker {
            run_id: run,
            pid: 42,
            started_ms: 3,
        };
        run_marker::write(&live, &marker).unwrap();
        s.checkpoint(CheckpointMode::Passive).unwrap();
        append(&mut s, 5);
        s.checkpoint(CheckpointMode::Passive).unwrap();
        // The -wal lost after an unclean stop: the file alone, and the marker.
        let lost = tempfile::tempdir().unwrap();
        let db = lost.path().join("spool.db");
        std::fs::copy(&live, &db).unwrap();
        let unmarked = lost.path().join("unmarked.db");
        std::fs::copy(&live, &unmarked).unwrap();
        run_marker::write(&db, &marker).unwrap();
        drop(reader);
        let o = super::super::open_spool_judged(&db, &SpoolOptions::default(), super::look(&db))
            .unwrap();
        assert_eq!(
            rows(&o.spool),
            2,
            "only the first run's rows reached the file"
        );
        assert!(
            o.lost
                .as_deref()
                .is_some_and(|l| l.contains(&format!("run {run} committed only to the -wal"))),
            "{:?}",
            o.lost
        );
        assert_eq!(counter(&o.spool, "spool_opened_without_wal"), 1);
        // Without the marker the file tells nothing: before it, every
        // commit of the run was gone without a word.
        let o = super::super::open_spool_judged(
            &unmarked,
            &SpoolOptions::default(),
            super::look(&unmarked),
        )
        .unwrap();
        assert_eq!(
            (o.lost, counter(&o.spool, "spool_opened_without_wal")),
            (None, 0)
        );
    }

    #[test]
    fn a_marker_whose_run_ended_or_that_an_older_run_left_reports_nothing_of_its_own() {
        use super::super::run_marker::{self, RunMarker};
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let mut s = Spool::open(&db, &SpoolOptions::default()).unwrap();
        let run = s.begin_run(5, 42, "v").unwrap();
        let m = RunMarker {
            run_id: run,
            pid: 42,
            started_ms: 5,
        };
        // Killed after the final checkpoint, before the marker's removal.
        run_marker::write(&db, &m).unwrap();
        s.end_run(run, 6, "ok", None).unwrap();
        drop(s);
        let o = super::super::open_spool_judged(&db, &SpoolOptions::default(), super::look(&db))
            .unwrap();
        assert_eq!(o.lost, None);
        // A later run whose marker could not be written: the stale marker
        // gives way to the file's newest run, which ended.
        let mut s = o.spool;
        let later = s.begin_run(7, 43, "v").unwrap();
        s.end_run(later, 8, "ok", None).unwrap();
        drop(s);
        let o = super::super::open_spool_judged(&db, &SpoolOptions::default(), super::look(&db))
            .unwrap();
        assert_eq!(
            (o.lost, counter(&o.spool, "spool_opened_without_wal")),
            (None, 0)
        );
    }

    #[test]
    fn a_bare_copy_given_an_empty_wal_by_a_read_only_open_is_still_counted() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let mut s = Spool::open(&live, &no_checkpoints()).unwrap();
        s.begin_run(1, 42, "v").unwrap();
        append(&mut s, 5);
        s.checkpoint(CheckpointMode::Passive).unwrap();
        append(&mut s, 3);
        let moved = tempfile::tempdir().unwrap();
        let db = moved.path().join("spool.db");
        std::fs::copy(&live, &db).unwrap();
        drop(Spool::open_read_only(&db).unwrap());
        let wal = crate::spool::wal_path(&db);
        assert_eq!(std::fs::metadata(&wal).map(|m| m.len()).ok(), Some(0));
        let opened = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        assert_eq!(counter(&opened, "spool_opened_without_wal"), 1);
    }

    #[test]
    fn a_clean_stop_then_a_read_only_open_is_not_reported() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let mut s = Spool::open(&db, &no_checkpoints()).unwrap();
        let run = s.begin_run(1, 42, "v").unwrap();
        append(&mut s, 5);
        s.end_run(run, 2, "ok", None).unwrap();
        drop(s);
        drop(Spool::open_read_only(&db).unwrap());
        let opened = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        assert_eq!(counter(&opened, "spool_opened_without_wal"), 0);
        assert_eq!(rows(&opened), 5);
    }

    #[test]
    fn an_export_of_a_running_spool_opens_without_a_lost_wal_report() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let mut s = Spool::open(&live, &no_checkpoints()).unwrap();
        s.begin_run(1, 42, "v").unwrap();
        append(&mut s, 7);
        let to = d.path().join("backup.db");
        let e = crate::spool::backup::export(&live, &to).unwrap();
        assert_eq!((e.rows, e.unacked), (7, 7));
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&to).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o640);
        assert!(matches!(
            crate::spool::backup::export(&live, &to),
            Err(crate::spool::backup::ExportError::Exists(_))
        ));
        let moved = tempfile::tempdir().unwrap();
        let db = moved.path().join("spool.db");
        std::fs::rename(&to, &db).unwrap();
        let opened = open_spool_at(&db, &SpoolOptions::default()).unwrap();
        assert_eq!(rows(&opened), 7);
        assert_eq!(counter(&opened, "spool_opened_without_wal"), 0);
        let run = opened.runs(1).unwrap().remove(0);
        assert_eq!(
            run.exit_status.as_deref(),
            Some(crate::spool::backup::EXPORTED_RUN_STATUS)
        );
    }
}
