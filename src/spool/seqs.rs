//! The sequence book: the last sequence number issued per stream, kept in
//! memory and persisted lazily, so an append writes only its own rows.
//!
//! One rule: a sequence number advances only with a committed append; a
//! restart catches up from the rows appended since the last persist.

use super::{Spool, SpoolError};
use rusqlite::params;
use std::collections::HashMap;
use std::sync::MutexGuard;

pub(super) const SQL_NEW_STREAM: &str =
    "INSERT INTO streams (name, last_seq, prio) VALUES (?1, 0, ?2) ON CONFLICT(name) DO NOTHING";

pub(super) const SQL_STREAM_BY_NAME: &str =
    "SELECT id, last_seq, prio FROM streams WHERE name = ?1";

pub(super) const SQL_SET_SEQ: &str =
    "UPDATE streams SET last_seq = max(last_seq, ?2) WHERE id = ?1";

/// The highest row id the stored sequence numbers cover: every row there is.
pub(super) const SQL_SEQ_THROUGH: &str = "INSERT INTO spool_meta (key, value)
    VALUES ('seq_through_id', coalesce((SELECT max(id) FROM events), 0))
    ON CONFLICT(key) DO UPDATE SET value = excluded.value";

/// Sequence numbers are persisted at least every this many appended rows,
/// so a start reads at most this many rows to catch up.
pub(super) const PERSIST_SEQS_EVERY: u64 = 10_000;

/// Sequence numbers per stream as the ingest connections issue them.
#[derive(Debug, Default)]
pub(super) struct SeqBook {
    /// Stream id and last sequence number per stream name.
    pub(super) streams: HashMap<String, StreamSeq>,
    /// Some `last_seq` moved since [`Spool::persist_seqs`].
    pub(super) dirty: bool,
    /// Rows appended since [`Spool::persist_seqs`].
    pub(super) appended_since_persist: u64,
    /// The config's priority per stream ([`Spool::set_priorities`]), for
    /// streams first seen after it ran.
    pub(super) priorities: HashMap<String, u8>,
}

/// A stream's id in `streams` and the last sequence number issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StreamSeq {
    pub(super) id: i64,
    pub(super) last_seq: i64,
    /// The stream's delivery priority (`streams.prio`), stamped on each row.
    pub(super) prio: u8,
}

/// The `streams` row for `name`, created with priority `prio` if missing,
/// with its `last_seq` caught up with rows appended since it was last
/// persisted.
pub(super) fn stream_row(
    tx: &rusqlite::Transaction<'_>,
    name: &str,
    prio: u8,
) -> rusqlite::Result<StreamSeq> {
    tx.prepare_cached(SQL_NEW_STREAM)?
        .execute(params![name, prio])?;
    let (id, stored, prio): (i64, i64, i64) = tx
        .prepare_cached(SQL_STREAM_BY_NAME)?
        .query_row(params![name], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    let tail: Option<i64> = tx
        .prepare_cached(
            "SELECT max(seq) FROM events WHERE stream_id = ?1
             AND id > coalesce((SELECT value FROM spool_meta WHERE key = 'seq_through_id'), 0)",
        )?
        .query_row(params![id], |r| r.get(0))?;
    Ok(StreamSeq {
        id,
        last_seq: stored.max(tail.unwrap_or(0)),
        prio: prio.clamp(0, 255) as u8,
    })
}

impl Spool {
    /// Sequence numbers per stream: the stored `last_seq`, caught up with the
    /// rows appended since it was last written (only those rows are read, so
    /// the cost does not grow with the spool).
    pub(super) fn load_seqs(&mut self) -> Result<(), SpoolError> {
        let path = self.path.clone();
        let err = |e| SpoolError::classify(&path, e);
        let mut stmt = self
            .conn
            .prepare(
                "SELECT s.name, s.id, max(s.last_seq, coalesce(t.top, 0)), s.prio FROM streams s
                 LEFT JOIN (SELECT stream_id, max(seq) AS top FROM events
                            WHERE id > coalesce((SELECT value FROM spool_meta
                                                 WHERE key = 'seq_through_id'), 0)
                            GROUP BY stream_id) t ON t.stream_id = s.id",
            )
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    StreamSeq {
                        id: r.get(1)?,
                        last_seq: r.get(2)?,
                        prio: r.get::<_, i64>(3)?.clamp(0, 255) as u8,
                    },
                ))
            })
            .map_err(err)?;
        let mut streams = HashMap::new();
        for row in rows {
            let (name, s) = row.map_err(err)?;
            streams.insert(name, s);
        }
        drop(stmt);
        let mut book = self.book();
        book.dirty = !streams.is_empty();
        book.streams = streams;
        Ok(())
    }

    pub(super) fn book(&self) -> MutexGuard<'_, SeqBook> {
        // panic = "abort" in release: a poisoned lock only happens in tests.
        self.seqs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Issue sequence numbers from `other`'s book from now on (the ingest
    /// thread's two connections, batched and `synchronous = FULL`, share one
    /// counter per stream, whichever commits a stream's readings).
    pub fn share_seqs(&mut self, other: &Spool) {
        self.seqs = other.seqs.clone();
    }

    /// Write the sequence numbers issued by this connection to `streams`,
    /// and the highest row id they cover, in one IMMEDIATE transaction. Call
    /// every minute or so, before retention and at a clean stop: between two
    /// calls an append writes only its own rows (no `streams` page), and a
    /// restart reads the few rows appended since.
    pub fn persist_seqs(&mut self) -> Result<(), SpoolError> {
        let Some(seqs) = self.seqs_to_persist() else {
            return Ok(());
        };
        self.write(|tx, err| write_seqs(tx, err, &seqs))?;
        self.seqs_persisted();
        Ok(())
    }

    /// The book's numbers if some moved since they were last written.
    pub(super) fn seqs_to_persist(&self) -> Option<Vec<StreamSeq>> {
        let book = self.book();
        book.dirty.then(|| book.streams.values().copied().collect())
    }

    /// The numbers taken by [`Spool::seqs_to_persist`] committed.
    pub(super) fn seqs_persisted(&self) {
        let mut book = self.book();
        book.dirty = false;
        book.appended_since_persist = 0;
    }

    /// Rows appended since [`Spool::persist_seqs`] last ran.
    pub fn appended_since_persist(&self) -> u64 {
        self.book().appended_since_persist
    }
}

/// Write `seqs` and the row id they cover inside the caller's transaction.
pub(super) fn write_seqs(
    tx: &rusqlite::Transaction<'_>,
    err: &dyn Fn(rusqlite::Error) -> SpoolError,
    seqs: &[StreamSeq],
) -> Result<(), SpoolError> {
    let mut st = tx.prepare_cached(SQL_SET_SEQ).map_err(err)?;
    for s in seqs {
        st.execute(params![s.id, s.last_seq]).map_err(err)?;
    }
    tx.execute(SQL_SEQ_THROUGH, []).map_err(err)?;
    Ok(())
}
