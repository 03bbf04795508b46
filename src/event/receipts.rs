//! Receipts on the wire: the fleet's word that its database stored an
//! event.
//!
//! A PUBACK proves the broker has a message, nothing more: brokers drop
//! acknowledged QoS 1 messages (queue caps, a local relay restarted, lossy
//! persistence). With `mqtt.retire_on = "receipt"` a PUBACKed row waits
//! (`crate::delivery::awaiting`) until a receipt from the sink names its
//! own event id; only then is it retired (`ACKED`). Its one rule: **a
//! receipt is parsed whole or refused whole.**
//!
//! Wire format, on `<topic_prefix>/receipts` (QoS 1, JSON, at most
//! [`MAX_RECEIPT_BYTES`] bytes and [`MAX_RECEIPT_EVENTS`] ids):
//!
//! ```text
//! {"v":1,"stored":{"<stream>":["<event id>", ...], ...}}
//! ```
//!
//! An event id is the hyphenated lowercase form (36 characters) the
//! envelope carries; [`parse`] gives them as [`EventId`]s, and a receipt
//! naming any other string is refused. Pure: time is passed in, nothing
//! here does I/O.

use crate::event::envelope::EventId;
use crate::event::stream::topic_safe;

/// Largest receipt accepted, bytes.
pub const MAX_RECEIPT_BYTES: usize = 64 * 1024;
/// Most event ids one receipt may name; the sink splits larger sets.
pub const MAX_RECEIPT_EVENTS: usize = 1024;
/// Most streams one receipt may name.
const MAX_RECEIPT_STREAMS: usize = 64;

/// A receipt, checked: per stream, the event ids the sink's database holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Receipt {
    /// `(stream, event ids)`, in the order the receipt gave them.
    pub stored: Vec<(String, Vec<EventId>)>,
}

impl Receipt {
    /// Event ids named, all streams.
    pub fn len(&self) -> usize {
        self.stored.iter().map(|(_, ids)| ids.len()).sum()
    }

    /// Whether it names no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a receipt was refused (it retires nothing; the caller counts it as
/// `receipts_malformed` and logs the reason, rate-limited).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    /// Larger than [`MAX_RECEIPT_BYTES`].
    #[error("receipt of {0} bytes is over the limit of {MAX_RECEIPT_BYTES}")]
    TooLarge(usize),
    /// Not the JSON shape above (the parser's message).
    #[error("receipt is not {{\"v\":1,\"stored\":{{stream:[event ids]}}}}: {0}")]
    Shape(String),
    /// A version this agent does not know.
    #[error("receipt version {0} is not 1")]
    Version(u64),
    /// More than [`MAX_RECEIPT_EVENTS`] ids or too many streams.
    #[error("receipt names {0} events (at most {MAX_RECEIPT_EVENTS})")]
    TooMany(usize),
    /// A stream name that no agent stream can have.
    #[error("receipt names an invalid stream {0:?}")]
    Stream(String),
    /// An event id that is not the 36-character hyphenated form.
    #[error("receipt names an invalid event id {0:?}")]
    EventId(String),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    v: u64,
    stored: serde_json::Map<String, serde_json::Value>,
}

/// Read and check a receipt's payload. Strict: unknown keys, bad stream
/// names, malformed ids and oversized receipts are refused whole.
///
/// Errors: [`ReceiptError`], naming what was wrong.
pub fn parse(payload: &[u8]) -> Result<Receipt, ReceiptError> {
    if payload.len() > MAX_RECEIPT_BYTES {
        return Err(ReceiptError::TooLarge(payload.len()));
    }
    let w: Wire =
        serde_json::from_slice(payload).map_err(|e| ReceiptError::Shape(e.to_string()))?;
    if w.v != 1 {
        return Err(ReceiptError::Version(w.v));
    }
    if w.stored.len() > MAX_RECEIPT_STREAMS {
        return Err(ReceiptError::TooMany(w.stored.len()));
    }
    let mut out = Receipt::default();
    let mut total = 0usize;
    for (stream, ids) in w.stored {
        if stream.is_empty() || stream.len() > 64 || !stream.chars().all(topic_safe) {
            return Err(ReceiptError::Stream(stream));
        }
        let serde_json::Value::Array(ids) = ids else {
            return Err(ReceiptError::Shape(format!(
                "stored.{stream} is not an array"
            )));
        };
        total += ids.len();
        if total > MAX_RECEIPT_EVENTS {
            return Err(ReceiptError::TooMany(total));
        }
        let mut list = Vec::with_capacity(ids.len());
        for id in ids {
            match id.as_str().and_then(EventId::parse) {
                Some(id) => list.push(id),
                None => return Err(ReceiptError::EventId(id.to_string())),
            }
        }
        out.stored.push((stream, list));
    }
    Ok(out)
}

/// The payloads of receipts for `stored` (`(stream, event id)` pairs, in
/// any order), each within [`MAX_RECEIPT_EVENTS`] ids. The ids are text
/// here, as the sink reads them from payloads and its database; it names
/// only those [`event_id_ok`] accepts.
pub fn encode(stored: &[(&str, &str)]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for chunk in stored.chunks(MAX_RECEIPT_EVENTS) {
        let mut by: Vec<(&str, Vec<&str>)> = Vec::new();
        for (stream, id) in chunk {
            match by.iter_mut().find(|(s, _)| s == stream) {
                Some((_, ids)) => ids.push(id),
                None => by.push((stream, vec![id])),
            }
        }
        // A receipt names at most MAX_RECEIPT_STREAMS streams.
        for part in by.chunks(MAX_RECEIPT_STREAMS) {
            let stored: serde_json::Map<String, serde_json::Value> = part
                .iter()
                .map(|(s, ids)| ((*s).to_owned(), serde_json::json!(ids)))
                .collect();
            out.push(
                serde_json::json!({"v": 1, "stored": stored})
                    .to_string()
                    .into_bytes(),
            );
        }
    }
    out
}

/// Whether `s` is an event id as the envelope writes it: 8-4-4-4-12
/// lowercase hex ([`EventId::parse`]).
pub fn event_id_ok(s: &str) -> bool {
    EventId::parse(s).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123abcd-0000-4000-8000-00000000000a";
    const B: &str = "0123abcd-0000-4000-8000-00000000000b";
    const C: &str = "0123abcd-0000-4000-8000-00000000000c";

    fn id(s: &str) -> EventId {
        EventId::parse(s).expect("a test id")
    }

    #[test]
    fn a_receipt_round_trips_and_names_its_streams() {
        let bytes = encode(&[("s", A), ("t", B), ("s", C)]);
        assert_eq!(bytes.len(), 1);
        let r = parse(&bytes[0]).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(
            r.stored,
            vec![
                ("s".to_owned(), vec![id(A), id(C)]),
                ("t".to_owned(), vec![id(B)])
            ]
        );
    }

    #[test]
    fn malformed_receipts_are_refused_whole() {
        let cases: &[(&[u8], &str)] = &[
            (b"not json", "is not"),
            (br#"{"v":2,"stored":{}}"#, "version 2"),
            (br#"{"v":1,"stored":{},"x":1}"#, "unknown field"),
            (br#"{"v":1,"stored":{"s":"a"}}"#, "not an array"),
            (br#"{"v":1,"stored":{"a/b":[]}}"#, "invalid stream"),
            (br#"{"v":1,"stored":{"s":["nope"]}}"#, "invalid event id"),
            (br#"{"v":1,"stored":{"s":[1]}}"#, "invalid event id"),
            (
                br#"{"v":1,"stored":{"s":["0123ABCD-0000-4000-8000-00000000000a"]}}"#,
                "invalid event id",
            ),
        ];
        for (p, want) in cases {
            let e = parse(p).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", String::from_utf8_lossy(p));
        }
        let big = vec![b' '; MAX_RECEIPT_BYTES + 1];
        assert_eq!(
            parse(&big),
            Err(ReceiptError::TooLarge(MAX_RECEIPT_BYTES + 1))
        );
        let many: Vec<(&str, &str)> = (0..=MAX_RECEIPT_EVENTS).map(|_| ("s", A)).collect();
        let mut one = String::from(r#"{"v":1,"stored":{"s":["#);
        one.push_str(&vec![format!("\"{A}\""); many.len()].join(","));
        one.push_str("]}}");
        assert!(matches!(
            parse(one.as_bytes()),
            Err(ReceiptError::TooMany(_))
        ));
        // The encoder splits what one receipt may not hold.
        assert_eq!(encode(&many).len(), 2);
    }

    #[test]
    fn only_the_envelopes_id_form_is_an_event_id() {
        assert!(event_id_ok(A));
        assert!(!event_id_ok(&A.replace('-', "x")));
        assert!(!event_id_ok(&A[1..]));
        assert!(!event_id_ok(&A.to_uppercase()));
    }
}
