//! Command idempotency records in the spool, and their result events.
//!
//! Its one rule: **every state change of a command and the result event that
//! reports it commit in one IMMEDIATE transaction**, so a result is never
//! stored without its event nor sent without being stored. The statements
//! are the spool's ([`crate::spool::CommandTx`]); what an arrival, a
//! duplicate, a conflict and an end mean is decided here.

use super::retention::{self, Policy};
use super::timefloor::{self, Mark, TimeFloor};
use super::Command;
use crate::event::envelope::{wall_clock_ms, EventId};
use crate::event::hex::encode as hex;
use crate::event::reading::FieldValue;
use crate::event::stream::RESULTS_STREAM;
use crate::spool::{CommandTx, NewEvent, NewRecord, Spool, SpoolError, StoredCommand};
use std::time::Duration;

pub use crate::spool::{cstate, CommandStats, EventCtx, Unfinished};

/// Characters of the canonical request kept once a command has finished (or
/// was rejected at receipt): the request hash still answers duplicates and
/// conflicts, and a 60 KB body is not kept for the life of the record.
pub const KEPT_REQUEST_CHARS: usize = 256;

/// Batches of [`retention::PURGE_BATCH`] deleted per purge pass at most.
const PURGE_MAX_BATCHES: usize = 20;

/// What to do with a command if it turns out to be new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit<'a> {
    /// Record it as `received`, to be run.
    Accept,
    /// Record it as `rejected` at once with this error (unknown command):
    /// the hash and a truncated request are kept, a result is appended.
    Reject(&'a str),
    /// Like [`Admit::Reject`], for a command with a side effect that no
    /// operator key signed ([`super::admission::unsigned_refusal`]); counted
    /// `commands_unsigned` as well. Its record is droppable like every
    /// `rejected` one: nothing ran.
    Unsigned(&'a str),
    /// Answer `rejected` with this error and keep no record (rate limit):
    /// the same id may be sent again later.
    Refuse(&'a str),
    /// Like [`Admit::Refuse`], for want of room among the records
    /// (answered `no_room`, counted `commands_no_room`).
    NoRoom(&'a str),
    /// Record it finished at once, with the answer of a built-in without a
    /// side effect ([`super::admission::SIDE_EFFECT_FREE`]) computed before
    /// the receipt: the result is appended in the same transaction.
    Answer(&'a Answered),
}

/// The answer of a built-in without a side effect, computed at receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    /// Final state (`completed`, or `rejected` for bad arguments).
    pub state: &'static str,
    /// Result or error, JSON text.
    pub result: String,
    /// How long it took, ms.
    pub duration_ms: i64,
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
    /// For a command an operator key signed with an `issued_at_ms`: what
    /// the [`TimeFloor`] is raised to if it is new and recorded.
    pub floor: Option<Mark>,
}

/// Outcome of claiming a receipt.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// First time this (scope, id) is seen: the receipt is committed as `received`.
    New,
    /// First time seen, recorded as `rejected` at once ([`Admit::Reject`],
    /// [`Admit::Unsigned`]).
    Rejected,
    /// First time seen, answered `rejected`, not recorded ([`Admit::Refuse`]).
    Refused,
    /// First time seen, answered `no_room`, not recorded ([`Admit::NoRoom`]).
    NoRoom,
    /// First time seen, recorded finished with its answer ([`Admit::Answer`]).
    Answered,
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
    /// Not accepted now (no room for its record) and not recorded: may be
    /// sent again.
    NoRoom,
}

impl Reply {
    fn as_str(self) -> &'static str {
        match self {
            Reply::Result => "result",
            Reply::Duplicate => "duplicate",
            Reply::Conflict => "conflict",
            Reply::InProgress => "in_progress",
            Reply::RateLimited => "rate_limited",
            Reply::NoRoom => "no_room",
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

fn result_event(r: &ResultEvent<'_>) -> NewEvent {
    let now = crate::os::clock::reading_now();
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
        ts_ms: now.wall_ms,
        clock_trusted: now.trusted,
        mono: now.mono.map(Box::new),
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

/// Claim the receipt of `cmd` atomically (`INSERT .. ON CONFLICT DO
/// NOTHING`, never check-then-insert; under [`Admit::Refuse`] and
/// [`Admit::NoRoom`] a lookup inside the same IMMEDIATE transaction). A new command is admitted as
/// `receipt.admit` says. For anything but [`Claim::New`], the answer event
/// (stored result, `conflict`, `in_progress`, rejection) is appended in the
/// same transaction; a retained duplicate of a finished command is counted
/// but not answered again (field case F13). A new record raises the time
/// floor by `receipt.floor` in the same transaction (no commit of its own).
pub fn claim(
    spool: &mut Spool,
    cmd: &Command,
    retained: bool,
    receipt: &Receipt<'_>,
    ctx: &mut EventCtx<'_>,
) -> Result<Claim, SpoolError> {
    let now = wall_clock_ms().0;
    spool.command_write(|tx| {
        if insert_receipt(tx, cmd, receipt, now)? {
            let recorded = !matches!(receipt.admit, Admit::Refuse(_) | Admit::NoRoom(_));
            if let Some(m) = receipt.floor.filter(|_| recorded) {
                tx.raise_state(timefloor::ISSUED_STATE_KEY, m.issued_ms, now)?;
                tx.raise_state(timefloor::OFFSET_STATE_KEY, m.offset_ms, now)?;
            }
            return answer_new(tx, cmd, receipt, ctx, now);
        }
        let stored = tx.stored(&cmd.scope, &cmd.command_id)?;
        answer_known(tx, cmd, &stored, retained, ctx, now)
    })
}

/// The receipt's row, inserted unless the key is taken (or, under
/// [`Admit::Refuse`] and [`Admit::NoRoom`], only looked up). True: the
/// command is new.
fn insert_receipt(
    tx: &CommandTx<'_>,
    cmd: &Command,
    receipt: &Receipt<'_>,
    now: i64,
) -> Result<bool, SpoolError> {
    let (state, request, result, finished) = match receipt.admit {
        Admit::Refuse(_) | Admit::NoRoom(_) => return Ok(!tx.exists(&cmd.scope, &cmd.command_id)?),
        Admit::Reject(why) | Admit::Unsigned(why) => (
            cstate::REJECTED,
            kept_request(&cmd.canonical),
            Some(serde_json::json!({ "error": why }).to_string()),
            Some(now),
        ),
        Admit::Answer(a) => (
            a.state,
            kept_request(&cmd.canonical),
            Some(a.result.clone()),
            Some(now),
        ),
        Admit::Accept => (cstate::RECEIVED, cmd.canonical.as_str(), None, None),
    };
    tx.claim(&NewRecord {
        scope: &cmd.scope,
        command_id: &cmd.command_id,
        request_hash: cmd.request_hash.as_slice(),
        name: &cmd.name,
        request,
        state,
        received_ms: now,
        ttl_ms: receipt.ttl.map(|t| t.as_millis() as i64),
        deadline_ms: receipt.deadline_ms,
        clock_ms: receipt.clock_ms,
        result: result.as_deref(),
        finished_ms: finished,
    })
}

/// A command seen for the first time: counted, and answered at once unless
/// it is to run.
fn answer_new(
    tx: &CommandTx<'_>,
    cmd: &Command,
    receipt: &Receipt<'_>,
    ctx: &mut EventCtx<'_>,
    now: i64,
) -> Result<Claim, SpoolError> {
    let (why, reply, claim) = match receipt.admit {
        Admit::Accept => {
            tx.count("commands_received")?;
            return Ok(Claim::New);
        }
        Admit::Reject(why) => {
            tx.count("commands_received")?;
            tx.count("commands_rejected")?;
            (why, Reply::Result, Claim::Rejected)
        }
        Admit::Unsigned(why) => {
            tx.count("commands_received")?;
            tx.count("commands_rejected")?;
            tx.count("commands_unsigned")?;
            (why, Reply::Result, Claim::Rejected)
        }
        Admit::Refuse(why) => {
            tx.count("commands_rate_limited")?;
            (why, Reply::RateLimited, Claim::Refused)
        }
        Admit::NoRoom(why) => {
            tx.count("commands_no_room")?;
            (why, Reply::NoRoom, Claim::NoRoom)
        }
        Admit::Answer(a) => {
            tx.count("commands_received")?;
            tx.count(&format!("commands_{}", a.state))?;
            let mut ev = answer(cmd, a.state, &a.result, Some(a.duration_ms), Reply::Result);
            ev.retry_safe = Some(true);
            tx.append(&result_event(&ev), ctx, now)?;
            return Ok(Claim::Answered);
        }
    };
    let result = serde_json::json!({ "error": why }).to_string();
    let ev = answer(cmd, cstate::REJECTED, &result, None, reply);
    tx.append(&result_event(&ev), ctx, now)?;
    Ok(claim)
}

/// A command whose (scope, id) is already recorded: a conflict when the
/// request differs, else a duplicate, answered with the stored result (or
/// `in_progress` while it is not finished).
fn answer_known(
    tx: &CommandTx<'_>,
    cmd: &Command,
    stored: &StoredCommand,
    retained: bool,
    ctx: &mut EventCtx<'_>,
    now: i64,
) -> Result<Claim, SpoolError> {
    if stored.request_hash != cmd.request_hash {
        tx.count("commands_conflicts")?;
        let detail = serde_json::json!({
            "error": "conflict: request hash mismatch",
            "stored_request_hash": hex(&stored.request_hash),
            "request_hash": hex(&cmd.request_hash),
            "stored_name": stored.name,
        })
        .to_string();
        let ev = answer(cmd, "conflict", &detail, None, Reply::Conflict);
        tx.append(&result_event(&ev), ctx, now)?;
        return Ok(Claim::Conflict);
    }
    tx.note_duplicate(&cmd.scope, &cmd.command_id)?;
    tx.count("commands_duplicates")?;
    let state = stored.state.as_str();
    if state == cstate::RECEIVED || state == cstate::RUNNING {
        let info = r#"{"info":"in progress; not run again"}"#;
        let ev = answer(cmd, state, info, None, Reply::InProgress);
        tx.append(&result_event(&ev), ctx, now)?;
        return Ok(Claim::InProgress);
    }
    if retained {
        tx.count("commands_retained_duplicates")?;
    } else {
        let result = stored.result.as_deref().unwrap_or("null");
        let ev = answer(cmd, state, result, stored.duration_ms, Reply::Duplicate);
        tx.append(&result_event(&ev), ctx, now)?;
    }
    Ok(Claim::Duplicate {
        state: stored.state.clone(),
    })
}

/// The answer to `cmd` with `state` and `result`.
fn answer<'a>(
    cmd: &'a Command,
    state: &'a str,
    result: &'a str,
    duration_ms: Option<i64>,
    reply: Reply,
) -> ResultEvent<'a> {
    ResultEvent {
        scope: &cmd.scope,
        command_id: Some(&cmd.command_id),
        name: Some(&cmd.name),
        state,
        result,
        duration_ms,
        reply,
        retry_safe: None,
    }
}

/// End a command: store `state` and `result` and append the result event,
/// in one transaction. Returns the result event's id.
pub fn finish(
    spool: &mut Spool,
    ev: &ResultEvent<'_>,
    ctx: &mut EventCtx<'_>,
) -> Result<EventId, SpoolError> {
    let now = wall_clock_ms().0;
    spool.command_write(|tx| {
        let key = (ev.scope, ev.command_id.unwrap_or(""));
        tx.finish(
            key,
            ev.state,
            ev.result,
            now,
            ev.duration_ms,
            KEPT_REQUEST_CHARS,
        )?;
        tx.count(&format!("commands_{}", ev.state))?;
        tx.append(&result_event(ev), ctx, now)
    })
}

/// Answer a message that could not be parsed: a `rejected` result event
/// (no record: there may be no usable id) and the counter `commands_malformed`.
/// The result names the payload by its sha256 and size, never echoes it.
pub fn reject_unparsed(
    spool: &mut Spool,
    command_id: Option<&str>,
    why: &str,
    payload: &[u8],
    ctx: &mut EventCtx<'_>,
) -> Result<(), SpoolError> {
    use sha2::{Digest, Sha256};
    let result = serde_json::json!({
        "error": why,
        "payload_sha256": hex(&Sha256::digest(payload)),
        "payload_bytes": payload.len(),
    })
    .to_string();
    let ev = ResultEvent {
        scope: super::DEFAULT_SCOPE,
        command_id,
        name: None,
        state: cstate::REJECTED,
        result: &result,
        duration_ms: None,
        reply: Reply::Result,
        retry_safe: None,
    };
    spool.command_write(|tx| {
        tx.count("commands_malformed")?;
        tx.append(&result_event(&ev), ctx, wall_clock_ms().0)
            .map(|_| ())
    })
}

/// The latest [`retention::AgentClock`] reading known to the spool.
pub fn clock_ms(spool: &Spool) -> Result<i64, SpoolError> {
    spool.command_clock_ms(retention::CLOCK_STATE_KEY)
}

/// The [`TimeFloor`] the spool holds (nothing known on a new spool; a
/// value that does not read as an integer counts as none).
pub fn time_floor(spool: &Spool) -> Result<TimeFloor, SpoolError> {
    let read = |key| -> Result<Option<i64>, SpoolError> {
        Ok(spool.state(key)?.and_then(|v| v.trim().parse().ok()))
    };
    Ok(TimeFloor::new(
        read(timefloor::ISSUED_STATE_KEY)?,
        read(timefloor::OFFSET_STATE_KEY)?,
    ))
}

/// Delete command records as [`retention::select`] decides, in
/// transactions of at most [`retention::PURGE_BATCH`] records, never a
/// `received` or `running` one. `now_ms` is the [`retention::AgentClock`]
/// reading, never the wall clock. Returns the number deleted.
pub fn purge(spool: &mut Spool, now_ms: i64, policy: &Policy) -> Result<usize, SpoolError> {
    let window = i64::try_from(policy.window.as_millis()).unwrap_or(i64::MAX);
    let mut deleted = 0;
    for _ in 0..PURGE_MAX_BATCHES {
        let n = spool.command_write(|tx| {
            let total = tx.total()?;
            let newest_kept_from = tx.nth_newest_rowid(retention::KEEP_NEWEST)?;
            let cands = tx.purge_candidates(
                newest_kept_from,
                now_ms.saturating_sub(window),
                retention::PURGE_BATCH,
            )?;
            let doomed = retention::select(&cands, total, newest_kept_from, now_ms, policy);
            tx.delete(&doomed)
        })?;
        deleted += n;
        if n < retention::PURGE_BATCH {
            break;
        }
    }
    Ok(deleted)
}

/// Make room for a tier whose share of the records is `cap`: delete
/// droppable records (`rejected`, or of a built-in without a side effect)
/// as [`retention::evict`] decides, oldest first, never one of the
/// [`retention::KEEP_NEWEST`] newest, never a record of a command that ran
/// with a side effect, whatever its age. Returns the number deleted.
pub fn make_room(spool: &mut Spool, cap: usize) -> Result<usize, SpoolError> {
    let names = serde_json::Value::from(super::admission::SIDE_EFFECT_FREE.to_vec()).to_string();
    let mut deleted = 0;
    for _ in 0..PURGE_MAX_BATCHES {
        let n = spool.command_write(|tx| {
            let total = tx.total()?;
            if total < cap {
                return Ok(0);
            }
            let newest_kept_from = tx.nth_newest_rowid(retention::KEEP_NEWEST)?;
            let cands = tx.droppable(newest_kept_from, &names, retention::PURGE_BATCH)?;
            tx.delete(&retention::evict(&cands, total, cap))
        })?;
        deleted += n;
        if n < retention::PURGE_BATCH {
            break;
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::parse;
    use crate::event::envelope::{EventIdGen, Format};
    use crate::spool::SpoolOptions;
    use rusqlite::{params, OptionalExtension};

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
                floor: None,
            };
            claim(&mut self.spool, &cmd, false, &receipt, &mut ctx).unwrap()
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
            finish(&mut self.spool, &ev, &mut ctx).unwrap();
        }

        fn request_len(&self, id: &str) -> Option<usize> {
            self.spool
                .raw()
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
            .raw()
            .execute("UPDATE commands SET received_ms = 0, finished_ms = 0", [])
            .unwrap();
        // Agent clock at 2 h 29 min: the receipts of the first 90 minutes are
        // past the 1-hour window; none of the newest 100 goes.
        let now = 149 * 60_000;
        assert_eq!(purge(&mut f.spool, now, &policy()).unwrap(), 50);
        assert_eq!(f.spool.command_count().unwrap(), 100);
        assert!(f.request_len("c-49").is_none() && f.request_len("c-50").is_some());
        // Much later on the agent clock: the newest 100 stay.
        assert_eq!(
            purge(&mut f.spool, now + 100 * HOUR_MS, &policy()).unwrap(),
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
        let n = purge(&mut f.spool, HOUR_MS + 1, &policy()).unwrap();
        // Every rejected record goes but the 50 among the newest 100; no
        // completed one (all inside the window), though 1250 stay above the cap.
        assert_eq!(n, 1150);
        let completed: i64 = f
            .spool
            .raw()
            .query_row(
                "SELECT count(*) FROM commands WHERE state = 'completed'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(completed, 1200);
    }

    fn count_where(f: &Fixture, sql_where: &str) -> i64 {
        f.spool
            .raw()
            .query_row(
                &format!("SELECT count(*) FROM commands WHERE {sql_where}"),
                [],
                |r| r.get(0),
            )
            .unwrap()
    }

    #[test]
    fn a_ping_answered_at_receipt_is_recorded_finished_and_still_answers_duplicates_and_conflicts()
    {
        let mut f = Fixture::new();
        let ping = r#"{"command_id":"p-1","name":"ping"}"#;
        let a = Answered {
            state: cstate::COMPLETED,
            result: r#"{"pong":true}"#.into(),
            duration_ms: 0,
        };
        assert_eq!(f.claim(ping, 0, Admit::Answer(&a)), Claim::Answered);
        assert_eq!(
            count_where(&f, "state = 'completed' AND finished_ms IS NOT NULL"),
            1
        );
        // A redelivery gets the stored answer, another request a conflict.
        assert_eq!(
            f.claim(ping, 1, Admit::Answer(&a)),
            Claim::Duplicate {
                state: cstate::COMPLETED.into()
            }
        );
        let other = r#"{"command_id":"p-1","name":"status"}"#;
        assert_eq!(f.claim(other, 1, Admit::Accept), Claim::Conflict);
        assert_eq!(counter(&f, "commands_completed"), 1);
    }

    fn counter(f: &Fixture, name: &str) -> i64 {
        f.spool
            .raw()
            .query_row("SELECT value FROM counters WHERE name = ?1", [name], |r| {
                r.get(0)
            })
            .optional()
            .unwrap()
            .unwrap_or(0)
    }

    #[test]
    fn no_room_keeps_no_record_and_a_known_command_is_still_answered_from_the_store() {
        let mut f = Fixture::new();
        let cmd = r#"{"command_id":"n-1","name":"flush"}"#;
        assert_eq!(f.claim(cmd, 0, Admit::NoRoom("no room")), Claim::NoRoom);
        assert_eq!(f.request_len("n-1"), None, "no record");
        assert_eq!(counter(&f, "commands_no_room"), 1);
        assert_eq!(f.claim(cmd, 0, Admit::Accept), Claim::New);
        f.finish("n-1", cstate::COMPLETED);
        assert!(matches!(
            f.claim(cmd, 0, Admit::NoRoom("no room")),
            Claim::Duplicate { .. }
        ));
    }

    /// The eviction rule: at a tier's cap, rejected records and records of
    /// built-ins without a side effect go, oldest first; nothing that ran
    /// with a side effect goes, however full the records are.
    #[test]
    fn making_room_drops_only_what_cannot_run_twice() {
        let mut f = Fixture::new();
        let ping = Answered {
            state: cstate::COMPLETED,
            result: "{}".into(),
            duration_ms: 0,
        };
        for i in 0..300 {
            let id = format!("ran-{i}");
            f.claim(
                &format!(r#"{{"command_id":"{id}","name":"count"}}"#),
                0,
                Admit::Accept,
            );
            let state = [
                cstate::COMPLETED,
                cstate::FAILED,
                cstate::EXPIRED,
                cstate::INTERRUPTED,
            ][i % 4];
            f.finish(&id, state);
            let json = format!(r#"{{"command_id":"j-{i}","name":"junk"}}"#);
            f.claim(&json, 0, Admit::Reject("unknown"));
            let json = format!(r#"{{"command_id":"p-{i}","name":"ping"}}"#);
            f.claim(&json, 0, Admit::Answer(&ping));
        }
        // One still running: never deleted either.
        f.claim(r#"{"command_id":"live","name":"count"}"#, 0, Admit::Accept);
        assert_eq!(f.spool.command_count().unwrap(), 901);
        assert_eq!(make_room(&mut f.spool, 902).unwrap(), 0, "below the cap");
        // A cap of 500: down to 450, junk and pings oldest first.
        assert_eq!(make_room(&mut f.spool, 500).unwrap(), 451);
        assert_eq!(f.spool.command_count().unwrap(), 450);
        assert_eq!(count_where(&f, "command_id LIKE 'ran-%'"), 300);
        assert_eq!(count_where(&f, "command_id = 'live'"), 1);
        assert!(f.request_len("j-0").is_none() && f.request_len("p-0").is_none());
        // However far over the cap: the records of commands that ran stay,
        // and so do the newest 100.
        let n = make_room(&mut f.spool, 10).unwrap();
        assert_eq!(count_where(&f, "command_id LIKE 'ran-%'"), 300);
        assert_eq!(count_where(&f, "command_id = 'live'"), 1);
        let left = f.spool.command_count().unwrap();
        assert_eq!(left, 450 - n);
        assert!(left >= retention::KEEP_NEWEST);
    }

    /// F3: the time floor rides the receipt's own transaction, only a new
    /// record raises it, and it never goes down.
    #[test]
    fn the_time_floor_rises_with_a_new_record_only_and_never_falls() {
        let mut f = Fixture::new();
        let claim_with = |f: &mut Fixture, id: &str, admit: Admit<'_>, floor| {
            let cmd = parse(
                format!(r#"{{"command_id":"{id}","name":"count"}}"#).as_bytes(),
                4096,
            )
            .unwrap();
            let mut ctx = EventCtx {
                ids: &mut f.ids,
                device_id: "d",
                format: Format::Json,
            };
            let receipt = Receipt {
                deadline_ms: None,
                ttl: None,
                clock_ms: 0,
                admit,
                floor,
            };
            claim(&mut f.spool, &cmd, false, &receipt, &mut ctx).unwrap()
        };
        let mark = |issued_ms, clock_ms| Some(Mark::of(issued_ms, clock_ms, None));
        assert_eq!(time_floor(&f.spool).unwrap(), TimeFloor::default());
        // Not recorded (rate limit, no room): nothing moves.
        claim_with(&mut f, "r", Admit::Refuse("rate"), mark(9 * HOUR_MS, 0));
        claim_with(&mut f, "n", Admit::NoRoom("room"), mark(9 * HOUR_MS, 0));
        assert_eq!(time_floor(&f.spool).unwrap(), TimeFloor::default());
        assert_eq!(
            claim_with(&mut f, "a", Admit::Accept, mark(5 * HOUR_MS, HOUR_MS)),
            Claim::New
        );
        let floor = time_floor(&f.spool).unwrap();
        assert_eq!(floor.at(HOUR_MS), Some(5 * HOUR_MS));
        assert_eq!(floor.at(3 * HOUR_MS), Some(7 * HOUR_MS));
        // A duplicate raises nothing, nor does an older command.
        let dup = claim_with(&mut f, "a", Admit::Accept, mark(50 * HOUR_MS, 0));
        assert!(matches!(dup, Claim::Duplicate { .. } | Claim::InProgress));
        claim_with(&mut f, "b", Admit::Accept, mark(2 * HOUR_MS, 2 * HOUR_MS));
        assert_eq!(time_floor(&f.spool).unwrap(), floor);
        // A failed transaction takes its raise with it.
        f.spool
            .raw()
            .execute_batch("CREATE TRIGGER no_c BEFORE INSERT ON commands WHEN NEW.command_id = 'c' BEGIN SELECT RAISE(ABORT, 'refused'); END")
            .unwrap();
        let cmd = parse(br#"{"command_id":"c","name":"count"}"#, 4096).unwrap();
        let receipt = Receipt {
            deadline_ms: None,
            ttl: None,
            clock_ms: 0,
            admit: Admit::Accept,
            floor: mark(90 * HOUR_MS, 0),
        };
        let mut ctx = EventCtx {
            ids: &mut f.ids,
            device_id: "d",
            format: Format::Json,
        };
        assert!(claim(&mut f.spool, &cmd, false, &receipt, &mut ctx).is_err());
        assert_eq!(time_floor(&f.spool).unwrap(), floor);
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
        assert_eq!(clock_ms(&f.spool).unwrap(), 5 * HOUR_MS);
        f.spool
            .set_state(retention::CLOCK_STATE_KEY, &(9 * HOUR_MS).to_string(), 0)
            .unwrap();
        assert_eq!(clock_ms(&f.spool).unwrap(), 9 * HOUR_MS);
    }
}
