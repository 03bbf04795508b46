//! Receipts on the wire: the fleet's signed word that its database stored
//! these bytes of this board's events.
//!
//! A PUBACK proves the broker has a message, nothing more: brokers drop
//! acknowledged QoS 1 messages (queue caps, a local relay restarted, lossy
//! persistence). With `mqtt.retire_on = "receipt"` a PUBACKed row waits
//! (`crate::delivery::awaiting`) until a receipt names its own stream,
//! event id and payload digest; only then is it retired (`ACKED`).
//!
//! Its one rule: **a receipt retires data only under a signature by a key
//! the board trusts, over the board's name and each event's id and
//! digest** ([`Receipt::check`]). A name on a topic is no proof: anyone
//! who can publish there (a local program, the broker itself) could send
//! it. Receipts are parsed whole or refused whole.
//!
//! Wire format, on `<topic_prefix>/receipts` (QoS 1, JSON, at most
//! [`MAX_RECEIPT_BYTES`] bytes and [`MAX_RECEIPT_EVENTS`] events):
//!
//! ```text
//! {"v":2,"board":"<device_id>","key":"<64 hex: the signer's public key>",
//!  "stored":{"<stream>":["<event id>:<sha256 of its payload, 64 hex>", ...], ...},
//!  "sig":"<128 hex: Ed25519 signature>"}
//! ```
//!
//! The signature (RFC 8032, [`Domain::Receipt`]) is over [`Receipt::body`]:
//! the board's name, then per stream in byte order of its name, the name,
//! the count and each event's 16-byte id and 32-byte digest, in the order
//! the receipt gives them, every length fixed or prefixed, so no two
//! receipts share signed bytes. The event id is the hyphenated lowercase
//! form (36 characters) the envelope carries. Version 1 receipts (no
//! board, digests or signature) are refused as [`ReceiptError::Unsigned`].
//! Pure: nothing here does I/O.

use crate::event::envelope::EventId;
use crate::event::signature::{Domain, PublicKey, SigningKey, SIGNATURE_BYTES};
use crate::event::stream::topic_safe;
use std::collections::BTreeMap;

/// Largest receipt accepted, bytes: [`MAX_RECEIPT_EVENTS`] entries of 104
/// bytes (id, digest, quotes, separators) and the rest.
pub const MAX_RECEIPT_BYTES: usize = 128 * 1024;
/// Most events one receipt may name; the sink splits larger sets.
pub const MAX_RECEIPT_EVENTS: usize = 1024;
/// Most streams one receipt may name.
const MAX_RECEIPT_STREAMS: usize = 64;
/// Longest board name (device_id) a receipt may carry, bytes.
const MAX_BOARD_BYTES: usize = 128;

/// One event a receipt names: its id and the sha256 of its payload bytes.
pub type Stored = (EventId, [u8; 32]);

/// A receipt, parsed (its shape checked, its signature not yet: see
/// [`Receipt::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The board it is for (the device_id the sink took from the topic).
    pub board: String,
    /// The public key that signed it.
    pub key: PublicKey,
    /// `(stream, events)`, streams in byte order of their names, events in
    /// the order the receipt gave them.
    pub stored: Vec<(String, Vec<Stored>)>,
    /// The signature over [`Receipt::body`].
    pub sig: [u8; SIGNATURE_BYTES],
}

/// Why a receipt was refused whole (it retires nothing; the caller counts
/// it by [`ReceiptError::reason`] and logs it, rate-limited).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    /// Larger than [`MAX_RECEIPT_BYTES`].
    #[error("receipt of {0} bytes is over the limit of {MAX_RECEIPT_BYTES}")]
    TooLarge(usize),
    /// Not the JSON shape above (the parser's message).
    #[error("receipt is not {{\"v\":2,\"board\",\"key\",\"stored\",\"sig\"}}: {0}")]
    Shape(String),
    /// A version 1 receipt: names only, no signature; anyone could send it.
    #[error(
        "receipt is unsigned (version 1): a name on a topic proves nothing, it retires nothing"
    )]
    Unsigned,
    /// A version this agent does not know.
    #[error("receipt version {0} is not 2")]
    Version(u64),
    /// More than [`MAX_RECEIPT_EVENTS`] events or too many streams.
    #[error("receipt names {0} events or streams (at most {MAX_RECEIPT_EVENTS} events, {MAX_RECEIPT_STREAMS} streams)")]
    TooMany(usize),
    /// A stream name that no agent stream can have.
    #[error("receipt names an invalid stream {0:?}")]
    Stream(String),
    /// An entry that is not `<event id>:<64 hex>`.
    #[error("receipt names an invalid event {0:?} (want <event id>:<sha256 hex>)")]
    Event(String),
    /// The key or signature is not hex of the right length.
    #[error("receipt's {0} is not hex of the right length")]
    Hex(&'static str),
    /// Signed for another board.
    #[error("receipt is for board {0:?}, not this one")]
    OtherBoard(String),
    /// Signed by a key this board does not list (`mqtt.receipt_public_keys`).
    #[error("receipt is signed by key {0}, which mqtt.receipt_public_keys does not list")]
    UntrustedKey(String),
    /// The signature does not verify over the receipt's contents.
    #[error("receipt's signature does not verify (forged or altered)")]
    BadSignature,
}

impl ReceiptError {
    /// The counter suffix this refusal is counted under
    /// (`receipts_refused_<reason>`).
    pub fn reason(&self) -> &'static str {
        match self {
            ReceiptError::Unsigned => "unsigned",
            ReceiptError::OtherBoard(_) => "other_board",
            ReceiptError::UntrustedKey(_) => "untrusted_key",
            ReceiptError::BadSignature => "bad_signature",
            _ => "malformed",
        }
    }
}

#[derive(serde::Deserialize)]
struct Version {
    v: u64,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    #[allow(dead_code)]
    v: u64,
    board: String,
    key: String,
    stored: BTreeMap<String, Vec<String>>,
    sig: String,
}

impl Receipt {
    /// Events named, all streams.
    pub fn len(&self) -> usize {
        self.stored.iter().map(|(_, e)| e.len()).sum()
    }

    /// Whether it names no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the signature covers (after [`Domain::Receipt`]'s label).
    pub fn body(&self) -> Vec<u8> {
        body(&self.board, &self.stored)
    }

    /// Whether this receipt may retire rows of `board`: for it, signed by
    /// one of `trusted`, and the signature verifies.
    ///
    /// Errors: [`ReceiptError::OtherBoard`], [`ReceiptError::UntrustedKey`],
    /// [`ReceiptError::BadSignature`].
    pub fn check(&self, board: &str, trusted: &[PublicKey]) -> Result<(), ReceiptError> {
        if self.board != board {
            return Err(ReceiptError::OtherBoard(self.board.clone()));
        }
        if !trusted.contains(&self.key) {
            return Err(ReceiptError::UntrustedKey(self.key.hex()));
        }
        if !self.key.verifies(Domain::Receipt, &self.body(), &self.sig) {
            return Err(ReceiptError::BadSignature);
        }
        Ok(())
    }
}

/// The signed bytes: the board's name (length-prefixed), the stream count,
/// then per stream its name (length-prefixed), its event count and each
/// event's id and digest. `stored` must be in byte order of stream names
/// (as [`parse`] gives it and [`encode`] writes it).
fn body(board: &str, stored: &[(String, Vec<Stored>)]) -> Vec<u8> {
    let n: usize = stored.iter().map(|(_, e)| e.len()).sum();
    let mut out = Vec::with_capacity(8 + board.len() + 72 * stored.len() + 48 * n);
    out.push(board.len() as u8);
    out.extend_from_slice(board.as_bytes());
    out.extend_from_slice(&(stored.len() as u32).to_be_bytes());
    for (stream, events) in stored {
        out.push(stream.len() as u8);
        out.extend_from_slice(stream.as_bytes());
        out.extend_from_slice(&(events.len() as u32).to_be_bytes());
        for (id, digest) in events {
            out.extend_from_slice(&id.0);
            out.extend_from_slice(digest);
        }
    }
    out
}

fn hex_array<const N: usize>(s: &str, what: &'static str) -> Result<[u8; N], ReceiptError> {
    let bytes = crate::event::hex::decode(s)
        .filter(|b| b.len() == N)
        .ok_or(ReceiptError::Hex(what))?;
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes);
    Ok(out)
}

/// `<event id>:<64 hex>`.
fn parse_event(s: &str) -> Option<Stored> {
    let (id, digest) = s.split_once(':')?;
    let id = EventId::parse(id)?;
    // Hex digits are written lowercase: one event, one spelling.
    if digest.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    let digest = hex_array::<32>(digest, "digest").ok()?;
    Some((id, digest))
}

/// Read and check a receipt's shape. Strict: unknown keys, bad stream
/// names, malformed events, keys or signatures and oversized receipts are
/// refused whole. The signature is judged by [`Receipt::check`].
///
/// Errors: [`ReceiptError`], naming what was wrong.
pub fn parse(payload: &[u8]) -> Result<Receipt, ReceiptError> {
    if payload.len() > MAX_RECEIPT_BYTES {
        return Err(ReceiptError::TooLarge(payload.len()));
    }
    let v: Version =
        serde_json::from_slice(payload).map_err(|e| ReceiptError::Shape(e.to_string()))?;
    match v.v {
        1 => return Err(ReceiptError::Unsigned),
        2 => {}
        other => return Err(ReceiptError::Version(other)),
    }
    let w: Wire =
        serde_json::from_slice(payload).map_err(|e| ReceiptError::Shape(e.to_string()))?;
    if w.board.is_empty() || w.board.len() > MAX_BOARD_BYTES {
        return Err(ReceiptError::Shape(format!(
            "board is empty or over {MAX_BOARD_BYTES} bytes"
        )));
    }
    if w.stored.len() > MAX_RECEIPT_STREAMS {
        return Err(ReceiptError::TooMany(w.stored.len()));
    }
    let key = PublicKey(hex_array::<32>(&w.key, "key")?);
    let sig = hex_array::<SIGNATURE_BYTES>(&w.sig, "sig")?;
    let mut stored = Vec::with_capacity(w.stored.len());
    let mut total = 0usize;
    // A BTreeMap: streams in byte order of their names, as signed.
    for (stream, entries) in w.stored {
        if stream.is_empty() || stream.len() > 64 || !stream.chars().all(topic_safe) {
            return Err(ReceiptError::Stream(stream));
        }
        total += entries.len();
        if total > MAX_RECEIPT_EVENTS {
            return Err(ReceiptError::TooMany(total));
        }
        let events = entries
            .iter()
            .map(|e| {
                parse_event(e).ok_or_else(|| ReceiptError::Event(e.chars().take(120).collect()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        stored.push((stream, events));
    }
    Ok(Receipt {
        board: w.board,
        key,
        stored,
        sig,
    })
}

/// The payloads of signed receipts telling `board` that its events
/// `stored` (`(stream, event id, digest)`, in any order) are stored, each
/// within [`MAX_RECEIPT_EVENTS`] events and [`MAX_RECEIPT_STREAMS`]
/// streams, signed by `key`. A stream name [`parse`] would refuse is left
/// out (it would cost the whole receipt).
pub fn encode(board: &str, stored: &[(&str, EventId, [u8; 32])], key: &SigningKey) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let board: String = board.chars().take(MAX_BOARD_BYTES).collect();
    for chunk in stored.chunks(MAX_RECEIPT_EVENTS) {
        let mut by: BTreeMap<&str, Vec<Stored>> = BTreeMap::new();
        for (stream, id, digest) in chunk {
            if stream.is_empty() || stream.len() > 64 || !stream.chars().all(topic_safe) {
                continue;
            }
            by.entry(stream).or_default().push((*id, *digest));
        }
        let streams: Vec<(String, Vec<Stored>)> =
            by.into_iter().map(|(s, e)| (s.to_owned(), e)).collect();
        for part in streams.chunks(MAX_RECEIPT_STREAMS) {
            out.push(encode_one(&board, part, key));
        }
    }
    out
}

fn encode_one(board: &str, part: &[(String, Vec<Stored>)], key: &SigningKey) -> Vec<u8> {
    let sig = key.sign(Domain::Receipt, &body(board, part));
    let stored: serde_json::Map<String, serde_json::Value> = part
        .iter()
        .map(|(s, events)| {
            let list: Vec<String> = events
                .iter()
                .map(|(id, d)| format!("{id}:{}", crate::event::hex::encode(d)))
                .collect();
            (s.clone(), serde_json::json!(list))
        })
        .collect();
    serde_json::json!({
        "v": 2,
        "board": board,
        "key": key.public().hex(),
        "stored": stored,
        "sig": crate::event::hex::encode(&sig),
    })
    .to_string()
    .into_bytes()
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

    fn key() -> SigningKey {
        SigningKey::generate().expect("keygen").0
    }

    #[test]
    fn a_signed_receipt_round_trips_and_checks_for_its_board_and_key() {
        let k = key();
        let bytes = encode(
            "gw1",
            &[
                ("t", id(B), [2; 32]),
                ("s", id(A), [1; 32]),
                ("s", id(C), [3; 32]),
            ],
            &k,
        );
        assert_eq!(bytes.len(), 1);
        let r = parse(&bytes[0]).expect("parse");
        assert_eq!(r.len(), 3);
        assert_eq!(
            r.stored,
            vec![
                ("s".to_owned(), vec![(id(A), [1; 32]), (id(C), [3; 32])]),
                ("t".to_owned(), vec![(id(B), [2; 32])])
            ]
        );
        assert_eq!(r.check("gw1", &[k.public()]), Ok(()));
        assert_eq!(
            r.check("gw2", &[k.public()]),
            Err(ReceiptError::OtherBoard("gw1".into()))
        );
        let other = key();
        assert!(matches!(
            r.check("gw1", &[other.public()]),
            Err(ReceiptError::UntrustedKey(_))
        ));
    }

    #[test]
    fn an_altered_receipt_does_not_verify() {
        let k = key();
        let good = String::from_utf8(encode("gw1", &[("s", id(A), [1; 32])], &k).remove(0))
            .expect("utf-8");
        // Another digest, another id, another stream, another board: each
        // keeps the signature and fails it.
        let digest = crate::event::hex::encode(&[1; 32]);
        for altered in [
            good.replace(&digest, &crate::event::hex::encode(&[9; 32])),
            good.replace(A, B),
            good.replace("\"s\"", "\"u\""),
        ] {
            let r = parse(altered.as_bytes()).expect("still well formed");
            assert_eq!(
                r.check("gw1", &[k.public()]),
                Err(ReceiptError::BadSignature),
                "{altered}"
            );
        }
        let r = parse(good.replace("gw1", "gw9").as_bytes()).expect("well formed");
        assert_eq!(
            r.check("gw9", &[k.public()]),
            Err(ReceiptError::BadSignature)
        );
        // A signature made for another kind of message is no receipt's.
        let mut r = parse(good.as_bytes()).expect("parse");
        r.sig = k.sign(Domain::Command, &r.body());
        assert_eq!(
            r.check("gw1", &[k.public()]),
            Err(ReceiptError::BadSignature)
        );
    }

    #[test]
    fn malformed_and_unsigned_receipts_are_refused_whole() {
        let k = key();
        let good = String::from_utf8(encode("gw1", &[("s", id(A), [1; 32])], &k).remove(0))
            .expect("utf-8");
        let v1 = format!(r#"{{"v":1,"stored":{{"s":["{A}"]}}}}"#);
        assert_eq!(parse(v1.as_bytes()), Err(ReceiptError::Unsigned));
        assert_eq!(ReceiptError::Unsigned.reason(), "unsigned");
        let cases: Vec<(String, &str)> = vec![
            ("not json".into(), "is not"),
            (r#"{"v":3}"#.into(), "version 3"),
            (good.replace("\"v\":2", "\"v\":2,\"x\":1"), "unknown field"),
            (good.replace(&format!("{A}:"), "nope:"), "invalid event"),
            (
                good.replace(&format!("{A}:"), &format!("{}:", A.to_uppercase())),
                "invalid event",
            ),
            (good.replace("\"s\"", "\"a/b\""), "invalid stream"),
            (good.replace("\"key\":\"", "\"key\":\"00"), "key"),
            (good.replace("\"sig\":\"", "\"sig\":\"zz"), "sig"),
            (good.replace("\"board\":\"gw1\"", "\"board\":\"\""), "board"),
        ];
        for (p, want) in cases {
            let e = parse(p.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(want), "{p}: {e}");
            assert_eq!(e.reason(), "malformed", "{p}");
        }
        let big = vec![b' '; MAX_RECEIPT_BYTES + 1];
        assert_eq!(
            parse(&big),
            Err(ReceiptError::TooLarge(MAX_RECEIPT_BYTES + 1))
        );
    }

    #[test]
    fn a_full_receipt_fits_its_byte_limit_and_larger_sets_are_split() {
        let k = key();
        let ids: Vec<EventId> = (0..MAX_RECEIPT_EVENTS as u32 + 1)
            .map(|i| {
                let mut b = [0u8; 16];
                b[..4].copy_from_slice(&i.to_be_bytes());
                EventId(b)
            })
            .collect();
        let events: Vec<(&str, EventId, [u8; 32])> = ids
            .iter()
            .map(|i| ("a-long-stream-name-x", *i, [7; 32]))
            .collect();
        let out = encode("a-board-with-a-long-device-id", &events, &k);
        assert_eq!(out.len(), 2, "1,025 events make two receipts");
        assert!(out[0].len() <= MAX_RECEIPT_BYTES, "{} bytes", out[0].len());
        let r = parse(&out[0]).expect("the full one parses");
        assert_eq!(r.len(), MAX_RECEIPT_EVENTS);
        assert_eq!(
            r.check("a-board-with-a-long-device-id", &[k.public()]),
            Ok(())
        );
    }

    #[test]
    fn only_the_envelopes_id_form_is_an_event_id() {
        assert!(event_id_ok(A));
        assert!(!event_id_ok(&A.replace('-', "x")));
        assert!(!event_id_ok(&A[1..]));
        assert!(!event_id_ok(&A.to_uppercase()));
    }
}
