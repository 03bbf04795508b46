//! `edgespool sink`: the reference consumer.
//!
//! Subscribes to the events (QoS 1, persistent session, optionally a shared
//! subscription) and stores each event in its own SQLite file keyed by event
//! id with `INSERT .. ON CONFLICT DO NOTHING`, as a fleet's ingestion should.
//! Its one rule: **a delivery is acknowledged only after it is stored**, and
//! every event id keeps the digest of its first payload, so a second delivery
//! is counted as a duplicate, or as a payload mismatch (which must be zero:
//! I3) if its bytes differ.

use rumqttc::{Client, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use rusqlite::{params, Connection, OptionalExtension};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Sink settings.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Broker host.
    pub host: String,
    /// Broker port.
    pub port: u16,
    /// Topic filter, e.g. `edgespool/+/events/#`.
    pub filter: String,
    /// MQTT client id (a persistent session is kept under it).
    pub client_id: String,
    /// Subscribe as `$share/<group>/<filter>` to spread load over sinks.
    pub shared_group: Option<String>,
}

/// What the sink has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SinkStats {
    /// Events stored the first time.
    pub first: u64,
    /// Deliveries of an event id already stored, same payload.
    pub duplicates: u64,
    /// Deliveries of a stored event id with different payload bytes.
    pub mismatches: u64,
    /// Deliveries that were not an edgespool envelope.
    pub unreadable: u64,
}

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

    /// Store one delivery. Returns the event id when the payload was an
    /// edgespool envelope (JSON or postcard).
    pub fn store(&mut self, topic: &str, payload: &[u8]) -> rusqlite::Result<Option<String>> {
        let Some((event_id, ts_ms)) = envelope_identity(payload) else {
            self.stats.unreadable += 1;
            return Ok(None);
        };
        let digest = Sha256::digest(payload).to_vec();
        let now = crate::envelope::wall_clock_ms().0;
        let tx = self.conn.transaction()?;
        let inserted = tx.execute(
            "INSERT INTO received (event_id, topic, digest, payload, ts_ms, first_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT(event_id) DO NOTHING",
            params![event_id, topic, digest, payload, ts_ms, now],
        )?;
        if inserted == 1 {
            self.stats.first += 1;
        } else {
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
                self.stats.duplicates += 1;
            } else {
                self.stats.mismatches += 1;
                tx.execute(
                    "INSERT INTO mismatches (event_id, digest, payload, at_ms) VALUES (?1, ?2, ?3, ?4)",
                    params![event_id, digest, payload, now],
                )?;
            }
        }
        tx.commit()?;
        Ok(Some(event_id))
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

/// Run the sink until `stop`; prints a line of counts every `report` interval.
///
/// Errors: the sink's file cannot be opened or written (fatal: nothing could
/// be acknowledged safely).
pub fn run(
    opts: &SinkOptions,
    db: &mut SinkDb,
    stop: &AtomicBool,
    report: Duration,
) -> Result<(), String> {
    let mut o = MqttOptions::new(opts.client_id.clone(), opts.host.clone(), opts.port);
    o.set_clean_session(false);
    o.set_manual_acks(true);
    o.set_keep_alive(Duration::from_secs(10));
    o.set_max_packet_size(16 << 20, 1 << 20);
    let (client, mut conn) = Client::new(o, 64);
    let filter = match &opts.shared_group {
        Some(g) => format!("$share/{g}/{}", opts.filter),
        None => opts.filter.clone(),
    };
    let mut last_report = Instant::now();
    // Acks the request channel had no room for: sent before the next poll.
    // A lost ack would hold one of the broker's in-flight slots for this
    // session forever, and enough of them stall delivery to the sink.
    let mut unsent: std::collections::VecDeque<rumqttc::Publish> = Default::default();
    while !stop.load(Ordering::Relaxed) {
        while let Some(p) = unsent.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            unsent.pop_front();
        }
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(_)))) => {
                // A new connection: a packet id of the old one means nothing
                // here, and the broker sends what was not acknowledged again.
                unsent.clear();
                // rumqttc does not re-subscribe by itself.
                let _ = client.try_subscribe(filter.clone(), QoS::AtLeastOnce);
            }
            Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => {
                db.store(&p.topic, &p.payload)
                    .map_err(|e| format!("sink store: {e}"))?;
                if client.try_ack(&p).is_err() {
                    unsent.push_back(p);
                }
            }
            Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Err(e)) => {
                unsent.clear();
                log::warn!("sink: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if last_report.elapsed() >= report {
            last_report = Instant::now();
            let s = db.stats;
            log::info!(
                "sink: first {} duplicates {} mismatches {} unreadable {}",
                s.first,
                s.duplicates,
                s.mismatches,
                s.unreadable
            );
        }
    }
    let _ = client.try_disconnect();
    Ok(())
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
