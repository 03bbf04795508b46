//! Replay of a recorded CSV trace as readings.
//!
//! A trace file (for example the UCI "Air Quality" recording: `;`-separated,
//! decimal commas, CRLF, `-200` for missing values) is played back row by
//! row, either paced against the clock (`speed` trace seconds per real
//! second) or as fast as the caller asks (`speed == 0`). Each usable row
//! becomes one reading: `trace_ts_ms` first, then the configured columns.
//!
//! The file is streamed line by line through a `BufReader` and is never held
//! whole; a line longer than [`MAX_LINE_BYTES`] is skipped without being
//! buffered, so memory stays flat whatever the file holds.
//!
//! Bad data is never an error: an unusable cell is skipped (and counted), a
//! row without a timestamp or without any usable value is skipped (and
//! counted). Errors are reserved for the file itself (unreadable: `Io`) and
//! for a configuration that does not fit it (`Parse`).
//!
//! Counting rules of [`ReplayStats`]:
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
use std::io::{self, BufRead, BufReader, Read};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::{excerpt, FieldValue, Fields, SourceError};

/// Name of the field carrying the row's timestamp (unix milliseconds, UTC).
pub const TRACE_TS_FIELD: &str = "trace_ts_ms";

/// Longest line kept; a longer one is consumed without being buffered and
/// counted as a skipped row.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

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
    /// Cell separator, e.g. `';'`. Not `'\n'`, `'\r'`, nor `','` together
    /// with `decimal_comma`.
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
    /// Subset of strftime: `%d %m %Y %H %M %S`, `%%` for a percent sign,
    /// every other character literal; e.g. `"%d/%m/%Y %H.%M.%S"`. `%Y`
    /// takes exactly 4 digits, the others 1 or 2. `%d`, `%m` and `%Y` are
    /// required. Interpreted as UTC.
    pub timestamp_format: String,
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
    /// `None` between the end of a pass and the next reopen.
    reader: Option<BufReader<File>>,
    /// Reused line buffer.
    line: Vec<u8>,
    /// Line number in the file of the last line read (header = 1).
    line_no: u64,
    /// A row read but not yet due.
    pending: Option<Row>,
    /// Instant of the first call.
    start: Option<Instant>,
    /// Timestamp (shifted) of the first row of the whole replay.
    first_ts: Option<i64>,
    /// Shift added to the file's timestamps in the current pass.
    offset_ms: i64,
    pass: PassInfo,
    stats: ReplayStats,
}

/// How to turn a line into a reading; fixed at open.
#[derive(Debug)]
struct Plan {
    /// For log lines.
    what: String,
    delimiter: char,
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

/// One usable row: the file's timestamp and the finished reading.
#[derive(Debug)]
struct Row {
    raw_ts: i64,
    ts: i64,
    fields: Fields,
}

/// Timestamps seen in the current pass, to place the next one.
#[derive(Debug, Default)]
struct PassInfo {
    first: Option<i64>,
    prev: Option<i64>,
    max: Option<i64>,
    step: Option<i64>,
}

impl PassInfo {
    fn note(&mut self, ts: i64) {
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

impl Replay {
    /// Opens the trace and reads its header.
    ///
    /// # Errors
    ///
    /// - `Io` if the file cannot be opened or read;
    /// - `Parse` if the file is empty, the header lacks a configured column
    ///   (the detail names it and lists the headers), `timestamp_format` is
    ///   not valid, or a setting is out of range (speed negative or not
    ///   finite, `max_rows_per_call` 0, an unusable delimiter, no timestamp
    ///   column, duplicate field names).
    pub fn open(spec: ReplaySpec) -> Result<Replay, SourceError> {
        let what = spec.path.display().to_string();
        let parse_err = |detail: String| SourceError::Parse {
            what: what.clone(),
            detail,
        };
        check_settings(&spec).map_err(parse_err)?;
        let format = TsFormat::compile(&spec.timestamp_format).map_err(|e| {
            parse_err(format!(
                "bad timestamp_format {:?}: {e}",
                spec.timestamp_format
            ))
        })?;
        let (reader, header) = open_with_header(&spec)?;
        let headers: Vec<&str> = split_line(&header, spec.delimiter)
            .into_iter()
            .map(str::trim)
            .collect();
        let (ts_cols, columns) = resolve_columns(&headers, &spec).map_err(parse_err)?;
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
            delimiter: spec.delimiter,
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
            reader: Some(reader),
            line: Vec::new(),
            line_no: 1,
            pending: None,
            start: None,
            first_ts: None,
            offset_ms: 0,
            pass: PassInfo::default(),
            stats: ReplayStats::default(),
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
        let mut out = Vec::new();
        if self.stats.finished {
            return Ok(out);
        }
        let start = *self.start.get_or_insert(now);
        let limit = self.spec.max_rows_per_call.max(1);
        let mut budget = MAX_SKIPPED_ROWS_PER_CALL;
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
            out.push(row.fields);
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
        match Duration::try_from_secs_f64(real_secs)
            .ok()
            .and_then(|d| start.checked_add(d))
        {
            Some(due_at) => now >= due_at,
            // Beyond what an Instant can hold: never in practice.
            None => false,
        }
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
            let read = read_line(reader, &mut self.line).map_err(|source| SourceError::Io {
                path: self.spec.path.clone(),
                source,
            })?;
            match read {
                LineRead::Eof => self.end_of_pass(),
                LineRead::TooLong => {
                    self.line_no += 1;
                    self.stats.rows_read += 1;
                    self.stats.rows_skipped += 1;
                    *budget -= 1;
                    log::debug!(
                        "{} line {}: longer than {MAX_LINE_BYTES} bytes, skipped",
                        self.plan.what,
                        self.line_no
                    );
                }
                LineRead::Line => {
                    self.line_no += 1;
                    self.stats.rows_read += 1;
                    let text = String::from_utf8_lossy(&self.line);
                    let row =
                        self.plan
                            .parse_row(&text, self.line_no, self.offset_ms, &mut self.stats);
                    match row {
                        Some(row) => {
                            self.pass.note(row.raw_ts);
                            return Ok(Some(row));
                        }
                        None => {
                            self.stats.rows_skipped += 1;
                            *budget -= 1;
                        }
                    }
                }
            }
        }
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
        let (reader, header) = open_with_header(&self.spec)?;
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
        Ok(())
    }
}

impl Plan {
    /// The reading of one line, or `None` if it has none (cells skipped are
    /// counted here, the row by the caller).
    fn parse_row(
        &self,
        line: &str,
        line_no: u64,
        offset_ms: i64,
        stats: &mut ReplayStats,
    ) -> Option<Row> {
        let cells = split_line(line, self.delimiter);
        if cells.iter().all(|c| c.trim().is_empty()) {
            // Blank or separator-only line: nothing to report.
            return None;
        }
        let mut ts_text = String::new();
        for (k, &index) in self.ts_cols.iter().enumerate() {
            let cell = cells.get(index).map_or("", |c| c.trim());
            if cell.is_empty() {
                log::debug!("{} line {line_no}: empty timestamp, row skipped", self.what);
                return None;
            }
            if k > 0 {
                ts_text.push(' ');
            }
            ts_text.push_str(cell);
        }
        let raw_ts = match self.format.parse_ms(&ts_text) {
            Ok(ts) => ts,
            Err(e) => {
                log::debug!(
                    "{} line {line_no}: timestamp {:?}: {e}, row skipped",
                    self.what,
                    excerpt(&ts_text, SHOWN_BYTES)
                );
                return None;
            }
        };
        let ts = raw_ts.saturating_add(offset_ms);
        let mut fields = Vec::with_capacity(self.columns.len() + 1);
        // Unix milliseconds stay far below 2^53, where f64 is exact.
        fields.push((TRACE_TS_FIELD.to_owned(), FieldValue::Num(ts as f64)));
        for col in &self.columns {
            let cell = cells.get(col.index).map_or("", |c| c.trim());
            match self.cell_value(cell) {
                Ok(Some(v)) => fields.push((col.field.clone(), FieldValue::Num(v))),
                Ok(None) => stats.cells_skipped += 1,
                Err(()) => {
                    stats.cells_skipped += 1;
                    log::debug!(
                        "{} line {line_no}: column {:?}: not a number: {:?}",
                        self.what,
                        col.header,
                        excerpt(cell, SHOWN_BYTES)
                    );
                }
            }
        }
        if fields.len() == 1 {
            return None;
        }
        Some(Row { raw_ts, ts, fields })
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
    if matches!(spec.delimiter, '\n' | '\r') {
        return Err(format!("delimiter {:?} cannot be used", spec.delimiter));
    }
    if spec.decimal_comma && spec.delimiter == ',' {
        return Err("delimiter ',' cannot be used with decimal_comma".to_owned());
    }
    if spec.timestamp_columns.is_empty() {
        return Err("timestamp_columns is empty, at least one column is needed".to_owned());
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

/// Opens the trace and reads its header line (BOM, CR and LF removed).
fn open_with_header(spec: &ReplaySpec) -> Result<(BufReader<File>, String), SourceError> {
    let io_err = |source| SourceError::Io {
        path: spec.path.clone(),
        source,
    };
    let parse_err = |detail: &str| SourceError::Parse {
        what: spec.path.display().to_string(),
        detail: detail.to_owned(),
    };
    let mut reader = BufReader::new(File::open(&spec.path).map_err(io_err)?);
    let mut buf = Vec::new();
    match read_line(&mut reader, &mut buf).map_err(io_err)? {
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
    Ok((reader, header))
}

/// Positions of the timestamp cells and the value columns in `headers`
/// (already trimmed).
fn resolve_columns(
    headers: &[&str],
    spec: &ReplaySpec,
) -> Result<(Vec<usize>, Vec<Column>), String> {
    let find = |name: &str| {
        let name = name.trim();
        headers.iter().position(|h| *h == name).ok_or_else(|| {
            let listed: Vec<String> = headers.iter().map(|h| format!("{h:?}")).collect();
            format!(
                "column {name:?} is not in the header (headers: {})",
                excerpt(&listed.join(", "), 16 * SHOWN_BYTES)
            )
        })
    };
    let ts_cols = spec
        .timestamp_columns
        .iter()
        .map(|c| find(c))
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
                header: (*header).to_owned(),
                field,
            });
        }
    } else {
        for (header, field) in &spec.columns {
            columns.push(Column {
                index: find(header)?,
                header: header.trim().to_owned(),
                field: field.clone(),
            });
        }
    }
    Ok((ts_cols, columns))
}

/// Reads one line into `buf` (cleared first), without its `\n` or `\r\n`.
/// A final line without a newline is a line. A line longer than
/// [`MAX_LINE_BYTES`] is consumed up to its newline without being kept.
fn read_line<R: BufRead>(reader: &mut R, buf: &mut Vec<u8>) -> io::Result<LineRead> {
    buf.clear();
    let cap = u64::try_from(MAX_LINE_BYTES)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    let n = reader.by_ref().take(cap).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(LineRead::Eof);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_LINE_BYTES {
        buf.clear();
        skip_past_newline(reader)?;
        return Ok(LineRead::TooLong);
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(LineRead::Line)
}

/// Consumes input up to and including the next `\n` (or to the end).
fn skip_past_newline<R: BufRead>(reader: &mut R) -> io::Result<()> {
    loop {
        let (found, used) = {
            let avail = reader.fill_buf()?;
            if avail.is_empty() {
                return Ok(());
            }
            match avail.iter().position(|&b| b == b'\n') {
                Some(pos) => (true, pos + 1),
                None => (false, avail.len()),
            }
        };
        reader.consume(used);
        if found {
            return Ok(());
        }
    }
}

/// Splits a line into its cells. No quoting: a `"` is an ordinary
/// character, so a quoted cell holding the delimiter is split (and its parts
/// then fail to parse as numbers).
pub fn split_line(line: &str, delimiter: char) -> Vec<&str> {
    line.split(delimiter).collect()
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

/// One piece of a compiled timestamp format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TsPart {
    Day,
    Month,
    Year,
    Hour,
    Minute,
    Second,
    Lit(char),
}

/// A compiled `timestamp_format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TsFormat {
    parts: Vec<TsPart>,
}

impl TsFormat {
    /// Compiles a format: `%d %m %Y %H %M %S`, `%%`, other characters
    /// literal. `%d`, `%m`, `%Y` must each appear once; `%H`, `%M`, `%S` at
    /// most once (absent ones are 0).
    ///
    /// # Errors
    ///
    /// A one-line reason: unknown directive, `%` at the end, a directive
    /// missing or repeated.
    pub fn compile(format: &str) -> Result<TsFormat, String> {
        let mut parts = Vec::new();
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                parts.push(TsPart::Lit(c));
                continue;
            }
            let part = match chars.next() {
                Some('d') => TsPart::Day,
                Some('m') => TsPart::Month,
                Some('Y') => TsPart::Year,
                Some('H') => TsPart::Hour,
                Some('M') => TsPart::Minute,
                Some('S') => TsPart::Second,
                Some('%') => TsPart::Lit('%'),
                Some(other) => {
                    return Err(format!(
                        "unsupported directive %{other} (supported: %d %m %Y %H %M %S %%)"
                    ))
                }
                None => return Err("lone % at the end".to_owned()),
            };
            parts.push(part);
        }
        for (part, name, required) in [
            (TsPart::Day, "%d", true),
            (TsPart::Month, "%m", true),
            (TsPart::Year, "%Y", true),
            (TsPart::Hour, "%H", false),
            (TsPart::Minute, "%M", false),
            (TsPart::Second, "%S", false),
        ] {
            let count = parts.iter().filter(|p| **p == part).count();
            if count > 1 {
                return Err(format!("{name} appears {count} times"));
            }
            if required && count == 0 {
                return Err(format!("{name} is missing"));
            }
        }
        Ok(TsFormat { parts })
    }

    /// Unix milliseconds of `text`, read as UTC. The whole text must match.
    ///
    /// # Errors
    ///
    /// A one-line reason: a literal not matching, digits missing, trailing
    /// text, or a field out of range (month 1–12, day within the month,
    /// leap years included, hour 0–23, minute and second 0–59).
    pub fn parse_ms(&self, text: &str) -> Result<i64, String> {
        let b = text.as_bytes();
        let mut i = 0;
        let (mut year, mut month, mut day) = (None, None, None);
        let (mut hour, mut minute, mut second) = (0, 0, 0);
        for part in &self.parts {
            let (min_len, max_len) = match part {
                TsPart::Lit(c) => {
                    let mut enc = [0u8; 4];
                    let lit = c.encode_utf8(&mut enc).as_bytes();
                    if b.get(i..i + lit.len()) != Some(lit) {
                        return Err(format!("expected {c:?} at position {i}"));
                    }
                    i += lit.len();
                    continue;
                }
                TsPart::Year => (4, 4),
                _ => (1, 2),
            };
            let mut value: i64 = 0;
            let mut len = 0;
            while len < max_len {
                match b.get(i) {
                    Some(d) if d.is_ascii_digit() => {
                        value = value * 10 + i64::from(d - b'0');
                        i += 1;
                        len += 1;
                    }
                    _ => break,
                }
            }
            if len < min_len {
                return Err(format!("expected {min_len} digit(s) at position {i}"));
            }
            match part {
                TsPart::Day => day = Some(value),
                TsPart::Month => month = Some(value),
                TsPart::Year => year = Some(value),
                TsPart::Hour => hour = value,
                TsPart::Minute => minute = value,
                TsPart::Second => second = value,
                TsPart::Lit(_) => {}
            }
        }
        if i != b.len() {
            return Err(format!("unexpected text at position {i}"));
        }
        let (Some(year), Some(month), Some(day)) = (year, month, day) else {
            return Err("format lacks a date".to_owned());
        };
        if !(1..=12).contains(&month) {
            return Err(format!("month {month} out of range"));
        }
        if day < 1 || day > days_in_month(year, month) {
            return Err(format!("day {day} out of range for {year}-{month:02}"));
        }
        if hour > 23 {
            return Err(format!("hour {hour} out of range"));
        }
        if minute > 59 {
            return Err(format!("minute {minute} out of range"));
        }
        if second > 59 {
            return Err(format!("second {second} out of range"));
        }
        let days = days_since_epoch(year, month, day);
        Ok(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000)
    }
}

fn is_leap_year(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

/// Days in `month` (1–12) of `year`.
fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap_year(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Leap years among years 1..=`year` (proleptic Gregorian; extends
/// consistently below 1 thanks to floor division).
fn leap_years_through(year: i64) -> i64 {
    year.div_euclid(4) - year.div_euclid(100) + year.div_euclid(400)
}

/// Days from 1970-01-01 to the given valid date (negative before).
fn days_since_epoch(year: i64, month: i64, day: i64) -> i64 {
    const BEFORE_MONTH: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let year_days = 365 * (year - 1970) + leap_years_through(year - 1) - leap_years_through(1969);
    let month_index = usize::try_from(month - 1).unwrap_or(0).min(11);
    let leap_day = i64::from(month > 2 && is_leap_year(year));
    year_days + BEFORE_MONTH[month_index] + leap_day + day - 1
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
            columns: Vec::new(),
            speed: 0.0,
            max_rows_per_call: 1000,
            repeat: false,
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
    fn split_line_keeps_empty_cells_and_ignores_quotes() {
        assert_eq!(split_line("a;b;;", ';'), ["a", "b", "", ""]);
        assert_eq!(split_line("", ';'), [""]);
        assert_eq!(split_line(";;;", ';'), ["", "", "", ""]);
        assert_eq!(split_line("1,2\t3", '\t'), ["1,2", "3"]);
        // No quoting: a quoted delimiter splits, and nothing panics.
        assert_eq!(split_line("\"x;y\";2", ';'), ["\"x", "y\"", "2"]);
        assert_eq!(split_line("\"", ';'), ["\""]);
        assert_eq!(split_line("é;ü", ';'), ["é", "ü"]);
    }

    #[test]
    fn read_line_handles_crlf_lf_and_last_line() {
        let mut input = &b"a;b\r\nc\n\r\n\nlast"[..];
        let mut buf = Vec::new();
        let mut got = Vec::new();
        loop {
            match read_line(&mut input, &mut buf).unwrap() {
                LineRead::Eof => break,
                r => got.push((r, String::from_utf8(buf.clone()).unwrap())),
            }
        }
        let want = ["a;b", "c", "", "", "last"].map(|s| (LineRead::Line, s.to_owned()));
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
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), LineRead::Line);
        assert_eq!(buf, b"ok");
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), LineRead::TooLong);
        assert!(buf.capacity() < MAX_LINE_BYTES * 3, "line kept whole");
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), LineRead::Line);
        assert_eq!(buf, b"next");
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), LineRead::Line);
        assert_eq!(buf, exact);
        assert_eq!(read_line(&mut input, &mut buf).unwrap(), LineRead::Eof);
    }

    #[test]
    fn timestamp_format_compile_errors() {
        let f = "%d/%m/%Y %H.%M.%S";
        assert!(TsFormat::compile(f).is_ok());
        assert!(TsFormat::compile("%Y-%m-%d").is_ok());
        assert!(TsFormat::compile("%d%%%m%%%Y").is_ok());
        for (bad, why) in [
            ("%d/%m/%Y %H:%M:%q", "%q"),
            ("%d/%m/%Y %", "lone %"),
            ("%d/%m %H", "%Y is missing"),
            ("%d/%m/%Y %d", "%d appears 2 times"),
            ("", "%d is missing"),
            ("%y-%m-%d", "%y"),
        ] {
            let e = TsFormat::compile(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn timestamp_parses_to_unix_ms() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S").unwrap();
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
        let iso = TsFormat::compile("%Y-%m-%dT%H:%M:%SZ").unwrap();
        assert_eq!(iso.parse_ms("2004-03-10T18:00:00Z"), Ok(1_078_941_600_000));
        let date_only = TsFormat::compile("%Y%m%d").unwrap();
        assert_eq!(date_only.parse_ms("20040310"), Ok(1_078_876_800_000));
    }

    #[test]
    fn timestamp_rejects_bad_values_and_literals() {
        let f = TsFormat::compile("%d/%m/%Y %H.%M.%S").unwrap();
        for bad in [
            "10/13/2004 18.00.00", // month 13
            "10/00/2004 18.00.00", // month 0
            "00/03/2004 18.00.00", // day 0
            "32/03/2004 18.00.00", // day 32
            "31/04/2004 18.00.00", // April has 30
            "29/02/2005 18.00.00", // not a leap year
            "29/02/1900 18.00.00", // century, not leap
            "10/03/2004 24.00.00", // hour 24
            "10/03/2004 18.60.00", // minute 60
            "10/03/2004 18.00.60", // second 60
            "10-03-2004 18.00.00", // wrong literal
            "10/03/2004 18:00:00", // wrong literal
            "10/03/2004  18.00.00",
            "10/03/04 18.00.00",       // year needs 4 digits
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
        assert!(f.parse_ms("29/02/2000 18.00.00").is_ok());
    }

    #[test]
    fn civil_days_are_consecutive() {
        // Independent of any reference: walking day by day from 1600 to
        // 2400 must add exactly one day each time.
        let mut prev = days_since_epoch(1600, 1, 1) - 1;
        for year in 1600..=2400 {
            for month in 1..=12 {
                for day in 1..=days_in_month(year, month) {
                    let d = days_since_epoch(year, month, day);
                    assert_eq!(d, prev + 1, "{year}-{month}-{day}");
                    prev = d;
                }
            }
        }
        assert_eq!(days_since_epoch(1970, 1, 1), 0);
        assert_eq!(days_since_epoch(2000, 3, 1), 11_017);
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
        s.timestamp_format = "%d/%m/%Y %H.%M.%Q".to_owned();
        let e = Replay::open(s).unwrap_err().to_string();
        assert!(e.contains("timestamp_format") && e.contains("%Q"), "{e}");

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

    // ---- the real trace ----

    #[test]
    fn plays_the_uci_air_quality_trace() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/AirQualityUCI.csv");
        if !path.exists() {
            println!("skipped: {} not found", path.display());
            return;
        }
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
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/AirQualityUCI.csv");
        if !path.exists() {
            println!("skipped: {} not found", path.display());
            return;
        }
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
