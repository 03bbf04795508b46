//! What the spool still holds of each stream: the board's holdings
//! ([`Spool::holdings`]), and its rows read again by sequence number when
//! the fleet asks for them ([`Spool::backfill_start`],
//! [`Spool::backfill_rows`]).
//!
//! One rule: **read only, and by what each row is**: nothing here changes a
//! row's state, and every row read says whether it is acknowledged, not yet
//! (it still comes by ordinary delivery) or FAILED, so only rows the fleet
//! had are sent again, with their stored bytes. What retention took is
//! known without reading it: each purge notes, per stream, the highest
//! sequence number it deleted (`spool_meta` `purged_seq:<stream id>`, in
//! the purge's own commit, [`note_purged`]).
//!
//! There is no index by sequence number (an index would cost every append a
//! page write, issue 23): within a stream sequence numbers grow with row ids,
//! so the first row at or after a number is found by bisecting row ids,
//! each probe a range read bounded by the bisection.

use super::{priority, OutRow, Spool, SpoolError};
use crate::event::backfill::Held;
use rusqlite::{params, OptionalExtension, Transaction};
use std::collections::HashMap;

/// Unresolved rows scanned at most to find each stream's first one not yet
/// delivered; a stream not met in them is taken as not delivered from its
/// oldest row on (the fleet asks nothing of it then).
pub const PENDING_SCAN_ROWS: i64 = 100_000;

/// Each stream's id, name, newest sequence number (as [`Spool`] loads them
/// at open) and the highest one retention deleted.
const SQL_STREAMS: &str = "
SELECT s.id, s.name, max(s.last_seq, coalesce(t.top, 0)),
       coalesce((SELECT m.value FROM spool_meta m WHERE m.key = 'purged_seq:' || s.id), 0)
FROM streams s
LEFT JOIN (SELECT stream_id, max(seq) AS top FROM events
           WHERE id > coalesce((SELECT value FROM spool_meta WHERE key = 'seq_through_id'), 0)
           GROUP BY stream_id) t ON t.stream_id = s.id
ORDER BY s.name";

/// The first sequence number not yet delivered per stream, among the
/// first `?1` unresolved rows.
const SQL_PENDING: &str = "
SELECT stream_id, min(seq), count(*) OVER () FROM (
    SELECT e.stream_id, e.seq FROM events e
    WHERE e.id > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)
    ORDER BY e.id LIMIT ?1)
GROUP BY stream_id";

/// The first row of stream `?1` with a row id in `[?2, ?3)`.
const SQL_PROBE: &str = "SELECT id, seq FROM events
    WHERE stream_id = ?1 AND id >= ?2 AND id < ?3 ORDER BY id LIMIT 1";

/// Rows of stream `?1` from row id `?2` on, in id order, with whether each
/// is FAILED or acknowledged.
const SQL_WALK: &str = "SELECT e.id, e.event_id, s.name, e.payload, e.digest, e.prio, e.seq,
    EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id),
    e.id <= (SELECT acked_through FROM delivery_mark)
        OR EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.stream_id = ?1 AND e.id >= ?2 ORDER BY e.id LIMIT ?3";

/// Run a purge statement returning `(stream_id, seq)` of each row it
/// deleted (bound: `?1` the age cutoff, `?2` the limit, `?3` the row id a
/// clock span holds from), noting the highest per stream in `top`; returns
/// the rows.
pub(super) fn purge_noting(
    tx: &Transaction<'_>,
    sql: &str,
    (cutoff_ms, below_id): (i64, i64),
    limit: usize,
    top: &mut HashMap<i64, i64>,
) -> rusqlite::Result<usize> {
    let mut st = tx.prepare_cached(sql)?;
    let mut rows = st.query(params![cutoff_ms, limit as i64, below_id])?;
    let mut n = 0;
    while let Some(r) = rows.next()? {
        let (stream, seq): (i64, i64) = (r.get(0)?, r.get(1)?);
        let t = top.entry(stream).or_insert(seq);
        *t = (*t).max(seq);
        n += 1;
    }
    Ok(n)
}

/// Remember the highest sequence number purged per stream (`top`).
pub(super) fn note_purged(tx: &Transaction<'_>, top: &HashMap<i64, i64>) -> rusqlite::Result<()> {
    let mut st = tx.prepare_cached(
        "INSERT INTO spool_meta (key, value) VALUES ('purged_seq:' || ?1, ?2)
         ON CONFLICT(key) DO UPDATE SET value = max(value, excluded.value)",
    )?;
    for (stream, seq) in top {
        st.execute(params![stream, seq])?;
    }
    Ok(())
}

/// A row read again for the fleet, and what it is.
#[derive(Debug, Clone)]
pub struct HeldRow {
    /// The row as the delivery thread sends rows.
    pub row: OutRow,
    /// Its sequence number.
    pub seq: i64,
    /// What it is.
    pub state: HeldState,
}

/// What a row read again is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldState {
    /// Acknowledged (or receipted): the fleet had it; it may be sent again.
    Acked,
    /// Not yet acknowledged: ordinary delivery sends it.
    Unresolved,
    /// FAILED by policy: never sent.
    Failed,
}

impl Spool {
    /// Per stream, in byte order of the names: its id and what the spool
    /// holds of it ([`Held`]): the oldest sequence number retention left
    /// (one past the highest it deleted), the newest appended, and the first
    /// not yet delivered (among the first [`PENDING_SCAN_ROWS`] unresolved
    /// rows; a stream not met there counts as not delivered from its
    /// oldest row on when the scan was cut short).
    pub fn holdings(&self) -> Result<Vec<(i64, String, Held)>, SpoolError> {
        let streams = self.query_all(SQL_STREAMS, [], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?;
        let mut first: HashMap<i64, i64> = HashMap::new();
        let mut cut_short = false;
        for (stream, seq, total) in
            self.query_all(SQL_PENDING, params![PENDING_SCAN_ROWS], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?
        {
            first.insert(stream, seq);
            cut_short = total >= PENDING_SCAN_ROWS;
        }
        Ok(streams
            .into_iter()
            .map(|(id, name, newest, purged)| {
                let newest = newest.max(0);
                let oldest = (purged + 1).clamp(1, newest + 1);
                let pending = match first.get(&id) {
                    Some(s) => (*s).clamp(1, newest + 1),
                    None if cut_short => oldest,
                    None => newest + 1,
                };
                (
                    id,
                    name,
                    Held {
                        oldest,
                        newest,
                        pending,
                    },
                )
            })
            .collect())
    }

    /// The row id of the first row of stream `stream_id` whose sequence
    /// number is `seq` or more; `None` when there is none. A bisection over
    /// row ids (sequence numbers grow with them within a stream), each
    /// probe reading from its midpoint to the end of the range still open.
    pub fn backfill_start(&self, stream_id: i64, seq: i64) -> Result<Option<i64>, SpoolError> {
        let (min, max): (Option<i64>, Option<i64>) = self
            .conn
            .prepare_cached("SELECT min(id), max(id) FROM events")
            .and_then(|mut st| st.query_row([], |r| Ok((r.get(0)?, r.get(1)?))))
            .map_err(|e| self.err(e))?;
        let (Some(mut lo), Some(max)) = (min, max) else {
            return Ok(None);
        };
        let mut hi = max + 1;
        let mut found = None;
        let mut probe = self
            .conn
            .prepare_cached(SQL_PROBE)
            .map_err(|e| self.err(e))?;
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let row: Option<(i64, i64)> = probe
                .query_row(params![stream_id, mid, hi], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()
                .map_err(|e| self.err(e))?;
            match row {
                // Nothing of the stream in [mid, hi): look below mid.
                None => hi = mid,
                Some((id, s)) if s < seq => lo = id + 1,
                Some((id, _)) => {
                    found = Some(id);
                    hi = mid;
                }
            }
        }
        Ok(found)
    }

    /// Up to `limit` rows of stream `stream_id` with row id `from_id` or
    /// more, in row-id order, each with its sequence number and what it is.
    /// Holds no statement afterwards.
    pub fn backfill_rows(
        &self,
        stream_id: i64,
        from_id: i64,
        limit: usize,
    ) -> Result<Vec<HeldRow>, SpoolError> {
        self.query_all(SQL_WALK, params![stream_id, from_id, limit as i64], |r| {
            let failed: bool = r.get(7)?;
            let acked: bool = r.get(8)?;
            Ok(HeldRow {
                row: priority::out_row(r)?,
                seq: r.get(6)?,
                state: match (failed, acked) {
                    (true, _) => HeldState::Failed,
                    (false, true) => HeldState::Acked,
                    (false, false) => HeldState::Unresolved,
                },
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{EventIdGen, Format};
    use crate::event::reading::FieldValue;
    use crate::spool::NewEvent;

    fn ev(stream: &str) -> NewEvent {
        NewEvent {
            replay: None,
            stream: stream.into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("x".into(), FieldValue::Num(1.0))],
            key: None,
            reply: None,
        }
    }

    #[test]
    fn holdings_say_what_retention_left_and_what_is_not_yet_delivered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Spool::open(&dir.path().join("s.db"), &Default::default()).expect("spool");
        let mut ids = EventIdGen::new().expect("ids");
        // Two streams interleaved: a (seq 1..=10) and b (seq 1..=5).
        let mut evs = Vec::new();
        for i in 0..10 {
            evs.push(ev("a"));
            if i % 2 == 0 {
                evs.push(ev("b"));
            }
        }
        s.append(&evs, &mut ids, "dev", Format::Json, 5)
            .expect("append");
        // Rows 1..=9 acknowledged (a1..a6 and b1..b3), then retention takes
        // rows 1..=4 (a1, b1, a2, a3).
        s.retire(&(1..=9).collect::<Vec<_>>()).expect("retire");
        assert_eq!(s.purge_acked(i64::MAX, 4).expect("purge"), 4);
        let h = s.holdings().expect("holdings");
        let by: HashMap<&str, Held> = h.iter().map(|(_, n, h)| (n.as_str(), *h)).collect();
        assert_eq!(
            by["a"],
            Held {
                oldest: 4,
                newest: 10,
                pending: 7
            }
        );
        assert_eq!(
            by["b"],
            Held {
                oldest: 2,
                newest: 5,
                pending: 4
            }
        );
        // Rows of a from seq 5 on: the bisection finds the row, the walk
        // tells acknowledged from not yet.
        let a = h.iter().find(|(_, n, _)| n == "a").expect("a").0;
        let start = s.backfill_start(a, 5).expect("start").expect("a row");
        let rows = s.backfill_rows(a, start, 100).expect("walk");
        let seen: Vec<(i64, HeldState)> = rows.iter().map(|r| (r.seq, r.state)).collect();
        assert_eq!(seen[0], (5, HeldState::Acked));
        assert_eq!(seen[1], (6, HeldState::Acked));
        assert_eq!(seen[2], (7, HeldState::Unresolved));
        assert_eq!(seen.len(), 6);
        assert!(rows.iter().all(|r| r.row.digest_ok()));
        assert_eq!(s.backfill_start(a, 11).expect("start"), None);
        assert_eq!(s.backfill_start(a, 1).expect("start"), Some(start - 1));
    }
}
