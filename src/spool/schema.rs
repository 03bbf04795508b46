//! The spool's schema: the version this build writes and the forward-only
//! migrations from every older one.
//!
//! One rule: a migration only goes forward, inside one IMMEDIATE
//! transaction with the version stamp (`PRAGMA user_version`); a file from a
//! newer build is refused, never downgraded.

use super::{CheckpointMode, Spool, SpoolError};
use rusqlite::TransactionBehavior;

/// Schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 13;

pub(super) const MIGRATION_1: &str = "
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
pub(super) const MIGRATION_2: &str = "
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
pub(super) const MIGRATION_3: &str = "
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
pub(super) const MIGRATION_4: &str = "
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
pub(super) const MIGRATION_5: &str = "
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
pub(super) const MIGRATION_6: &str = "
ALTER TABLE commands ADD COLUMN received_clock_ms INTEGER;
";

/// Schema 7: the keyed event ids and the row each one is.
pub(super) const MIGRATION_7: &str = "
CREATE TABLE event_keys (
    row_id   INTEGER PRIMARY KEY,
    event_id TEXT    NOT NULL UNIQUE
);
";

/// Schema 8: a priority per stream and per row, and the partial index of
/// the rows above priority 0.
pub(super) const MIGRATION_8: &str = "
ALTER TABLE streams ADD COLUMN prio INTEGER NOT NULL DEFAULT 0;
ALTER TABLE events ADD COLUMN prio INTEGER NOT NULL DEFAULT 0;
UPDATE streams SET prio = 200 WHERE name IN ('_commands', '_agent');
UPDATE events SET prio = 200
    WHERE stream_id IN (SELECT id FROM streams WHERE name IN ('_commands', '_agent'))
      AND id > (SELECT acked_through FROM delivery_mark);
CREATE INDEX events_priority ON events(id) WHERE prio > 0;
";

/// Schema 9: the digest of the reading each key names
/// ([`crate::spool::ReadingKey`]), so a key reused for another reading is
/// refused. Keys stored before have NULL (taken as the same reading).
pub(super) const MIGRATION_9: &str = "
ALTER TABLE event_keys ADD COLUMN digest BLOB;
";

/// Schema 10: the board's secrets, never shown by `status` (unlike
/// `agent_state`). `key_ids` keys the handles of keyed readings
/// ([`crate::event::envelope::key_id`]); SQLite's `randomblob` draws it
/// from its ChaCha20 generator, seeded from the OS (`/dev/urandom`).
pub(super) const MIGRATION_10: &str = "
CREATE TABLE secrets (
    name  TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
";

/// Schema 11: the event id each key's reading was published under
/// ([`crate::event::envelope::derived_event_id`], derived from the key and the
/// payload), beside the key's own id (`event_id`, the lookup). Keys stored
/// before have NULL: they were published under the key's id itself.
pub(super) const MIGRATION_11: &str = "
ALTER TABLE event_keys ADD COLUMN published_id TEXT;
";

/// Schema 12: a row's event id is not stored twice (issue 35: it was a
/// sixth of each row, and rows written per commit window are most of what
/// a slow board writes). New rows store `events.event_id` empty, and the id
/// is read from the payload, where the envelope always carries it
/// ([`crate::event::envelope::event_id_of`]: a JSON payload begins with it,
/// a postcard one has it after its version byte); rows written before keep
/// theirs. The view shows both alike. The payload's digest stays in the
/// row: every row is checked against it before it is sent (I3).
pub(super) const MIGRATION_12: &str = "
DROP VIEW IF EXISTS event_states;
CREATE VIEW event_states AS
SELECT e.id,
    CASE WHEN e.event_id <> '' THEN e.event_id
         WHEN substr(e.payload, 1, 13) = CAST('{\"event_id\":\"' AS BLOB)
              THEN CAST(substr(e.payload, 14, 36) AS TEXT)
         ELSE lower(substr(hex(substr(e.payload, 2, 16)), 1, 8) || '-'
                 || substr(hex(substr(e.payload, 2, 16)), 9, 4) || '-'
                 || substr(hex(substr(e.payload, 2, 16)), 13, 4) || '-'
                 || substr(hex(substr(e.payload, 2, 16)), 17, 4) || '-'
                 || substr(hex(substr(e.payload, 2, 16)), 21, 12)) END AS event_id,
    s.name AS stream, e.seq, e.created_ms, e.payload, e.digest,
    CASE WHEN f.id IS NOT NULL THEN 'FAILED'
         WHEN e.id <= m.acked_through OR a.id IS NOT NULL THEN 'ACKED'
         WHEN e.id <= m.sent_through THEN 'SENT'
         ELSE 'PENDING' END AS state,
    f.reason AS fail_reason
FROM events e JOIN streams s ON s.id = e.stream_id CROSS JOIN delivery_mark m
    LEFT JOIN acked_above a ON a.id = e.id LEFT JOIN failed f ON f.id = e.id;
";

/// Schema 13: the spans of rows appended before the wall clock was set
/// ([`super::clock_spans`]): the first row id of each, and once the clock
/// is set the last one and the time retention counts them from. A spool
/// written before has none: its rows keep counting from their append time,
/// as they did.
pub(super) const MIGRATION_13: &str = "
CREATE TABLE IF NOT EXISTS clock_spans (
    first_id   INTEGER PRIMARY KEY,
    last_id    INTEGER,
    settled_ms INTEGER
);
";

/// Made once per spool, the first time a build of schema 10 opens it.
const SQL_MAKE_SECRETS: &str =
    "INSERT OR IGNORE INTO secrets (name, value) VALUES ('key_ids', randomblob(32))";

impl Spool {
    /// `PRAGMA user_version` of the open file.
    pub fn schema_version(&self) -> Result<i64, SpoolError> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }

    pub(super) fn migrate(&mut self) -> Result<(), SpoolError> {
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
            tx.execute_batch(MIGRATION_7).map_err(err)?;
        }
        if version < 8 {
            tx.execute_batch(MIGRATION_8).map_err(err)?;
        }
        if version < 9 {
            tx.execute_batch(MIGRATION_9).map_err(err)?;
        }
        if version < 10 {
            tx.execute_batch(MIGRATION_10).map_err(err)?;
        }
        if version < 11 {
            tx.execute_batch(MIGRATION_11).map_err(err)?;
        }
        if version < 12 {
            tx.execute_batch(MIGRATION_12).map_err(err)?;
        }
        if version < 13 {
            tx.execute_batch(MIGRATION_13).map_err(err)?;
        }
        tx.execute(SQL_MAKE_SECRETS, []).map_err(err)?;
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .map_err(err)?;
        tx.commit().map_err(err)?;
        self.key_secret = self.read_key_secret()?;
        self.convert_to_incremental_vacuum()
    }

    /// The secret keyed event ids are made with.
    ///
    /// Errors: SQLite's; a secret of another length is damage
    /// ([`SpoolError::Corrupt`] would move the spool aside, so it is told
    /// as an error of its own kind instead: the file is kept).
    fn read_key_secret(&self) -> Result<[u8; 32], SpoolError> {
        let v: Vec<u8> = self
            .conn
            .query_row(
                "SELECT value FROM secrets WHERE name = 'key_ids'",
                [],
                |r| r.get(0),
            )
            .map_err(|e| self.err(e))?;
        <[u8; 32]>::try_from(v.as_slice()).map_err(|_| SpoolError::Encode {
            path: self.path.clone(),
            detail: format!(
                "the key_ids secret is {} bytes, not 32; the spool was edited by hand",
                v.len()
            ),
        })
    }

    /// A spool created before schema 5 has `auto_vacuum = NONE` and never
    /// gives space back; one VACUUM converts it
    /// (<https://www.sqlite.org/pragma.html#pragma_auto_vacuum>). It needs
    /// free space about the size of the file; if it fails (SQLITE_FULL on a
    /// small disk or temp directory) the spool keeps working as it is and
    /// the next start tries again.
    pub(super) fn convert_to_incremental_vacuum(&mut self) -> Result<(), SpoolError> {
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
}
