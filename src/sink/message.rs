//! One delivered payload, read into the columns a store keeps.
//!
//! Pure: no I/O. Its one rule: the digest is taken over the payload bytes
//! exactly as delivered (JSON or postcard), so two deliveries of one event id
//! are the same event only if every byte is the same (I3).

use crate::event::clock::{BootId, MonoStamp};
use crate::event::envelope::{read_compact, EventId};
use crate::event::reading::FieldValue;
use sha2::{Digest, Sha256};

/// An edgespool envelope, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Canonical event id: 8-4-4-4-12 lowercase hex (a UUID's text form).
    pub event_id: String,
    /// `device_id` of the board that produced it.
    pub device_id: String,
    /// Stream (source) name.
    pub stream: String,
    /// Per-stream sequence number.
    pub seq: i64,
    /// Reading time, Unix ms (the board's clock).
    pub ts_ms: i64,
    /// Whether the board's clock was trusted when the reading was taken.
    pub clock_trusted: bool,
    /// Where `ts_ms` was read on the board's monotonic clock, when the
    /// envelope says (`boot_id` and `mono_ms`: a reading taken before time
    /// sync, a clock anchor); see [`super::clock`].
    pub mono: Option<MonoStamp>,
    /// The reading's fields as a JSON object (text), whatever the wire format.
    pub fields_json: String,
    /// sha256 of the payload bytes.
    pub digest: [u8; 32],
}

/// Why a delivery cannot be stored as an event: not an edgespool envelope,
/// or (`Forged`) an envelope of another device or stream than its topic's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// Neither a JSON envelope nor a postcard one. Kept aside and counted;
    /// it can never be stored as an event.
    #[error("not an edgespool envelope (JSON or postcard)")]
    NotAnEnvelope,
    /// A JSON envelope with a missing or mistyped field (named).
    #[error("envelope field {0}: missing or of the wrong type")]
    Field(&'static str),
    /// An event id that is not 32 hex digits in the 8-4-4-4-12 form.
    #[error("event id {0:?} is not a UUID-shaped id")]
    EventId(String),
    /// A NUL character in a string, which PostgreSQL's `text` and `jsonb`
    /// cannot hold.
    #[error("NUL character in {0}")]
    Nul(&'static str),
    /// A device id or stream name longer than the agent ever sends
    /// ([`MAX_NAME_CHARS`]); indexed columns must stay within PostgreSQL's
    /// index row size, or one message would fail every batch it is in.
    #[error("{0} is longer than {MAX_NAME_CHARS} characters")]
    TooLong(&'static str),
    /// A batched publish (`<prefix>/batches/...`) that cannot be read as a
    /// whole: bad compression, neither a JSON nor a postcard batch, or over
    /// the bounds of [`super::unbatch`]; the reason says which. None of its
    /// events is stored.
    #[error("unreadable batch: {0}")]
    Batch(String),
    /// An envelope whose `device_id` or `stream` is not the one its topic
    /// names, or a topic that names none (see [`super::identity`]): set
    /// aside and counted as forged, never stored as an event.
    #[error("forged: {0}")]
    Forged(String),
    /// A PUBLISH over the sink's incoming limit, read on one session with
    /// a raised limit (see [`super::consume`]) only to be set aside: never
    /// decoded; its topic, size and first bytes are kept.
    #[error(
        "oversized: a PUBLISH of {packet} bytes ({bytes}-byte payload), over the sink's \
         incoming limit of {limit} bytes; set aside unread"
    )]
    Oversized {
        /// The payload's length.
        bytes: usize,
        /// The packet's remaining length (topic, packet id and payload).
        packet: usize,
        /// The incoming limit it is over.
        limit: usize,
    },
}

/// The longest device id or stream name accepted: the agent's own limit on
/// both is 64 characters; 256 leaves room for other publishers.
pub const MAX_NAME_CHARS: usize = 256;

/// sha256 of `payload`.
pub fn digest(payload: &[u8]) -> [u8; 32] {
    Sha256::digest(payload).into()
}

/// Decode a delivered payload: a JSON envelope, else a postcard one.
///
/// Errors: [`Unreadable`] when it is neither, or a field is missing; the
/// caller keeps it aside, counts it and acknowledges it (no redelivery can
/// make it readable).
pub fn decode(payload: &[u8]) -> Result<Event, Unreadable> {
    let e = match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(v) if v.is_object() => decode_json(&v, payload)?,
        _ => decode_postcard(payload)?,
    };
    // Text columns cannot hold NUL; a batch holding one would fail every
    // time it is delivered again.
    if e.device_id.contains('\0') {
        return Err(Unreadable::Nul("device_id"));
    }
    if e.stream.contains('\0') {
        return Err(Unreadable::Nul("stream"));
    }
    if e.device_id.chars().count() > MAX_NAME_CHARS {
        return Err(Unreadable::TooLong("device_id"));
    }
    if e.stream.chars().count() > MAX_NAME_CHARS {
        return Err(Unreadable::TooLong("stream"));
    }
    if has_escaped_nul(&e.fields_json) {
        return Err(Unreadable::Nul("fields"));
    }
    Ok(e)
}

fn decode_json(v: &serde_json::Value, payload: &[u8]) -> Result<Event, Unreadable> {
    let text = |k: &'static str| {
        v.get(k)
            .and_then(|x| x.as_str())
            .map(str::to_owned)
            .ok_or(Unreadable::Field(k))
    };
    let int = |k: &'static str| {
        v.get(k)
            .and_then(|x| x.as_i64())
            .ok_or(Unreadable::Field(k))
    };
    let raw_id = text("event_id")?;
    let id = parse_event_id(&raw_id).ok_or(Unreadable::EventId(raw_id))?;
    let fields = match v.get("fields") {
        Some(f @ serde_json::Value::Object(_)) => f.to_string(),
        None => "{}".to_owned(),
        Some(_) => return Err(Unreadable::Field("fields")),
    };
    Ok(Event {
        event_id: id.hyphenated(),
        device_id: text("device_id")?,
        stream: text("stream")?,
        seq: int("seq")?,
        ts_ms: int("ts_ms")?,
        clock_trusted: v
            .get("clock_trusted")
            .and_then(|x| x.as_bool())
            .ok_or(Unreadable::Field("clock_trusted"))?,
        mono: json_stamp(v)?,
        fields_json: fields,
        digest: digest(payload),
    })
}

/// `boot_id` and `mono_ms`: both or neither (an envelope written before
/// they existed, or an event the board did not stamp), `boot_id` in either
/// form [`BootId::parse`] reads, `mono_ms` an integer a `bigint` holds.
fn json_stamp(v: &serde_json::Value) -> Result<Option<MonoStamp>, Unreadable> {
    let (boot, mono) = match (v.get("boot_id"), v.get("mono_ms")) {
        (None, None) => return Ok(None),
        (boot, mono) => (boot, mono),
    };
    let boot_id = boot
        .and_then(|b| b.as_str())
        .and_then(BootId::parse)
        .ok_or(Unreadable::Field("boot_id"))?;
    let mono_ms = mono
        .and_then(|m| m.as_u64())
        .filter(|&m| i64::try_from(m).is_ok())
        .ok_or(Unreadable::Field("mono_ms"))?;
    Ok(Some(MonoStamp { boot_id, mono_ms }))
}

fn decode_postcard(payload: &[u8]) -> Result<Event, Unreadable> {
    let (c, mono) = read_compact(payload).map_err(|_| Unreadable::NotAnEnvelope)?;
    if mono.is_some_and(|m| i64::try_from(m.mono_ms).is_err()) {
        return Err(Unreadable::Field("mono_ms"));
    }
    let mut fields = serde_json::Map::with_capacity(c.fields.len());
    for (k, v) in c.fields {
        let j = match v {
            FieldValue::Num(n) => serde_json::Number::from_f64(n)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
            FieldValue::Text(t) => serde_json::Value::String(t),
            FieldValue::Bool(b) => serde_json::Value::Bool(b),
        };
        fields.insert(k, j);
    }
    Ok(Event {
        event_id: EventId(c.event_id).hyphenated(),
        device_id: c.device_id,
        stream: c.stream,
        seq: i64::try_from(c.seq).map_err(|_| Unreadable::Field("seq"))?,
        ts_ms: c.ts_ms,
        clock_trusted: c.clock_trusted,
        mono,
        fields_json: serde_json::Value::Object(fields).to_string(),
        digest: digest(payload),
    })
}

/// Whether serialized JSON holds the escape `\u0000` (not a literal
/// backslash followed by `u0000`, which is written `\\u0000`).
fn has_escaped_nul(json: &str) -> bool {
    let b = json.as_bytes();
    json.match_indices("\\u0000").any(|(i, _)| {
        let backslashes_before = b[..i].iter().rev().take_while(|&&c| c == b'\\').count();
        backslashes_before % 2 == 0
    })
}

/// Parse `8-4-4-4-12` hex (either case) into the 16 id bytes.
pub fn parse_event_id(s: &str) -> Option<EventId> {
    let b = s.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let mut out = [0u8; 16];
    let mut digits = b.iter().filter(|&&c| c != b'-');
    for byte in &mut out {
        let hi = (*digits.next()? as char).to_digit(16)?;
        let lo = (*digits.next()? as char).to_digit(16)?;
        *byte = (hi << 4 | lo) as u8;
    }
    digits.next().is_none().then_some(EventId(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{encode, Envelope, Format};

    fn fields() -> crate::event::reading::Fields {
        vec![
            ("load1".into(), FieldValue::Num(0.5)),
            ("iface".into(), FieldValue::Text("eth0".into())),
        ]
    }

    fn envelope(f: &crate::event::reading::Fields) -> Envelope<'_> {
        Envelope {
            event_id: EventId([0xab; 16]),
            device_id: "dev-1",
            stream: "system",
            seq: 42,
            ts_ms: 1_800_000_000_000,
            clock_trusted: true,
            mono: None,
            fields: f,
        }
    }

    #[test]
    fn json_and_postcard_envelopes_decode_to_the_same_columns() {
        let f = fields();
        let js = encode(Format::Json, &envelope(&f)).unwrap();
        let pc = encode(Format::Postcard, &envelope(&f)).unwrap();
        let (a, b) = (decode(&js).unwrap(), decode(&pc).unwrap());
        assert_eq!(a.event_id, "abababab-abab-abab-abab-abababababab");
        assert_eq!(
            (&a.event_id, &a.device_id, &a.stream, a.seq, a.ts_ms),
            (&b.event_id, &b.device_id, &b.stream, b.seq, b.ts_ms)
        );
        assert_eq!(a.fields_json, b.fields_json);
        assert_ne!(a.digest, b.digest, "the digest covers the wire bytes");
    }

    #[test]
    fn a_stamp_is_read_from_both_formats_and_an_old_envelope_has_none() {
        let f = fields();
        let stamp = MonoStamp {
            boot_id: BootId([0x37; 16]),
            mono_ms: 123_456,
        };
        let mut env = envelope(&f);
        env.mono = Some(stamp);
        for format in [Format::Json, Format::Postcard] {
            let e = decode(&encode(format, &env).unwrap()).unwrap();
            assert_eq!(e.mono, Some(stamp), "{format:?}");
        }
        let old = br#"{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"d","stream":"s","seq":1,"ts_ms":5,"clock_trusted":false,"fields":{}}"#;
        assert_eq!(decode(old).unwrap().mono, None);
        let with = |members: &str| {
            format!(
                r#"{{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"d","stream":"s","seq":1,"ts_ms":5,"clock_trusted":false,{members}"fields":{{}}}}"#
            )
        };
        let kernel_form =
            with(r#""boot_id":"37373737-3737-3737-3737-373737373737","mono_ms":123456,"#);
        assert_eq!(decode(kernel_form.as_bytes()).unwrap().mono, Some(stamp));
        for (bad, field) in [
            (r#""boot_id":"3737","mono_ms":1,"#, "boot_id"),
            (r#""mono_ms":1,"#, "boot_id"),
            (
                r#""boot_id":"37373737373737373737373737373737","#,
                "mono_ms",
            ),
            (
                r#""boot_id":"37373737373737373737373737373737","mono_ms":-1,"#,
                "mono_ms",
            ),
            (
                r#""boot_id":"37373737373737373737373737373737","mono_ms":18446744073709551615,"#,
                "mono_ms",
            ),
        ] {
            assert_eq!(
                decode(with(bad).as_bytes()),
                Err(Unreadable::Field(field)),
                "{bad}"
            );
        }
    }

    #[test]
    fn an_uppercase_id_is_stored_in_canonical_lowercase() {
        let p = br#"{"event_id":"ABABABAB-ABAB-ABAB-ABAB-ABABABABABAB","device_id":"d","stream":"s","seq":1,"ts_ms":5,"clock_trusted":false,"fields":{}}"#;
        assert_eq!(
            decode(p).unwrap().event_id,
            "abababab-abab-abab-abab-abababababab"
        );
    }

    #[test]
    fn an_overlong_device_id_or_stream_is_unreadable_not_a_failed_batch() {
        let long = "d".repeat(MAX_NAME_CHARS + 1);
        let ok = "d".repeat(MAX_NAME_CHARS);
        let env = |device: &str, stream: &str| {
            format!(
                r#"{{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"{device}","stream":"{stream}","seq":1,"ts_ms":5,"clock_trusted":false,"fields":{{}}}}"#
            )
        };
        assert!(matches!(
            decode(env(&long, "s").as_bytes()),
            Err(Unreadable::TooLong("device_id"))
        ));
        assert!(matches!(
            decode(env("d", &long).as_bytes()),
            Err(Unreadable::TooLong("stream"))
        ));
        assert!(decode(env(&ok, &ok).as_bytes()).is_ok());
    }

    #[test]
    fn payloads_that_are_not_envelopes_are_unreadable_with_a_reason() {
        assert_eq!(decode(b"hello"), Err(Unreadable::NotAnEnvelope));
        assert_eq!(
            decode(br#"{"event_id":"e-1","ts_ms":5}"#),
            Err(Unreadable::EventId("e-1".into()))
        );
        let no_stream = br#"{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"d","seq":1,"ts_ms":5,"clock_trusted":true}"#;
        assert_eq!(decode(no_stream), Err(Unreadable::Field("stream")));
        let nul = br#"{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"d","stream":"s","seq":1,"ts_ms":5,"clock_trusted":true,"fields":{"x":"a\u0000b"}}"#;
        assert_eq!(decode(nul), Err(Unreadable::Nul("fields")));
        let backslash = br#"{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"d","stream":"s","seq":1,"ts_ms":5,"clock_trusted":true,"fields":{"x":"a\\u0000b"}}"#;
        assert!(
            decode(backslash).is_ok(),
            "a literal backslash is not a NUL"
        );
    }

    #[test]
    fn event_id_parser_rejects_near_misses() {
        assert!(parse_event_id("abababab-abab-abab-abab-abababababab").is_some());
        for bad in [
            "abababab-abab-abab-abab-ababababab",
            "abababababababababababababababababab",
            "abababab-abab-abab-abab-abababababag",
            "abababab-abab-abab-abab+abababababab",
        ] {
            assert!(parse_event_id(bad).is_none(), "{bad}");
        }
    }
}
