//! `<spool>.run`: the run whose commits may be in the `-wal` alone.
//!
//! Its one rule: **the marker exists while the database file alone may not
//! hold every commit of the run it names**: written at start once the run
//! is recorded (through a new file of the agent's, fsynced:
//! [`crate::os::fsguard::files::replace`]), removed at a clean stop only
//! after the final checkpoint copied the whole `-wal` into the file. Two
//! small writes a run, whatever it commits.
//!
//! Why a file beside the spool and not a row in it: a reader that holds a
//! read transaction from before the run began (a `sqlite3` shell left open
//! with `BEGIN; SELECT ...`) keeps every checkpoint from copying the run's
//! frames into the file, its start record included; the `runs` table in the
//! file then shows an older run that ended cleanly, and a lost `-wal` would
//! leave no trace in the file (issue 33, item 8: 57,432 committed rows gone
//! with only "integrity check passed" in the log). The marker does not
//! depend on any checkpoint.

use std::path::{Path, PathBuf};

/// What the marker names: the run as `runs` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunMarker {
    /// `runs.id`.
    pub run_id: i64,
    /// `runs.pid`.
    pub pid: i64,
    /// `runs.started_ms` (Unix ms): tells this run from a later one given
    /// the same id after the file lost it.
    pub started_ms: i64,
}

impl RunMarker {
    /// The file's text: `run=<id> pid=<pid> started_ms=<ms>`.
    fn text(&self) -> String {
        format!(
            "run={} pid={} started_ms={}\n",
            self.run_id, self.pid, self.started_ms
        )
    }

    /// The marker in `text`, or `None` when it is not what [`Self::text`] writes.
    fn parse(text: &str) -> Option<RunMarker> {
        let mut run_id = None;
        let mut pid = None;
        let mut started_ms = None;
        for part in text.split_whitespace() {
            let (k, v) = part.split_once('=')?;
            let v: i64 = v.parse().ok()?;
            match k {
                "run" => run_id = Some(v),
                "pid" => pid = Some(v),
                "started_ms" => started_ms = Some(v),
                _ => return None,
            }
        }
        Some(RunMarker {
            run_id: run_id?,
            pid: pid?,
            started_ms: started_ms?,
        })
    }
}

/// `<spool>.run`.
pub fn path(db: &Path) -> PathBuf {
    super::suffixed(db, ".run")
}

/// Write the marker for the spool at `db` (mode 0600).
///
/// Errors: the directory is not writable, the disk is full, a planted name
/// is in the way; the caller warns and runs on (a lost `-wal` of this run
/// is then found only when the file shows the run, as before the marker).
pub fn write(db: &Path, m: &RunMarker) -> std::io::Result<()> {
    crate::os::fsguard::files::replace(&path(db), m.text().as_bytes(), 0o600)
}

/// Remove the marker of the spool at `db` (a clean stop whose final
/// checkpoint copied everything). A marker already gone is no error.
pub fn remove(db: &Path) {
    let p = path(db);
    match std::fs::remove_file(&p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!(
            "cannot remove {}: {e}; the next start may name a lost -wal for a run that stopped cleanly",
            p.display()
        ),
    }
}

/// The marker beside the spool at `db`, if the agent wrote it (owner and
/// mode, [`crate::os::fsguard::files::read_trusted`]) and it parses. Any
/// other file at that name is named in a WARN and removed; `None` either way.
pub(super) fn read(db: &Path) -> Option<RunMarker> {
    let p = path(db);
    let why = match crate::os::fsguard::files::read_trusted(&p) {
        Ok(None) => return None,
        Ok(Some(bytes)) => match RunMarker::parse(&String::from_utf8_lossy(&bytes)) {
            Some(m) => return Some(m),
            None => "it is not the marker the agent writes".to_owned(),
        },
        Err(d) => d.to_string(),
    };
    log::warn!("run marker {} is ignored: {why}; removing it", p.display());
    let _ = std::fs::remove_file(&p);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_reads_back_as_written_and_anything_else_is_ignored_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        assert_eq!(read(&db), None);
        let m = RunMarker {
            run_id: 7,
            pid: 4242,
            started_ms: 1_700_000_000_000,
        };
        write(&db, &m).unwrap();
        assert_eq!(read(&db), Some(m));
        std::fs::write(path(&db), b"run=7 pid=x").unwrap();
        assert_eq!(read(&db), None);
        assert!(!path(&db).exists(), "a damaged marker is removed");
        // A planted symlink is never followed, and removed by name.
        let target = d.path().join("target");
        std::fs::write(&target, m.text()).unwrap();
        std::os::unix::fs::symlink(&target, path(&db)).unwrap();
        assert_eq!(read(&db), None);
        assert!(target.exists(), "the symlink's target is untouched");
        remove(&db);
        remove(&db);
    }
}
