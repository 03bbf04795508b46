//! One request line of the ingest socket, as the connection reader hands
//! it to `ingest::parse_request` (the line without its `\n`; the listener
//! bounds its length at `ingest.max_line_bytes`, here libFuzzer's -max_len).
//!
//! Input: the line's bytes.
//!
//! Bounds asserted, for a line that parses:
//! - the stream is one the config allows (declared, or matching a pattern),
//!   follows the name rule and is never an agent stream (`_...`);
//! - 1..=max_fields fields, names unique and 1..=64 safe characters,
//!   numbers finite, strings at most 1024 bytes;
//! - the key is 1..=128 printable ASCII bytes; ts_ms is in range, or the
//!   `now` given when the line has none;
//! - the request written back as a line parses to the same request.
//!
//! For a line that is refused: the reply line is one JSON object on one line.
#![no_main]

use edgespool::event::reading::FieldValue;
use edgespool::event::stream::{Durability, StreamSettings};
use edgespool::ingest::request::{error_line, MAX_KEY_BYTES, MAX_TEXT_BYTES, MAX_TS_MS};
use edgespool::ingest::{parse_request, Request};
use edgespool::ingest::{IngestConfig, IngestStream};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const NOW: (i64, bool) = (1_800_000_000_000, true);

fn config() -> IngestConfig {
    IngestConfig {
        socket: Some("/run/edgespool/ingest.sock".into()),
        streams: vec![IngestStream {
            name: "pump".into(),
            settings: StreamSettings {
                durability: Durability::Full,
                priority: 3,
                live_first: false,
                batch: None,
            },
        }],
        stream_patterns: vec!["plant.*".into()],
        max_fields: 8,
        ..IngestConfig::default()
    }
}

fuzz_target!(|data: &[u8]| {
    let cfg = config();
    match parse_request(data, &cfg, NOW) {
        Ok(req) => {
            check(&req, &cfg, data);
            let again = parse_request(line_of(&req).as_bytes(), &cfg, NOW)
                .unwrap_or_else(|e| panic!("written-back request refused: {e}\n{}", line_of(&req)));
            assert_eq!(again, req, "written back: {}", line_of(&req));
        }
        Err(e) => {
            let line = error_line(&e.to_string());
            assert!(
                line.ends_with('\n') && line.matches('\n').count() == 1,
                "{line:?}"
            );
            let v: Value = serde_json::from_str(&line).expect("the reply is JSON");
            assert_eq!(v["ok"], false);
        }
    }
});

fn check(req: &Request, cfg: &IngestConfig, data: &[u8]) {
    let name = &req.stream.name;
    assert!(
        !name.starts_with('_') && !name.is_empty() && name.len() <= 64,
        "{name:?}"
    );
    assert!(edgespool::event::stream::stream_name_ok(name));
    assert_eq!(cfg.stream(name).as_ref(), Some(&req.stream));
    assert!(!req.fields.is_empty() && req.fields.len() <= cfg.max_fields);
    for (i, (n, v)) in req.fields.iter().enumerate() {
        let safe = n
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        assert!(!n.is_empty() && n.len() <= 64 && safe, "{n:?}");
        assert!(req.fields[..i].iter().all(|(m, _)| m != n), "{n} twice");
        match v {
            FieldValue::Num(f) => assert!(f.is_finite()),
            FieldValue::Text(s) => assert!(s.len() <= MAX_TEXT_BYTES),
            FieldValue::Bool(_) => {}
        }
    }
    if let Some(k) = &req.key {
        assert!(
            !k.is_empty() && k.len() <= MAX_KEY_BYTES && k.bytes().all(|b| b.is_ascii_graphic())
        );
    }
    assert!((0..=MAX_TS_MS).contains(&req.ts_ms));
    let has_ts = serde_json::from_slice::<Value>(data.strip_suffix(b"\r").unwrap_or(data))
        .ok()
        .is_some_and(|v| v.get("ts_ms").is_some_and(|t| !t.is_null()));
    if !has_ts {
        assert_eq!((req.ts_ms, req.clock_trusted), NOW);
    }
}

/// The request as a client would write it (fields in their order: a
/// serde_json map would sort them).
fn line_of(req: &Request) -> String {
    let fields: Vec<String> = req
        .fields
        .iter()
        .map(|(n, v)| {
            let v = match v {
                FieldValue::Num(f) => serde_json::Number::from_f64(*f)
                    .map(Value::Number)
                    .expect("finite"),
                FieldValue::Text(s) => Value::from(s.clone()),
                FieldValue::Bool(b) => Value::from(*b),
            };
            format!("{}:{v}", Value::from(n.clone()))
        })
        .collect();
    let key = req
        .key
        .as_ref()
        .map(|k| format!(",\"key\":{}", Value::from(k.clone())))
        .unwrap_or_default();
    // ts_ms only when the line gave one: a line without it is another
    // request (its reading digest leaves the agent's clock out).
    let ts = if req.ts_given {
        format!(",\"ts_ms\":{}", req.ts_ms)
    } else {
        String::new()
    };
    format!(
        "{{\"stream\":{},\"fields\":{{{}}}{ts}{key}}}",
        Value::from(req.stream.name.clone()),
        fields.join(",")
    )
}
