//! What the outage budget ([`crate::flash::outage`]) reads from the spool: the rows
//! appended since a row id, by stream, and how many rows the spool holds.
//!
//! One job: both are range reads on the row id (the table's primary key),
//! so their cost grows with the rows appended since the last read, never
//! with the spool's size.

use super::{Spool, SpoolError};

/// Rows above `?1`, per stream: count, stored bytes (payload, event id and
/// digest, as SQLite's `length` gives them), and the highest row id.
const SQL_APPENDED_SINCE: &str = "SELECT s.name, count(*),
        sum(length(e.payload) + length(e.event_id) + length(e.digest)), max(e.id)
    FROM events e JOIN streams s ON s.id = e.stream_id
    WHERE e.id > ?1 GROUP BY s.name";

/// Lowest and highest row id (both 0 when the spool is empty).
const SQL_ID_SPAN: &str = "SELECT coalesce(min(id), 0), coalesce(max(id), 0) FROM events";

/// Rows of one stream appended since a row id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// Stream name.
    pub stream: String,
    /// Rows.
    pub rows: u64,
    /// Stored bytes of those rows (payload + event id + digest).
    pub bytes: u64,
    /// Highest row id among them.
    pub newest_id: i64,
}

impl Spool {
    /// Rows appended with an id above `after_id`, per stream.
    pub fn appended_since(&self, after_id: i64) -> Result<Vec<Appended>, SpoolError> {
        let mut st = self
            .conn
            .prepare_cached(SQL_APPENDED_SINCE)
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([after_id], |r| {
                Ok(Appended {
                    stream: r.get(0)?,
                    rows: r.get::<_, i64>(1)?.max(0) as u64,
                    bytes: r.get::<_, Option<i64>>(2)?.unwrap_or(0).max(0) as u64,
                    newest_id: r.get(3)?,
                })
            })
            .map_err(|e| self.err(e))?;
        rows.collect::<Result<Vec<_>, _>>().map_err(|e| self.err(e))
    }

    /// Rows in the spool, every state: highest id - lowest id + 1 (ids only
    /// grow and retention deletes the oldest first, so this is exact but
    /// for rows deleted out of order, which it counts as still there).
    pub fn rows_estimate(&self) -> Result<u64, SpoolError> {
        let (lo, hi) = self
            .conn
            .prepare_cached(SQL_ID_SPAN)
            .and_then(|mut st| st.query_row([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))))
            .map_err(|e| self.err(e))?;
        Ok(if hi == 0 {
            0
        } else {
            (hi - lo + 1).max(0) as u64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{NewEvent, Spool, SpoolOptions};
    use crate::event::envelope::{EventIdGen, Format};
    use crate::event::reading::FieldValue;

    fn ev(stream: &str) -> NewEvent {
        NewEvent::new(stream, 1, true, vec![("x".into(), FieldValue::Num(1.0))])
    }

    #[test]
    fn rows_appended_since_an_id_are_counted_by_stream_with_their_bytes() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        assert_eq!(s.rows_estimate().unwrap(), 0);
        assert!(s.appended_since(0).unwrap().is_empty());
        let mut ids = EventIdGen::new().unwrap();
        let batch = vec![ev("pump"), ev("pump"), ev("air")];
        s.append(&batch, &mut ids, "dev", Format::Json, 0).unwrap();
        let mut got = s.appended_since(0).unwrap();
        got.sort_by(|a, b| a.stream.cmp(&b.stream));
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].stream.as_str(), got[0].rows), ("air", 1));
        assert_eq!((got[1].stream.as_str(), got[1].rows), ("pump", 2));
        let bytes: i64 = s
            .query_all(
                "SELECT length(payload) + length(event_id) + length(digest) FROM events e
                 JOIN streams t ON t.id = e.stream_id WHERE t.name = 'pump'",
                [],
                |r| r.get(0),
            )
            .unwrap()
            .iter()
            .sum();
        assert_eq!(got[1].bytes, bytes as u64);
        let newest = got.iter().map(|a| a.newest_id).max().unwrap();
        assert!(s.appended_since(newest).unwrap().is_empty());
        assert_eq!(s.rows_estimate().unwrap(), 3);
    }
}
