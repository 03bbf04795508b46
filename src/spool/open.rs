//! Opening a spool connection: flags, pragmas set and read back (WAL must
//! take effect, field case F07), the WAL hook, then the schema.

use super::wal::{self, WalWatch};
use super::{EffectivePragmas, Spool, SpoolError, SpoolOptions, Synchronous, SCHEMA_VERSION};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub(super) fn read_pragmas(conn: &Connection) -> rusqlite::Result<EffectivePragmas> {
    let q = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0));
    Ok(EffectivePragmas {
        journal_mode: conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?,
        synchronous: q("PRAGMA synchronous")?,
        busy_timeout_ms: q("PRAGMA busy_timeout")?,
        journal_size_limit: q("PRAGMA journal_size_limit")?,
        wal_autocheckpoint: q("PRAGMA wal_autocheckpoint")?,
    })
}

/// The `-wal` file beside a database.
pub fn wal_path(db: &Path) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push("-wal");
    PathBuf::from(s)
}

/// The `-shm` file beside a database (the WAL index every connection maps).
pub fn shm_path(db: &Path) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push("-shm");
    PathBuf::from(s)
}

pub(super) fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

impl Spool {
    /// Open (creating if needed) the spool at `path`, set and verify pragmas,
    /// and migrate the schema forward.
    ///
    /// Errors: [`SpoolError::WalNotInEffect`] if WAL did not take (F07),
    /// [`SpoolError::NewerSchema`], [`SpoolError::Corrupt`], or another
    /// classified SQLite error.
    pub fn open(path: &Path, opts: &SpoolOptions) -> Result<Spool, SpoolError> {
        let err = |e| SpoolError::classify(path, e);
        create_private(path);
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(err)?;
        conn.busy_timeout(opts.busy_timeout).map_err(err)?;
        // auto_vacuum can only be chosen before the first table exists
        // (<https://www.sqlite.org/pragma.html#pragma_auto_vacuum>); older
        // spools are converted once, by VACUUM, in `migrate`.
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL")
            .map_err(err)?;
        // journal_mode returns a row and is ignored inside a transaction
        // (F07): set it alone, outside any transaction, and read the answer.
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(SpoolError::WalNotInEffect {
                path: path.to_path_buf(),
                effective: mode,
            });
        }
        let sync = match opts.synchronous {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync).map_err(err)?;
        let _: i64 = conn
            .query_row(
                &format!(
                    "PRAGMA journal_size_limit={}",
                    opts.journal_size_limit_bytes
                ),
                [],
                |r| r.get(0),
            )
            .map_err(err)?;
        let _: i64 = conn
            .query_row(
                &format!(
                    "PRAGMA wal_autocheckpoint={}",
                    opts.wal_autocheckpoint_pages
                ),
                [],
                |r| r.get(0),
            )
            .map_err(err)?;
        let pragmas = read_pragmas(&conn).map_err(err)?;
        if !pragmas.journal_mode.eq_ignore_ascii_case("wal") {
            return Err(SpoolError::WalNotInEffect {
                path: path.to_path_buf(),
                effective: pragmas.journal_mode,
            });
        }
        let wal = Arc::new(WalWatch::default());
        wal::watch(&conn, &wal);
        let mut spool = Spool {
            conn,
            path: path.to_path_buf(),
            pragmas,
            seqs: Arc::default(),
            wal,
            key_secret: [0; 32],
            seen_through: 0,
        };
        spool.migrate()?;
        spool.load_seqs()?;
        spool.seen_through = spool
            .conn
            .query_row("SELECT coalesce(max(id), 0) FROM events", [], |r| r.get(0))
            .map_err(err)?;
        Ok(spool)
    }

    /// Open an existing spool read-only, for `status` beside a running agent:
    /// no pragma is changed, nothing is migrated, nothing is written.
    ///
    /// Errors: the file cannot be opened, is damaged, or is from a newer build.
    pub fn open_read_only(path: &Path) -> Result<Spool, SpoolError> {
        let err = |e| SpoolError::classify(path, e);
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        if version > SCHEMA_VERSION {
            return Err(SpoolError::NewerSchema {
                path: path.to_path_buf(),
                found: version,
            });
        }
        if version < 13 {
            // A spool from before schema 13 (its agent not restarted since
            // the upgrade) has no clock spans: an empty one of this
            // connection's own stands in, so the reads that look at it work.
            conn.execute_batch(super::clock_spans::SQL_NO_SPANS_YET)
                .map_err(err)?;
        }
        let pragmas = read_pragmas(&conn).map_err(err)?;
        Ok(Spool {
            conn,
            path: path.to_path_buf(),
            pragmas,
            seqs: Arc::default(),
            wal: Arc::default(),
            key_secret: [0; 32],
            seen_through: 0,
        })
    }

    /// Another connection on this spool's file with `opts` (its own
    /// `synchronous`, say), counting its commits in this one's WAL watch
    /// ([`Spool::wal`]). Sequence numbers are not shared (see
    /// [`Spool::share_seqs`]).
    ///
    /// Errors: as [`Spool::open`].
    pub fn open_sibling(&self, opts: &SpoolOptions) -> Result<Spool, SpoolError> {
        let mut s = Spool::open(&self.path, opts)?;
        s.share_wal(self);
        Ok(s)
    }
}

/// A new spool file is created here, empty (SQLite takes an empty file as a
/// new database), mode 0640 whatever the umask: SQLite would create it 0644
/// less the umask (`SQLITE_DEFAULT_FILE_PERMISSIONS`), and it gives the
/// `-wal` and `-shm` it creates the database file's own mode (`fchmod` in
/// `robust_open`, the mode taken from the database file), so all three
/// end up 0640 (or stricter, under a umask such as 077). An existing file
/// is left as it is; any other failure is SQLite's own open to report.
fn create_private(path: &Path) {
    let _ = crate::os::fsguard::files::create_new(path, 0o640);
}
