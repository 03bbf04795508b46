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
    /// The replay ledger per (device, stream) (empty for a store older
    /// than the ledger).
    pub ledger: Vec<LedgerLine>,
    /// Its gaps, open and given up, the first [`GAPS_SHOWN`] in key order.
    pub gaps: Vec<GapRow>,
    /// What the ledger says is missing, all boards.
    pub ledger_summary: super::LedgerSummary,
}

/// Gaps listed by `--stats` at most (the summary counts them all).
pub const GAPS_SHOWN: i64 = 200;

/// One (device, stream) of the ledger, as `--stats` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LedgerLine {
    /// Device id.
    pub device_id: String,
    /// Stream.
    pub stream: String,
    /// Highest sequence number accounted for (stored, or announced by the
    /// board).
    pub known_seq: i64,
    /// Highest sequence number stored.
    pub newest_seq: i64,
    /// Every sequence number up to this is stored.
    pub contiguous_seq: i64,
    /// Open gaps.
    pub open_gaps: i64,
    /// Rows in them.
    pub rows_missing: i64,
    /// Rows given up.
    pub rows_gone: i64,
    /// When its oldest open gap was first seen, Unix ms.
    pub oldest_gap_since_ms: Option<i64>,
    /// The board's last holdings: oldest kept, newest appended, first not
    /// yet delivered, and when they came (Unix ms).
    pub board: Option<(i64, i64, i64, i64)>,
}

/// One gap of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GapRow {
    /// Device id.
    pub device_id: String,
    /// Stream.
    pub stream: String,
    /// First missing sequence number.
    pub first_seq: i64,
    /// Last missing.
    pub last_seq: i64,
    /// When it was first seen, Unix ms.
    pub since_ms: i64,
    /// Requests that named it since a row of it last arrived.
    pub asks: i32,
    /// Why it was given up; `None`: open.
    pub gone_reason: Option<String>,
}

/// The ledger's lines with their gap figures.
const LEDGER_LINES: &str = "
SELECT l.device_id, l.stream, l.known_seq, l.newest_seq, l.contiguous_seq,
       CAST(coalesce(g.open_gaps, 0) AS BIGINT), CAST(coalesce(g.missing, 0) AS BIGINT),
       CAST(coalesce(g.gone, 0) AS BIGINT), g.since,
       l.board_oldest, l.board_newest, l.board_pending, l.board_at_ms
FROM ledger l LEFT JOIN (
    SELECT device_id, stream,
           sum(CASE WHEN gone_reason IS NULL THEN 1 ELSE 0 END) AS open_gaps,
           sum(CASE WHEN gone_reason IS NULL THEN last_seq - first_seq + 1 ELSE 0 END) AS missing,
           sum(CASE WHEN gone_reason IS NULL THEN 0 ELSE last_seq - first_seq + 1 END) AS gone,
           min(CASE WHEN gone_reason IS NULL THEN since_ms END) AS since
    FROM ledger_gaps GROUP BY device_id, stream) g
  ON g.device_id = l.device_id AND g.stream = l.stream
ORDER BY l.device_id, l.stream";

/// The first gaps, in key order.
const LEDGER_GAPS: &str = "
SELECT device_id, stream, first_seq, last_seq, since_ms, asks, gone_reason
FROM ledger_gaps ORDER BY device_id, stream, first_seq LIMIT 200";

/// A [`LedgerLine`] from [`LEDGER_LINES`]' columns, in order.
#[allow(clippy::type_complexity)]
fn ledger_line(
    (device_id, stream, known_seq, newest_seq, contiguous_seq): (String, String, i64, i64, i64),
    (open_gaps, rows_missing, rows_gone, oldest_gap_since_ms): (i64, i64, i64, Option<i64>),
    board: (Option<i64>, Option<i64>, Option<i64>, Option<i64>),
) -> LedgerLine {
    LedgerLine {
        device_id,
        stream,
        known_seq,
        newest_seq,
        contiguous_seq,
        open_gaps,
        rows_missing,
        rows_gone,
        oldest_gap_since_ms,
        board: match board {
            (Some(a), Some(b), Some(c), Some(d)) => Some((a, b, c, d)),
            _ => None,
        },
    }
}

/// The ledger's part of the text report, at wall-clock `now_ms`.
fn render_ledger(out: &mut String, r: &Report, now_ms: i64) {
    if r.ledger.is_empty() {
        return;
    }
    let age = |t: Option<i64>| {
        t.map_or("-".to_owned(), |t| {
            format!("{} s", (now_ms - t).max(0) / 1000)
        })
    };
    let _ = writeln!(
        out,
        "\nledger: {} boards with gaps, {} rows missing, oldest gap {}; {} rows given up",
        r.ledger_summary.boards_with_gaps,
        r.ledger_summary.rows_missing,
        age(r.ledger_summary.oldest_gap_since_ms),
        r.ledger_summary.rows_gone
    );
    let _ = writeln!(
        out,
        "{:<24} {:<16} {:>10} {:>10} {:>6} {:>9} {:>9} {:>10}  board holds (oldest..newest, delivered below)",
        "device", "stream", "stored to", "contiguous", "gaps", "missing", "gone", "oldest gap"
    );
    for l in &r.ledger {
        let board = l.board.map_or("-".to_owned(), |(o, n, p, at)| {
            format!("{o}..{n}, below {p} ({} ago)", age(Some(at)))
        });
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:>10} {:>10} {:>6} {:>9} {:>9} {:>10}  {board}",
            l.device_id,
            l.stream,
            l.newest_seq,
            l.contiguous_seq,
            l.open_gaps,
            l.rows_missing,
            l.rows_gone,
            age(l.oldest_gap_since_ms)
        );
    }
    if r.gaps.is_empty() {
        return;
    }
    let _ = writeln!(out, "\ngaps (first {GAPS_SHOWN}):");
    for g in &r.gaps {
        let state = match &g.gone_reason {
            Some(why) => format!("gone: {why}"),
            None if g.asks > 0 => format!("asked {} times", g.asks),
            None => "open".to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:>10}..{:<10} {:>8} rows, seen {} ago, {state}",
            g.device_id,
            g.stream,
            g.first_seq,
            g.last_seq,
            g.last_seq - g.first_seq + 1,
            age(Some(g.since_ms))
        );
    }
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
    render_ledger(&mut out, r, crate::event::envelope::wall_clock_ms().0);
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
    // Version 6 counts redeliveries per event; before, a row each.
    let v6: bool = c
        .query_one("SELECT to_regclass('redeliveries') IS NOT NULL", &[])?
        .get(0);
    let duplicates = match v6 {
        true => one(
            c,
            "SELECT coalesce(sum(deliveries), 0)::int8 FROM redeliveries",
        )?,
        false => one(c, "SELECT count(*) FROM duplicates")?,
    };
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
    let mut r = Report {
        streams,
        events,
        duplicates,
        mismatches,
        unreadable,
        forged,
        side_dropped,
        rate_last_minute,
        rate_overall,
        ..Report::default()
    };
    // The ledger came with schema version 5.
    let v4: bool = c
        .query_one("SELECT to_regclass('ledger_gaps') IS NOT NULL", &[])?
        .get(0);
    if v4 {
        pg_ledger(c, &mut r)?;
    }
    Ok(r)
}

/// The ledger's lines, gaps and summary of a PostgreSQL sink database.
#[cfg(feature = "pg-sink")]
fn pg_ledger(c: &mut postgres::Client, r: &mut Report) -> Result<(), postgres::Error> {
    r.ledger = c
        .query(LEDGER_LINES, &[])?
        .iter()
        .map(|w| {
            ledger_line(
                (w.get(0), w.get(1), w.get(2), w.get(3), w.get(4)),
                (w.get(5), w.get(6), w.get(7), w.get(8)),
                (w.get(9), w.get(10), w.get(11), w.get(12)),
            )
        })
        .collect();
    r.gaps = c
        .query(LEDGER_GAPS, &[])?
        .iter()
        .map(|w| GapRow {
            device_id: w.get(0),
            stream: w.get(1),
            first_seq: w.get(2),
            last_seq: w.get(3),
            since_ms: w.get(4),
            asks: w.get(5),
            gone_reason: w.get(6),
        })
        .collect();
    let w = c.query_one(super::LEDGER_SUMMARY, &[])?;
    let n = |i: usize| w.get::<_, i64>(i).max(0) as u64;
    r.ledger_summary = super::LedgerSummary {
        boards_with_gaps: n(0),
        rows_missing: n(1),
        oldest_gap_since_ms: w.get(2),
        rows_gone: n(3),
    };
    Ok(())
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
    let mut r = Report {
        streams,
        events,
        duplicates: redeliveries - mismatches,
        mismatches,
        unreadable,
        forged,
        side_dropped: mismatches_dropped + forged_dropped + unreadable_dropped,
        rate_last_minute,
        rate_overall,
        ..Report::default()
    };
    // The ledger came with schema version 5.
    if one("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ledger_gaps'")? > 0
    {
        sqlite_ledger(&c, &mut r)?;
    }
    Ok(r)
}

/// The ledger's lines, gaps and summary of a SQLite sink file.
fn sqlite_ledger(c: &rusqlite::Connection, r: &mut Report) -> rusqlite::Result<()> {
    let mut st = c.prepare(LEDGER_LINES)?;
    r.ledger = st
        .query_map([], |w| {
            Ok(ledger_line(
                (w.get(0)?, w.get(1)?, w.get(2)?, w.get(3)?, w.get(4)?),
                (w.get(5)?, w.get(6)?, w.get(7)?, w.get(8)?),
                (w.get(9)?, w.get(10)?, w.get(11)?, w.get(12)?),
            ))
        })?
        .collect::<rusqlite::Result<_>>()?;
    let mut st = c.prepare(LEDGER_GAPS)?;
    r.gaps = st
        .query_map([], |w| {
            Ok(GapRow {
                device_id: w.get(0)?,
                stream: w.get(1)?,
                first_seq: w.get(2)?,
                last_seq: w.get(3)?,
                since_ms: w.get(4)?,
                asks: w.get(5)?,
                gone_reason: w.get(6)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    r.ledger_summary = c.query_row(super::LEDGER_SUMMARY, [], |w| {
        Ok(super::LedgerSummary {
            boards_with_gaps: w.get::<_, i64>(0)?.max(0) as u64,
            rows_missing: w.get::<_, i64>(1)?.max(0) as u64,
            oldest_gap_since_ms: w.get(2)?,
            rows_gone: w.get::<_, i64>(3)?.max(0) as u64,
        })
    })?;
    Ok(())
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
