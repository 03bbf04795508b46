//! Wire format of an event and the event id.
//!
//! Owns the bytes that go to the broker. Its one rule: an event's payload is
//! encoded **once**, at append time, and stored; every retry sends those stored
//! bytes (I3), so nothing here runs on the publish path.
//!
//! Two formats, chosen by `mqtt.payload_format`:
//! - `json` (default): one UTF-8 JSON object,
//!   `{"event_id","device_id","stream","seq","ts_ms","clock_trusted",["boot_id","mono_ms",]"fields":{..}}`.
//! - `postcard`: the same envelope as [`CompactEnvelope`] in postcard
//!   (<https://postcard.jamesmunns.com/wire-format>), for metered links;
//!   version 2 ([`CompactEnvelope::v`]) adds the [`CompactClock`] after it.
//!
//! `boot_id` and `mono_ms` ([`Envelope::mono`]) are optional: an event
//! without them is byte for byte what the agent sent before they existed,
//! and a reader of either format that does not know them reads the rest.

use crate::event::clock::{BootId, MonoStamp};
use crate::event::reading::{FieldValue, Fields};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A 128-bit event id, unique forever (I3).
///
/// Three kinds. Most ids come from [`EventIdGen`] (a key drawn per agent
/// process and a counter within it). Nothing of it is stored in or derived
/// from the spool, so a power-loss rollback or a lost `-wal` file that
/// undoes the newest commits cannot make a later process issue the same id
/// again for another reading. A replayed trace row's id and a keyed
/// reading's are instead derived ([`derived_event_id`]) from a handle (the
/// row's position, [`replay_row_id`]; the key, [`key_id`]) and the whole
/// payload: the same row or key sent again with the same bytes gets the
/// same id (that is their purpose), and one id never names two payloads,
/// whatever a rollback, a dropped row, a truncated file or a config change
/// did to `seq`, the cells or the payload format in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventId(pub [u8; 16]);

impl EventId {
    /// 8-4-4-4-12 lowercase hex, like a UUID (36 ASCII bytes).
    pub fn hyphenated(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(36);
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                out.push('-');
            }
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 0xf) as usize] as char);
        }
        out
    }
}

impl EventId {
    /// The id `s` names in the one text form ids have on the wire and in
    /// the spool: 8-4-4-4-12 lowercase hex, as [`EventId::hyphenated`]
    /// writes it. `None` for anything else (another length, upper case,
    /// hyphens elsewhere, no hyphens): a receipt naming such a string is
    /// refused whole, and a spool row holding one is not sent
    /// (`crate::delivery`: FAILED and kept, like a payload that fails its
    /// digest).
    pub fn parse(s: &str) -> Option<EventId> {
        let b = s.as_bytes();
        if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
            return None;
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut hex = b.iter().copied().filter(|&c| c != b'-');
        let mut out = [0u8; 16];
        for byte in &mut out {
            let hi = nibble(hex.next()?)?;
            let lo = nibble(hex.next()?)?;
            *byte = hi << 4 | lo;
        }
        Some(EventId(out))
    }
}

impl fmt::Display for EventId {
    /// Same as [`EventId::hyphenated`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hyphenated())
    }
}

/// Issues [`EventId`]s for one agent process: each id is the first 16
/// bytes of sha256(a 256-bit key drawn from the OS when the generator is
/// made, a counter), with the UUID version 4 and RFC 9562 variant bits set.
///
/// Unpredictable: an id observed on the wire says nothing about the next
/// ones (the key never leaves the process), so no other publisher can
/// pre-empt a board's future events. Unique: the counter never repeats
/// under one key, and a new process draws a new key; nothing stored in the
/// spool takes part, so a rolled-back spool cannot make an id come again.
pub struct EventIdGen {
    key: [u8; 32],
    counter: u64,
}

impl fmt::Debug for EventIdGen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key stays out of logs.
        f.debug_struct("EventIdGen")
            .field("counter", &self.counter)
            .finish_non_exhaustive()
    }
}

impl EventIdGen {
    /// A generator with a fresh key from the OS (`getrandom(2)`).
    ///
    /// Errors: the OS random source failed; the agent cannot promise
    /// unpredictable, unique ids without it and must not start.
    pub fn new() -> Result<Self, getrandom::Error> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key)?;
        Ok(EventIdGen { key, counter: 0 })
    }

    /// The next id.
    pub fn next_id(&mut self) -> EventId {
        use sha2::{Digest, Sha256};
        self.counter += 1;
        let mut h = Sha256::new();
        h.update(b"edgespool-event-v2");
        h.update(self.key);
        h.update(self.counter.to_be_bytes());
        let mut b = [0u8; 16];
        b.copy_from_slice(&h.finalize()[..16]);
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        EventId(b)
    }
}

/// The handle of a replayed trace row's position: the first 16 bytes of
/// sha256(`"edgespool-replay-v1"`, device id, stream, trace identity, lap,
/// line), each string length-prefixed, with the UUID version nibble set
/// to 8 and the RFC 9562 variant bits (a UUIDv8, so it never looks like a
/// random [`EventIdGen`] id). The row's event id is
/// [`derived_event_id`] of this handle and its payload.
///
/// The same row of the same trace on the same device and stream, encoded
/// to the same bytes, gets the same event id in every process, which is
/// what lets a consumer drop a row that a restart (or a power-cut rollback
/// of the newest commits) sends again. Another lap of a repeated trace is
/// another row, so another id.
pub fn replay_row_id(
    device_id: &str,
    stream: &str,
    trace_id: &str,
    lap: u64,
    line: u64,
) -> EventId {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in ["edgespool-replay-v1", device_id, stream, trace_id] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    h.update(lap.to_be_bytes());
    h.update(line.to_be_bytes());
    uuid_v8(h)
}

/// The spool's handle for an idempotency key from a local producer (the
/// ingest socket's `key`, a bridged message's `id_field`): the first 16
/// bytes of sha256(`"edgespool-key-v3"`, `secret`, device id, stream,
/// scope, key), each length-prefixed, as a UUIDv8 like [`replay_row_id`].
/// The spool looks a key up by it (`event_keys.event_id`) and finds the
/// event id the key was published under; a key stored before schema 11 was
/// published under this id itself. `secret` is the spool's own (32 random
/// bytes made with it, schema 10): whoever knows a key cannot compute it
/// (issue 21: a receipt or an event naming another board's id), and it
/// stays the same as long as the spool does.
///
/// `scope` is who gave the key (a listener and peer, a bridged topic: see
/// [`crate::spool::ReadingKey::scope`]): the same key from two scopes is two
/// readings, so one client can neither take another's event id nor have
/// its reading dropped as a duplicate. (`v1` hashed no scope, `v2` no
/// secret: a key sent before the upgrade and again after it gets a new id,
/// as it does after the spool is moved aside.)
pub fn key_id(secret: &[u8; 32], device_id: &str, stream: &str, scope: &str, key: &str) -> EventId {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [
        b"edgespool-key-v3".as_slice(),
        secret.as_slice(),
        device_id.as_bytes(),
        stream.as_bytes(),
        scope.as_bytes(),
        key.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    uuid_v8(h)
}

/// The event id a keyed reading or a replayed row is published under: the
/// first 16 bytes of sha256(`"edgespool-keyed-event-v1"`, `key_id`, `body`),
/// length-prefixed, as a UUIDv8. `key_id` is the handle: a key's
/// [`key_id`] (so the id cannot be computed without the spool's secret) or
/// a replayed row's [`replay_row_id`]; `body` is the event's payload as
/// [`encode`] writes it with the all-zero event id: device, stream, `seq`,
/// `ts_ms`, `clock_trusted` and fields, in the spool's payload format.
///
/// A payload is thus a function of its id (I3 even after a rollback): a
/// key that the spool has forgotten (a power cut or a lost `-wal` rolled
/// it back, or [`crate::spool::KEYS_KEPT`] passed) and is sent again gets
/// this id back only if every byte of its payload comes out the same (the
/// producer's own `ts_ms`, the same `seq`); with a time the agent filled
/// in, or another `seq`, it is a new event under a new id, never a second
/// payload under the first one. While the key is remembered the spool
/// answers with the id stored beside it and stores nothing.
pub fn derived_event_id(key_id: &EventId, body: &[u8]) -> EventId {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [b"edgespool-keyed-event-v1".as_slice(), &key_id.0, body] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    uuid_v8(h)
}

/// The first 16 bytes of `h`'s digest with the UUID version nibble set to
/// 8 and the RFC 9562 variant bits.
fn uuid_v8(h: sha2::Sha256) -> EventId {
    use sha2::Digest;
    let mut b = [0u8; 16];
    b.copy_from_slice(&h.finalize()[..16]);
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    EventId(b)
}

/// The event id a keyed or replayed payload is first encoded with, to derive its real
/// one from ([`derived_event_id`]).
pub const ZERO_EVENT_ID: EventId = EventId([0; 16]);

/// Payload encoding, from `mqtt.payload_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A JSON object (default).
    Json,
    /// postcard bytes of [`CompactEnvelope`].
    Postcard,
}

/// Everything that goes into one event's payload.
#[derive(Debug, Clone)]
pub struct Envelope<'a> {
    /// The event id (also the consumer's deduplication key).
    pub event_id: EventId,
    /// `device_id` from the board config.
    pub device_id: &'a str,
    /// Stream name: the source name, or `_commands` for command results.
    pub stream: &'a str,
    /// Per-stream sequence number, from 1.
    pub seq: u64,
    /// Time of the reading, Unix milliseconds: the wall clock when it was
    /// taken, the producer's own, or a replayed row's trace time.
    pub ts_ms: i64,
    /// False when the board's clock was not trusted when the reading was
    /// taken (a trace's time is trusted).
    pub clock_trusted: bool,
    /// Where on the board's monotonic clock `ts_ms` was read, for a reading
    /// taken while time sync had not yet vouched for the wall clock (and
    /// for a clock anchor): what lets the fleet correct `ts_ms` later
    /// ([`crate::event::clock`]). `None` for every other event, whose
    /// bytes are then those of an envelope without these members.
    pub mono: Option<MonoStamp>,
    /// The reading's fields.
    pub fields: &'a Fields,
}

/// The postcard form of an envelope. Field order is the wire order.
///
/// postcard is positional and reads no further than the value it is
/// asked for, so the format grows only at its end, with a version: `v` 1
/// is these fields alone; `v` 2 is these fields followed by a
/// [`CompactClock`] ([`read_compact`] reads both). A reader that knows
/// only version 1 reads a version 2 payload as its version 1 part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompactEnvelope {
    /// Format version: 1, or 2 when a [`CompactClock`] follows.
    pub v: u8,
    /// Event id bytes.
    pub event_id: [u8; 16],
    /// Device id.
    pub device_id: String,
    /// Stream.
    pub stream: String,
    /// Per-stream sequence.
    pub seq: u64,
    /// Unix milliseconds.
    pub ts_ms: i64,
    /// Whether the clock was trusted.
    pub clock_trusted: bool,
    /// Fields in order.
    pub fields: Vec<(String, FieldValue)>,
}

/// What follows a version 2 [`CompactEnvelope`]: its [`MonoStamp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactClock {
    /// The boot id's 16 bytes.
    pub boot_id: [u8; 16],
    /// `CLOCK_BOOTTIME`, ms (a varint).
    pub mono_ms: u64,
}

/// The version of a [`CompactEnvelope`] followed by a [`CompactClock`].
pub const COMPACT_WITH_CLOCK: u8 = 2;

/// A postcard envelope and, for version 2 and later, its clock stamp.
///
/// Errors: postcard's, for a payload that is not a [`CompactEnvelope`], or
/// of version 2 or later without a [`CompactClock`] after it. Bytes after
/// what the version defines are ignored, as a version 1 reader ignores a
/// version 2 stamp.
pub fn read_compact(
    payload: &[u8],
) -> Result<(CompactEnvelope, Option<MonoStamp>), postcard::Error> {
    let (c, rest) = postcard::take_from_bytes::<CompactEnvelope>(payload)?;
    if c.v < COMPACT_WITH_CLOCK {
        return Ok((c, None));
    }
    let t: CompactClock = postcard::from_bytes(rest)?;
    let stamp = MonoStamp {
        boot_id: BootId(t.boot_id),
        mono_ms: t.mono_ms,
    };
    Ok((c, Some(stamp)))
}

/// The JSON form, serialized straight from borrowed data (no intermediate map).
#[derive(Serialize)]
struct JsonEnvelope<'a> {
    event_id: &'a str,
    device_id: &'a str,
    stream: &'a str,
    seq: u64,
    ts_ms: i64,
    clock_trusted: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    boot_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mono_ms: Option<u64>,
    fields: JsonFields<'a>,
}

/// Fields as a JSON object in reading order.
struct JsonFields<'a>(&'a Fields);

impl Serialize for JsonFields<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeMap};
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            match v {
                // Counters and byte sizes read as integers on the wire.
                FieldValue::Num(n) if n.fract() == 0.0 && n.abs() < 9.0e15 => {
                    m.serialize_entry(k, &(*n as i64))?
                }
                FieldValue::Num(n) if !n.is_finite() => {
                    return Err(S::Error::custom(format!(
                        "field {k}: non-finite number {n}"
                    )))
                }
                FieldValue::Num(n) => m.serialize_entry(k, n)?,
                FieldValue::Text(t) => m.serialize_entry(k, t)?,
                FieldValue::Bool(b) => m.serialize_entry(k, b)?,
            }
        }
        m.end()
    }
}

/// Encode `env` in `format`.
///
/// Errors: a serializer failure (for JSON only a non-finite number, which the
/// sources never produce; it is reported rather than sent as `null`).
pub fn encode(format: Format, env: &Envelope<'_>) -> Result<Vec<u8>, String> {
    match format {
        Format::Json => {
            let id = env.event_id.hyphenated();
            let doc = JsonEnvelope {
                event_id: &id,
                device_id: env.device_id,
                stream: env.stream,
                seq: env.seq,
                ts_ms: env.ts_ms,
                clock_trusted: env.clock_trusted,
                boot_id: env.mono.map(|m| m.boot_id.simple()),
                mono_ms: env.mono.map(|m| m.mono_ms),
                fields: JsonFields(env.fields),
            };
            let mut out = Vec::with_capacity(128 + 32 * env.fields.len());
            serde_json::to_writer(&mut out, &doc).map_err(|e| e.to_string())?;
            Ok(out)
        }
        Format::Postcard => {
            let c = CompactEnvelope {
                v: match env.mono {
                    Some(_) => COMPACT_WITH_CLOCK,
                    None => 1,
                },
                event_id: env.event_id.0,
                device_id: env.device_id.to_owned(),
                stream: env.stream.to_owned(),
                seq: env.seq,
                ts_ms: env.ts_ms,
                clock_trusted: env.clock_trusted,
                fields: env.fields.clone(),
            };
            let mut out = postcard::to_stdvec(&c).map_err(|e| e.to_string())?;
            if let Some(m) = env.mono {
                let t = CompactClock {
                    boot_id: m.boot_id.0,
                    mono_ms: m.mono_ms,
                };
                out = postcard::to_extend(&t, out).map_err(|e| e.to_string())?;
            }
            Ok(out)
        }
    }
}

/// How a JSON payload begins: its event id comes first ([`encode`] writes
/// the fields in [`JsonEnvelope`]'s order).
const JSON_ID_PREFIX: &[u8] = b"{\"event_id\":\"";

/// The event id inside a payload [`encode`] made: the spool reads a row's
/// id from its payload instead of storing it twice (schema 12). A JSON
/// payload has it first, at a fixed place, as [`EventId::parse`] reads it; a
/// postcard one right after its version byte. `None` for bytes neither
/// encoding made (a row whose payload is damaged: its digest fails too).
pub fn event_id_of(payload: &[u8]) -> Option<EventId> {
    if let Some(rest) = payload.strip_prefix(JSON_ID_PREFIX) {
        if rest.get(36) != Some(&b'"') {
            return None;
        }
        return std::str::from_utf8(rest.get(..36)?)
            .ok()
            .and_then(EventId::parse);
    }
    match payload {
        // Every version keeps the id right after its version byte (the
        // format grows only at its end): 1, and 2 with a clock stamp.
        [v, id @ ..] if *v >= 1 && id.len() > 16 => {
            let mut b = [0u8; 16];
            b.copy_from_slice(&id[..16]);
            Some(EventId(b))
        }
        _ => None,
    }
}

/// Wall-clock instants before this (2026-01-01T00:00:00Z, Unix ms) mean the
/// board has not set its clock yet: boards without an RTC boot in 1970 and
/// step the clock once time sync runs. Readings taken earlier are flagged
/// `clock_trusted: false`.
pub const CLOCK_FLOOR_MS: i64 = 1_767_225_600_000;

/// Current wall-clock time (Unix ms) and whether it is trusted (not before
/// [`CLOCK_FLOOR_MS`]).
pub fn wall_clock_ms() -> (i64, bool) {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    (ms, ms >= CLOCK_FLOOR_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_fields() -> Fields {
        vec![
            ("load1".into(), FieldValue::Num(0.25)),
            ("iface".into(), FieldValue::Text("eth0".into())),
            ("ok".into(), FieldValue::Bool(true)),
        ]
    }

    #[test]
    fn an_event_id_is_read_back_only_from_the_form_it_is_written_in() {
        let mut g = EventIdGen::new().unwrap();
        for id in (0..100)
            .map(|_| g.next_id())
            .chain([EventId([0; 16]), EventId([0xff; 16])])
        {
            assert_eq!(EventId::parse(&id.hyphenated()), Some(id));
        }
        let a = "0123abcd-0000-4000-8000-00000000000a";
        assert_eq!(
            EventId::parse(a).map(|id| id.0),
            Some([0x01, 0x23, 0xab, 0xcd, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x0a])
        );
        for bad in [
            "",
            "0123ABCD-0000-4000-8000-00000000000a",
            "0123abcd00000400080000000000000000a",
            "0123abcd-0000-4000-8000-00000000000",
            "0123abcd-0000-4000-8000-00000000000a0",
            "0123abc-d0000-4000-8000-00000000000a",
            "0123abcg-0000-4000-8000-00000000000a",
            "0123abcd-0000-4000-8000-0000000000\u{e9}",
            " 0123abcd-0000-4000-8000-0000000000a",
        ] {
            assert_eq!(EventId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn event_ids_of_one_generator_are_distinct_uuid_v4_and_follow_no_counter() {
        // Issue 21: one observed id must not give the next ones (the old
        // ids were a per-process prefix and a counter).
        let mut g = EventIdGen::new().unwrap();
        let ids: Vec<EventId> = (0..10_000).map(|_| g.next_id()).collect();
        let mut halves = std::collections::HashSet::new();
        for w in ids.windows(2) {
            assert_ne!(
                w[0].0[..8],
                w[1].0[..8],
                "consecutive ids share their first half"
            );
            assert_ne!(
                w[0].0[8..],
                w[1].0[8..],
                "consecutive ids share their second half"
            );
        }
        for id in &ids {
            let s = id.to_string();
            assert_eq!(s.len(), 36);
            assert_eq!(&s[14..15], "4", "{s}");
            assert!(matches!(&s[19..20], "8" | "9" | "a" | "b"), "{s}");
            assert!(
                halves.insert(id.0[..8].to_vec()),
                "two ids share a first half"
            );
        }
    }

    #[test]
    fn two_generators_do_not_share_a_prefix() {
        // A restarted process draws a new key, so a rolled-back spool (or
        // counter) cannot reissue an id.
        let a = EventIdGen::new().unwrap().next_id();
        let b = EventIdGen::new().unwrap().next_id();
        assert_ne!(a, b);
    }

    #[test]
    fn replay_ids_are_stable_and_differ_by_each_part() {
        let id = replay_row_id("dev", "air", "fp:ab", 0, 2);
        assert_eq!(id, replay_row_id("dev", "air", "fp:ab", 0, 2));
        assert_eq!(&id.to_string()[14..15], "8", "{id}");
        for other in [
            replay_row_id("dev2", "air", "fp:ab", 0, 2),
            replay_row_id("dev", "air2", "fp:ab", 0, 2),
            replay_row_id("dev", "air", "fp:ac", 0, 2),
            replay_row_id("dev", "air", "fp:ab", 1, 2),
            replay_row_id("dev", "air", "fp:ab", 0, 3),
            // Length prefixes: moving a character between parts changes it.
            replay_row_id("de", "vair", "fp:ab", 0, 2),
        ] {
            assert_ne!(id, other);
        }
    }

    #[test]
    fn a_keyed_id_changes_with_every_byte_of_its_payload_and_with_its_key() {
        let f = sample_fields();
        let env = |seq, ts_ms| Envelope {
            event_id: ZERO_EVENT_ID,
            device_id: "dev",
            stream: "pump",
            seq,
            ts_ms,
            clock_trusted: true,
            mono: None,
            fields: &f,
        };
        let body = |seq, ts| encode(Format::Json, &env(seq, ts)).unwrap();
        let k = key_id(&[7; 32], "dev", "pump", "tcp", "k1");
        let id = derived_event_id(&k, &body(1, 5));
        assert_eq!(id, derived_event_id(&k, &body(1, 5)));
        assert_eq!(&id.to_string()[14..15], "8", "{id}");
        for other in [
            derived_event_id(&k, &body(2, 5)),
            derived_event_id(&k, &body(1, 6)),
            derived_event_id(&key_id(&[7; 32], "dev", "pump", "tcp", "k2"), &body(1, 5)),
            derived_event_id(&key_id(&[8; 32], "dev", "pump", "tcp", "k1"), &body(1, 5)),
        ] {
            assert_ne!(id, other);
        }
        assert_ne!(id, k, "the published id is not the key's");
    }

    #[test]
    fn json_envelope_carries_identity_and_fields() {
        let f = sample_fields();
        let id = EventId([1; 16]);
        let env = Envelope {
            event_id: id,
            device_id: "dev",
            stream: "system",
            seq: 7,
            ts_ms: 1_800_000_000_000,
            clock_trusted: true,
            mono: None,
            fields: &f,
        };
        let bytes = encode(Format::Json, &env).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["event_id"], id.to_string());
        assert_eq!(v["seq"], 7);
        assert_eq!(v["fields"]["load1"], 0.25);
        assert_eq!(v["fields"]["iface"], "eth0");
        assert_eq!(v["clock_trusted"], true);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains("\"seq\":7"), "{text}");
    }

    #[test]
    fn integral_numbers_are_written_without_a_fraction() {
        let f = vec![("mem_total_bytes".into(), FieldValue::Num(25_276_502_016.0))];
        let env = Envelope {
            event_id: EventId([0; 16]),
            device_id: "d",
            stream: "s",
            seq: 1,
            ts_ms: 0,
            clock_trusted: true,
            mono: None,
            fields: &f,
        };
        let text = String::from_utf8(encode(Format::Json, &env).unwrap()).unwrap();
        assert!(text.contains("\"mem_total_bytes\":25276502016}"), "{text}");
    }

    #[test]
    fn postcard_envelope_round_trips_and_is_smaller() {
        let f = sample_fields();
        let env = Envelope {
            event_id: EventId([9; 16]),
            device_id: "dev",
            stream: "system",
            seq: 1,
            ts_ms: 5,
            clock_trusted: false,
            mono: None,
            fields: &f,
        };
        let pc = encode(Format::Postcard, &env).unwrap();
        let js = encode(Format::Json, &env).unwrap();
        let back: CompactEnvelope = postcard::from_bytes(&pc).unwrap();
        assert_eq!(back.event_id, [9; 16]);
        assert_eq!(back.fields, f);
        assert!(pc.len() < js.len());
    }

    fn stamped(f: &Fields, mono: Option<MonoStamp>) -> Envelope<'_> {
        Envelope {
            event_id: EventId([9; 16]),
            device_id: "pi4-gw-01",
            stream: "system",
            seq: 1234,
            ts_ms: 1_795_999_292_433,
            clock_trusted: false,
            mono,
            fields: f,
        }
    }

    const STAMP: MonoStamp = MonoStamp {
        boot_id: BootId([
            0x37, 0x8e, 0x97, 0xe1, 0xf4, 0x81, 0x41, 0x24, 0x9e, 0x58, 0x22, 0x1d, 0x16, 0xd6,
            0xb5, 0x4f,
        ]),
        // Six days after boot.
        mono_ms: 518_400_000,
    };

    #[test]
    fn an_event_without_a_stamp_is_the_bytes_it_was_before_stamps_existed() {
        let f = sample_fields();
        let js = encode(Format::Json, &stamped(&f, None)).unwrap();
        assert_eq!(
            String::from_utf8(js).unwrap(),
            r#"{"event_id":"09090909-0909-0909-0909-090909090909","device_id":"pi4-gw-01","stream":"system","seq":1234,"ts_ms":1795999292433,"clock_trusted":false,"fields":{"load1":0.25,"iface":"eth0","ok":true}}"#
        );
        let pc = encode(Format::Postcard, &stamped(&f, None)).unwrap();
        assert_eq!(pc[0], 1, "version 1");
        let (c, mono) = read_compact(&pc).unwrap();
        assert_eq!((c.seq, mono), (1234, None));
    }

    #[test]
    fn a_stamp_adds_boot_id_and_mono_ms_that_older_readers_skip() {
        let f = sample_fields();
        let js = encode(Format::Json, &stamped(&f, Some(STAMP))).unwrap();
        let text = String::from_utf8(js.clone()).unwrap();
        assert!(
            text.contains(r#""clock_trusted":false,"boot_id":"378e97e1f48141249e58221d16d6b54f","mono_ms":518400000,"fields""#),
            "{text}"
        );
        let plain = encode(Format::Json, &stamped(&f, None)).unwrap();
        // The figure docs/delivery.md gives.
        assert_eq!(js.len() - plain.len(), 65);
        let pc = encode(Format::Postcard, &stamped(&f, Some(STAMP))).unwrap();
        let pc1 = encode(Format::Postcard, &stamped(&f, None)).unwrap();
        assert_eq!(pc[0], COMPACT_WITH_CLOCK);
        assert_eq!(
            pc.len() - pc1.len(),
            16 + 5,
            "16 bytes of boot id, a 5-byte varint"
        );
        // A version 1 reader (an older sink) reads the rest, as before.
        let old: CompactEnvelope = postcard::from_bytes(&pc).unwrap();
        assert_eq!(
            (old.seq, old.ts_ms, old.fields.len()),
            (1234, 1_795_999_292_433, 3)
        );
        assert_eq!(read_compact(&pc).unwrap().1, Some(STAMP));
        // Version 2 promises a stamp: one cut short is no envelope.
        assert!(read_compact(&pc[..pc.len() - 3]).is_err());
    }

    #[test]
    fn non_finite_number_is_an_error_not_null() {
        let f = vec![("x".into(), FieldValue::Num(f64::NAN))];
        let env = Envelope {
            event_id: EventId([0; 16]),
            device_id: "d",
            stream: "s",
            seq: 1,
            ts_ms: 0,
            clock_trusted: true,
            mono: None,
            fields: &f,
        };
        assert!(encode(Format::Json, &env).is_err());
    }

    #[test]
    fn the_event_id_is_read_back_from_either_payload_format() {
        let fields = vec![("t".to_owned(), FieldValue::Num(21.5))];
        let id = EventId([0xab; 16]);
        // Unstamped, and stamped before time sync (postcard version 2).
        let stamp = crate::event::clock::MonoStamp {
            boot_id: crate::event::clock::BootId([7; 16]),
            mono_ms: 12_345_678,
        };
        for mono in [None, Some(stamp)] {
            for format in [Format::Json, Format::Postcard] {
                let env = Envelope {
                    event_id: id,
                    device_id: "board",
                    stream: "temp",
                    seq: 7,
                    ts_ms: 1,
                    clock_trusted: mono.is_none(),
                    mono,
                    fields: &fields,
                };
                let payload = encode(format, &env).unwrap();
                if format == Format::Postcard {
                    assert_eq!(payload[0], if mono.is_some() { 2 } else { 1 });
                }
                assert_eq!(event_id_of(&payload), Some(id), "{format:?} {mono:?}");
            }
        }
        assert_eq!(event_id_of(b"{\"event_id\":\"not-an-id\"}"), None);
        assert_eq!(event_id_of(b"junk"), None);
        assert_eq!(event_id_of(b""), None);
    }
}
