//! The trace file a line at a time: opening it with its header line, and
//! reading each next line into a reused buffer, CR LF or LF, with the bytes
//! it took (the offsets of stored positions are made of these).
//!
//! One rule: memory stays flat whatever the file holds. A line longer than
//! [`MAX_LINE_BYTES`] is consumed up to its newline without being kept.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

use crate::source::tail::MAX_LINE_BYTES;
use crate::source::SourceError;

/// What reading one line gave.
#[derive(Debug, PartialEq)]
pub(super) enum LineRead {
    /// A line is in the buffer, without its `\n` or `\r\n`.
    Line,
    /// The line was longer than the limit and has been skipped.
    TooLong,
    /// Nothing left.
    Eof,
}

/// Opens the trace and reads its header line (BOM, CR and LF removed),
/// with the bytes it took.
pub(super) fn open_with_header(path: &Path) -> Result<(BufReader<File>, String, u64), SourceError> {
    let io_err = |source| SourceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let parse_err = |detail: &str| SourceError::Parse {
        what: path.display().to_string(),
        detail: detail.to_owned(),
    };
    // A FIFO would block the open, /dev/zero would be read for ever.
    if !std::fs::metadata(path).map_err(io_err)?.is_file() {
        return Err(parse_err("not a regular file"));
    }
    let mut reader = BufReader::new(File::open(path).map_err(io_err)?);
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

/// Reads one line into `buf` (cleared first), without its `\n` or `\r\n`,
/// and returns it with the bytes consumed (end of line included). A final
/// line without a newline is a line. A line longer than [`MAX_LINE_BYTES`]
/// is consumed up to its newline without being kept.
pub(super) fn read_line<R: BufRead>(
    reader: &mut R,
    buf: &mut Vec<u8>,
) -> io::Result<(LineRead, u64)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
