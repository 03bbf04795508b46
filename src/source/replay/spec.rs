//! The settings of a replayed trace ([`ReplaySpec`]) and what may be said
//! about them before a row is read: the checks of [`Replay::open`] and of
//! `check-config` ([`check`]).
//!
//! One rule: a setting that cannot work is refused at open (and so by
//! `check-config`), whatever the file holds; it is never found out row by
//! row.

use std::path::PathBuf;

use super::{Replay, TRACE_TS_FIELD};
use crate::source::SourceError;

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
    /// A jiff strftime-style format (see [`TsFormat`](super::TsFormat)),
    /// e.g. `"%d/%m/%Y %H.%M.%S"`, `"%Y-%m-%dT%H:%M:%S%.f%:z"` or `"%s"`.
    pub timestamp_format: String,
    /// Zone that wall-clock timestamps without an offset are read in:
    /// `"UTC"`, an IANA name (`"Europe/Rome"`) or a fixed offset
    /// (`"+01:00"`). See [`parse_timezone`](super::parse_timezone).
    pub timezone: String,
    /// The trace's identity, from which the event ids of its rows derive.
    /// `None`: the file's [`fingerprint`](super::fingerprint), so another
    /// file is another trace.
    pub trace_id: Option<String>,
    /// `(CSV column header, field name)`, in output order. Empty means every
    /// column that is not a timestamp column and has a non-empty header,
    /// named by [`sanitize_header`](super::sanitize_header) (a clash or an
    /// empty result gets a `_2`, `_3`… suffix or a `col_N` name).
    pub columns: Vec<(String, String)>,
    /// Trace seconds per real second (3600 plays an hourly trace at one row
    /// per second); 0 means no pacing, each call takes the next batch.
    pub speed: f64,
    /// Most readings returned by one call (at least 1).
    pub max_rows_per_call: usize,
    /// Start over at the end of the file.
    pub repeat: bool,
    /// Tail the file: wait at its end for more lines, follow rotation and
    /// truncation (see [`crate::source::tail`]). Excludes `repeat`; rows are
    /// played as they are written, so `speed` is 0.
    pub follow: bool,
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
pub(super) fn check_settings(spec: &ReplaySpec) -> Result<(), String> {
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
