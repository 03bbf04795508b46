//! Envelope decoding in the sink: `sink::envelope_identity`, which
//! `SinkDb::store` calls on every delivery (JSON first, else postcard).
//!
//! Input: the delivered payload bytes. The same bytes also seed an envelope
//! that is encoded both ways with `envelope::encode` (what the agent does at
//! append) and decoded back.
//!
//! Bounds asserted: decoding arbitrary bytes returns or refuses, nothing
//! else; an event id read from JSON is the text that was there; an envelope
//! the agent encodes is always readable by the sink, with its event id and
//! reading time.
#![no_main]

use edgespool::event::envelope::{self, Envelope, EventId, Format};
use edgespool::event::reading::{FieldValue, Fields};
use edgespool::sink::envelope_identity;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some((id, _ts)) = envelope_identity(data) {
        assert!(
            id.len() <= data.len().max(36),
            "event id longer than the payload"
        );
    }
    // An envelope built from the bytes: the first 16 are the id, the next 8
    // the time, the rest split into fields at 0 bytes (text, a number or a
    // boolean by the first byte of each piece).
    let mut id = [0u8; 16];
    let n = data.len().min(16);
    id[..n].copy_from_slice(&data[..n]);
    let mut ts = [0u8; 8];
    let rest = data.get(16..).unwrap_or_default();
    let m = rest.len().min(8);
    ts[..m].copy_from_slice(&rest[..m]);
    let ts_ms = i64::from_le_bytes(ts);
    let mut fields: Fields = Vec::new();
    for (i, piece) in rest
        .get(8..)
        .unwrap_or_default()
        .split(|b| *b == 0)
        .enumerate()
    {
        let name = format!("f{i}");
        let value = match piece.first() {
            Some(b'n') if piece.len() >= 9 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&piece[1..9]);
                let v = f64::from_le_bytes(b);
                if !v.is_finite() {
                    continue; // sources never produce one
                }
                FieldValue::Num(v)
            }
            Some(b'b') => FieldValue::Bool(piece.len() % 2 == 0),
            _ => FieldValue::Text(String::from_utf8_lossy(piece).into_owned()),
        };
        fields.push((name, value));
    }
    let env = Envelope {
        event_id: EventId(id),
        device_id: "fuzz-board",
        stream: "s",
        seq: 1,
        ts_ms,
        clock_trusted: true,
        mono: None,
        fields: &fields,
    };
    for format in [Format::Json, Format::Postcard] {
        let bytes = envelope::encode(format, &env).expect("finite fields encode");
        let got = envelope_identity(&bytes);
        assert_eq!(
            got,
            Some((EventId(id).hyphenated(), Some(ts_ms))),
            "{format:?} envelope unreadable by the sink"
        );
    }
});
