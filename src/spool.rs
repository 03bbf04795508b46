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

mod keys;
pub mod priority;

use crate::envelope::{self, Envelope, EventIdGen, Format};
use crate::reading::Fields;
use crate::reading::ReplayPosition;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 8;

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

/// Schema 5: what one reading costs on flash (issue: flash writes within 1.5x
/// of the minimum). A reading is one row in one append-only table with its
/// payload inline and no secondary index, so an append dirties the table's
/// rightmost leaf and nothing else. Delivery state is not a column:
/// - `delivery_mark.acked_through`: every row with a smaller or equal id is
///   acknowledged or FAILED (a high-water mark, moved only by
///   [`Spool::retire`] over rows whose PUBACK arrived);
/// - `acked_above`: rows acknowledged out of order above the mark (few);
/// - `failed`: rows FAILED by policy, with the reason;
/// - `delivery_mark.sent_through`: the highest row id ever submitted (rows at
///   or below it that are not acknowledged show as SENT).
///
/// Sequence numbers live in `streams.last_seq`, written lazily (see
/// [`Spool::persist_seqs`]); at open the rows above `spool_meta.seq_through_id`
/// are scanned to catch up. Row ids are never reused because retention never
/// deletes the row with the highest id (<https://www.sqlite.org/autoinc.html>:
/// a new rowid is one more than the largest in the table).
const MIGRATION_5: &str = "
CREATE TABLE streams (
    id       INTEGER PRIMARY KEY,
    name     TEXT    NOT NULL UNIQUE,
    last_seq INTEGER NOT NULL
);
INSERT INTO streams (name, last_seq) SELECT stream, last_seq FROM stream_seq;
INSERT OR IGNORE INTO streams (name, last_seq) SELECT stream, max(seq) FROM events GROUP BY stream;
CREATE TABLE delivery_mark (
    one            INTEGER PRIMARY KEY CHECK (one = 1),
    acked_through  INTEGER NOT NULL,
    sent_through   INTEGER NOT NULL
);
INSERT INTO delivery_mark VALUES (1,
    coalesce((SELECT min(id) - 1 FROM events WHERE state IN ('PENDING','SENT')),
             (SELECT max(id) FROM events), 0),
    coalesce((SELECT max(id) FROM events WHERE state <> 'PENDING'), 0));
CREATE TABLE acked_above (id INTEGER PRIMARY KEY);
INSERT INTO acked_above SELECT id FROM events
    WHERE state = 'ACKED' AND id > (SELECT acked_through FROM delivery_mark);
CREATE TABLE failed (
    id        INTEGER PRIMARY KEY,
    reason    TEXT    NOT NULL,
    failed_ms INTEGER NOT NULL
);
INSERT INTO failed SELECT id, coalesce(fail_reason, ''), coalesce(last_attempt_ms, created_ms)
    FROM events WHERE state = 'FAILED';
CREATE TABLE spool_meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE events_v5 (
    id         INTEGER PRIMARY KEY,
    stream_id  INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    event_id   TEXT    NOT NULL,
    created_ms INTEGER NOT NULL,
    digest     BLOB    NOT NULL,
    payload    BLOB    NOT NULL
);
INSERT INTO events_v5 SELECT e.id, s.id, e.seq, e.event_id, e.created_ms, e.digest, p.payload
    FROM events e JOIN streams s ON s.name = e.stream JOIN payloads p ON p.id = e.id;
INSERT INTO spool_meta VALUES ('seq_through_id', coalesce((SELECT max(id) FROM events_v5), 0));
DROP TABLE events;
DROP TABLE payloads;
DROP TABLE stream_seq;
ALTER TABLE events_v5 RENAME TO events;
CREATE VIEW event_states AS
SELECT e.id, e.event_id, s.name AS stream, e.seq, e.created_ms, e.payload, e.digest,
    CASE WHEN f.id IS NOT NULL THEN 'FAILED'
         WHEN e.id <= m.acked_through OR a.id IS NOT NULL THEN 'ACKED'
         WHEN e.id <= m.sent_through THEN 'SENT'
         ELSE 'PENDING' END AS state,
    f.reason AS fail_reason
FROM events e JOIN streams s ON s.id = e.stream_id CROSS JOIN delivery_mark m
    LEFT JOIN acked_above a ON a.id = e.id LEFT JOIN failed f ON f.id = e.id;
";

/// Schema 6: command records carry the agent clock at receipt
/// ([`crate::commands::retention::AgentClock`]), so they are purged by the
/// time the agent has run, never by the wall clock. Records written before
/// have NULL: older than anything stamped since.
const MIGRATION_6: &str = "
ALTER TABLE commands ADD COLUMN received_clock_ms INTEGER;
";

const SQL_INSERT_EVENT: &str = "INSERT INTO events
    (stream_id, seq, event_id, created_ms, digest, payload, prio)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
const SQL_NEW_STREAM: &str =
    "INSERT INTO streams (name, last_seq, prio) VALUES (?1, 0, ?2) ON CONFLICT(name) DO NOTHING";
const SQL_STREAM_BY_NAME: &str = "SELECT id, last_seq, prio FROM streams WHERE name = ?1";
const SQL_SET_SEQ: &str = "UPDATE streams SET last_seq = max(last_seq, ?2) WHERE id = ?1";
/// The append time of the first row above the acknowledged mark that is
/// neither acknowledged out of order nor FAILED.
const SQL_OLDEST_UNACKED: &str = "SELECT e.created_ms FROM events e
    WHERE e.id > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT 1";
/// Unresolved rows (not acknowledged, not FAILED) above `?1`, in id order.
const SQL_SENDABLE: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id > max(?1, (SELECT acked_through FROM delivery_mark))
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT ?2";
/// Rows above the mark with whether each is already resolved, for folding.
const SQL_ABOVE_MARK: &str = "SELECT e.id,
    EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
    OR EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    FROM events e WHERE e.id > ?1 ORDER BY e.id LIMIT ?2";
const SQL_MARK: &str = "SELECT acked_through, sent_through FROM delivery_mark";
const SQL_SET_MARK: &str = "UPDATE delivery_mark SET acked_through = ?1, sent_through = ?2";
const SQL_ACKED_ABOVE: &str = "INSERT OR IGNORE INTO acked_above (id) SELECT ?1
    WHERE EXISTS (SELECT 1 FROM events WHERE id = ?1)";
const SQL_FAIL: &str = "INSERT OR IGNORE INTO failed (id, reason, failed_ms) SELECT ?1, ?2, ?3
    WHERE EXISTS (SELECT 1 FROM events WHERE id = ?1)
      AND ?1 > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above WHERE id = ?1)";
/// Acknowledged rows, oldest first, appended before `?1`; never the newest
/// row (its id keeps new ids above every id ever used) nor a FAILED one.
const SQL_PURGE: &str = "DELETE FROM events WHERE id IN (
    SELECT id FROM events
    WHERE id <= (SELECT acked_through FROM delivery_mark)
      AND id < (SELECT max(id) FROM events)
      AND created_ms < ?1
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = events.id)
    ORDER BY id LIMIT ?2)";
const SQL_PURGE_ABOVE: &str = "DELETE FROM events WHERE id IN (
    SELECT a.id FROM acked_above a JOIN events e ON e.id = a.id
    WHERE e.created_ms < ?1 AND a.id < (SELECT max(id) FROM events)
    ORDER BY a.id LIMIT ?2)";
const SQL_PURGE_ABOVE_INDEX: &str =
    "DELETE FROM acked_above WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.id = acked_above.id)";
const SQL_GET_STATE: &str = "SELECT value FROM agent_state WHERE key = ?1";
const SQL_SET_STATE: &str = "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
    ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms";
const SQL_COUNTER_ADD: &str = "INSERT INTO counters (name, value) VALUES (?1, ?2)
    ON CONFLICT(name) DO UPDATE SET value = value + excluded.value";

/// Sequence numbers are persisted at least every this many appended rows,
/// so a start reads at most this many rows to catch up.
const PERSIST_SEQS_EVERY: u64 = 10_000;

/// Rows folded into the acknowledged mark per query while retiring.
const FOLD_STEP: i64 = 4096;

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
    /// For a row of a replayed trace: where the replay stands after it.
    /// The event id then derives from it ([`envelope::replay_event_id`]),
    /// the append stores it with the row, and a row at or before the
    /// position already stored for the same trace is not appended again.
    pub replay: Option<ReplayPosition>,
    /// Idempotency key from the producer (ingest socket `key`, bridged
    /// message `id_field`). The event id then derives from (device id,
    /// stream, key) ([`envelope::keyed_event_id`]); a keyed reading whose
    /// id is already spooled is not appended again (counted under
    /// `ingest_keys_already_spooled`) and its reply carries that id. Keys
    /// are remembered while their row, or any older row, is in the spool.
    pub key: Option<String>,
    /// Told the outcome once: after the commit, or when refused.
    pub reply: Option<Reply>,
}

impl NewEvent {
    /// A reading with no replay position, key or reply.
    pub fn new(stream: impl Into<String>, ts_ms: i64, clock_trusted: bool, fields: Fields) -> Self {
        NewEvent {
            stream: stream.into(),
            ts_ms,
            clock_trusted,
            fields,
            replay: None,
            key: None,
            reply: None,
        }
    }

    /// Tell the producer this reading was refused (`why`, a sentence naming
    /// the cause); nothing when no one waits.
    pub fn refuse(&self, why: &str) {
        if let Some(r) = &self.reply {
            r.send(Err(why.to_owned()));
        }
    }
}

/// What a producer waiting on a reading learns: `Ok(event id)` (a
/// hyphenated UUID) once the transaction holding it has committed, or
/// `Err(why)` when it was refused (spool or disk full, the in-memory
/// buffer full, not encodable). When the agent stops before committing,
/// the sender is dropped and the receiver's `recv` fails: not stored.
pub type CommitOutcome = Result<String, String>;

/// Where a reading's [`CommitOutcome`] goes (one per reading).
#[derive(Debug, Clone)]
pub struct Reply(std::sync::mpsc::Sender<CommitOutcome>);

impl Reply {
    /// A reply into `tx`.
    pub fn new(tx: std::sync::mpsc::Sender<CommitOutcome>) -> Self {
        Reply(tx)
    }

    /// Send `outcome`; a producer that has gone away is ignored.
    pub fn send(&self, outcome: CommitOutcome) {
        let _ = self.0.send(outcome);
    }
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
    /// Delivery priority of the row (its stream's, [`priority`]).
    pub prio: u8,
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

/// A FAILED row, for `status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FailedRow {
    /// Row id.
    pub id: i64,
    /// Event id.
    pub event_id: String,
    /// Stream.
    pub stream: String,
    /// Why it was marked FAILED.
    pub reason: String,
    /// When, Unix ms.
    pub failed_ms: i64,
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
    /// Sequence numbers issued by [`Spool::append`]; shared by the ingest
    /// connections ([`Spool::share_seqs`]) so each stream has one counter.
    seqs: Arc<Mutex<SeqBook>>,
}

/// Sequence numbers per stream as the ingest connections issue them.
#[derive(Debug, Default)]
struct SeqBook {
    /// Stream id and last sequence number per stream name.
    streams: HashMap<String, StreamSeq>,
    /// Some `last_seq` moved since [`Spool::persist_seqs`].
    dirty: bool,
    /// Rows appended since [`Spool::persist_seqs`].
    appended_since_persist: u64,
    /// The config's priority per stream ([`Spool::set_priorities`]), for
    /// streams first seen after it ran.
    priorities: HashMap<String, u8>,
}

/// A stream's id in `streams` and the last sequence number issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StreamSeq {
    id: i64,
    last_seq: i64,
    /// The stream's delivery priority (`streams.prio`), stamped on each row.
    prio: u8,
}

/// Frames in the WAL after the newest commit on any connection of this
/// process, as reported by SQLite's WAL hook
/// (<https://www.sqlite.org/c3ref/wal_hook.html>).
static WAL_FRAMES: AtomicI64 = AtomicI64::new(0);
/// Frames already copied back by the last checkpoint this process ran.
static WAL_BACKFILLED: AtomicI64 = AtomicI64::new(0);
/// Past this many frames in the WAL, the committing connection runs a
/// PASSIVE checkpoint itself (a brake while the agent's loop is busy);
/// 0 = off. Set by the agent from its checkpoint threshold.
static WAL_BRAKE_FRAMES: AtomicI64 = AtomicI64::new(8192);
/// Commits on every connection of this process (the write budget).
static COMMITS: AtomicU64 = AtomicU64::new(0);

/// Registering this hook turns SQLite's own auto-checkpoint off for the
/// connection (the agent owns checkpoints); it records the WAL's frame count
/// and brakes the WAL with a PASSIVE checkpoint past [`set_wal_brake_frames`].
fn wal_hook(wal: &rusqlite::hooks::Wal, frames: std::os::raw::c_int) -> rusqlite::Result<()> {
    let frames = i64::from(frames);
    if WAL_FRAMES.swap(frames, Ordering::Relaxed) > frames {
        // Fewer frames than before: the WAL restarted from its beginning.
        WAL_BACKFILLED.store(0, Ordering::Relaxed);
    }
    COMMITS.fetch_add(1, Ordering::Relaxed);
    let brake = WAL_BRAKE_FRAMES.load(Ordering::Relaxed);
    if brake > 0 && frames - WAL_BACKFILLED.load(Ordering::Relaxed) >= brake {
        // Busy is not an error here: the agent's own pass retries.
        if let Ok((log, done)) = wal.checkpoint_v2(rusqlite::hooks::CheckpointMode::PASSIVE) {
            note_checkpoint(i64::from(log), i64::from(done));
        }
    }
    Ok(())
}

fn note_checkpoint(log_frames: i64, checkpointed: i64) {
    if log_frames >= 0 && checkpointed >= 0 {
        WAL_FRAMES.store(log_frames, Ordering::Relaxed);
        WAL_BACKFILLED.store(checkpointed, Ordering::Relaxed);
    }
}

/// Frames written to the WAL since the last checkpoint copied them back
/// (not the `-wal` file's length, which `journal_size_limit` keeps at its
/// limit after a reset).
pub fn wal_frames_since_checkpoint() -> u64 {
    let frames = WAL_FRAMES.load(Ordering::Relaxed);
    let done = WAL_BACKFILLED.load(Ordering::Relaxed);
    (frames - done).max(0) as u64
}

/// Commits made by every spool connection of this process since it started.
pub fn commits_total() -> u64 {
    COMMITS.load(Ordering::Relaxed)
}

/// Set the frame count past which a committing connection checkpoints
/// (PASSIVE) on its own; 0 turns the brake off.
pub fn set_wal_brake_frames(frames: i64) {
    WAL_BRAKE_FRAMES.store(frames.max(0), Ordering::Relaxed);
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
        conn.wal_hook(Some(wal_hook));
        let mut spool = Spool {
            conn,
            path: path.to_path_buf(),
            pragmas,
            seqs: Arc::default(),
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
            seqs: Arc::default(),
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
        if version < 5 {
            tx.execute_batch(MIGRATION_5).map_err(err)?;
        }
        if version < 6 {
            tx.execute_batch(MIGRATION_6).map_err(err)?;
        }
        if version < 7 {
            tx.execute_batch(keys::MIGRATION_7).map_err(err)?;
        }
        if version < 8 {
            tx.execute_batch(priority::MIGRATION_8).map_err(err)?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .map_err(err)?;
        tx.commit().map_err(err)?;
        self.convert_to_incremental_vacuum()
    }

    /// A spool created before schema 5 has `auto_vacuum = NONE` and never
    /// gives space back; one VACUUM converts it
    /// (<https://www.sqlite.org/pragma.html#pragma_auto_vacuum>). It needs
    /// free space about the size of the file; if it fails (SQLITE_FULL on a
    /// small disk or temp directory) the spool keeps working as it is and
    /// the next start tries again.
    fn convert_to_incremental_vacuum(&mut self) -> Result<(), SpoolError> {
        let mode: i64 = self
            .conn
            .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        if mode == 2 {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let res = self
            .conn
            .execute_batch("PRAGMA auto_vacuum = INCREMENTAL; VACUUM;");
        match res {
            Ok(()) => {
                log::info!(
                    "spool {}: converted to auto_vacuum=incremental in {} ms (once)",
                    self.path.display(),
                    t.elapsed().as_millis()
                );
                let _ = self.checkpoint(CheckpointMode::Truncate);
            }
            Err(e) => log::warn!(
                "spool {}: could not convert to auto_vacuum=incremental ({e}); the file will not shrink until this succeeds at a later start",
                self.path.display()
            ),
        }
        Ok(())
    }

    /// Sequence numbers per stream: the stored `last_seq`, caught up with the
    /// rows appended since it was last written (only those rows are read, so
    /// the cost does not grow with the spool).
    fn load_seqs(&mut self) -> Result<(), SpoolError> {
        let path = self.path.clone();
        let err = |e| SpoolError::classify(&path, e);
        let mut stmt = self
            .conn
            .prepare(
                "SELECT s.name, s.id, max(s.last_seq, coalesce(t.top, 0)), s.prio FROM streams s
                 LEFT JOIN (SELECT stream_id, max(seq) AS top FROM events
                            WHERE id > coalesce((SELECT value FROM spool_meta
                                                 WHERE key = 'seq_through_id'), 0)
                            GROUP BY stream_id) t ON t.stream_id = s.id",
            )
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    StreamSeq {
                        id: r.get(1)?,
                        last_seq: r.get(2)?,
                        prio: r.get::<_, i64>(3)?.clamp(0, 255) as u8,
                    },
                ))
            })
            .map_err(err)?;
        let mut streams = HashMap::new();
        for row in rows {
            let (name, s) = row.map_err(err)?;
            streams.insert(name, s);
        }
        drop(stmt);
        let mut book = self.book();
        book.dirty = !streams.is_empty();
        book.streams = streams;
        Ok(())
    }

    fn book(&self) -> MutexGuard<'_, SeqBook> {
        // panic = "abort" in release: a poisoned lock only happens in tests.
        self.seqs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Issue sequence numbers from `other`'s book from now on (the ingest
    /// thread's two connections, batched and `synchronous = FULL`, share one
    /// counter per stream, whichever commits a stream's readings).
    pub fn share_seqs(&mut self, other: &Spool) {
        self.seqs = other.seqs.clone();
    }

    /// Write the sequence numbers issued by this connection to `streams`,
    /// and the highest row id they cover, in one IMMEDIATE transaction. Call
    /// every minute or so, before retention and at a clean stop: between two
    /// calls an append writes only its own rows (no `streams` page), and a
    /// restart reads the few rows appended since.
    pub fn persist_seqs(&mut self) -> Result<(), SpoolError> {
        let seqs: Vec<StreamSeq> = {
            let book = self.book();
            if !book.dirty {
                return Ok(());
            }
            book.streams.values().copied().collect()
        };
        self.write(|tx, err| {
            {
                let mut st = tx.prepare_cached(SQL_SET_SEQ).map_err(err)?;
                for s in &seqs {
                    st.execute(params![s.id, s.last_seq]).map_err(err)?;
                }
            }
            tx.execute(
                "INSERT INTO spool_meta (key, value)
                 VALUES ('seq_through_id', coalesce((SELECT max(id) FROM events), 0))
                 ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [],
            )
            .map_err(err)?;
            Ok(())
        })?;
        let mut book = self.book();
        book.dirty = false;
        book.appended_since_persist = 0;
        Ok(())
    }

    /// Rows appended since [`Spool::persist_seqs`] last ran.
    pub fn appended_since_persist(&self) -> u64 {
        self.book().appended_since_persist
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
    /// sequence number of its stream, an event id (fresh, or derived from
    /// its replay position), its payload encoded once, and a sha256 digest
    /// of that payload. All or nothing. The transaction writes the new rows
    /// only (plus a `streams` row the first time a stream appears, and the
    /// replay position of each replayed stream, see [`NewEvent::replay`]):
    /// sequence numbers reach `streams` through [`Spool::persist_seqs`].
    ///
    /// Returns the number of rows appended. Errors: classified SQLite errors
    /// (nothing is appended); an event whose encoding fails is skipped and
    /// counted under `readings_unencodable`; a replayed row already in the
    /// spool is skipped and counted under `replay_rows_already_spooled`.
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
        let seqs = self.seqs.clone();
        let mut book = seqs.lock().unwrap_or_else(|p| p.into_inner());
        // Issued in this transaction; into the book only after the commit,
        // so a rolled-back batch does not advance any sequence.
        let mut next: HashMap<String, StreamSeq> = HashMap::new();
        let mut appended = 0usize;
        let mut unencodable = 0i64;
        let mut marks = ReplayMarks::default();
        // What each reading's producer is told after the commit.
        let mut outcomes: Vec<Option<CommitOutcome>> = vec![None; events.len()];
        let mut keys_already = 0i64;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        {
            let mut insert = tx.prepare_cached(SQL_INSERT_EVENT).map_err(err)?;
            for (ev, outcome) in events.iter().zip(outcomes.iter_mut()) {
                let known = next
                    .get(&ev.stream)
                    .or_else(|| book.streams.get(&ev.stream))
                    .copied();
                let stream = match known {
                    Some(s) => s,
                    None => {
                        let prio = book.priorities.get(&ev.stream).copied();
                        let prio =
                            prio.unwrap_or_else(|| crate::stream::fallback_priority(&ev.stream));
                        stream_row(&tx, &ev.stream, prio).map_err(err)?
                    }
                };
                let event_id = match &ev.replay {
                    Some(pos) => {
                        if !marks.admit(&tx, &ev.stream, pos).map_err(err)? {
                            continue;
                        }
                        envelope::replay_event_id(
                            device_id,
                            &ev.stream,
                            &pos.id_trace(),
                            pos.lap,
                            pos.line,
                        )
                    }
                    None => match &ev.key {
                        Some(key) => {
                            let id = envelope::keyed_event_id(device_id, &ev.stream, key);
                            if keys::spooled(&tx, &id.hyphenated()).map_err(err)? {
                                *outcome = Some(Ok(id.hyphenated()));
                                keys_already += 1;
                                continue;
                            }
                            id
                        }
                        None => ids.next_id(),
                    },
                };
                let seq = stream.last_seq + 1;
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
                        *outcome = Some(Err(format!(
                            "not stored: the reading is not encodable ({e})"
                        )));
                        unencodable += 1;
                        continue;
                    }
                };
                let digest = Sha256::digest(&payload);
                let hyphenated = event_id.hyphenated();
                insert
                    .execute(params![
                        stream.id,
                        seq,
                        hyphenated,
                        now_ms,
                        digest.as_slice(),
                        payload,
                        stream.prio
                    ])
                    .map_err(err)?;
                if ev.key.is_some() {
                    keys::remember(&tx, tx.last_insert_rowid(), &hyphenated).map_err(err)?;
                }
                *outcome = Some(Ok(hyphenated));
                next.insert(
                    ev.stream.clone(),
                    StreamSeq {
                        last_seq: seq,
                        ..stream
                    },
                );
                if let Some(pos) = &ev.replay {
                    marks.appended(&ev.stream, pos);
                }
                appended += 1;
            }
            marks.store(&tx, now_ms).map_err(err)?;
            if unencodable > 0 {
                tx.execute(
                    SQL_COUNTER_ADD,
                    params!["readings_unencodable", unencodable],
                )
                .map_err(err)?;
            }
            if keys_already > 0 {
                tx.execute(
                    SQL_COUNTER_ADD,
                    params!["ingest_keys_already_spooled", keys_already],
                )
                .map_err(err)?;
            }
        }
        tx.commit().map_err(err)?;
        for (ev, outcome) in events.iter().zip(outcomes) {
            if let (Some(reply), Some(outcome)) = (&ev.reply, outcome) {
                reply.send(outcome);
            }
        }
        book.dirty |= !next.is_empty();
        book.appended_since_persist += appended as u64;
        book.streams.extend(next);
        let persist = book.appended_since_persist >= PERSIST_SEQS_EVERY;
        drop(book);
        if persist {
            // Bounds what the next open reads to catch up, whoever appends.
            self.persist_seqs()?;
        }
        Ok(appended)
    }

    /// Up to `limit` unresolved rows (not acknowledged, not FAILED) with row
    /// id greater than `after_id`, in row-id order, which is sequence order
    /// within each stream (I7). Holds no statement or transaction afterwards.
    pub fn sendable(&self, after_id: i64, limit: usize) -> Result<Vec<OutRow>, SpoolError> {
        let mut stmt = self
            .conn
            .prepare_cached(SQL_SENDABLE)
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![after_id, limit as i64], priority::out_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Record a publish attempt for `ids`: the highest becomes the sent mark
    /// (rows at or below it that are not acknowledged show as SENT). One
    /// IMMEDIATE transaction; nothing is retired.
    pub fn mark_sent(&mut self, ids: &[i64]) -> Result<(), SpoolError> {
        self.record_delivery(ids, &[]).map(|_| ())
    }

    /// Retire `ids`: call only with rows whose PUBACK arrived (I2). One
    /// IMMEDIATE transaction. Returns how many rows changed state (a row
    /// already acknowledged, FAILED or deleted is not counted).
    pub fn retire(&mut self, ids: &[i64]) -> Result<usize, SpoolError> {
        self.record_delivery(&[], ids)
    }

    /// Record publish attempts (`sent`) and acknowledgements (`acked`) in one
    /// IMMEDIATE transaction (the delivery thread's group commit). The
    /// acknowledged rows are folded into the `acked_through` mark while they
    /// are contiguous with it (rows already acknowledged or FAILED count as
    /// contiguous); the rest go to `acked_above`. Usually this writes one
    /// small page. Returns the number of rows retired.
    pub fn record_delivery(&mut self, sent: &[i64], acked: &[i64]) -> Result<usize, SpoolError> {
        if sent.is_empty() && acked.is_empty() {
            return Ok(0);
        }
        self.fold(sent, acked)
    }

    fn fold(&mut self, sent: &[i64], acked: &[i64]) -> Result<usize, SpoolError> {
        self.write(|tx, err| {
            let (mark, old_sent): (i64, i64) = tx
                .query_row(SQL_MARK, [], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(err)?;
            let sent_mark = sent.iter().copied().fold(old_sent, i64::max);
            let mut pending: std::collections::BTreeSet<i64> =
                acked.iter().copied().filter(|id| *id > mark).collect();
            let mut retired = 0usize;
            let mut new_mark = mark;
            // Fold: walk the rows above the mark in order while each one is
            // acknowledged now, or was already resolved.
            let mut step = tx.prepare_cached(SQL_ABOVE_MARK).map_err(err)?;
            'fold: loop {
                let mut rows = step.query(params![new_mark, FOLD_STEP]).map_err(err)?;
                let mut seen = 0;
                while let Some(r) = rows.next().map_err(err)? {
                    seen += 1;
                    let (id, resolved): (i64, bool) =
                        (r.get(0).map_err(err)?, r.get(1).map_err(err)?);
                    if pending.remove(&id) {
                        if !resolved {
                            retired += 1;
                        }
                    } else if !resolved {
                        break 'fold;
                    }
                    new_mark = id;
                }
                if seen < FOLD_STEP {
                    break;
                }
            }
            drop(step);
            {
                let mut above = tx.prepare_cached(SQL_ACKED_ABOVE).map_err(err)?;
                for id in &pending {
                    retired += above.execute(params![id]).map_err(err)?;
                }
            }
            if new_mark > mark {
                tx.execute("DELETE FROM acked_above WHERE id <= ?1", params![new_mark])
                    .map_err(err)?;
            }
            if new_mark != mark || sent_mark != old_sent {
                tx.execute(SQL_SET_MARK, params![new_mark, sent_mark])
                    .map_err(err)?;
            }
            Ok(retired)
        })
    }

    /// Mark row `id` `FAILED` with `reason` and count it under
    /// `events_failed_<counter>`. Terminal until an operator requeues it.
    /// A row already acknowledged is left alone.
    pub fn mark_failed(&mut self, id: i64, reason: &str, counter: &str) -> Result<(), SpoolError> {
        let now = crate::envelope::wall_clock_ms().0;
        self.write(|tx, err| {
            tx.execute(SQL_FAIL, params![id, reason, now])
                .map_err(err)?;
            tx.execute(
                SQL_COUNTER_ADD,
                params![format!("events_failed_{counter}"), 1],
            )
            .map_err(err)?;
            Ok(())
        })?;
        // A FAILED row no longer holds the acknowledged mark back.
        self.fold(&[], &[]).map(|_| ())
    }

    /// Put `FAILED` rows (of `stream`, or all) back in the queue (operator
    /// action): each is appended again as a new row with the same event id,
    /// sequence number and payload bytes (I3), after every row there is now,
    /// and the FAILED row is removed. Returns how many.
    pub fn requeue_failed(&mut self, stream: Option<&str>) -> Result<usize, SpoolError> {
        self.write(|tx, err| {
            let ids: Vec<i64> = {
                let mut st = tx
                    .prepare(
                        "SELECT f.id FROM failed f JOIN events e ON e.id = f.id
                         JOIN streams s ON s.id = e.stream_id
                         WHERE ?1 IS NULL OR s.name = ?1 ORDER BY f.id",
                    )
                    .map_err(err)?;
                let rows = st
                    .query_map(params![stream], |r| r.get(0))
                    .map_err(err)?
                    .collect::<Result<Vec<i64>, _>>()
                    .map_err(err)?;
                rows
            };
            for id in &ids {
                tx.execute(
                    "INSERT INTO events (stream_id, seq, event_id, created_ms, digest, payload, prio)
                     SELECT e.stream_id, e.seq, e.event_id, e.created_ms, e.digest, e.payload, s.prio
                     FROM events e JOIN streams s ON s.id = e.stream_id WHERE e.id = ?1",
                    params![id],
                )
                .map_err(err)?;
                tx.execute("DELETE FROM events WHERE id = ?1", params![id])
                    .map_err(err)?;
                tx.execute("DELETE FROM failed WHERE id = ?1", params![id])
                    .map_err(err)?;
            }
            Ok(ids.len())
        })
    }

    /// The newest `limit` FAILED rows: `(row id, event id, stream, reason,
    /// failed Unix ms)`, newest first.
    pub fn failed_rows(&self, limit: usize) -> Result<Vec<FailedRow>, SpoolError> {
        self.query_all(
            "SELECT f.id, e.event_id, s.name, f.reason, f.failed_ms FROM failed f
             JOIN events e ON e.id = f.id JOIN streams s ON s.id = e.stream_id
             ORDER BY f.id DESC LIMIT ?1",
            params![limit as i64],
            |r| {
                Ok(FailedRow {
                    id: r.get(0)?,
                    event_id: r.get(1)?,
                    stream: r.get(2)?,
                    reason: r.get(3)?,
                    failed_ms: r.get(4)?,
                })
            },
        )
    }

    /// Every row `sql` returns with `params`, mapped by `f`; no statement
    /// stays open afterwards (F01).
    fn query_all<T>(
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

    /// Rows not yet acknowledged, at most (the newest row id less the
    /// acknowledged mark: FAILED rows and out-of-order acks above the mark
    /// count too). Two index lookups, whatever the spool's size.
    pub fn backlog_estimate(&self) -> Result<u64, SpoolError> {
        self.conn
            .query_row(
                "SELECT coalesce((SELECT max(id) FROM events), 0)
                      - (SELECT acked_through FROM delivery_mark)",
                [],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n.max(0) as u64)
            .map_err(|e| self.err(e))
    }

    /// Append wall time (Unix ms) of the oldest unacknowledged row: the
    /// lowest row id above the acknowledged mark that is neither
    /// acknowledged out of order nor FAILED; `None` when there is none. A
    /// range read from the mark, whatever the spool's size (`stats` takes
    /// the minimum over every row instead, a full scan).
    pub fn oldest_unacked_ms(&self) -> Result<Option<i64>, SpoolError> {
        self.conn
            .prepare_cached(SQL_OLDEST_UNACKED)
            .and_then(|mut st| st.query_row([], |r| r.get::<_, i64>(0)).optional())
            .map_err(|e| self.err(e))
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

    /// The replay position stored with the last row appended to `stream`
    /// (see [`NewEvent::replay`]), if any.
    ///
    /// # Errors
    ///
    /// Classified SQLite errors.
    pub fn replay_position(&self, stream: &str) -> Result<Option<ReplayPosition>, SpoolError> {
        load_replay_position(&self.conn, stream).map_err(|e| self.err(e))
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

    /// Record several pieces of agent state in one IMMEDIATE transaction.
    pub fn set_states(&mut self, states: &[(&str, String)], now_ms: i64) -> Result<(), SpoolError> {
        self.write(|tx, err| {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
                     ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms",
                )
                .map_err(err)?;
            for (k, v) in states {
                st.execute(params![k, v, now_ms]).map_err(err)?;
            }
            Ok(())
        })
    }

    /// All recorded agent state: `(key, value, updated_ms)`, by key.
    pub fn states(&self) -> Result<Vec<(String, String, i64)>, SpoolError> {
        self.query_all(
            "SELECT key, value, updated_ms FROM agent_state ORDER BY key",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
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

    /// Delete at most `batch` acknowledged rows appended before `cutoff_ms`,
    /// oldest first, in one IMMEDIATE transaction. Never touches an
    /// unacknowledged or FAILED row, nor the newest row. Returns the number
    /// deleted; call again until 0, with a checkpoint in between, so a large
    /// purge never balloons the WAL (F02). Sequence numbers are persisted
    /// first ([`Spool::persist_seqs`]).
    pub fn purge_acked(&mut self, cutoff_ms: i64, batch: usize) -> Result<usize, SpoolError> {
        self.persist_seqs()?;
        self.write(|tx, err| {
            let mut n = tx
                .execute(SQL_PURGE, params![cutoff_ms, batch as i64])
                .map_err(err)?;
            if n < batch {
                let above = tx
                    .execute(SQL_PURGE_ABOVE, params![cutoff_ms, (batch - n) as i64])
                    .map_err(err)?;
                if above > 0 {
                    tx.execute(SQL_PURGE_ABOVE_INDEX, []).map_err(err)?;
                }
                n += above;
            }
            if n > 0 {
                keys::forget_purged(tx).map_err(err)?;
                tx.execute(SQL_COUNTER_ADD, params!["events_purged_acked", n as i64])
                    .map_err(err)?;
            }
            Ok(n)
        })
    }

    /// Give up to `max_pages` free pages back to the filesystem
    /// (`PRAGMA incremental_vacuum`, <https://www.sqlite.org/pragma.html#pragma_incremental_vacuum>)
    /// when the free pages inside the file exceed the live data plus
    /// `slack_bytes`. One bounded step: call again at the next maintenance
    /// pass. Returns the pages freed.
    pub fn shrink_step(&mut self, slack_bytes: u64, max_pages: u64) -> Result<u64, SpoolError> {
        let (live, free) = self.usage()?;
        if free <= live.saturating_add(slack_bytes) {
            return Ok(0);
        }
        let page = self
            .conn
            .query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
            .map_err(|e| self.err(e))?
            .max(512) as u64;
        let excess = (free - live - slack_bytes) / page;
        let pages = excess.clamp(1, max_pages.max(1));
        {
            // Each step frees one page: step the pragma to its end.
            let mut st = self
                .conn
                .prepare(&format!("PRAGMA incremental_vacuum({pages})"))
                .map_err(|e| self.err(e))?;
            let mut rows = st.query([]).map_err(|e| self.err(e))?;
            while rows.next().map_err(|e| self.err(e))?.is_some() {}
        }
        let (_, after) = self.usage()?;
        Ok(free.saturating_sub(after) / page)
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
            .inspect(|r| note_checkpoint(r.log_frames, r.checkpointed_frames))
    }

    /// Counts for `status`.
    pub fn stats(&self, now_ms: i64) -> Result<Stats, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let by = self.query_all(
            "SELECT stream, state, count(*) FROM event_states GROUP BY stream, state ORDER BY stream, state",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        let oldest: Option<i64> = self
            .conn
            .query_row(
                "SELECT min(created_ms) FROM event_states WHERE state IN ('PENDING','SENT')",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(e)?
            .flatten();
        let counters = self.counters()?;
        Ok(Stats {
            by_stream_state: by,
            oldest_unacked_age_ms: oldest.map(|c| (now_ms - c).max(0)),
            wal_bytes: file_len(&wal_path(&self.path)),
            db_bytes: file_len(&self.path),
            counters,
        })
    }

    /// The persistent counters `(name, value)`, by name (drops by reason,
    /// FAILED by reason, command outcomes); one small table.
    pub fn counters(&self) -> Result<Vec<(String, i64)>, SpoolError> {
        self.query_all("SELECT name, value FROM counters ORDER BY name", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
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
        self.query_all(
            "SELECT id, started_ms, ended_ms, pid, version, exit_status, error FROM runs ORDER BY id DESC LIMIT ?1",
            params![limit as i64],
            |r| {
                Ok(RunRecord {
                    id: r.get(0)?,
                    started_ms: r.get(1)?,
                    ended_ms: r.get(2)?,
                    pid: r.get(3)?,
                    version: r.get(4)?,
                    exit_status: r.get(5)?,
                    error: r.get(6)?,
                })
            },
        )
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

/// Replay positions met in one append transaction.
#[derive(Default)]
struct ReplayMarks {
    /// Per stream: the position stored (or appended in this transaction),
    /// and whether this transaction moved it.
    by_stream: HashMap<String, (Option<ReplayPosition>, bool)>,
    /// Rows not appended because their position was already stored.
    already: i64,
}

impl ReplayMarks {
    /// Whether the row at `pos` is new: not at or before the position
    /// stored for `stream` with the same trace identity. Two readers of one
    /// trace (a config reload racing the old source thread) thus never
    /// append one row twice.
    fn admit(
        &mut self,
        tx: &rusqlite::Transaction<'_>,
        stream: &str,
        pos: &ReplayPosition,
    ) -> rusqlite::Result<bool> {
        if !self.by_stream.contains_key(stream) {
            let stored = load_replay_position(tx, stream)?;
            self.by_stream.insert(stream.to_owned(), (stored, false));
        }
        let seen = self.by_stream.get(stream).is_some_and(|(s, _)| {
            s.as_ref().is_some_and(|s| {
                s.trace_id == pos.trace_id && (pos.lap, pos.line) <= (s.lap, s.line)
            })
        });
        if seen {
            self.already += 1;
        }
        Ok(!seen)
    }

    /// The row at `pos` was appended.
    fn appended(&mut self, stream: &str, pos: &ReplayPosition) {
        self.by_stream
            .insert(stream.to_owned(), (Some(pos.clone()), true));
    }

    /// Stores the moved positions (and the count of rows not appended
    /// again) in `tx`.
    fn store(&self, tx: &rusqlite::Transaction<'_>, now_ms: i64) -> rusqlite::Result<()> {
        for (stream, (pos, moved)) in &self.by_stream {
            let Some(pos) = pos.as_ref().filter(|_| *moved) else {
                continue;
            };
            let json = serde_json::to_string(pos)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            tx.prepare_cached(SQL_SET_STATE)?
                .execute(params![replay_key(stream), json, now_ms])?;
        }
        if self.already > 0 {
            tx.execute(
                SQL_COUNTER_ADD,
                params!["replay_rows_already_spooled", self.already],
            )?;
        }
        Ok(())
    }
}

/// `agent_state` key of a replayed stream's position.
fn replay_key(stream: &str) -> String {
    format!("replay_position.{stream}")
}

/// The position stored for `stream`; a value that does not parse (written
/// by hand, or by a later version) counts as none, with a warning.
fn load_replay_position(
    conn: &Connection,
    stream: &str,
) -> rusqlite::Result<Option<ReplayPosition>> {
    let text: Option<String> = conn
        .prepare_cached(SQL_GET_STATE)?
        .query_row(params![replay_key(stream)], |r| r.get(0))
        .optional()?;
    Ok(text.and_then(|t| match serde_json::from_str(&t) {
        Ok(p) => Some(p),
        Err(e) => {
            log::warn!("stream {stream}: stored replay position unreadable ({e}); ignored");
            None
        }
    }))
}

/// Append one event inside the caller's transaction `tx`, reading and
/// advancing its stream's sequence in the `streams` table at once (not the ingest
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
    let prio = crate::stream::fallback_priority(&ev.stream);
    let stream = stream_row(tx, &ev.stream, prio).map_err(err)?;
    let seq = stream.last_seq + 1;
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
        .execute(params![
            stream.id,
            seq,
            id,
            now_ms,
            digest.as_slice(),
            payload,
            stream.prio
        ])
        .map_err(err)?;
    tx.prepare_cached(SQL_SET_SEQ)
        .map_err(err)?
        .execute(params![stream.id, seq])
        .map_err(err)?;
    Ok(id)
}

/// The `streams` row for `name`, created with priority `prio` if missing,
/// with its `last_seq` caught up with rows appended since it was last
/// persisted.
fn stream_row(tx: &rusqlite::Transaction<'_>, name: &str, prio: u8) -> rusqlite::Result<StreamSeq> {
    tx.prepare_cached(SQL_NEW_STREAM)?
        .execute(params![name, prio])?;
    let (id, stored, prio): (i64, i64, i64) = tx
        .prepare_cached(SQL_STREAM_BY_NAME)?
        .query_row(params![name], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    let tail: Option<i64> = tx
        .prepare_cached(
            "SELECT max(seq) FROM events WHERE stream_id = ?1
             AND id > coalesce((SELECT value FROM spool_meta WHERE key = 'seq_through_id'), 0)",
        )?
        .query_row(params![id], |r| r.get(0))?;
    Ok(StreamSeq {
        id,
        last_seq: stored.max(tail.unwrap_or(0)),
        prio: prio.clamp(0, 255) as u8,
    })
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
    use crate::reading::FieldValue;

    fn ev(stream: &str, x: f64) -> NewEvent {
        NewEvent {
            replay: None,
            stream: stream.into(),
            ts_ms: 1,
            clock_trusted: true,
            fields: vec![("x".into(), FieldValue::Num(x))],
            key: None,
            reply: None,
        }
    }

    fn open(dir: &Path) -> Spool {
        Spool::open(&dir.join("spool.db"), &SpoolOptions::default()).unwrap()
    }

    fn replayed(trace: &str, lap: u64, line: u64) -> NewEvent {
        let mut e = ev("air", line as f64);
        e.replay = Some(ReplayPosition {
            trace_id: trace.into(),
            fingerprint: "f".into(),
            lap,
            line,
            offset: line * 10,
            shift_ms: 0,
            pass: Default::default(),
            segment: None,
        });
        e
    }

    fn event_ids(s: &Spool) -> Vec<String> {
        s.query_all("SELECT event_id FROM events ORDER BY id", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn replayed_rows_get_derived_ids_and_their_position_commits_with_them() {
        let d = tempfile::tempdir().unwrap();
        let mut s = open(d.path());
        let mut ids = EventIdGen::new().unwrap();
        let batch: Vec<NewEvent> = (2..5).map(|l| replayed("fp:a", 0, l)).collect();
        assert_eq!(
            s.append(&batch, &mut ids, "dev", Format::Json, 0).unwrap(),
            3
        );
        let want: Vec<String> = (2..5)
            .map(|l| envelope::replay_event_id("dev", "air", "fp:a", 0, l).hyphenated())
            .collect();
        assert_eq!(event_ids(&s), want);
        assert_eq!(s.replay_position("air").unwrap(), batch[2].replay);
        assert_eq!(s.replay_position("other").unwrap(), None);

        // A second reader of the same trace (a reload racing the old
        // thread): rows already stored are not appended again.
        let overlap: Vec<NewEvent> = (3..6).map(|l| replayed("fp:a", 0, l)).collect();
        assert_eq!(
            s.append(&overlap, &mut ids, "dev", Format::Json, 0)
                .unwrap(),
            1
        );
        let skipped: i64 = s
            .conn
            .query_row(
                "SELECT value FROM counters WHERE name = 'replay_rows_already_spooled'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(skipped, 2);
        // The next lap, and another trace, are new rows.
        let more = [replayed("fp:a", 1, 2), replayed("fp:b", 0, 2)];
        assert_eq!(
            s.append(&more, &mut ids, "dev", Format::Json, 0).unwrap(),
            2
        );
        let all = event_ids(&s);
        assert_eq!(all.len(), 6);
        let distinct: std::collections::HashSet<&String> = all.iter().collect();
        assert_eq!(distinct.len(), 6);
        drop(s);
        let s = open(d.path());
        assert_eq!(s.replay_position("air").unwrap(), more[1].replay);
        // An unreadable stored value counts as none.
        s.conn
            .execute(
                "UPDATE agent_state SET value = 'junk' WHERE key = 'replay_position.air'",
                [],
            )
            .unwrap();
        assert_eq!(s.replay_position("air").unwrap(), None);
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
        s.mark_sent(&[rows[0].id, rows[1].id]).unwrap();
        assert_eq!(s.retire(&[rows[0].id]).unwrap(), 1);
        // Retiring twice changes nothing.
        assert_eq!(s.retire(&[rows[0].id]).unwrap(), 0);
        // Purge with a cutoff far in the future removes only the ACKED row.
        assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 1);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![rows[1].id, rows[2].id]);
        // mark_sent on an acked row does not resurrect it.
        s.retire(&[rows[1].id]).unwrap();
        s.mark_sent(&[rows[1].id]).unwrap();
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![rows[2].id]);
    }

    fn states(s: &Spool) -> Vec<(i64, String)> {
        let mut st = s
            .conn
            .prepare("SELECT id, state FROM event_states ORDER BY id")
            .unwrap();
        let rows = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        rows
    }

    fn mark(s: &Spool) -> (i64, i64) {
        s.conn
            .query_row(SQL_MARK, [], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
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
        assert_eq!(s.record_delivery(&[a, b], &[a]).unwrap(), 1);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![b]);
        assert_eq!(
            states(&s),
            vec![(a, "ACKED".to_owned()), (b, "SENT".to_owned())]
        );
        assert_eq!(mark(&s), (a, b));
    }

    #[test]
    fn the_oldest_unacknowledged_row_skips_acked_above_and_failed_rows() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        assert_eq!(s.oldest_unacked_ms().unwrap(), None);
        for (i, at) in [100, 200, 300].into_iter().enumerate() {
            s.append(&[ev("a", i as f64)], &mut ids, "d", Format::Json, at)
                .unwrap();
        }
        let r: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        let created = |s: &Spool| s.oldest_unacked_ms().unwrap();
        let first = created(&s);
        assert!(first.is_some());
        // Row 2 acknowledged out of order, row 1 FAILED: row 3 is the oldest.
        s.retire(&[r[1]]).unwrap();
        s.mark_failed(r[0], "too big", "oversized").unwrap();
        let third: i64 = s
            .conn
            .query_row("SELECT created_ms FROM events WHERE id = ?1", [r[2]], |x| {
                x.get(0)
            })
            .unwrap();
        assert_eq!(created(&s), Some(third));
        s.retire(&[r[2]]).unwrap();
        assert_eq!(created(&s), None);
    }

    #[test]
    fn out_of_order_acks_wait_above_the_mark_and_fold_in_once_contiguous() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        let evs: Vec<NewEvent> = (0..5).map(|i| ev("a", i as f64)).collect();
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
        let r: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        // PUBACKs for rows 2 and 4 first: nothing below them is retired.
        assert_eq!(s.retire(&[r[1], r[3]]).unwrap(), 2);
        assert_eq!(mark(&s).0, 0);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![r[0], r[2], r[4]]);
        // Row 3 fails by policy; then row 1 is acknowledged: the mark moves
        // over 1, 2 (acked above), 3 (FAILED) and 4, and stops before 5.
        s.mark_failed(r[2], "too big", "oversized").unwrap();
        assert_eq!(s.retire(&[r[0]]).unwrap(), 1);
        assert_eq!(mark(&s).0, r[3]);
        let above: i64 = s
            .conn
            .query_row("SELECT count(*) FROM acked_above", [], |r| r.get(0))
            .unwrap();
        assert_eq!(above, 0, "folded entries are removed");
        let st = states(&s);
        assert_eq!(st[2].1, "FAILED");
        assert_eq!(st[4].1, "PENDING");
        // A PUBACK for a row below the mark, or for no row, retires nothing.
        assert_eq!(s.retire(&[r[0], 9999]).unwrap(), 0);
        // The FAILED row is never purged; the others are, except the newest.
        assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 3);
        assert_eq!(s.requeue_failed(Some("a")).unwrap(), 1);
        let left: Vec<OutRow> = s.sendable(0, 10).unwrap();
        assert_eq!(left.len(), 2);
        assert!(left[1].id > r[4], "requeued after every row");
        assert!(left.iter().all(|r| r.digest_ok()));
    }

    #[test]
    fn sequences_continue_after_reopen_without_persisting() {
        // An append writes no `streams` page; a restart catches up from rows.
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        {
            let mut s = open(d.path());
            s.append(
                &[ev("a", 1.0), ev("a", 2.0)],
                &mut ids,
                "d",
                Format::Json,
                0,
            )
            .unwrap();
            s.persist_seqs().unwrap();
            s.append(&[ev("a", 3.0)], &mut ids, "d", Format::Json, 0)
                .unwrap();
        }
        let mut s = open(d.path());
        s.append(&[ev("a", 4.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let seqs: Vec<i64> = {
            let mut st = s
                .conn
                .prepare("SELECT seq FROM events ORDER BY id")
                .unwrap();
            let v = st
                .query_map([], |r| r.get(0))
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            v
        };
        assert_eq!(seqs, vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_start_reads_at_most_ten_thousand_rows_to_catch_up_sequences() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        let evs: Vec<NewEvent> = (0..1000).map(|i| ev("a", i as f64)).collect();
        for _ in 0..11 {
            s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
        }
        let through: i64 = s
            .conn
            .query_row(
                "SELECT value FROM spool_meta WHERE key = 'seq_through_id'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(through >= 10_000, "seq_through_id {through}");
        assert!(s.appended_since_persist() < 10_000);
    }

    #[test]
    fn free_pages_are_given_back_in_bounded_steps() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        let evs: Vec<NewEvent> = (0..3000).map(|i| ev("a", i as f64)).collect();
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
        let all: Vec<i64> = s.sendable(0, 5000).unwrap().iter().map(|r| r.id).collect();
        s.retire(&all).unwrap();
        while s.purge_acked(i64::MAX, 1000).unwrap() > 0 {}
        let (live, free) = s.usage().unwrap();
        assert!(free > live, "live {live} free {free}");
        let freed = s.shrink_step(0, 10).unwrap();
        assert_eq!(freed, 10, "one bounded step");
        while s.shrink_step(0, 1000).unwrap() > 0 {}
        let (_, free) = s.usage().unwrap();
        assert!(free <= live, "free {free} live {live}");
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
        s.retire(&[rows[0].id, top]).unwrap();
        // The newest row stays: its id keeps new ids above every id used.
        assert_eq!(s.purge_acked(i64::MAX, 10).unwrap(), 1);
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
        assert!(sql.contains("stream_id"), "{sql}");
        let rows = s.sendable(0, 10).unwrap();
        assert_eq!(rows[0].id, 7);
        assert_eq!(rows[0].payload, vec![0u8]);
        let vacuum: i64 = s
            .conn
            .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
            .unwrap();
        assert_eq!(vacuum, 2, "converted to incremental auto_vacuum");
    }

    #[test]
    fn a_schema_4_spool_keeps_every_row_state_through_the_migration() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        {
            let c = Connection::open(&path).unwrap();
            let _: String = c
                .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
                .unwrap();
            c.execute_batch(MIGRATION_1).unwrap();
            c.execute_batch(MIGRATION_2).unwrap();
            c.execute_batch(MIGRATION_3).unwrap();
            c.execute_batch(MIGRATION_4).unwrap();
            for (id, state) in [
                (1, "ACKED"),
                (2, "SENT"),
                (3, "ACKED"),
                (4, "FAILED"),
                (5, "PENDING"),
            ] {
                c.execute(
                    "INSERT INTO events (id, event_id, stream, seq, digest, state, created_ms, fail_reason)
                     VALUES (?1, 'e' || ?1, 'a', ?1, x'00', ?2, 0, CASE WHEN ?2 = 'FAILED' THEN 'too big' END)",
                    params![id, state],
                )
                .unwrap();
                c.execute(
                    "INSERT INTO payloads (id, payload) VALUES (?1, x'01')",
                    params![id],
                )
                .unwrap();
            }
            c.execute_batch("INSERT INTO stream_seq VALUES ('a', 5); PRAGMA user_version = 4;")
                .unwrap();
        }
        let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        let got: Vec<(i64, String)> = states(&s);
        let want: Vec<(i64, String)> = [
            (1, "ACKED"),
            (2, "SENT"),
            (3, "ACKED"),
            (4, "FAILED"),
            (5, "PENDING"),
        ]
        .iter()
        .map(|(i, st)| (*i, st.to_string()))
        .collect();
        assert_eq!(got, want);
        let left: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        assert_eq!(left, vec![2, 5]);
        // Sequences continue from the old table.
        let mut ids = EventIdGen::new().unwrap();
        s.append(&[ev("a", 6.0)], &mut ids, "d", Format::Json, 0)
            .unwrap();
        let seq: i64 = s
            .conn
            .query_row("SELECT seq FROM events ORDER BY id DESC LIMIT 1", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(seq, 6);
    }

    #[test]
    fn purge_is_bounded_per_batch() {
        let d = tempfile::tempdir().unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut s = open(d.path());
        let evs: Vec<NewEvent> = (0..25).map(|i| ev("a", i as f64)).collect();
        s.append(&evs, &mut ids, "d", Format::Json, 0).unwrap();
        let all: Vec<i64> = s.sendable(0, 100).unwrap().iter().map(|r| r.id).collect();
        s.retire(&all).unwrap();
        assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
        assert_eq!(s.purge_acked(6, 10).unwrap(), 10);
        // 25 rows: the newest stays.
        assert_eq!(s.purge_acked(6, 10).unwrap(), 4);
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
        b.retire(&[rows[0].id]).unwrap();
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
