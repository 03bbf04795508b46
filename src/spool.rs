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

use crate::envelope::{self, Envelope, EventIdGen, Format};
use crate::source::Fields;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 4;

/// Row states (DESIGN.md, "Spool states").
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

const MIGRATION_1: &str = "
CREATE TABLE IF NOT EXISTS events (
    id              INTEGER PRIMARY KEY,
    event_id        TEXT    NOT NULL UNIQUE,
    stream          TEXT    NOT NULL,
    seq             INTEGER NOT NULL,
    payload         BLOB    NOT NULL,
    digest          BLOB    NOT NULL,
    state           TEXT    NOT NULL CHECK (state IN ('PENDING','SENT','ACKED','FAILED')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_ms      INTEGER NOT NULL,
    last_attempt_ms INTEGER,
    next_retry_ms   INTEGER,
    acked_ms        INTEGER,
    fail_reason     TEXT
);
CREATE INDEX IF NOT EXISTS events_unacked ON events(id) WHERE state IN ('PENDING','SENT');
CREATE INDEX IF NOT EXISTS events_acked ON events(acked_ms) WHERE state = 'ACKED';
CREATE TABLE IF NOT EXISTS stream_seq (
    stream   TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id          INTEGER PRIMARY KEY,
    started_ms  INTEGER NOT NULL,
    ended_ms    INTEGER,
    pid         INTEGER NOT NULL,
    version     TEXT NOT NULL,
    exit_status TEXT,
    error       TEXT
);
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
";

/// Commands received over MQTT and their results (idempotency records).
const MIGRATION_2: &str = "
CREATE TABLE IF NOT EXISTS commands (
    scope        TEXT    NOT NULL,
    command_id   TEXT    NOT NULL,
    request_hash BLOB    NOT NULL,
    name         TEXT    NOT NULL,
    request      TEXT    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN
                 ('received','running','completed','failed','rejected','expired','interrupted')),
    received_ms  INTEGER NOT NULL,
    ttl_ms       INTEGER,
    deadline_ms  INTEGER,
    started_ms   INTEGER,
    finished_ms  INTEGER,
    duration_ms  INTEGER,
    result       TEXT,
    duplicates   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, command_id)
);
CREATE INDEX IF NOT EXISTS commands_finished ON commands(finished_ms);
";

/// The running agent's health, last checkpoint and write budget, for `status`.
const MIGRATION_3: &str = "
CREATE TABLE IF NOT EXISTS agent_state (
    key        TEXT PRIMARY KEY,
    value      TEXT NOT NULL,
    updated_ms INTEGER NOT NULL
);
";

/// Schema 4, two changes in one table rebuild:
/// - row ids are never reused (AUTOINCREMENT, <https://www.sqlite.org/autoinc.html>):
///   the delivery thread reads rows by `id > cursor`, so an id reused after
///   retention would be skipped until the next reconnect, and a late PUBACK for
///   the old row could retire the new one;
/// - payloads live in their own table: SQLite rewrites a whole record on
///   UPDATE, so with the payload inline every state change (SENT, ACKED)
///   rewrote the payload too, to the WAL and then the flash.
const MIGRATION_4: &str = "
CREATE TABLE events_v4 (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id        TEXT    NOT NULL UNIQUE,
    stream          TEXT    NOT NULL,
    seq             INTEGER NOT NULL,
    digest          BLOB    NOT NULL,
    state           TEXT    NOT NULL CHECK (state IN ('PENDING','SENT','ACKED','FAILED')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    created_ms      INTEGER NOT NULL,
    last_attempt_ms INTEGER,
    next_retry_ms   INTEGER,
    acked_ms        INTEGER,
    fail_reason     TEXT
);
CREATE TABLE payloads (
    id      INTEGER PRIMARY KEY,
    payload BLOB NOT NULL
);
INSERT INTO events_v4 SELECT id, event_id, stream, seq, digest, state, attempts,
    created_ms, last_attempt_ms, next_retry_ms, acked_ms, fail_reason FROM events;
INSERT INTO payloads SELECT id, payload FROM events;
DROP TABLE events;
ALTER TABLE events_v4 RENAME TO events;
CREATE INDEX IF NOT EXISTS events_unacked ON events(id) WHERE state IN ('PENDING','SENT');
CREATE INDEX IF NOT EXISTS events_acked ON events(acked_ms) WHERE state = 'ACKED';
";

const SQL_INSERT_EVENT: &str = "INSERT INTO events
    (event_id, stream, seq, digest, state, attempts, created_ms)
    VALUES (?1, ?2, ?3, ?4, 'PENDING', 0, ?5)";
const SQL_INSERT_PAYLOAD: &str = "INSERT INTO payloads (id, payload) VALUES (?1, ?2)";
const SQL_UPSERT_SEQ: &str = "INSERT INTO stream_seq (stream, last_seq) VALUES (?1, ?2)
    ON CONFLICT(stream) DO UPDATE SET last_seq = excluded.last_seq";
const SQL_SENDABLE: &str = "SELECT e.id, e.event_id, e.stream, p.payload, e.digest
    FROM events e JOIN payloads p ON p.id = e.id
    WHERE e.state IN ('PENDING','SENT') AND e.id > ?1 ORDER BY e.id LIMIT ?2";
const SQL_MARK_SENT: &str = "UPDATE events SET state = 'SENT', attempts = attempts + 1,
    last_attempt_ms = ?2, next_retry_ms = ?3 WHERE id = ?1 AND state IN ('PENDING','SENT')";
const SQL_RETIRE: &str = "UPDATE events SET state = 'ACKED', acked_ms = ?2
    WHERE id = ?1 AND state IN ('PENDING','SENT')";
const SQL_RETIRE_ATTEMPT: &str = "UPDATE events SET state = 'ACKED', acked_ms = ?2,
    attempts = attempts + ?3, last_attempt_ms = CASE WHEN ?3 > 0 THEN ?2 ELSE last_attempt_ms END
    WHERE id = ?1 AND state IN ('PENDING','SENT')";
const SQL_FAIL: &str = "UPDATE events SET state = 'FAILED', fail_reason = ?2
    WHERE id = ?1 AND state IN ('PENDING','SENT')";
const SQL_PURGE_PAYLOADS: &str = "DELETE FROM payloads WHERE id IN (
    SELECT id FROM events WHERE state = 'ACKED' AND acked_ms < ?1 ORDER BY id LIMIT ?2)";
const SQL_PURGE: &str = "DELETE FROM events WHERE id IN (
    SELECT id FROM events WHERE state = 'ACKED' AND acked_ms < ?1 ORDER BY id LIMIT ?2)";
const SQL_COUNTER_ADD: &str = "INSERT INTO counters (name, value) VALUES (?1, ?2)
    ON CONFLICT(name) DO UPDATE SET value = value + excluded.value";

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

/// One reading to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// Stream (source name).
    pub stream: String,
    /// Unix ms.
    pub ts_ms: i64,
    /// Whether the wall clock was trusted.
    pub clock_trusted: bool,
    /// The fields.
    pub fields: Fields,
}

/// A row to publish.
#[derive(Debug, Clone)]
pub struct OutRow {
    /// Row id (spool-local).
    pub id: i64,
    /// Event id (string form).
    pub event_id: String,
    /// Stream.
    pub stream: String,
    /// The stored payload bytes, sent unchanged on every attempt.
    pub payload: Vec<u8>,
    /// sha256 of `payload` as stored at append.
    pub digest: Vec<u8>,
}

impl OutRow {
    /// True when the payload still hashes to the digest stored at append (I3).
    pub fn digest_ok(&self) -> bool {
        Sha256::digest(&self.payload).as_slice() == self.digest.as_slice()
    }
}

/// Result of one `PRAGMA wal_checkpoint` (<https://www.sqlite.org/pragma.html#pragma_wal_checkpoint>).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointResult {
    /// 1 when the checkpoint could not finish (a reader or writer was in the way).
    pub busy: i64,
    /// Frames in the WAL.
    pub log_frames: i64,
    /// Frames copied back into the database.
    pub checkpointed_frames: i64,
}

/// Checkpoint modes the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointMode {
    /// Copy what it can without waiting for readers or writers.
    Passive,
    /// Copy everything and truncate the WAL to zero bytes; waits for writers.
    Truncate,
}

/// Counts for `status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    /// Rows by (stream, state).
    pub by_stream_state: Vec<(String, String, i64)>,
    /// Age of the oldest unacknowledged row, ms (by creation wall time).
    pub oldest_unacked_age_ms: Option<i64>,
    /// Size of the `-wal` file, bytes.
    pub wal_bytes: u64,
    /// Size of the database file, bytes.
    pub db_bytes: u64,
    /// Persistent counters (drops by reason and the like).
    pub counters: Vec<(String, i64)>,
}

/// A recorded agent run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunRecord {
    /// Run id.
    pub id: i64,
    /// Unix ms.
    pub started_ms: i64,
    /// Unix ms; `None` while running or after a kill.
    pub ended_ms: Option<i64>,
    /// Process id.
    pub pid: i64,
    /// Agent version.
    pub version: String,
    /// `ok`, `error`, `killed (no clean stop recorded)`, or `None` while running.
    pub exit_status: Option<String>,
    /// Error text for a failed run.
    pub error: Option<String>,
}

/// An open spool connection.
pub struct Spool {
    pub(crate) conn: Connection,
    path: PathBuf,
    pragmas: EffectivePragmas,
    /// Last sequence number per stream (ingest connection only).
    seqs: HashMap<String, i64>,
}

impl std::fmt::Debug for Spool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spool").field("path", &self.path).finish()
    }
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
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(err)?;
        conn.busy_timeout(opts.busy_timeout).map_err(err)?;
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
        let mut spool = Spool {
            conn,
            path: path.to_path_buf(),
            pragmas,
            seqs: HashMap::new(),
        };
        spool.migrate()?;
        spool.load_seqs()?;
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
        let pragmas = read_pragmas(&conn).map_err(err)?;
        Ok(Spool {
            conn,
            path: path.to_path_buf(),
            pragmas,
            seqs: HashMap::new(),
        })
    }

    /// `PRAGMA user_version` of the open file.
    pub fn schema_version(&self) -> Result<i64, SpoolError> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }

    /// Run `f` inside one `BEGIN IMMEDIATE` transaction: every write of the
    /// spool but the schema migration and the ingest append (which keep
    /// their own, equally IMMEDIATE) goes through here, so none can hit the
    /// deferred read→write upgrade that fails with SQLITE_BUSY without waiting
    /// for `busy_timeout` (F03). `f` gets the transaction and this spool's
    /// error classifier; Ok commits, Err rolls back.
    pub(crate) fn write<T>(
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

    fn err(&self, e: rusqlite::Error) -> SpoolError {
        SpoolError::classify(&self.path, e)
    }

    fn migrate(&mut self) -> Result<(), SpoolError> {
        let path = self.path.clone();
        let err = |e| SpoolError::classify(&path, e);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        let version: i64 = tx
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        if version > SCHEMA_VERSION {
            return Err(SpoolError::NewerSchema {
                path: path.clone(),
                found: version,
            });
        }
        if version < 1 {
            tx.execute_batch(MIGRATION_1).map_err(err)?;
        }
        if version < 2 {
            tx.execute_batch(MIGRATION_2).map_err(err)?;
        }
        if version < 3 {
            tx.execute_batch(MIGRATION_3).map_err(err)?;
        }
        if version < 4 {
            tx.execute_batch(MIGRATION_4).map_err(err)?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .map_err(err)?;
        tx.commit().map_err(err)
    }

    fn load_seqs(&mut self) -> Result<(), SpoolError> {
        let mut stmt = self
            .conn
            .prepare("SELECT stream, last_seq FROM stream_seq")
            .map_err(|e| SpoolError::classify(&self.path, e))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
            .map_err(|e| SpoolError::classify(&self.path, e))?;
        let mut seqs = HashMap::new();
        for row in rows {
            let (s, n) = row.map_err(|e| SpoolError::classify(&self.path, e))?;
            seqs.insert(s, n);
        }
        drop(stmt);
        self.seqs = seqs;
        Ok(())
    }

    /// The spool file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pragmas as read back at open.
    pub fn pragmas(&self) -> &EffectivePragmas {
        &self.pragmas
    }

    /// Append `events` in one IMMEDIATE transaction: each gets the next
    /// sequence number of its stream, a fresh event id, its payload encoded
    /// once, and a sha256 digest of that payload. All or nothing.
    ///
    /// Returns the number of rows appended. Errors: classified SQLite errors
    /// (nothing is appended); an event whose encoding fails is skipped and
    /// counted under `readings_unencodable`.
    pub fn append(
        &mut self,
        events: &[NewEvent],
        ids: &mut EventIdGen,
        device_id: &str,
        format: Format,
        now_ms: i64,
    ) -> Result<usize, SpoolError> {
        let path = self.path.clone();
        let err = |e| SpoolError::classify(&path, e);
        let mut next: HashMap<String, i64> = HashMap::new();
        let mut appended = 0usize;
        let mut unencodable = 0i64;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        {
            let mut insert = tx.prepare_cached(SQL_INSERT_EVENT).map_err(err)?;
            let mut insert_payload = tx.prepare_cached(SQL_INSERT_PAYLOAD).map_err(err)?;
            for ev in events {
                let seq = next
                    .get(&ev.stream)
                    .or_else(|| self.seqs.get(&ev.stream))
                    .copied()
                    .unwrap_or(0)
                    + 1;
                let event_id = ids.next_id();
                let env = Envelope {
                    event_id,
                    device_id,
                    stream: &ev.stream,
                    seq: seq as u64,
                    ts_ms: ev.ts_ms,
                    clock_trusted: ev.clock_trusted,
                    fields: &ev.fields,
                };
                let payload = match envelope::encode(format, &env) {
                    Ok(p) => p,
                    Err(e) => {
                        log::warn!("stream {}: reading not encodable, skipped: {e}", ev.stream);
                        unencodable += 1;
                        continue;
                    }
                };
                let digest = Sha256::digest(&payload);
                insert
                    .execute(params![
                        event_id.hyphenated(),
                        ev.stream,
                        seq,
                        digest.as_slice(),
                        now_ms
                    ])
                    .map_err(err)?;
                insert_payload
                    .execute(params![tx.last_insert_rowid(), payload])
                    .map_err(err)?;
                next.insert(ev.stream.clone(), seq);
                appended += 1;
            }
            let mut upsert = tx.prepare_cached(SQL_UPSERT_SEQ).map_err(err)?;
            for (stream, seq) in &next {
                upsert.execute(params![stream, seq]).map_err(err)?;
            }
            if unencodable > 0 {
                tx.execute(
                    SQL_COUNTER_ADD,
                    params!["readings_unencodable", unencodable],
                )
                .map_err(err)?;
            }
        }
        tx.commit().map_err(err)?;
        // Only after the commit: a rolled-back batch must not advance the sequence.
        self.seqs.extend(next);
        Ok(appended)
    }

    /// Up to `limit` unacknowledged rows (`PENDING` or `SENT`) with row id
    /// greater than `after_id`, in row-id order, which is sequence order
    /// within each stream (I7). Holds no statement or transaction afterwards.
    pub fn sendable(&self, after_id: i64, limit: usize) -> Result<Vec<OutRow>, SpoolError> {
        let mut stmt = self
            .conn
            .prepare_cached(SQL_SENDABLE)
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![after_id, limit as i64], |r| {
                Ok(OutRow {
                    id: r.get(0)?,
                    event_id: r.get(1)?,
                    stream: r.get(2)?,
                    payload: r.get(3)?,
                    digest: r.get(4)?,
                })
            })
            .map_err(|e| self.err(e))?;
        let mut out = Vec::with_capacity(limit);
        for r in rows {
            out.push(r.map_err(|e| self.err(e))?);
        }
        Ok(out)
    }

    /// Record a publish attempt for `ids`: state `SENT`, attempts + 1, last
    /// attempt `now_ms`, next retry `now_ms + retry_after_ms`. One IMMEDIATE
    /// transaction. Acknowledged rows are left alone.
    pub fn mark_sent(
        &mut self,
        ids: &[i64],
        now_ms: i64,
        retry_after_ms: i64,
    ) -> Result<(), SpoolError> {
        if ids.is_empty() {
            return Ok(());
        }
        self.write(|tx, err| {
            {
                let mut stmt = tx.prepare_cached(SQL_MARK_SENT).map_err(err)?;
                for id in ids {
                    stmt.execute(params![id, now_ms, now_ms + retry_after_ms])
                        .map_err(err)?;
                }
            }
            Ok(())
        })
    }

    /// Retire `ids` (state `ACKED`, `acked_ms = now_ms`): call only with rows
    /// whose PUBACK arrived (I2). One IMMEDIATE transaction. Returns how many
    /// rows changed state (a row already ACKED or deleted is not counted).
    pub fn retire(&mut self, ids: &[i64], now_ms: i64) -> Result<usize, SpoolError> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.write(|tx, err| {
            let mut changed = 0;
            {
                let mut stmt = tx.prepare_cached(SQL_RETIRE).map_err(err)?;
                for id in ids {
                    changed += stmt.execute(params![id, now_ms]).map_err(err)?;
                }
            }
            Ok(changed)
        })
    }

    /// [`Spool::mark_sent`] and [`Spool::retire`] in one IMMEDIATE
    /// transaction (the delivery thread's group commit). Attempts are recorded
    /// first, so a row acknowledged in the same batch still ends `ACKED`.
    /// Returns the number of rows retired.
    pub fn record_delivery(
        &mut self,
        sent: &[i64],
        acked: &[i64],
        now_ms: i64,
        retry_after_ms: i64,
    ) -> Result<usize, SpoolError> {
        if sent.is_empty() && acked.is_empty() {
            return Ok(0);
        }
        self.write(|tx, err| {
            let mut retired = 0;
            {
                // A row sent and acknowledged within one batch takes one UPDATE
                // (its attempt counted there), not two.
                let acked_set: std::collections::HashSet<i64> = acked.iter().copied().collect();
                let sent_set: std::collections::HashSet<i64> = sent.iter().copied().collect();
                let mut mark = tx.prepare_cached(SQL_MARK_SENT).map_err(err)?;
                for id in sent.iter().filter(|id| !acked_set.contains(id)) {
                    mark.execute(params![id, now_ms, now_ms + retry_after_ms])
                        .map_err(err)?;
                }
                let mut retire = tx.prepare_cached(SQL_RETIRE_ATTEMPT).map_err(err)?;
                for id in acked {
                    let attempt = i64::from(sent_set.contains(id));
                    retired += retire.execute(params![id, now_ms, attempt]).map_err(err)?;
                }
            }
            Ok(retired)
        })
    }

    /// Mark row `id` `FAILED` with `reason` and count it under
    /// `events_failed_<counter>`. Terminal until an operator requeues it.
    pub fn mark_failed(&mut self, id: i64, reason: &str, counter: &str) -> Result<(), SpoolError> {
        self.write(|tx, err| {
            tx.execute(SQL_FAIL, params![id, reason]).map_err(err)?;
            tx.execute(
                SQL_COUNTER_ADD,
                params![format!("events_failed_{counter}"), 1],
            )
            .map_err(err)?;
            Ok(())
        })
    }

    /// Put `FAILED` rows (of `stream`, or all) back to `PENDING` (operator
    /// action). Returns how many.
    pub fn requeue_failed(&mut self, stream: Option<&str>) -> Result<usize, SpoolError> {
        self.write(|tx, err| {
            let n = tx
                .execute(
                    "UPDATE events SET state = 'PENDING', fail_reason = NULL
                     WHERE state = 'FAILED' AND (?1 IS NULL OR stream = ?1)",
                    params![stream],
                )
                .map_err(err)?;
            Ok(n)
        })
    }

    /// Live and free space inside the file, bytes: `(page_count -
    /// freelist_count) * page_size` and `freelist_count * page_size`.
    pub fn usage(&self) -> Result<(u64, u64), SpoolError> {
        let q = |sql: &str| {
            self.conn
                .query_row(sql, [], |r| r.get::<_, i64>(0))
                .map_err(|e| self.err(e))
        };
        let (pages, free, size) = (
            q("PRAGMA page_count")?,
            q("PRAGMA freelist_count")?,
            q("PRAGMA page_size")?,
        );
        Ok((
            ((pages - free).max(0) * size) as u64,
            (free.max(0) * size) as u64,
        ))
    }

    /// Record one piece of agent state for `status` (health, last checkpoint, ...).
    pub fn set_state(&mut self, key: &str, value: &str, now_ms: i64) -> Result<(), SpoolError> {
        self.conn
            .execute(
                "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms",
                params![key, value, now_ms],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// All recorded agent state: `(key, value, updated_ms)`, by key.
    pub fn states(&self) -> Result<Vec<(String, String, i64)>, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let mut stmt = self
            .conn
            .prepare_cached("SELECT key, value, updated_ms FROM agent_state ORDER BY key")
            .map_err(e)?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        Ok(rows)
    }

    /// Add several counter increments in one IMMEDIATE transaction.
    pub fn count_many(&mut self, counts: &[(String, i64)]) -> Result<(), SpoolError> {
        self.write(|tx, err| {
            {
                let mut st = tx.prepare_cached(SQL_COUNTER_ADD).map_err(err)?;
                for (name, by) in counts {
                    st.execute(params![name, by]).map_err(err)?;
                }
            }
            Ok(())
        })
    }

    /// Add `by` to the persistent counter `name`.
    pub fn count(&mut self, name: &str, by: i64) -> Result<(), SpoolError> {
        self.conn
            .execute(SQL_COUNTER_ADD, params![name, by])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Delete at most `batch` `ACKED` rows acknowledged before `cutoff_ms`,
    /// in one IMMEDIATE transaction. Never touches `PENDING`, `SENT` or
    /// `FAILED` rows. Returns the number deleted; call again until 0, with a
    /// checkpoint in between, so a large purge never balloons the WAL (F02).
    pub fn purge_acked(&mut self, cutoff_ms: i64, batch: usize) -> Result<usize, SpoolError> {
        self.write(|tx, err| {
            tx.execute(SQL_PURGE_PAYLOADS, params![cutoff_ms, batch as i64])
                .map_err(err)?;
            let n = tx
                .execute(SQL_PURGE, params![cutoff_ms, batch as i64])
                .map_err(err)?;
            if n > 0 {
                tx.execute(SQL_COUNTER_ADD, params!["events_purged_acked", n as i64])
                    .map_err(err)?;
            }
            Ok(n)
        })
    }

    /// Run `PRAGMA wal_checkpoint(mode)`. A busy result is reported, not an error.
    pub fn checkpoint(&self, mode: CheckpointMode) -> Result<CheckpointResult, SpoolError> {
        let sql = match mode {
            CheckpointMode::Passive => "PRAGMA wal_checkpoint(PASSIVE)",
            CheckpointMode::Truncate => "PRAGMA wal_checkpoint(TRUNCATE)",
        };
        self.conn
            .query_row(sql, [], |r| {
                Ok(CheckpointResult {
                    busy: r.get(0)?,
                    log_frames: r.get(1)?,
                    checkpointed_frames: r.get(2)?,
                })
            })
            .map_err(|e| self.err(e))
    }

    /// Counts for `status`.
    pub fn stats(&self, now_ms: i64) -> Result<Stats, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT stream, state, count(*) FROM events GROUP BY stream, state ORDER BY stream, state",
            )
            .map_err(e)?;
        let by = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        let oldest: Option<i64> = self
            .conn
            .query_row(
                "SELECT min(created_ms) FROM events WHERE state IN ('PENDING','SENT')",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(e)?
            .flatten();
        let mut cstmt = self
            .conn
            .prepare_cached("SELECT name, value FROM counters ORDER BY name")
            .map_err(e)?;
        let counters = cstmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        Ok(Stats {
            by_stream_state: by,
            oldest_unacked_age_ms: oldest.map(|c| (now_ms - c).max(0)),
            wal_bytes: file_len(&wal_path(&self.path)),
            db_bytes: file_len(&self.path),
            counters,
        })
    }

    /// Record the start of an agent run; first marks any earlier run that has
    /// no end as killed (the process died without a clean stop). Returns the run id.
    pub fn begin_run(&mut self, now_ms: i64, pid: u32, version: &str) -> Result<i64, SpoolError> {
        self.write(|tx, err| {
            tx.execute(
                "UPDATE runs SET exit_status = 'killed (no clean stop recorded)' WHERE ended_ms IS NULL AND exit_status IS NULL",
                [],
            )
            .map_err(err)?;
            tx.execute(
                "INSERT INTO runs (started_ms, pid, version) VALUES (?1, ?2, ?3)",
                params![now_ms, pid, version],
            )
            .map_err(err)?;
            let id = tx.last_insert_rowid();
            Ok(id)
        })
    }

    /// Record the end of run `id` with `exit_status` (`ok` or `error`) and optional error text.
    pub fn end_run(
        &mut self,
        id: i64,
        now_ms: i64,
        exit_status: &str,
        error: Option<&str>,
    ) -> Result<(), SpoolError> {
        self.conn
            .execute(
                "UPDATE runs SET ended_ms = ?2, exit_status = ?3, error = ?4 WHERE id = ?1",
                params![id, now_ms, exit_status, error],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// The newest `limit` runs, newest first.
    pub fn runs(&self, limit: usize) -> Result<Vec<RunRecord>, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT id, started_ms, ended_ms, pid, version, exit_status, error FROM runs ORDER BY id DESC LIMIT ?1",
            )
            .map_err(e)?;
        let rows = stmt
            .query_map(params![limit as i64], |r| {
                Ok(RunRecord {
                    id: r.get(0)?,
                    started_ms: r.get(1)?,
                    ended_ms: r.get(2)?,
                    pid: r.get(3)?,
                    version: r.get(4)?,
                    exit_status: r.get(5)?,
                    error: r.get(6)?,
                })
            })
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        Ok(rows)
    }

    /// `PRAGMA quick_check` result (`ok` when healthy).
    pub fn quick_check(&self) -> Result<String, SpoolError> {
        self.conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }
}

fn read_pragmas(conn: &Connection) -> rusqlite::Result<EffectivePragmas> {
    let q = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0));
    Ok(EffectivePragmas {
        journal_mode: conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?,
        synchronous: q("PRAGMA synchronous")?,
        busy_timeout_ms: q("PRAGMA busy_timeout")?,
        journal_size_limit: q("PRAGMA journal_size_limit")?,
        wal_autocheckpoint: q("PRAGMA wal_autocheckpoint")?,
    })
}

/// Append one event inside the caller's transaction `tx`, reading and
/// advancing its stream's sequence in the `stream_seq` table (not the ingest
/// connection's cache: used for streams only one other connection writes,
/// such as command results). Returns the event id.
pub(crate) fn insert_one(
    tx: &rusqlite::Transaction<'_>,
    path: &Path,
    ev: &NewEvent,
    ids: &mut EventIdGen,
    device_id: &str,
    format: Format,
    now_ms: i64,
) -> Result<String, SpoolError> {
    let err = |e| SpoolError::classify(path, e);
    let last: i64 = tx
        .query_row(
            "SELECT last_seq FROM stream_seq WHERE stream = ?1",
            params![ev.stream],
            |r| r.get(0),
        )
        .optional()
        .map_err(err)?
        .unwrap_or(0);
    let seq = last + 1;
    let event_id = ids.next_id();
    let env = Envelope {
        event_id,
        device_id,
        stream: &ev.stream,
        seq: seq as u64,
        ts_ms: ev.ts_ms,
        clock_trusted: ev.clock_trusted,
        fields: &ev.fields,
    };
    let payload = envelope::encode(format, &env).map_err(|e| SpoolError::Encode {
        path: path.to_path_buf(),
        detail: e,
    })?;
    let digest = Sha256::digest(&payload);
    let id = event_id.hyphenated();
    tx.prepare_cached(SQL_INSERT_EVENT)
        .map_err(err)?
        .execute(params![id, ev.stream, seq, digest.as_slice(), now_ms])
        .map_err(err)?;
    tx.prepare_cached(SQL_INSERT_PAYLOAD)
        .map_err(err)?
        .execute(params![tx.last_insert_rowid(), payload])
        .map_err(err)?;
    tx.prepare_cached(SQL_UPSERT_SEQ)
        .map_err(err)?
        .execute(params![ev.stream, seq])
        .map_err(err)?;
    Ok(id)
}

/// The `-wal` file beside a database.
pub fn wal_path(db: &Path) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push("-wal");
    PathBuf::from(s)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::FieldValue;

    fn ev(stream: &str, x: f64) -> NewEvent {
        NewEvent {
            stream: stream.into(),
            ts_ms: 1,
            clock_trusted: true,
            fields: vec![("x".into(), FieldValue::Num(x))],
        }
    }

    fn open(dir: &Path) -> Spool {
        Spool::open(&dir.join("spool.db"), &SpoolOptions::default()).unwrap()
    }

    #[test]
    fn open_puts_the_spool_in_wal_mode_and_reads_pragmas_back() {
        let d = tempfile::tempdir().unwrap();
        let s = open(d.path());
        let p = s.pragmas();
        assert_eq!(p.journal_mode, "wal");
        assert_eq!(p.synchronous, 1);
        assert_eq!(p.busy_timeout_ms, 5000);
        assert_eq!(p.journal_size_limit, 4 * 1024 * 1024);
    }

    #[test]
    fn a_rollback_journal_database_is_converted_to_wal() {
        // field case F07 (b): a spool created in DELETE mode by an older build.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        {
            let c = Connection::open(&path).unwrap();
            let m: String = c
                .query_row("PRAGMA journal_mode=DELETE", [], |r| r.get(0))
                .unwrap();
            assert_eq!(m, "delete");
            c.execute_batch("CREATE TABLE t(x)").unwrap();
        }
        let s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        assert_eq!(s.pragmas().journal_mode, "wal");
    }

    #[test]
    fn sequences_are_per_stream_and_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        {
            let mut s = open(d.path());
            s.append(
                &[ev("a", 1.0), ev("b", 2.0), ev("a", 3.0)],
                &mut ids,
                "d",
                Format::Json,
                0,
            )
            .unwrap();
        }
        let mut s = open(d.path());
        s.append(&[ev("a", 4.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let rows = s.sendable(0, 10).unwrap();
        let seqs: Vec<(String, i64)> = rows
            .iter()
            .map(|r| {
                let v: serde_json::Value = serde_json::from_slice(&r.payload).unwrap();
                (r.stream.clone(), v["seq"].as_i64().unwrap())
            })
            .collect();
        assert_eq!(
            seqs,
            vec![
                ("a".into(), 1),
                ("b".into(), 1),
                ("a".into(), 2),
                ("a".into(), 3)
            ]
        );
        assert!(rows.iter().all(|r| r.digest_ok()));
    }

    #[test]
    fn only_retire_makes_a_row_acked_and_purge_only_removes_acked_rows() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        s.append(
            &[ev("a", 1.0), ev("a", 2.0), ev("a", 3.0)],
            &mut ids,
            "d",
            Format::Json,
            0,
        )
        .unwrap();
        let rows = s.sendable(0, 10).unwrap();
        s.mark_sent(&[rows[0].id, rows[1].id], 10, 1000).unwrap();
        assert_eq!(s.retire(&[rows[0].id], 20).unwrap(), 1);
        // Retiring twice changes nothing.
        assert_eq!(s.retire(&[rows[0].id], 21).unwrap(), 0);
        // Purge with a cutoff far in the future removes only the ACKED row.
        assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 1);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![rows[1].id, rows[2].id]);
        // mark_sent on an acked row does not resurrect it.
        s.retire(&[rows[1].id], 30).unwrap();
        s.mark_sent(&[rows[1].id], 40, 1000).unwrap();
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![rows[2].id]);
    }

    #[test]
    fn record_delivery_marks_attempts_then_retires_in_one_transaction() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        s.append(
            &[ev("a", 1.0), ev("a", 2.0)],
            &mut ids,
            "d",
            Format::Json,
            0,
        )
        .unwrap();
        let rows = s.sendable(0, 10).unwrap();
        let (a, b) = (rows[0].id, rows[1].id);
        assert_eq!(s.record_delivery(&[a, b], &[a], 5, 100).unwrap(), 1);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![b]);
        let (state, attempts): (String, i64) = s
            .conn
            .query_row(
                "SELECT state, attempts FROM events WHERE id = ?1",
                [b],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((state.as_str(), attempts), ("SENT", 1));
        let (state, attempts): (String, i64) = s
            .conn
            .query_row(
                "SELECT state, attempts FROM events WHERE id = ?1",
                [a],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((state.as_str(), attempts), ("ACKED", 1));
    }

    #[test]
    fn row_ids_are_never_reused_after_retention() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        s.append(
            &[ev("a", 1.0), ev("a", 2.0)],
            &mut ids,
            "d",
            Format::Json,
            0,
        )
        .unwrap();
        let rows = s.sendable(0, 10).unwrap();
        let top = rows[1].id;
        s.retire(&[rows[0].id, top], 1).unwrap();
        assert_eq!(s.purge_acked(i64::MAX, 10).unwrap(), 2);
        s.append(&[ev("a", 3.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let next = s.sendable(0, 10).unwrap()[0].id;
        assert!(next > top, "id {next} reused (top was {top})");
    }

    #[test]
    fn a_schema_1_spool_is_migrated_and_keeps_its_rows_and_payloads() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        {
            let c = Connection::open(&path).unwrap();
            let m: String = c
                .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
                .unwrap();
            assert_eq!(m, "wal");
            c.execute_batch(&MIGRATION_1.replace("AUTOINCREMENT", ""))
                .unwrap();
            // Schema 1 kept the payload in the events row.
            c.execute_batch(
                "INSERT INTO events (id, event_id, stream, seq, payload, digest, state, created_ms)
                 VALUES (7, 'e7', 'a', 1, x'00', x'00', 'PENDING', 0); PRAGMA user_version = 1;",
            )
            .unwrap();
        }
        let s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        let sql: String = s
            .conn
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'events'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(sql.contains("AUTOINCREMENT"));
        let rows = s.sendable(0, 10).unwrap();
        assert_eq!(rows[0].id, 7);
        assert_eq!(rows[0].payload, vec![0u8]);
    }

    #[test]
    fn purge_is_bounded_per_batch() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        let evs: Vec<NewEvent> = (0..25).map(|i| ev("a", i as f64)).collect();
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
        let all: Vec<i64> = s.sendable(0, 100).unwrap().iter().map(|r| r.id).collect();
        s.retire(&all, 5).unwrap();
        assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
        assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
        assert_eq!(s.purge_acked(6, 10).unwrap(), 5);
        assert_eq!(s.purge_acked(6, 10).unwrap(), 0);
    }

    #[test]
    fn a_second_connection_writes_while_the_first_holds_no_transaction() {
        // Two real connections on one file, as the agent runs them.
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut a = open(d.path());
        let mut b = open(d.path());
        a.append(&[ev("a", 1.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let rows = b.sendable(0, 10).unwrap();
        b.retire(&[rows[0].id], 1).unwrap();
        a.append(&[ev("a", 2.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        assert_eq!(b.sendable(0, 10).unwrap().len(), 1);
        // No agent statement pins the WAL: a TRUNCATE checkpoint completes.
        let c = a.checkpoint(CheckpointMode::Truncate).unwrap();
        assert_eq!(c.busy, 0);
    }

    #[test]
    fn immediate_write_waits_for_another_writer_instead_of_failing_busy() {
        // field case F03: an external writer holds the write lock for a while.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        let mut ids = EventIdGen::new().unwrap();
        let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        s.append(&[ev("a", 1.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let holder = std::thread::spawn({
            let path = path.clone();
            move || {
                let c = Connection::open(&path).unwrap();
                c.execute_batch("BEGIN IMMEDIATE; UPDATE counters SET value = value;")
                    .unwrap();
                std::thread::sleep(Duration::from_millis(700));
                c.execute_batch("COMMIT").unwrap();
            }
        });
        std::thread::sleep(Duration::from_millis(100));
        // A read snapshot first (as a deferred transaction would take), then the write.
        let _ = s.sendable(0, 10).unwrap();
        s.append(&[ev("a", 2.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        holder.join().unwrap();
        assert_eq!(s.sendable(0, 10).unwrap().len(), 2);
    }

    #[test]
    fn damaged_file_is_reported_as_corrupt() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        std::fs::write(&path, vec![0x42u8; 8192]).unwrap();
        match Spool::open(&path, &SpoolOptions::default()) {
            Err(SpoolError::Corrupt { .. }) => {}
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }

    #[test]
    fn runs_are_recorded_and_an_unended_run_is_marked_killed() {
        let d = tempfile::tempdir().unwrap();
        let mut s = open(d.path());
        let r1 = s.begin_run(1, 10, "v").unwrap();
        let r2 = s.begin_run(2, 11, "v").unwrap();
        s.end_run(r2, 3, "ok", None).unwrap();
        let runs = s.runs(10).unwrap();
        assert_eq!(runs[0].id, r2);
        assert_eq!(runs[0].exit_status.as_deref(), Some("ok"));
        assert_eq!(runs[1].id, r1);
        assert_eq!(
            runs[1].exit_status.as_deref(),
            Some("killed (no clean stop recorded)")
        );
    }
}
