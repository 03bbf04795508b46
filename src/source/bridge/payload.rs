//! Decoding one local-broker message into the fields of a reading: a pure
//! function of (topic, payload bytes, settings), no I/O, so the fuzz target
//! `bridge_payload` calls exactly what the bridge calls.
//!
//! Its one rule: **a payload either becomes a complete reading or a named
//! refusal**; nothing is guessed from half a message, and no input panics.

use crate::event::reading::{FieldValue, Fields};
use std::fmt;

/// The field every bridged reading carries: the topic its message came on.
pub const TOPIC_FIELD: &str = "source_topic";

/// Longest field name kept (a flattened name is `a.b.c`); a longer member is
/// skipped. Bounds the envelope against keys built to be huge. (The ingest
/// socket's names are at most 64 bytes: a bridged name joins the levels of
/// nested objects, so it gets more room; the characters are the same rule,
/// [`crate::event::reading::field_name_ok`].)
pub const MAX_NAME_BYTES: usize = 256;

/// Longest idempotency key taken from `id_field` (bytes).
pub const MAX_KEY_BYTES: usize = 256;

/// How a payload is read (`payload` in the source's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadFormat {
    /// A JSON object: number, bool and string members become fields; nested
    /// objects are flattened with `.` (`{"a":{"b":1}}` → `a.b`); arrays and
    /// nulls are skipped.
    Json,
    /// A decimal number as text (`21.5`), stored as field `value`.
    Number,
    /// A JSON object as [`PayloadFormat::Json`], else a bare number as
    /// [`PayloadFormat::Number`].
    Auto,
}

/// The decoding settings of one bridge source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadSettings {
    /// `payload`.
    pub format: PayloadFormat,
    /// `max_payload_bytes`: a larger payload is refused unread.
    pub max_payload_bytes: usize,
    /// `id_field`: a member (flattened name) whose value, a string or a
    /// number, becomes the reading's idempotency key.
    pub id_field: Option<String>,
}

/// A decoded message.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// `source_topic` first, then the payload's fields in a stable order
    /// (member names sorted; names unique).
    pub fields: Fields,
    /// The `id_field` value, when configured and present.
    pub key: Option<String>,
}

/// Why a payload is refused. Every variant means the same to the bridge:
/// the message can never become a reading, so it is acknowledged (never
/// redelivered), counted `bridge_payload_refused` and logged rate-limited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayloadError {
    /// Larger than `max_payload_bytes`.
    TooLarge {
        /// Payload size in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not UTF-8 text.
    NotUtf8,
    /// Not what `payload` asks for; the detail names what was found.
    Unreadable(String),
    /// A JSON object without a number, bool or string member.
    NoUsableFields,
    /// The `id_field` member is there but is not a usable key (a string or
    /// number of 1..=256 bytes).
    BadId(String),
    /// A member name (flattened) with a character the field-name rule does
    /// not allow: only ASCII letters, digits, `-`, `_` and `.`, as on the
    /// ingest socket (so no NUL, newline, space or quote reaches a stored
    /// name). The name, at most 64 bytes of it, escaped.
    BadFieldName(String),
}

impl fmt::Display for PayloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PayloadError::TooLarge { len, max } => {
                write!(
                    f,
                    "payload of {len} bytes is over max_payload_bytes ({max})"
                )
            }
            PayloadError::NotUtf8 => write!(f, "payload is not UTF-8 text"),
            PayloadError::Unreadable(d) => write!(f, "{d}"),
            PayloadError::NoUsableFields => write!(
                f,
                "JSON object has no number, bool or string member to store"
            ),
            PayloadError::BadId(d) => write!(f, "id_field: {d}"),
            PayloadError::BadFieldName(n) => write!(
                f,
                "bad field name {n:?}: member names are ASCII letters, digits, '-', '_' or '.' (the ingest socket's rule)"
            ),
        }
    }
}

impl std::error::Error for PayloadError {}

/// Decode one message published on `topic`.
///
/// # Errors
///
/// [`PayloadError`]: too large, not UTF-8, not the configured format (not
/// JSON, not an object, not a finite number), a member name outside the
/// field-name rule, no usable member, or an unusable `id_field` value.
pub fn decode(
    topic: &str,
    bytes: &[u8],
    settings: &PayloadSettings,
) -> Result<Decoded, PayloadError> {
    if bytes.len() > settings.max_payload_bytes {
        return Err(PayloadError::TooLarge {
            len: bytes.len(),
            max: settings.max_payload_bytes,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|_| PayloadError::NotUtf8)?;
    let mut fields: Fields = vec![(TOPIC_FIELD.to_owned(), FieldValue::Text(topic.to_owned()))];
    let trimmed = text.trim_matches(|c: char| c.is_ascii_whitespace());
    let object = match settings.format {
        PayloadFormat::Number => None,
        PayloadFormat::Json => Some(parse_object(trimmed)?),
        PayloadFormat::Auto if trimmed.starts_with('{') => Some(parse_object(trimmed)?),
        PayloadFormat::Auto => None,
    };
    let Some(map) = object else {
        let v = super::super::parse_finite(trimmed).ok_or_else(|| {
            PayloadError::Unreadable(format!(
                "expected a finite number, got {:?}",
                super::super::excerpt(trimmed, 40)
            ))
        })?;
        fields.push(("value".to_owned(), FieldValue::Num(v)));
        return Ok(Decoded { fields, key: None });
    };
    flatten(&map, "", &mut fields)?;
    if fields.len() == 1 {
        return Err(PayloadError::NoUsableFields);
    }
    let key = match &settings.id_field {
        None => None,
        Some(name) => id_key(&map, name)?,
    };
    Ok(Decoded { fields, key })
}

fn parse_object(text: &str) -> Result<serde_json::Map<String, serde_json::Value>, PayloadError> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(PayloadError::Unreadable(format!(
            "expected a JSON object, got {}",
            kind(&other)
        ))),
        Err(e) => Err(PayloadError::Unreadable(format!("not JSON: {e}"))),
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a bool",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Append the usable members of `map` under `prefix`, skipping a name that
/// is empty, too long, or already taken (`source_topic`, or `a.b` given both
/// flat and nested: the first in sorted order wins). serde_json's recursion
/// limit (128) bounds the depth.
///
/// Errors: a member name with a character outside the field-name rule
/// (whatever its value: a name is never half-kept).
fn flatten(
    map: &serde_json::Map<String, serde_json::Value>,
    prefix: &str,
    out: &mut Fields,
) -> Result<(), PayloadError> {
    for (k, v) in map {
        if k.is_empty() {
            continue;
        }
        let name = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if !crate::event::reading::field_name_ok(k, usize::MAX) {
            return Err(PayloadError::BadFieldName(super::super::excerpt(&name, 64)));
        }
        if name.len() > MAX_NAME_BYTES {
            continue;
        }
        let value = match v {
            serde_json::Value::Number(n) => {
                n.as_f64().filter(|f| f.is_finite()).map(FieldValue::Num)
            }
            serde_json::Value::String(s) => Some(FieldValue::Text(s.clone())),
            serde_json::Value::Bool(b) => Some(FieldValue::Bool(*b)),
            serde_json::Value::Object(inner) => {
                flatten(inner, &name, out)?;
                None
            }
            serde_json::Value::Null | serde_json::Value::Array(_) => None,
        };
        if let Some(value) = value {
            if !out.iter().any(|(n, _)| *n == name) {
                out.push((name, value));
            }
        }
    }
    Ok(())
}

/// The key named by `id_field`, found in the JSON itself (never in the
/// flattened fields, whose numbers are f64): a dotted name walks nested
/// objects (`meta.id`). A string gives itself; a number its JSON text
/// (`17` stays `17`), exact for every integer serde_json holds as i64 or
/// u64. Absent: no key. Present but a bool, null, object, array, empty,
/// too long, or a number that only an f64 holds (an integer past 2^64, or
/// a fraction: two distinct ids could then meet): an error, since the
/// publisher meant the message to carry an id.
fn id_key(
    map: &serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Result<Option<String>, PayloadError> {
    let raw = match lookup(map, name, 0) {
        None => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) if n.is_f64() => {
            return Err(PayloadError::BadId(format!(
                "{name:?} is the number {n}, which is not an exact integer id (send it as a string)"
            )))
        }
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            return Err(PayloadError::BadId(format!(
                "{name:?} is {}, not a string or number",
                kind(other)
            )))
        }
    };
    match raw {
        Some(k) if k.is_empty() || k.len() > MAX_KEY_BYTES => Err(PayloadError::BadId(format!(
            "{name:?} must be 1..={MAX_KEY_BYTES} bytes (got {} bytes)",
            k.len()
        ))),
        other => Ok(other),
    }
}

/// The member `name` names: itself, or, split at any `.`, a nested one
/// (member names may hold dots too, so every split is tried). `depth`
/// bounds the walk like the flattening's nesting limit.
fn lookup<'a>(
    map: &'a serde_json::Map<String, serde_json::Value>,
    name: &str,
    depth: usize,
) -> Option<&'a serde_json::Value> {
    if let Some(v) = map.get(name) {
        return Some(v);
    }
    if depth >= 32 {
        return None;
    }
    name.match_indices('.').find_map(|(i, _)| {
        let (head, rest) = (&name[..i], &name[i + 1..]);
        match map.get(head) {
            Some(serde_json::Value::Object(inner)) => lookup(inner, rest, depth + 1),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(format: PayloadFormat, id: Option<&str>) -> PayloadSettings {
        PayloadSettings {
            format,
            max_payload_bytes: 1024,
            id_field: id.map(str::to_owned),
        }
    }

    fn text(s: &str) -> FieldValue {
        FieldValue::Text(s.to_owned())
    }

    #[test]
    fn a_json_object_is_flattened_with_dots_after_the_topic() {
        let d = decode(
            "plant/line1",
            br#"{"temp_c":21.5,"ok":true,"state":"run","pump":{"rpm":1200,"motor":{"amps":3}},"tags":[1],"n":null}"#,
            &settings(PayloadFormat::Json, None),
        )
        .unwrap();
        assert_eq!(
            d.fields,
            vec![
                ("source_topic".to_owned(), text("plant/line1")),
                ("ok".to_owned(), FieldValue::Bool(true)),
                ("pump.motor.amps".to_owned(), FieldValue::Num(3.0)),
                ("pump.rpm".to_owned(), FieldValue::Num(1200.0)),
                ("state".to_owned(), text("run")),
                ("temp_c".to_owned(), FieldValue::Num(21.5)),
            ]
        );
        assert_eq!(d.key, None);
    }

    #[test]
    fn the_topic_field_cannot_be_overwritten_and_names_stay_unique() {
        let d = decode(
            "t",
            br#"{"source_topic":"forged","a":{"b":1},"a.b":2}"#,
            &settings(PayloadFormat::Json, None),
        )
        .unwrap();
        assert_eq!(
            d.fields,
            vec![
                ("source_topic".to_owned(), text("t")),
                ("a.b".to_owned(), FieldValue::Num(1.0)),
            ]
        );
    }

    #[test]
    fn number_and_auto_formats() {
        let n = settings(PayloadFormat::Number, None);
        let d = decode("s/temp", b" 21.5\n", &n).unwrap();
        assert_eq!(d.fields[1], ("value".to_owned(), FieldValue::Num(21.5)));
        assert!(matches!(
            decode("s", b"{\"a\":1}", &n),
            Err(PayloadError::Unreadable(_))
        ));
        let a = settings(PayloadFormat::Auto, None);
        assert_eq!(decode("s", b"-3", &a).unwrap().fields.len(), 2);
        assert_eq!(decode("s", b"{\"a\":1}", &a).unwrap().fields.len(), 2);
        assert!(decode("s", b"NaN", &a).is_err());
        assert!(decode("s", b"{\"a\":", &a).is_err());
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let j = settings(PayloadFormat::Json, None);
        for (bytes, want) in [
            (&b"\xff\xfe"[..], "not UTF-8"),
            (b"hello", "not JSON"),
            (b"[1,2]", "got an array"),
            (b"42", "got a number"),
            (b"{\"a\":[1],\"b\":null}", "no number, bool or string"),
            (b"{}", "no number, bool or string"),
        ] {
            let e = decode("t", bytes, &j).unwrap_err().to_string();
            assert!(e.contains(want), "{bytes:?}: {e}");
        }
        let big = vec![b' '; 1025];
        assert_eq!(
            decode("t", &big, &j),
            Err(PayloadError::TooLarge {
                len: 1025,
                max: 1024
            })
        );
    }

    #[test]
    fn id_field_gives_the_key_when_present() {
        let s = settings(PayloadFormat::Json, Some("msg_id"));
        let d = decode("t", br#"{"msg_id":"m-17","v":1}"#, &s).unwrap();
        assert_eq!(d.key.as_deref(), Some("m-17"));
        // The id is data too: it stays a field.
        assert!(d.fields.iter().any(|(n, _)| n == "msg_id"));
        assert_eq!(
            decode("t", br#"{"msg_id":17,"v":1}"#, &s)
                .unwrap()
                .key
                .as_deref(),
            Some("17")
        );
        assert_eq!(decode("t", br#"{"v":1}"#, &s).unwrap().key, None);
        let nested = settings(PayloadFormat::Json, Some("meta.id"));
        assert_eq!(
            decode("t", br#"{"meta":{"id":"x"},"v":1}"#, &nested)
                .unwrap()
                .key
                .as_deref(),
            Some("x")
        );
        // Nested numeric ids keep every digit (they were once read from
        // the f64 fields: 2^53 and 2^53 + 1 became one id).
        let key = |body: &[u8]| decode("t", body, &nested).unwrap().key;
        assert_eq!(
            key(br#"{"meta":{"id":9007199254740993},"v":1}"#).as_deref(),
            Some("9007199254740993")
        );
        assert_ne!(
            key(br#"{"meta":{"id":9007199254740992},"v":1}"#),
            key(br#"{"meta":{"id":9007199254740993},"v":1}"#)
        );
        // A member name holding a dot is found too.
        assert_eq!(
            key(br#"{"meta.id":"dotted","v":1}"#).as_deref(),
            Some("dotted")
        );
        for bad in [
            &br#"{"msg_id":true,"v":1}"#[..],
            br#"{"msg_id":"","v":1}"#,
            br#"{"msg_id":{"a":1},"v":1}"#,
            // Only an f64 holds these: two ids could meet.
            br#"{"msg_id":12345678901234567000001,"v":1}"#,
            br#"{"msg_id":1.5,"v":1}"#,
        ] {
            assert!(matches!(decode("t", bad, &s), Err(PayloadError::BadId(_))));
        }
    }

    #[test]
    fn member_names_follow_the_ingest_field_name_rule() {
        let j = settings(PayloadFormat::Json, None);
        for bad in [
            &br#"{"a\u0000b":1}"#[..],
            br#"{"a\nb":1,"v":2}"#,
            br#"{"v":1,"ok":{"in ner":1}}"#,
            br#"{"v":1,"q\"":1}"#,
            br#"{"v":1,"x":{"y":{"\r":1}}}"#,
        ] {
            let e = decode("t", bad, &j).unwrap_err();
            assert!(matches!(e, PayloadError::BadFieldName(_)), "{bad:?}: {e}");
        }
        let e = decode("t", br#"{"ok":{"in\nner":1}}"#, &j).unwrap_err();
        assert_eq!(e, PayloadError::BadFieldName("ok.in\nner".into()));
        assert!(e.to_string().contains(r#""ok.in\nner""#), "{e}");
        // Names of the rule pass, dots and all; an empty name is skipped.
        let d = decode("t", br#"{"a-b_c.d":1,"":2}"#, &j).unwrap();
        assert_eq!(d.fields.len(), 2);
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = format!("{}1{}", "{\"a\":".repeat(10_000), "}".repeat(10_000));
        let s = PayloadSettings {
            max_payload_bytes: 1 << 20,
            ..settings(PayloadFormat::Json, None)
        };
        assert!(decode("t", deep.as_bytes(), &s).is_err());
    }
}
