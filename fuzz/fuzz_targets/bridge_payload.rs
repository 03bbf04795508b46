//! A message from the local broker: `source::bridge::decode`, which the
//! mqtt source calls on every PUBLISH before anything is stored.
//!
//! Input: one settings byte (bits 0-1: payload json / number / auto; bit 2:
//! `id_field = "id"`; bit 3: a 64-byte `max_payload_bytes` instead of
//! 64 KiB), the topic up to the first 0 byte, then the payload bytes.
//! Without a 0 byte the whole rest is the payload on topic `plant/x`.
//!
//! Bounds asserted: decoding returns or refuses, nothing else, and does so
//! the same way twice; a payload over the limit is always refused; a reading
//! starts with `source_topic` = the topic, has at least one field of its
//! own, unique non-empty names of at most 256 bytes, finite numbers only,
//! a key only when `id_field` is set (1..=256 bytes); and its envelope
//! encodes in both wire formats.
#![no_main]

use edgespool::event::envelope::{self, Envelope, EventId, Format};
use edgespool::event::reading::FieldValue;
use edgespool::source::bridge::payload::{MAX_KEY_BYTES, MAX_NAME_BYTES};
use edgespool::source::bridge::{
    decode, PayloadError, PayloadFormat, PayloadSettings, TOPIC_FIELD,
};
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (topic, payload) = match rest.iter().position(|b| *b == 0) {
        Some(i) => (
            String::from_utf8_lossy(&rest[..i]).into_owned(),
            &rest[i + 1..],
        ),
        None => ("plant/x".to_owned(), rest),
    };
    let settings = PayloadSettings {
        format: match flags & 3 {
            0 => PayloadFormat::Json,
            1 => PayloadFormat::Number,
            _ => PayloadFormat::Auto,
        },
        max_payload_bytes: if flags & 8 != 0 { 64 } else { 64 * 1024 },
        id_field: (flags & 4 != 0).then(|| "id".to_owned()),
    };
    let got = decode(&topic, payload, &settings);
    assert_eq!(got, decode(&topic, payload, &settings), "not deterministic");
    if payload.len() > settings.max_payload_bytes {
        assert!(matches!(got, Err(PayloadError::TooLarge { .. })), "{got:?}");
    }
    let Ok(d) = got else {
        return;
    };
    assert_eq!(
        d.fields.first(),
        Some(&(TOPIC_FIELD.to_owned(), FieldValue::Text(topic.clone())))
    );
    assert!(d.fields.len() >= 2, "a reading with no field of its own");
    let mut names = HashSet::new();
    for (name, value) in &d.fields {
        assert!(
            !name.is_empty() && name.len() <= MAX_NAME_BYTES,
            "name {name:?}"
        );
        // The ingest socket's field-name rule: no NUL, newline or space.
        assert!(
            name == TOPIC_FIELD || edgespool::event::reading::field_name_ok(name, MAX_NAME_BYTES),
            "name {name:?}"
        );
        assert!(names.insert(name.as_str()), "{name:?} twice");
        if let FieldValue::Num(v) = value {
            assert!(v.is_finite(), "{name} = {v}");
        }
    }
    match (&d.key, &settings.id_field) {
        (Some(k), Some(_)) => assert!(!k.is_empty() && k.len() <= MAX_KEY_BYTES),
        (Some(k), None) => panic!("key {k:?} without id_field"),
        (None, _) => {}
    }
    let env = Envelope {
        event_id: EventId([7; 16]),
        device_id: "fuzz-board",
        stream: "plant",
        seq: 1,
        ts_ms: 0,
        clock_trusted: true,
        mono: None,
        fields: &d.fields,
    };
    for format in [Format::Json, Format::Postcard] {
        envelope::encode(format, &env).expect("a decoded reading encodes");
    }
});
