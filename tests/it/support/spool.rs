//! Read-only access to the agent's SQLite spool (table `events`; each row's
//! delivery state comes from the spool's `event_states` view).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};

use super::agent::AgentProc;
use super::wait_for;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub id: i64,
    pub event_id: String,
    pub stream: String,
    pub seq: i64,
    pub payload: Vec<u8>,
    pub state: String,
    /// Not stored per row any more (schema 5): always 0.
    pub attempts: i64,
}

/// Open the spool read-only with a 5 s busy timeout. Panics if it cannot.
pub fn open(db: &Path) -> Connection {
    let conn = Connection::open_with_flags(
        db,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .unwrap_or_else(|e| panic!("open spool {} read-only: {e}", db.display()));
    conn.busy_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("set busy_timeout on spool {}: {e}", db.display()));
    conn
}

/// Every row of `events`, ordered by id.
pub fn rows(db: &Path) -> Vec<Row> {
    query_rows(db, "", &[])
}

/// The rows of `events` in `state` ('PENDING', 'SENT', 'ACKED' or 'FAILED'), ordered by id.
pub fn rows_in_state(db: &Path, state: &str) -> Vec<Row> {
    query_rows(db, "WHERE state = ?1", &[&state])
}

/// Number of rows per state (states with no rows are absent).
pub fn count_by_state(db: &Path) -> BTreeMap<String, i64> {
    let conn = open(db);
    if !has_events(&conn) {
        return BTreeMap::new();
    }
    let mut stmt = conn
        .prepare("SELECT state, COUNT(*) FROM event_states GROUP BY state")
        .unwrap_or_else(|e| panic!("prepare count-by-state on {}: {e}", db.display()));
    let mapped = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .unwrap_or_else(|e| panic!("count events by state in {}: {e}", db.display()));
    mapped
        .map(|r| r.unwrap_or_else(|e| panic!("read count-by-state row from {}: {e}", db.display())))
        .collect()
}

/// Number of rows in `state` (0 if none).
pub fn count_in_state(db: &Path, state: &str) -> i64 {
    count_by_state(db).get(state).copied().unwrap_or(0)
}

/// Rows per delivery state of a spool at one moment ([`count_by_state`];
/// none before the agent has created the file).
pub struct States(BTreeMap<String, i64>);

impl States {
    /// Rows in `state` ('PENDING', 'SENT', 'ACKED' or 'FAILED'; 0 if none).
    pub fn n(&self, state: &str) -> i64 {
        self.0.get(state).copied().unwrap_or(0)
    }
}

impl std::fmt::Debug for States {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The spool's [`States`] now (none while the file does not exist).
pub fn states(db: &Path) -> States {
    if !db.exists() {
        return States(BTreeMap::new());
    }
    States(count_by_state(db))
}

/// Wait up to `timeout` until `cond` holds on the spool's [`States`];
/// panics with `what`, the counts and the agent's log tail otherwise.
pub fn await_states(
    db: &Path,
    agent: &AgentProc,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&States) -> bool,
) {
    assert!(
        wait_for(timeout, || cond(&states(db))),
        "{what} within {timeout:?}: {:?}\n{}",
        states(db),
        agent.log_tail(30)
    );
}

/// A persistent counter of the spool's `counters` table (0 while the
/// spool, its schema or the counter does not exist yet).
pub fn counter(db: &Path, name: &str) -> i64 {
    if !db.exists() {
        return 0;
    }
    open(db)
        .query_row("SELECT value FROM counters WHERE name = ?1", [name], |r| {
            r.get(0)
        })
        .unwrap_or(0)
}

/// True once the agent has created the `events` table (a spool file can
/// exist a moment before its schema does).
fn has_events(conn: &Connection) -> bool {
    conn.query_row(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'events'",
        [],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n > 0)
    .unwrap_or(false)
}

/// Total number of rows in `events` (0 before the schema exists).
pub fn total(db: &Path) -> i64 {
    let conn = open(db);
    if !has_events(&conn) {
        return 0;
    }
    conn.query_row("SELECT COUNT(*) FROM events", [], |r| r.get(0))
        .unwrap_or_else(|e| panic!("count events in {}: {e}", db.display()))
}

fn query_rows(db: &Path, filter: &str, params: &[&dyn rusqlite::ToSql]) -> Vec<Row> {
    let conn = open(db);
    let sql = format!(
        "SELECT id, event_id, stream, seq, payload, state, NULL
         FROM event_states {filter} ORDER BY id"
    );
    let mut stmt = conn
        .prepare(&sql)
        .unwrap_or_else(|e| panic!("prepare `{sql}` on {}: {e}", db.display()));
    let mapped = stmt
        .query_map(params, |r| {
            Ok(Row {
                id: r.get(0)?,
                event_id: text(r.get_ref(1)?),
                stream: text(r.get_ref(2)?),
                seq: r.get(3)?,
                payload: bytes(r.get_ref(4)?),
                state: text(r.get_ref(5)?),
                attempts: r.get::<_, Option<i64>>(6)?.unwrap_or(0),
            })
        })
        .unwrap_or_else(|e| panic!("query `{sql}` on {}: {e}", db.display()));
    mapped
        .map(|r| r.unwrap_or_else(|e| panic!("read events row from {}: {e}", db.display())))
        .collect()
}

/// TEXT or BLOB column as bytes (payloads may be stored either way).
fn bytes(v: ValueRef<'_>) -> Vec<u8> {
    match v {
        ValueRef::Blob(b) | ValueRef::Text(b) => b.to_vec(),
        ValueRef::Null => Vec::new(),
        ValueRef::Integer(i) => i.to_string().into_bytes(),
        ValueRef::Real(f) => f.to_string().into_bytes(),
    }
}

/// TEXT (or BLOB) column as a String.
fn text(v: ValueRef<'_>) -> String {
    String::from_utf8_lossy(&bytes(v)).into_owned()
}
