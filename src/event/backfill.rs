//! Holdings and backfill on the wire: what a board says it still holds, how
//! the fleet asks it for ranges again, and what the board answers.
//!
//! A restored or partial fleet database cannot see what it lost by itself:
//! nothing arrives for the rows it lost, and an idle board sends nothing at
//! all. So a board announces, per stream, the sequence numbers it holds
//! ([`Holdings`], retained on `<topic_prefix>/holdings`, at every connection
//! and periodically); the sink compares them with its ledger and asks for
//! the missing ranges ([`Request`], on `<topic_prefix>/backfill`); the board
//! sends those rows again, with their own event ids and bytes, and answers
//! what it cannot send ([`Answer`], on `<topic_prefix>/holdings`, not
//! retained).
//!
//! Its one rule: **a request makes a board send anything only under a
//! signature by a key the board trusts, for this board, naming a nonce the
//! board announced** ([`Request::check`]). A name on a topic is no proof,
//! and the nonce (fresh at every announcement, kept for a few) makes an old
//! request worthless without depending on any clock: a replay of a request
//! seen before is caught by its id. Everything is parsed whole or refused
//! whole, and bounded in bytes, streams and ranges.
//!
//! ```text
//! <topic_prefix>/holdings (board → fleet, retained):
//! {"v":1,"kind":"holdings","board":"gw1","nonce":"<32 hex>",
//!  "streams":{"<stream>":[<oldest held>,<newest appended>,<first not yet delivered>],...},"more":false}
//! <topic_prefix>/holdings (board → fleet, an answer, not retained):
//! {"v":1,"kind":"answer","board":"gw1","request":"<32 hex>","queued":N,
//!  "gone":{"<stream>":[[first,last,"<reason>"],...]},"pending":{"<stream>":[[first,last],...]}}
//! <topic_prefix>/backfill (fleet → board):
//! {"v":1,"board":"gw1","nonce":"<32 hex>","id":"<32 hex>","at_ms":T,
//!  "ranges":{"<stream>":[[first,last],...]},"key":"<64 hex>","sig":"<128 hex>"}
//! ```
//!
//! The signature (RFC 8032, [`Domain::Backfill`]) covers [`Request::body`]:
//! the board's name, the nonce, the id, the time, then per stream in byte
//! order of its name the name, the range count and each range's two
//! numbers, every length fixed or prefixed. Pure: nothing here does I/O.

use crate::event::signature::{Domain, PublicKey, SigningKey, SIGNATURE_BYTES};
use crate::event::stream::topic_safe;
use std::collections::BTreeMap;

/// Largest request accepted, bytes.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;
/// Most ranges one request may name, all streams.
pub const MAX_REQUEST_RANGES: usize = 256;
/// Largest holdings or answer message accepted, bytes.
pub const MAX_NOTE_BYTES: usize = 64 * 1024;
/// Most streams one holdings message names (the rest: `more`).
pub const MAX_HOLDINGS_STREAMS: usize = 256;
/// Most ranges one answer names, all streams and both lists.
pub const MAX_ANSWER_RANGES: usize = 512;
/// Longest board name (device_id), bytes.
const MAX_BOARD_BYTES: usize = 128;

/// 16 random bytes: a nonce or a request id.
pub type Token = [u8; 16];

/// A fresh [`Token`] from the system's random source.
///
/// Errors: the random source failed (the message says so).
pub fn fresh_token() -> Result<Token, String> {
    use ring::rand::SecureRandom;
    let mut t = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut t)
        .map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(t)
}

/// What a board holds of one stream: sequence numbers `oldest..=newest` are
/// appended and still kept (save rows retention took out of order), and
/// those from `pending` on may still come by ordinary delivery (not every
/// row there is acknowledged yet). `oldest > newest`: none is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The oldest sequence number still kept.
    pub oldest: i64,
    /// The newest sequence number appended.
    pub newest: i64,
    /// The first sequence number not yet delivered (acknowledged, or
    /// receipted in receipt mode); `newest + 1` when all are.
    pub pending: i64,
}

/// A board's announcement of what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    /// The board (its device_id).
    pub board: String,
    /// The nonce a request must name to be answered.
    pub nonce: Token,
    /// Per stream, in byte order of the names.
    pub streams: Vec<(String, Held)>,
    /// More streams than [`MAX_HOLDINGS_STREAMS`]: the rest are left out.
    pub more: bool,
}

/// Why a board cannot send a range again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GoneReason {
    /// Deleted by retention (or for space) after it was delivered.
    Retention,
    /// FAILED on the board (never delivered; kept until requeued).
    Failed,
    /// Beyond the newest sequence number the board ever appended.
    Beyond,
    /// Its stored bytes no longer match their digest: it is never sent with
    /// other bytes than the first time.
    Damaged,
}

impl GoneReason {
    /// The word on the wire (and in the sink's ledger).
    pub fn word(self) -> &'static str {
        match self {
            GoneReason::Retention => "retention",
            GoneReason::Failed => "failed",
            GoneReason::Beyond => "beyond",
            GoneReason::Damaged => "damaged",
        }
    }

    fn from_word(w: &str) -> Option<GoneReason> {
        [
            GoneReason::Retention,
            GoneReason::Failed,
            GoneReason::Beyond,
            GoneReason::Damaged,
        ]
        .into_iter()
        .find(|r| r.word() == w)
    }
}

/// Ranges a board cannot send, with why, per stream.
pub type GoneRanges = Vec<(String, Vec<(i64, i64, GoneReason)>)>;

/// A board's answer to one request (it may come in several parts).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Answer {
    /// The board.
    pub board: String,
    /// The request's id.
    pub request: Token,
    /// Rows queued to be sent again for it (this part).
    pub queued: u64,
    /// Ranges the board cannot send, with why, per stream.
    pub gone: GoneRanges,
    /// Ranges not yet delivered: they come by ordinary delivery.
    pub pending: Vec<(String, Vec<(i64, i64)>)>,
}

/// A message on `<topic_prefix>/holdings`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// What the board holds.
    Holdings(Holdings),
    /// An answer to a request.
    Answer(Answer),
}

/// A request for ranges again, parsed (shape checked; see [`Request::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The board it is for.
    pub board: String,
    /// The nonce of the board's announcement it answers.
    pub nonce: Token,
    /// Its own id (a board answers an id once).
    pub id: Token,
    /// When the sink made it, Unix ms (its clock).
    pub at_ms: i64,
    /// Per stream in byte order of the names: ranges `first..=last`.
    pub ranges: Vec<(String, Vec<(i64, i64)>)>,
    /// The signer's public key.
    pub key: PublicKey,
    /// The signature over [`Request::body`].
    pub sig: [u8; SIGNATURE_BYTES],
}

/// Why a message on these topics was refused whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackfillError {
    /// Over its byte limit.
    #[error("{0} bytes is over the limit of {1}")]
    TooLarge(usize, usize),
    /// Not the JSON shape above.
    #[error("not a backfill message of version 1: {0}")]
    Shape(String),
    /// A stream name no agent stream can have.
    #[error("invalid stream {0:?}")]
    Stream(String),
    /// A range that is not `first <= last`, both at least 1.
    #[error("invalid range {0}..={1}")]
    Range(i64, i64),
    /// More streams or ranges than the bounds.
    #[error("{0} streams or ranges (over the bound)")]
    TooMany(usize),
    /// A nonce, id, key or signature that is not hex of its length.
    #[error("{0} is not hex of the right length")]
    Hex(&'static str),
    /// Signed for another board.
    #[error("request is for board {0:?}, not this one")]
    OtherBoard(String),
    /// Signed by a key `mqtt.receipt_public_keys` does not list.
    #[error("request is signed by key {0}, which mqtt.receipt_public_keys does not list")]
    UntrustedKey(String),
    /// The signature does not verify.
    #[error("request's signature does not verify (forged or altered)")]
    BadSignature,
}

impl BackfillError {
    /// The counter suffix a refused request is counted under.
    pub fn reason(&self) -> &'static str {
        match self {
            BackfillError::OtherBoard(_) => "other_board",
            BackfillError::UntrustedKey(_) => "untrusted_key",
            BackfillError::BadSignature => "bad_signature",
            _ => "malformed",
        }
    }
}

fn shape(e: impl std::fmt::Display) -> BackfillError {
    BackfillError::Shape(e.to_string())
}

fn stream_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(topic_safe)
}

fn board_ok(b: &str) -> Result<(), BackfillError> {
    match !b.is_empty() && b.len() <= MAX_BOARD_BYTES {
        true => Ok(()),
        false => Err(shape(format!(
            "board is empty or over {MAX_BOARD_BYTES} bytes"
        ))),
    }
}

fn range_ok(first: i64, last: i64) -> Result<(), BackfillError> {
    match first >= 1 && first <= last {
        true => Ok(()),
        false => Err(BackfillError::Range(first, last)),
    }
}

fn hex_array<const N: usize>(s: &str, what: &'static str) -> Result<[u8; N], BackfillError> {
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(BackfillError::Hex(what));
    }
    let bytes = crate::event::hex::decode(s)
        .filter(|b| b.len() == N)
        .ok_or(BackfillError::Hex(what))?;
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes);
    Ok(out)
}

/// The payload of `h` (JSON, at most [`MAX_HOLDINGS_STREAMS`] streams: the
/// caller leaves the rest out and sets `more`).
pub fn encode_holdings(h: &Holdings) -> Vec<u8> {
    let streams: serde_json::Map<String, serde_json::Value> = h
        .streams
        .iter()
        .take(MAX_HOLDINGS_STREAMS)
        .map(|(s, x)| {
            (
                s.clone(),
                serde_json::json!([x.oldest, x.newest, x.pending]),
            )
        })
        .collect();
    serde_json::json!({
        "v": 1,
        "kind": "holdings",
        "board": h.board,
        "nonce": crate::event::hex::encode(&h.nonce),
        "streams": streams,
        "more": h.more || h.streams.len() > MAX_HOLDINGS_STREAMS,
    })
    .to_string()
    .into_bytes()
}

/// The payload of `a` (JSON). Ranges beyond [`MAX_ANSWER_RANGES`] are left
/// out: the sink asks again for what it still misses.
pub fn encode_answer(a: &Answer) -> Vec<u8> {
    let mut left = MAX_ANSWER_RANGES;
    let mut gone = serde_json::Map::new();
    for (s, list) in &a.gone {
        let n = list.len().min(left);
        left -= n;
        let v: Vec<serde_json::Value> = list[..n]
            .iter()
            .map(|(f, l, r)| serde_json::json!([f, l, r.word()]))
            .collect();
        if !v.is_empty() {
            gone.insert(s.clone(), serde_json::Value::Array(v));
        }
    }
    let mut pending = serde_json::Map::new();
    for (s, list) in &a.pending {
        let n = list.len().min(left);
        left -= n;
        let v: Vec<serde_json::Value> = list[..n]
            .iter()
            .map(|(f, l)| serde_json::json!([f, l]))
            .collect();
        if !v.is_empty() {
            pending.insert(s.clone(), serde_json::Value::Array(v));
        }
    }
    serde_json::json!({
        "v": 1,
        "kind": "answer",
        "board": a.board,
        "request": crate::event::hex::encode(&a.request),
        "queued": a.queued,
        "gone": gone,
        "pending": pending,
    })
    .to_string()
    .into_bytes()
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldingsWire {
    #[allow(dead_code)]
    v: u64,
    #[allow(dead_code)]
    kind: String,
    board: String,
    nonce: String,
    streams: BTreeMap<String, (i64, i64, i64)>,
    more: bool,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerWire {
    #[allow(dead_code)]
    v: u64,
    #[allow(dead_code)]
    kind: String,
    board: String,
    request: String,
    queued: u64,
    gone: BTreeMap<String, Vec<(i64, i64, String)>>,
    pending: BTreeMap<String, Vec<(i64, i64)>>,
}

#[derive(serde::Deserialize)]
struct Kind {
    v: u64,
    kind: String,
}

/// Read a message of `<topic_prefix>/holdings`, strictly.
///
/// Errors: [`BackfillError`] naming what was wrong.
pub fn parse_note(payload: &[u8]) -> Result<Note, BackfillError> {
    if payload.len() > MAX_NOTE_BYTES {
        return Err(BackfillError::TooLarge(payload.len(), MAX_NOTE_BYTES));
    }
    let k: Kind = serde_json::from_slice(payload).map_err(shape)?;
    if k.v != 1 {
        return Err(shape(format!("version {}", k.v)));
    }
    match k.kind.as_str() {
        "holdings" => parse_holdings(payload).map(Note::Holdings),
        "answer" => parse_answer(payload).map(Note::Answer),
        other => Err(shape(format!("kind {other:?}"))),
    }
}

fn parse_holdings(payload: &[u8]) -> Result<Holdings, BackfillError> {
    let w: HoldingsWire = serde_json::from_slice(payload).map_err(shape)?;
    board_ok(&w.board)?;
    if w.streams.len() > MAX_HOLDINGS_STREAMS {
        return Err(BackfillError::TooMany(w.streams.len()));
    }
    let mut streams = Vec::with_capacity(w.streams.len());
    for (s, (oldest, newest, pending)) in w.streams {
        if !stream_ok(&s) {
            return Err(BackfillError::Stream(s));
        }
        // `oldest` may pass `newest` by one (nothing kept); `pending` lies
        // in 1..=newest + 1.
        let fine = newest >= 0
            && (1..=newest.saturating_add(1)).contains(&oldest)
            && (1..=newest.saturating_add(1)).contains(&pending);
        if !fine {
            return Err(BackfillError::Range(oldest, newest));
        }
        streams.push((
            s,
            Held {
                oldest,
                newest,
                pending,
            },
        ));
    }
    Ok(Holdings {
        board: w.board,
        nonce: hex_array(&w.nonce, "nonce")?,
        streams,
        more: w.more,
    })
}

fn parse_answer(payload: &[u8]) -> Result<Answer, BackfillError> {
    let w: AnswerWire = serde_json::from_slice(payload).map_err(shape)?;
    board_ok(&w.board)?;
    let n: usize = w.gone.values().map(Vec::len).sum::<usize>()
        + w.pending.values().map(Vec::len).sum::<usize>();
    if n > MAX_ANSWER_RANGES || w.gone.len() + w.pending.len() > 2 * MAX_HOLDINGS_STREAMS {
        return Err(BackfillError::TooMany(n));
    }
    let mut gone = Vec::new();
    for (s, list) in w.gone {
        if !stream_ok(&s) {
            return Err(BackfillError::Stream(s));
        }
        let mut out = Vec::with_capacity(list.len());
        for (f, l, why) in list {
            range_ok(f, l)?;
            let r = GoneReason::from_word(&why).ok_or_else(|| shape(format!("reason {why:?}")))?;
            out.push((f, l, r));
        }
        gone.push((s, out));
    }
    let mut pending = Vec::new();
    for (s, list) in w.pending {
        if !stream_ok(&s) {
            return Err(BackfillError::Stream(s));
        }
        for (f, l) in &list {
            range_ok(*f, *l)?;
        }
        pending.push((s, list));
    }
    Ok(Answer {
        board: w.board,
        request: hex_array(&w.request, "request")?,
        queued: w.queued,
        gone,
        pending,
    })
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestWire {
    v: u64,
    board: String,
    nonce: String,
    id: String,
    at_ms: i64,
    ranges: BTreeMap<String, Vec<(i64, i64)>>,
    key: String,
    sig: String,
}

impl Request {
    /// Rows the request names, all ranges (saturating: a range of billions
    /// is well-formed, and bounded by the board).
    pub fn rows(&self) -> u64 {
        self.ranges
            .iter()
            .flat_map(|(_, r)| r.iter())
            .map(|(f, l)| (l - f) as u64 + 1)
            .fold(0u64, u64::saturating_add)
    }

    /// The bytes the signature covers (after [`Domain::Backfill`]'s label).
    pub fn body(&self) -> Vec<u8> {
        body(&self.board, &self.nonce, &self.id, self.at_ms, &self.ranges)
    }

    /// Whether this request may make `board` send anything: for it, signed
    /// by one of `trusted`, and the signature verifies. Freshness (the
    /// nonce, the id) is the board's to judge.
    ///
    /// Errors: [`BackfillError::OtherBoard`], [`BackfillError::UntrustedKey`],
    /// [`BackfillError::BadSignature`].
    pub fn check(&self, board: &str, trusted: &[PublicKey]) -> Result<(), BackfillError> {
        if self.board != board {
            return Err(BackfillError::OtherBoard(self.board.clone()));
        }
        if !trusted.contains(&self.key) {
            return Err(BackfillError::UntrustedKey(self.key.hex()));
        }
        if !self.key.verifies(Domain::Backfill, &self.body(), &self.sig) {
            return Err(BackfillError::BadSignature);
        }
        Ok(())
    }
}

/// The signed bytes of a request: board (length-prefixed), nonce, id, time
/// (i64 big-endian), the stream count, then per stream its name
/// (length-prefixed), its range count and each range as two i64.
fn body(
    board: &str,
    nonce: &Token,
    id: &Token,
    at_ms: i64,
    ranges: &[(String, Vec<(i64, i64)>)],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + board.len() + 80 * ranges.len());
    out.push(board.len() as u8);
    out.extend_from_slice(board.as_bytes());
    out.extend_from_slice(nonce);
    out.extend_from_slice(id);
    out.extend_from_slice(&at_ms.to_be_bytes());
    out.extend_from_slice(&(ranges.len() as u32).to_be_bytes());
    for (stream, list) in ranges {
        out.push(stream.len() as u8);
        out.extend_from_slice(stream.as_bytes());
        out.extend_from_slice(&(list.len() as u32).to_be_bytes());
        for (f, l) in list {
            out.extend_from_slice(&f.to_be_bytes());
            out.extend_from_slice(&l.to_be_bytes());
        }
    }
    out
}

/// Read a request, strictly (its signature is judged by [`Request::check`]).
///
/// Errors: [`BackfillError`] naming what was wrong.
pub fn parse_request(payload: &[u8]) -> Result<Request, BackfillError> {
    if payload.len() > MAX_REQUEST_BYTES {
        return Err(BackfillError::TooLarge(payload.len(), MAX_REQUEST_BYTES));
    }
    let w: RequestWire = serde_json::from_slice(payload).map_err(shape)?;
    if w.v != 1 {
        return Err(shape(format!("version {}", w.v)));
    }
    board_ok(&w.board)?;
    let n: usize = w.ranges.values().map(Vec::len).sum();
    if n > MAX_REQUEST_RANGES || w.ranges.len() > MAX_HOLDINGS_STREAMS {
        return Err(BackfillError::TooMany(n));
    }
    let mut ranges = Vec::with_capacity(w.ranges.len());
    // A BTreeMap: streams in byte order of their names, as signed.
    for (s, list) in w.ranges {
        if !stream_ok(&s) {
            return Err(BackfillError::Stream(s));
        }
        for (f, l) in &list {
            range_ok(*f, *l)?;
        }
        ranges.push((s, list));
    }
    Ok(Request {
        board: w.board,
        nonce: hex_array(&w.nonce, "nonce")?,
        id: hex_array(&w.id, "id")?,
        at_ms: w.at_ms,
        ranges,
        key: PublicKey(hex_array(&w.key, "key")?),
        sig: hex_array(&w.sig, "sig")?,
    })
}

/// The payload of a request for `ranges` (per stream; streams are put in
/// byte order of their names, a stream [`parse_request`] would refuse is
/// left out, and at most [`MAX_REQUEST_RANGES`] ranges are kept), signed by
/// `key`.
pub fn encode_request(
    board: &str,
    nonce: &Token,
    id: &Token,
    at_ms: i64,
    ranges: &[(String, Vec<(i64, i64)>)],
    key: &SigningKey,
) -> Vec<u8> {
    let mut by: BTreeMap<&str, Vec<(i64, i64)>> = BTreeMap::new();
    let mut left = MAX_REQUEST_RANGES;
    for (s, list) in ranges {
        if !stream_ok(s) || left == 0 {
            continue;
        }
        let keep: Vec<(i64, i64)> = list
            .iter()
            .copied()
            .filter(|(f, l)| *f >= 1 && f <= l)
            .take(left)
            .collect();
        left -= keep.len();
        if !keep.is_empty() {
            by.entry(s).or_default().extend(keep);
        }
    }
    let ranges: Vec<(String, Vec<(i64, i64)>)> =
        by.into_iter().map(|(s, r)| (s.to_owned(), r)).collect();
    let board: String = board.chars().take(MAX_BOARD_BYTES).collect();
    let sig = key.sign(Domain::Backfill, &body(&board, nonce, id, at_ms, &ranges));
    let map: serde_json::Map<String, serde_json::Value> = ranges
        .iter()
        .map(|(s, r)| (s.clone(), serde_json::json!(r)))
        .collect();
    serde_json::json!({
        "v": 1,
        "board": board,
        "nonce": crate::event::hex::encode(nonce),
        "id": crate::event::hex::encode(id),
        "at_ms": at_ms,
        "ranges": map,
        "key": key.public().hex(),
        "sig": crate::event::hex::encode(&sig),
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SigningKey {
        SigningKey::generate().expect("keygen").0
    }

    #[test]
    fn a_signed_request_round_trips_and_checks_for_its_board_and_key() {
        let k = key();
        let ranges = vec![
            ("temp".to_owned(), vec![(5, 9)]),
            ("load".to_owned(), vec![(301, 1000), (1200, 1200)]),
        ];
        let p = encode_request("gw1", &[1; 16], &[2; 16], 77, &ranges, &k);
        let r = parse_request(&p).expect("parses");
        assert_eq!(r.ranges[0].0, "load", "streams in byte order");
        assert_eq!(r.rows(), 700 + 1 + 5);
        assert_eq!(r.check("gw1", &[k.public()]), Ok(()));
        assert_eq!(
            r.check("gw2", &[k.public()]),
            Err(BackfillError::OtherBoard("gw1".into()))
        );
        assert!(matches!(
            r.check("gw1", &[key().public()]),
            Err(BackfillError::UntrustedKey(_))
        ));
        // Altered: another range, another nonce, another time; and a
        // receipt's signature over the same bytes.
        let text = String::from_utf8(p).expect("utf-8");
        for altered in [
            text.replace("[301,1000]", "[1,1000]"),
            text.replace(&"01".repeat(16), &"03".repeat(16)),
            text.replace("\"at_ms\":77", "\"at_ms\":78"),
        ] {
            let r = parse_request(altered.as_bytes()).expect("well formed");
            assert_eq!(
                r.check("gw1", &[k.public()]),
                Err(BackfillError::BadSignature)
            );
        }
        let mut r = parse_request(text.as_bytes()).expect("parses");
        r.sig = k.sign(Domain::Receipt, &r.body());
        assert_eq!(
            r.check("gw1", &[k.public()]),
            Err(BackfillError::BadSignature)
        );
    }

    #[test]
    fn malformed_requests_are_refused_whole() {
        let k = key();
        let good = String::from_utf8(encode_request(
            "gw1",
            &[1; 16],
            &[2; 16],
            5,
            &[("s".to_owned(), vec![(1, 2)])],
            &k,
        ))
        .expect("utf-8");
        for (p, want) in [
            ("nope".to_owned(), "version 1"),
            (good.replace("\"v\":1", "\"v\":2"), "version 2"),
            (good.replace("[[1,2]]", "[[3,2]]"), "invalid range"),
            (good.replace("[[1,2]]", "[[0,2]]"), "invalid range"),
            (good.replace("\"s\":", "\"a/b\":"), "invalid stream"),
            (good.replace("\"id\":\"", "\"id\":\"00"), "id"),
            (good.replace("\"v\":1", "\"v\":1,\"x\":0"), "unknown field"),
        ] {
            let e = parse_request(p.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(want), "{p}: {e}");
            assert_eq!(e.reason(), "malformed");
        }
        let many: Vec<(i64, i64)> = (1..=MAX_REQUEST_RANGES as i64 + 1)
            .map(|i| (i, i))
            .collect();
        let p = good.replace("[[1,2]]", &serde_json::json!(many).to_string());
        assert!(matches!(
            parse_request(p.as_bytes()),
            Err(BackfillError::TooMany(_))
        ));
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert!(matches!(
            parse_request(&big),
            Err(BackfillError::TooLarge(..))
        ));
        // A range of billions is well formed: the board bounds it.
        let absurd = good.replace("[[1,2]]", "[[1,9000000000]]");
        let r = parse_request(absurd.as_bytes()).expect("well formed");
        assert_eq!(r.rows(), 9_000_000_000);
    }

    #[test]
    fn holdings_and_answers_round_trip() {
        let h = Holdings {
            board: "gw1".into(),
            nonce: [7; 16],
            streams: vec![
                (
                    "load".into(),
                    Held {
                        oldest: 1,
                        newest: 1000,
                        pending: 1001,
                    },
                ),
                (
                    "quiet".into(),
                    Held {
                        oldest: 6,
                        newest: 5,
                        pending: 6,
                    },
                ),
            ],
            more: false,
        };
        assert_eq!(
            parse_note(&encode_holdings(&h)),
            Ok(Note::Holdings(h.clone()))
        );
        let a = Answer {
            board: "gw1".into(),
            request: [9; 16],
            queued: 650,
            gone: vec![("load".into(), vec![(301, 350, GoneReason::Retention)])],
            pending: vec![("load".into(), vec![(990, 1000)])],
        };
        assert_eq!(parse_note(&encode_answer(&a)), Ok(Note::Answer(a)));
        let text = String::from_utf8(encode_holdings(&h)).expect("utf-8");
        for bad in [
            text.replace("[1,1000,1001]", "[0,1000,1001]"),
            text.replace("[1,1000,1001]", "[1,1000,1002]"),
            text.replace("\"kind\":\"holdings\"", "\"kind\":\"other\""),
            text.replace("\"load\"", "\"lo ad\""),
        ] {
            assert!(parse_note(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
