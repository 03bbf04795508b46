//! The SQLite store's share of true time ([`super::clock`]): a reading's
//! clock columns at its insert, and what a clock anchor does when it is
//! first stored.
//!
//! Its one rule, the store's: nothing here writes over a payload or
//! `ts_ms`; a reading's `ts_corrected_ms` is set once, by the first
//! anchor believed for its boot, either at the reading's insert (the
//! anchor came first) or by that anchor's update (the reading came first).
//! One writer at a time holds the file (`IMMEDIATE`), so the two cannot
//! miss each other.

use super::clock::{self, Refused};
use super::message::Event;
use crate::event::clock::{Anchor, BootId, MonoStamp, CLOCK_STREAM};
use rusqlite::{params, OptionalExtension, Transaction};

/// Version 3 to 4: true time. `received` gets the clock columns of each
/// event (`clock_trusted`, `boot_id` as 32 hex digits, `mono_ms`, and
/// `ts_corrected_ms`, set for a reading an anchor moved); `received_boot`
/// finds a boot's stamped readings (only stamped rows are in it);
/// `clock_anchors` holds the anchor believed per (device, boot);
/// `clock_refused` the anchors kept aside, with their reason.
pub(super) const V3_TO_V4: &str = "
ALTER TABLE received ADD COLUMN clock_trusted INTEGER;
ALTER TABLE received ADD COLUMN boot_id TEXT;
ALTER TABLE received ADD COLUMN mono_ms INTEGER;
ALTER TABLE received ADD COLUMN ts_corrected_ms INTEGER;
CREATE INDEX received_boot ON received (device_id, boot_id, mono_ms) WHERE boot_id IS NOT NULL;
CREATE TABLE clock_anchors (
    device_id  TEXT NOT NULL,
    boot_id    TEXT NOT NULL,
    mono_ms    INTEGER NOT NULL,
    wall_ms    INTEGER NOT NULL,
    event_id   TEXT NOT NULL,
    at_ms      INTEGER NOT NULL,
    PRIMARY KEY (device_id, boot_id)
);
CREATE TABLE clock_refused (
    device_id     TEXT NOT NULL,
    topic         TEXT NOT NULL,
    payload       BLOB NOT NULL,
    payload_bytes INTEGER NOT NULL,
    reason        TEXT NOT NULL,
    at_ms         INTEGER NOT NULL
);
PRAGMA user_version = 4;
";

/// Readings of a boot taken before its anchor (`?3` mono, `?4` wall) whose
/// time was off: moved to `?4 - (?3 - mono_ms)`. [`clock::MOVE_MS`] is `?5`.
const MOVE_READINGS: &str = "
UPDATE received SET ts_corrected_ms = ?4 - (?3 - mono_ms)
WHERE device_id = ?1 AND boot_id = ?2 AND mono_ms <= ?3 AND ts_corrected_ms IS NULL
  AND stream <> ?6
  AND (clock_trusted = 0 OR abs(?4 - (?3 - mono_ms) - ts_ms) > ?5)";

/// The clock columns of one event as `received` stores them.
#[derive(Debug, Default)]
pub(super) struct Columns {
    pub(super) trusted: Option<bool>,
    pub(super) boot_id: Option<String>,
    pub(super) mono_ms: Option<i64>,
    pub(super) corrected_ms: Option<i64>,
}

/// The clock columns of `e` (of `device`, the topic's), its corrected time
/// taken from the anchor believed for its boot if there is one. `None`
/// (an envelope read leniently): all empty.
pub(super) fn columns(
    tx: &Transaction<'_>,
    device: &str,
    e: Option<&Event>,
) -> rusqlite::Result<Columns> {
    let Some(e) = e else {
        return Ok(Columns::default());
    };
    let mut c = Columns {
        trusted: Some(e.clock_trusted),
        ..Columns::default()
    };
    let Some(m) = e.mono else {
        return Ok(c);
    };
    c.boot_id = Some(m.boot_id.simple());
    c.mono_ms = Some(m.mono_ms as i64);
    if e.stream != CLOCK_STREAM {
        if let Some(a) = believed(tx, device, &m.boot_id)? {
            c.corrected_ms = clock::corrected(&a, e.ts_ms, e.clock_trusted, &m);
        }
    }
    Ok(c)
}

/// The anchor believed for `device`'s boot `boot`, if any.
fn believed(tx: &Transaction<'_>, device: &str, boot: &BootId) -> rusqlite::Result<Option<Anchor>> {
    tx.prepare_cached(
        "SELECT mono_ms, wall_ms FROM clock_anchors WHERE device_id = ?1 AND boot_id = ?2",
    )?
    .query_row(params![device, boot.simple()], |r| {
        let (mono, wall): (i64, i64) = (r.get(0)?, r.get(1)?);
        Ok(Anchor {
            at: MonoStamp {
                boot_id: *boot,
                mono_ms: mono.max(0) as u64,
            },
            wall_ms: wall,
        })
    })
    .optional()
}

/// What a clock anchor `e` of `device`, stored for the first time at the
/// sink's clock `now`, did: `Ok(n)` believed, `n` readings moved (0 for an
/// anchor agreeing with the one already believed); `Err` kept aside (by
/// the caller) with the reason.
pub(super) fn anchor_stored(
    tx: &Transaction<'_>,
    device: &str,
    e: &Event,
    now: i64,
) -> rusqlite::Result<Result<u64, Refused>> {
    let a = match clock::anchor_of(e) {
        Ok(a) => a,
        Err(r) => return Ok(Err(r)),
    };
    let stored = believed(tx, device, &a.at.boot_id)?;
    match clock::judge(&a, stored.as_ref(), now) {
        Err(r) => return Ok(Err(r)),
        Ok(false) => return Ok(Ok(0)),
        Ok(true) => {}
    }
    let boot = a.at.boot_id.simple();
    let mono = a.at.mono_ms as i64;
    let moved = tx.execute(
        MOVE_READINGS,
        params![device, boot, mono, a.wall_ms, clock::MOVE_MS, CLOCK_STREAM],
    )? as u64;
    tx.execute(
        "INSERT INTO clock_anchors (device_id, boot_id, mono_ms, wall_ms, event_id, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![device, boot, mono, a.wall_ms, e.event_id, now],
    )?;
    log::info!(
        "sink: clock anchor of {device} boot {boot} believed; {moved} readings taken before it moved to true time"
    );
    Ok(Ok(moved))
}

#[cfg(test)]
mod tests {
    use super::super::{SinkDb, Store};
    use crate::event::clock::{Anchor, BootId, MonoStamp, CLOCK_STREAM};
    use crate::event::envelope::{encode, Envelope, EventId, Format};
    use crate::event::reading::FieldValue;
    use crate::sink::batch::Item;
    use rusqlite::Connection;

    const BOOT: BootId = BootId([0x42; 16]);
    /// The sink's clock: 2026-12-05T02:00:00Z.
    const NOW: i64 = 1_796_436_000_000;
    const HOUR: i64 = 3_600_000;

    fn payload(
        seq: u64,
        stream: &str,
        ts_ms: i64,
        trusted: bool,
        mono: Option<MonoStamp>,
    ) -> Vec<u8> {
        let fields = vec![("x".to_owned(), FieldValue::Num(seq as f64))];
        let a;
        let fields = match (stream, mono) {
            (CLOCK_STREAM, Some(m)) => {
                a = Anchor {
                    at: m,
                    wall_ms: ts_ms,
                }
                .fields(1000);
                &a
            }
            _ => &fields,
        };
        let env = Envelope {
            event_id: EventId([seq as u8; 16]),
            device_id: "gw",
            stream,
            seq,
            ts_ms,
            clock_trusted: trusted,
            mono,
            fields,
        };
        encode(
            if seq.is_multiple_of(2) {
                Format::Json
            } else {
                Format::Postcard
            },
            &env,
        )
        .unwrap()
    }

    fn at(mono_ms: u64) -> Option<MonoStamp> {
        Some(MonoStamp {
            boot_id: BOOT,
            mono_ms,
        })
    }

    /// `ts_corrected_ms` of stream `s`'s rows, in seq order (their event
    /// ids are their seq repeated).
    fn corrected(path: &std::path::Path) -> Vec<Option<i64>> {
        let c = Connection::open(path).unwrap();
        let mut st = c
            .prepare("SELECT ts_corrected_ms FROM received WHERE stream = 's' ORDER BY event_id")
            .unwrap();
        let rows = st.query_map([], |r| r.get(0)).unwrap();
        rows.map(|r| r.unwrap()).collect()
    }

    #[test]
    fn readings_before_the_anchor_are_corrected_whichever_comes_first_and_the_payload_stays() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sink.db");
        let mut db = SinkDb::open(&path).unwrap();
        // Boot + 10 s, + 20 s: the clock 3 h behind, then 3 h ahead; the
        // anchor at + 600 s on the true clock; boot + 30 s arrives after
        // the anchor (a backlog), boot + 700 s was taken after it.
        let true_at = |mono: i64| NOW - 600_000 + mono;
        let early = [
            Item::new(
                "p/gw/events/s",
                &payload(10, "s", true_at(10_000) - 3 * HOUR, true, at(10_000)),
            ),
            Item::new(
                "p/gw/events/s",
                &payload(11, "s", true_at(20_000) + 3 * HOUR, true, at(20_000)),
            ),
            // An old envelope, no stamp: stored as before.
            Item::new("p/gw/events/s", &payload(12, "s", 5, false, None)),
        ];
        let s = db.commit(&early, NOW).unwrap();
        assert_eq!((s.stats.first, s.stats.corrected), (3, 0));
        let anchor = payload(13, CLOCK_STREAM, NOW, true, at(600_000));
        let s = db
            .commit(&[Item::new("p/gw/events/_clock", &anchor)], NOW)
            .unwrap();
        assert_eq!((s.stats.anchors, s.stats.corrected), (1, 2));
        let late = [
            Item::new("p/gw/events/s", &payload(14, "s", 9, false, at(30_000))),
            Item::new(
                "p/gw/events/s",
                &payload(15, "s", true_at(700_000), true, at(700_000)),
            ),
        ];
        let s = db.commit(&late, NOW).unwrap();
        assert_eq!(s.stats.corrected, 1);
        assert_eq!(
            corrected(&path),
            vec![
                Some(true_at(10_000)),
                Some(true_at(20_000)),
                None,
                Some(true_at(30_000)),
                None
            ]
        );
        let c = Connection::open(&path).unwrap();
        let same: i64 = c
            .query_row(
                "SELECT count(*) FROM received WHERE payload = ?1",
                [payload(
                    10,
                    "s",
                    true_at(10_000) - 3 * HOUR,
                    true,
                    at(10_000),
                )],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(same, 1, "the stored payload is the bytes sent");
    }

    #[test]
    fn a_bad_anchor_is_kept_aside_with_its_reason_and_moves_nothing() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sink.db");
        let mut db = SinkDb::open(&path).unwrap();
        let reading = payload(2, "s", NOW - 4 * HOUR, false, at(10_000));
        db.commit(&[Item::new("p/gw/events/s", &reading)], NOW)
            .unwrap();
        let other_boot = {
            // Fields of boot 0x42, envelope of boot 0x43.
            let f = Anchor {
                at: at(600_000).unwrap(),
                wall_ms: NOW,
            }
            .fields(1000);
            let env = Envelope {
                event_id: EventId([3; 16]),
                device_id: "gw",
                stream: CLOCK_STREAM,
                seq: 3,
                ts_ms: NOW,
                clock_trusted: true,
                mono: Some(MonoStamp {
                    boot_id: BootId([0x43; 16]),
                    mono_ms: 600_000,
                }),
                fields: &f,
            };
            encode(Format::Json, &env).unwrap()
        };
        let bad = [
            other_boot,
            // A boot that began in 1999, a wall time two days ahead.
            payload(4, CLOCK_STREAM, 946_684_800_000, true, at(600_000)),
            payload(5, CLOCK_STREAM, NOW + 2 * 86_400_000, true, at(600_000)),
        ];
        for p in &bad {
            let s = db
                .commit(&[Item::new("p/gw/events/_clock", p)], NOW)
                .unwrap();
            assert_eq!(
                (s.stats.first, s.stats.anchors_refused, s.stats.corrected),
                (1, 1, 0)
            );
        }
        // The first good anchor, then one 3 h off on the same boot.
        let good = payload(6, CLOCK_STREAM, NOW, true, at(600_000));
        let s = db
            .commit(&[Item::new("p/gw/events/_clock", &good)], NOW)
            .unwrap();
        assert_eq!((s.stats.anchors, s.stats.corrected), (1, 1));
        let contra = payload(7, CLOCK_STREAM, NOW + 3 * HOUR + 60_000, true, at(660_000));
        let s = db
            .commit(&[Item::new("p/gw/events/_clock", &contra)], NOW)
            .unwrap();
        assert_eq!(s.stats.anchors_refused, 1);
        let agree = payload(8, CLOCK_STREAM, NOW + 60_000, true, at(660_000));
        let s = db
            .commit(&[Item::new("p/gw/events/_clock", &agree)], NOW)
            .unwrap();
        assert_eq!((s.stats.anchors, s.stats.corrected), (1, 0));
        let c = Connection::open(&path).unwrap();
        let reasons: Vec<String> = c
            .prepare("SELECT reason FROM clock_refused ORDER BY rowid")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(reasons.len(), 4, "{reasons:?}");
        assert!(reasons[0].contains("another boot"), "{reasons:?}");
        assert!(reasons[1].contains("before 2020"), "{reasons:?}");
        assert!(reasons[2].contains("more than a day ahead"), "{reasons:?}");
        assert!(reasons[3].contains("contradicts"), "{reasons:?}");
        let believed: (i64, i64) = c
            .query_row(
                "SELECT count(*), max(wall_ms) FROM clock_anchors",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(believed, (1, NOW));
        // Every anchor is an event of its device all the same (receipted).
        let events: i64 = c
            .query_row(
                "SELECT count(*) FROM received WHERE stream = '_clock'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(events, 6);
    }
}
