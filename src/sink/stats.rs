//! `edgespool sink --stats`: what a sink's store holds, as a consumer sees it.
//!
//! Read-only. Its one rule: gaps are counted per (device, stream) between the
//! lowest and highest `seq` stored, so a gap is loss (or not yet delivered),
//! never a guess about rows before the first one seen.

use std::fmt::Write;

/// One (device, stream).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StreamRow {
    /// Device id.
    pub device_id: String,
    /// Stream name.
    pub stream: String,
    /// Distinct events stored.
    pub events: i64,
    /// Lowest `seq`.
    pub min_seq: i64,
    /// Highest `seq`.
    pub max_seq: i64,
    /// `seq` values missing between the two.
    pub missing: i64,
}

/// The whole report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Report {
    /// Per (device, stream), ordered.
    pub streams: Vec<StreamRow>,
    /// Distinct events.
    pub events: i64,
    /// Deliveries of a stored event id with the same payload.
    pub duplicates: i64,
    /// (device, event id, payload) triples that differ from the stored
    /// payload (ever set aside: the rows kept and those dropped).
    pub mismatches: i64,
    /// Deliveries that were not envelopes, oversized ones included (ever
    /// set aside; SQLite files since schema version 3).
    pub unreadable: i64,
    /// Envelopes of another device or stream than their topic's (ever set
    /// aside).
    pub forged: i64,
    /// Side-table rows dropped, oldest first, to keep the tables within
    /// their bounds (`side_drops`).
    pub side_dropped: i64,
    /// Events first stored in the last 60 s, per second.
    pub rate_last_minute: f64,
    /// Events per second between the first and last first receipt.
    pub rate_overall: f64,
}

/// The report as text: per device, then per stream, then the totals.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let mut devices: std::collections::BTreeMap<&str, (i64, i64, i64)> = Default::default();
    for s in &r.streams {
        let d = devices.entry(&s.device_id).or_default();
        *d = (d.0 + s.events, d.1 + 1, d.2 + s.missing);
    }
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>8} {:>8}",
        "device", "events", "streams", "missing"
    );
    for (dev, (n, streams, missing)) in &devices {
        let _ = writeln!(out, "{dev:<24} {n:>10} {streams:>8} {missing:>8}");
    }
    let _ = writeln!(
        out,
        "\n{:<24} {:<16} {:>10} {:>10} {:>10} {:>8}",
        "device", "stream", "events", "first seq", "last seq", "missing"
    );
    for s in &r.streams {
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:>10} {:>10} {:>10} {:>8}",
            s.device_id, s.stream, s.events, s.min_seq, s.max_seq, s.missing
        );
    }
    let _ = writeln!(
        out,
        "\nevents {}  duplicates {}  mismatches {}  unreadable {}  forged {}",
        r.events, r.duplicates, r.mismatches, r.unreadable, r.forged
    );
    let b = super::SideBounds::default();
    let _ = writeln!(
        out,
        "side tables: {} rows dropped, oldest first (bounds: {} rows and {} MiB per table, \
         {} rows and {} MiB per device, {} KiB per payload)",
        r.side_dropped,
        b.rows,
        b.table_bytes >> 20,
        b.device_rows,
        b.device_bytes >> 20,
        b.payload_bytes >> 10
    );
    let _ = writeln!(
        out,
        "ingest rate: {:.1}/s over the last minute, {:.1}/s from first to last receipt",
        r.rate_last_minute, r.rate_overall
    );
    out
}

fn rates(last_minute: i64, events: i64, span_ms: i64) -> (f64, f64) {
    let overall = if span_ms > 0 {
        events as f64 * 1000.0 / span_ms as f64
    } else {
        0.0
    };
    (last_minute as f64 / 60.0, overall)
}

/// The report of a PostgreSQL sink database, at wall-clock `now_ms`.
///
/// Errors: the queries failed (no schema yet, no permission, connection).
#[cfg(feature = "pg-sink")]
pub fn from_postgres(c: &mut postgres::Client, now_ms: i64) -> Result<Report, postgres::Error> {
    let streams = c
        .query(
            "SELECT device_id, stream, count(*), min(seq), max(seq)
             FROM events GROUP BY device_id, stream ORDER BY device_id, stream",
            &[],
        )?
        .iter()
        .map(|r| stream_row(r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let one = |c: &mut postgres::Client, sql: &str| -> Result<i64, postgres::Error> {
        Ok(c.query_one(sql, &[])?.get(0))
    };
    let events = one(c, "SELECT count(*) FROM events")?;
    let duplicates = one(c, "SELECT count(*) FROM duplicates")?;
    // `forged` and `side_drops` came with schema version 2.
    let v2: bool = c
        .query_one("SELECT to_regclass('side_drops') IS NOT NULL", &[])?
        .get(0);
    let mut dropped = std::collections::HashMap::new();
    if v2 {
        for r in c.query(
            "SELECT side, sum(dropped)::int8 FROM side_drops GROUP BY side",
            &[],
        )? {
            dropped.insert(r.get::<_, String>(0), r.get::<_, i64>(1));
        }
    }
    let ever = |table: &str, kept: i64| kept + dropped.get(table).copied().unwrap_or(0);
    let mismatches = ever("mismatches", one(c, "SELECT count(*) FROM mismatches")?);
    let unreadable = ever("unreadable", one(c, "SELECT count(*) FROM unreadable")?);
    let forged = match v2 {
        true => ever("forged", one(c, "SELECT count(*) FROM forged")?),
        false => 0,
    };
    let side_dropped = dropped.values().sum();
    let recent: i64 = c
        .query_one(
            "SELECT count(*) FROM events WHERE received_ms >= $1",
            &[&(now_ms - 60_000)],
        )?
        .get(0);
    let span = one(
        c,
        "SELECT coalesce(max(received_ms) - min(received_ms), 0) FROM events",
    )?;
    let (rate_last_minute, rate_overall) = rates(recent, events, span);
    Ok(Report {
        streams,
        events,
        duplicates,
        mismatches,
        unreadable,
        forged,
        side_dropped,
        rate_last_minute,
        rate_overall,
    })
}

/// The report of a SQLite sink file (JSON envelopes only: a postcard row
/// counts in the totals but in no stream), at wall-clock `now_ms`.
///
/// Errors: the file cannot be read as a sink database.
pub fn from_sqlite(path: &std::path::Path, now_ms: i64) -> rusqlite::Result<Report> {
    let c =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    let mut st = c.prepare(
        "SELECT json_extract(j, '$.device_id') AS d, json_extract(j, '$.stream') AS s,
                count(*), min(json_extract(j, '$.seq')), max(json_extract(j, '$.seq'))
         FROM (SELECT CAST(payload AS TEXT) AS j FROM received)
         WHERE json_valid(j) AND d IS NOT NULL AND s IS NOT NULL
         GROUP BY d, s ORDER BY d, s",
    )?;
    let streams = st
        .query_map([], |r| {
            Ok(stream_row(
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let one = |sql: &str| c.query_row(sql, [], |r| r.get::<_, i64>(0));
    let events = one("SELECT count(*) FROM received")?;
    // `forged` and `side_drops` came with schema version 2.
    let v2 =
        one("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'side_drops'")? > 0;
    let dropped = |side: &str| -> rusqlite::Result<i64> {
        match v2 {
            true => c.query_row(
                "SELECT coalesce(sum(dropped), 0) FROM side_drops WHERE side = ?1",
                [side],
                |r| r.get(0),
            ),
            false => Ok(0),
        }
    };
    let (mismatches_dropped, forged_dropped) = (dropped("mismatches")?, dropped("forged")?);
    let unreadable_dropped = dropped("unreadable")?;
    let mismatches = one("SELECT count(*) FROM mismatches")? + mismatches_dropped;
    let forged = match v2 {
        true => one("SELECT count(*) FROM forged")? + forged_dropped,
        false => 0,
    };
    // `unreadable` came with schema version 3.
    let v3 =
        one("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'unreadable'")? > 0;
    let unreadable = match v3 {
        true => one("SELECT count(*) FROM unreadable")? + unreadable_dropped,
        false => 0,
    };
    let redeliveries = one("SELECT coalesce(sum(deliveries - 1), 0) FROM received")?;
    let recent: i64 = c.query_row(
        "SELECT count(*) FROM received WHERE first_ms >= ?1",
        [now_ms - 60_000],
        |r| r.get(0),
    )?;
    let span = one("SELECT coalesce(max(first_ms) - min(first_ms), 0) FROM received")?;
    let (rate_last_minute, rate_overall) = rates(recent, events, span);
    Ok(Report {
        streams,
        events,
        duplicates: redeliveries - mismatches,
        mismatches,
        unreadable,
        forged,
        side_dropped: mismatches_dropped + forged_dropped + unreadable_dropped,
        rate_last_minute,
        rate_overall,
    })
}

fn stream_row(
    device_id: String,
    stream: String,
    events: i64,
    min_seq: i64,
    max_seq: i64,
) -> StreamRow {
    StreamRow {
        missing: (max_seq - min_seq + 1 - events).max(0),
        device_id,
        stream,
        events,
        min_seq,
        max_seq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_stats_count_gaps_duplicates_and_mismatches() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("sink.db");
        let mut db = crate::sink::SinkDb::open(&path).unwrap();
        let ev = |id: &str, seq: i64, x: i64| {
            format!(
                r#"{{"event_id":"{id}","device_id":"dev","stream":"s","seq":{seq},"ts_ms":5,"clock_trusted":true,"fields":{{"x":{x}}}}}"#
            )
        };
        for (id, seq, x) in [
            ("a", 1, 0),
            ("b", 2, 0),
            ("c", 5, 0),
            ("b", 2, 0),
            ("c", 5, 1),
        ] {
            db.store("p/dev/events/s", ev(id, seq, x).as_bytes())
                .unwrap();
        }
        let r = from_sqlite(&path, crate::event::envelope::wall_clock_ms().0).unwrap();
        assert_eq!((r.events, r.duplicates, r.mismatches), (3, 1, 1));
        assert_eq!(r.streams.len(), 1);
        assert_eq!(
            (
                r.streams[0].min_seq,
                r.streams[0].max_seq,
                r.streams[0].missing
            ),
            (1, 5, 2)
        );
        assert!(render(&r).contains("mismatches 1"));
    }
}
