//! A single number read from a file (sysfs/IIO attribute, 1-Wire
//! `temperature` file, anything that holds one number).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::{excerpt, parse_finite, read_limited, SourceError};
use crate::event::reading::{FieldValue, Fields};

/// One number never needs more; a longer file is the wrong file.
const MAX_FILE_BYTES: usize = 4096;
/// Enough of the bad text to recognise it in a log line.
const SHOWN_BYTES: usize = 64;

pub(super) fn read(
    path: &Path,
    scale: f64,
    offset: f64,
    field: &str,
) -> Result<Fields, SourceError> {
    let io_err = |source| SourceError::Io {
        path: path.to_path_buf(),
        source,
    };
    // O_NONBLOCK: a path misconfigured to a FIFO would otherwise block the
    // open (and the agent) until a writer shows up. Regular and sysfs files
    // ignore the flag.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io_err)?;
    let (bytes, truncated) = read_limited(file, MAX_FILE_BYTES).map_err(io_err)?;
    let parse_err = |detail| SourceError::Parse {
        what: path.display().to_string(),
        detail,
    };
    if truncated {
        return Err(parse_err(format!(
            "file is longer than {MAX_FILE_BYTES} bytes, expected a single number"
        )));
    }
    let value = parse_value(&String::from_utf8_lossy(&bytes), scale, offset).map_err(parse_err)?;
    Ok(vec![(field.to_owned(), FieldValue::Num(value))])
}

/// `raw * scale + offset` of the trimmed text; the error is a one-line detail.
fn parse_value(text: &str, scale: f64, offset: f64) -> Result<f64, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("file is empty, expected a number".to_owned());
    }
    let raw = parse_finite(t)
        .ok_or_else(|| format!("expected a number, got {:?}", excerpt(t, SHOWN_BYTES)))?;
    let value = raw * scale + offset;
    if !value.is_finite() {
        return Err(format!("{raw} * {scale} + {offset} is not a finite number"));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn read_text(text: &[u8], scale: f64, offset: f64) -> Result<Fields, SourceError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("value");
        fs::write(&path, text).unwrap();
        read(&path, scale, offset, "temp_c")
    }

    fn one(fields: Fields) -> f64 {
        match fields.as_slice() {
            [(name, FieldValue::Num(v))] if name == "temp_c" => *v,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn scales_and_offsets() {
        assert_eq!(one(read_text(b"23125\n", 0.001, 0.0).unwrap()), 23.125);
        assert_eq!(one(read_text(b"  42  \n", 1.0, 0.0).unwrap()), 42.0);
        assert_eq!(one(read_text(b"-3.5", 2.0, 1.0).unwrap()), -6.0);
        assert_eq!(one(read_text(b"+7\n", 1.0, -7.0).unwrap()), 0.0);
        assert_eq!(one(read_text(b"0.5\r\n", 10.0, 0.0).unwrap()), 5.0);
    }

    #[test]
    fn garbage_is_a_parse_error_showing_the_text() {
        let err = read_text(b"abc\n", 1.0, 0.0).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, SourceError::Parse { .. }), "{msg}");
        assert!(msg.contains("value") && msg.contains("\"abc\""), "{msg}");
    }

    #[test]
    fn empty_nan_inf_rejected() {
        for bad in [
            &b""[..],
            b"  \n",
            b"NaN\n",
            b"inf",
            b"-infinity",
            b"1 2",
            b"\xff\xfe",
        ] {
            let err = read_text(bad, 1.0, 0.0).unwrap_err();
            assert!(matches!(err, SourceError::Parse { .. }), "{bad:?}: {err}");
        }
    }

    #[test]
    fn overflow_after_scaling_rejected() {
        let err = read_text(b"1e308", 10.0, 0.0).unwrap_err();
        assert!(err.to_string().contains("not a finite number"), "{err}");
    }

    #[test]
    fn long_garbage_is_truncated_in_message() {
        let long = "x".repeat(1000);
        let err = read_text(long.as_bytes(), 1.0, 0.0).unwrap_err();
        let msg = err.to_string();
        assert!(msg.len() < 300, "{msg}");
        assert!(msg.contains('…'), "{msg}");
    }

    #[test]
    fn oversized_file_rejected() {
        let mut text = b"1".to_vec();
        text.extend(std::iter::repeat_n(b' ', MAX_FILE_BYTES));
        let err = read_text(&text, 1.0, 0.0).unwrap_err();
        assert!(err.to_string().contains("longer than 4096"), "{err}");
        // Exactly at the limit is fine.
        text.truncate(MAX_FILE_BYTES);
        assert_eq!(one(read_text(&text, 1.0, 0.0).unwrap()), 1.0);
    }

    #[test]
    fn missing_file_is_io_error_naming_path() {
        let err = read(Path::new("/nonexistent/w1/temperature"), 1.0, 0.0, "t").unwrap_err();
        match &err {
            SourceError::Io { path, .. } => {
                assert_eq!(path, Path::new("/nonexistent/w1/temperature"))
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("/nonexistent/w1/temperature"));
    }

    #[test]
    fn directory_is_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = read(dir.path(), 1.0, 0.0, "t").unwrap_err();
        assert!(matches!(err, SourceError::Io { .. }), "{err}");
    }

    #[test]
    fn fifo_without_writer_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fifo");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read(&path, 1.0, 0.0, "t").unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
    }
}
