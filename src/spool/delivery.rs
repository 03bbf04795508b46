//! Delivery state: the rows to publish, the acknowledged high-water mark
//! and the rows acknowledged above it, FAILED rows and their requeue.
//!
//! One rule: a row leaves the unacknowledged set only through
//! [`Spool::retire`] (or [`Spool::record_delivery`]), called with the
//! acknowledgement of a publish that carried it (I2).

use super::clock_spans::since_ms;
use super::{priority, Spool, SpoolError, SQL_COUNTER_ADD};
use crate::event::envelope::EventId;
use rusqlite::{params, OptionalExtension};
use sha2::{Digest, Sha256};

/// The append time of the first row above the acknowledged mark that is
/// neither acknowledged out of order nor FAILED (for a row appended before
/// the clock was set, when it was set: [`super::clock_spans::since_ms`]).
pub(super) const SQL_OLDEST_UNACKED: &str = concat!(
    "SELECT ",
    since_ms!(),
    " FROM events e
    WHERE e.id > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT 1"
);

/// Unresolved rows (not acknowledged, not FAILED) above `?1`, in id order.
pub(super) const SQL_SENDABLE: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id > max(?1, (SELECT acked_through FROM delivery_mark))
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT ?2";

/// Rows above the mark with whether each is already resolved, for folding
/// ([`FOLD_STEP`] at a time: the LIMIT is written out, as a bound one has
/// SQLite plan the statement again at every bind, see
/// [`super::priority::LANE_READ_MAX`]).
pub(super) const SQL_ABOVE_MARK: &str = "SELECT e.id,
    EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
    OR EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    FROM events e WHERE e.id > ?1 ORDER BY e.id LIMIT 4096";

/// For a run `(?1, ?2]` of row ids all acknowledged now: the highest row
/// id in it, the rows in it, and those of them already resolved
/// (acknowledged out of order, or FAILED). Index range reads: the two small
/// tables and the row ids, no row's record is decoded.
const SQL_RUN: &str = "SELECT
    (SELECT max(id) FROM events WHERE id > ?1 AND id <= ?2),
    (SELECT count(*) FROM events WHERE id > ?1 AND id <= ?2),
    (SELECT count(*) FROM (
        SELECT id FROM acked_above WHERE id > ?1 AND id <= ?2
        UNION SELECT id FROM failed WHERE id > ?1 AND id <= ?2) r
     WHERE EXISTS (SELECT 1 FROM events e WHERE e.id = r.id))";

pub(super) const SQL_MARK: &str = "SELECT acked_through, sent_through FROM delivery_mark";

pub(super) const SQL_SET_MARK: &str =
    "UPDATE delivery_mark SET acked_through = ?1, sent_through = ?2";

pub(super) const SQL_ACKED_ABOVE: &str = "INSERT OR IGNORE INTO acked_above (id) SELECT ?1
    WHERE EXISTS (SELECT 1 FROM events WHERE id = ?1)";

pub(super) const SQL_FAIL: &str =
    "INSERT OR IGNORE INTO failed (id, reason, failed_ms) SELECT ?1, ?2, ?3
    WHERE EXISTS (SELECT 1 FROM events WHERE id = ?1)
      AND ?1 > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above WHERE id = ?1)";

/// Rows folded into the acknowledged mark per query while retiring.
pub(super) const FOLD_STEP: i64 = 4096;

/// A row to publish.
#[derive(Debug, Clone)]
pub struct OutRow {
    /// Row id (spool-local).
    pub id: i64,
    /// Event id, read from the text the spool stores; `None` when that
    /// text is not one ([`EventId::parse`]): the row then fails its check,
    /// as a payload that fails its digest does (FAILED and kept, never
    /// sent, never retired).
    pub event_id: Option<EventId>,
    /// Stream.
    pub stream: String,
    /// The stored payload bytes, sent unchanged on every attempt.
    pub payload: Vec<u8>,
    /// sha256 of `payload` as stored at append; `None` when the stored
    /// digest is not 32 bytes (the row then fails its check).
    pub digest: Option<[u8; 32]>,
    /// Delivery priority of the row (its stream's, [`priority`]).
    pub prio: u8,
}

impl OutRow {
    /// True when the payload still hashes to the digest stored at append (I3).
    pub fn digest_ok(&self) -> bool {
        self.digest
            .is_some_and(|d| Sha256::digest(&self.payload).as_slice() == d.as_slice())
    }
}

/// A FAILED row, for `status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FailedRow {
    /// Row id.
    pub id: i64,
    /// Event id, as the spool stores it (text: `status` shows what is
    /// there, a damaged id too).
    pub event_id: String,
    /// Stream.
    pub stream: String,
    /// Why it was marked FAILED.
    pub reason: String,
    /// When, Unix ms.
    pub failed_ms: i64,
}

/// Unresolved rows (not acknowledged, not FAILED) among the ids in the JSON
/// array `?1`, in id order.
const SQL_UNRESOLVED_OF: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id IN (SELECT value FROM json_each(?1))
      AND e.id > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id";

impl Spool {
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

    /// The rows among `ids` that are still unresolved (not acknowledged,
    /// not FAILED), in row-id order: rows to publish again (a receipt that
    /// did not come). Holds no statement afterwards.
    pub fn unresolved_rows(&self, ids: &[i64]) -> Result<Vec<OutRow>, SpoolError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let list = serde_json::to_string(ids).unwrap_or_else(|_| "[]".to_owned());
        let mut stmt = self
            .conn
            .prepare_cached(SQL_UNRESOLVED_OF)
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map(params![list], priority::out_row)
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

    pub(super) fn fold(&mut self, sent: &[i64], acked: &[i64]) -> Result<usize, SpoolError> {
        self.write(|tx, err| fold_in(tx, err, sent, acked))
    }

    /// Mark row `id` `FAILED` with `reason` and count it under
    /// `events_failed_<counter>`. Terminal until an operator requeues it.
    /// A row already acknowledged is left alone.
    pub fn mark_failed(&mut self, id: i64, reason: &str, counter: &str) -> Result<(), SpoolError> {
        let now = crate::event::envelope::wall_clock_ms().0;
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

    /// FAILED rows in the spool (a small table: one count).
    pub fn failed_count(&self) -> Result<u64, SpoolError> {
        self.conn
            .query_row("SELECT count(*) FROM failed", [], |r| r.get::<_, i64>(0))
            .map(|n| n.max(0) as u64)
            .map_err(|e| self.err(e))
    }

    /// The newest `limit` FAILED rows: `(row id, event id, stream, reason,
    /// failed Unix ms)`, newest first.
    pub fn failed_rows(&self, limit: usize) -> Result<Vec<FailedRow>, SpoolError> {
        self.query_all(
            "SELECT f.id, e.event_id, s.name, f.reason, f.failed_ms, e.payload FROM failed f
             JOIN events e ON e.id = f.id JOIN streams s ON s.id = e.stream_id
             ORDER BY f.id DESC LIMIT ?1",
            params![limit as i64],
            |r| {
                let payload = r.get_ref(5)?.as_blob().unwrap_or_default();
                Ok(FailedRow {
                    id: r.get(0)?,
                    event_id: super::stored_id::stored_event_id_text(r.get(1)?, payload),
                    stream: r.get(2)?,
                    reason: r.get(3)?,
                    failed_ms: r.get(4)?,
                })
            },
        )
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
}

/// Fold `sent` (publish attempts) and `acked` (acknowledgements) into the
/// delivery state inside the caller's transaction `tx` (see
/// [`Spool::record_delivery`]): the delivery thread's own commit, or the
/// writer's commit they ride ([`super::Riders`]). Returns the rows retired.
pub(super) fn fold_in(
    tx: &rusqlite::Transaction<'_>,
    err: &dyn Fn(rusqlite::Error) -> SpoolError,
    sent: &[i64],
    acked: &[i64],
) -> Result<usize, SpoolError> {
    let (mark, old_sent): (i64, i64) = tx
        .query_row(SQL_MARK, [], |r| Ok((r.get(0)?, r.get(1)?)))
        .map_err(err)?;
    let sent_mark = sent.iter().copied().fold(old_sent, i64::max);
    let mut pending: std::collections::BTreeSet<i64> =
        acked.iter().copied().filter(|id| *id > mark).collect();
    let mut retired = 0usize;
    let mut new_mark = mark;
    // The acknowledgements that continue the mark without a gap
    // (the usual case: PUBACKs come in order) fold in one step: every
    // row id in the run is acknowledged now, so the walk below would
    // pass all of its rows.
    let run_end = pending
        .iter()
        .zip(mark + 1..)
        .take_while(|(id, want)| **id == *want)
        .last()
        .map(|(id, _)| *id);
    if let Some(end) = run_end {
        let (top, rows, resolved): (Option<i64>, i64, i64) = tx
            .prepare_cached(SQL_RUN)
            .and_then(|mut st| {
                st.query_row(params![mark, end], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
            })
            .map_err(err)?;
        // The mark stops at the highest row that exists: a row id
        // above every row is never taken as acknowledged.
        if let Some(top) = top {
            retired += (rows - resolved).max(0) as usize;
            new_mark = top;
            pending = pending.split_off(&(top + 1));
        }
    }
    // Fold: walk the rows above the mark in order while each one is
    // acknowledged now, or was already resolved.
    let mut step = tx.prepare_cached(SQL_ABOVE_MARK).map_err(err)?;
    'fold: loop {
        let mut rows = step.query(params![new_mark]).map_err(err)?;
        let mut seen = 0;
        while let Some(r) = rows.next().map_err(err)? {
            seen += 1;
            let (id, resolved): (i64, bool) = (r.get(0).map_err(err)?, r.get(1).map_err(err)?);
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
}
