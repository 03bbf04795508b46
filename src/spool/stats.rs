//! What `status` reads: counts by stream and state, persistent counters,
//! agent state, and the record of each agent run.

use super::clock_spans::since_ms;
use super::open::{file_len, wal_path};
use super::{Spool, SpoolError, SQL_COUNTER_ADD};
use rusqlite::{params, OptionalExtension};
use std::collections::HashMap;

/// Counts for `status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    /// Rows by (stream, state).
    pub by_stream_state: Vec<(String, String, i64)>,
    /// Age of the oldest unacknowledged row, ms (by creation wall time),
    /// at least 0: `now_ms` less [`Stats::oldest_unacked_ms`].
    pub oldest_unacked_age_ms: Option<i64>,
    /// The wall time that age counts from, Unix ms: the row's append time,
    /// or when the clock was set for a row appended before
    /// (`clock_spans`); for a reader to judge whether the age
    /// means anything (`crate::event::age`).
    pub oldest_unacked_ms: Option<i64>,
    /// Size of the `-wal` file, bytes.
    pub wal_bytes: u64,
    /// Size of the database file, bytes.
    pub db_bytes: u64,
    /// Persistent counters (drops by reason and the like).
    pub counters: Vec<(String, i64)>,
}

/// A recorded agent run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunRecord {
    /// Run id.
    pub id: i64,
    /// Unix ms.
    pub started_ms: i64,
    /// Unix ms; `None` while running or after a kill.
    pub ended_ms: Option<i64>,
    /// Process id.
    pub pid: i64,
    /// Agent version.
    pub version: String,
    /// `ok`, `error`, `killed (no clean stop recorded)`, or `None` while running.
    pub exit_status: Option<String>,
    /// Error text for a failed run.
    pub error: Option<String>,
}

/// The earliest time a waiting row (PENDING or SENT) counts from: its
/// append time, or for a row appended before the clock was set, when it
/// was set ([`super::clock_spans`]); a read of the rows above the mark.
const SQL_OLDEST_WAITING: &str = concat!(
    "SELECT min(",
    since_ms!(),
    ") FROM events e
    WHERE e.id > (SELECT acked_through FROM delivery_mark)
      AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
      AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id)"
);

/// Per stream, when the clock was set for the earliest span of rows
/// appended before it ([`super::clock_spans`]) that still holds a waiting
/// row of the stream: the span's `settled_ms`. Reads the few spans and, per
/// span and stream, its rows above the acknowledged mark up to the first
/// waiting one.
const SQL_SET_FOR_WAITING: &str = "SELECT s.name, min(c.settled_ms)
    FROM clock_spans c, streams s
    WHERE c.last_id IS NOT NULL AND EXISTS (SELECT 1 FROM events e
        WHERE e.stream_id = s.id AND e.id >= c.first_id AND e.id <= c.last_id
          AND e.id > (SELECT acked_through FROM delivery_mark)
          AND NOT EXISTS (SELECT 1 FROM acked_above a WHERE a.id = e.id)
          AND NOT EXISTS (SELECT 1 FROM failed f WHERE f.id = e.id))
    GROUP BY s.name ORDER BY s.name";

impl Spool {
    /// The streams holding a waiting row (PENDING or SENT) appended before
    /// the wall clock was set, and when the spool saw it set (Unix ms): the
    /// time such a row's age counts from ([`Stats::oldest_unacked_ms`]).
    /// `(stream, settled_ms)`, by stream; none while the clock is not set
    /// (the span is open: its rows count from their own time). For
    /// `status`, to say such a row's age is not its own (schema 13).
    pub fn clock_set_for_waiting(&self) -> Result<Vec<(String, i64)>, SpoolError> {
        self.query_all(SQL_SET_FOR_WAITING, [], |r| Ok((r.get(0)?, r.get(1)?)))
    }

    /// Record one piece of agent state for `status` (health, last checkpoint, ...).
    pub fn set_state(&mut self, key: &str, value: &str, now_ms: i64) -> Result<(), SpoolError> {
        self.conn
            .execute(
                "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms",
                params![key, value, now_ms],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// The value recorded under `key`, if any.
    pub fn state(&self, key: &str) -> Result<Option<String>, SpoolError> {
        self.conn
            .query_row(super::SQL_GET_STATE, params![key], |r| r.get(0))
            .optional()
            .map_err(|e| self.err(e))
    }

    /// Record several pieces of agent state in one IMMEDIATE transaction.
    pub fn set_states(&mut self, states: &[(&str, String)], now_ms: i64) -> Result<(), SpoolError> {
        self.write(|tx, err| {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
                     ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms",
                )
                .map_err(err)?;
            for (k, v) in states {
                st.execute(params![k, v, now_ms]).map_err(err)?;
            }
            Ok(())
        })
    }

    /// All recorded agent state: `(key, value, updated_ms)`, by key.
    pub fn states(&self) -> Result<Vec<(String, String, i64)>, SpoolError> {
        self.query_all(
            "SELECT key, value, updated_ms FROM agent_state ORDER BY key",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
    }

    /// Add several counter increments in one IMMEDIATE transaction.
    pub fn count_many(&mut self, counts: &[(String, i64)]) -> Result<(), SpoolError> {
        self.write(|tx, err| {
            {
                let mut st = tx.prepare_cached(SQL_COUNTER_ADD).map_err(err)?;
                for (name, by) in counts {
                    st.execute(params![name, by]).map_err(err)?;
                }
            }
            Ok(())
        })
    }

    /// Add `by` to the persistent counter `name`.
    pub fn count(&mut self, name: &str, by: i64) -> Result<(), SpoolError> {
        self.conn
            .execute(SQL_COUNTER_ADD, params![name, by])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Rows by (stream, state), in that order: one pass over the rows,
    /// counted here. A `GROUP BY` over the rows made SQLite sort them, and
    /// its sorter spills to a temporary file (in /var/tmp) once they
    /// outgrow its memory: from about 40,000 rows a file of 1.4 MB and
    /// growing, written and deleted at every count, which the agent's
    /// metrics take every summary interval (issue 35: at 10 readings/s an
    /// hour in, 2,000-2,900 MB/day instead of 585).
    fn count_by_stream_state(&self) -> Result<Vec<(String, String, i64)>, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let mut st = self
            .conn
            .prepare_cached("SELECT stream, state FROM event_states")
            .map_err(e)?;
        let mut rows = st.query([]).map_err(e)?;
        // Looked up by borrowed names: nothing allocated per row.
        let mut by: HashMap<String, HashMap<String, i64>> = HashMap::new();
        while let Some(r) = rows.next().map_err(e)? {
            let stream = r.get_ref(0).map_err(e)?.as_str().map_err(|x| e(x.into()))?;
            let state = r.get_ref(1).map_err(e)?.as_str().map_err(|x| e(x.into()))?;
            let states = match by.get_mut(stream) {
                Some(states) => states,
                None => by.entry(stream.to_owned()).or_default(),
            };
            match states.get_mut(state) {
                Some(n) => *n += 1,
                None => {
                    states.insert(state.to_owned(), 1);
                }
            }
        }
        let mut out: Vec<(String, String, i64)> = by
            .into_iter()
            .flat_map(|(stream, states)| {
                states
                    .into_iter()
                    .map(move |(state, n)| (stream.clone(), state, n))
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Counts for `status`.
    pub fn stats(&self, now_ms: i64) -> Result<Stats, SpoolError> {
        let e = |e| SpoolError::classify(&self.path, e);
        let by = self.count_by_stream_state()?;
        let oldest: Option<i64> = self
            .conn
            .query_row(SQL_OLDEST_WAITING, [], |r| r.get(0))
            .optional()
            .map_err(e)?
            .flatten();
        let counters = self.counters()?;
        Ok(Stats {
            by_stream_state: by,
            oldest_unacked_age_ms: oldest.map(|c| (now_ms - c).max(0)),
            oldest_unacked_ms: oldest,
            wal_bytes: file_len(&wal_path(&self.path)),
            db_bytes: file_len(&self.path),
            counters,
        })
    }

    /// The persistent counters `(name, value)`, by name (drops by reason,
    /// FAILED by reason, command outcomes); one small table.
    pub fn counters(&self) -> Result<Vec<(String, i64)>, SpoolError> {
        self.query_all("SELECT name, value FROM counters ORDER BY name", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
    }

    /// Record the start of an agent run; first marks any earlier run that has
    /// no end as killed (the process died without a clean stop). Returns the run id.
    pub fn begin_run(&mut self, now_ms: i64, pid: u32, version: &str) -> Result<i64, SpoolError> {
        self.write(|tx, err| {
            tx.execute(
                "UPDATE runs SET exit_status = 'killed (no clean stop recorded)' WHERE ended_ms IS NULL AND exit_status IS NULL",
                [],
            )
            .map_err(err)?;
            tx.execute(
                "INSERT INTO runs (started_ms, pid, version) VALUES (?1, ?2, ?3)",
                params![now_ms, pid, version],
            )
            .map_err(err)?;
            let id = tx.last_insert_rowid();
            Ok(id)
        })
    }

    /// Record the end of run `id` with `exit_status` (`ok` or `error`) and optional error text.
    pub fn end_run(
        &mut self,
        id: i64,
        now_ms: i64,
        exit_status: &str,
        error: Option<&str>,
    ) -> Result<(), SpoolError> {
        self.conn
            .execute(
                "UPDATE runs SET ended_ms = ?2, exit_status = ?3, error = ?4 WHERE id = ?1",
                params![id, now_ms, exit_status, error],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// The newest `limit` runs, newest first.
    pub fn runs(&self, limit: usize) -> Result<Vec<RunRecord>, SpoolError> {
        self.query_all(
            "SELECT id, started_ms, ended_ms, pid, version, exit_status, error FROM runs ORDER BY id DESC LIMIT ?1",
            params![limit as i64],
            |r| {
                Ok(RunRecord {
                    id: r.get(0)?,
                    started_ms: r.get(1)?,
                    ended_ms: r.get(2)?,
                    pid: r.get(3)?,
                    version: r.get(4)?,
                    exit_status: r.get(5)?,
                    error: r.get(6)?,
                })
            },
        )
    }
}
