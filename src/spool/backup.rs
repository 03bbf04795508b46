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
//! The copy is written to a temporary name beside the target (mode 0640),
//! the run that was live in it is marked as exported (a restored copy is
//! then not taken for a file copied without its `-wal`), checked with
//! `PRAGMA quick_check`, fsynced, and only then given its name, which it
//! never takes from an existing file.

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

/// Removes the temporary copy unless it was given its name.
struct Temp(Option<PathBuf>);

impl Drop for Temp {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(&p);
            let mut j = p.into_os_string();
            j.push("-journal");
            let _ = std::fs::remove_file(j);
        }
    }
}

/// Copy the spool at `spool` to `to`, a new file (see the module doc).
///
/// Errors: [`ExportError::Exists`] (checked first, and again by the final
/// rename), [`ExportError::Spool`] (no spool there, unreadable, damaged),
/// [`ExportError::Check`], [`ExportError::Io`] (the target's directory).
pub fn export(spool: &Path, to: &Path) -> Result<Exported, ExportError> {
    let started = Instant::now();
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(ExportError::Exists(to.to_path_buf()));
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ExportError::Io { path, source }
    };
    let name = to
        .file_name()
        .ok_or_else(|| ExportError::Io {
            path: to.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
        })?
        .to_string_lossy()
        .into_owned();
    let tmp_path = to.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let src = Spool::open_read_only(spool)?;
    let file = crate::fsguard::files::create_new(&tmp_path, 0o640).map_err(io(&tmp_path))?;
    let mut tmp = Temp(Some(tmp_path.clone()));
    // The umask narrows the mode at create; the copy is 0640 whatever it is.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o640))
        .map_err(io(&tmp_path))?;
    let t = Instant::now();
    // VACUUM INTO writes into an empty existing file; the name is bound.
    src.conn
        .execute("VACUUM INTO ?1", [tmp_path.to_string_lossy()])
        .map_err(|e| src.err(e))?;
    let read = t.elapsed();
    drop(src);
    let (rows, unacked) = settle_copy(&tmp_path)?;
    file.sync_all().map_err(io(&tmp_path))?;
    drop(file);
    let bytes = std::fs::metadata(&tmp_path).map_err(io(&tmp_path))?.len();
    crate::fsguard::files::rename_noreplace(&tmp_path, to).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            ExportError::Exists(to.to_path_buf())
        } else {
            ExportError::Io {
                path: to.to_path_buf(),
                source: e,
            }
        }
    })?;
    tmp.0 = None; // named now: nothing to remove
    let dir = to
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
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
