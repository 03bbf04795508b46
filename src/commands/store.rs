//! Command idempotency records in the spool, and their result events.
//!
//! Its one rule: **every state change of a command and the result event that
//! reports it commit in one IMMEDIATE transaction**, so a result is never
//! stored without its event nor sent without being stored.

use super::{hex, Command, RESULTS_STREAM};
use crate::envelope::{wall_clock_ms, EventIdGen, Format};
use crate::source::FieldValue;
use crate::spool::{insert_one, NewEvent, Spool, SpoolError};
use rusqlite::{params, OptionalExtension};

/// Terminal and intermediate command states.
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

/// Outcome of claiming a receipt.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// First time this (scope, id) is seen: the receipt is committed as `received`.
    New,
    /// Same id and hash, finished: the stored result was answered again
    /// (unless the delivery was a retained message).
    Duplicate {
        /// Stored state.
        state: String,
    },
    /// Same id and hash, still received or running: answered `in_progress`.
    InProgress,
    /// Same id, different hash: answered `conflict`; the record is untouched.
    Conflict,
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

/// How a result event is labelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// The command's own result.
    Result,
    /// The stored result, answered again for a duplicate delivery.
    Duplicate,
    /// A different request under an id already used.
    Conflict,
    /// A duplicate while the first is still running.
    InProgress,
}

impl Reply {
    fn as_str(self) -> &'static str {
        match self {
            Reply::Result => "result",
            Reply::Duplicate => "duplicate",
            Reply::Conflict => "conflict",
            Reply::InProgress => "in_progress",
        }
    }
}

/// Everything a result event carries.
#[derive(Debug, Clone)]
pub struct ResultEvent<'a> {
    /// Scope.
    pub scope: &'a str,
    /// Command id (None for a payload with no readable id).
    pub command_id: Option<&'a str>,
    /// Command name, when known.
    pub name: Option<&'a str>,
    /// State reported.
    pub state: &'a str,
    /// Result or error as JSON text.
    pub result: &'a str,
    /// How long the handler ran, ms.
    pub duration_ms: Option<i64>,
    /// Which kind of answer.
    pub reply: Reply,
    /// Whether the handler may be re-run after an interruption.
    pub retry_safe: Option<bool>,
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

fn result_event(r: &ResultEvent<'_>) -> NewEvent {
    let (ts_ms, trusted) = wall_clock_ms();
    let mut fields = vec![
        ("scope".to_owned(), FieldValue::Text(r.scope.to_owned())),
        (
            "command_id".to_owned(),
            FieldValue::Text(r.command_id.unwrap_or("").to_owned()),
        ),
        (
            "name".to_owned(),
            FieldValue::Text(r.name.unwrap_or("").to_owned()),
        ),
        ("state".to_owned(), FieldValue::Text(r.state.to_owned())),
        (
            "reply".to_owned(),
            FieldValue::Text(r.reply.as_str().to_owned()),
        ),
        ("result".to_owned(), FieldValue::Text(r.result.to_owned())),
    ];
    if let Some(d) = r.duration_ms {
        fields.push(("duration_ms".to_owned(), FieldValue::Num(d as f64)));
    }
    if let Some(s) = r.retry_safe {
        fields.push(("retry_safe".to_owned(), FieldValue::Bool(s)));
    }
    NewEvent {
        stream: RESULTS_STREAM.to_owned(),
        ts_ms,
        clock_trusted: trusted,
        fields,
    }
}

fn count(tx: &rusqlite::Transaction<'_>, name: &str) -> rusqlite::Result<usize> {
    tx.execute(
        "INSERT INTO counters (name, value) VALUES (?1, 1)
         ON CONFLICT(name) DO UPDATE SET value = value + 1",
        params![name],
    )
}

impl Spool {
    /// Claim the receipt of `cmd` atomically (`INSERT .. ON CONFLICT DO
    /// NOTHING`, never check-then-insert). For anything but [`Claim::New`],
    /// the answer event (stored result, `conflict`, `in_progress`) is appended
    /// in the same transaction; a retained duplicate of a finished command is
    /// counted but not answered again (field case F13).
    pub fn claim_command(
        &mut self,
        cmd: &Command,
        retained: bool,
        deadline_ms: Option<i64>,
        ctx: &mut EventCtx<'_>,
    ) -> Result<Claim, SpoolError> {
        let path = self.path().to_path_buf();
        let now = wall_clock_ms().0;
        self.write(|tx, err| {
            let inserted = tx
                .execute(
                    "INSERT INTO commands (scope, command_id, request_hash, name, request, state,
                        received_ms, ttl_ms, deadline_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, 'received', ?6, ?7, ?8)
                     ON CONFLICT(scope, command_id) DO NOTHING",
                    params![
                        cmd.scope,
                        cmd.command_id,
                        cmd.request_hash.as_slice(),
                        cmd.name,
                        cmd.canonical,
                        now,
                        cmd.ttl.map(|t| t.as_millis() as i64),
                        deadline_ms
                    ],
                )
                .map_err(err)?;
            let claim = if inserted == 1 {
                count(tx, "commands_received").map_err(err)?;
                Claim::New
            } else {
                let (hash, state, result, name, duration): (
                    Vec<u8>,
                    String,
                    Option<String>,
                    String,
                    Option<i64>,
                ) = tx
                    .query_row(
                        "SELECT request_hash, state, result, name, duration_ms FROM commands
                         WHERE scope = ?1 AND command_id = ?2",
                        params![cmd.scope, cmd.command_id],
                        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
                    )
                    .map_err(err)?;
                if hash != cmd.request_hash {
                    count(tx, "commands_conflicts").map_err(err)?;
                    let detail = serde_json::json!({
                        "error": "conflict: request hash mismatch",
                        "stored_request_hash": hex(&hash),
                        "request_hash": hex(&cmd.request_hash),
                        "stored_name": name,
                    })
                    .to_string();
                    let ev = result_event(&ResultEvent {
                        scope: &cmd.scope,
                        command_id: Some(&cmd.command_id),
                        name: Some(&cmd.name),
                        state: "conflict",
                        result: &detail,
                        duration_ms: None,
                        reply: Reply::Conflict,
                        retry_safe: None,
                    });
                    insert_one(tx, &path, &ev, ctx.ids, ctx.device_id, ctx.format, now)?;
                    Claim::Conflict
                } else {
                    tx.execute(
                        "UPDATE commands SET duplicates = duplicates + 1 WHERE scope = ?1 AND command_id = ?2",
                        params![cmd.scope, cmd.command_id],
                    )
                    .map_err(err)?;
                    count(tx, "commands_duplicates").map_err(err)?;
                    if state == super::store::cstate::RECEIVED || state == super::store::cstate::RUNNING
                    {
                        let ev = result_event(&ResultEvent {
                            scope: &cmd.scope,
                            command_id: Some(&cmd.command_id),
                            name: Some(&cmd.name),
                            state: &state,
                            result: r#"{"info":"in progress; not run again"}"#,
                            duration_ms: None,
                            reply: Reply::InProgress,
                            retry_safe: None,
                        });
                        insert_one(tx, &path, &ev, ctx.ids, ctx.device_id, ctx.format, now)?;
                        Claim::InProgress
                    } else {
                        if retained {
                            count(tx, "commands_retained_duplicates").map_err(err)?;
                        } else {
                            let ev = result_event(&ResultEvent {
                                scope: &cmd.scope,
                                command_id: Some(&cmd.command_id),
                                name: Some(&cmd.name),
                                state: &state,
                                result: result.as_deref().unwrap_or("null"),
                                duration_ms: duration,
                                reply: Reply::Duplicate,
                                retry_safe: None,
                            });
                            insert_one(tx, &path, &ev, ctx.ids, ctx.device_id, ctx.format, now)?;
                        }
                        Claim::Duplicate { state }
                    }
                }
            };
            Ok(claim)
        })
    }

    /// Move a command from `received` to `running`, committed before its
    /// handler starts. Returns false if it was not `received`.
    pub fn start_command(&mut self, scope: &str, command_id: &str) -> Result<bool, SpoolError> {
        let path = self.path().to_path_buf();
        let err = |e| SpoolError::classify(&path, e);
        let n = self
            .conn
            .execute(
                "UPDATE commands SET state = 'running', started_ms = ?3
                 WHERE scope = ?1 AND command_id = ?2 AND state = 'received'",
                params![scope, command_id, wall_clock_ms().0],
            )
            .map_err(err)?;
        Ok(n == 1)
    }

    /// End a command: store `state` and `result` and append the result event,
    /// in one transaction. Returns the result event's id.
    pub fn finish_command(
        &mut self,
        ev: &ResultEvent<'_>,
        ctx: &mut EventCtx<'_>,
    ) -> Result<String, SpoolError> {
        let path = self.path().to_path_buf();
        let now = wall_clock_ms().0;
        self.write(|tx, err| {
            tx.execute(
                "UPDATE commands SET state = ?3, result = ?4, finished_ms = ?5, duration_ms = ?6
                 WHERE scope = ?1 AND command_id = ?2",
                params![
                    ev.scope,
                    ev.command_id.unwrap_or(""),
                    ev.state,
                    ev.result,
                    now,
                    ev.duration_ms
                ],
            )
            .map_err(err)?;
            count(tx, &format!("commands_{}", ev.state)).map_err(err)?;
            let id = insert_one(
                tx,
                &path,
                &result_event(ev),
                ctx.ids,
                ctx.device_id,
                ctx.format,
                now,
            )?;
            Ok(id)
        })
    }

    /// Answer a message that could not be parsed: a `rejected` result event
    /// (no record: there may be no usable id) and the counter `commands_malformed`.
    pub fn reject_unparsed(
        &mut self,
        command_id: Option<&str>,
        why: &str,
        ctx: &mut EventCtx<'_>,
    ) -> Result<(), SpoolError> {
        let path = self.path().to_path_buf();
        self.write(|tx, err| {
            count(tx, "commands_malformed").map_err(err)?;
            let result = serde_json::json!({ "error": why }).to_string();
            let ev = result_event(&ResultEvent {
                scope: super::DEFAULT_SCOPE,
                command_id,
                name: None,
                state: cstate::REJECTED,
                result: &result,
                duration_ms: None,
                reply: Reply::Result,
                retry_safe: None,
            });
            insert_one(
                tx,
                &path,
                &ev,
                ctx.ids,
                ctx.device_id,
                ctx.format,
                wall_clock_ms().0,
            )?;
            Ok(())
        })
    }

    /// Commands left `received` or `running` by an earlier process, oldest first.
    pub fn unfinished_commands(&self) -> Result<Vec<Unfinished>, SpoolError> {
        let err = |e| SpoolError::classify(self.path(), e);
        let mut stmt = self
            .conn
            .prepare(
                "SELECT scope, command_id, name, request, state, received_ms, deadline_ms, ttl_ms
                 FROM commands WHERE state IN ('received','running') ORDER BY received_ms",
            )
            .map_err(err)?;
        let rows = stmt
            .query_map([], |r| {
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
            .map_err(err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        Ok(rows)
    }

    /// Put a `running` command back to `received` (its handler is retry-safe).
    pub fn requeue_command(&mut self, scope: &str, command_id: &str) -> Result<(), SpoolError> {
        let err = |e| SpoolError::classify(self.path(), e);
        self.conn
            .execute(
                "UPDATE commands SET state = 'received' WHERE scope = ?1 AND command_id = ?2 AND state = 'running'",
                params![scope, command_id],
            )
            .map(|_| ())
            .map_err(err)
    }

    /// Delete at most `batch` finished command records older than `cutoff_ms`.
    pub fn purge_commands(&mut self, cutoff_ms: i64, batch: usize) -> Result<usize, SpoolError> {
        let err = |e| SpoolError::classify(self.path(), e);
        self.conn
            .execute(
                "DELETE FROM commands WHERE rowid IN (SELECT rowid FROM commands
                 WHERE state NOT IN ('received','running') AND finished_ms < ?1 LIMIT ?2)",
                params![cutoff_ms, batch as i64],
            )
            .map_err(err)
    }

    /// For `status`: commands by state, total duplicates answered, mean duration (ms).
    pub fn command_stats(&self) -> Result<CommandStats, SpoolError> {
        let err = |e| SpoolError::classify(self.path(), e);
        let mut stmt = self
            .conn
            .prepare_cached("SELECT state, count(*) FROM commands GROUP BY state ORDER BY state")
            .map_err(err)?;
        let by_state = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(err)?
            .collect::<Result<Vec<(String, i64)>, _>>()
            .map_err(err)?;
        let (dups, mean): (Option<i64>, Option<f64>) = self
            .conn
            .query_row(
                "SELECT sum(duplicates), avg(duration_ms) FROM commands",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(err)?
            .unwrap_or((None, None));
        Ok(CommandStats {
            by_state,
            duplicates: dups.unwrap_or(0),
            mean_duration_ms: mean,
        })
    }
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
