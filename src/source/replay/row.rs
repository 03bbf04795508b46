//! One line of a trace into one reading: the plan fixed at open (which
//! cell is the timestamp, which column becomes which field, the sentinels)
//! and the parsing of cells, numbers and header names.
//!
//! One rule: bad data is never an error. A missing or unparseable cell is
//! skipped and counted; a row without a timestamp, or without any usable
//! value, gives no reading; errors are kept for a configuration the header
//! does not fit.

use super::spec::ReplaySpec;
use super::timestamp::TsFormat;
use super::{ReplayStats, SHOWN_BYTES, TRACE_TS_FIELD};
use crate::event::reading::{FieldValue, Fields};
use crate::source::excerpt;

/// How to turn a line into a reading; fixed at open.
#[derive(Debug)]
pub(super) struct Plan {
    /// The file, for log lines.
    pub(super) what: String,
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

impl Plan {
    /// The plan for a file whose header line is `header`: the positions of
    /// the timestamp cells and of the value columns, and the sentinels.
    ///
    /// # Errors
    ///
    /// A configured column the header lacks; the message starts with the
    /// key at fault (`timestamp_columns:` or `columns:`) and lists the
    /// headers.
    pub(super) fn new(spec: &ReplaySpec, format: TsFormat, header: &str) -> Result<Plan, String> {
        let delimiter = spec.delimiter as u8;
        let headers: Vec<String> = split_cells(header.as_bytes(), delimiter)
            .into_iter()
            .map(|h| h.trim().to_owned())
            .collect();
        let (ts_cols, columns) = resolve_columns(&headers, spec)?;
        let sentinels = spec
            .missing
            .iter()
            .map(|s| {
                let s = s.trim();
                (s.to_owned(), parse_number(s, spec.decimal_comma))
            })
            .collect();
        Ok(Plan {
            what: spec.path.display().to_string(),
            delimiter,
            decimal_comma: spec.decimal_comma,
            format,
            ts_cols,
            columns,
            sentinels,
        })
    }

    /// The file timestamp and reading of one line: `Ok(None)` if it has
    /// none (cells skipped are counted here, the row by the caller),
    /// `Err(())` if its timestamp does not parse (logged, at warn level if
    /// `warn`, else at debug).
    pub(super) fn parse_row(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
