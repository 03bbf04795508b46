//! Replay of a recorded CSV trace as readings.
//!
//! A trace file (for example the UCI "Air Quality" recording: `;`-separated,
//! decimal commas, CRLF, `-200` for missing values) is played back row by
//! row, either paced against the clock (`speed` trace seconds per real
//! second) or as fast as the caller asks (`speed == 0`). Each usable row
//! becomes one reading: `trace_ts_ms` first, then the configured columns;
//! its event's `ts_ms` is the same trace time ([`DueRow::ts_ms`]).
//!
//! Its one rule: **a row has one identity for ever.** Every reading carries
//! a [`ReplayPosition`] (trace identity, lap, line); the spool derives the
//! row's event id from it and the row's payload, and stores the position in
//! the same transaction as the row, and [`Replay::resume`] continues after
//! the stored position. So a restart neither skips a row nor sends one
//! again under a new id. A row's time ([`DueRow::ts_ms`]) and cells come
//! from the file and the stored position (the repeat shift included), never
//! from the clock when it is read, so a row read again after a rollback of
//! the spool's newest commits is encoded to the same bytes under the same
//! id; if anything moved its bytes meanwhile (its `seq` after a dropped row,
//! a truncated file, a config change), it is a new event under a new id,
//! never a second payload under one id (I3).
//!
//! With `follow = true` the file is tailed instead (like `tail -F`, see
//! [`super::tail`]): at its end the replay waits for more complete lines,
//! and a rotated or truncated file continues as the next *segment*, read
//! from its start. The segment number takes the place of the lap in a
//! row's position, and the segment's inode and first bytes join the trace
//! identity the event id derives from ([`ReplayPosition::id_trace`]).
//!
//! The file is streamed line by line through a `BufReader` and is never held
//! whole; a line longer than [`MAX_LINE_BYTES`] is skipped without being
//! buffered, so memory stays flat whatever the file holds. Each line is
//! split by the `csv` crate (quoted cells, `""` escapes); as lines are read
//! one at a time, a quoted cell cannot span two lines. Timestamps are read
//! by `jiff` (strftime-style formats, offsets, IANA time zones).
//!
//! Bad data is never an error: an unusable cell is skipped (and counted), a
//! row without a timestamp or without any usable value is skipped (and
//! counted). Errors are reserved for the file itself (unreadable: `Io`) and
//! for a configuration that does not fit it (`Parse`).
//!
//! Counting rules of [`ReplayStats`] (for this process only: a resumed
//! replay counts from the resume point):
//! - `rows_read`: every line after the header, including blank and
//!   separator-only lines (`;;;;`) and over-long lines; over all passes when
//!   repeating.
//! - `readings`: rows returned as readings.
//! - `rows_skipped`: rows read that gave no reading, so
//!   `rows_read == readings + rows_skipped` once no row is held back for
//!   pacing.
//! - `cells_skipped`: missing or unparseable cells of configured columns in
//!   rows whose timestamp parsed, including rows then skipped because every
//!   cell was missing. Cells of blank, separator-only or bad-timestamp rows
//!   are not looked at and not counted.
//!
//! One file per job:
//! - this one: [`Replay`] and its driving (open, the rows due per call,
//!   pacing, laps), its counters;
//! - `spec`: the settings ([`ReplaySpec`]) and their checks ([`check`]);
//! - `lines`: the file a line at a time, with bounded memory;
//! - `row`: one line into one reading (cells, numbers, sentinels, the
//!   column plan);
//! - `timestamp`: timestamp formats and time zones ([`TsFormat`]);
//! - `resume`: going on after a restart ([`Replay::resume`]) and the
//!   file's [`fingerprint`].
//!
//! What several of them share (the counters, [`TRACE_TS_FIELD`]) lives here;
//! a sibling imports only the ones below it (`row` reads `spec` and
//! `timestamp`, `resume` reads `lines`), so no two import each other.

use std::fs::File;
use std::io::BufReader;
use std::time::{Duration, Instant};

use crate::event::reading::{Fields, PassInfo, ReplayPosition};
use crate::source::tail::{Tail, TailError, TailLine, MAX_LINE_BYTES};
use crate::source::{excerpt, SourceError};

mod lines;
mod resume;
mod row;
mod spec;
mod timestamp;

pub use resume::{fingerprint, Resumed};
pub use row::{parse_number, sanitize_header, split_cells};
pub use spec::{check, ReplaySpec};
pub use timestamp::{parse_timezone, TsFormat};

use lines::{open_with_header, read_line, LineRead};
use row::Plan;
use spec::check_settings;

/// Name of the field carrying the row's timestamp (unix milliseconds, UTC).
pub const TRACE_TS_FIELD: &str = "trace_ts_ms";

/// Rows that give no reading examined per call at most, so one call stays
/// short even on a file made mostly of junk.
const MAX_SKIPPED_ROWS_PER_CALL: usize = 10_000;

/// Step assumed between the end of one pass and the start of the next when
/// the trace does not show one (a single row, or no increasing timestamps).
const FALLBACK_STEP_MS: i64 = 1000;

/// Enough of a bad cell or header to recognise it in a log line.
const SHOWN_BYTES: usize = 64;

/// Counters, for logs and the closing report. See the module doc for what
/// each one counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayStats {
    /// Lines after the header, separator-only and blank ones included.
    pub rows_read: u64,
    /// Readings returned.
    pub readings: u64,
    /// Missing or unparseable cells of configured columns.
    pub cells_skipped: u64,
    /// Rows that gave no reading.
    pub rows_skipped: u64,
    /// The end of the file was reached without `repeat` (or a repeated pass
    /// held no usable row); every later call returns no reading.
    pub finished: bool,
}

/// A trace being played.
///
/// Pacing: the first call to [`Replay::due`] fixes the start instant; the
/// first usable row is due then, and a row with timestamp `ts` is due at
/// `start + (ts - ts_first) / speed`.
///
/// Repeat: at the end of the file it is opened again (its header must be
/// unchanged), and every timestamp of the new pass is shifted so that its
/// first row follows the previous pass's latest row by the trace's own step
/// (the first positive gap between two rows; 1 s if there is none). The
/// shift applies to `trace_ts_ms` too, so a repeated trace reads as one
/// continuous, ever later timeline; the first pass carries the file's own
/// timestamps. At most one reopen happens per call.
#[derive(Debug)]
pub struct Replay {
    spec: ReplaySpec,
    plan: Plan,
    /// The header line as read at open; a reopen must find the same.
    header: String,
    /// Identity of the trace and fingerprint of the file, fixed at open.
    trace_id: String,
    fingerprint: String,
    /// `None` between the end of a pass and the next reopen, and when
    /// following.
    reader: Option<BufReader<File>>,
    /// The followed file (`follow = true`).
    tail: Option<Tail>,
    /// Reused line buffer.
    line: Vec<u8>,
    /// Line number in the file of the last line read (header = 1).
    line_no: u64,
    /// Byte offset just after the last line read.
    offset: u64,
    /// Pass over the file, from 0.
    lap: u64,
    /// A row read but not yet due.
    pending: Option<Row>,
    /// Instant of the first call.
    start: Option<Instant>,
    /// Timestamp (shifted) of the first row played by this process.
    first_ts: Option<i64>,
    /// Shift added to the file's timestamps in the current pass.
    offset_ms: i64,
    pass: PassInfo,
    stats: ReplayStats,
    /// A bad timestamp was already logged at warn level.
    warned_ts: bool,
    /// The row waited for is due so far ahead that it was logged (once per
    /// row timestamp).
    warned_wait: Option<i64>,
}

/// One usable row: the file's timestamp, the finished reading and where
/// the replay stands after it.
#[derive(Debug)]
struct Row {
    ts: i64,
    fields: Fields,
    position: ReplayPosition,
}

/// One row due ([`Replay::due_rows`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DueRow {
    /// The reading: `trace_ts_ms` first, then the configured columns.
    pub fields: Fields,
    /// Where the replay stands just after the row (stored with it).
    pub position: ReplayPosition,
    /// The row's time, unix ms (UTC): the trace's timestamp plus the lap's
    /// shift, as in `trace_ts_ms`. A function of the file, (trace, lap,
    /// line) and the stored position, never of the clock at read time, so a row
    /// read again after a resume (a rollback undid its commit) has the same
    /// time; the event's `ts_ms` is this.
    pub ts_ms: i64,
}

/// A paced replay waiting longer than this for its next row says so.
const LONG_WAIT: Duration = Duration::from_secs(3600);

impl Replay {
    /// Opens the trace, reads its header and fingerprints the file. The
    /// replay starts at the first row unless [`Replay::resume`] is called
    /// before the first [`Replay::due`].
    ///
    /// # Errors
    ///
    /// - `Io` if the file cannot be opened or read;
    /// - `Parse` if the file is empty, the header lacks a configured column
    ///   (the detail starts with the key, `timestamp_columns:` or
    ///   `columns:`, names the column and lists the headers),
    ///   `timestamp_format` or `timezone` is not valid, or a setting is out
    ///   of range (speed negative or not finite, `max_rows_per_call` 0, an
    ///   unusable delimiter, no timestamp column, duplicate field names).
    pub fn open(spec: ReplaySpec) -> Result<Replay, SourceError> {
        let what = spec.path.display().to_string();
        let parse_err = |detail: String| SourceError::Parse {
            what: what.clone(),
            detail,
        };
        check_settings(&spec).map_err(parse_err)?;
        let format = TsFormat::compile(&spec.timestamp_format, &spec.timezone)
            .map_err(|e| parse_err(format!("timestamp_format/timezone: {e}")))?;
        let (reader, tail, header, header_len) = if spec.follow {
            let (tail, header) = Tail::open(&spec.path).map_err(tail_err)?;
            let len = tail.offset();
            (None, Some(tail), header, len)
        } else {
            let (reader, header, len) = open_with_header(&spec.path)?;
            (Some(reader), None, header, len)
        };
        let plan = Plan::new(&spec, format, &header).map_err(parse_err)?;
        // A followed file grows: its content is no identity. Its path is.
        let fingerprint = if spec.follow {
            String::new()
        } else {
            fingerprint(&spec.path).map_err(|source| SourceError::Io {
                path: spec.path.clone(),
                source,
            })?
        };
        let trace_id = match &spec.trace_id {
            Some(id) => id.clone(),
            None if spec.follow => format!("path:{}", spec.path.display()),
            None => format!("fp:{fingerprint}"),
        };
        Ok(Replay {
            spec,
            plan,
            header,
            trace_id,
            fingerprint,
            reader,
            tail,
            line: Vec::new(),
            line_no: 1,
            offset: header_len,
            lap: 0,
            pending: None,
            start: None,
            first_ts: None,
            offset_ms: 0,
            pass: PassInfo::default(),
            stats: ReplayStats::default(),
            warned_ts: false,
            warned_wait: None,
        })
    }

    /// The trace identity rows of this replay carry (`trace_id` or
    /// `fp:<fingerprint>`).
    pub fn trace_id(&self) -> &str {
        &self.trace_id
    }

    /// The readings due at `now`, oldest first, at most `max_rows_per_call`.
    ///
    /// With `speed > 0` these are the rows whose time has come (see
    /// [`Replay`]); a caller that fell behind catches up over several calls.
    /// With `speed == 0` it is simply the next `max_rows_per_call` rows.
    /// Each reading is `("trace_ts_ms", Num)` followed by the usable cells of
    /// the configured columns, in their configured order.
    ///
    /// After the end of the file without `repeat`, `stats().finished` is set
    /// and every later call returns `Ok` with no reading.
    ///
    /// # Errors
    ///
    /// `Io` if reading (or, repeating, reopening) the file fails, `Parse` if
    /// a reopened file is empty or its header changed. Only returned when no
    /// reading is due in the same call, so readings are never lost; the
    /// failed step is tried again on the next call.
    pub fn due(&mut self, now: Instant) -> Result<Vec<Fields>, SourceError> {
        Ok(self.due_at(now)?.into_iter().map(|(f, _)| f).collect())
    }

    /// Like [`Replay::due`], each reading with the position just after its
    /// row (to be stored with it, see [`ReplayPosition`]).
    ///
    /// # Errors
    ///
    /// As [`Replay::due`].
    pub fn due_at(&mut self, now: Instant) -> Result<Vec<(Fields, ReplayPosition)>, SourceError> {
        Ok(self
            .due_rows(now)?
            .into_iter()
            .map(|r| (r.fields, r.position))
            .collect())
    }

    /// Like [`Replay::due_at`], each reading with its row's time as well
    /// ([`DueRow::ts_ms`]), the time its event carries.
    ///
    /// # Errors
    ///
    /// As [`Replay::due`].
    pub fn due_rows(&mut self, now: Instant) -> Result<Vec<DueRow>, SourceError> {
        let mut out = Vec::new();
        if self.stats.finished {
            return Ok(out);
        }
        let start = *self.start.get_or_insert(now);
        let limit = self.spec.max_rows_per_call.max(1);
        let mut budget = MAX_SKIPPED_ROWS_PER_CALL;
        if let Some(tail) = self.tail.as_mut() {
            tail.new_poll();
        }
        let mut reopened = false;
        while out.len() < limit {
            let row = match self.pending.take() {
                Some(row) => row,
                None => match self.next_row(&mut budget, &mut reopened) {
                    Ok(Some(row)) => row,
                    Ok(None) => break,
                    Err(e) if out.is_empty() => return Err(e),
                    Err(e) => {
                        log::debug!("{e} (after {} readings; retried next call)", out.len());
                        break;
                    }
                },
            };
            if !self.is_due(row.ts, start, now) {
                self.pending = Some(row);
                break;
            }
            self.stats.readings += 1;
            out.push(DueRow {
                ts_ms: row.ts,
                fields: row.fields,
                position: row.position,
            });
        }
        Ok(out)
    }

    /// The counters so far.
    pub fn stats(&self) -> &ReplayStats {
        &self.stats
    }

    /// Whether a row with (shifted) timestamp `ts` is due at `now`.
    fn is_due(&mut self, ts: i64, start: Instant, now: Instant) -> bool {
        let first = *self.first_ts.get_or_insert(ts);
        if self.spec.speed <= 0.0 {
            return true;
        }
        let ahead_ms = ts.saturating_sub(first);
        if ahead_ms <= 0 {
            return true;
        }
        // Integer milliseconds up to 2^53 convert exactly.
        let real_secs = ahead_ms as f64 / 1000.0 / self.spec.speed;
        let due_at = Duration::try_from_secs_f64(real_secs)
            .ok()
            .and_then(|d| start.checked_add(d));
        let due = due_at.is_some_and(|d| now >= d);
        // A timestamp far ahead of the others stalls a paced replay with no
        // other sign: say so once.
        let wait = due_at.map(|d| d.saturating_duration_since(now));
        if !due && wait.is_none_or(|w| w > LONG_WAIT) && self.warned_wait != Some(ts) {
            self.warned_wait = Some(ts);
            log::warn!(
                "{}: line {}: the next row is {} s of trace time after the first one, due in {} at speed {}: a timestamp far ahead of the others? (nothing is played until then)",
                self.plan.what,
                self.line_no,
                ahead_ms / 1000,
                wait.map_or_else(|| "never".to_owned(), |w| format!("{} s", w.as_secs())),
                self.spec.speed
            );
        }
        due
    }

    /// Reads lines until one gives a reading. `Ok(None)`: nothing more in
    /// this call (end of the replay, the skip budget spent, or the end of
    /// a pass already reopened once in this call).
    fn next_row(
        &mut self,
        budget: &mut usize,
        reopened: &mut bool,
    ) -> Result<Option<Row>, SourceError> {
        loop {
            if self.stats.finished || *budget == 0 {
                return Ok(None);
            }
            let read = if let Some(tail) = self.tail.as_mut() {
                let read = match tail.next_line(&mut self.line).map_err(tail_err)? {
                    TailLine::Wait => return Ok(None),
                    TailLine::Line => LineRead::Line,
                    TailLine::TooLong => LineRead::TooLong,
                };
                if tail.segment() != self.lap {
                    // A new segment: its own timeline.
                    self.pass = PassInfo::default();
                }
                self.lap = tail.segment();
                self.line_no = tail.line_no();
                self.offset = tail.offset();
                read
            } else {
                match self.next_file_line(reopened)? {
                    Some(read) => read,
                    None => return Ok(None),
                }
            };
            if read == LineRead::Eof {
                self.end_of_pass();
                continue;
            }
            self.stats.rows_read += 1;
            let row = if read == LineRead::TooLong {
                log::debug!(
                    "{} line {}: longer than {MAX_LINE_BYTES} bytes, skipped",
                    self.plan.what,
                    self.line_no
                );
                None
            } else {
                self.parse_current()
            };
            match row {
                Some(row) => return Ok(Some(row)),
                None => {
                    self.stats.rows_skipped += 1;
                    *budget -= 1;
                }
            }
        }
    }

    /// The next line of the (not followed) file, reopened for the next
    /// pass at most once per call: `None` when nothing more in this call.
    fn next_file_line(&mut self, reopened: &mut bool) -> Result<Option<LineRead>, SourceError> {
        if self.reader.is_none() {
            if *reopened {
                return Ok(None);
            }
            *reopened = true;
            self.reopen()?;
        }
        let Some(reader) = self.reader.as_mut() else {
            return Ok(None);
        };
        let (read, used) = read_line(reader, &mut self.line).map_err(|source| SourceError::Io {
            path: self.spec.path.clone(),
            source,
        })?;
        if read != LineRead::Eof {
            self.line_no += 1;
            self.offset += used;
        }
        Ok(Some(read))
    }

    /// The reading of the line in the buffer, if it gives one.
    fn parse_current(&mut self) -> Option<Row> {
        let warn = !self.warned_ts;
        let (raw_ts, fields) = match self.plan.parse_row(
            &self.line,
            self.line_no,
            self.offset_ms,
            &mut self.stats,
            warn,
        ) {
            Ok(row) => row?,
            Err(()) => {
                self.warned_ts = true;
                return None;
            }
        };
        self.pass.note(raw_ts);
        let position = ReplayPosition {
            trace_id: self.trace_id.clone(),
            fingerprint: self.fingerprint.clone(),
            lap: self.lap,
            line: self.line_no,
            offset: self.offset,
            shift_ms: self.offset_ms,
            pass: self.pass.clone(),
            segment: self.tail.as_mut().map(|t| Box::new(t.mark())),
        };
        Some(Row {
            ts: raw_ts.saturating_add(self.offset_ms),
            fields,
            position,
        })
    }

    /// The file is exhausted: finish, or arrange the next pass.
    fn end_of_pass(&mut self) {
        self.reader = None;
        let pass = std::mem::take(&mut self.pass);
        if !self.spec.repeat {
            self.stats.finished = true;
            return;
        }
        match (pass.first, pass.max) {
            (Some(first), Some(max)) => {
                let step = pass.step.unwrap_or(FALLBACK_STEP_MS);
                self.offset_ms = self
                    .offset_ms
                    .saturating_add(max.saturating_sub(first))
                    .saturating_add(step);
                self.lap += 1;
            }
            _ => {
                log::warn!(
                    "{}: no usable row in a whole pass, replay stopped",
                    self.plan.what
                );
                self.stats.finished = true;
            }
        }
    }

    /// Opens the file again for the next pass; its header must not have
    /// changed, or the column positions would be wrong.
    fn reopen(&mut self) -> Result<(), SourceError> {
        let (reader, header, header_len) = open_with_header(&self.spec.path)?;
        if header != self.header {
            return Err(SourceError::Parse {
                what: self.plan.what.clone(),
                detail: format!(
                    "header changed since the replay started: now {:?}",
                    excerpt(&header, 4 * SHOWN_BYTES)
                ),
            });
        }
        self.reader = Some(reader);
        self.line_no = 1;
        self.offset = header_len;
        Ok(())
    }
}

/// A followed file's error as a source error: unreadable → `Io`, a bad
/// header → `Parse`.
fn tail_err(e: TailError) -> SourceError {
    match e {
        TailError::Io { path, source } => SourceError::Io { path, source },
        TailError::Header { path, detail } => SourceError::Parse {
            what: path.display().to_string(),
            detail,
        },
    }
}

#[cfg(test)]
mod tests;
