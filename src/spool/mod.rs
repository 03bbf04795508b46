//! The spool: one SQLite file in WAL mode holding every event until the broker
//! has acknowledged it.
//!
//! Owns one SQLite connection (the agent opens two: ingest and delivery, so a
//! slow commit on one never waits on the other's work). Its one rule: **a row
//! leaves the unacknowledged set (`PENDING`, `SENT`) only through
//! [`Spool::retire`], called with a PUBACK; it is deleted only by
//! [`Spool::purge_acked`], and only once `ACKED`.**
//!
//! - Pragmas are set, read back and checked at open
//!   (<https://www.sqlite.org/pragma.html>, <https://www.sqlite.org/wal.html>):
//!   `journal_mode` must come back `wal` or the open fails (field case F07).
//! - Every write transaction is `BEGIN IMMEDIATE`, so a write never hits the
//!   deferred read→write upgrade that returns `SQLITE_BUSY` without waiting
//!   for `busy_timeout` (<https://www.sqlite.org/lang_transaction.html>, F03).
//! - Schema version lives in `PRAGMA user_version`; migrations only go forward.
//! - No statement or read transaction is held across calls, so no agent reader
//!   pins the WAL (F01).
//!
//! One file per job:
//! - `schema`: the schema version and its forward-only migrations;
//! - `open`: opening a connection, setting and reading back the pragmas;
//! - `wal`: the WAL frames and commits every connection on the file shares;
//! - `seqs`: the sequence number book of each stream;
//! - `append`: a reading into a row (event id, payload encoded once, digest);
//! - `riders`: the bookkeeping that rides an append instead of a commit of its own;
//! - `delivery`: rows to publish, the acknowledged mark, FAILED rows;
//! - `held`: what the spool still holds per stream, and rows read again by
//!   sequence number when the fleet asks (backfill);
//! - `upkeep`: retention, giving space back, checkpoints;
//! - `clock_spans`: the rows appended before the wall clock was set, and
//!   the time retention counts them from;
//! - `commands`: command records (the idempotency keys of commands);
//! - `keys`: idempotency keys of keyed readings;
//! - `priority`: each row's delivery lane;
//! - `rates`: rows appended since a row id and rows held, for the outage budget;
//! - `stats`: counters, agent state and run records for `status`;
//! - `backup`: a consistent copy of the live spool (`edgespool export`).

mod append;
pub mod backup;
mod clock_spans;
mod commands;
mod delivery;
mod held;
pub mod integrity;
mod keys;
mod open;
pub mod priority;
pub mod rates;
mod riders;
mod schema;
mod seqs;
mod stats;
mod stored_id;
mod upkeep;
mod wal;

pub use append::{CommitOutcome, Committed, NewEvent, ReadingKey, Refused, Reply, REPLY_BYTES};
pub use clock_spans::WallClock;
pub use commands::*;
pub use delivery::{FailedRow, OutRow};
pub use held::{HeldRow, HeldState, PENDING_SCAN_ROWS};
pub use keys::KEYS_KEPT;
pub use open::{shm_path, wal_path};
pub use riders::{Riders, Rode};
pub use schema::SCHEMA_VERSION;
pub use stats::{RunRecord, Stats};
pub use upkeep::{CheckpointMode, CheckpointResult};
pub use wal::WalWatch;

use rusqlite::{Connection, ErrorCode, TransactionBehavior};
use seqs::SeqBook;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Row states (docs/invariants.md, "Spool states").
pub mod state {
    /// Committed locally; no publish attempt yet.
    pub const PENDING: &str = "PENDING";
    /// At least one publish attempt; no acknowledgement yet. Replay-eligible.
    pub const SENT: &str = "SENT";
    /// The broker's PUBACK for a publish carrying this row arrived.
    pub const ACKED: &str = "ACKED";
    /// Terminal by policy (e.g. larger than the broker accepts); kept until requeued.
    pub const FAILED: &str = "FAILED";
}

/// Errors from the spool, classified from SQLite's result codes
/// (<https://www.sqlite.org/rescode.html>), never from message text.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// The database stayed locked past `busy_timeout` (SQLITE_BUSY/LOCKED).
    /// Transient: keep the data and retry with backoff.
    #[error("spool {path}: database busy past busy_timeout: {source}")]
    Busy {
        /// The spool file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// The disk or the database size limit is full (SQLITE_FULL). Refuse new
    /// data by policy, never delete unacknowledged rows; retry when space returns.
    #[error("spool {path}: disk full: {source}")]
    Full {
        /// The spool file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// The file is damaged or is not a SQLite database (SQLITE_CORRUPT/NOTADB).
    /// Move it aside and start a fresh spool; never a silent wipe.
    #[error("spool {path}: database damaged: {source}")]
    Corrupt {
        /// The spool file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// WAL did not take effect (field case F07): the agent refuses to start.
    #[error("spool {path}: journal_mode is {effective:?} after asking for wal; WAL needs a local filesystem with working shared memory and locks")]
    WalNotInEffect {
        /// The spool file.
        path: PathBuf,
        /// The journal mode SQLite reported.
        effective: String,
    },
    /// The file was written by a newer edgespool. Fatal: do not downgrade data.
    #[error("spool {path}: schema version {found} is newer than this build's {SCHEMA_VERSION}")]
    NewerSchema {
        /// The spool file.
        path: PathBuf,
        /// `user_version` found.
        found: i64,
    },
    /// An event could not be encoded (a non-finite number). Bad data: skip it.
    #[error("spool {path}: event not encodable: {detail}")]
    Encode {
        /// The spool file.
        path: PathBuf,
        /// Why.
        detail: String,
    },
    /// Any other SQLite or I/O failure. Fatal for the operation; logged.
    #[error("spool {path}: {source}")]
    Other {
        /// The spool file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
}

impl SpoolError {
    pub(crate) fn classify(path: &Path, e: rusqlite::Error) -> SpoolError {
        let path = path.to_path_buf();
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
                SpoolError::Busy { path, source: e }
            }
            Some(ErrorCode::DiskFull) => SpoolError::Full { path, source: e },
            Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
                SpoolError::Corrupt { path, source: e }
            }
            _ => SpoolError::Other { path, source: e },
        }
    }

    /// True for errors worth retrying with the same data (busy, full).
    pub fn is_transient(&self) -> bool {
        matches!(self, SpoolError::Busy { .. } | SpoolError::Full { .. })
    }
}

/// `PRAGMA synchronous` levels the agent accepts (never OFF: F04).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchronous {
    /// fsync at checkpoints only; a power cut may roll back the newest commits.
    Normal,
    /// fsync at every commit.
    Full,
}

/// Settings for opening a spool, from the `[spool]` config table.
#[derive(Debug, Clone, PartialEq)]
pub struct SpoolOptions {
    /// `PRAGMA synchronous`.
    pub synchronous: Synchronous,
    /// `PRAGMA busy_timeout`, at least 5 s by validation (F03).
    pub busy_timeout: Duration,
    /// `PRAGMA journal_size_limit`, bytes: the WAL is truncated to this after a checkpoint.
    pub journal_size_limit_bytes: i64,
    /// `PRAGMA wal_autocheckpoint`, pages; 0 turns SQLite's own checkpoints off.
    pub wal_autocheckpoint_pages: i64,
}

impl Default for SpoolOptions {
    fn default() -> Self {
        SpoolOptions {
            synchronous: Synchronous::Normal,
            busy_timeout: Duration::from_secs(5),
            journal_size_limit_bytes: 4 * 1024 * 1024,
            wal_autocheckpoint_pages: 1000,
        }
    }
}

/// Pragmas as read back after open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectivePragmas {
    /// `journal_mode` (must be `wal`).
    pub journal_mode: String,
    /// `synchronous` (1 NORMAL, 2 FULL).
    pub synchronous: i64,
    /// `busy_timeout`, ms.
    pub busy_timeout_ms: i64,
    /// `journal_size_limit`, bytes.
    pub journal_size_limit: i64,
    /// `wal_autocheckpoint`, pages.
    pub wal_autocheckpoint: i64,
}

/// An open spool connection.
pub struct Spool {
    conn: Connection,
    path: PathBuf,
    pragmas: EffectivePragmas,
    /// Sequence numbers issued by [`Spool::append`]; shared by the ingest
    /// connections ([`Spool::share_seqs`]) so each stream has one counter.
    seqs: Arc<Mutex<SeqBook>>,
    /// WAL frames and commits of this file, shared by every connection of
    /// this process on it ([`Spool::open_sibling`]).
    wal: Arc<WalWatch>,
    /// The secret of keyed event ids (schema 10's `secrets`); zeros on a
    /// read-only spool, which appends nothing.
    key_secret: [u8; 32],
    /// The highest row id there was at this connection's last append that
    /// judged the clock (or at open): a span of rows appended before the
    /// clock was set starts right after it, so it also takes the rows
    /// another connection appended since (a command's result).
    seen_through: i64,
}

impl Spool {
    /// The raw connection, for tests that look at the tables directly.
    #[cfg(test)]
    pub(crate) fn raw(&self) -> &Connection {
        &self.conn
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        // The hook's context is `self.wal`: clear it before the Arc can go.
        wal::unwatch(&self.conn);
    }
}

impl std::fmt::Debug for Spool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spool").field("path", &self.path).finish()
    }
}

pub(super) const SQL_GET_STATE: &str = "SELECT value FROM agent_state WHERE key = ?1";

pub(super) const SQL_SET_STATE: &str =
    "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
    ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms";

pub(super) const SQL_COUNTER_ADD: &str = "INSERT INTO counters (name, value) VALUES (?1, ?2)
    ON CONFLICT(name) DO UPDATE SET value = value + excluded.value";

impl Spool {
    /// Run `f` inside one `BEGIN IMMEDIATE` transaction: every write of the
    /// spool but the schema migration and the ingest append (which keep
    /// their own, equally IMMEDIATE) goes through here, so none can hit the
    /// deferred read→write upgrade that fails with SQLITE_BUSY without waiting
    /// for `busy_timeout` (F03). `f` gets the transaction and this spool's
    /// error classifier; Ok commits, Err rolls back.
    pub(super) fn write<T>(
        &mut self,
        f: impl FnOnce(
            &rusqlite::Transaction<'_>,
            &dyn Fn(rusqlite::Error) -> SpoolError,
        ) -> Result<T, SpoolError>,
    ) -> Result<T, SpoolError> {
        let path = &self.path;
        let err = |e| SpoolError::classify(path, e);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        let v = f(&tx, &err)?;
        tx.commit().map_err(err)?;
        Ok(v)
    }

    pub(super) fn err(&self, e: rusqlite::Error) -> SpoolError {
        SpoolError::classify(&self.path, e)
    }

    /// The spool file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pragmas as read back at open.
    pub fn pragmas(&self) -> &EffectivePragmas {
        &self.pragmas
    }

    /// Every row `sql` returns with `params`, mapped by `f`; no statement
    /// stays open afterwards (F01).
    pub(super) fn query_all<T>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
        f: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let mut st = self.conn.prepare_cached(sql).map_err(e)?;
        let rows = st
            .query_map(params, f)
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests;
