//! One request line of the socket ingest → a validated [`Request`], and the
//! reply lines.
//!
//! Its one rule: **a line is judged whole, with no I/O and the time passed
//! in**, so the fuzz target (`fuzz/fuzz_targets/ingest_line.rs`) runs exactly
//! what the listener runs. Every refusal names what was wrong.
//!
//! A request is a JSON object on one line:
//! `{"stream":"pump","fields":{"pressure_bar":2.5},"ts_ms":1796000000000,"key":"pump-000123"}`
//! (`ts_ms` and `key` optional, no other members).

use crate::event::envelope::CLOCK_FLOOR_MS;
use crate::event::reading::{FieldValue, Fields};
use crate::ingest::{IngestConfig, IngestStream};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// Longest idempotency key, bytes.
pub const MAX_KEY_BYTES: usize = 128;
/// Longest field name, bytes.
pub const MAX_FIELD_NAME_BYTES: usize = 64;
/// Longest string field value, bytes.
pub const MAX_TEXT_BYTES: usize = 1024;
/// Latest `ts_ms` taken: 9999-12-31T23:59:59.999Z.
pub const MAX_TS_MS: i64 = 253_402_300_799_999;

/// A request that passed every check.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The stream, as configured (durability and priority with it).
    pub stream: IngestStream,
    /// Fields in the order the line gave them; names unique.
    pub fields: Fields,
    /// Reading time, ms since the Unix epoch: the request's `ts_ms`, or the
    /// `now` passed to [`parse_request`].
    pub ts_ms: i64,
    /// Whether `ts_ms` is past [`CLOCK_FLOOR_MS`] (a clock that was never
    /// set reads 1970), as for readings of sources.
    pub clock_trusted: bool,
    /// Whether the line gave `ts_ms` (else it is the agent's clock, which
    /// the key's reading digest leaves out).
    pub ts_given: bool,
    /// The idempotency key: 1..=[`MAX_KEY_BYTES`] printable ASCII bytes.
    pub key: Option<String>,
}

/// Why a request line was refused. The client gets `{"ok":false,"error":<Display>}`
/// and may send the next line (the connection stays open).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// Not a JSON object of the request's shape (serde_json's message:
    /// syntax, a missing `stream`/`fields`, an unknown member, a wrong type).
    #[error("bad request: {0}")]
    Json(String),
    /// The stream name breaks the name rule (or is reserved: `_commands`, `_agent`).
    #[error("bad stream name {0:?}: streams are 1..=64 letters, digits, '-', '_' or '.', not starting with '_'")]
    BadStream(String),
    /// The stream is not declared in `[[ingest.streams]]` nor allowed by a pattern.
    #[error("unknown stream {0:?}: not declared in [[ingest.streams]] nor allowed by ingest.stream_patterns")]
    UnknownStream(String),
    /// A new stream a pattern allows, past [`super::MAX_PATTERN_STREAMS`]
    /// such streams in this run (declare it in `[[ingest.streams]]`).
    #[error("stream {0:?} refused: patterns already let in 64 streams in this run (declare the streams you need in [[ingest.streams]])")]
    TooManyStreams(String),
    /// `fields` is empty.
    #[error("bad fields: no field given")]
    NoFields,
    /// More fields than `ingest.max_fields`.
    #[error("bad fields: {got} fields, at most {max} (ingest.max_fields)")]
    TooManyFields {
        /// Fields in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A field name that is empty, too long or not letters, digits, '-', '_', '.'.
    #[error("bad field name {0:?}: 1..=64 letters, digits, '-', '_' or '.'")]
    BadFieldName(String),
    /// A field name given twice.
    #[error("bad fields: {0:?} appears twice")]
    DuplicateField(String),
    /// A field whose value is an object or an array.
    #[error(
        "bad field {0:?}: nested objects and arrays are not taken; flatten them (e.g. \"a.b\")"
    )]
    Nested(String),
    /// A field whose value is null.
    #[error("bad field {0:?}: null is not a value")]
    Null(String),
    /// A number that does not fit a finite f64.
    #[error("bad field {0:?}: not a finite number")]
    NotFinite(String),
    /// A string value over [`MAX_TEXT_BYTES`].
    #[error("bad field {0:?}: strings are at most 1024 bytes")]
    TextTooLong(String),
    /// `ts_ms` outside 0..=[`MAX_TS_MS`].
    #[error("bad ts_ms {0}: must be 0..=253402300799999 (ms since 1970)")]
    BadTs(i64),
    /// `key` empty, too long or not printable ASCII.
    #[error("bad key: 1..=128 printable ASCII characters without spaces")]
    BadKey,
}

impl RequestError {
    /// The counter suffix of this refusal (`ingest_refused.<reason>`).
    pub fn reason(&self) -> &'static str {
        match self {
            RequestError::Json(_) => "bad_request",
            RequestError::BadStream(_) => "bad_stream",
            RequestError::UnknownStream(_) => "unknown_stream",
            RequestError::TooManyStreams(_) => "too_many_streams",
            RequestError::BadTs(_) => "bad_ts",
            RequestError::BadKey => "bad_key",
            _ => "bad_fields",
        }
    }
}

/// The request as serde reads it; fields kept in line order.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    stream: String,
    fields: RawFields,
    ts_ms: Option<i64>,
    key: Option<String>,
}

/// `(name, value)` pairs in the order of the line (serde_json's map would
/// sort them and keep only the last of a repeated name).
struct RawFields(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for RawFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawFields;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of fields")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawFields, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, Value>()? {
                    // Bounded by the line length already; this stops a
                    // line of a million one-byte fields early.
                    if out.len() > 1024 {
                        return Err(de::Error::custom("more than 1024 fields"));
                    }
                    out.push((k, v));
                }
                Ok(RawFields(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Judge one request line (without its newline; a trailing `\r` is
/// allowed). `now` is the wall clock `(ms, trusted)` as
/// [`crate::event::envelope::wall_clock_ms`] gives it, used when the line has no
/// `ts_ms`.
///
/// Errors: see [`RequestError`]; the first problem found.
pub fn parse_request(
    line: &[u8],
    cfg: &IngestConfig,
    now: (i64, bool),
) -> Result<Request, RequestError> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let raw: RawRequest =
        serde_json::from_slice(line).map_err(|e| RequestError::Json(json_problem(&e)))?;
    if !crate::event::stream::stream_name_ok(&raw.stream) {
        return Err(RequestError::BadStream(raw.stream));
    }
    let stream = cfg
        .stream(&raw.stream)
        .ok_or(RequestError::UnknownStream(raw.stream))?;
    let fields = fields(raw.fields.0, cfg.max_fields)?;
    let (ts_ms, clock_trusted) = match raw.ts_ms {
        Some(t) if !(0..=MAX_TS_MS).contains(&t) => return Err(RequestError::BadTs(t)),
        Some(t) => (t, t >= CLOCK_FLOOR_MS),
        None => now,
    };
    if let Some(k) = &raw.key {
        let printable = k.bytes().all(|b| b.is_ascii_graphic());
        if k.is_empty() || k.len() > MAX_KEY_BYTES || !printable {
            return Err(RequestError::BadKey);
        }
    }
    Ok(Request {
        stream,
        fields,
        ts_ms,
        clock_trusted,
        ts_given: raw.ts_ms.is_some(),
        key: raw.key,
    })
}

/// serde_json's message without its position when the line is one line
/// anyway ("at line 1 column 12" stays: it points into the request).
fn json_problem(e: &serde_json::Error) -> String {
    let s = e.to_string();
    if s.len() > 200 {
        // An unknown member's name is echoed in full; keep replies short.
        let cut = (0..=200)
            .rev()
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(0);
        format!("{}...", &s[..cut])
    } else {
        s
    }
}

/// The fields, checked: names, count, value types.
fn fields(raw: Vec<(String, Value)>, max: usize) -> Result<Fields, RequestError> {
    if raw.is_empty() {
        return Err(RequestError::NoFields);
    }
    if raw.len() > max {
        return Err(RequestError::TooManyFields {
            got: raw.len(),
            max,
        });
    }
    let mut out: Fields = Vec::with_capacity(raw.len());
    for (name, v) in raw {
        if !crate::event::reading::field_name_ok(&name, MAX_FIELD_NAME_BYTES) {
            return Err(RequestError::BadFieldName(truncated(&name)));
        }
        if out.iter().any(|(n, _)| *n == name) {
            return Err(RequestError::DuplicateField(name));
        }
        let value = match v {
            Value::Bool(b) => FieldValue::Bool(b),
            Value::Number(n) => match n.as_f64() {
                Some(f) if f.is_finite() => FieldValue::Num(f),
                _ => return Err(RequestError::NotFinite(name)),
            },
            Value::String(s) if s.len() > MAX_TEXT_BYTES => {
                return Err(RequestError::TextTooLong(name))
            }
            Value::String(s) => FieldValue::Text(s),
            Value::Null => return Err(RequestError::Null(name)),
            Value::Array(_) | Value::Object(_) => return Err(RequestError::Nested(name)),
        };
        out.push((name, value));
    }
    Ok(out)
}

/// At most 64 bytes of `s` (a bad name is echoed, not all of it).
fn truncated(s: &str) -> String {
    let cut = (0..=s.len().min(64))
        .rev()
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(0);
    s[..cut].to_owned()
}

/// The reply line for a committed reading:
/// `{"ok":true,"event_id":"...","durable":true}\n`. `durable` says what the
/// `ok` promises: `true`, the commit was synced (a `durability = "full"`
/// stream, or `spool.synchronous = "full"`), a power cut cannot undo it;
/// `false`, committed but not yet synced (a `batched` stream under
/// `synchronous = "normal"`): a power cut before the next checkpoint may
/// roll the reading back.
pub fn ok_line(event_id: &str, durable: bool) -> String {
    format!(
        "{{\"ok\":true,\"event_id\":{},\"durable\":{durable}}}\n",
        Value::from(event_id)
    )
}

/// The reply line for a refusal: `{"ok":false,"error":"..."}\n`.
pub fn error_line(why: &str) -> String {
    format!("{{\"ok\":false,\"error\":{}}}\n", Value::from(why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::stream::Durability;

    fn cfg() -> IngestConfig {
        IngestConfig {
            socket: Some("/tmp/x.sock".into()),
            streams: vec![IngestStream {
                name: "pump".into(),
                settings: crate::event::stream::StreamSettings {
                    durability: Durability::Full,
                    priority: 7,
                    live_first: false,
                    batch: None,
                },
            }],
            stream_patterns: vec!["plant.*".into()],
            max_fields: 3,
            ..IngestConfig::default()
        }
    }

    const NOW: (i64, bool) = (1_800_000_000_000, true);

    fn parse(line: &str) -> Result<Request, RequestError> {
        parse_request(line.as_bytes(), &cfg(), NOW)
    }

    #[test]
    fn the_issue_example_parses_with_its_time_and_key() {
        let r = parse(r#"{"stream":"pump","fields":{"pressure_bar":2.5},"ts_ms":1796000000000,"key":"pump-000123"}"#)
            .expect("parses");
        assert_eq!(r.stream.name, "pump");
        assert_eq!(r.stream.settings.durability, Durability::Full);
        assert_eq!(r.stream.settings.priority, 7);
        assert_eq!(
            r.fields,
            vec![("pressure_bar".into(), FieldValue::Num(2.5))]
        );
        assert_eq!((r.ts_ms, r.clock_trusted), (1_796_000_000_000, true));
        assert_eq!(r.key.as_deref(), Some("pump-000123"));
    }

    #[test]
    fn without_ts_the_wall_clock_given_is_used_and_field_order_is_kept() {
        let r = parse("{\"stream\":\"plant.a\",\"fields\":{\"z\":\"on\",\"a\":true,\"m\":1}}\r")
            .expect("parses");
        assert_eq!((r.ts_ms, r.clock_trusted), NOW);
        assert_eq!(r.stream.settings.durability, Durability::Batched);
        let names: Vec<&str> = r.fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["z", "a", "m"]);
        assert_eq!(r.key, None);
        let early = parse(r#"{"stream":"pump","fields":{"a":1},"ts_ms":5}"#).expect("parses");
        assert!(!early.clock_trusted);
    }

    #[test]
    fn streams_must_be_declared_or_match_a_pattern_and_never_reserved() {
        assert_eq!(
            parse(r#"{"stream":"valve","fields":{"a":1}}"#),
            Err(RequestError::UnknownStream("valve".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"plant.","fields":{"a":1}}"#),
            Err(RequestError::UnknownStream("plant.".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"_commands","fields":{"a":1}}"#),
            Err(RequestError::BadStream("_commands".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"plant/#","fields":{"a":1}}"#),
            Err(RequestError::BadStream("plant/#".into()))
        );
        let msg = parse(r#"{"stream":"valve","fields":{"a":1}}"#)
            .expect_err("refused")
            .to_string();
        assert!(msg.contains("\"valve\""), "{msg}");
    }

    #[test]
    fn bad_fields_are_refused_by_name() {
        let nested = parse(r#"{"stream":"pump","fields":{"a":{"b":1}}}"#);
        assert_eq!(nested, Err(RequestError::Nested("a".into())));
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"arr":[1]}}"#),
            Err(RequestError::Nested("arr".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"n":null}}"#),
            Err(RequestError::Null("n".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"x":1e999}}"#).map(|_| ()),
            Err(RequestError::Json(
                "number out of range at line 1 column 36".into()
            ))
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{}}"#),
            Err(RequestError::NoFields)
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"a":1,"b":2,"c":3,"d":4}}"#),
            Err(RequestError::TooManyFields { got: 4, max: 3 })
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"a":1,"a":2}}"#),
            Err(RequestError::DuplicateField("a".into()))
        );
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"a b":1}}"#),
            Err(RequestError::BadFieldName("a b".into()))
        );
        // The rule the bridge's member names follow too.
        for (line, name) in [
            (r#"{"stream":"pump","fields":{"a\u0000b":1}}"#, "a\0b"),
            (r#"{"stream":"pump","fields":{"a\nb":1}}"#, "a\nb"),
        ] {
            assert_eq!(parse(line), Err(RequestError::BadFieldName(name.into())));
        }
        let long = format!(
            r#"{{"stream":"pump","fields":{{"s":"{}"}}}}"#,
            "x".repeat(1025)
        );
        assert_eq!(parse(&long), Err(RequestError::TextTooLong("s".into())));
    }

    #[test]
    fn shape_time_and_key_errors_are_named() {
        for (line, want) in [
            ("hello", "expected value"),
            ("{\"stream\":", "EOF while parsing"),
            (r#"{"fields":{"a":1}}"#, "missing field `stream`"),
            (r#"{"stream":"pump"}"#, "missing field `fields`"),
            (
                r#"{"stream":"pump","fields":{"a":1},"extra":1}"#,
                "unknown field `extra`",
            ),
            (
                r#"{"stream":"pump","fields":{"a":1},"ts_ms":1.5}"#,
                "invalid type",
            ),
            (r#"[1]"#, "invalid type"),
        ] {
            let e = parse(line).expect_err(line).to_string();
            assert!(e.contains(want), "{line}: {e}");
        }
        assert_eq!(
            parse(r#"{"stream":"pump","fields":{"a":1},"ts_ms":-1}"#),
            Err(RequestError::BadTs(-1))
        );
        for key in ["", "a b", "é", &"k".repeat(129)] {
            let line = format!(r#"{{"stream":"pump","fields":{{"a":1}},"key":"{key}"}}"#);
            assert_eq!(parse(&line), Err(RequestError::BadKey), "{key}");
        }
    }

    #[test]
    fn reply_lines_are_one_json_object_each() {
        assert_eq!(
            ok_line("abc", false),
            "{\"ok\":true,\"event_id\":\"abc\",\"durable\":false}\n"
        );
        assert_eq!(
            ok_line("abc", true),
            "{\"ok\":true,\"event_id\":\"abc\",\"durable\":true}\n"
        );
        let e = error_line("unknown stream \"x\"\n");
        assert_eq!(e.matches('\n').count(), 1);
        let v: Value = serde_json::from_str(&e).expect("json");
        assert_eq!(v["ok"], false);
    }
}
