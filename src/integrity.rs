//! When the spool's integrity is checked, and the check itself.
//!
//! Its one rule: **a check that reads the whole file runs only when it is
//! needed, and never before delivery starts** (startup work must not grow
//! with the spool: `PRAGMA quick_check` reads every page, about 25 s for a
//! 470 MB spool on an SD card).
//!
//! "Needed" means the agent cannot vouch for the file: the last run did not
//! stop cleanly (no stamp), or the file changed since the stamp was written
//! (another program wrote it, a backup tool restored it), or an operator
//! asked (`run --check-spool`). A clean stop writes the stamp
//! `<spool>.clean` (length, mtime and inode of the database file after a
//! final checkpoint); a start removes it, so a kill or a power cut leaves
//! none. A check that finds damage writes `<spool>.damaged` with the reason;
//! the next open moves the file aside (see [`crate::agent::open_spool`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// `<spool>.clean`: written at a clean stop.
pub fn stamp_path(db: &Path) -> PathBuf {
    suffixed(db, ".clean")
}

/// `<spool>.damaged`: written when a check found damage; holds the reason.
pub fn damaged_marker(db: &Path) -> PathBuf {
    suffixed(db, ".damaged")
}

fn suffixed(db: &Path, suffix: &str) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// What the stamp records of the database file.
fn fingerprint(db: &Path) -> Option<String> {
    let m = std::fs::metadata(db).ok()?;
    Some(format!(
        "len={} mtime={}.{:09} ino={}",
        m.len(),
        m.mtime(),
        m.mtime_nsec(),
        m.ino()
    ))
}

/// Why the spool at `db` needs a check before the agent can vouch for it,
/// or `None`. Removes the stamp: from here on the file is in use.
pub fn take_stamp(db: &Path) -> Option<String> {
    let stamp = stamp_path(db);
    let stored = std::fs::read_to_string(&stamp).ok();
    let _ = std::fs::remove_file(&stamp);
    let now = fingerprint(db)?; // no file yet: nothing to check
    match stored {
        None => Some("the last run did not stop cleanly".into()),
        Some(s) if s.trim() != now => Some("the file changed since the last clean stop".into()),
        Some(_) => None,
    }
}

/// Record that the spool at `db` was closed cleanly, as it is now.
pub fn write_stamp(db: &Path) {
    if let Some(fp) = fingerprint(db) {
        if let Err(e) = std::fs::write(stamp_path(db), fp) {
            log::warn!(
                "cannot write {}: {e}; the next start checks the spool's integrity",
                stamp_path(db).display()
            );
        }
    }
}

/// The outcome of a background check, filled in once it has run:
/// `Some(reason)` when the spool is damaged.
pub type Verdict = Arc<Mutex<Option<String>>>;

/// Run `PRAGMA quick_check` on its own read-only connection, on a thread of
/// its own, after delivery has started. On damage, write the marker and put
/// the reason in the returned [`Verdict`]; the agent then stops and opens
/// the spool again (which moves the damaged file aside).
pub fn spawn_check(db: PathBuf, why: String) -> Verdict {
    let verdict: Verdict = Arc::default();
    let out = verdict.clone();
    let spawned = std::thread::Builder::new()
        .name("integrity".into())
        .spawn(move || {
            let t = std::time::Instant::now();
            let result = crate::spool::Spool::open_read_only(&db).and_then(|s| s.quick_check());
            let damage = match result {
                Ok(r) if r == "ok" => {
                    log::info!(
                        "spool {}: integrity check ({why}) passed in {} ms",
                        db.display(),
                        t.elapsed().as_millis()
                    );
                    return;
                }
                Ok(r) => format!("quick_check: {r}"),
                Err(crate::spool::SpoolError::Corrupt { source, .. }) => source.to_string(),
                Err(e) => {
                    log::warn!("spool {}: integrity check could not run: {e}", db.display());
                    return;
                }
            };
            let _ = std::fs::write(damaged_marker(&db), &damage);
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(damage);
        });
    if let Err(e) = spawned {
        log::warn!("cannot start the integrity check: {e}");
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_stop_vouches_for_the_file_until_it_changes() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        assert_eq!(take_stamp(&db), None, "no file, nothing to check");
        std::fs::write(&db, b"x").unwrap();
        assert!(take_stamp(&db).unwrap().contains("did not stop cleanly"));
        write_stamp(&db);
        assert_eq!(take_stamp(&db), None);
        // Taken: a second start without a clean stop in between checks.
        assert!(take_stamp(&db).is_some());
        write_stamp(&db);
        std::fs::write(&db, b"xy").unwrap();
        assert!(take_stamp(&db).unwrap().contains("changed"));
    }
}
