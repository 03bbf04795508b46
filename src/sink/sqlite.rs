//! The sink's single-machine store: one SQLite file (rigs and tests).
//!
//! Stores each event keyed by (device id, event id), the device being the
//! one its topic names ([`super::identity`]), with `INSERT .. ON CONFLICT
//! DO NOTHING`; every key keeps the digest of its first payload, so a
//! second delivery is counted as a duplicate, or as a payload mismatch (kept
//! in `mismatches`, never written over the first) if its bytes differ. An
//! envelope claiming another device or stream than its topic's is kept in
//! `forged`. Its one rule: the schema is changed only by [`migrate`], one
//! version at a time (`PRAGMA user_version`), forward only, in the
//! transaction that records it.

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;

use super::batch::{Fate, Item};
use super::ledger::book;
use super::ledger::sqlite::{self as ledger_sql, SqliteBooks};
use super::message::Unreadable;
use super::notes::BoardNote;
use super::{LedgerSummary, SideBounds, SinkStats, Store, StoreError, Stored};

/// The schema version this build writes (`PRAGMA user_version`). Version
/// 1 is the file of older sinks, which had no version: `received` keyed
/// by event id alone, `mismatches` without device or topic. Version 2 had
/// no `unreadable` table and no device in `forged`. Version 3 had no clock
/// columns, anchors or `clock_refused` ([`super::sqlite_clock::V3_TO_V4`]);
/// version 4 no replay ledger ([`super::ledger::sqlite::V4_TO_V5`]).
pub const VERSION: i32 = 5;

/// Version 2, created whole in a new file.
const SCHEMA_V2: &str = "
CREATE TABLE received (
    device_id  TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    stream     TEXT NOT NULL,
    topic      TEXT NOT NULL,
    digest     BLOB NOT NULL,
    payload    BLOB NOT NULL,
    ts_ms      INTEGER,
    first_ms   INTEGER NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (device_id, event_id)
);
CREATE INDEX received_event ON received (event_id);
CREATE TABLE mismatches (
    device_id     TEXT NOT NULL,
    event_id      TEXT NOT NULL,
    digest        BLOB NOT NULL,
    payload       BLOB NOT NULL,
    payload_bytes INTEGER NOT NULL,
    topic         TEXT NOT NULL,
    at_ms         INTEGER NOT NULL
);
CREATE TABLE forged (
    topic         TEXT NOT NULL,
    payload       BLOB NOT NULL,
    payload_bytes INTEGER NOT NULL,
    reason        TEXT NOT NULL,
    at_ms         INTEGER NOT NULL
);
CREATE TABLE side_drops (
    side    TEXT PRIMARY KEY,
    dropped INTEGER NOT NULL
);
PRAGMA user_version = 2;
";

/// Version 2 to 3: the side tables bounded per device. `forged` gets the
/// device that published it (filled from each row's topic by
/// [`v2_to_v3`]); `unreadable` keeps what is not an envelope, oversized
/// deliveries included, with the reason.
const V2_TO_V3: &str = "
ALTER TABLE forged ADD COLUMN device_id TEXT NOT NULL DEFAULT '';
CREATE TABLE unreadable (
    device_id     TEXT NOT NULL,
    topic         TEXT NOT NULL,
    payload       BLOB NOT NULL,
    payload_bytes INTEGER NOT NULL,
    reason        TEXT NOT NULL,
    at_ms         INTEGER NOT NULL
);
PRAGMA user_version = 3;
";

/// Why the sink's file cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// SQLite said no.
    #[error(transparent)]
    Db(#[from] rusqlite::Error),
    /// A file written by a newer sink: run that version.
    #[error(
        "schema version {found} is newer than this sink knows ({known}); run a newer edgespool"
    )]
    Newer {
        /// `user_version` in the file.
        found: i32,
        /// [`VERSION`].
        known: i32,
    },
}

/// The sink's store.
pub struct SinkDb {
    conn: Connection,
    bounds: SideBounds,
    /// Counters so far.
    pub stats: SinkStats,
}

impl SinkDb {
    /// Open (create, or migrate to [`VERSION`]) the sink's SQLite file.
    ///
    /// Errors: SQLite's, or a file of a newer schema.
    pub fn open(path: &Path) -> Result<SinkDb, OpenError> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.execute_batch("PRAGMA journal_mode = WAL;")?;
        let bounds = SideBounds::default();
        migrate(&mut conn, &bounds)?;
        Ok(SinkDb {
            conn,
            bounds,
            stats: SinkStats::default(),
        })
    }

    /// Keep the side tables within `b` from now on.
    pub fn set_side_bounds(&mut self, b: SideBounds) {
        self.bounds = b;
    }

    /// Store one delivery in its own transaction. Returns the event id when
    /// it was stored as an event (first or again).
    pub fn store(&mut self, topic: &str, payload: &[u8]) -> rusqlite::Result<Option<String>> {
        let now = crate::event::envelope::wall_clock_ms().0;
        let it = Item::new(topic, payload);
        let tx = self.conn.transaction()?;
        let one = store_in(&tx, &it, now, &self.bounds)?;
        let mut delta = one.stats;
        delta.side_dropped += trim_sides(&tx, &self.bounds, one.side)?;
        let arrivals = book::arrivals(std::slice::from_ref(&it), &[one.fate]);
        book::record(&mut SqliteBooks { tx: &tx }, &arrivals, now)?;
        tx.commit()?;
        self.stats += delta;
        Ok(one.event_id)
    }

    /// The slowest first delivery: max(first receipt - reading time), ms.
    pub fn slowest_ms(&self) -> rusqlite::Result<Option<i64>> {
        self.conn
            .query_row("SELECT max(first_ms - ts_ms) FROM received", [], |r| {
                r.get(0)
            })
    }

    /// Whether `event_id` of `device_id` was received, with its payload digest.
    pub fn digest_of(&self, device_id: &str, event_id: &str) -> rusqlite::Result<Option<Vec<u8>>> {
        self.conn
            .query_row(
                "SELECT digest FROM received WHERE device_id = ?1 AND event_id = ?2",
                params![device_id, event_id],
                |r| r.get(0),
            )
            .optional()
    }
}

impl Store for SinkDb {
    /// One `IMMEDIATE` transaction for the batch. Every error is fatal: a
    /// file the sink cannot write will not heal by retrying.
    fn commit(&mut self, items: &[Item], now_ms: i64) -> Result<Stored, StoreError> {
        let fatal = |e: rusqlite::Error| StoreError::Fatal(format!("sink database: {e}"));
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(fatal)?;
        let mut out = Stored::default();
        let mut sides = Sides::default();
        for it in items {
            let one = store_in(&tx, it, now_ms, &self.bounds).map_err(fatal)?;
            out.stats += one.stats;
            out.fates.push(one.fate);
            sides.add(one.side);
        }
        out.stats.side_dropped += trim_sides(&tx, &self.bounds, sides).map_err(fatal)?;
        let arrivals = book::arrivals(items, &out.fates);
        book::record(&mut SqliteBooks { tx: &tx }, &arrivals, now_ms).map_err(fatal)?;
        tx.commit().map_err(fatal)?;
        self.stats += out.stats;
        Ok(out)
    }

    /// One `IMMEDIATE` transaction for the notes.
    fn notes(
        &mut self,
        notes: &[BoardNote],
        asking: bool,
        now_ms: i64,
    ) -> Result<book::NotesDone, StoreError> {
        let fatal = |e: rusqlite::Error| StoreError::Fatal(format!("sink database: {e}"));
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(fatal)?;
        let done = book::apply_notes(&mut SqliteBooks { tx: &tx }, notes, asking, now_ms)
            .map_err(fatal)?;
        tx.commit().map_err(fatal)?;
        Ok(done)
    }

    fn ledger_summary(&mut self) -> Result<LedgerSummary, StoreError> {
        self.conn
            .query_row(super::LEDGER_SUMMARY, [], |r| {
                Ok(LedgerSummary {
                    boards_with_gaps: r.get::<_, i64>(0)?.max(0) as u64,
                    rows_missing: r.get::<_, i64>(1)?.max(0) as u64,
                    oldest_gap_since_ms: r.get(2)?,
                    rows_gone: r.get::<_, i64>(3)?.max(0) as u64,
                })
            })
            .map_err(|e| StoreError::Fatal(format!("sink database: {e}")))
    }
}

/// Bring the file to [`VERSION`], in one `IMMEDIATE` transaction (a second
/// sink opening the file meanwhile waits, then finds it done).
///
/// Errors: SQLite's, or a file of a newer schema.
pub fn migrate(conn: &mut Connection, b: &SideBounds) -> Result<(), OpenError> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let found: i32 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found > VERSION {
        return Err(OpenError::Newer {
            found,
            known: VERSION,
        });
    }
    let old: bool = tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'received')",
        [],
        |r| r.get(0),
    )?;
    if found < 2 {
        match old {
            true => v1_to_v2(&tx, b)?,
            false => tx.execute_batch(SCHEMA_V2)?,
        }
    }
    if found < 3 {
        v2_to_v3(&tx)?;
    }
    if found < 4 {
        tx.execute_batch(super::sqlite_clock::V3_TO_V4)?;
    }
    if found < 5 {
        tx.execute_batch(ledger_sql::V4_TO_V5)?;
        let n = ledger_sql::fill(&tx, crate::event::envelope::wall_clock_ms().0)?;
        if n > 0 {
            log::info!("sink: the ledger starts from the {n} events already stored");
        }
    }
    if found < VERSION && old {
        trim_sides(&tx, b, Sides::ALL)?;
        log::info!("sink: SQLite schema migrated to version {VERSION}");
    }
    tx.commit()?;
    Ok(())
}

/// Version 2 to 3 ([`V2_TO_V3`]): each `forged` row's device taken from
/// its topic ([`super::identity::publisher`]).
fn v2_to_v3(tx: &Transaction<'_>) -> rusqlite::Result<()> {
    tx.execute_batch(V2_TO_V3)?;
    let rows: Vec<(i64, String)> = {
        let mut st = tx.prepare("SELECT rowid, topic FROM forged")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let mut set = tx.prepare("UPDATE forged SET device_id = ?1 WHERE rowid = ?2")?;
    for (rowid, topic) in rows {
        set.execute(params![super::identity::publisher(&topic), rowid])?;
    }
    Ok(())
}

/// Version 1 (no version) to 2: `received` keyed by (device, event id),
/// its device and stream taken from each row's topic (the payload's claim
/// is not trusted; a topic naming none gives `''`); `mismatches` with the
/// device of the stored event, payloads cut to the bound.
fn v1_to_v2(tx: &Transaction<'_>, b: &SideBounds) -> rusqlite::Result<()> {
    tx.execute_batch(
        "ALTER TABLE received RENAME TO received_v1;
         ALTER TABLE mismatches RENAME TO mismatches_v1;",
    )?;
    tx.execute_batch(SCHEMA_V2)?;
    {
        let mut read = tx.prepare(
            "SELECT event_id, topic, digest, payload, ts_ms, first_ms, deliveries
             FROM received_v1 ORDER BY rowid",
        )?;
        let mut write = tx.prepare(
            "INSERT INTO received (device_id, event_id, stream, topic, digest, payload,
                                   ts_ms, first_ms, deliveries)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let topic: String = r.get(1)?;
            let (device, stream) = super::identity::of_topic(&topic)
                .map(|t| (t.device.to_owned(), t.stream.to_owned()))
                .unwrap_or_default();
            let (id, digest, payload): (String, Vec<u8>, Vec<u8>) =
                (r.get(0)?, r.get(2)?, r.get(3)?);
            let (ts, first, n): (Option<i64>, i64, i64) = (r.get(4)?, r.get(5)?, r.get(6)?);
            write.execute(params![
                device, id, stream, topic, digest, payload, ts, first, n
            ])?;
        }
    }
    tx.execute(
        "INSERT INTO mismatches (device_id, event_id, digest, payload, payload_bytes, topic, at_ms)
         SELECT coalesce((SELECT r.device_id FROM received r WHERE r.event_id = m.event_id
                          LIMIT 1), ''),
                m.event_id, m.digest, substr(m.payload, 1, ?1), length(m.payload), '', m.at_ms
         FROM mismatches_v1 m ORDER BY m.rowid",
        params![b.payload_bytes as i64],
    )?;
    tx.execute_batch("DROP TABLE received_v1; DROP TABLE mismatches_v1;")?;
    Ok(())
}

/// The side tables a batch added rows to.
#[derive(Debug, Clone, Copy, Default)]
struct Sides {
    mismatches: bool,
    forged: bool,
    unreadable: bool,
    clock_refused: bool,
}

impl Sides {
    const ALL: Sides = Sides {
        mismatches: true,
        forged: true,
        unreadable: true,
        clock_refused: true,
    };

    fn add(&mut self, o: Sides) {
        self.mismatches |= o.mismatches;
        self.forged |= o.forged;
        self.unreadable |= o.unreadable;
        self.clock_refused |= o.clock_refused;
    }
}

/// Rows of one device beyond its bounds (`?1` rows, `?2` payload bytes):
/// its oldest.
const TRIM_DEVICE: &str = "
DELETE FROM {t} WHERE rowid IN (
    SELECT r FROM (
        SELECT rowid AS r, row_number() OVER w AS n, sum(length(payload)) OVER w AS b
        FROM {t} WINDOW w AS (PARTITION BY device_id ORDER BY rowid DESC)
    ) WHERE n > ?1 OR b > ?2)";

/// Rows beyond the table's bounds (`?1` rows, `?2` payload bytes): rows
/// ranked by how new they are within their device (`k`), every device's
/// newest first, then its second newest, ...; what is past the bounds in
/// that order goes, so the devices holding the most lose rows first.
const TRIM_TABLE: &str = "
DELETE FROM {t} WHERE rowid IN (
    SELECT r FROM (
        SELECT r, row_number() OVER o AS n, sum(len) OVER o AS b
        FROM (SELECT rowid AS r, length(payload) AS len,
                     row_number() OVER (PARTITION BY device_id ORDER BY rowid DESC) AS k
              FROM {t})
        WINDOW o AS (ORDER BY k, r DESC)
    ) WHERE n > ?1 OR b > ?2)";

/// Drop rows beyond the bounds of each side table in `sides` (per device,
/// then the table's, see [`SideBounds`]), counted in `side_drops`;
/// returns how many went.
fn trim_sides(tx: &Transaction<'_>, b: &SideBounds, sides: Sides) -> rusqlite::Result<u64> {
    let mut gone = 0;
    for (on, table) in [
        (sides.mismatches, "mismatches"),
        (sides.forged, "forged"),
        (sides.unreadable, "unreadable"),
        (sides.clock_refused, "clock_refused"),
    ] {
        if !on {
            continue;
        }
        let mut n = tx.execute(
            &TRIM_DEVICE.replace("{t}", table),
            params![b.device_rows, b.device_bytes],
        )? as u64;
        n += tx.execute(
            &TRIM_TABLE.replace("{t}", table),
            params![b.rows, b.table_bytes],
        )? as u64;
        if n > 0 {
            tx.execute(
                "INSERT INTO side_drops (side, dropped) VALUES (?1, ?2)
                 ON CONFLICT(side) DO UPDATE SET dropped = dropped + excluded.dropped",
                params![table, n as i64],
            )?;
        }
        gone += n;
    }
    Ok(gone)
}

/// What became of one delivery in [`store_in`].
struct One {
    event_id: Option<String>,
    stats: SinkStats,
    fate: Fate,
    side: Sides,
}

impl One {
    fn of(fate: Fate, event_id: Option<String>) -> One {
        let mut stats = SinkStats::default();
        match fate {
            Fate::First => stats.first = 1,
            Fate::Duplicate => stats.duplicates = 1,
            Fate::Mismatch => stats.mismatches = 1,
            Fate::Unreadable => stats.unreadable = 1,
            Fate::Forged => stats.forged = 1,
        }
        let side = Sides {
            mismatches: fate == Fate::Mismatch,
            forged: fate == Fate::Forged,
            unreadable: fate == Fate::Unreadable,
            clock_refused: false,
        };
        One {
            event_id,
            stats,
            fate,
            side,
        }
    }
}

/// Store one delivery inside `tx`. This store reads envelopes leniently
/// (an event id is enough, see [`envelope_identity`]); identity comes from
/// the topic either way, and a device or stream the payload names must be
/// the topic's.
fn store_in(tx: &Transaction<'_>, it: &Item, now: i64, b: &SideBounds) -> rusqlite::Result<One> {
    match &it.read {
        // A batch that could not be unpacked, or a delivery too large to
        // read: its bytes are no envelope, whatever they happen to parse as.
        Err(e @ (Unreadable::Batch(_) | Unreadable::Oversized { .. })) => {
            return unreadable(tx, it, &e.to_string(), now, b)
        }
        Err(Unreadable::Forged(why)) => return forged(tx, it, why, now, b),
        _ => {}
    }
    let (event_id, ts_ms) = match &it.read {
        Ok(e) => (e.event_id.clone(), Some(e.ts_ms)),
        Err(e) => {
            let Some(found) = envelope_identity(&it.payload) else {
                return unreadable(tx, it, &e.to_string(), now, b);
            };
            let (dev, stream) = envelope_claims(&it.payload);
            let claims = (dev.as_deref(), stream.as_deref());
            if let Err(Unreadable::Forged(why)) =
                super::identity::check_claims(&it.topic, claims.0, claims.1)
            {
                return forged(tx, it, &why, now, b);
            }
            found
        }
    };
    let Some(t) = super::identity::of_topic(&it.topic) else {
        return forged(tx, it, "topic names no device and stream", now, b);
    };
    let digest = Sha256::digest(&it.payload).to_vec();
    let c = super::sqlite_clock::columns(tx, t.device, it.read.as_ref().ok())?;
    let inserted = tx.execute(
        "INSERT INTO received (device_id, event_id, stream, topic, digest, payload, ts_ms, first_ms,
                               clock_trusted, boot_id, mono_ms, ts_corrected_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
         ON CONFLICT(device_id, event_id) DO NOTHING",
        params![
            t.device,
            event_id,
            t.stream,
            it.topic,
            digest,
            it.payload,
            ts_ms,
            now,
            c.trusted,
            c.boot_id,
            c.mono_ms,
            c.corrected_ms
        ],
    )?;
    if inserted == 1 {
        let mut one = One::of(Fate::First, Some(event_id));
        one.stats.corrected = u64::from(c.corrected_ms.is_some());
        if let Some(e) = it.read.as_ref().ok().filter(|e| super::clock::is_anchor(e)) {
            match super::sqlite_clock::anchor_stored(tx, t.device, e, now)? {
                Ok(moved) => {
                    one.stats.anchors = 1;
                    one.stats.corrected += moved;
                }
                Err(why) => {
                    log::warn!("sink: clock anchor on {} kept aside: {why}", it.topic);
                    set_aside(tx, "clock_refused", it, &why.to_string(), now, b)?;
                    one.stats.anchors_refused = 1;
                    one.side.clock_refused = true;
                }
            }
        }
        return Ok(one);
    }
    let key = params![t.device, event_id];
    let stored: Option<Vec<u8>> = tx
        .query_row(
            "SELECT digest FROM received WHERE device_id = ?1 AND event_id = ?2",
            key,
            |r| r.get(0),
        )
        .optional()?;
    tx.execute(
        "UPDATE received SET deliveries = deliveries + 1 WHERE device_id = ?1 AND event_id = ?2",
        key,
    )?;
    if stored.as_deref() == Some(digest.as_slice()) {
        return Ok(One::of(Fate::Duplicate, Some(event_id)));
    }
    tx.execute(
        "INSERT INTO mismatches (device_id, event_id, digest, payload, payload_bytes, topic, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            t.device,
            event_id,
            digest,
            b.cut(&it.payload),
            it.payload.len() as i64,
            it.topic,
            now
        ],
    )?;
    Ok(One::of(Fate::Mismatch, Some(event_id)))
}

/// Keep a forged delivery in `forged`, cut to the bounds.
fn forged(
    tx: &Transaction<'_>,
    it: &Item,
    why: &str,
    now: i64,
    b: &SideBounds,
) -> rusqlite::Result<One> {
    log::warn!("sink: set aside a delivery on {}: {why}", it.topic);
    set_aside(tx, "forged", it, why, now, b)?;
    Ok(One::of(Fate::Forged, None))
}

/// Keep a delivery that is no envelope (or too large to read) in
/// `unreadable`, cut to the bounds.
fn unreadable(
    tx: &Transaction<'_>,
    it: &Item,
    why: &str,
    now: i64,
    b: &SideBounds,
) -> rusqlite::Result<One> {
    set_aside(tx, "unreadable", it, why, now, b)?;
    let mut one = One::of(Fate::Unreadable, None);
    one.stats.oversized = u64::from(it.is_oversized());
    Ok(one)
}

/// A row of `forged` or `unreadable`: the publisher, the topic, the
/// payload cut to the bounds and its delivered length, the reason.
fn set_aside(
    tx: &Transaction<'_>,
    table: &str,
    it: &Item,
    why: &str,
    now: i64,
    b: &SideBounds,
) -> rusqlite::Result<()> {
    tx.execute(
        &format!(
            "INSERT INTO {table} (device_id, topic, payload, payload_bytes, reason, at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
        ),
        params![
            it.publisher,
            it.topic,
            b.cut(&it.payload),
            it.delivered_bytes() as i64,
            why,
            now
        ],
    )?;
    Ok(())
}

/// Event id and reading time of an edgespool envelope (JSON, else postcard).
pub fn envelope_identity(payload: &[u8]) -> Option<(String, Option<i64>)> {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
        let id = v.get("event_id")?.as_str()?.to_owned();
        return Some((id, v.get("ts_ms").and_then(|t| t.as_i64())));
    }
    let c: crate::event::envelope::CompactEnvelope = postcard::from_bytes(payload).ok()?;
    Some((
        crate::event::envelope::EventId(c.event_id).hyphenated(),
        Some(c.ts_ms),
    ))
}

/// The device id and stream an envelope names, where it names them.
fn envelope_claims(payload: &[u8]) -> (Option<String>, Option<String>) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
        let text = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
        return (text("device_id"), text("stream"));
    }
    match postcard::from_bytes::<crate::event::envelope::CompactEnvelope>(payload) {
        Ok(c) => (Some(c.device_id), Some(c.stream)),
        Err(_) => (None, None),
    }
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
        let t = "p/d/events/s";
        assert_eq!(db.store(t, a).unwrap().as_deref(), Some("e-1"));
        db.store(t, a).unwrap();
        db.store(t, b).unwrap();
        db.store(t, b"not an envelope").unwrap();
        assert_eq!(
            db.stats,
            SinkStats {
                first: 1,
                duplicates: 1,
                mismatches: 1,
                unreadable: 1,
                ..Default::default()
            }
        );
        assert!(db.digest_of("d", "e-1").unwrap().is_some());
    }

    #[test]
    fn identity_is_the_topics_and_keys_are_per_device() {
        let d = tempfile::tempdir().unwrap();
        let mut db = SinkDb::open(&d.path().join("sink.db")).unwrap();
        let env = |dev: &str| {
            format!(r#"{{"event_id":"e-1","device_id":"{dev}","stream":"s","ts_ms":5}}"#)
        };
        // gw1's event, and evil's claiming to be gw1's: set aside.
        assert!(db
            .store("p/gw1/events/s", env("gw1").as_bytes())
            .unwrap()
            .is_some());
        assert!(db
            .store("p/evil/events/s", env("gw1").as_bytes())
            .unwrap()
            .is_none());
        // A topic naming no device, and a stream that is not the topic's.
        assert!(db
            .store("elsewhere", env("gw1").as_bytes())
            .unwrap()
            .is_none());
        assert!(db
            .store("p/gw1/events/t", env("gw1").as_bytes())
            .unwrap()
            .is_none());
        // The same event id from evil, as evil: its own event, not a mismatch.
        assert!(db
            .store("p/evil/events/s", env("evil").as_bytes())
            .unwrap()
            .is_some());
        assert_eq!(
            (db.stats.first, db.stats.forged, db.stats.mismatches),
            (2, 3, 0)
        );
        let n: i64 = db
            .conn
            .query_row("SELECT count(*) FROM forged", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 3);
    }

    /// Rows of `forged` per device, by device.
    fn forged_per_device(db: &SinkDb) -> Vec<(String, i64)> {
        let mut st = db
            .conn
            .prepare("SELECT device_id, count(*) FROM forged GROUP BY device_id ORDER BY device_id")
            .unwrap();
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(|r| r.unwrap()).collect()
    }

    #[test]
    fn one_devices_junk_evicts_only_its_own_rows_and_the_table_bound_takes_from_the_largest() {
        let d = tempfile::tempdir().unwrap();
        let mut db = SinkDb::open(&d.path().join("sink.db")).unwrap();
        db.set_side_bounds(SideBounds {
            rows: 10,
            payload_bytes: 100,
            table_bytes: 1 << 20,
            device_rows: 4,
            device_bytes: 1 << 20,
        });
        let claim = |i: u32| format!(r#"{{"event_id":"e-{i}","device_id":"gw1"}}"#);
        db.store("p/a/events/s", claim(0).as_bytes()).unwrap();
        db.store("p/b/events/s", claim(1).as_bytes()).unwrap();
        for i in 0..20 {
            db.store("p/junk/events/s", claim(100 + i).as_bytes())
                .unwrap();
        }
        let n = |v: &[(String, i64)], dev: &str| {
            v.iter().find(|(d, _)| d == dev).map_or(0, |(_, n)| *n)
        };
        let v = forged_per_device(&db);
        assert_eq!((n(&v, "a"), n(&v, "b"), n(&v, "junk")), (1, 1, 4), "{v:?}");
        // Six more devices, two rows each: 18 rows for a table of 10. Every
        // device keeps its newest; a and b, holding one each, lose nothing.
        for dev in 0..6 {
            for i in 0..2 {
                db.store(&format!("p/d{dev}/events/s"), claim(200 + i).as_bytes())
                    .unwrap();
            }
        }
        let v = forged_per_device(&db);
        assert_eq!(v.iter().map(|(_, n)| n).sum::<i64>(), 10, "{v:?}");
        assert_eq!((n(&v, "a"), n(&v, "b")), (1, 1), "{v:?}");
        assert!(v.iter().all(|(_, n)| *n >= 1 && *n <= 2), "{v:?}");
        assert_eq!(db.stats.side_dropped, 16 + 8);
    }

    #[test]
    fn a_version_2_file_gets_unreadable_and_the_device_of_each_forged_row() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sink.db");
        {
            let c = Connection::open(&path).unwrap();
            c.execute_batch(SCHEMA_V2).unwrap();
            for t in ["p/evil/events/s", "p/evil/events/gw1/events/s", "odd"] {
                c.execute(
                    "INSERT INTO forged (topic, payload, payload_bytes, reason, at_ms)
                     VALUES (?1, x'00', 1, 'r', 0)",
                    [t],
                )
                .unwrap();
            }
        }
        let db = SinkDb::open(&path).unwrap();
        let v: i32 = db
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, VERSION);
        assert_eq!(
            forged_per_device(&db),
            vec![("".to_owned(), 1), ("evil".to_owned(), 2)]
        );
        let n: i64 = db
            .conn
            .query_row("SELECT count(*) FROM unreadable", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
    }

    #[test]
    fn an_unreadable_or_oversized_delivery_is_kept_with_its_topic_size_and_reason() {
        let d = tempfile::tempdir().unwrap();
        let mut db = SinkDb::open(&d.path().join("sink.db")).unwrap();
        let big = vec![b'x'; 200_000];
        let items = [
            Item::new("p/a/events/s", b"not an envelope"),
            Item::oversized("p/a/events/s", &big, 200_010, 100_000),
        ];
        let s = db.commit(&items, 7).unwrap();
        assert_eq!((s.stats.unreadable, s.stats.oversized), (2, 1));
        let rows: Vec<(String, i64, i64, String)> = {
            let mut st = db
                .conn
                .prepare(
                    "SELECT device_id, length(payload), payload_bytes, reason
                     FROM unreadable ORDER BY rowid",
                )
                .unwrap();
            let rows = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .unwrap();
            rows.map(|r| r.unwrap()).collect()
        };
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].0.as_str(), rows[0].2), ("a", 15));
        assert!(rows[0].3.contains("not an edgespool envelope"), "{rows:?}");
        assert_eq!((rows[1].1, rows[1].2), (64 << 10, 200_000));
        assert!(rows[1].3.contains("200010") && rows[1].3.contains("oversized"));
    }

    #[test]
    fn side_tables_keep_the_newest_within_their_bounds() {
        let d = tempfile::tempdir().unwrap();
        let mut db = SinkDb::open(&d.path().join("sink.db")).unwrap();
        db.set_side_bounds(SideBounds {
            rows: 5,
            payload_bytes: 100,
            table_bytes: 350,
            ..SideBounds::default()
        });
        for i in 0..20 {
            let p = format!(
                r#"{{"event_id":"e-{i}","device_id":"gw1","pad":"{}"}}"#,
                "x".repeat(200)
            );
            db.store("p/evil/events/s", p.as_bytes()).unwrap();
        }
        let kept: Vec<(i64, String)> = {
            let mut st = db
                .conn
                .prepare("SELECT payload_bytes, CAST(payload AS TEXT) FROM forged ORDER BY rowid")
                .unwrap();
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
            rows.map(|r| r.unwrap()).collect()
        };
        // 100 bytes each, 350 per table: the newest three.
        assert_eq!(kept.len(), 3, "{kept:?}");
        assert!(kept.iter().all(|(n, p)| *n > 200 && p.len() == 100));
        assert!(kept[2].1.contains("e-19"), "{kept:?}");
        assert_eq!(db.stats.side_dropped, 17);
        assert_eq!(db.stats.forged, 20);
    }

    /// Version 3 through 4 (true time: `sqlite_clock`'s migration) and 5
    /// (the replay ledger).
    #[test]
    fn a_version_3_file_gets_the_clock_columns_and_keeps_its_rows() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sink.db");
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch(&format!("{SCHEMA_V2}{V2_TO_V3}")).unwrap();
            c.execute(
                "INSERT INTO received (device_id, event_id, stream, topic, digest, payload, ts_ms, first_ms)
                 VALUES ('gw', 'e', 's', 'p/gw/events/s', x'00', x'00', 5, 6)",
                [],
            )
            .unwrap();
        }
        SinkDb::open(&path).unwrap();
        let c = rusqlite::Connection::open(&path).unwrap();
        let v: i32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        // Through version 4 (these columns) and 5 (the replay ledger).
        assert_eq!(v, VERSION);
        let lines: i64 = c
            .query_row("SELECT count(*) FROM ledger", [], |r| r.get(0))
            .unwrap();
        assert_eq!(lines, 0, "a payload that is no envelope counts nowhere");
        let row: (i64, Option<String>, Option<i64>) = c
            .query_row(
                "SELECT ts_ms, boot_id, ts_corrected_ms FROM received",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(row, (5, None, None));
    }
}
