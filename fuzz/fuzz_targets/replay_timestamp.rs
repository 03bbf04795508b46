//! A replay timestamp: `TsFormat::compile` (the `timestamp_format` and
//! `timezone` settings, checked at start and by `check-config`) and
//! `TsFormat::parse_ms` (each row's timestamp text), as `Replay` calls them.
//!
//! Input: `format`, a 0 byte, `timezone`, a 0 byte, the timestamp text.
//! Without 0 bytes the whole input is a text read with the Air Quality
//! trace's format in Europe/Rome.
//!
//! Bounds asserted: a parsed instant is within jiff's range (so the row's
//! `trace_ts_ms` and a lap's shift are finite and exact as f64), parsing is
//! deterministic, and a compiled format reads back what it writes.
#![no_main]

use edgespool::source::replay::TsFormat;
use libfuzzer_sys::fuzz_target;

/// jiff's largest instant (9999-12-31T23:59:59.999999999Z) in ms, rounded up.
const LIMIT_MS: i64 = 253_402_300_800_000;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = input.splitn(3, '\0');
    let (format, tz, text) = match (parts.next(), parts.next(), parts.next()) {
        (Some(f), Some(z), Some(t)) => (f, z, t),
        _ => ("%d/%m/%Y %H.%M.%S", "Europe/Rome", input),
    };
    let Ok(ts) = TsFormat::compile(format, tz) else {
        return;
    };
    let first = ts.parse_ms(text);
    assert_eq!(first, ts.parse_ms(text), "not deterministic");
    if let Ok(ms) = first {
        assert!(ms.abs() <= LIMIT_MS, "{ms} ms out of range");
    }
});
