//! A replayed CSV trace through `Replay::open` and `Replay::due_at`, the
//! calls the agent's sampler makes: the header, every row, its cells and its
//! timestamp, as the agent reads them (the file streamed line by line).
//!
//! Input: one byte of settings (delimiter, decimal comma, timestamp layout,
//! repeat), then the file's bytes, written to a file in a temporary directory
//! created once per fuzzing process.
//!
//! Bounds asserted:
//! - every reading starts with `trace_ts_ms` and holds only finite numbers
//!   (a non-finite number cannot be encoded as JSON, and the whole reading
//!   would be dropped at append);
//! - no call returns more than `max_rows_per_call` readings;
//! - positions move forward (lap, line) and lines never pass the file's;
//! - the counting rule of the module doc: `rows_read == readings +
//!   rows_skipped` (no pacing, so no row is held back);
//! - a bounded number of calls ends a trace that does not repeat.
#![no_main]

use edgespool::event::reading::FieldValue;
use edgespool::source::replay::{Replay, ReplaySpec, TRACE_TS_FIELD};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Instant;

const MAX_ROWS_PER_CALL: usize = 16;

fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        // Memory-backed when the machine has it: a file is written per input.
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .expect("temporary directory")
    })
    .path()
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let path = dir().join("trace.csv");
    std::fs::write(&path, body).expect("write the trace");
    let delimiter = [';', ',', '\t', '|'][usize::from(flags & 3)];
    let decimal_comma = flags & 4 != 0 && delimiter != ',';
    let (ts_cols, format, tz): (&[&str], &str, &str) = match (flags >> 3) & 3 {
        0 => (&["Date", "Time"], "%d/%m/%Y %H.%M.%S", "Europe/Rome"),
        1 => (&["ts"], "%s", "UTC"),
        2 => (&["time"], "%Y-%m-%dT%H:%M:%S%.f%:z", "UTC"),
        _ => (&["time"], "%Y-%m-%d %H:%M:%S", "+05:30"),
    };
    let columns = if flags & 0x20 != 0 {
        vec![
            ("CO(GT)".to_owned(), "co".to_owned()),
            ("T".to_owned(), "t".to_owned()),
        ]
    } else {
        Vec::new()
    };
    let repeat = flags & 0x40 != 0;
    let spec = ReplaySpec {
        path,
        delimiter,
        decimal_comma,
        missing: vec!["-200".to_owned()],
        timestamp_columns: ts_cols.iter().map(|s| (*s).to_owned()).collect(),
        timestamp_format: format.to_owned(),
        timezone: tz.to_owned(),
        trace_id: (flags & 0x80 != 0).then(|| "fuzz-trace".to_owned()),
        columns,
        speed: 0.0,
        max_rows_per_call: MAX_ROWS_PER_CALL,
        repeat,
        follow: false,
    };
    let Ok(mut replay) = Replay::open(spec) else {
        return;
    };
    let lines = body.iter().filter(|b| **b == b'\n').count() as u64 + 1;
    let mut last: Option<(u64, u64)> = None;
    let mut readings = 0u64;
    let now = Instant::now();
    // A trace of n lines ends within n / 10000 + n / 16 + 2 calls (the skip
    // budget is 10000 rows a call); 64 calls cover every input here.
    for _ in 0..64 {
        let rows = replay.due_at(now).expect("a readable file gives no error");
        assert!(rows.len() <= MAX_ROWS_PER_CALL);
        for (fields, pos) in &rows {
            assert_eq!(fields.first().map(|f| f.0.as_str()), Some(TRACE_TS_FIELD));
            assert!(fields.len() >= 2, "a reading with no value");
            for (name, v) in fields {
                if let FieldValue::Num(n) = v {
                    assert!(n.is_finite(), "{name}: {n}");
                }
            }
            assert!(
                pos.line >= 2 && pos.line <= lines,
                "line {} of {lines}",
                pos.line
            );
            assert!(pos.offset <= body.len() as u64, "offset {}", pos.offset);
            let here = (pos.lap, pos.line);
            assert!(last.is_none_or(|l| here > l), "{here:?} after {last:?}");
            last = Some(here);
        }
        readings += rows.len() as u64;
        let s = replay.stats();
        assert_eq!(s.readings, readings);
        assert_eq!(s.rows_read, s.readings + s.rows_skipped, "{s:?}");
        if s.finished {
            return;
        }
    }
    assert!(
        repeat,
        "a trace that does not repeat did not end: {:?}",
        replay.stats()
    );
});
