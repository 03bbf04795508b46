//! Rows appended before the wall clock was set: spans of row ids, and the
//! time retention counts a span's rows from.
//!
//! A board without a real-time clock boots in 1970, or at the time it saved
//! at shutdown (fake-hwclock), and steps its clock when time sync sets it:
//! the rows it appended before carry an append time (`created_ms`) in 1970
//! or days stale. Retention counts a row's age from that time, so once the
//! clock is set and the rows are acknowledged it would purge them at once,
//! not `acked_retention_secs` later, and a fleet database restored from a
//! backup could never get them back (docs/fleet.md, "When the fleet's
//! database loses data"). A span (`clock_spans`, schema 13) remembers them:
//!
//! - it opens with the first commit that appends a row while the clock is
//!   not settled ([`WallClock`]): its first row id, riding that commit;
//! - it stays open across commits, runs and boots while the clock stays
//!   unsettled (nothing more is written); while the clock is still before
//!   the floor its rows age by that same clock (it loses time, never gains
//!   it, reboots included: such an age is never longer than the true one);
//!   once the clock is past the floor they are purged by no age until the
//!   span closes (a clock stepped by anything but time sync would read
//!   them decades old), only by the spool bound;
//! - it closes with the first commit made with a settled clock (the clock
//!   anchor's, or the next one): its last row id and that commit's time
//!   (`settled_ms`), riding that commit;
//! - retention then counts its rows from `settled_ms` (or their own time if
//!   later): kept `acked_retention_secs` from when the clock was set, never
//!   shorter; the span is forgotten by the purge that lets its rows go.
//!
//! The rows are never rewritten: an UPDATE of `created_ms` rewrites every
//! page holding them, payloads included, through the WAL and into the file
//! again (a week at 100 readings/s is 60 M rows, about 10 GB), where one
//! span row says the same.
//!
//! One rule: **nothing is written per commit in the steady state**, settled
//! or not: a span's start and its end each ride a commit the writer makes
//! anyway (issue 35), once per change of the clock.

use super::SpoolError;
use crate::event::clock::{wants_stamp, Sync};
use rusqlite::{params, Connection, OptionalExtension, Transaction};

/// For a read-only connection on a spool from before schema 13: an empty
/// table of spans in the connection's own temporary schema (nothing is
/// written to the file).
pub(super) const SQL_NO_SPANS_YET: &str = "CREATE TEMP TABLE IF NOT EXISTS clock_spans (
    first_id INTEGER PRIMARY KEY, last_id INTEGER, settled_ms INTEGER)";

/// The open span's first row id (at most one span is open).
const SQL_OPEN_SPAN: &str = "SELECT first_id FROM clock_spans WHERE last_id IS NULL";

/// The id the next appended row gets: row ids are never reused, and within
/// one transaction rows get consecutive ids (the newest row is never
/// deleted, so a new id is the largest plus one).
const SQL_NEXT_ID: &str = "SELECT coalesce(max(id), 0) + 1 FROM events";

const SQL_START: &str = "INSERT INTO clock_spans (first_id) VALUES (?1)";

const SQL_SETTLE: &str =
    "UPDATE clock_spans SET last_id = ?1, settled_ms = ?2 WHERE last_id IS NULL";

/// A span closed before its first row committed holds nothing.
const SQL_DROP_EMPTY: &str = "DELETE FROM clock_spans WHERE last_id < first_id";

/// The lowest row id a span holds against an age purge with cutoff `?1`:
/// an open span's (when `?2` is 1: the clock is settled now), or a closed
/// one's whose rows count from `?1` or later.
const SQL_HOLD_FROM: &str = "SELECT min(first_id) FROM clock_spans
    WHERE (settled_ms IS NULL AND ?2 = 1) OR settled_ms >= ?1";

/// Closed spans that hold nothing any more: counted from before the age
/// cutoff `?1`, or with every row gone (the spool bound took them).
const SQL_FORGET: &str = "DELETE FROM clock_spans WHERE last_id IS NOT NULL
    AND (settled_ms < ?1 OR last_id < (SELECT min(id) FROM events))";

/// The time retention counts a row `e` from, Unix ms: its append time, or,
/// for a row of a closed span, the time its span closed if that is later.
/// A row of an open span has its append time (the clock is not set yet:
/// any age read from it is as wrong as the clock).
macro_rules! since_ms {
    () => {
        "max(e.created_ms, coalesce((SELECT c.settled_ms FROM clock_spans c
            WHERE c.first_id <= e.id AND e.id <= c.last_id), e.created_ms))"
    };
}
pub(super) use since_ms;

/// The wall clock a commit's `created_ms` was read from, as the appender
/// judged it. The rule is the readings' own ([`wants_stamp`]): a reading
/// whose time the fleet may still move carries a monotonic stamp, and a row
/// appended at that time opens a span. So a clock before the floor is
/// unsettled whatever the kernel says, and one past it is unsettled while
/// the kernel says time sync has not vouched for it (a fake-hwclock's stale
/// time is past the floor); where the kernel will not say, a clock past the
/// floor is believed, as the readings' `clock_trusted` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WallClock {
    /// Past the floor and not said unsynchronized: `created_ms` is true time.
    Settled,
    /// Before the floor, or time sync has not vouched for it.
    Unsettled,
}

impl WallClock {
    /// Judge a wall clock `trusted` (past
    /// [`crate::event::envelope::CLOCK_FLOOR_MS`]) when the kernel says `sync`.
    pub fn judge(trusted: bool, sync: Sync) -> WallClock {
        match wants_stamp(trusted, sync) {
            true => WallClock::Unsettled,
            false => WallClock::Settled,
        }
    }
}

/// The id the next row appended in `tx` gets (read before the appends).
pub(super) fn next_id(tx: &Transaction<'_>) -> rusqlite::Result<i64> {
    tx.prepare_cached(SQL_NEXT_ID)?.query_row([], |r| r.get(0))
}

/// Open or close the span for a commit whose rows were read at `clock` and
/// `now_ms`, inside its transaction `tx`: `first_new` is the id its first
/// row got ([`next_id`] before the appends), `appended` how many it
/// appended, `since` the first row this appender has not seen (a span it
/// opens starts there: the rows other connections appended since its last
/// commit, a command's result, were read at the same clock, or if at a
/// set one are merely kept a little longer). Writes only when the clock
/// changed since the last commit (an unsettled commit with rows and no
/// span open, a settled one with a span open); otherwise one read of a
/// table of a few rows.
pub(super) fn note(
    tx: &Transaction<'_>,
    err: &dyn Fn(rusqlite::Error) -> SpoolError,
    clock: WallClock,
    now_ms: i64,
    (since, first_new, appended): (i64, i64, usize),
) -> Result<(), SpoolError> {
    let open: Option<i64> = tx
        .prepare_cached(SQL_OPEN_SPAN)
        .and_then(|mut st| st.query_row([], |r| r.get(0)).optional())
        .map_err(err)?;
    match (clock, open) {
        (WallClock::Unsettled, None) if appended > 0 => {
            let first = since.clamp(1, first_new);
            tx.prepare_cached(SQL_START)
                .and_then(|mut st| st.execute(params![first]))
                .map_err(err)?;
            log::info!(
                "clock: not set by time sync; rows from row {first} on are kept by retention from when it is"
            );
        }
        (WallClock::Settled, Some(first)) => {
            // This commit's own rows were read at a settled clock.
            tx.prepare_cached(SQL_SETTLE)
                .and_then(|mut st| st.execute(params![first_new - 1, now_ms]))
                .map_err(err)?;
            tx.execute(SQL_DROP_EMPTY, []).map_err(err)?;
            log::info!(
                "clock: set; the rows appended before it (rows {first}..={}) count their retention from now",
                first_new - 1
            );
        }
        _ => {}
    }
    Ok(())
}

/// The lowest row id an age purge with `cutoff_ms`, read off a clock judged
/// `now`, may not reach: rows of an open span while `now` is settled (an
/// unset clock ages them by itself), or of a closed one counted from
/// `cutoff_ms` or later, and
/// every row above them (appended after them: no older by a clock that
/// went forward). `i64::MAX` when no span holds, and for `cutoff_ms =
/// i64::MAX` (the spool bound, which takes the oldest acknowledged rows
/// whatever their age).
pub(super) fn hold_from(
    conn: &Connection,
    cutoff_ms: i64,
    now: WallClock,
) -> rusqlite::Result<i64> {
    if cutoff_ms == i64::MAX {
        return Ok(i64::MAX);
    }
    let settled = i64::from(now == WallClock::Settled);
    let first: Option<i64> = conn
        .prepare_cached(SQL_HOLD_FROM)?
        .query_row(params![cutoff_ms, settled], |r| r.get(0))?;
    Ok(first.unwrap_or(i64::MAX))
}

/// Forget the closed spans that hold nothing any more after a purge with
/// `cutoff_ms` (`i64::MAX`, the spool bound: only spans whose rows are all
/// gone). Rides the purge's commit.
pub(super) fn forget(tx: &Transaction<'_>, cutoff_ms: i64) -> rusqlite::Result<usize> {
    let cutoff = match cutoff_ms {
        i64::MAX => i64::MIN,
        c => c,
    };
    tx.prepare_cached(SQL_FORGET)?.execute(params![cutoff])
}

#[cfg(test)]
mod tests;
