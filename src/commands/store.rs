//! Command idempotency records in the spool, and their result events.
//!
//! Its one rule: **every state change of a command and the result event that
//! reports it commit in one IMMEDIATE transaction**, so a result is never
//! stored without its event nor sent without being stored.

use super::retention::{self, Candidate, Policy};
use super::{hex, Command};
use crate::envelope::{wall_clock_ms, EventIdGen, Format};
use crate::reading::FieldValue;
use crate::spool::{insert_one, NewEvent, Spool, SpoolError};
use crate::stream::RESULTS_STREAM;
use rusqlite::{params, OptionalExtension};
use std::time::Duration;

/// Characters of the canonical request kept once a command has finished (or
/// was rejected at receipt): the request hash still answers duplicates and
/// conflicts, and a 60 KB body is not kept for the life of the record.
pub const KEPT_REQUEST_CHARS: usize = 256;

/// Batches of [`retention::PURGE_BATCH`] deleted per purge pass at most.
const PURGE_MAX_BATCHES: usize = 20;

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

/// What to do with a command if it turns out to be new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit<'a> {
    /// Record it as `received`, to be run.
    Accept,
    /// Record it as `rejected` at once with this error (unknown command):
    /// the hash and a truncated request are kept, a result is appended.
    Reject(&'a str),
    /// Answer `rejected` with this error and keep no record (rate limit):
    /// the same id may be sent again later.
    Refuse(&'a str),
}

/// How a receipt is stamped and admitted.
#[derive(Debug, Clone, Copy)]
pub struct Receipt<'a> {
    /// Wall-clock deadline, when the clock is trusted and a TTL applies.
    pub deadline_ms: Option<i64>,
    /// Time to live (the command's own, or the default for exec handlers).
    pub ttl: Option<Duration>,
    /// [`retention::AgentClock`] reading now.
    pub clock_ms: i64,
    /// What a new command gets.
    pub admit: Admit<'a>,
}

/// Outcome of claiming a receipt.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// First time this (scope, id) is seen: the receipt is committed as `received`.
    New,
    /// First time seen, recorded as `rejected` at once ([`Admit::Reject`]).
    Rejected,
    /// First time seen, answered `rejected`, not recorded ([`Admit::Refuse`]).
    Refused,
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
    /// Not accepted now (rate limit) and not recorded: may be sent again.
    RateLimited,
}

impl Reply {
    fn as_str(self) -> &'static str {
        match self {
            Reply::Result => "result",
            Reply::Duplicate => "duplicate",
            Reply::Conflict => "conflict",
            Reply::InProgress => "in_progress",
            Reply::RateLimited => "rate_limited",
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
        replay: None,
        stream: RESULTS_STREAM.to_owned(),
        ts_ms,
        clock_trusted: trusted,
        fields,
        key: None,
        reply: None,
    }
}

/// The first [`KEPT_REQUEST_CHARS`] characters of a canonical request.
fn kept_request(canonical: &str) -> &str {
    match canonical.char_indices().nth(KEPT_REQUEST_CHARS) {
        Some((i, _)) => &canonical[..i],
        None => canonical,
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
    /// NOTHING`, never check-then-insert; under [`Admit::Refuse`] a lookup
    /// inside the same IMMEDIATE transaction). A new command is admitted as
    /// `receipt.admit` says. For anything but [`Claim::New`], the answer
    /// event (stored result, `conflict`, `in_progress`, rejection) is
    /// appended in the same transaction; a retained duplicate of a finished
    /// command is counted but not answered again (field case F13).
    pub fn claim_command(
        &mut self,
        cmd: &Command,
        retained: bool,
        receipt: &Receipt<'_>,
        ctx: &mut EventCtx<'_>,
    ) -> Result<Claim, SpoolError> {
        let path = self.path().to_path_buf();
        let now = wall_clock_ms().0;
        self.write(|tx, err| {
            let inserted = match receipt.admit {
                Admit::Refuse(_) => {
                    let known = tx
                        .query_row(
                            "SELECT 1 FROM commands WHERE scope = ?1 AND command_id = ?2",
                            params![cmd.scope, cmd.command_id],
                            |_| Ok(()),
                        )
                        .optional()
                        .map_err(err)?;
                    known.is_none()
                }
                Admit::Accept | Admit::Reject(_) => {
                    let (state, request, result, finished) = match receipt.admit {
                        Admit::Reject(why) => (
                            cstate::REJECTED,
                            kept_request(&cmd.canonical),
                            Some(serde_json::json!({ "error": why }).to_string()),
                            Some(now),
                        ),
                        _ => (cstate::RECEIVED, cmd.canonical.as_str(), None, None),
                    };
                    tx.prepare_cached(
                        "INSERT INTO commands (scope, command_id, request_hash, name, request, state,
                            received_ms, ttl_ms, deadline_ms, received_clock_ms, result, finished_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
                         ON CONFLICT(scope, command_id) DO NOTHING",
                    )
                    .map_err(err)?
                    .execute(params![
                        cmd.scope,
                        cmd.command_id,
                        cmd.request_hash.as_slice(),
                        cmd.name,
                        request,
                        state,
                        now,
                        receipt.ttl.map(|t| t.as_millis() as i64),
                        receipt.deadline_ms,
                        receipt.clock_ms,
                        result,
                        finished,
                    ])
                    .map_err(err)?
                        == 1
                }
            };
            if inserted {
                let (why, state, reply, claim) = match receipt.admit {
                    Admit::Accept => {
                        count(tx, "commands_received").map_err(err)?;
                        return Ok(Claim::New);
                    }
                    Admit::Reject(why) => {
                        count(tx, "commands_received").map_err(err)?;
                        count(tx, "commands_rejected").map_err(err)?;
                        (why, cstate::REJECTED, Reply::Result, Claim::Rejected)
                    }
                    Admit::Refuse(why) => {
                        count(tx, "commands_rate_limited").map_err(err)?;
                        (why, cstate::REJECTED, Reply::RateLimited, Claim::Refused)
                    }
                };
                let result = serde_json::json!({ "error": why }).to_string();
                let ev = result_event(&ResultEvent {
                    scope: &cmd.scope,
                    command_id: Some(&cmd.command_id),
                    name: Some(&cmd.name),
                    state,
                    result: &result,
                    duration_ms: None,
                    reply,
                    retry_safe: None,
                });
                insert_one(tx, &path, &ev, ctx.ids, ctx.device_id, ctx.format, now)?;
                return Ok(claim);
            }
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
            let claim = if hash != cmd.request_hash {
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
                if state == cstate::RECEIVED || state == cstate::RUNNING {
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
                "UPDATE commands SET state = ?3, result = ?4, finished_ms = ?5, duration_ms = ?6,
                    request = substr(request, 1, ?7)
                 WHERE scope = ?1 AND command_id = ?2",
                params![
                    ev.scope,
                    ev.command_id.unwrap_or(""),
                    ev.state,
                    ev.result,
                    now,
                    ev.duration_ms,
                    KEPT_REQUEST_CHARS as i64
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
    /// The result names the payload by its sha256 and size, never echoes it.
    pub fn reject_unparsed(
        &mut self,
        command_id: Option<&str>,
        why: &str,
        payload: &[u8],
        ctx: &mut EventCtx<'_>,
    ) -> Result<(), SpoolError> {
        use sha2::{Digest, Sha256};
        let path = self.path().to_path_buf();
        self.write(|tx, err| {
            count(tx, "commands_malformed").map_err(err)?;
            let result = serde_json::json!({
                "error": why,
                "payload_sha256": hex(&Sha256::digest(payload)),
                "payload_bytes": payload.len(),
            })
            .to_string();
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

    /// Command records, all states.
    pub fn command_count(&self) -> Result<usize, SpoolError> {
        let n: i64 = self
            .conn
            .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
            .map_err(|e| SpoolError::classify(self.path(), e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The latest [`retention::AgentClock`] reading known to the spool: the
    /// persisted one or the newest receipt stamp, whichever is later.
    pub fn command_clock_ms(&self) -> Result<i64, SpoolError> {
        let err = |e| SpoolError::classify(self.path(), e);
        let stamped: Option<i64> = self
            .conn
            .query_row("SELECT max(received_clock_ms) FROM commands", [], |r| {
                r.get(0)
            })
            .map_err(err)?;
        let persisted: Option<String> = self
            .conn
            .query_row(
                "SELECT value FROM agent_state WHERE key = ?1",
                params![retention::CLOCK_STATE_KEY],
                |r| r.get(0),
            )
            .optional()
            .map_err(err)?;
        let persisted = persisted.and_then(|v| v.parse::<i64>().ok());
        Ok(stamped.unwrap_or(0).max(persisted.unwrap_or(0)))
    }

    /// Delete command records as [`retention::select`] decides, in
    /// transactions of at most [`retention::PURGE_BATCH`] records, never a
    /// `received` or `running` one. `now_ms` is the
    /// [`retention::AgentClock`] reading, never the wall clock. Returns the
    /// number deleted.
    pub fn purge_commands(&mut self, now_ms: i64, policy: &Policy) -> Result<usize, SpoolError> {
        let window = i64::try_from(policy.window.as_millis()).unwrap_or(i64::MAX);
        let mut deleted = 0;
        for _ in 0..PURGE_MAX_BATCHES {
            let n = self.write(|tx, err| {
                let total: i64 = tx
                    .query_row("SELECT count(*) FROM commands", [], |r| r.get(0))
                    .map_err(err)?;
                let newest_kept_from: i64 = tx
                    .query_row(
                        "SELECT rowid FROM commands ORDER BY rowid DESC LIMIT 1 OFFSET ?1",
                        params![retention::KEEP_NEWEST as i64 - 1],
                        |r| r.get(0),
                    )
                    .optional()
                    .map_err(err)?
                    .unwrap_or(i64::MIN);
                let cands = tx
                    .prepare_cached(
                        "SELECT rowid, coalesce(received_clock_ms, 0), state = 'rejected'
                         FROM commands
                         WHERE state NOT IN ('received', 'running') AND rowid < ?1
                           AND (coalesce(received_clock_ms, 0) <= ?2 OR state = 'rejected')
                         ORDER BY rowid LIMIT ?3",
                    )
                    .map_err(err)?
                    .query_map(
                        params![
                            newest_kept_from,
                            now_ms.saturating_sub(window),
                            retention::PURGE_BATCH as i64
                        ],
                        |r| {
                            Ok(Candidate {
                                rowid: r.get(0)?,
                                received_clock_ms: r.get(1)?,
                                rejected: r.get(2)?,
                            })
                        },
                    )
                    .map_err(err)?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(err)?;
                let total = usize::try_from(total).unwrap_or(0);
                let doomed = retention::select(&cands, total, newest_kept_from, now_ms, policy);
                let mut del = tx
                    .prepare_cached(
                        "DELETE FROM commands WHERE rowid = ?1 AND state NOT IN ('received', 'running')",
                    )
                    .map_err(err)?;
                let mut n = 0;
                for rowid in &doomed {
                    n += del.execute(params![rowid]).map_err(err)?;
                }
                Ok(n)
            })?;
            deleted += n;
            if n < retention::PURGE_BATCH {
                break;
            }
        }
        Ok(deleted)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::parse;
    use crate::spool::SpoolOptions;

    const HOUR_MS: i64 = 3_600_000;

    struct Fixture {
        _dir: tempfile::TempDir,
        spool: Spool,
        ids: EventIdGen,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let spool =
                Spool::open(&dir.path().join("spool.db"), &SpoolOptions::default()).unwrap();
            Fixture {
                _dir: dir,
                spool,
                ids: EventIdGen::new().unwrap(),
            }
        }

        fn claim(&mut self, json: &str, clock_ms: i64, admit: Admit<'_>) -> Claim {
            let cmd = parse(json.as_bytes(), 1 << 20).unwrap();
            let mut ctx = EventCtx {
                ids: &mut self.ids,
                device_id: "d",
                format: Format::Json,
            };
            let receipt = Receipt {
                deadline_ms: None,
                ttl: None,
                clock_ms,
                admit,
            };
            self.spool
                .claim_command(&cmd, false, &receipt, &mut ctx)
                .unwrap()
        }

        fn finish(&mut self, id: &str, state: &str) {
            let mut ctx = EventCtx {
                ids: &mut self.ids,
                device_id: "d",
                format: Format::Json,
            };
            let ev = ResultEvent {
                scope: crate::commands::DEFAULT_SCOPE,
                command_id: Some(id),
                name: Some("ping"),
                state,
                result: "{}",
                duration_ms: Some(1),
                reply: Reply::Result,
                retry_safe: Some(true),
            };
            self.spool.finish_command(&ev, &mut ctx).unwrap();
        }

        fn request_len(&self, id: &str) -> Option<usize> {
            self.spool
                .conn
                .query_row(
                    "SELECT length(request) FROM commands WHERE command_id = ?1",
                    params![id],
                    |r| r.get::<_, i64>(0),
                )
                .optional()
                .unwrap()
                .map(|n| n as usize)
        }
    }

    fn policy() -> Policy {
        Policy {
            window: Duration::from_secs(3600),
            max_records: 1000,
        }
    }

    #[test]
    fn a_finished_record_keeps_its_hash_and_a_truncated_request() {
        let mut f = Fixture::new();
        let big = format!(
            r#"{{"command_id":"big","name":"ping","args":{{"x":"{}"}}}}"#,
            "y".repeat(60_000)
        );
        assert_eq!(f.claim(&big, 0, Admit::Accept), Claim::New);
        assert!(
            f.request_len("big").unwrap() > 60_000,
            "kept whole while it may run"
        );
        f.finish("big", cstate::COMPLETED);
        assert_eq!(f.request_len("big"), Some(KEPT_REQUEST_CHARS));
        // The hash still tells a duplicate from a conflict.
        assert!(matches!(
            f.claim(&big, 1, Admit::Accept),
            Claim::Duplicate { .. }
        ));
        let other = big.replace("\"y", "\"z");
        assert_eq!(f.claim(&other, 1, Admit::Accept), Claim::Conflict);
    }

    #[test]
    fn a_command_rejected_at_receipt_is_recorded_truncated_and_a_rate_limited_one_not_at_all() {
        let mut f = Fixture::new();
        let big = format!(
            r#"{{"command_id":"u-1","name":"nope","args":{{"x":"{}"}}}}"#,
            "y".repeat(60_000)
        );
        assert_eq!(
            f.claim(&big, 0, Admit::Reject("unknown command")),
            Claim::Rejected
        );
        assert_eq!(f.request_len("u-1"), Some(KEPT_REQUEST_CHARS));
        assert!(matches!(
            f.claim(&big, 0, Admit::Reject("unknown command")),
            Claim::Duplicate { state } if state == cstate::REJECTED
        ));
        let ping = r#"{"command_id":"r-1","name":"ping"}"#;
        assert_eq!(
            f.claim(ping, 0, Admit::Refuse("rate limit")),
            Claim::Refused
        );
        assert_eq!(f.request_len("r-1"), None, "no record");
        // Later, within the limit, the same id is taken.
        assert_eq!(f.claim(ping, 0, Admit::Accept), Claim::New);
        // A known command is answered from the store even over the limit.
        assert_eq!(
            f.claim(ping, 0, Admit::Refuse("rate limit")),
            Claim::InProgress
        );
    }

    #[test]
    fn purge_reads_the_agent_clock_not_the_wall_clock() {
        let mut f = Fixture::new();
        for i in 0..150 {
            let id = format!("c-{i}");
            f.claim(
                &format!(r#"{{"command_id":"{id}","name":"ping"}}"#),
                i * 60_000,
                Admit::Accept,
            );
            f.finish(&id, cstate::COMPLETED);
        }
        // The wall clock of every record says 1970 (as on a board that booted
        // without an RTC) or far in the past: it is not read.
        f.spool
            .conn
            .execute("UPDATE commands SET received_ms = 0, finished_ms = 0", [])
            .unwrap();
        // Agent clock at 2 h 29 min: the receipts of the first 90 minutes are
        // past the 1-hour window; none of the newest 100 goes.
        let now = 149 * 60_000;
        assert_eq!(f.spool.purge_commands(now, &policy()).unwrap(), 50);
        assert_eq!(f.spool.command_count().unwrap(), 100);
        assert!(f.request_len("c-49").is_none() && f.request_len("c-50").is_some());
        // Much later on the agent clock: the newest 100 stay.
        assert_eq!(
            f.spool
                .purge_commands(now + 100 * HOUR_MS, &policy())
                .unwrap(),
            0
        );
    }

    #[test]
    fn over_the_cap_rejected_records_go_and_records_of_commands_that_ran_stay_inside_the_window() {
        let mut f = Fixture::new();
        for i in 0..1200 {
            let json = format!(r#"{{"command_id":"j-{i}","name":"junk"}}"#);
            f.claim(&json, HOUR_MS, Admit::Reject("unknown"));
            let json = format!(r#"{{"command_id":"p-{i}","name":"ping"}}"#);
            f.claim(&json, HOUR_MS, Admit::Accept);
            f.finish(&format!("p-{i}"), cstate::COMPLETED);
        }
        assert_eq!(f.spool.command_count().unwrap(), 2400);
        let n = f.spool.purge_commands(HOUR_MS + 1, &policy()).unwrap();
        // Every rejected record goes but the 50 among the newest 100; no
        // completed one (all inside the window), though 1250 stay above the cap.
        assert_eq!(n, 1150);
        let completed: i64 = f
            .spool
            .conn
            .query_row(
                "SELECT count(*) FROM commands WHERE state = 'completed'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(completed, 1200);
    }

    #[test]
    fn the_agent_clock_resumes_from_the_newest_receipt_if_the_persisted_value_lags() {
        let mut f = Fixture::new();
        f.claim(
            r#"{"command_id":"a","name":"ping"}"#,
            5 * HOUR_MS,
            Admit::Accept,
        );
        f.spool
            .set_state(retention::CLOCK_STATE_KEY, &(2 * HOUR_MS).to_string(), 0)
            .unwrap();
        assert_eq!(f.spool.command_clock_ms().unwrap(), 5 * HOUR_MS);
        f.spool
            .set_state(retention::CLOCK_STATE_KEY, &(9 * HOUR_MS).to_string(), 0)
            .unwrap();
        assert_eq!(f.spool.command_clock_ms().unwrap(), 9 * HOUR_MS);
    }
}
