//! A reading's own types: its fields, and for a row of a replayed trace,
//! where the replay stands after it.
//!
//! Shared vocabulary at the bottom of the house: the sources produce these,
//! the wire format encodes them, the spool stores them, command results and
//! the sink name them. Its one rule: a value is data only (no I/O, no
//! imports from the rest of the crate).

use serde::{Deserialize, Serialize};

/// One value of a reading.
///
/// Numbers carry their unit in the field name, not here (see [`Fields`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FieldValue {
    /// A finite number (never NaN or infinite).
    Num(f64),
    /// A string, as a program printed it in a JSON object.
    Text(String),
    /// A boolean, as a program printed it in a JSON object.
    Bool(bool),
}

/// Fields of one sample, in a stable order: `(name, value)`.
///
/// Names are `snake_case` with units in the name (e.g. `"mem_available_bytes"`,
/// `"load1"`, `"cpu_util_pct"`, `"uptime_secs"`, `"temp_c"`). Within one
/// sample a name appears at most once.
pub type Fields = Vec<(String, FieldValue)>;

/// The rule for field names that come from outside the board (the ingest
/// socket's `fields`, a bridged message's members): 1..=`max_len` bytes,
/// each an ASCII letter or digit, `-`, `_` or `.`. So no NUL, no newline,
/// no space, nothing a consumer's line-based tool or a database column
/// could take for something else.
pub fn field_name_ok(name: &str, max_len: usize) -> bool {
    !name.is_empty()
        && name.len() <= max_len
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Where a replay stands just after one row: stored by the spool with the
/// row (key `replay_position.<stream>` in `agent_state`, as JSON) and given
/// back to [`crate::source::replay::Replay::resume`] at the next start.
///
/// `(trace_id, lap, line)` is the row's identity: the spool derives the
/// event id from it and the payload ([`crate::event::envelope::replay_row_id`],
/// [`crate::event::envelope::derived_event_id`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayPosition {
    /// The trace identity: the configured `trace_id`, else `fp:` and the
    /// file's [`crate::source::replay::fingerprint`].
    pub trace_id: String,
    /// The file's [`crate::source::replay::fingerprint`] when the row was read.
    pub fingerprint: String,
    /// Pass over the file, from 0 (grows only with `repeat`).
    pub lap: u64,
    /// Line number of the row in the file (the header is line 1).
    pub line: u64,
    /// Byte offset in the file just after the row's line.
    pub offset: u64,
    /// Shift added to the file's timestamps in this lap, ms.
    pub shift_ms: i64,
    /// Timestamps of this lap up to the row, to place the next lap.
    pub pass: PassInfo,
    /// For a followed file: which file the row came from (`lap` is then
    /// the segment number). Absent in positions of other replays. Boxed:
    /// every reading in flight to the spool carries a position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<Box<SegmentMark>>,
}

impl ReplayPosition {
    /// The trace identity the event id derives from
    /// ([`crate::event::envelope::replay_row_id`]): `trace_id`, and for a
    /// followed file also the segment's inode and head digest
    /// (`trace_id#ino:head`), so rows of two different files never share an
    /// id even under one segment number.
    pub fn id_trace(&self) -> std::borrow::Cow<'_, str> {
        match &self.segment {
            None => std::borrow::Cow::Borrowed(&self.trace_id),
            Some(m) => std::borrow::Cow::Owned(format!("{}#{}:{}", self.trace_id, m.ino, m.head)),
        }
    }
}

/// Timestamps seen in the current pass, to place the next one.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct PassInfo {
    /// First timestamp of the pass (file time, unshifted), ms.
    pub first: Option<i64>,
    /// Latest timestamp read, ms.
    pub prev: Option<i64>,
    /// Largest timestamp read, ms.
    pub max: Option<i64>,
    /// First positive gap between two consecutive rows, ms.
    pub step: Option<i64>,
}

impl PassInfo {
    /// Take the next row's timestamp `ts` (ms) into account.
    pub fn note(&mut self, ts: i64) {
        self.first.get_or_insert(ts);
        if let Some(prev) = self.prev {
            if self.step.is_none() && ts > prev {
                self.step = Some(ts - prev);
            }
        }
        self.prev = Some(ts);
        self.max = Some(self.max.map_or(ts, |m| m.max(ts)));
    }
}

/// Which file a followed row came from, stored with its position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentMark {
    /// Inode number of the file (`st_ino`, stat(2)).
    pub ino: u64,
    /// sha256 of the file's first `min(offset, HEAD_BYTES)` bytes (offset
    /// of the row's position), first 16 bytes in hex.
    pub head: String,
}
