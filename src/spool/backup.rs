//! A consistent copy of a live spool (`edgespool export`).
//!
//! Its one rule: **an export never takes the spool's write lock**: it is
//! one `VACUUM INTO` on a read-only connection
//! (<https://www.sqlite.org/lang_vacuum.html#vacuuminto>), a single read
//! transaction, so it copies one committed state of the file, WAL included,
//! while the agent goes on committing (in WAL mode a reader never blocks a
//! writer). The backup API would do the same in one step; in several steps
//! it starts over whenever another connection writes, which the agent does
//! every commit window. While it reads, checkpoints cannot reset the WAL
//! past its snapshot (the agent's health says `checkpoint blocked` until it
//! ends).
//!
//! The copy is built inside a private directory made for it beside the
//! target (mode 0700, created exclusively like mkdtemp(3), on the target's
//! filesystem), so every step that opens it by name (`VACUUM INTO`, the
//! settle step) opens a name no other user can swap for a symlink. There it
//! is written (mode 0640), the run that was live in it is marked as
//! exported (a restored copy is then not taken for a file copied without
//! its `-wal`), checked with `PRAGMA quick_check`, fsynced, and only then
//! renamed to its name, which it never takes from an existing file; the
//! private directory is removed after, and on every error. A target that is
//! not valid UTF-8 is refused (SQLite takes the name as UTF-8 text).

use super::{Spool, SpoolError};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What a run that was live when the spool was exported is marked with in
/// the copy (`runs.exit_status`).
pub const EXPORTED_RUN_STATUS: &str = "running when exported (edgespool export)";

/// Marks the run left open in the copy.
const SQL_MARK_LIVE_RUN: &str =
    "UPDATE runs SET exit_status = ?1 WHERE ended_ms IS NULL AND exit_status IS NULL";

/// Rows of the copy by state.
const SQL_ROWS_BY_STATE: &str = "SELECT state, count(*) FROM event_states GROUP BY state";

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// Size of the copy, bytes.
    pub bytes: u64,
    /// Rows in the copy.
    pub rows: i64,
    /// Of them, not yet acknowledged (`PENDING`, `SENT`).
    pub unacked: i64,
    /// How long the read transaction on the spool lasted (`VACUUM INTO`).
    pub read: Duration,
    /// The whole export, check and fsync included.
    pub total: Duration,
}

/// Why [`export`] wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The target exists: nothing was written; pick another name.
    #[error("{0} exists; refusing to overwrite it (pick a new name)")]
    Exists(PathBuf),
    /// The target's name is not valid UTF-8 (SQLite takes names as UTF-8):
    /// nothing was written; pick a UTF-8 name.
    #[error("{}: the name is not valid UTF-8; nothing was written (pick a UTF-8 name)", .0.display())]
    NotUtf8(PathBuf),
    /// The spool could not be read: the cause says what to fix.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The copy failed its `quick_check`: nothing was kept; try again, and
    /// check the spool itself (`edgespool run --check-spool`).
    #[error("the copy failed its quick_check ({0}); nothing was kept")]
    Check(String),
    /// A file operation on the target's directory failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The private directory the copy is built in, removed with whatever is
/// left in it (the copy unless it was given its name, a journal).
struct Private(PathBuf);

impl Drop for Private {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Make a new directory `<dir>/.<name>.export-XXXXXX`, mode 0700, under a
/// name nobody had (mkdtemp(3): `mkdir` fails on an existing name, and the
/// six characters are tried again).
fn make_private(dir: &Path, name: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let template = dir.join(format!(".{name}.export-XXXXXX"));
    let mut bytes = std::ffi::CString::new(template.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?
        .into_bytes_with_nul();
    // SAFETY: `bytes` is a NUL-terminated template ending in "XXXXXX" that
    // mkdtemp(3) rewrites in place; it outlives the call.
    let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
    if made.is_null() {
        return Err(std::io::Error::last_os_error());
    }
    bytes.pop(); // the NUL
    Ok(PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

/// Copy the spool at `spool` to `to`, a new file (see the module doc).
///
/// Errors: [`ExportError::NotUtf8`] and [`ExportError::Exists`] (checked
/// first; the final rename never replaces either), [`ExportError::Spool`]
/// (no spool there, unreadable, damaged), [`ExportError::Check`],
/// [`ExportError::Io`] (the target's directory).
pub fn export(spool: &Path, to: &Path) -> Result<Exported, ExportError> {
    let started = Instant::now();
    if to.to_str().is_none() {
        return Err(ExportError::NotUtf8(to.to_path_buf()));
    }
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(ExportError::Exists(to.to_path_buf()));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Io { path, source }
    };
    let name = to
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| ExportError::Io {
            path: to.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
        })?;
    let dir = to
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let private = Private(make_private(dir, name).map_err(io(dir))?);
    let copy = private.0.join("copy.db");
    let copy_name = copy
        .to_str()
        .ok_or_else(|| ExportError::NotUtf8(copy.clone()))?
        .to_owned();
    let src = Spool::open_read_only(spool)?;
    let file = crate::os::fsguard::files::create_new(&copy, 0o640).map_err(io(&copy))?;
    // The umask narrows the mode at create; the copy is 0640 whatever it is.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o640))
        .map_err(io(&copy))?;
    let t = Instant::now();
    // VACUUM INTO writes into an empty existing file; the name is bound.
    src.conn
        .execute("VACUUM INTO ?1", [&copy_name])
        .map_err(|e| src.err(e))?;
    let read = t.elapsed();
    drop(src);
    let (rows, unacked) = settle_copy(&copy)?;
    file.sync_all().map_err(io(&copy))?;
    drop(file);
    let bytes = std::fs::metadata(&copy).map_err(io(&copy))?.len();
    crate::os::fsguard::files::rename_noreplace(&copy, to).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            ExportError::Exists(to.to_path_buf())
        } else {
            ExportError::Io {
                path: to.to_path_buf(),
                source: e,
            }
        }
    })?;
    drop(private);
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(Exported {
        bytes,
        rows,
        unacked,
        read,
        total: started.elapsed(),
    })
}

/// On the copy (a file of its own, nobody else's): the live run marked as
/// exported, then `quick_check`, then its rows counted. (rows, unacked).
fn settle_copy(copy: &Path) -> Result<(i64, i64), ExportError> {
    let err = |e| SpoolError::classify(copy, e);
    let c = Connection::open_with_flags(
        copy,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(err)?;
    c.execute(SQL_MARK_LIVE_RUN, [EXPORTED_RUN_STATUS])
        .map_err(err)?;
    let check: String = c
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(err)?;
    if check != "ok" {
        return Err(ExportError::Check(check));
    }
    let mut st = c.prepare(SQL_ROWS_BY_STATE).map_err(err)?;
    let by_state = st
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .map_err(err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    let rows = by_state.iter().map(|(_, n)| n).sum();
    let unacked = by_state
        .iter()
        .filter(|(s, _)| s == super::state::PENDING || s == super::state::SENT)
        .map(|(_, n)| n)
        .sum();
    Ok((rows, unacked))
}

#[cfg(test)]
mod tests {
    use super::{export, ExportError};
    use crate::spool::{Spool, SpoolOptions};
    use std::path::Path;

    /// Names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn spool(dir: &Path) -> std::path::PathBuf {
        let db = dir.join("spool.db");
        let mut s = Spool::open(&db, &SpoolOptions::default()).unwrap();
        s.begin_run(1, 42, "v").unwrap();
        db
    }

    #[test]
    fn an_export_leaves_nothing_but_the_copy_in_the_target_directory() {
        let d = tempfile::tempdir().unwrap();
        let db = spool(d.path());
        let out = tempfile::tempdir().unwrap();
        let to = out.path().join("backup.db");
        export(&db, &to).unwrap();
        assert_eq!(names(out.path()), ["backup.db"]);
    }

    #[test]
    fn an_export_onto_an_existing_name_is_refused_and_leaves_it_alone() {
        let d = tempfile::tempdir().unwrap();
        let db = spool(d.path());
        let out = tempfile::tempdir().unwrap();
        let to = out.path().join("backup.db");
        std::fs::write(&to, b"mine").unwrap();
        assert!(matches!(export(&db, &to), Err(ExportError::Exists(_))));
        assert_eq!(std::fs::read(&to).unwrap(), b"mine");
        let link = out.path().join("link.db");
        std::os::unix::fs::symlink(out.path().join("nowhere"), &link).unwrap();
        assert!(matches!(export(&db, &link), Err(ExportError::Exists(_))));
        assert_eq!(names(out.path()), ["backup.db", "link.db"]);
    }

    #[test]
    fn an_export_to_a_name_that_is_not_utf8_is_refused_and_writes_nothing() {
        use std::os::unix::ffi::OsStrExt;
        let d = tempfile::tempdir().unwrap();
        let db = spool(d.path());
        let out = tempfile::tempdir().unwrap();
        let to = out
            .path()
            .join(std::ffi::OsStr::from_bytes(b"backup-\xff.db"));
        let e = export(&db, &to).unwrap_err();
        assert!(matches!(e, ExportError::NotUtf8(_)), "{e}");
        assert!(e.to_string().contains("not valid UTF-8"), "{e}");
        assert!(names(out.path()).is_empty(), "{:?}", names(out.path()));
    }

    #[test]
    fn an_export_that_fails_leaves_no_temporary_files() {
        let d = tempfile::tempdir().unwrap();
        let not_a_spool = d.path().join("spool.db");
        std::fs::write(&not_a_spool, vec![b'x'; 8192]).unwrap();
        let out = tempfile::tempdir().unwrap();
        let to = out.path().join("backup.db");
        assert!(matches!(
            export(&not_a_spool, &to),
            Err(ExportError::Spool(_))
        ));
        assert!(names(out.path()).is_empty(), "{:?}", names(out.path()));
    }
}
