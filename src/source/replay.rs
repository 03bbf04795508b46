//! Replay of a recorded CSV trace as readings.
//!
//! A trace file (for example the UCI "Air Quality" recording: `;`-separated,
//! decimal commas, CRLF, `-200` for missing values) is played back row by
//! row, either paced against the clock (`speed` trace seconds per real
//! second) or as fast as the caller asks (`speed == 0`). Each usable row
//! becomes one reading: `trace_ts_ms` first, then the configured columns.
//!
//! Its one rule: **a row has one identity for ever.** Every reading carries
//! a [`ReplayPosition`] (trace identity, lap, line); the spool derives the
//! row's event id from it and stores the position in the same transaction
//! as the row, and [`Replay::resume`] continues after the stored position.
//! So a restart neither skips a row nor sends one again under a new id.
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

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use jiff::fmt::strtime;
use jiff::tz::TimeZone;
use sha2::{Digest, Sha256};

use super::tail::{Tail, TailError, TailLine, TailResumed, MAX_LINE_BYTES};
use super::{excerpt, SourceError};
use crate::reading::{FieldValue, Fields, PassInfo, ReplayPosition};

/// Name of the field carrying the row's timestamp (unix milliseconds, UTC).
pub const TRACE_TS_FIELD: &str = "trace_ts_ms";

/// Bytes hashed at each end of the file for its fingerprint.
const FINGERPRINT_EDGE_BYTES: u64 = 64 * 1024;

/// Rows that give no reading examined per call at most, so one call stays
/// short even on a file made mostly of junk.
const MAX_SKIPPED_ROWS_PER_CALL: usize = 10_000;

/// Step assumed between the end of one pass and the start of the next when
/// the trace does not show one (a single row, or no increasing timestamps).
const FALLBACK_STEP_MS: i64 = 1000;

/// Enough of a bad cell or header to recognise it in a log line.
const SHOWN_BYTES: usize = 64;

/// Settings of a replayed trace (the config module builds this).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplaySpec {
    /// The CSV file; its first line is the header.
    pub path: PathBuf,
    /// Cell separator, one ASCII character, e.g. `';'`. Not `'\n'`, `'\r'`,
    /// `'"'`, nor `','` together with `decimal_comma`.
    pub delimiter: char,
    /// `"2,6"` means 2.6 (and `"2.6"` is then rejected, as `.` would be a
    /// thousands separator in such a file).
    pub decimal_comma: bool,
    /// Sentinel cell texts meaning "missing", compared after trimming, e.g.
    /// `["-200"]`. A cell whose number equals a sentinel's number is also
    /// missing, so `"-200,0"` matches `"-200"`.
    pub missing: Vec<String>,
    /// Header names of the cells making up the timestamp, joined with one
    /// space before parsing, e.g. `["Date", "Time"]`. At least one.
    pub timestamp_columns: Vec<String>,
    /// A jiff strftime-style format (see [`TsFormat`]), e.g.
    /// `"%d/%m/%Y %H.%M.%S"`, `"%Y-%m-%dT%H:%M:%S%.f%:z"` or `"%s"`.
    pub timestamp_format: String,
    /// Zone that wall-clock timestamps without an offset are read in:
    /// `"UTC"`, an IANA name (`"Europe/Rome"`) or a fixed offset
    /// (`"+01:00"`). See [`parse_timezone`].
    pub timezone: String,
    /// The trace's identity, from which the event ids of its rows derive.
    /// `None`: the file's [`fingerprint`], so another file is another trace.
    pub trace_id: Option<String>,
    /// `(CSV column header, field name)`, in output order. Empty means every
    /// column that is not a timestamp column and has a non-empty header,
    /// named by [`sanitize_header`] (a clash or an empty result gets a
    /// `_2`, `_3`… suffix or a `col_N` name).
    pub columns: Vec<(String, String)>,
    /// Trace seconds per real second (3600 plays an hourly trace at one row
    /// per second); 0 means no pacing, each call takes the next batch.
    pub speed: f64,
    /// Most readings returned by one call (at least 1).
    pub max_rows_per_call: usize,
    /// Start over at the end of the file.
    pub repeat: bool,
    /// Tail the file: wait at its end for more lines, follow rotation and
    /// truncation (see [`super::tail`]). Excludes `repeat`; rows are played
    /// as they are written, so `speed` is 0.
    pub follow: bool,
}

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

/// What [`Replay::resume`] did, for the log line.
#[derive(Debug, Clone, PartialEq)]
pub enum Resumed {
    /// No stored position: from the first row.
    Fresh,
    /// Seeked to just after the stored row.
    After {
        /// Lap of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
    },
    /// Same configured `trace_id` but another file content: lines were
    /// skipped up to the stored line (reached: `true`; the file is shorter
    /// than the stored position: `false`, and the lap counts as ended).
    SkippedTo {
        /// Lap of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
        /// Whether the file still has that line.
        reached: bool,
    },
    /// The stored position belongs to another trace identity (the file
    /// changed and no `trace_id` is configured): a new trace, from the first
    /// row, with new event ids.
    NewTrace {
        /// The identity stored before.
        was: String,
    },
    /// Followed file: the stored file was found under another name (rotated
    /// while the agent was down); it is read to its end from the stored
    /// row, then the path's file follows as the next segment.
    InRotated {
        /// Segment of the stored row.
        lap: u64,
        /// Line of the stored row.
        line: u64,
        /// Where the stored file is now.
        file: PathBuf,
    },
    /// Followed file: the stored file is gone or was truncated; the path's
    /// file is played from its first row as segment `lap`.
    NextSegment {
        /// The new segment's number (the stored one + 1).
        lap: u64,
    },
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

/// How to turn a line into a reading; fixed at open.
#[derive(Debug)]
struct Plan {
    /// For log lines.
    what: String,
    delimiter: u8,
    decimal_comma: bool,
    format: TsFormat,
    ts_cols: Vec<usize>,
    columns: Vec<Column>,
    /// Sentinel texts (trimmed) with their numbers when they parse.
    sentinels: Vec<(String, Option<f64>)>,
}

#[derive(Debug)]
struct Column {
    index: usize,
    header: String,
    field: String,
}

/// One usable row: the file's timestamp, the finished reading and where
/// the replay stands after it.
#[derive(Debug)]
struct Row {
    ts: i64,
    fields: Fields,
    position: ReplayPosition,
}

/// What reading one line gave.
#[derive(Debug, PartialEq)]
enum LineRead {
    /// A line is in the buffer, without its `\n` or `\r\n`.
    Line,
    /// The line was longer than the limit and has been skipped.
    TooLong,
    /// Nothing left.
    Eof,
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
        let delimiter = spec.delimiter as u8;
        let (reader, tail, header, header_len) = if spec.follow {
            let (tail, header) = Tail::open(&spec.path).map_err(tail_err)?;
            let len = tail.offset();
            (None, Some(tail), header, len)
        } else {
            let (reader, header, len) = open_with_header(&spec)?;
            (Some(reader), None, header, len)
        };
        let headers: Vec<String> = split_cells(header.as_bytes(), delimiter)
            .into_iter()
            .map(|h| h.trim().to_owned())
            .collect();
        let (ts_cols, columns) = resolve_columns(&headers, &spec).map_err(parse_err)?;
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
        let sentinels = spec
            .missing
            .iter()
            .map(|s| {
                let s = s.trim();
                (s.to_owned(), parse_number(s, spec.decimal_comma))
            })
            .collect();
        let plan = Plan {
            what,
            delimiter,
            decimal_comma: spec.decimal_comma,
            format,
            ts_cols,
            columns,
            sentinels,
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

    /// Continues after `saved`, the position stored with the last row the
    /// spool committed (`None`: from the first row). Call before the first
    /// [`Replay::due`].
    ///
    /// - Same identity and same file: seeks just after the stored row.
    /// - Same configured `trace_id`, other content: skips lines up to the
    ///   stored line; a file shorter than that ends the stored lap.
    /// - Another identity: the file is a new trace, played from its first
    ///   row (lap 0) under new ids.
    /// - Followed file ([`Tail::resume`]): after the stored row if the file
    ///   at the path is still the stored one (inode and first bytes); else
    ///   in the stored file found under another name in its directory
    ///   ([`Resumed::InRotated`]); else the path's file from its first row
    ///   as the next segment ([`Resumed::NextSegment`]). A position stored
    ///   without a file identity skips lines up to the stored line.
    ///
    /// # Errors
    ///
    /// `Io` if seeking or reading the file fails.
    pub fn resume(&mut self, saved: Option<ReplayPosition>) -> Result<Resumed, SourceError> {
        let Some(saved) = saved else {
            return Ok(Resumed::Fresh);
        };
        if saved.trace_id != self.trace_id {
            return Ok(Resumed::NewTrace {
                was: saved.trace_id,
            });
        }
        if let Some(tail) = self.tail.as_mut() {
            let how = tail
                .resume(
                    saved.lap,
                    saved.line,
                    saved.offset,
                    saved.segment.as_deref(),
                )
                .map_err(tail_err)?;
            if tail.segment() != saved.lap {
                self.pass = PassInfo::default();
            }
            self.lap = tail.segment();
            self.line_no = tail.line_no();
            self.offset = tail.offset();
            let (lap, line) = (saved.lap, saved.line);
            return Ok(match how {
                TailResumed::Same => Resumed::After { lap, line },
                TailResumed::ByLine => Resumed::SkippedTo {
                    lap,
                    line,
                    reached: true,
                },
                TailResumed::Rotated(file) => Resumed::InRotated { lap, line, file },
                TailResumed::NextSegment => Resumed::NextSegment { lap: self.lap },
            });
        }
        self.lap = saved.lap;
        self.offset_ms = saved.shift_ms;
        self.pass = saved.pass.clone();
        let io_err = |source| SourceError::Io {
            path: self.spec.path.clone(),
            source,
        };
        let Some(reader) = self.reader.as_mut() else {
            return Ok(Resumed::Fresh);
        };
        if saved.fingerprint == self.fingerprint {
            reader.seek(SeekFrom::Start(saved.offset)).map_err(io_err)?;
            self.line_no = saved.line;
            self.offset = saved.offset;
            return Ok(Resumed::After {
                lap: saved.lap,
                line: saved.line,
            });
        }
        while self.line_no < saved.line {
            let (read, used) = read_line(reader, &mut self.line).map_err(io_err)?;
            if read == LineRead::Eof {
                self.end_of_pass();
                return Ok(Resumed::SkippedTo {
                    lap: saved.lap,
                    line: saved.line,
                    reached: false,
                });
            }
            self.line_no += 1;
            self.offset += used;
        }
        Ok(Resumed::SkippedTo {
            lap: saved.lap,
            line: saved.line,
            reached: true,
        })
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
            out.push((row.fields, row.position));
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
        let (reader, header, header_len) = open_with_header(&self.spec)?;
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

impl Plan {
    /// The file timestamp and reading of one line: `Ok(None)` if it has
    /// none (cells skipped are counted here, the row by the caller),
    /// `Err(())` if its timestamp does not parse (logged, at warn level if
    /// `warn`, else at debug).
    fn parse_row(
        &self,
        line: &[u8],
        line_no: u64,
        offset_ms: i64,
        stats: &mut ReplayStats,
        warn: bool,
    ) -> Result<Option<(i64, Fields)>, ()> {
        let cells = split_cells(line, self.delimiter);
        let cell = |index: usize| cells.get(index).map_or("", |c| c.trim());
        if cells.iter().all(|c| c.trim().is_empty()) {
            // Blank or separator-only line: nothing to report.
            return Ok(None);
        }
        let mut ts_text = String::new();
        for (k, &index) in self.ts_cols.iter().enumerate() {
            if cell(index).is_empty() {
                log::debug!("{} line {line_no}: empty timestamp, row skipped", self.what);
                return Ok(None);
            }
            if k > 0 {
                ts_text.push(' ');
            }
            ts_text.push_str(cell(index));
        }
        let raw_ts = match self.format.parse_ms(&ts_text) {
            Ok(ts) => ts,
            Err(e) => {
                let level = if warn {
                    log::Level::Warn
                } else {
                    log::Level::Debug
                };
                log::log!(
                    level,
                    "{} line {line_no}: timestamp {:?} (column {}) does not match timestamp_format {:?}: {e}; row skipped{}",
                    self.what,
                    excerpt(&ts_text, SHOWN_BYTES),
                    self.ts_cols.iter().map(|i| (i + 1).to_string()).collect::<Vec<_>>().join("+"),
                    self.format.format,
                    if warn { " (further ones at debug level)" } else { "" }
                );
                return Err(());
            }
        };
        let ts = raw_ts.saturating_add(offset_ms);
        let mut fields = Vec::with_capacity(self.columns.len() + 1);
        // Unix milliseconds stay far below 2^53, where f64 is exact.
        fields.push((TRACE_TS_FIELD.to_owned(), FieldValue::Num(ts as f64)));
        for col in &self.columns {
            let text = cell(col.index);
            match self.cell_value(text) {
                Ok(Some(v)) => fields.push((col.field.clone(), FieldValue::Num(v))),
                Ok(None) => stats.cells_skipped += 1,
                Err(()) => {
                    stats.cells_skipped += 1;
                    log::debug!(
                        "{} line {line_no}: column {} {:?}: not a number: {:?}",
                        self.what,
                        col.index + 1,
                        col.header,
                        excerpt(text, SHOWN_BYTES)
                    );
                }
            }
        }
        if fields.len() == 1 {
            return Ok(None);
        }
        Ok(Some((raw_ts, fields)))
    }

    /// `Ok(Some)` for a number, `Ok(None)` for an empty or missing cell,
    /// `Err` for text that is not a number.
    fn cell_value(&self, cell: &str) -> Result<Option<f64>, ()> {
        if cell.is_empty() || self.sentinels.iter().any(|(s, _)| s == cell) {
            return Ok(None);
        }
        let v = parse_number(cell, self.decimal_comma).ok_or(())?;
        if self.sentinels.iter().any(|(_, n)| *n == Some(v)) {
            return Ok(None);
        }
        Ok(Some(v))
    }
}

/// What `check-config` says about a replay source: opens the file and
/// reads its header as [`Replay::open`] does. The error is `(key, message)`:
/// the source key at fault (`path` for a file that cannot be opened or read
/// or is empty, `timestamp_columns` or `columns` for a column the header
/// lacks, `timestamp_format` for the format or zone) and the message, which
/// names the file.
///
/// # Errors
///
/// As above; nothing is written.
pub fn check(spec: &ReplaySpec) -> Result<(), (&'static str, String)> {
    match Replay::open(spec.clone()) {
        Ok(_) => Ok(()),
        Err(SourceError::Parse { what, detail }) => {
            // Replay::open starts a detail with the key it is about.
            let key = ["timestamp_columns", "columns", "timestamp_format"]
                .into_iter()
                .find(|k| {
                    detail.starts_with(&format!("{k}:")) || detail.starts_with(&format!("{k}/"))
                })
                .unwrap_or("path");
            Err((key, SourceError::Parse { what, detail }.to_string()))
        }
        Err(e) => Err(("path", e.to_string())),
    }
}

/// Rejects settings that cannot work, whatever the file.
fn check_settings(spec: &ReplaySpec) -> Result<(), String> {
    if !spec.speed.is_finite() || spec.speed < 0.0 {
        return Err(format!(
            "speed must be a finite number >= 0, got {}",
            spec.speed
        ));
    }
    if spec.max_rows_per_call == 0 {
        return Err("max_rows_per_call must be at least 1".to_owned());
    }
    if !spec.delimiter.is_ascii() || matches!(spec.delimiter, '\n' | '\r' | '"') {
        return Err(format!("delimiter {:?} cannot be used", spec.delimiter));
    }
    if spec.decimal_comma && spec.delimiter == ',' {
        return Err("delimiter ',' cannot be used with decimal_comma".to_owned());
    }
    if spec.timestamp_columns.is_empty() {
        return Err("timestamp_columns is empty, at least one column is needed".to_owned());
    }
    if spec.follow && spec.repeat {
        return Err("follow: cannot be combined with repeat (a followed file has no end to start over from)".to_owned());
    }
    let mut names: Vec<&str> = vec![TRACE_TS_FIELD];
    for (header, field) in &spec.columns {
        if field.is_empty() {
            return Err(format!("column {header:?} has an empty field name"));
        }
        if names.contains(&field.as_str()) {
            return Err(format!("field name {field:?} is used twice"));
        }
        names.push(field);
    }
    Ok(())
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

/// Opens the trace and reads its header line (BOM, CR and LF removed),
/// with the bytes it took.
fn open_with_header(spec: &ReplaySpec) -> Result<(BufReader<File>, String, u64), SourceError> {
    let io_err = |source| SourceError::Io {
        path: spec.path.clone(),
        source,
    };
    let parse_err = |detail: &str| SourceError::Parse {
        what: spec.path.display().to_string(),
        detail: detail.to_owned(),
    };
    // A FIFO would block the open, /dev/zero would be read for ever.
    if !std::fs::metadata(&spec.path).map_err(io_err)?.is_file() {
        return Err(parse_err("not a regular file"));
    }
    let mut reader = BufReader::new(File::open(&spec.path).map_err(io_err)?);
    let mut buf = Vec::new();
    let (read, used) = read_line(&mut reader, &mut buf).map_err(io_err)?;
    match read {
        LineRead::Eof => return Err(parse_err("file is empty, expected a header line")),
        LineRead::TooLong => {
            return Err(parse_err(&format!(
                "header line is longer than {MAX_LINE_BYTES} bytes"
            )))
        }
        LineRead::Line => {}
    }
    let text = String::from_utf8_lossy(&buf);
    let header = text.strip_prefix('\u{feff}').unwrap_or(&text).to_owned();
    Ok((reader, header, used))
}

/// sha256 over the file's length and its first and last 64 KiB (the
/// header included), first 16 bytes in hex (32 characters). Cheap on any
/// file size; an edit in the middle of a large file that keeps its length
/// is not seen (configure `trace_id` to decide identity yourself).
///
/// # Errors
///
/// The file cannot be opened, measured or read.
pub fn fingerprint(path: &std::path::Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut hash = Sha256::new();
    hash.update(len.to_be_bytes());
    let mut buf = Vec::new();
    (&mut file)
        .take(FINGERPRINT_EDGE_BYTES)
        .read_to_end(&mut buf)?;
    hash.update(&buf);
    if len > FINGERPRINT_EDGE_BYTES {
        file.seek(SeekFrom::Start(
            len.saturating_sub(FINGERPRINT_EDGE_BYTES)
                .max(FINGERPRINT_EDGE_BYTES),
        ))?;
        buf.clear();
        file.take(FINGERPRINT_EDGE_BYTES).read_to_end(&mut buf)?;
        hash.update(&buf);
    }
    Ok(hash.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Positions of the timestamp cells and the value columns in `headers`
/// (already trimmed). An error starts with the key at fault
/// (`timestamp_columns:` or `columns:`).
fn resolve_columns(
    headers: &[String],
    spec: &ReplaySpec,
) -> Result<(Vec<usize>, Vec<Column>), String> {
    let find = |key: &str, name: &str| {
        let name = name.trim();
        headers.iter().position(|h| *h == name).ok_or_else(|| {
            let listed: Vec<String> = headers.iter().map(|h| format!("{h:?}")).collect();
            format!(
                "{key}: column {name:?} is not in the header (headers: {})",
                excerpt(&listed.join(", "), 16 * SHOWN_BYTES)
            )
        })
    };
    let ts_cols = spec
        .timestamp_columns
        .iter()
        .map(|c| find("timestamp_columns", c))
        .collect::<Result<Vec<_>, _>>()?;
    let mut columns = Vec::new();
    if spec.columns.is_empty() {
        let mut used = vec![TRACE_TS_FIELD.to_owned()];
        for (index, header) in headers.iter().enumerate() {
            if header.is_empty() || ts_cols.contains(&index) {
                continue;
            }
            let base = match sanitize_header(header) {
                s if s.is_empty() => format!("col_{}", index + 1),
                s => s,
            };
            let mut field = base.clone();
            let mut n = 2;
            while used.contains(&field) {
                field = format!("{base}_{n}");
                n += 1;
            }
            used.push(field.clone());
            columns.push(Column {
                index,
                header: header.clone(),
                field,
            });
        }
    } else {
        for (header, field) in &spec.columns {
            columns.push(Column {
                index: find("columns", header)?,
                header: header.trim().to_owned(),
                field: field.clone(),
            });
        }
    }
    Ok((ts_cols, columns))
}

/// Reads one line into `buf` (cleared first), without its `\n` or `\r\n`,
/// and returns it with the bytes consumed (end of line included). A final
/// line without a newline is a line. A line longer than [`MAX_LINE_BYTES`]
/// is consumed up to its newline without being kept.
fn read_line<R: BufRead>(reader: &mut R, buf: &mut Vec<u8>) -> io::Result<(LineRead, u64)> {
    buf.clear();
    let cap = u64::try_from(MAX_LINE_BYTES)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    let n = reader.by_ref().take(cap).read_until(b'\n', buf)? as u64;
    if n == 0 {
        return Ok((LineRead::Eof, 0));
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_LINE_BYTES {
        buf.clear();
        let rest = skip_past_newline(reader)?;
        return Ok((LineRead::TooLong, n + rest));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok((LineRead::Line, n))
}

/// Consumes input up to and including the next `\n` (or to the end), and
/// returns the bytes consumed.
fn skip_past_newline<R: BufRead>(reader: &mut R) -> io::Result<u64> {
    let mut total = 0u64;
    loop {
        let (found, used) = {
            let avail = reader.fill_buf()?;
            if avail.is_empty() {
                return Ok(total);
            }
            match avail.iter().position(|&b| b == b'\n') {
                Some(pos) => (true, pos + 1),
                None => (false, avail.len()),
            }
        };
        reader.consume(used);
        total += used as u64;
        if found {
            return Ok(total);
        }
    }
}

/// The cells of one line, split by the `csv` crate: a cell may be quoted
/// (`"a;b"` holds the delimiter, `""` inside quotes is one `"`); a `"` in
/// the middle of an unquoted cell is an ordinary character. Bytes that are
/// not UTF-8 become U+FFFD. A blank line gives no cell. A quote left open
/// runs to the end of the line (lines are split one at a time).
pub fn split_cells(line: &[u8], delimiter: u8) -> Vec<String> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(delimiter)
        .buffer_capacity(line.len().max(64))
        .from_reader(line);
    let mut record = csv::ByteRecord::new();
    match reader.read_byte_record(&mut record) {
        Ok(true) => record
            .iter()
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect(),
        // A slice cannot fail to read, flexible records have no length
        // error and byte records no UTF-8 one: only a blank line is left.
        Ok(false) | Err(_) => Vec::new(),
    }
}

/// Field name for a header: lowercase ASCII, each run of characters other
/// than `[a-z0-9]` turned into one `_`, no `_` at either end
/// (`"PT08.S1(CO)"` → `"pt08_s1_co"`). May be empty.
pub fn sanitize_header(header: &str) -> String {
    let mut out = String::with_capacity(header.len());
    let mut gap = false;
    for c in header.chars().map(|c| c.to_ascii_lowercase()) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            if gap && !out.is_empty() {
                out.push('_');
            }
            gap = false;
            out.push(c);
        } else {
            gap = true;
        }
    }
    out
}

/// A decimal number as written in a trace cell (surrounding whitespace
/// ignored): optional sign, digits with at most one decimal separator (`,`
/// with `decimal_comma`, else `.`), optional exponent. Anything else, a
/// thousands separator included, is rejected, as are results that are not
/// finite.
pub fn parse_number(text: &str, decimal_comma: bool) -> Option<f64> {
    let t = text.trim();
    let b = t.as_bytes();
    let point = if decimal_comma { b',' } else { b'.' };
    let digits_from = |mut i: usize| {
        let from = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i, i - from)
    };
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let (next, whole) = digits_from(i);
    i = next;
    let mut frac = 0;
    if b.get(i) == Some(&point) {
        (i, frac) = digits_from(i + 1);
    }
    if whole + frac == 0 {
        return None;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let (next, exp) = digits_from(i);
        if exp == 0 {
            return None;
        }
        i = next;
    }
    if i != b.len() {
        return None;
    }
    let v = if decimal_comma {
        t.replace(',', ".").parse::<f64>()
    } else {
        t.parse::<f64>()
    };
    v.ok().filter(|v| v.is_finite())
}

/// A `timezone` setting: `"UTC"` (also `"Z"`), a fixed offset (`"+01:00"`,
/// `"-0530"`), or an IANA name looked up in the system's zoneinfo
/// (`/usr/share/zoneinfo`, e.g. `"Europe/Rome"`).
///
/// # Errors
///
/// A one-line reason naming the value.
pub fn parse_timezone(text: &str) -> Result<TimeZone, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err(
            "empty: write \"UTC\", an offset like \"+01:00\" or a zone like \"Europe/Rome\""
                .to_owned(),
        );
    }
    if t.eq_ignore_ascii_case("utc") || t == "Z" {
        return Ok(TimeZone::UTC);
    }
    if t.starts_with(['+', '-']) {
        for format in ["%:z", "%z"] {
            if let Some(offset) = strtime::parse(format, t).ok().and_then(|tm| tm.offset()) {
                return Ok(TimeZone::fixed(offset));
            }
        }
        return Err(format!(
            "{t:?} is not an offset like \"+01:00\" or \"-0530\""
        ));
    }
    TimeZone::get(t).map_err(|e| format!("unknown time zone {t:?}: {e}"))
}

/// A `timestamp_format`, read by jiff's strptime
/// (<https://docs.rs/jiff/latest/jiff/fmt/strtime/index.html>): `%d %m %Y
/// %H %M %S` as before (numbers need no leading zeros; `%Y` takes 1 to 4
/// digits, so `04` is the year 4: use `%y` for two-digit years; a leap
/// second `:60` reads as `:59`), plus `%.f`
/// (fractional seconds), `%z`/`%:z` (an offset in the text), `%Q` (an IANA
/// zone in the text), `%s` (epoch seconds), `%b`, `%y`, `%j` and the rest
/// of jiff's set; every other character is literal, a space matches any run
/// of whitespace. A text with an offset, zone or epoch seconds is read as
/// such; a bare wall time is read in the configured zone, and a wall time
/// a DST change makes ambiguous or skips is resolved the way RFC 5545 does
/// (jiff's "compatible": the earlier of two, the later across a gap).
#[derive(Debug, Clone)]
pub struct TsFormat {
    format: String,
    tz: TimeZone,
}

impl TsFormat {
    /// Checks `format` by writing a known instant with it and reading it
    /// back, and resolves `timezone` ([`parse_timezone`]).
    ///
    /// # Errors
    ///
    /// A one-line reason: empty format, an unknown directive, a format that
    /// does not give a date (for example `"%H:%M"`), or a bad `timezone`.
    pub fn compile(format: &str, timezone: &str) -> Result<TsFormat, String> {
        if format.trim().is_empty() {
            return Err("timestamp_format is empty".to_owned());
        }
        let tz = parse_timezone(timezone).map_err(|e| format!("timezone: {e}"))?;
        let f = TsFormat {
            format: format.to_owned(),
            tz: tz.clone(),
        };
        // 2004-03-10T18:07:09.25Z, in the zone the texts will be read in.
        let probe = jiff::Timestamp::from_millisecond(1_078_942_029_250)
            .map_err(|e| e.to_string())?
            .to_zoned_datetime(tz);
        let text = strtime::format(format, &probe)
            .map_err(|e| format!("timestamp_format {format:?}: {e}"))?;
        f.parse_ms(&text).map_err(|e| {
            format!("timestamp_format {format:?} cannot read back its own output {text:?}: {e}")
        })?;
        Ok(f)
    }

    /// Unix milliseconds of `text`. The whole text must match.
    ///
    /// # Errors
    ///
    /// jiff's one-line reason: a literal not matching, digits missing,
    /// trailing text, a field out of range (month 13, 31 April, 29 February
    /// of a common year, hour 24...), an unknown zone named in the text.
    pub fn parse_ms(&self, text: &str) -> Result<i64, String> {
        let tm = strtime::parse(&self.format, text).map_err(|e| e.to_string())?;
        let ts = if tm.timestamp().is_some() || tm.offset().is_some() {
            tm.to_timestamp().map_err(|e| e.to_string())?
        } else {
            let dt = tm.to_datetime().map_err(|e| e.to_string())?;
            let named;
            let tz = match tm.iana_time_zone() {
                Some(name) => {
                    named = TimeZone::get(name).map_err(|e| e.to_string())?;
                    &named
                }
                None => &self.tz,
            };
            tz.to_ambiguous_timestamp(dt)
                .compatible()
                .map_err(|e| e.to_string())?
        };
        Ok(ts.as_millisecond())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::path::Path;

    const HOUR_MS: f64 = 3_600_000.0;
    /// 10/03/2004 18.00.00 UTC (`date -u -d '2004-03-10 18:00' +%s`).
    const T0_MS: f64 = 1_078_941_600_000.0;

    const HEADER: &str = "Date;Time;CO(GT);PT08.S1(CO);T;RH;;";

    fn spec(path: &Path) -> ReplaySpec {
        ReplaySpec {
            path: path.to_path_buf(),
            delimiter: ';',
            decimal_comma: true,
            missing: vec!["-200".to_owned()],
            timestamp_columns: vec!["Date".to_owned(), "Time".to_owned()],
            timestamp_format: "%d/%m/%Y %H.%M.%S".to_owned(),
            timezone: "UTC".to_owned(),
            trace_id: None,
            columns: Vec::new(),
            speed: 0.0,
            max_rows_per_call: 1000,
            repeat: false,
            follow: false,
        }
    }

    /// Writes `lines` joined with `eol` (and a final `eol`) to a temp file.
    fn trace(lines: &[&str], eol: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.csv");
        let mut text = lines.join(eol);
        text.push_str(eol);
        fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// `n` hourly rows from 10/03/2004 18.00.00 with CO = row number.
    fn hourly(n: usize) -> Vec<String> {
        let mut lines = vec![HEADER.to_owned()];
        for k in 0..n {
            let hour = 18 + k;
            let (day, hour) = (10 + hour / 24, hour % 24);
            lines.push(format!(
                "{day:02}/03/2004;{hour:02}.00.00;{k};1000;10,5;50;;"
            ));
        }
        lines
    }

    fn refs(lines: &[String]) -> Vec<&str> {
        lines.iter().map(String::as_str).collect()
    }

    /// Calls `due` with speed-0 semantics until finished.
    fn drain(replay: &mut Replay) -> Vec<Fields> {
        let mut all = Vec::new();
        for _ in 0..100_000 {
            if replay.stats().finished {
                return all;
            }
            let batch = replay.due(Instant::now()).unwrap();
            assert!(batch.len() <= replay.spec.max_rows_per_call);
            all.extend(batch);
        }
        panic!("replay never finished");
    }

    fn num(fields: &Fields, name: &str) -> Option<f64> {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| match v {
                FieldValue::Num(x) => *x,
                other => panic!("{name}: {other:?}"),
            })
    }

    fn names(fields: &Fields) -> Vec<&str> {
        fields.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn ts(fields: &Fields) -> f64 {
        num(fields, TRACE_TS_FIELD).unwrap()
    }

    // ---- pure helpers ----

    #[test]
    fn parse_number_with_decimal_comma() {
        for (text, want) in [
            ("-200", -200.0),
            ("-200,0", -200.0),
            ("2,6", 2.6),
            ("0,7578", 0.7578),
            ("1360", 1360.0),
            ("-1,9", -1.9),
            (" 11,0 ", 11.0),
            ("+3", 3.0),
            (",5", 0.5),
            ("1,5e3", 1500.0),
        ] {
            assert_eq!(parse_number(text, true), Some(want), "{text:?}");
        }
        for bad in [
            "", " ", "2.6", "1.360", "1.360,5", "1,360,5", "NaN", "nan", "inf", "-inf", "infinity",
            "abc", "12a", "-", ",", "1e", "1e999", "0x10", "--1", "1 000", "\"2,6\"",
        ] {
            assert_eq!(parse_number(bad, true), None, "{bad:?}");
        }
    }

    #[test]
    fn parse_number_with_decimal_point() {
        assert_eq!(parse_number("2.6", false), Some(2.6));
        assert_eq!(parse_number("-200", false), Some(-200.0));
        assert_eq!(parse_number("1360", false), Some(1360.0));
        assert_eq!(parse_number("-2.5E-1", false), Some(-0.25));
        for bad in ["2,6", "1,360", "1,360.5", "1.2.3", "NaN", "inf", "1e400"] {
            assert_eq!(parse_number(bad, false), None, "{bad:?}");
        }
    }

    #[test]
    fn sanitize_header_examples() {
        assert_eq!(sanitize_header("CO(GT)"), "co_gt");
        assert_eq!(sanitize_header("PT08.S1(CO)"), "pt08_s1_co");
        assert_eq!(sanitize_header("PT08.S5(O3)"), "pt08_s5_o3");
        assert_eq!(sanitize_header("T"), "t");
        assert_eq!(sanitize_header("  Rel. Humidity [%] "), "rel_humidity");
        assert_eq!(sanitize_header("__a__b__"), "a_b");
        assert_eq!(sanitize_header("Temp°C"), "temp_c");
        assert_eq!(sanitize_header("(%)"), "");
        assert_eq!(sanitize_header(""), "");
    }

    #[test]
    fn split_cells_keeps_empty_cells_and_honours_quotes() {
        let split = |line: &str, d: u8| split_cells(line.as_bytes(), d);
        assert_eq!(split("a;b;;", b';'), ["a", "b", "", ""]);
        assert!(split("", b';').is_empty());
        assert_eq!(split(";;;", b';'), ["", "", "", ""]);
        assert_eq!(split("1,2\t3", b'\t'), ["1,2", "3"]);
        // Quoted cells hold the delimiter; "" is one quote.
        assert_eq!(split("\"x;y\";2", b';'), ["x;y", "2"]);
        assert_eq!(
            split("\"say \"\"hi\"\"\";\"2,6\"", b';'),
            ["say \"hi\"", "2,6"]
        );
        // A quote inside an unquoted cell is a character; an open quote
        // runs to the end of the line. Nothing panics.
        assert_eq!(split("ab\"c;d", b';'), ["ab\"c", "d"]);
        assert_eq!(split("\"", b';'), [""]);
        assert_eq!(split("\"open;still", b';'), ["open;still"]);
        assert_eq!(split("é;ü", b';'), ["é", "ü"]);
        assert_eq!(split_cells(b"\xff;1", b';'), ["\u{fffd}", "1"]);
    }

    #[test]
    fn read_line_handles_crlf_lf_and_last_line() {
        let mut input = &b"a;b\r\nc\n\r\n\nlast"[..];
        let mut buf = Vec::new();
        let mut got = Vec::new();
        loop {
            match read_line(&mut input, &mut buf).unwrap() {
                (LineRead::Eof, n) => {
                    assert_eq!(n, 0);
                    break;
                }
                (r, n) => got.push((r, n, String::from_utf8(buf.clone()).unwrap())),
            }
        }
        let want = [("a;b", 5), ("c", 2), ("", 2), ("", 1), ("last", 4)]
            .map(|(s, n)| (LineRead::Line, n, s.to_owned()));
        assert_eq!(got, want);
    }

    #[test]
    fn read_line_skips_overlong_line_without_keeping_it() {
        let mut data = b"ok\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES * 3));
        data.extend(b"\r\nnext\n");
        let exact = vec![b'y'; MAX_LINE_BYTES];
        data.extend(&exact);
        data.push(b'\n');
        let mut input = io::BufReader::with_capacity(1000, &data[..]);
        let mut buf = Vec::new();
        let long = MAX_LINE_BYTES as u64 * 3 + 2;
        assert_eq!(
            read_line(&mut input, &mut buf).unwrap(),
            (LineRead::Line, 3)
        );
        assert_eq!(buf, b"ok");
        assert_eq!(
            read_line(&mut input, &mut buf).unwrap(),
            (LineRead::TooLong, long)
        );
        assert!(buf.capacity() < MAX_LINE_BYTES * 3, "line kept whole");
        assert_eq!(
            read_line(&mut input, &mut buf).unwrap(),
            (LineRead::Line, 5)
        );
        assert_eq!(buf, b"next");
        let exact_len = MAX_LINE_BYTES as u64 + 1;
        assert_eq!(
            read_line(&mut input, &mut buf).unwrap(),
            (LineRead::Line, exact_len)
        );
        assert_eq!(buf, exact);
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), (LineRead::Eof, 0));
    }

    #[test]
    fn timestamp_format_compile_errors() {
        for good in [
            "%d/%m/%Y %H.%M.%S",
            "%Y-%m-%d",
            "%d%%%m%%%Y",
            "%y-%m-%d",
            "%s",
            "%Y-%m-%dT%H:%M:%S%.f%:z",
            "%Y-%m-%d %H:%M:%S %Q",
        ] {
            assert!(TsFormat::compile(good, "UTC").is_ok(), "{good:?}");
        }
        for bad in [
            "%d/%m/%Y %H:%M:%q",
            "%d/%m/%Y %",
            "%d/%m %H",
            "%H:%M",
            "",
            "  ",
        ] {
            let e = TsFormat::compile(bad, "UTC").unwrap_err();
            println!("{bad:?}: {e}");
            assert!(e.contains("timestamp_format"), "{bad:?}: {e}");
        }
        let e = TsFormat::compile("%Y-%m-%d", "Mars/Olympus").unwrap_err();
        assert!(e.contains("timezone") && e.contains("Mars/Olympus"), "{e}");
    }

    #[test]
    fn timezones_named_fixed_and_utc() {
        assert_eq!(parse_timezone("UTC").unwrap(), TimeZone::UTC);
        assert!(
            parse_timezone("").is_err(),
            "an empty timezone is a mistake, not UTC"
        );
        let plus_one = jiff::tz::Offset::from_seconds(3600).unwrap();
        assert_eq!(parse_timezone("+01:00").unwrap(), TimeZone::fixed(plus_one));
        assert_eq!(parse_timezone("+0100").unwrap(), TimeZone::fixed(plus_one));
        for bad in ["+1h", "-", "Nowhere/Atlantis"] {
            assert!(parse_timezone(bad).is_err(), "{bad:?}");
        }
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "+01:00").unwrap();
        assert_eq!(f.parse_ms("10/03/2004 19.00.00"), Ok(1_078_941_600_000));
        if std::path::Path::new("/usr/share/zoneinfo/Europe/Rome").exists() {
            let rome = TsFormat::compile("%d/%m/%Y %H.%M.%S", "Europe/Rome").unwrap();
            // Winter (CET, +1) and summer (CEST, +2).
            assert_eq!(rome.parse_ms("10/03/2004 19.00.00"), Ok(1_078_941_600_000));
            assert_eq!(rome.parse_ms("10/07/2004 20.00.00"), Ok(1_089_482_400_000));
            // 02:30 does not exist on 27/03/2005: read as 03:30 CEST.
            assert_eq!(
                rome.parse_ms("27/03/2005 02.30.00"),
                rome.parse_ms("27/03/2005 03.30.00")
            );
        } else {
            println!("no zoneinfo for Europe/Rome here; named-zone case skipped");
        }
    }

    #[test]
    fn timestamps_with_fractions_offsets_zones_and_epochs() {
        let iso = TsFormat::compile("%Y-%m-%dT%H:%M:%S%.f%:z", "Europe/Rome");
        let iso = iso
            .or_else(|_| TsFormat::compile("%Y-%m-%dT%H:%M:%S%.f%:z", "UTC"))
            .unwrap();
        // The offset in the text wins over the configured zone.
        assert_eq!(
            iso.parse_ms("2004-03-10T20:00:00.250+02:00"),
            Ok(1_078_941_600_250)
        );
        let epoch = TsFormat::compile("%s", "+05:00").unwrap();
        assert_eq!(epoch.parse_ms("1078941600"), Ok(1_078_941_600_000));
        let bad = iso.parse_ms("2004-03-10T20:00:00").unwrap_err();
        assert!(!bad.is_empty());
    }

    #[test]
    fn timestamp_parses_to_unix_ms() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "UTC").unwrap();
        // Expected values from `date -u -d '...' +%s`.
        for (text, secs) in [
            ("10/03/2004 18.00.00", 1_078_941_600),
            ("04/04/2005 14.00.00", 1_112_623_200),
            ("01/01/1970 00.00.00", 0),
            ("31/12/1969 23.59.59", -1),
            ("29/02/2000 12.34.56", 951_827_696),
            ("01/03/1900 00.00.00", -2_203_891_200),
            ("31/12/2024 23.59.59", 1_735_689_599),
            ("1/1/1970 0.0.1", 1),
        ] {
            assert_eq!(f.parse_ms(text), Ok(secs * 1000), "{text}");
        }
        let iso = TsFormat::compile("%Y-%m-%dT%H:%M:%SZ", "UTC").unwrap();
        assert_eq!(iso.parse_ms("2004-03-10T18:00:00Z"), Ok(1_078_941_600_000));
        let date_only = TsFormat::compile("%Y%m%d", "UTC").unwrap();
        assert_eq!(date_only.parse_ms("20040310"), Ok(1_078_876_800_000));
    }

    #[test]
    fn timestamp_rejects_bad_values_and_literals() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S", "UTC").unwrap();
        for bad in [
            "10/13/2004 18.00.00",     // month 13
            "10/00/2004 18.00.00",     // month 0
            "00/03/2004 18.00.00",     // day 0
            "32/03/2004 18.00.00",     // day 32
            "31/04/2004 18.00.00",     // April has 30
            "29/02/2005 18.00.00",     // not a leap year
            "29/02/1900 18.00.00",     // century, not leap
            "10/03/2004 24.00.00",     // hour 24
            "10/03/2004 18.60.00",     // minute 60
            "10-03-2004 18.00.00",     // wrong literal
            "10/03/2004 18:00:00",     // wrong literal
            "10/03/2004 18.00.00 UTC", // trailing text
            "10/03/2004 18.00.0x",
            "10/03/2004 18.00",
            "10/03/2004",
            "",
            "100/03/2004 18.00.00",
            "1é/03/2004 18.00.00",
        ] {
            assert!(f.parse_ms(bad).is_err(), "{bad:?}");
        }
        assert!(f.parse_ms("29/02/2004 18.00.00").is_ok());
        // jiff's %Y takes 1 to 4 digits: "04" is the year 4 (use %y for
        // two-digit years, which jiff maps to 1969..=2068).
        let y4 = f.parse_ms("10/03/04 18.00.00").unwrap();
        assert!(y4 < -60_000_000_000_000, "{y4}");
        // A space in the format matches any run of whitespace.
        assert!(f.parse_ms("10/03/2004  18.00.00").is_ok());
        // jiff reads a leap second as :59 of the same minute.
        assert_eq!(
            f.parse_ms("10/03/2004 18.00.60"),
            f.parse_ms("10/03/2004 18.00.59")
        );
        assert!(f.parse_ms("29/02/2000 18.00.00").is_ok());
    }

    // ---- open ----

    #[test]
    fn open_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.csv");
        assert!(matches!(
            Replay::open(spec(&missing)),
            Err(SourceError::Io { ref path, .. }) if *path == missing
        ));

        let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
        let mut s = spec(&path);
        s.timestamp_format = "%d/%m/%Y %H.%M.%q".to_owned();
        let e = Replay::open(s).unwrap_err().to_string();
        assert!(e.contains("timestamp_format") && e.contains("%q"), "{e}");

        for change in [
            (|s: &mut ReplaySpec| s.speed = -1.0) as fn(&mut ReplaySpec),
            |s| s.speed = f64::NAN,
            |s| s.speed = f64::INFINITY,
            |s| s.max_rows_per_call = 0,
            |s| s.delimiter = ',',
            |s| s.timestamp_columns.clear(),
            |s| s.columns = vec![("T".into(), "t".into()), ("RH".into(), "t".into())],
            |s| s.columns = vec![("T".into(), TRACE_TS_FIELD.into())],
        ] {
            let mut s = spec(&path);
            change(&mut s);
            assert!(
                matches!(Replay::open(s.clone()), Err(SourceError::Parse { .. })),
                "{s:?}"
            );
        }

        let empty = dir.path().join("empty.csv");
        fs::write(&empty, "").unwrap();
        let e = Replay::open(spec(&empty)).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn check_names_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (key, msg) = check(&spec(&dir.path().join("nope.csv"))).unwrap_err();
        assert_eq!(key, "path");
        assert!(msg.contains("nope.csv"), "{msg}");
        let (_d, path) = trace(&refs(&hourly(1)), "\n");
        assert_eq!(check(&spec(&path)), Ok(()));
        let mut s = spec(&path);
        s.columns = vec![("NO2(GT)".into(), "no2".into())];
        let (key, msg) = check(&s).unwrap_err();
        assert_eq!(key, "columns");
        assert!(
            msg.contains("trace.csv") && msg.contains("NO2(GT)"),
            "{msg}"
        );
        let mut s = spec(&path);
        s.timestamp_columns = vec!["Datum".into()];
        assert_eq!(check(&s).unwrap_err().0, "timestamp_columns");
    }

    #[test]
    fn unknown_column_is_named_with_the_headers() {
        let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
        let mut s = spec(&path);
        s.columns = vec![
            ("T".into(), "temp_c".into()),
            ("NO2(GT)".into(), "no2".into()),
        ];
        match Replay::open(s) {
            Err(SourceError::Parse { what, detail }) => {
                assert_eq!(what, path.display().to_string());
                assert!(detail.contains("\"NO2(GT)\""), "{detail}");
                assert!(detail.contains("\"CO(GT)\", \"PT08.S1(CO)\""), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        let mut s = spec(&path);
        s.timestamp_columns = vec!["Datum".into()];
        let e = Replay::open(s).unwrap_err().to_string();
        assert!(e.contains("\"Datum\""), "{e}");
    }

    // ---- rows and cells ----

    #[test]
    fn default_columns_are_sanitized_headers() {
        let (_d, path) = trace(&refs(&hourly(1)), "\r\n");
        let mut r = Replay::open(spec(&path)).unwrap();
        let rows = drain(&mut r);
        assert_eq!(rows.len(), 1);
        assert_eq!(
            rows[0],
            vec![
                (TRACE_TS_FIELD.to_owned(), FieldValue::Num(T0_MS)),
                ("co_gt".to_owned(), FieldValue::Num(0.0)),
                ("pt08_s1_co".to_owned(), FieldValue::Num(1000.0)),
                ("t".to_owned(), FieldValue::Num(10.5)),
                ("rh".to_owned(), FieldValue::Num(50.0)),
            ]
        );
    }

    #[test]
    fn clashing_or_empty_sanitized_names_are_made_unique() {
        let (_d, path) = trace(
            &[
                "\u{feff}Date;Time;CO(GT);CO GT;(%);trace ts ms",
                "10/03/2004;18.00.00;1;2;3;4",
            ],
            "\n",
        );
        let mut r = Replay::open(spec(&path)).unwrap();
        let rows = drain(&mut r);
        assert_eq!(
            names(&rows[0]),
            ["trace_ts_ms", "co_gt", "co_gt_2", "col_5", "trace_ts_ms_2"]
        );
    }

    #[test]
    fn selected_columns_in_configured_order() {
        let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
        let mut s = spec(&path);
        s.columns = vec![
            ("RH".into(), "rh_pct".into()),
            (" CO(GT) ".into(), "co_mg_m3".into()),
        ];
        let mut r = Replay::open(s).unwrap();
        let rows = drain(&mut r);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[1],
            vec![
                (TRACE_TS_FIELD.to_owned(), FieldValue::Num(T0_MS + HOUR_MS)),
                ("rh_pct".to_owned(), FieldValue::Num(50.0)),
                ("co_mg_m3".to_owned(), FieldValue::Num(1.0)),
            ]
        );
    }

    #[test]
    fn missing_sentinels_and_bad_cells_are_skipped() {
        let (_d, path) = trace(
            &[
                HEADER,
                "10/03/2004;18.00.00;-200;-200;-1,9;50;;", // 2 missing, T negative kept
                "10/03/2004;19.00.00;-200,0;1292; -200 ;-200,00;;", // all missing but PT08
                "10/03/2004;20.00.00;abc;1,2,3;;49;;",     // 2 garbage, 1 empty
                "10/03/2004;21.00.00;-200;-200,0;-200;-200;;", // all missing: row skipped
                "10/03/2004;22.00.00;2,6;-2000;-20;200;;", // near-sentinels are values
                "10/03/2004;23.00.00;1;2",                 // short line: T, RH missing
            ],
            "\r\n",
        );
        let mut s = spec(&path);
        s.missing = vec!["-200".into(), " NA ".into()];
        let mut r = Replay::open(s).unwrap();
        let rows = drain(&mut r);
        let got: Vec<Vec<&str>> = rows.iter().map(names).collect();
        assert_eq!(
            got,
            [
                vec!["trace_ts_ms", "t", "rh"],
                vec!["trace_ts_ms", "pt08_s1_co"],
                vec!["trace_ts_ms", "rh"],
                vec!["trace_ts_ms", "co_gt", "pt08_s1_co", "t", "rh"],
                vec!["trace_ts_ms", "co_gt", "pt08_s1_co"],
            ]
        );
        assert_eq!(num(&rows[0], "t"), Some(-1.9));
        assert_eq!(num(&rows[3], "pt08_s1_co"), Some(-2000.0));
        assert_eq!(num(&rows[3], "t"), Some(-20.0));
        assert_eq!(ts(&rows[3]), T0_MS + 4.0 * HOUR_MS);
        assert_eq!(
            *r.stats(),
            ReplayStats {
                rows_read: 6,
                readings: 5,
                cells_skipped: 2 + 3 + 3 + 4 + 2,
                rows_skipped: 1,
                finished: true,
            }
        );
    }

    #[test]
    fn text_sentinel_matches_after_trim() {
        let (_d, path) = trace(&["Date;Time;A;B", "10/03/2004;18.00.00; NA ;n/a"], "\n");
        let mut s = spec(&path);
        s.missing = vec![" NA".into()];
        let mut r = Replay::open(s).unwrap();
        assert!(drain(&mut r).is_empty());
        // "NA" is a sentinel, "n/a" is garbage: both skipped cells.
        assert_eq!(r.stats().cells_skipped, 2);
        assert_eq!(r.stats().rows_skipped, 1);
    }

    #[test]
    fn separator_rows_bad_timestamps_and_line_endings() {
        // Mixed CRLF / LF, blank lines, separator-only rows, bad and empty
        // timestamps, a final line without newline.
        let text = [
            HEADER,
            "10/03/2004;18.00.00;1;2;3;4;;\r",
            ";;;;;;;\r",
            "",
            "10/03/2004;19.00.00;1;2;3;4;;",
            "31/02/2004;19.00.00;1;2;3;4;;\r",
            ";20.00.00;1;2;3;4;;",
            "10/03/2004;;1;2;3;4;;",
            "10/03/2004;21.00.00",
            "   ;  ;;;;;;",
            "10/03/2004;22.00.00;5;;;;",
        ]
        .join("\n");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        fs::write(&path, text).unwrap();
        let mut r = Replay::open(spec(&path)).unwrap();
        let rows = drain(&mut r);
        let stamps: Vec<f64> = rows.iter().map(ts).collect();
        assert_eq!(stamps, [T0_MS, T0_MS + HOUR_MS, T0_MS + 4.0 * HOUR_MS]);
        assert_eq!(num(&rows[2], "co_gt"), Some(5.0));
        assert_eq!(
            *r.stats(),
            ReplayStats {
                rows_read: 10,
                readings: 3,
                // "21.00.00" row: 4 cells absent; last row: 3 empty cells.
                cells_skipped: 4 + 3,
                rows_skipped: 7,
                finished: true,
            }
        );
        // Finished stays finished.
        assert!(r.due(Instant::now()).unwrap().is_empty());
        assert!(r.stats().finished);
    }

    #[test]
    fn header_only_file_finishes_at_once() {
        let (_d, path) = trace(&[HEADER], "\r\n");
        let mut r = Replay::open(spec(&path)).unwrap();
        assert!(r.due(Instant::now()).unwrap().is_empty());
        assert!(r.stats().finished);
        assert_eq!(r.stats().rows_read, 0);
    }

    #[test]
    fn lines_that_are_not_utf8_do_not_fail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let mut data = format!("{HEADER}\r\n").into_bytes();
        data.extend(b"10/03/2004;18.00.00;\xff\xfe;7;;;;\r\n");
        fs::write(&path, data).unwrap();
        let mut r = Replay::open(spec(&path)).unwrap();
        let rows = drain(&mut r);
        assert_eq!(names(&rows[0]), ["trace_ts_ms", "pt08_s1_co"]);
        assert_eq!(r.stats().cells_skipped, 3);
    }

    // ---- batching, pacing, repeat ----

    #[test]
    fn max_rows_per_call_bounds_each_batch() {
        let (_d, path) = trace(&refs(&hourly(5)), "\r\n");
        let mut s = spec(&path);
        s.max_rows_per_call = 2;
        let mut r = Replay::open(s).unwrap();
        let now = Instant::now();
        let sizes: Vec<usize> = (0..4).map(|_| r.due(now).unwrap().len()).collect();
        // The 3rd call reads the last row and then the end of the file.
        assert_eq!(sizes, [2, 2, 1, 0]);
        assert!(r.stats().finished);
        assert_eq!(r.stats().readings, 5);
    }

    #[test]
    fn speed_paces_rows_against_the_clock() {
        let (_d, path) = trace(&refs(&hourly(6)), "\r\n");
        let mut s = spec(&path);
        s.speed = 3600.0; // one hourly row per second
        let mut r = Replay::open(s).unwrap();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut counts = Vec::new();
        for at in [0, 0, 500, 999, 1000, 1500, 3500, 3999] {
            counts.push(r.due(t0 + ms(at)).unwrap().len());
        }
        assert_eq!(counts, [1, 0, 0, 0, 1, 0, 2, 0]);
        assert!(!r.stats().finished);
        // Far behind: rows 4 and 5 at once, and the end is seen.
        let last = r.due(t0 + ms(60_000)).unwrap();
        assert_eq!(
            last.iter().map(ts).collect::<Vec<_>>(),
            [T0_MS + 4.0 * HOUR_MS, T0_MS + 5.0 * HOUR_MS]
        );
        assert!(r.stats().finished);
        assert_eq!(r.stats().readings, 6);
    }

    #[test]
    fn a_row_due_far_ahead_is_noticed_once_and_plays_when_due() {
        // Row 2 is ten years after row 1: at 60x it is due in ~60 days.
        let mut lines = hourly(1);
        lines.push("10/03/2014;18.00.00;9;1000;10,5;50;;".to_owned());
        let (_d, path) = trace(&refs(&lines), "\n");
        let mut s = spec(&path);
        s.speed = 60.0;
        let mut r = Replay::open(s).unwrap();
        let t0 = Instant::now();
        assert_eq!(r.due(t0).unwrap().len(), 1);
        assert!(r.due(t0 + Duration::from_secs(1)).unwrap().is_empty());
        let waited = r.warned_wait.expect("the long wait was noticed");
        assert!(r.due(t0 + Duration::from_secs(2)).unwrap().is_empty());
        assert_eq!(r.warned_wait, Some(waited), "noticed once per row");
        let later = t0 + Duration::from_secs(61 * 24 * 3600);
        assert_eq!(r.due(later).unwrap().len(), 1);
    }

    #[test]
    fn pacing_catch_up_respects_max_rows_per_call() {
        let (_d, path) = trace(&refs(&hourly(10)), "\n");
        let mut s = spec(&path);
        s.speed = 7200.0; // two rows per second
        s.max_rows_per_call = 3;
        let mut r = Replay::open(s).unwrap();
        let t0 = Instant::now();
        assert_eq!(r.due(t0).unwrap().len(), 1);
        // At 3 s rows 1..=6 are due: 3 now, 3 next, none after.
        let at = t0 + Duration::from_secs(3);
        let sizes: Vec<usize> = (0..3).map(|_| r.due(at).unwrap().len()).collect();
        assert_eq!(sizes, [3, 3, 0]);
        assert_eq!(r.stats().readings, 7);
        // The earliest instant may come before the first call's instant:
        // nothing is due before the start, nothing panics.
        assert!(r.due(t0).unwrap().is_empty());
    }

    #[test]
    fn repeat_without_pacing_continues_the_timeline() {
        let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
        let mut s = spec(&path);
        s.repeat = true;
        let mut r = Replay::open(s).unwrap();
        let now = Instant::now();
        let mut stamps = Vec::new();
        for _ in 0..3 {
            stamps.extend(r.due(now).unwrap().iter().map(ts));
        }
        let want: Vec<f64> = (0..stamps.len())
            .map(|k| T0_MS + HOUR_MS * k as f64)
            .collect();
        assert_eq!(stamps, want);
        // At most one reopen per call: 3 + 3 rows, then 3 per call.
        assert_eq!(stamps.len(), 6 + 3 + 3);
        assert!(!r.stats().finished);
        assert_eq!(r.stats().rows_read, 12);
    }

    #[test]
    fn repeat_with_pacing_is_smooth_across_the_wrap() {
        let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
        let mut s = spec(&path);
        s.speed = 3600.0;
        s.repeat = true;
        let mut r = Replay::open(s).unwrap();
        let t0 = Instant::now();
        let mut seen = Vec::new();
        for sec in 0..8 {
            let batch = r.due(t0 + Duration::from_secs(sec)).unwrap();
            assert_eq!(batch.len(), 1, "at {sec} s");
            seen.push(ts(&batch[0]));
        }
        let want: Vec<f64> = (0..8).map(|k| T0_MS + HOUR_MS * f64::from(k)).collect();
        assert_eq!(seen, want);
        // The field values repeat with the file.
        let again = r.due(t0 + Duration::from_secs(8)).unwrap();
        assert_eq!(num(&again[0], "co_gt"), Some(2.0));
    }

    #[test]
    fn repeat_of_a_file_without_usable_rows_stops() {
        let (_d, path) = trace(
            &[HEADER, ";;;;;;;", "10/03/2004;18.00.00;-200;;;;;"],
            "\r\n",
        );
        let mut s = spec(&path);
        s.repeat = true;
        let mut r = Replay::open(s).unwrap();
        assert!(r.due(Instant::now()).unwrap().is_empty());
        assert!(r.stats().finished);
        assert_eq!(r.stats().rows_skipped, 2);
    }

    #[test]
    fn repeat_refuses_a_changed_header() {
        let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
        let mut s = spec(&path);
        s.repeat = true;
        s.max_rows_per_call = 2;
        let mut r = Replay::open(s).unwrap();
        assert_eq!(r.due(Instant::now()).unwrap().len(), 2);
        fs::write(&path, "Date;Time;T\r\n10/03/2004;18.00.00;1\r\n").unwrap();
        let e = r.due(Instant::now()).unwrap_err().to_string();
        assert!(e.contains("header changed"), "{e}");
        // Still an error on the next call, never a panic.
        assert!(r.due(Instant::now()).is_err());
    }

    #[test]
    fn many_junk_rows_are_spread_over_calls() {
        let mut lines = vec![HEADER.to_owned()];
        lines.extend((0..MAX_SKIPPED_ROWS_PER_CALL + 5).map(|_| ";;;;;;;".to_owned()));
        lines.extend(hourly(1).into_iter().skip(1));
        let (_d, path) = trace(&refs(&lines), "\n");
        let mut r = Replay::open(spec(&path)).unwrap();
        assert!(r.due(Instant::now()).unwrap().is_empty());
        assert!(!r.stats().finished);
        assert_eq!(r.due(Instant::now()).unwrap().len(), 1);
    }

    // ---- quoting, resume, identity ----

    #[test]
    fn a_quoted_header_and_quoted_cells_play() {
        let (_d, path) = trace(
            &[
                "\"Date\";\"Time\";\"CO;GT\";\"T\"",
                "\"10/03/2004\";\"18.00.00\";\"2,6\";\"-1,9\"",
            ],
            "\r\n",
        );
        let mut s = spec(&path);
        s.columns = vec![("CO;GT".into(), "co".into()), ("T".into(), "t".into())];
        let mut r = Replay::open(s).unwrap();
        let rows = drain(&mut r);
        assert_eq!(rows.len(), 1);
        assert_eq!(num(&rows[0], "co"), Some(2.6));
        assert_eq!(num(&rows[0], "t"), Some(-1.9));
        assert_eq!(ts(&rows[0]), T0_MS);
    }

    /// Every (position, trace_ts_ms) of a replay, `per_call` rows a call.
    fn positions(r: &mut Replay, calls: usize) -> Vec<(ReplayPosition, f64)> {
        let mut out = Vec::new();
        for _ in 0..calls {
            for (f, p) in r.due_at(Instant::now()).unwrap() {
                out.push((p, ts(&f)));
            }
        }
        out
    }

    #[test]
    fn resume_continues_after_the_stored_row_with_the_same_identities() {
        let (_d, path) = trace(&refs(&hourly(5)), "\r\n");
        let mut s = spec(&path);
        s.repeat = true;
        s.max_rows_per_call = 2;
        // Uninterrupted: 32 rows over laps 0..=6.
        let whole = positions(&mut Replay::open(s.clone()).unwrap(), 16);
        assert_eq!(whole.len(), 32);
        assert_eq!(whole[31].0.lap, 6);
        assert_eq!(whole[4].0.line, 6);
        assert_eq!(whole[5].0.lap, 1);
        // Stopped after each k rows, resumed from the k-th position.
        for k in 1..10 {
            let mut r = Replay::open(s.clone()).unwrap();
            let done = positions(&mut r, 8);
            let stored = done[k - 1].0.clone();
            let mut again = Replay::open(s.clone()).unwrap();
            let how = again.resume(Some(stored.clone())).unwrap();
            assert_eq!(
                how,
                Resumed::After {
                    lap: stored.lap,
                    line: stored.line
                }
            );
            let rest = positions(&mut again, 8);
            assert_eq!(rest[..], whole[k..k + rest.len()], "after row {k}");
            assert!(rest.len() >= 2);
        }
    }

    #[test]
    fn resume_at_the_end_finishes_and_a_changed_file_is_a_new_trace() {
        let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
        let s = spec(&path);
        let mut r = Replay::open(s.clone()).unwrap();
        let all = positions(&mut r, 2);
        let last = all[2].0.clone();
        let mut again = Replay::open(s.clone()).unwrap();
        again.resume(Some(last.clone())).unwrap();
        assert!(again.due(Instant::now()).unwrap().is_empty());
        assert!(again.stats().finished);

        // One more row: another fingerprint, so another trace from row 1.
        let mut lines = hourly(4);
        lines[1] = lines[1].replace(";0;", ";9;");
        fs::write(&path, refs(&lines).join("\r\n")).unwrap();
        let mut changed = Replay::open(s).unwrap();
        assert_ne!(changed.trace_id(), last.trace_id);
        let how = changed.resume(Some(last.clone())).unwrap();
        assert_eq!(how, Resumed::NewTrace { was: last.trace_id });
        let rows = positions(&mut changed, 2);
        assert_eq!((rows[0].0.lap, rows[0].0.line), (0, 2));
        assert_eq!(rows.len(), 4);
    }

    #[test]
    fn a_configured_trace_id_skips_by_line_and_a_shorter_file_ends_the_lap() {
        let (_d, path) = trace(&refs(&hourly(6)), "\n");
        let mut s = spec(&path);
        s.trace_id = Some("air-2004".into());
        let mut r = Replay::open(s.clone()).unwrap();
        assert_eq!(r.trace_id(), "air-2004");
        let all = positions(&mut r, 2);
        let at4 = all[3].0.clone();
        assert_eq!(at4.line, 5);

        // Same id, other content (CRLF now, so other offsets): by line.
        fs::write(&path, refs(&hourly(6)).join("\r\n")).unwrap();
        let mut again = Replay::open(s.clone()).unwrap();
        let how = again.resume(Some(at4.clone())).unwrap();
        assert_eq!(
            how,
            Resumed::SkippedTo {
                lap: 0,
                line: 5,
                reached: true
            }
        );
        let rest = positions(&mut again, 2);
        assert_eq!(rest.iter().map(|(p, _)| p.line).collect::<Vec<_>>(), [6, 7]);
        assert_eq!(rest[0].1, all[4].1);

        // Shorter than the stored line: that lap has ended.
        fs::write(&path, refs(&hourly(2)).join("\n")).unwrap();
        let mut short = Replay::open(s.clone()).unwrap();
        let how = short.resume(Some(at4.clone())).unwrap();
        assert_eq!(
            how,
            Resumed::SkippedTo {
                lap: 0,
                line: 5,
                reached: false
            }
        );
        assert!(short.due(Instant::now()).unwrap().is_empty());
        assert!(short.stats().finished);
        // With repeat, the next lap starts, from its first row.
        s.repeat = true;
        let mut looped = Replay::open(s).unwrap();
        looped.resume(Some(at4)).unwrap();
        let next = positions(&mut looped, 1);
        assert_eq!((next[0].0.lap, next[0].0.line), (1, 2));
    }

    #[test]
    fn a_followed_trace_waits_at_its_end_and_numbers_segments_across_rotation() {
        let (dir, path) = trace(&refs(&hourly(2)), "\n");
        let mut s = spec(&path);
        s.follow = true;
        let mut r = Replay::open(s.clone()).unwrap();
        assert_eq!(r.trace_id(), format!("path:{}", path.display()));
        let first = positions(&mut r, 2);
        assert_eq!(first.len(), 2);
        assert!(!r.stats().finished, "a followed file has no end");
        let more = hourly(4);
        let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
        std::io::Write::write_all(&mut f, format!("{}\n{}", more[3], &more[4][..5]).as_bytes())
            .unwrap();
        let grown = positions(&mut r, 1);
        assert_eq!(grown.len(), 1, "the incomplete line waits");
        assert_eq!((grown[0].0.lap, grown[0].0.line), (0, 4));
        // Rotated: the rest of the old file, then the new one as segment 1.
        std::io::Write::write_all(&mut f, format!("{}\n", &more[4][5..]).as_bytes()).unwrap();
        fs::rename(&path, dir.path().join("trace.csv.1")).unwrap();
        fs::write(&path, refs(&hourly(1)).join("\n") + "\n").unwrap();
        let after = positions(&mut r, 1);
        let at: Vec<(u64, u64)> = after.iter().map(|(p, _)| (p.lap, p.line)).collect();
        assert_eq!(at, [(0, 5), (1, 2)]);
        // Row 2 of segment 1 and of segment 0 hold the same data, yet their
        // identities differ (segment number, inode and head are all in it).
        assert_eq!(after[1].1, first[0].1);
        assert_ne!(after[1].0.id_trace(), first[0].0.id_trace());
        assert_ne!(after[1].0.segment, first[0].0.segment);

        // Resumed from each stored position, the rest is the same rows.
        let stored = after[0].0.clone();
        let mut again = Replay::open(s.clone()).unwrap();
        let how = again.resume(Some(stored)).unwrap();
        assert_eq!(
            how,
            Resumed::InRotated {
                lap: 0,
                line: 5,
                file: dir.path().join("trace.csv.1")
            }
        );
        let rest = positions(&mut again, 1);
        assert_eq!(rest, after[1..]);
        let mut again = Replay::open(s).unwrap();
        let how = again.resume(Some(after[1].0.clone())).unwrap();
        assert_eq!(how, Resumed::After { lap: 1, line: 2 });
        assert!(positions(&mut again, 1).is_empty());
    }

    #[test]
    fn fingerprint_sees_length_head_and_tail() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let big = vec![b'a'; 300 * 1024];
        fs::write(&p, &big).unwrap();
        let base = fingerprint(&p).unwrap();
        assert_eq!(base.len(), 32);
        assert_eq!(base, fingerprint(&p).unwrap());
        for at in [0, big.len() - 1] {
            let mut other = big.clone();
            other[at] = b'b';
            fs::write(&p, &other).unwrap();
            assert_ne!(fingerprint(&p).unwrap(), base, "byte {at}");
        }
        fs::write(&p, &big[1..]).unwrap();
        assert_ne!(fingerprint(&p).unwrap(), base);
    }

    // ---- the real trace ----

    #[test]
    fn plays_the_uci_air_quality_trace() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/AirQualityUCI.csv");
        let mut s = spec(&path);
        s.missing = vec!["-200".into()];
        let mut r = Replay::open(s).unwrap();
        let rows = drain(&mut r);
        let stats = r.stats().clone();
        println!("AirQualityUCI.csv: {stats:?}");

        // 9357 data rows + 114 separator-only rows, all counted as read.
        assert_eq!(stats.rows_read, 9357 + 114);
        // 31 data rows have all 13 value columns at -200 (25-26/05/2004
        // 19:00-08:00 and 07-08/09/2004 23:00-16:00 except 09:00), so they
        // give no reading.
        assert_eq!(stats.readings, 9357 - 31);
        assert_eq!(rows.len(), 9326);
        assert_eq!(stats.rows_skipped, 114 + 31);
        // Per column (SOURCE.txt): NMHC 8443 + CO 1683 + NO2 1642 + NOx 1639
        // + 9 device columns x 366, the 31 all-missing rows included.
        assert_eq!(stats.cells_skipped, 8443 + 1683 + 1642 + 1639 + 9 * 366);
        assert!(stats.finished);

        let first = &rows[0];
        assert_eq!(
            *first,
            [
                ("trace_ts_ms", T0_MS),
                ("co_gt", 2.6),
                ("pt08_s1_co", 1360.0),
                ("nmhc_gt", 150.0),
                ("c6h6_gt", 11.9),
                ("pt08_s2_nmhc", 1046.0),
                ("nox_gt", 166.0),
                ("pt08_s3_nox", 1056.0),
                ("no2_gt", 113.0),
                ("pt08_s4_no2", 1692.0),
                ("pt08_s5_o3", 1268.0),
                ("t", 13.6),
                ("rh", 48.9),
                ("ah", 0.7578),
            ]
            .map(|(n, v)| (n.to_owned(), FieldValue::Num(v)))
        );
        assert_eq!(ts(&rows[rows.len() - 1]), 1_112_623_200_000.0);
        // Strictly increasing, on the hour, no -200 left anywhere.
        for pair in rows.windows(2) {
            let gap = ts(&pair[1]) - ts(&pair[0]);
            assert!(gap >= HOUR_MS && gap % HOUR_MS == 0.0, "{gap}");
        }
        let values = rows.iter().flat_map(|f| f.iter().skip(1));
        assert!(values.clone().all(|(_, v)| *v != FieldValue::Num(-200.0)));
        let present: usize = rows.iter().map(|f| f.len() - 1).sum();
        assert_eq!(present, 9357 * 13 - 16701);
        let cold = values
            .filter(|(n, v)| n == "t" && matches!(v, FieldValue::Num(x) if *x < 0.0))
            .count();
        assert_eq!(cold, 13);
    }

    #[test]
    fn paces_the_uci_air_quality_trace() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/AirQualityUCI.csv");
        let mut s = spec(&path);
        s.speed = 3600.0;
        s.max_rows_per_call = 1000;
        let mut r = Replay::open(s).unwrap();
        let t0 = Instant::now();
        assert_eq!(r.due(t0).unwrap().len(), 1);
        assert_eq!(r.due(t0 + Duration::from_millis(999)).unwrap().len(), 0);
        assert_eq!(r.due(t0 + Duration::from_secs(1)).unwrap().len(), 1);
        // One simulated day later: 24 more hourly rows (none missing there).
        assert_eq!(r.due(t0 + Duration::from_secs(25)).unwrap().len(), 24);
    }
}
