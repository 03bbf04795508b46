//! Delivery priority in the spool: which rows the delivery thread reads for
//! each lane of [`crate::delivery::lanes`].
//!
//! One job: keep each row's priority next to it and read the unresolved
//! rows of one lane in row-id order without scanning the others.
//!
//! - `events.prio` is the stream's priority when the row was appended, and
//!   `streams.prio` the stream's current one. A row costs nothing more for
//!   it: a zero takes no bytes in SQLite's record format
//!   (<https://www.sqlite.org/fileformat2.html#record_format>, serial type 8).
//! - Rows of priority above 0 are also in the partial index
//!   `events_priority` (<https://www.sqlite.org/partialindex.html>); rows of
//!   priority 0, the bulk of telemetry, are not, so an append of one writes
//!   no index page.
//! - When the config gives a stream another priority, [`Spool::set_priorities`]
//!   moves its unacknowledged rows too (one pass over the rows above the
//!   acknowledged mark), so a stream's rows are never split between two
//!   lanes and its first publishes stay in sequence order.

use super::clock_spans::since_ms;
use super::{OutRow, Spool, SpoolError};
use crate::event::stream::fallback_priority;
use rusqlite::{params, OptionalExtension};
use std::collections::HashMap;

/// Which rows a delivery read returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Rows of priority 0, by row id (a range read of the table).
    Normal,
    /// Rows of priority above 0, by row id (through `events_priority`).
    Priority,
}

/// The most rows one [`Spool::sendable_lane`] read returns.
pub const LANE_READ_MAX: usize = 1024;

// The lane reads below have their LIMIT written out ([`LANE_READ_MAX`]),
// not bound: with a bound LIMIT SQLite (built with STAT4) marks the
// statement for a new query plan whenever that parameter is bound again,
// so every read parsed and planned its statement anew (8% of the delivery
// thread's time in a batched drain). The caller's smaller limit is applied
// by stepping no further.

/// Unresolved rows of priority 0 above `?1`, in row-id order.
const SQL_NORMAL: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id > max(?1, (SELECT acked_through FROM delivery_mark)) AND e.prio = 0
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT 1024";

/// Unresolved rows of priority above 0 above `?1`, in row-id order, through
/// the partial index (named, so a large table is never scanned for them).
const SQL_PRIORITY: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e INDEXED BY events_priority JOIN streams s ON s.id = e.stream_id
    WHERE e.prio > 0 AND e.id > max(?1, (SELECT acked_through FROM delivery_mark))
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT 1024";

/// Unresolved rows of the streams in the JSON array `?3` (stream ids) with
/// row ids in `(?1, ?2]`, in row-id order.
const SQL_OF_STREAMS: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id > max(?1, (SELECT acked_through FROM delivery_mark)) AND e.id <= ?2
      AND e.stream_id IN (SELECT value FROM json_each(?3))
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT ?4";

/// An [`OutRow`] from the columns id, event_id, stream name, payload,
/// digest, prio. The event id is read in place from its stored text, or
/// from the payload where that text is empty (schema 12); text that is not
/// an id (or not text) gives `None`, and the row fails its check on the
/// delivery thread rather than its read here, so the rows behind it still
/// flow.
pub(super) fn out_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<OutRow> {
    let payload: Vec<u8> = r.get(3)?;
    Ok(OutRow {
        id: r.get(0)?,
        event_id: super::stored_id::stored_event_id(r.get_ref(1)?, &payload),
        stream: r.get(2)?,
        payload,
        // Read in place, not as a Vec of its own (one allocation per row
        // fewer on the delivery thread's reads).
        digest: r
            .get_ref(4)?
            .as_blob()
            .ok()
            .and_then(|d| <[u8; 32]>::try_from(d).ok()),
        prio: r.get::<_, i64>(5)?.clamp(0, 255) as u8,
    })
}

/// One stream's backlog, for `status` and the metrics.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StreamBacklog {
    /// The stream.
    pub stream: String,
    /// Its delivery priority now (`streams.prio`).
    pub priority: u8,
    /// Rows not yet acknowledged (PENDING or SENT; FAILED rows not counted).
    pub rows: u64,
    /// Age of its oldest unacknowledged row by append wall time, ms;
    /// `None` when it has none.
    pub oldest_unacked_age_ms: Option<i64>,
    /// The wall time that age counts from, Unix ms (as
    /// [`super::Stats::oldest_unacked_ms`]); `None` when it has none.
    pub oldest_unacked_ms: Option<i64>,
}

/// Every stream, highest priority first ([`Spool::backlog_by_stream`]).
const SQL_STREAMS_BY_PRIORITY: &str = "SELECT id, name, prio FROM streams ORDER BY prio DESC, name";

/// Each unacknowledged row's stream and the time its age counts from (for
/// a row appended before the clock was set, when it was set): a read of
/// the rows above the acknowledged mark only, counted by the caller.
const SQL_BACKLOG: &str = concat!(
    "SELECT e.stream_id, ",
    since_ms!(),
    " FROM events e
        WHERE e.id > (SELECT acked_through FROM delivery_mark)
          AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
          AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)"
);
// Counted in Rust, not grouped: a GROUP BY sorts the rows, and SQLite's
// sorter spills to a temporary file once they outgrow its memory (a
// backlog of an outage: a file written and deleted at every call, issue
// 35). Read from the mark, not joined: with the join outside a subquery,
// SQLite built an automatic index over every row of `events` (the whole table, acknowledged
// rows too) on each call: 0.84 s on a 1,000,000-row spool with 10,000
// unacknowledged, against 0.015 s for this range read from the mark.

/// A stream whose priority [`Spool::set_priorities`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reranked {
    /// The stream.
    pub stream: String,
    /// Its priority before.
    pub from: u8,
    /// Its priority now.
    pub to: u8,
    /// Its unacknowledged rows moved to the new priority.
    pub rows: usize,
}

impl Spool {
    /// Up to `limit` (at most [`LANE_READ_MAX`]) unresolved rows (not
    /// acknowledged, not FAILED) of `lane` with row id above `after_id`, in
    /// row-id order (sequence order within each stream, I7). Holds no
    /// statement or transaction afterwards.
    pub fn sendable_lane(
        &self,
        lane: Lane,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<OutRow>, SpoolError> {
        let sql = match lane {
            Lane::Normal => SQL_NORMAL,
            Lane::Priority => SQL_PRIORITY,
        };
        let mut stmt = self.conn.prepare_cached(sql).map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![after_id], out_row)
            .map_err(|e| self.err(e))?;
        rows.take(limit.min(LANE_READ_MAX))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))
    }

    /// Up to `limit` unresolved rows of the streams named in `streams` with
    /// row ids in `(after_id, through_id]`, in row-id order. Streams the
    /// spool has never seen are ignored.
    pub fn sendable_of_streams(
        &self,
        streams: &[String],
        after_id: i64,
        through_id: i64,
        limit: usize,
    ) -> Result<Vec<OutRow>, SpoolError> {
        let book = self.book();
        let ids: Vec<i64> = streams
            .iter()
            .filter_map(|s| book.streams.get(s).map(|b| b.id))
            .collect();
        drop(book);
        let ids = if ids.len() == streams.len() {
            ids
        } else {
            // Streams another connection created: look them up.
            let mut st = self
                .conn
                .prepare_cached("SELECT id FROM streams WHERE name = ?1")
                .map_err(|e| self.err(e))?;
            let mut out = Vec::new();
            for s in streams {
                let id = st
                    .query_row(params![s], |r| r.get::<_, i64>(0))
                    .optional()
                    .map_err(|e| self.err(e))?;
                out.extend(id);
            }
            out
        };
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let json = format!(
            "[{}]",
            ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        );
        let mut stmt = self
            .conn
            .prepare_cached(SQL_OF_STREAMS)
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![after_id, through_id, json, limit as i64], out_row)
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Backlog and oldest unacknowledged age per stream, at `now_ms`
    /// (Unix ms), highest priority first. Reads the rows above the
    /// acknowledged mark (the backlog), not the whole spool.
    pub fn backlog_by_stream(&self, now_ms: i64) -> Result<Vec<StreamBacklog>, SpoolError> {
        let err = |e| self.err(e);
        let mut streams: Vec<(i64, StreamBacklog)> =
            self.query_all(SQL_STREAMS_BY_PRIORITY, [], |r| {
                Ok((
                    r.get(0)?,
                    StreamBacklog {
                        stream: r.get(1)?,
                        priority: r.get::<_, i64>(2)?.clamp(0, 255) as u8,
                        rows: 0,
                        oldest_unacked_age_ms: None,
                        oldest_unacked_ms: None,
                    },
                ))
            })?;
        let at: HashMap<i64, usize> = streams
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (*id, i))
            .collect();
        let mut stmt = self.conn.prepare_cached(SQL_BACKLOG).map_err(err)?;
        let mut rows = stmt.query([]).map_err(err)?;
        while let Some(r) = rows.next().map_err(err)? {
            let (id, since): (i64, i64) = (r.get(0).map_err(err)?, r.get(1).map_err(err)?);
            if let Some((_, b)) = at.get(&id).and_then(|&i| streams.get_mut(i)) {
                b.rows += 1;
                b.oldest_unacked_ms = Some(b.oldest_unacked_ms.map_or(since, |o| o.min(since)));
            }
        }
        Ok(streams
            .into_iter()
            .map(|(_, mut b)| {
                b.oldest_unacked_age_ms = b.oldest_unacked_ms.map(|c| (now_ms - c).max(0));
                b
            })
            .collect())
    }

    /// The highest row id in the spool (0 when empty). Row ids are handed
    /// out in commit order (one writer at a time takes one more than the
    /// largest) and never reused, so every row at or below it is visible to
    /// any later read on any connection.
    pub fn newest_id(&self) -> Result<i64, SpoolError> {
        self.conn
            .prepare_cached("SELECT coalesce(max(id), 0) FROM events")
            .and_then(|mut st| st.query_row([], |r| r.get(0)))
            .map_err(|e| self.err(e))
    }

    /// Give streams the priorities of the config: each stream in `want`
    /// gets its value, every other stream [`fallback_priority`]. Streams
    /// appended later get theirs when first seen. A stream whose priority
    /// changes has its unacknowledged rows moved with it, in the same
    /// IMMEDIATE transaction (one pass over the rows above the acknowledged
    /// mark per changed stream). Returns what changed.
    pub fn set_priorities(
        &mut self,
        want: &HashMap<String, u8>,
    ) -> Result<Vec<Reranked>, SpoolError> {
        let changed = self.write(|tx, err| {
            let streams: Vec<(i64, String, i64)> = {
                let mut st = tx
                    .prepare("SELECT id, name, prio FROM streams")
                    .map_err(err)?;
                let rows = st
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .map_err(err)?;
                rows.collect::<Result<_, _>>().map_err(err)?
            };
            let mut changed = Vec::new();
            for (id, name, prio) in streams {
                let to = want
                    .get(&name)
                    .copied()
                    .unwrap_or_else(|| fallback_priority(&name));
                if i64::from(to) == prio {
                    continue;
                }
                tx.execute(
                    "UPDATE streams SET prio = ?2 WHERE id = ?1",
                    params![id, to],
                )
                .map_err(err)?;
                let rows = tx
                    .execute(
                        "UPDATE events SET prio = ?2 WHERE stream_id = ?1
                         AND id > (SELECT acked_through FROM delivery_mark)",
                        params![id, to],
                    )
                    .map_err(err)?;
                changed.push(Reranked {
                    stream: name,
                    from: prio.clamp(0, 255) as u8,
                    to,
                    rows,
                });
            }
            Ok(changed)
        })?;
        let mut book = self.book();
        book.priorities = want.clone();
        for c in &changed {
            if let Some(s) = book.streams.get_mut(&c.stream) {
                s.prio = c.to;
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spool::{Spool, SpoolOptions};

    #[test]
    fn backlog_reads_the_rows_above_the_mark_not_the_whole_table() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = Spool::open(&dir.path().join("s.db"), &SpoolOptions::default()).expect("open");
        let plan: Vec<String> = s
            .conn
            .prepare(&format!("EXPLAIN QUERY PLAN {SQL_BACKLOG}"))
            .expect("explain")
            .query_map([], |r| r.get::<_, String>(3))
            .expect("plan")
            .collect::<Result<_, _>>()
            .expect("plan rows");
        let plan = plan.join("\n");
        // The join with the grouping outside the subquery was planned as an
        // automatic index built over all of `events` on every call.
        assert!(
            plan.contains("SEARCH e USING INTEGER PRIMARY KEY (rowid>?)"),
            "{plan}"
        );
        assert!(!plan.contains("SEARCH e USING AUTOMATIC"), "{plan}");
        assert!(!plan.contains("SCAN e "), "{plan}");
    }
}
