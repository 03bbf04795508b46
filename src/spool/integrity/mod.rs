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
//! none. A check that finds damage writes `<spool>.damaged` with the
//! database file's inode and the reason; the next open moves the file aside
//! ([`open_spool_at`]).
//!
//! A third file, the run marker `<spool>.run` ([`run_marker`]), says which
//! run may have commits in the `-wal` alone, so a lost `-wal` is named
//! whatever readers kept from the file ([`wal_lost`]).
//!
//! These files sit where another user might once have planted names: they
//! are written only through new files of the agent's
//! ([`crate::os::fsguard::files::replace`]) and believed only when the agent's
//! own (owner, mode, [`crate::os::fsguard::files::read_trusted`]). A marker that
//! does not name this spool's inode is ignored, by name, and removed: a
//! marker alone never moves a spool aside.

pub mod run_marker;
mod wal_lost;

pub use wal_lost::{look as look_before_open, Before};

use crate::spool::{Spool, SpoolError, SpoolOptions};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Why [`open_spool_at`] gave no spool.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The open failed and the file is not damaged (or the fresh spool
    /// failed): fatal, the cause says what to fix.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The file is not a SQLite database, or a damaged one could not be
    /// moved aside: refused, nothing touched; fix the path or directory.
    #[error("{0}")]
    Refused(String),
}

/// The first 16 bytes of every SQLite database file
/// (<https://www.sqlite.org/fileformat.html#the_database_header>).
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// A spool [`open_spool_judged`] opened, with what the open found lost.
#[derive(Debug)]
pub struct Opened {
    /// The spool, ready.
    pub spool: Spool,
    /// Committed rows the open found gone, in a short sentence (already
    /// logged at ERROR and counted): a lost `-wal`, or a file moved aside
    /// (damaged, or its every commit in a lost `-wal`). The agent keeps it
    /// as a health reason for the run.
    pub lost: Option<String>,
}

/// Open the spool at `path` with `options`; a file that lost its `-wal` is
/// named at ERROR, and moved aside when its schema was only in it
/// ([`wal_lost`]); a damaged spool is moved aside
/// (never a silent wipe; F04): `spool.db` → `spool.db.corrupt-<unix ms>`
/// (with its `-wal` and `-shm`), the move is counted, and a fresh spool is
/// created. Damage is known from the open itself (SQLITE_CORRUPT/NOTADB, or
/// a generic error that SQLite's own check of the file confirms, see
/// [`confirm_damage`]) or from the marker a background check left. A file
/// that is not a SQLite database at all (a config file given as
/// `spool.path` by mistake) is refused, never moved. No whole-file check
/// runs here: startup work does not grow with the spool. The fuzz target
/// that mutates spool files runs exactly this code.
///
/// Errors: [`OpenError::Spool`] (the open failed and the file is not
/// damaged, or the fresh spool failed), [`OpenError::Refused`] (not a
/// SQLite file, or it cannot be moved aside).
pub fn open_spool_at(path: &Path, options: &SpoolOptions) -> Result<Spool, OpenError> {
    open_spool_seen(path, options, wal_lost::look(path))
}

/// [`open_spool_at`] judged on `before`, what [`look_before_open`] saw
/// before anything opened the file (the agent looks before its read-only
/// opens, which create an empty `-wal`). A `before` of another path is
/// ignored and the file looked at now.
///
/// Errors: as [`open_spool_at`].
pub fn open_spool_seen(
    path: &Path,
    options: &SpoolOptions,
    before: Before,
) -> Result<Spool, OpenError> {
    open_spool_judged(path, options, before).map(|o| o.spool)
}

/// [`open_spool_seen`], also returning what the open found lost
/// ([`Opened::lost`]).
///
/// Errors: as [`open_spool_at`].
pub fn open_spool_judged(
    path: &Path,
    options: &SpoolOptions,
    before: Before,
) -> Result<Opened, OpenError> {
    let before = if before.path == path {
        before
    } else {
        wal_lost::look(path)
    };
    if before.schema_only_in_wal {
        let aside = wal_lost::move_aside(path).map_err(OpenError::Refused)?;
        let mut s = Spool::open(path, options)?;
        s.count("spool_moved_aside_without_wal", 1)?;
        return Ok(Opened {
            spool: s,
            lost: Some(format!(
                "every commit was in a -wal that was gone; the file was moved to {aside} and a fresh spool started"
            )),
        });
    }
    let marker = damaged_marker(path);
    let damage = match believed_marker(path) {
        Some(reason) => reason,
        None => match Spool::open(path, options) {
            Ok(mut s) => {
                let lost = if before.wal_missing {
                    wal_lost::report_lost_commits(&mut s)
                } else {
                    None
                };
                return Ok(Opened { spool: s, lost });
            }
            Err(SpoolError::Corrupt { source, .. }) => source.to_string(),
            // SQLite reports some damage as a generic error (a mangled
            // header: "unsupported file format"), damaged rows read back
            // with the wrong type (NULL in a NOT NULL column), and a mangled
            // schema as a missing column: whatever the error, a file its own
            // check also fails is damaged, one it passes keeps the error
            // (a bug of ours must never move a good spool aside).
            Err(SpoolError::Other { path: p, source }) => match confirm_damage(path) {
                Some(why) => format!("{source}; {why}"),
                None => return Err(SpoolError::Other { path: p, source }.into()),
            },
            Err(e) => return Err(e.into()),
        },
    };
    let mut head = [0u8; 16];
    let is_sqlite = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .is_ok_and(|()| &head == SQLITE_MAGIC);
    if !is_sqlite {
        return Err(OpenError::Refused(format!(
            "spool.path {} is not a SQLite database (no SQLite header); refusing to touch it",
            path.display()
        )));
    }
    let stamp = crate::event::envelope::wall_clock_ms().0;
    let aside = format!("{}.corrupt-{stamp}", path.display());
    log::error!(
        "spool {} is damaged ({damage}); moving it to {aside} and starting a fresh spool",
        path.display()
    );
    for suffix in ["", "-wal", "-shm"] {
        let from = format!("{}{suffix}", path.display());
        if Path::new(&from).exists() {
            std::fs::rename(&from, format!("{aside}{suffix}")).map_err(|e| {
                OpenError::Refused(format!("cannot move damaged spool {from} aside: {e}"))
            })?;
        }
    }
    let _ = std::fs::remove_file(&marker);
    let mut s = Spool::open(path, options)?;
    s.count("spool_moved_aside_corrupt", 1)?;
    Ok(Opened {
        spool: s,
        lost: Some(format!(
            "the spool was damaged ({damage}); it was moved to {aside} and a fresh spool started"
        )),
    })
}

/// `<spool>.clean`: written at a clean stop.
pub fn stamp_path(db: &Path) -> PathBuf {
    suffixed(db, ".clean")
}

/// `<spool>.damaged`: written when a check found damage; its first line
/// names the database file's inode (`ino=<n>`), the rest is the reason.
pub fn damaged_marker(db: &Path) -> PathBuf {
    suffixed(db, ".damaged")
}

/// The marker's first line for the spool at `db` as it is now (`ino=<n>`),
/// or `None` when there is no file.
fn marker_identity(db: &Path) -> Option<String> {
    std::fs::metadata(db)
        .ok()
        .map(|m| format!("ino={}", m.ino()))
}

/// Write the marker for the spool at `db`: its inode, then `reason`.
///
/// Errors: the marker could not be written (the reason is still returned
/// to the agent, which stops; the next start then checks again).
pub fn write_marker(db: &Path, reason: &str) -> std::io::Result<()> {
    let id = marker_identity(db).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "the spool file is gone")
    })?;
    crate::os::fsguard::files::replace(
        &damaged_marker(db),
        format!("{id}\n{reason}").as_bytes(),
        0o600,
    )
}

/// The damage a marker reports for the spool at `db`, if the agent wrote
/// it (owner and mode) for this very file (its inode). Any other marker is
/// named in a WARN with the reason and removed; `None` either way.
fn believed_marker(db: &Path) -> Option<String> {
    let marker = damaged_marker(db);
    let why = match crate::os::fsguard::files::read_trusted(&marker) {
        Ok(None) => return None,
        Ok(Some(bytes)) => {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let (first, reason) = text.split_once('\n').unwrap_or((text.as_str(), ""));
            match marker_identity(db) {
                Some(id) if first.trim() == id => return Some(reason.trim().to_owned()),
                Some(id) => format!(
                    "it does not name this spool's inode ({id}): written by someone else, or for a spool since replaced"
                ),
                None => "there is no spool file it could be about".to_owned(),
            }
        }
        Err(d) => d.to_string(),
    };
    log::warn!(
        "damage marker {} is ignored: {why}; removing it (the spool is opened as it is)",
        marker.display()
    );
    let _ = std::fs::remove_file(&marker);
    None
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
/// or `None`. Removes the stamp: from here on the file is in use. A stamp
/// the agent did not write (a symlink, another owner, a loose mode) is
/// named in a WARN and counts as none.
pub fn take_stamp(db: &Path) -> Option<String> {
    let stamp = stamp_path(db);
    let stored = match crate::os::fsguard::files::read_trusted(&stamp) {
        Ok(s) => s.map(|b| String::from_utf8_lossy(&b).into_owned()),
        Err(d) => {
            log::warn!(
                "clean-stop stamp {} is ignored: {d}; removing it (the spool's integrity is checked)",
                stamp.display()
            );
            None
        }
    };
    let _ = std::fs::remove_file(&stamp);
    let now = fingerprint(db)?; // no file yet: nothing to check
    match stored {
        Some(s) if !s.starts_with("len=") => {
            log::warn!(
                "clean-stop stamp {} is ignored: it is damaged (not the fingerprint the agent writes: {:?}); the spool's integrity is checked",
                stamp.display(),
                s.chars().take(40).collect::<String>()
            );
            Some("the clean-stop stamp was damaged".into())
        }
        None => Some("the last run did not stop cleanly".into()),
        Some(s) if s.trim() != now => Some("the file changed since the last clean stop".into()),
        Some(_) => None,
    }
}

/// Record that the spool at `db` was closed cleanly, as it is now (a new
/// file of the agent's renamed over the name: a symlink planted there is
/// replaced, never followed).
pub fn write_stamp(db: &Path) {
    if let Some(fp) = fingerprint(db) {
        if let Err(e) = crate::os::fsguard::files::replace(&stamp_path(db), fp.as_bytes(), 0o600) {
            log::warn!(
                "cannot write {}: {e}; the next start checks the spool's integrity",
                stamp_path(db).display()
            );
        }
    }
}

/// Whether an error from opening the spool may come from damage to the
/// file's content: SQLite's generic error, or a value read back with a type
/// the schema rules out. Confirm with [`confirm_damage`] before acting.
pub fn may_be_damage(e: &rusqlite::Error) -> bool {
    use rusqlite::Error as E;
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::Unknown)
        || matches!(
            e,
            E::InvalidColumnType(..)
                | E::FromSqlConversionFailure(..)
                | E::IntegralValueOutOfRange(..)
        )
}

/// After an open failed with an error [`may_be_damage`] accepts: whether the file at
/// `db` is damaged, by SQLite's own check on a read-only connection
/// (`PRAGMA quick_check`, which reads every page; this runs only on that
/// error path). `Some(reason)` when the check cannot read the file or finds
/// damage; `None` when it passes, or cannot run for a reason that is not the
/// file's content (busy, permissions, I/O): then the open's error stands.
pub fn confirm_damage(db: &Path) -> Option<String> {
    use rusqlite::{Connection, ErrorCode, OpenFlags};
    let content_error = |e: &rusqlite::Error| {
        matches!(
            e.sqlite_error_code(),
            Some(ErrorCode::Unknown | ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
        )
    };
    // A plain connection, not `Spool::open_read_only`: the check is about
    // the content, whatever `user_version` the damaged header claims.
    let checked = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .and_then(|c| c.query_row("PRAGMA quick_check", [], |r| r.get::<_, String>(0)));
    match checked {
        Ok(r) if r == "ok" => None,
        Ok(r) => Some(format!("quick_check: {r}")),
        Err(e) if content_error(&e) => Some(format!("quick_check: {e}")),
        Err(_) => None,
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
            if let Err(e) = write_marker(&db, &damage) {
                log::warn!(
                    "cannot write the damage marker {}: {e}",
                    damaged_marker(&db).display()
                );
            }
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

    fn moved_aside(dir: &Path) -> bool {
        std::fs::read_dir(dir).unwrap().any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".corrupt-")
        })
    }

    /// Found by the `spool_open` fuzz target: a header whose schema format
    /// number (byte 47) was damaged made SQLite answer "unsupported file
    /// format", a generic error, so the agent refused to start at every
    /// restart (a crash loop) instead of moving the file aside.
    #[test]
    fn a_spool_whose_header_names_an_unknown_schema_format_is_moved_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let opts = crate::spool::SpoolOptions::default();
        drop(crate::spool::Spool::open(&db, &opts).unwrap());
        let mut bytes = std::fs::read(&db).unwrap();
        bytes[47] = 35;
        std::fs::write(&db, &bytes).unwrap();
        let s = open_spool_at(&db, &opts).expect("moved aside, fresh spool");
        assert!(moved_aside(d.path()));
        let counted = s.counters().unwrap();
        assert!(
            counted.contains(&("spool_moved_aside_corrupt".to_owned(), 1)),
            "{counted:?}"
        );
    }

    /// Found by the CI's `spool_open` fuzz smoke: bytes changed inside the
    /// stored schema, so the open failed with "no such column" (not an error
    /// that looked like damage) at every restart, though SQLite's own check
    /// fails the file. Any open error is now checked the same way.
    #[test]
    fn a_spool_with_a_mangled_schema_that_fails_its_check_is_moved_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/spool-with-a-mangled-schema.db");
        std::fs::copy(&fixture, &db).unwrap();
        assert!(
            confirm_damage(&db).is_some(),
            "the fixture fails quick_check"
        );
        let opts = crate::spool::SpoolOptions::default();
        let s = open_spool_at(&db, &opts).expect("moved aside, fresh spool");
        assert!(moved_aside(d.path()));
        assert!(s.stats(0).unwrap().by_stream_state.is_empty());
    }

    /// Found by the `spool_open` fuzz target: a damaged row with NULL in
    /// `streams.name` (NOT NULL) failed the open with a type error while
    /// reading sequence numbers, at every restart.
    #[test]
    fn a_spool_with_null_in_a_not_null_column_is_moved_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let opts = crate::spool::SpoolOptions::default();
        let mut s = crate::spool::Spool::open(&db, &opts).unwrap();
        let mut ids = crate::event::envelope::EventIdGen::new().unwrap();
        let ev = crate::spool::NewEvent {
            stream: "s".into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("v".into(), crate::event::reading::FieldValue::Num(1.0))],
            replay: None,
            key: None,
            reply: None,
        };
        s.append(
            &[ev],
            &mut ids,
            "d",
            crate::event::envelope::Format::Json,
            1,
        )
        .unwrap();
        drop(s);
        // Damage the way a bad sector could: the row, not the schema.
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch(
            "PRAGMA writable_schema = ON;
             UPDATE sqlite_schema SET sql = replace(sql, 'TEXT    NOT NULL UNIQUE', 'TEXT UNIQUE')
                 WHERE name = 'streams';",
        )
        .unwrap();
        drop(conn);
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch(
            "UPDATE streams SET name = NULL;
             PRAGMA writable_schema = ON;
             UPDATE sqlite_schema SET sql = replace(sql, 'TEXT UNIQUE', 'TEXT    NOT NULL UNIQUE')
                 WHERE name = 'streams';",
        )
        .unwrap();
        drop(conn);
        let s = open_spool_at(&db, &opts).expect("moved aside, fresh spool");
        assert!(moved_aside(d.path()));
        assert!(s.stats(0).unwrap().by_stream_state.is_empty());
    }

    /// Found by the `spool_open` fuzz target (the long run): a header with
    /// both the schema format and `user_version` damaged; the read-only
    /// check stopped at the version ("newer schema") before looking at the
    /// content, so the file was neither opened nor moved aside.
    #[test]
    fn a_damaged_header_claiming_a_newer_schema_is_moved_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let opts = crate::spool::SpoolOptions::default();
        drop(crate::spool::Spool::open(&db, &opts).unwrap());
        let mut bytes = std::fs::read(&db).unwrap();
        bytes[47] = 35; // schema format number
        bytes[60..64].copy_from_slice(&50_331_648u32.to_be_bytes()); // user_version
        std::fs::write(&db, &bytes).unwrap();
        open_spool_at(&db, &opts).expect("moved aside, fresh spool");
        assert!(moved_aside(d.path()));
    }

    /// The other side of the rule above: a healthy SQLite file that is not a
    /// spool of the version it claims fails the open with its error, and is
    /// never moved aside.
    #[test]
    fn a_healthy_file_with_a_foreign_schema_is_refused_not_moved_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch("CREATE TABLE other (x); PRAGMA user_version = 6;")
            .unwrap();
        drop(conn);
        let opts = crate::spool::SpoolOptions::default();
        let e = open_spool_at(&db, &opts).unwrap_err();
        assert!(e.to_string().contains("no such table"), "{e}");
        assert!(!moved_aside(d.path()));
    }

    fn aside_and_fresh(d: &Path, db: &Path) -> bool {
        let opts = crate::spool::SpoolOptions::default();
        drop(open_spool_at(db, &opts).unwrap());
        moved_aside(d)
    }

    #[test]
    fn only_a_marker_naming_this_spools_inode_moves_it_aside() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        drop(crate::spool::Spool::open(&db, &Default::default()).unwrap());
        let marker = damaged_marker(&db);
        std::fs::write(&marker, "quick_check: planted").unwrap();
        assert!(
            !aside_and_fresh(d.path(), &db),
            "a marker without the inode"
        );
        assert!(!marker.exists(), "the ignored marker is removed");
        std::fs::write(&marker, "ino=1\nquick_check: planted").unwrap();
        assert!(!aside_and_fresh(d.path(), &db), "another file's inode");
        write_marker(&db, "quick_check: page 3 is never used").unwrap();
        assert!(aside_and_fresh(d.path(), &db), "the agent's own marker");
        assert!(!marker.exists());
    }

    #[test]
    fn a_stamp_planted_as_a_symlink_is_replaced_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("spool.db");
        std::fs::write(&db, b"x").unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::os::unix::fs::symlink(&victim, stamp_path(&db)).unwrap();
        write_stamp(&db);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(take_stamp(&db), None, "the stamp written is believed");
        std::os::unix::fs::symlink(&victim, stamp_path(&db)).unwrap();
        assert!(
            take_stamp(&db).is_some(),
            "a symlinked stamp vouches for nothing"
        );
        assert!(std::fs::symlink_metadata(stamp_path(&db)).is_err());
    }

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
        // A power cut left the stamp NUL-filled: damaged, so checked.
        write_stamp(&db);
        let stamp = stamp_path(&db);
        crate::os::fsguard::files::replace(&stamp, &[0u8; 48], 0o600).unwrap();
        assert_eq!(
            take_stamp(&db).as_deref(),
            Some("the clean-stop stamp was damaged")
        );
        assert!(!stamp.exists());
    }
}
