//! Upkeep of the file: retention of acknowledged rows in bounded batches,
//! giving free pages back, and checkpoints.
//!
//! One rule: retention deletes only acknowledged rows (never an
//! unacknowledged or FAILED one, never the newest), a bounded batch per
//! transaction (F02).

use super::{clock_spans, held, keys, Spool, SpoolError, SQL_COUNTER_ADD};
use rusqlite::params;

/// Acknowledged rows, oldest first, appended before `?1` and below row
/// `?3` (the rows a clock span holds and those above them,
/// [`clock_spans::hold_from`]); never the newest row (its id keeps new ids
/// above every id ever used) nor a FAILED one.
pub(super) const SQL_PURGE: &str = "DELETE FROM events WHERE id IN (
    SELECT id FROM events
    WHERE id <= (SELECT acked_through FROM delivery_mark)
      AND id < (SELECT max(id) FROM events)
      AND id < ?3
      AND created_ms < ?1
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = events.id)
    ORDER BY id LIMIT ?2) RETURNING stream_id, seq";

/// Whether [`SQL_PURGE`] or [`SQL_PURGE_ABOVE`] would delete a row
/// appended before `?1` below row `?2` (read only: a pass with nothing to
/// delete writes nothing, not even the sequence numbers).
pub(super) const SQL_PURGE_ANY: &str = "SELECT EXISTS (
    SELECT 1 FROM events
    WHERE id <= (SELECT acked_through FROM delivery_mark)
      AND id < (SELECT max(id) FROM events)
      AND id < ?2
      AND created_ms < ?1
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = events.id))
 OR EXISTS (
    SELECT 1 FROM acked_above a JOIN events e ON e.id = a.id
    WHERE e.created_ms < ?1 AND a.id < (SELECT max(id) FROM events) AND a.id < ?2)";

/// [`SQL_PURGE`] for the rows acknowledged above the mark.
pub(super) const SQL_PURGE_ABOVE: &str = "DELETE FROM events WHERE id IN (
    SELECT a.id FROM acked_above a JOIN events e ON e.id = a.id
    WHERE e.created_ms < ?1 AND a.id < (SELECT max(id) FROM events) AND a.id < ?3
    ORDER BY a.id LIMIT ?2) RETURNING stream_id, seq";

pub(super) const SQL_PURGE_ABOVE_INDEX: &str =
    "DELETE FROM acked_above WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.id = acked_above.id)";

/// Result of one `PRAGMA wal_checkpoint` (<https://www.sqlite.org/pragma.html#pragma_wal_checkpoint>).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointResult {
    /// 1 when the checkpoint could not finish (a reader or writer was in the way).
    pub busy: i64,
    /// Frames in the WAL.
    pub log_frames: i64,
    /// Frames copied back into the database.
    pub checkpointed_frames: i64,
}

/// Checkpoint modes the agent uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointMode {
    /// Copy what it can without waiting for readers or writers.
    Passive,
    /// Copy everything, then wait for every reader to read from the
    /// database file alone, so the next write starts the WAL from its
    /// beginning (<https://www.sqlite.org/c3ref/wal_checkpoint_v2.html>);
    /// waits for writers and readers as long as the busy timeout allows,
    /// holding new writers off meanwhile ([`Spool::checkpoint_within`]
    /// bounds the wait).
    Restart,
    /// Copy everything and truncate the WAL to zero bytes; waits for writers.
    Truncate,
}

impl Spool {
    /// Delete at most `batch` acknowledged rows appended before `cutoff_ms`,
    /// oldest first, in one IMMEDIATE transaction. Never touches an
    /// unacknowledged or FAILED row, nor the newest row, nor a row appended
    /// before the wall clock was set while its span holds it (its span is
    /// open, or closed at `cutoff_ms` or later, see [`super::WallClock`]),
    /// nor any row above it. `cutoff_ms = i64::MAX` is the spool bound:
    /// every acknowledged row, oldest first, whatever its age or span.
    /// Returns the number deleted; call again until 0, with a checkpoint in
    /// between, so a large purge never balloons the WAL (F02). Sequence
    /// numbers are persisted in the same transaction
    /// ([`Spool::persist_seqs`]), and only when a row is to go: with
    /// nothing to delete this writes nothing (issue 23: persisting them at
    /// every maintenance pass was a commit every 5 s).
    pub fn purge_acked(&mut self, cutoff_ms: i64, batch: usize) -> Result<usize, SpoolError> {
        self.purge_acked_at(cutoff_ms, batch, super::WallClock::Settled)
    }

    /// [`Spool::purge_acked`] by a clock judged `now` when `cutoff_ms` was
    /// read: while it is still the unset clock (before the floor: a board
    /// without RTC), an open span holds nothing (its rows' times and the
    /// cutoff come from that same clock, which only loses time, across
    /// reboots too: an age read off it is never longer than the true one);
    /// past the floor an open span holds until a commit with a clock time
    /// sync vouched for closes it (the clock may have been stepped by
    /// something else, and the rows would read decades old).
    pub fn purge_acked_at(
        &mut self,
        cutoff_ms: i64,
        batch: usize,
        now: super::WallClock,
    ) -> Result<usize, SpoolError> {
        let below = clock_spans::hold_from(&self.conn, cutoff_ms, now).map_err(|e| self.err(e))?;
        let any: bool = self
            .conn
            .prepare_cached(SQL_PURGE_ANY)
            .and_then(|mut st| st.query_row(params![cutoff_ms, below], |r| r.get(0)))
            .map_err(|e| self.err(e))?;
        if !any {
            return Ok(0);
        }
        // The sequence numbers ride the purge's transaction.
        let seqs = self.seqs_to_persist();
        let n = self.write(|tx, err| {
            if let Some(seqs) = &seqs {
                super::seqs::write_seqs(tx, err, seqs)?;
            }
            // What each stream loses, for what the board says it still
            // holds (`held`): one small row per stream, in this commit.
            let mut top: std::collections::HashMap<i64, i64> = Default::default();
            let bounds = (cutoff_ms, below);
            let mut n = held::purge_noting(tx, SQL_PURGE, bounds, batch, &mut top).map_err(err)?;
            if n < batch {
                let above = held::purge_noting(tx, SQL_PURGE_ABOVE, bounds, batch - n, &mut top)
                    .map_err(err)?;
                if above > 0 {
                    tx.execute(SQL_PURGE_ABOVE_INDEX, []).map_err(err)?;
                }
                n += above;
            }
            if n > 0 {
                held::note_purged(tx, &top).map_err(err)?;
                keys::forget_purged(tx).map_err(err)?;
                clock_spans::forget(tx, cutoff_ms).map_err(err)?;
                tx.execute(SQL_COUNTER_ADD, params!["events_purged_acked", n as i64])
                    .map_err(err)?;
            }
            Ok(n)
        })?;
        if seqs.is_some() {
            self.seqs_persisted();
        }
        Ok(n)
    }

    /// Give up to `max_pages` free pages back to the filesystem
    /// (`PRAGMA incremental_vacuum`, <https://www.sqlite.org/pragma.html#pragma_incremental_vacuum>)
    /// when the free pages inside the file exceed the live data plus
    /// `slack_bytes`. One bounded step: call again at the next maintenance
    /// pass. Returns the pages freed.
    pub fn shrink_step(&mut self, slack_bytes: u64, max_pages: u64) -> Result<u64, SpoolError> {
        let (live, free) = self.usage()?;
        if free <= live.saturating_add(slack_bytes) {
            return Ok(0);
        }
        let page = self
            .conn
            .query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
            .map_err(|e| self.err(e))?
            .max(512) as u64;
        let excess = (free - live - slack_bytes) / page;
        let pages = excess.clamp(1, max_pages.max(1));
        {
            // Each step frees one page: step the pragma to its end.
            let mut st = self
                .conn
                .prepare(&format!("PRAGMA incremental_vacuum({pages})"))
                .map_err(|e| self.err(e))?;
            let mut rows = st.query([]).map_err(|e| self.err(e))?;
            while rows.next().map_err(|e| self.err(e))?.is_some() {}
        }
        let (_, after) = self.usage()?;
        Ok(free.saturating_sub(after) / page)
    }

    /// Run `PRAGMA wal_checkpoint(mode)`. A busy result is reported, not an error.
    pub fn checkpoint(&self, mode: CheckpointMode) -> Result<CheckpointResult, SpoolError> {
        let sql = match mode {
            CheckpointMode::Passive => "PRAGMA wal_checkpoint(PASSIVE)",
            CheckpointMode::Restart => "PRAGMA wal_checkpoint(RESTART)",
            CheckpointMode::Truncate => "PRAGMA wal_checkpoint(TRUNCATE)",
        };
        self.conn
            .query_row(sql, [], |r| {
                Ok(CheckpointResult {
                    busy: r.get(0)?,
                    log_frames: r.get(1)?,
                    checkpointed_frames: r.get(2)?,
                })
            })
            .map_err(|e| self.err(e))
            .inspect(|r| {
                self.wal
                    .note_checkpoint(r.log_frames, r.checkpointed_frames)
            })
    }

    /// [`Spool::checkpoint`] waiting at most `wait` (instead of the busy
    /// timeout) for writers and readers; zero waits for none. A checkpoint
    /// that ran out of time reports `busy = 1` after copying what it could,
    /// as PASSIVE would. The connection's busy timeout (read before) is put
    /// back after, whatever the checkpoint returned.
    pub fn checkpoint_within(
        &self,
        mode: CheckpointMode,
        wait: std::time::Duration,
    ) -> Result<CheckpointResult, SpoolError> {
        let before: i64 = self
            .conn
            .query_row("PRAGMA busy_timeout", [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        self.conn.busy_timeout(wait).map_err(|e| self.err(e))?;
        let res = self.checkpoint(mode);
        // `sqlite3_busy_timeout` cannot fail on an open connection; were it
        // to, the error says so rather than leaving the short wait unnoticed.
        let before = std::time::Duration::from_millis(before.max(0) as u64);
        self.conn.busy_timeout(before).map_err(|e| self.err(e))?;
        res
    }

    /// Live and free space inside the file, bytes: `(page_count -
    /// freelist_count) * page_size` and `freelist_count * page_size`.
    pub fn usage(&self) -> Result<(u64, u64), SpoolError> {
        let q = |sql: &str| {
            self.conn
                .query_row(sql, [], |r| r.get::<_, i64>(0))
                .map_err(|e| self.err(e))
        };
        let (pages, free, size) = (
            q("PRAGMA page_count")?,
            q("PRAGMA freelist_count")?,
            q("PRAGMA page_size")?,
        );
        Ok((
            ((pages - free).max(0) * size) as u64,
            (free.max(0) * size) as u64,
        ))
    }

    /// `PRAGMA quick_check` result (`ok` when healthy).
    pub fn quick_check(&self) -> Result<String, SpoolError> {
        self.conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(|e| self.err(e))
    }
}
