//! The sink's single-machine store: one SQLite file (rigs and tests).
//!
//! Stores each event keyed by event id with `INSERT .. ON CONFLICT DO
//! NOTHING`; every event id keeps the digest of its first payload, so a
//! second delivery is counted as a duplicate, or as a payload mismatch (kept
//! in `mismatches`, never written over the first) if its bytes differ.

use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;

use super::batch::Item;
use super::{SinkStats, Store, StoreError};

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
CREATE TABLE IF NOT EXISTS received (
    event_id   TEXT PRIMARY KEY,
    topic      TEXT NOT NULL,
    digest     BLOB NOT NULL,
    payload    BLOB NOT NULL,
    ts_ms      INTEGER,
    first_ms   INTEGER NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS mismatches (
    event_id TEXT NOT NULL,
    digest   BLOB NOT NULL,
    payload  BLOB NOT NULL,
    at_ms    INTEGER NOT NULL
);
";

/// The sink's store.
pub struct SinkDb {
    conn: Connection,
    /// Counters so far.
    pub stats: SinkStats,
}

impl SinkDb {
    /// Open (create) the sink's SQLite file.
    pub fn open(path: &Path) -> rusqlite::Result<SinkDb> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        Ok(SinkDb {
            conn,
            stats: SinkStats::default(),
        })
    }

    /// Store one delivery in its own transaction. Returns the event id when
    /// the payload was an edgespool envelope (JSON or postcard).
    pub fn store(&mut self, topic: &str, payload: &[u8]) -> rusqlite::Result<Option<String>> {
        let now = crate::envelope::wall_clock_ms().0;
        let tx = self.conn.transaction()?;
        let (id, delta) = store_in(&tx, topic, payload, now)?;
        tx.commit()?;
        self.stats += delta;
        Ok(id)
    }

    /// The slowest first delivery: max(first receipt - reading time), ms.
    pub fn slowest_ms(&self) -> rusqlite::Result<Option<i64>> {
        self.conn
            .query_row("SELECT max(first_ms - ts_ms) FROM received", [], |r| {
                r.get(0)
            })
    }

    /// Whether `event_id` was received, with its payload digest.
    pub fn digest_of(&self, event_id: &str) -> rusqlite::Result<Option<Vec<u8>>> {
        self.conn
            .query_row(
                "SELECT digest FROM received WHERE event_id = ?1",
                params![event_id],
                |r| r.get(0),
            )
            .optional()
    }
}

impl Store for SinkDb {
    /// One `IMMEDIATE` transaction for the batch. Every error is fatal: a
    /// file the sink cannot write will not heal by retrying.
    fn store_batch(&mut self, items: &[Item], now_ms: i64) -> Result<SinkStats, StoreError> {
        let fatal = |e: rusqlite::Error| StoreError::Fatal(format!("sink database: {e}"));
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(fatal)?;
        let mut delta = SinkStats::default();
        for it in items {
            // A batch that could not be unpacked: its bytes are no envelope,
            // whatever they happen to parse as.
            if let Err(super::message::Unreadable::Batch(_)) = &it.read {
                delta.unreadable += 1;
                continue;
            }
            delta += store_in(&tx, &it.topic, &it.payload, now_ms)
                .map_err(fatal)?
                .1;
        }
        tx.commit().map_err(fatal)?;
        self.stats += delta;
        Ok(delta)
    }
}

/// Store one delivery inside `tx`: its event id (if an envelope) and what
/// became of it.
fn store_in(
    tx: &rusqlite::Transaction<'_>,
    topic: &str,
    payload: &[u8],
    now: i64,
) -> rusqlite::Result<(Option<String>, SinkStats)> {
    let mut d = SinkStats::default();
    let Some((event_id, ts_ms)) = envelope_identity(payload) else {
        d.unreadable = 1;
        return Ok((None, d));
    };
    let digest = Sha256::digest(payload).to_vec();
    let inserted = tx.execute(
        "INSERT INTO received (event_id, topic, digest, payload, ts_ms, first_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT(event_id) DO NOTHING",
        params![event_id, topic, digest, payload, ts_ms, now],
    )?;
    if inserted == 1 {
        d.first = 1;
        return Ok((Some(event_id), d));
    }
    let stored: Option<Vec<u8>> = tx
        .query_row(
            "SELECT digest FROM received WHERE event_id = ?1",
            params![event_id],
            |r| r.get(0),
        )
        .optional()?;
    tx.execute(
        "UPDATE received SET deliveries = deliveries + 1 WHERE event_id = ?1",
        params![event_id],
    )?;
    if stored.as_deref() == Some(digest.as_slice()) {
        d.duplicates = 1;
    } else {
        d.mismatches = 1;
        tx.execute(
            "INSERT INTO mismatches (event_id, digest, payload, at_ms) VALUES (?1, ?2, ?3, ?4)",
            params![event_id, digest, payload, now],
        )?;
    }
    Ok((Some(event_id), d))
}

/// Event id and reading time of an edgespool envelope (JSON, else postcard).
pub fn envelope_identity(payload: &[u8]) -> Option<(String, Option<i64>)> {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
        let id = v.get("event_id")?.as_str()?.to_owned();
        return Some((id, v.get("ts_ms").and_then(|t| t.as_i64())));
    }
    let c: crate::envelope::CompactEnvelope = postcard::from_bytes(payload).ok()?;
    Some((
        crate::envelope::EventId(c.event_id).hyphenated(),
        Some(c.ts_ms),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_duplicate_and_mismatch_are_told_apart() {
        let d = tempfile::tempdir().unwrap();
        let mut db = SinkDb::open(&d.path().join("sink.db")).unwrap();
        let a = br#"{"event_id":"e-1","ts_ms":5,"fields":{}}"#;
        let b = br#"{"event_id":"e-1","ts_ms":5,"fields":{"x":1}}"#;
        assert_eq!(db.store("t", a).unwrap().as_deref(), Some("e-1"));
        db.store("t", a).unwrap();
        db.store("t", b).unwrap();
        db.store("t", b"not an envelope").unwrap();
        assert_eq!(
            db.stats,
            SinkStats {
                first: 1,
                duplicates: 1,
                mismatches: 1,
                unreadable: 1
            }
        );
        assert!(db.digest_of("e-1").unwrap().is_some());
    }
}
