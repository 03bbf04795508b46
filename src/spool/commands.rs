//! Command records: the `commands` table, one row per (scope, command id)
//! with its request hash, state, result and the agent clock at receipt.
//!
//! Every statement on that table lives here; what a command's arrival,
//! start and end mean is decided in [`crate::commands::store`]. One rule:
//! a record is claimed with `INSERT .. ON CONFLICT DO NOTHING` (never
//! check-then-insert), and each state change commits in the same IMMEDIATE
//! transaction as the result event that reports it.

use super::append::{insert_one, NewEvent};
use super::{Spool, SpoolError};
use crate::event::envelope::{EventId, EventIdGen, Format};
use rusqlite::{params, OptionalExtension, Transaction};
use std::path::Path;

/// Command states (the `commands.state` column's CHECK constraint).
pub mod cstate {
    /// Receipt committed; not started.
    pub const RECEIVED: &str = "received";
    /// Handler started (committed before it ran).
    pub const RUNNING: &str = "running";
    /// Handler succeeded.
    pub const COMPLETED: &str = "completed";
    /// Handler ran and failed.
    pub const FAILED: &str = "failed";
    /// Not run: unknown command, bad arguments.
    pub const REJECTED: &str = "rejected";
    /// Not run: past its deadline.
    pub const EXPIRED: &str = "expired";
    /// Was running when the agent died; not re-run (handler not retry-safe).
    pub const INTERRUPTED: &str = "interrupted";
}

const SQL_EXISTS: &str = "SELECT 1 FROM commands WHERE scope = ?1 AND command_id = ?2";
const SQL_CLAIM: &str = "INSERT INTO commands (scope, command_id, request_hash, name, request,
        state, received_ms, ttl_ms, deadline_ms, received_clock_ms, result, finished_ms)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
    ON CONFLICT(scope, command_id) DO NOTHING";
const SQL_STORED: &str = "SELECT request_hash, state, result, name, duration_ms FROM commands
    WHERE scope = ?1 AND command_id = ?2";
const SQL_DUPLICATE: &str =
    "UPDATE commands SET duplicates = duplicates + 1 WHERE scope = ?1 AND command_id = ?2";
const SQL_COUNT_ONE: &str = "INSERT INTO counters (name, value) VALUES (?1, 1)
    ON CONFLICT(name) DO UPDATE SET value = value + 1";
const SQL_FINISH: &str = "UPDATE commands SET state = ?3, result = ?4, finished_ms = ?5,
        duration_ms = ?6, request = substr(request, 1, ?7)
    WHERE scope = ?1 AND command_id = ?2";
const SQL_START: &str = "UPDATE commands SET state = 'running', started_ms = ?3
    WHERE scope = ?1 AND command_id = ?2 AND state = 'received'";
const SQL_REQUEUE: &str = "UPDATE commands SET state = 'received'
    WHERE scope = ?1 AND command_id = ?2 AND state = 'running'";
const SQL_UNFINISHED: &str = "SELECT scope, command_id, name, request, state, received_ms,
        deadline_ms, ttl_ms
    FROM commands WHERE state IN ('received','running') ORDER BY received_ms";
const SQL_COUNT: &str = "SELECT count(*) FROM commands";
const SQL_NEWEST_CLOCK: &str = "SELECT max(received_clock_ms) FROM commands";
const SQL_STATE_VALUE: &str = "SELECT value FROM agent_state WHERE key = ?1";
const SQL_RAISE_STATE: &str = "INSERT INTO agent_state (key, value, updated_ms) VALUES (?1, ?2, ?3)
    ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_ms = excluded.updated_ms
    WHERE CAST(excluded.value AS INTEGER) > CAST(agent_state.value AS INTEGER)";
const SQL_NEWEST_KEPT: &str = "SELECT rowid FROM commands ORDER BY rowid DESC LIMIT 1 OFFSET ?1";
const SQL_PURGE_CANDIDATES: &str = "SELECT rowid, coalesce(received_clock_ms, 0),
        state = 'rejected'
    FROM commands
    WHERE state NOT IN ('received', 'running') AND rowid < ?1
      AND (coalesce(received_clock_ms, 0) <= ?2 OR state = 'rejected')
    ORDER BY rowid LIMIT ?3";
const SQL_DROPPABLE: &str = "SELECT rowid FROM commands
    WHERE rowid < ?1 AND state NOT IN ('received', 'running')
      AND (state = 'rejected' OR name IN (SELECT value FROM json_each(?2)))
    ORDER BY rowid LIMIT ?3";
const SQL_DELETE: &str =
    "DELETE FROM commands WHERE rowid = ?1 AND state NOT IN ('received', 'running')";
const SQL_BY_STATE: &str = "SELECT state, count(*) FROM commands GROUP BY state ORDER BY state";
const SQL_DUPLICATES_AND_MEAN: &str = "SELECT sum(duplicates), avg(duration_ms) FROM commands";

/// A receipt to claim: one new row of `commands`.
#[derive(Debug, Clone, Copy)]
pub struct NewRecord<'a> {
    /// Scope (with the command id, the record's key).
    pub scope: &'a str,
    /// Command id.
    pub command_id: &'a str,
    /// sha256 of the canonical request.
    pub request_hash: &'a [u8],
    /// Command name.
    pub name: &'a str,
    /// The canonical request as kept (whole while it may run, truncated once
    /// rejected).
    pub request: &'a str,
    /// `received`, or `rejected` for a command refused at receipt.
    pub state: &'a str,
    /// Wall clock at receipt, Unix ms.
    pub received_ms: i64,
    /// Time to live, ms.
    pub ttl_ms: Option<i64>,
    /// Wall-clock deadline, when the clock is trusted and a TTL applies.
    pub deadline_ms: Option<i64>,
    /// The agent clock at receipt ([`crate::commands::retention::AgentClock`]).
    pub clock_ms: i64,
    /// The result (JSON text) of a command rejected at receipt.
    pub result: Option<&'a str>,
    /// Wall clock when it finished (at receipt, for a rejected one).
    pub finished_ms: Option<i64>,
}

/// What a record already holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCommand {
    /// sha256 of the canonical request first received under this id.
    pub request_hash: Vec<u8>,
    /// Its state.
    pub state: String,
    /// Its result (JSON text), once finished.
    pub result: Option<String>,
    /// The command name.
    pub name: String,
    /// How long its handler ran, ms.
    pub duration_ms: Option<i64>,
}

/// A command found unfinished at start.
#[derive(Debug, Clone)]
pub struct Unfinished {
    /// Scope.
    pub scope: String,
    /// Command id.
    pub command_id: String,
    /// Name.
    pub name: String,
    /// Canonical request JSON (`{"args":..,"name":..}`).
    pub request: String,
    /// `received` or `running`.
    pub state: String,
    /// Unix ms of receipt.
    pub received_ms: i64,
    /// Wall-clock deadline, when one was known.
    pub deadline_ms: Option<i64>,
    /// TTL, ms.
    pub ttl_ms: Option<i64>,
}

/// A finished record that may be deleted: old enough, or `rejected`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgeCandidate {
    /// The record's rowid: receipt order (records are only ever appended,
    /// and the newest is never deleted, so rowids only grow).
    pub rowid: i64,
    /// Agent clock reading at receipt (0 for records written before the
    /// clock existed: they are older than anything stamped since).
    pub received_clock_ms: i64,
    /// `rejected`: nothing ran, so deleting the record cannot let anything
    /// run twice (a redelivery is judged afresh).
    pub rejected: bool,
}

/// Command counts for `status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CommandStats {
    /// Records by state.
    pub by_state: Vec<(String, i64)>,
    /// Duplicate deliveries answered from the store.
    pub duplicates: i64,
    /// Mean handler duration, ms.
    pub mean_duration_ms: Option<f64>,
}

/// Identity and format for appending result events.
#[derive(Debug)]
pub struct EventCtx<'a> {
    /// Event ids.
    pub ids: &'a mut EventIdGen,
    /// Device id.
    pub device_id: &'a str,
    /// Payload format.
    pub format: Format,
}

/// The statements of one command transaction ([`Spool::command_write`]).
pub struct CommandTx<'t> {
    tx: &'t Transaction<'t>,
    path: &'t Path,
}

impl CommandTx<'_> {
    fn err(&self, e: rusqlite::Error) -> SpoolError {
        SpoolError::classify(self.path, e)
    }

    /// Whether a record of (`scope`, `command_id`) exists.
    pub fn exists(&self, scope: &str, command_id: &str) -> Result<bool, SpoolError> {
        self.tx
            .prepare_cached(SQL_EXISTS)
            .and_then(|mut st| {
                st.query_row(params![scope, command_id], |_| Ok(()))
                    .optional()
            })
            .map(|found| found.is_some())
            .map_err(|e| self.err(e))
    }

    /// Claim `r`: true when this transaction inserted it, false when a
    /// record of the same key was already there (left untouched).
    pub fn claim(&self, r: &NewRecord<'_>) -> Result<bool, SpoolError> {
        let n = self
            .tx
            .prepare_cached(SQL_CLAIM)
            .and_then(|mut st| {
                st.execute(params![
                    r.scope,
                    r.command_id,
                    r.request_hash,
                    r.name,
                    r.request,
                    r.state,
                    r.received_ms,
                    r.ttl_ms,
                    r.deadline_ms,
                    r.clock_ms,
                    r.result,
                    r.finished_ms,
                ])
            })
            .map_err(|e| self.err(e))?;
        Ok(n == 1)
    }

    /// The record of (`scope`, `command_id`), which must exist.
    pub fn stored(&self, scope: &str, command_id: &str) -> Result<StoredCommand, SpoolError> {
        self.tx
            .query_row(SQL_STORED, params![scope, command_id], |r| {
                Ok(StoredCommand {
                    request_hash: r.get(0)?,
                    state: r.get(1)?,
                    result: r.get(2)?,
                    name: r.get(3)?,
                    duration_ms: r.get(4)?,
                })
            })
            .map_err(|e| self.err(e))
    }

    /// Count one more duplicate delivery on the record.
    pub fn note_duplicate(&self, scope: &str, command_id: &str) -> Result<(), SpoolError> {
        self.tx
            .execute(SQL_DUPLICATE, params![scope, command_id])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Add one to the persistent counter `name`.
    pub fn count(&self, name: &str) -> Result<(), SpoolError> {
        self.tx
            .execute(SQL_COUNT_ONE, params![name])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Store the end of (`scope`, `command_id`): `state`, `result`, when, how
    /// long; the request is cut to `kept_chars` characters.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &self,
        (scope, command_id): (&str, &str),
        state: &str,
        result: &str,
        now_ms: i64,
        duration_ms: Option<i64>,
        kept_chars: usize,
    ) -> Result<(), SpoolError> {
        self.tx
            .execute(
                SQL_FINISH,
                params![
                    scope,
                    command_id,
                    state,
                    result,
                    now_ms,
                    duration_ms,
                    kept_chars as i64
                ],
            )
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Append `ev` (a result event) in this transaction; its event id.
    pub fn append(
        &self,
        ev: &NewEvent,
        ctx: &mut EventCtx<'_>,
        now_ms: i64,
    ) -> Result<EventId, SpoolError> {
        insert_one(
            self.tx,
            self.path,
            ev,
            ctx.ids,
            ctx.device_id,
            ctx.format,
            now_ms,
        )
    }

    /// Raise the agent state `key` (an integer as decimal text) to `value`
    /// in this transaction: written when there is none or it is smaller,
    /// else left as it is (never lowered).
    pub fn raise_state(&self, key: &str, value: i64, now_ms: i64) -> Result<(), SpoolError> {
        self.tx
            .prepare_cached(SQL_RAISE_STATE)
            .and_then(|mut st| st.execute(params![key, value.to_string(), now_ms]))
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Records, all states.
    pub fn total(&self) -> Result<usize, SpoolError> {
        let n: i64 = self
            .tx
            .query_row(SQL_COUNT, [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The rowid of the `n`-th newest record (1 = the newest), or
    /// `i64::MIN` when there are fewer.
    pub fn nth_newest_rowid(&self, n: usize) -> Result<i64, SpoolError> {
        let found: Option<i64> = self
            .tx
            .query_row(SQL_NEWEST_KEPT, params![n as i64 - 1], |r| r.get(0))
            .optional()
            .map_err(|e| self.err(e))?;
        Ok(found.unwrap_or(i64::MIN))
    }

    /// Finished records below rowid `below`, received at or before agent
    /// clock `aged_at_ms` or `rejected`, oldest first, at most `limit`.
    pub fn purge_candidates(
        &self,
        below: i64,
        aged_at_ms: i64,
        limit: usize,
    ) -> Result<Vec<PurgeCandidate>, SpoolError> {
        let e = |e| self.err(e);
        let mut st = self.tx.prepare_cached(SQL_PURGE_CANDIDATES).map_err(e)?;
        let rows = st
            .query_map(params![below, aged_at_ms, limit as i64], |r| {
                Ok(PurgeCandidate {
                    rowid: r.get(0)?,
                    received_clock_ms: r.get(1)?,
                    rejected: r.get(2)?,
                })
            })
            .map_err(e)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(e)?;
        Ok(rows)
    }

    /// Finished records below rowid `below` that are `rejected` or named one
    /// of `names` (a JSON array of strings), oldest first, at most `limit`.
    pub fn droppable(&self, below: i64, names: &str, limit: usize) -> Result<Vec<i64>, SpoolError> {
        let e = |e| self.err(e);
        let mut st = self.tx.prepare_cached(SQL_DROPPABLE).map_err(e)?;
        let rows = st
            .query_map(params![below, names, limit as i64], |r| r.get(0))
            .map_err(e)?
            .collect::<Result<Vec<i64>, _>>()
            .map_err(e)?;
        Ok(rows)
    }

    /// Delete the records `rowids` (never a `received` or `running` one);
    /// how many went.
    pub fn delete(&self, rowids: &[i64]) -> Result<usize, SpoolError> {
        let e = |e| self.err(e);
        let mut st = self.tx.prepare_cached(SQL_DELETE).map_err(e)?;
        let mut n = 0;
        for rowid in rowids {
            n += st.execute(params![rowid]).map_err(e)?;
        }
        Ok(n)
    }
}

impl Spool {
    /// Run `f` on the command statements of one IMMEDIATE transaction: Ok
    /// commits, Err rolls back.
    pub fn command_write<T>(
        &mut self,
        f: impl FnOnce(&mut CommandTx<'_>) -> Result<T, SpoolError>,
    ) -> Result<T, SpoolError> {
        let path = self.path.clone();
        self.write(|tx, _| {
            let mut c = CommandTx { tx, path: &path };
            f(&mut c)
        })
    }

    /// Move a command from `received` to `running`, committed before its
    /// handler starts. Returns false if it was not `received`.
    pub fn start_command(&mut self, scope: &str, command_id: &str) -> Result<bool, SpoolError> {
        let now_ms = crate::event::envelope::wall_clock_ms().0;
        let n = self
            .conn
            .execute(SQL_START, params![scope, command_id, now_ms])
            .map_err(|e| self.err(e))?;
        Ok(n == 1)
    }

    /// Put a `running` command back to `received` (its handler is retry-safe).
    pub fn requeue_command(&mut self, scope: &str, command_id: &str) -> Result<(), SpoolError> {
        self.conn
            .execute(SQL_REQUEUE, params![scope, command_id])
            .map(|_| ())
            .map_err(|e| self.err(e))
    }

    /// Commands left `received` or `running` by an earlier process, oldest first.
    pub fn unfinished_commands(&self) -> Result<Vec<Unfinished>, SpoolError> {
        self.query_all(SQL_UNFINISHED, [], |r| {
            Ok(Unfinished {
                scope: r.get(0)?,
                command_id: r.get(1)?,
                name: r.get(2)?,
                request: r.get(3)?,
                state: r.get(4)?,
                received_ms: r.get(5)?,
                deadline_ms: r.get(6)?,
                ttl_ms: r.get(7)?,
            })
        })
    }

    /// Whether a record of (`scope`, `command_id`) exists (outside a
    /// transaction: a hint only; [`CommandTx::claim`] decides).
    pub fn command_exists(&self, scope: &str, command_id: &str) -> Result<bool, SpoolError> {
        self.conn
            .query_row(SQL_EXISTS, params![scope, command_id], |_| Ok(()))
            .optional()
            .map(|found| found.is_some())
            .map_err(|e| self.err(e))
    }

    /// Command records, all states.
    pub fn command_count(&self) -> Result<usize, SpoolError> {
        let n: i64 = self
            .conn
            .query_row(SQL_COUNT, [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The latest agent clock reading known to the spool: the value
    /// persisted in `agent_state` under `clock_key` or the newest receipt
    /// stamp, whichever is later (0 for none).
    pub fn command_clock_ms(&self, clock_key: &str) -> Result<i64, SpoolError> {
        let stamped: Option<i64> = self
            .conn
            .query_row(SQL_NEWEST_CLOCK, [], |r| r.get(0))
            .map_err(|e| self.err(e))?;
        let persisted: Option<String> = self
            .conn
            .query_row(SQL_STATE_VALUE, params![clock_key], |r| r.get(0))
            .optional()
            .map_err(|e| self.err(e))?;
        let persisted = persisted.and_then(|v| v.parse::<i64>().ok());
        Ok(stamped.unwrap_or(0).max(persisted.unwrap_or(0)))
    }

    /// For `status`: commands by state, total duplicates answered, mean duration (ms).
    pub fn command_stats(&self) -> Result<CommandStats, SpoolError> {
        let by_state = self.query_all(SQL_BY_STATE, [], |r| Ok((r.get(0)?, r.get(1)?)))?;
        let (dups, mean): (Option<i64>, Option<f64>) = self
            .conn
            .query_row(SQL_DUPLICATES_AND_MEAN, [], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .map_err(|e| self.err(e))?
            .unwrap_or((None, None));
        Ok(CommandStats {
            by_state,
            duplicates: dups.unwrap_or(0),
            mean_duration_ms: mean,
        })
    }
}
