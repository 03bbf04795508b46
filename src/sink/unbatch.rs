//! Batched publishes: one MQTT PUBLISH holding several events, unpacked into
//! one [`Item`] per event.
//!
//! Pure: no I/O. The wire format (docs/fleet.md, "Batched and compressed
//! publishes"):
//!
//! - topic `<prefix>/batches/<stream>` (uncompressed), `.../<stream>/lz4`
//!   (one lz4 frame, <https://github.com/lz4/lz4/blob/dev/doc/lz4_Frame_format.md>)
//!   or `.../<stream>/zstd` (one zstd frame, RFC 8878);
//! - JSON events: `{"batch":[E1,E2,...]}`, each `E` a stored JSON envelope,
//!   byte for byte;
//! - postcard events: postcard's encoding of a sequence of byte strings,
//!   `varint(n)` then `varint(len) + envelope` n times.
//!
//! Its one rule: each event's bytes are handed on exactly as the agent
//! stored them, so the digest of an event delivered in a batch equals the
//! digest of the same event delivered alone, and the store deduplicates the
//! two. Everything here is attack surface (anyone with publish rights on the
//! topic): at most [`MAX_EVENTS`] events, at most [`MAX_DECOMPRESSED`] bytes
//! decompressed (decompression stops there: a zip bomb is refused, not
//! allocated).

use super::batch::Item;
use super::message::Unreadable;
use std::borrow::Cow;
use std::io::Read;

/// Most events in one batch.
pub const MAX_EVENTS: usize = 1000;

/// Most bytes of a batch once decompressed (16 MiB, the sink's largest
/// incoming packet).
pub const MAX_DECOMPRESSED: usize = 16 << 20;

/// How a batch's payload is compressed, from the last topic level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// `<prefix>/batches/<stream>`.
    None,
    /// `<prefix>/batches/<stream>/lz4`: one lz4 frame.
    Lz4,
    /// `<prefix>/batches/<stream>/zstd`: one zstd frame.
    Zstd,
}

/// What a topic says about its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicKind {
    /// Not a batch topic: one event (`<prefix>/events/<stream>` or anything
    /// else the filter matched).
    Single,
    /// A batch, compressed so.
    Batch(Compression),
    /// `<prefix>/batches/<stream>/<x>` with an `x` this sink does not know.
    UnknownEncoding(String),
}

/// Read a topic. A stream name never holds '/', so a batch topic has
/// `batches` as its second-to-last level, or third-to-last with a
/// compression level after the stream. The compressed form is tried first:
/// `a/batches/batches/lz4` is an lz4 batch of stream `batches`. A topic
/// whose second-to-last level is `events` is a single event even when a
/// level of the prefix is `batches` (`site/batches/events/tele`: without
/// this rule it read as a batch in an unknown encoding `tele`, and the
/// event was acknowledged and not stored). One ambiguity is left: a
/// single event of a stream named `lz4` or `zstd` under a prefix ending in
/// `batches` reads as a compressed batch of stream `events` (unreadable,
/// counted, named in the log).
pub fn topic_kind(topic: &str) -> TopicKind {
    let levels: Vec<&str> = topic.rsplitn(4, '/').collect();
    // Reversed: levels[0] is the last level.
    match levels.as_slice() {
        ["lz4", _stream, "batches", ..] => TopicKind::Batch(Compression::Lz4),
        ["zstd", _stream, "batches", ..] => TopicKind::Batch(Compression::Zstd),
        [_stream, "events", ..] => TopicKind::Single,
        [_stream, "batches", ..] => TopicKind::Batch(Compression::None),
        [last, _stream, "batches", ..] => TopicKind::UnknownEncoding((*last).to_owned()),
        _ => TopicKind::Single,
    }
}

/// One delivery as the items a store takes: one item for a single event;
/// one per event for a readable batch (each decoded by
/// [`super::message::decode`], an unreadable one counted as such); one
/// unreadable item holding the delivered bytes (with [`Unreadable::Batch`]
/// naming what was wrong) for a batch that cannot be read at all.
pub fn items(topic: &str, payload: &[u8]) -> Vec<Item> {
    let compression = match topic_kind(topic) {
        TopicKind::Single => return vec![Item::new(topic, payload)],
        TopicKind::Batch(c) => c,
        TopicKind::UnknownEncoding(x) => {
            return vec![refused(
                topic,
                payload,
                format!("unknown batch encoding {x:?} (lz4 or zstd)"),
            )]
        }
    };
    let plain = match decompress(compression, payload) {
        Ok(p) => p,
        Err(why) => return vec![refused(topic, payload, why)],
    };
    match split(&plain) {
        Ok(events) => events.into_iter().map(|e| Item::new(topic, e)).collect(),
        Err(why) => vec![refused(topic, payload, why)],
    }
}

fn refused(topic: &str, payload: &[u8], why: String) -> Item {
    log::warn!("sink: unreadable batch on {topic}: {why}");
    Item {
        topic: topic.to_owned(),
        payload: payload.to_vec(),
        read: Err(Unreadable::Batch(why)),
        publisher: super::identity::publisher(topic).to_owned(),
    }
}

/// The uncompressed batch, at most [`MAX_DECOMPRESSED`] bytes.
///
/// Errors: a frame that does not decode, bytes after a zstd frame (after an
/// lz4 frame they must be another lz4 frame, read on as the `lz4` CLI
/// does), or output past the bound (decoding stops one byte past it). A
/// zstd frame whose window is larger than the bound is refused before
/// decoding (the decoder reserves the window up front). Memory: the output
/// (at most the bound plus one byte) and the decoder's buffers (lz4: one
/// input block and two output blocks of at most 4 MiB each plus 64 KiB;
/// zstd: a window of at most the bound).
pub fn decompress(c: Compression, payload: &[u8]) -> Result<Cow<'_, [u8]>, String> {
    match c {
        Compression::None if payload.len() > MAX_DECOMPRESSED => {
            Err(format!("batch of {} bytes is over 16 MiB", payload.len()))
        }
        Compression::None => Ok(Cow::Borrowed(payload)),
        Compression::Lz4 => {
            bounded(lz4_flex::frame::FrameDecoder::new(payload), "lz4").map(Cow::Owned)
        }
        #[cfg(not(feature = "zstd"))]
        Compression::Zstd => Err("zstd batch: this sink is built without zstd (the `zstd` feature; the armv7 and armv6 packages leave it out): run one built with it".to_owned()),
        #[cfg(feature = "zstd")]
        Compression::Zstd => {
            let window = zstd_window(payload)?;
            if window > MAX_DECOMPRESSED as u64 {
                return Err(format!(
                    "zstd window of {window} bytes is over the 16 MiB batch limit"
                ));
            }
            let mut src = payload;
            let dec = ruzstd::decoding::StreamingDecoder::new(&mut src)
                .map_err(|e| format!("zstd frame: {e}"))?;
            let out = bounded(dec, "zstd")?;
            if !src.is_empty() {
                return Err(format!("{} bytes after the zstd frame", src.len()));
            }
            Ok(Cow::Owned(out))
        }
    }
}

/// The window a zstd frame asks the decoder to hold (RFC 8878 §3.1.1.1):
/// from the Window_Descriptor, or with Single_Segment_flag set, the
/// Frame_Content_Size. ruzstd reserves it before decoding, so it is
/// checked first.
#[cfg(feature = "zstd")]
fn zstd_window(payload: &[u8]) -> Result<u64, String> {
    const MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
    let short = || "zstd frame header: too short".to_owned();
    if payload.get(..4) != Some(&MAGIC[..]) {
        return Err("zstd frame header: no zstd magic number".to_owned());
    }
    let fhd = *payload.get(4).ok_or_else(short)?;
    let single_segment = fhd & 0x20 != 0;
    if !single_segment {
        let wd = *payload.get(5).ok_or_else(short)?;
        let log = 10 + u32::from(wd >> 3);
        let base = 1u64 << log;
        return Ok(base + (base / 8) * u64::from(wd & 7));
    }
    let dict_len = [0usize, 1, 2, 4][usize::from(fhd & 3)];
    let fcs_len = [1usize, 2, 4, 8][usize::from(fhd >> 6)];
    let at = 5 + dict_len;
    let field = payload.get(at..at + fcs_len).ok_or_else(short)?;
    let mut le = [0u8; 8];
    le[..fcs_len].copy_from_slice(field);
    let size = u64::from_le_bytes(le);
    Ok(if fcs_len == 2 { size + 256 } else { size })
}

/// Read `r` to its end, refusing output past [`MAX_DECOMPRESSED`].
fn bounded(r: impl Read, what: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    r.take(MAX_DECOMPRESSED as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{what} frame: {e}"))?;
    if out.len() > MAX_DECOMPRESSED {
        return Err(format!(
            "{what} batch decompresses to more than 16 MiB (refused)"
        ));
    }
    Ok(out)
}

/// `{"batch":[...]}` with each element's exact bytes.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonBatch<'a> {
    #[serde(borrow, deserialize_with = "bounded_events")]
    batch: Bounded<'a>,
}

/// The first [`MAX_EVENTS`] elements of a JSON array and how many it held.
struct Bounded<'a> {
    kept: Vec<&'a serde_json::value::RawValue>,
    total: usize,
}

/// Keep at most [`MAX_EVENTS`] elements and skip (count, never store) the
/// rest, so a 16 MiB `[0,0,0,...]` costs no more memory than 1,000
/// elements (storing every element cost 16 bytes per element: 128 MiB for
/// an 8-million-element array that a 64 KiB lz4 frame inflates to).
fn bounded_events<'de, D>(d: D) -> Result<Bounded<'de>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Bounded<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array of events")
        }
        fn visit_seq<A>(self, mut seq: A) -> Result<Bounded<'de>, A::Error>
        where
            A: serde::de::SeqAccess<'de>,
        {
            let mut kept = Vec::new();
            let mut total = 0usize;
            while total < MAX_EVENTS {
                match seq.next_element::<&'de serde_json::value::RawValue>()? {
                    Some(e) => kept.push(e),
                    None => return Ok(Bounded { kept, total }),
                }
                total += 1;
            }
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                total += 1;
            }
            Ok(Bounded { kept, total })
        }
    }
    d.deserialize_seq(V)
}

/// The events of an uncompressed batch, each its exact bytes: a JSON batch
/// when the payload is a JSON object, else a postcard one.
///
/// Errors: neither form; more than [`MAX_EVENTS`] events; bytes after a
/// postcard sequence.
pub fn split(plain: &[u8]) -> Result<Vec<&[u8]>, String> {
    let events: Vec<&[u8]> = if plain.first() == Some(&b'{') {
        match serde_json::from_slice::<JsonBatch<'_>>(plain) {
            Ok(b) if b.batch.total > MAX_EVENTS => {
                return Err(format!(
                    "{} events in one batch (at most {MAX_EVENTS})",
                    b.batch.total
                ))
            }
            Ok(b) => b.batch.kept.iter().map(|r| r.get().as_bytes()).collect(),
            Err(json) => split_postcard(plain)
                .map_err(|pc| format!("neither a JSON batch ({json}) nor a postcard one ({pc})"))?,
        }
    } else {
        split_postcard(plain)?
    };
    if events.len() > MAX_EVENTS {
        return Err(format!(
            "{} events in one batch (at most {MAX_EVENTS})",
            events.len()
        ));
    }
    if events.is_empty() {
        return Err("a batch of no events".into());
    }
    Ok(events)
}

/// Postcard `Vec<&[u8]>`: serde's `&[u8]` goes through `deserialize_bytes`,
/// which postcard reads as varint length + bytes, borrowed from `plain`.
fn split_postcard(plain: &[u8]) -> Result<Vec<&[u8]>, String> {
    // The count first: serde's Vec grows with the elements it reads (1 byte
    // each at least, 16 bytes each in the Vec), so a 16 MiB run of empty
    // strings cost 256 MiB before the count was checked.
    let (count, _) = postcard::take_from_bytes::<usize>(plain)
        .map_err(|e| format!("not a postcard batch: {e}"))?;
    if count > MAX_EVENTS {
        return Err(format!(
            "{count} events in one batch (at most {MAX_EVENTS})"
        ));
    }
    let (events, rest) = postcard::take_from_bytes::<Vec<&[u8]>>(plain)
        .map_err(|e| format!("not a postcard batch: {e}"))?;
    if !rest.is_empty() {
        return Err(format!(
            "{} bytes after the postcard batch's events",
            rest.len()
        ));
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{encode, Envelope, EventId, Format};
    use crate::event::reading::FieldValue;
    use crate::sink::identity::{of_topic, publisher, Shape};
    use crate::sink::message::digest;
    use crate::sink::{SinkDb, SinkStats, Store};
    use std::io::Write;

    /// Event `n` as the agent stores it.
    fn event(format: Format, n: u8) -> Vec<u8> {
        let fields = vec![
            ("n".to_owned(), FieldValue::Num(f64::from(n))),
            ("iface".to_owned(), FieldValue::Text("eth0".into())),
        ];
        let env = Envelope {
            event_id: EventId([n; 16]),
            device_id: "dev-1",
            stream: "system",
            seq: u64::from(n) + 1,
            ts_ms: 1_800_000_000_000 + i64::from(n),
            clock_trusted: true,
            mono: None,
            fields: &fields,
        };
        encode(format, &env).expect("encode")
    }

    /// `{"batch":[` + events joined by `,` + `]}`, by hand.
    fn json_batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = br#"{"batch":["#.to_vec();
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(e);
        }
        out.extend_from_slice(b"]}");
        out
    }

    /// LEB128, as postcard writes a varint(usize).
    fn varint(mut n: usize, out: &mut Vec<u8>) {
        while n >= 0x80 {
            out.push((n as u8) | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
    }

    /// varint(count) then varint(len) + bytes per event, by hand.
    fn postcard_batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        varint(events.len(), &mut out);
        for e in events {
            varint(e.len(), &mut out);
            out.extend_from_slice(e);
        }
        out
    }

    fn lz4(plain: &[u8]) -> Vec<u8> {
        let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::new());
        enc.write_all(plain).expect("lz4 write");
        enc.finish().expect("lz4 finish")
    }

    /// A zstd frame (RFC 8878 §3.1.1) of raw blocks: magic, a descriptor
    /// without single segment, a 128 KiB window, then blocks of at most
    /// 128 KiB (header: last flag, type 0 = raw, size).
    fn zstd_raw(plain: &[u8]) -> Vec<u8> {
        let mut out = vec![0x28, 0xB5, 0x2F, 0xFD, 0x00, 0x38];
        let chunks: Vec<&[u8]> = plain.chunks(128 << 10).collect();
        for (i, c) in chunks.iter().enumerate() {
            let last = u32::from(i + 1 == chunks.len());
            let h = last | (c.len() as u32) << 3;
            out.extend_from_slice(&h.to_le_bytes()[..3]);
            out.extend_from_slice(c);
        }
        out
    }

    /// The payloads of `items`, all of which must decode as envelopes
    /// (whether the topic is theirs is `identity`'s business: a forged read
    /// is one that decoded).
    fn payloads(items: &[Item]) -> Vec<Vec<u8>> {
        items
            .iter()
            .map(|it| {
                assert!(
                    matches!(it.read, Ok(_) | Err(Unreadable::Forged(_))),
                    "{:?}",
                    it.read
                );
                it.payload.clone()
            })
            .collect()
    }

    fn batch_reason(items: &[Item]) -> String {
        match items {
            [Item {
                read: Err(Unreadable::Batch(why)),
                ..
            }] => why.clone(),
            other => panic!("not one unreadable batch: {other:?}"),
        }
    }

    #[test]
    fn topics_say_single_batch_or_compression() {
        use Compression::*;
        assert_eq!(topic_kind("es/d1/events/system"), TopicKind::Single);
        assert_eq!(topic_kind("es/d1/batches/system"), TopicKind::Batch(None));
        assert_eq!(topic_kind("batches/system"), TopicKind::Batch(None));
        assert_eq!(topic_kind("es/batches/system/lz4"), TopicKind::Batch(Lz4));
        assert_eq!(topic_kind("es/batches/system/zstd"), TopicKind::Batch(Zstd));
        assert_eq!(topic_kind("a/batches/batches/lz4"), TopicKind::Batch(Lz4));
        assert_eq!(
            topic_kind("es/batches/system/gzip"),
            TopicKind::UnknownEncoding("gzip".into())
        );
        assert_eq!(topic_kind("system"), TopicKind::Single);
    }

    #[test]
    fn a_prefix_level_named_batches_leaves_single_events_single() {
        use Compression::*;
        // topic_prefix "site/batches" (or device_id "batches" under the
        // default prefix): single events were read as a batch in an
        // unknown encoding, acknowledged and not stored.
        assert_eq!(topic_kind("site/batches/events/tele"), TopicKind::Single);
        assert_eq!(topic_kind("batches/events/tele"), TopicKind::Single);
        assert_eq!(
            topic_kind("site/batches/batches/tele"),
            TopicKind::Batch(None)
        );
        assert_eq!(
            topic_kind("site/batches/batches/tele/lz4"),
            TopicKind::Batch(Lz4)
        );
        assert_eq!(topic_kind("es/batches/events"), TopicKind::Batch(None));
        assert_eq!(topic_kind("es/batches/events/zstd"), TopicKind::Batch(Zstd));
        let e = event(Format::Json, 3);
        let got = items("site/batches/events/system", &e);
        assert_eq!(payloads(&got), [e]);
    }

    #[test]
    fn a_huge_element_count_is_refused_by_its_count() {
        // 8 million JSON elements and 16 million empty postcard strings:
        // refused with their count (the elements past 1,000 are skipped,
        // the postcard count is read before any element).
        let mut js = br#"{"batch":["#.to_vec();
        js.extend_from_slice(&b"0,".repeat(8_000_000));
        js.extend_from_slice(b"0]}");
        let why = batch_reason(&items("es/batches/s", &js));
        assert!(why.contains("8000001 events"), "{why}");
        let mut pc = Vec::new();
        varint(16_000_000, &mut pc);
        pc.resize(pc.len() + 16_000_000, 0);
        let why = batch_reason(&items("es/batches/s", &pc));
        assert!(why.contains("16000000 events"), "{why}");
    }

    #[test]
    fn json_batch_yields_each_envelope_byte_for_byte() {
        let events: Vec<Vec<u8>> = (1..=3).map(|n| event(Format::Json, n)).collect();
        let items = items("es/dev-1/batches/system", &json_batch(&events));
        assert_eq!(payloads(&items), events);
        for (it, e) in items.iter().zip(&events) {
            let read = it.read.as_ref().expect("readable");
            assert_eq!(read.digest, digest(e), "same digest as a single delivery");
            assert_eq!(it.topic, "es/dev-1/batches/system");
        }
        let ids: Vec<&str> = items
            .iter()
            .filter_map(|it| it.read.as_ref().ok().map(|e| e.event_id.as_str()))
            .collect();
        assert_eq!(ids[0], "01010101-0101-0101-0101-010101010101");
        assert_eq!(ids.len(), 3);
    }

    #[test]
    fn postcard_batch_is_a_postcard_sequence_of_byte_strings() {
        // One event over 127 bytes, so some lengths take two varint bytes.
        let mut events: Vec<Vec<u8>> = (1..=3).map(|n| event(Format::Postcard, n)).collect();
        events[1].clear();
        let big = Envelope {
            event_id: EventId([2; 16]),
            device_id: "dev-1",
            stream: "system",
            seq: 3,
            ts_ms: 5,
            clock_trusted: false,
            mono: None,
            fields: &vec![("long".to_owned(), FieldValue::Text("x".repeat(300)))],
        };
        events[1] = encode(Format::Postcard, &big).expect("encode");
        assert!(events[1].len() > 127);
        let by_hand = postcard_batch(&events);
        let slices: Vec<&[u8]> = events.iter().map(Vec::as_slice).collect();
        assert_eq!(
            postcard::to_allocvec(&slices).expect("postcard"),
            by_hand,
            "postcard's Vec<&[u8]> is the documented shape"
        );
        assert_eq!(payloads(&items("es/batches/system", &by_hand)), events);
        // Trailing bytes are not silently ignored.
        let mut trailing = by_hand.clone();
        trailing.push(0);
        assert!(batch_reason(&items("es/batches/system", &trailing)).contains("after"));
    }

    #[test]
    fn lz4_and_zstd_frames_decode_to_the_same_events() {
        let events: Vec<Vec<u8>> = (1..=5).map(|n| event(Format::Json, n)).collect();
        let plain = json_batch(&events);
        let lz = lz4(&plain);
        assert!(lz.starts_with(&[0x04, 0x22, 0x4D, 0x18]), "lz4 frame magic");
        assert_eq!(payloads(&items("es/batches/system/lz4", &lz)), events);
        let pc: Vec<Vec<u8>> = (1..=5).map(|n| event(Format::Postcard, n)).collect();
        let plain_pc = postcard_batch(&pc);
        assert_eq!(payloads(&items("es/batches/s/lz4", &lz4(&plain_pc))), pc);
        #[cfg_attr(not(feature = "zstd"), allow(unused_mut))]
        let mut tools = vec![("lz4", "es/batches/s/lz4")];
        #[cfg(feature = "zstd")]
        {
            let zs = zstd_raw(&plain);
            assert_eq!(payloads(&items("es/batches/system/zstd", &zs)), events);
            assert_eq!(
                payloads(&items("es/batches/s/zstd", &zstd_raw(&plain_pc))),
                pc
            );
            tools.push(("zstd", "es/batches/s/zstd"));
        }
        #[cfg(not(feature = "zstd"))]
        {
            let why = batch_reason(&items("es/batches/system/zstd", &zstd_raw(&plain)));
            assert!(why.contains("built without zstd"), "{why}");
        }
        // Compressed frames with the real tools, where installed (zstd's
        // compressed blocks, Huffman and FSE tables, its content checksum).
        for (tool, topic) in tools {
            match cli_compress(tool, &plain) {
                Some(c) => assert_eq!(payloads(&items(topic, &c)), events, "{tool} CLI"),
                None => println!("{tool} CLI not installed: checked our own frames only"),
            }
        }
    }

    /// `tool -c -q` over `plain`, or `None` when the tool is not installed.
    fn cli_compress(tool: &str, plain: &[u8]) -> Option<Vec<u8>> {
        let mut child = std::process::Command::new(tool)
            .args(["-c", "-q"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .ok()?;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(plain)
            .expect("write to the tool");
        let out = child.wait_with_output().expect("tool output");
        assert!(out.status.success(), "{tool} failed");
        Some(out.stdout)
    }

    #[test]
    fn a_zip_bomb_is_refused_without_being_allocated() {
        // 100 MiB of zeros, streamed into the encoder (this test never holds
        // them either): about 400 KiB of lz4 frame.
        let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::new());
        std::io::copy(&mut std::io::repeat(0).take(100 << 20), &mut enc).expect("compress");
        let bomb = enc.finish().expect("finish");
        println!("lz4 bomb: {} bytes for 100 MiB", bomb.len());
        let why = batch_reason(&items("es/batches/s/lz4", &bomb));
        assert!(why.contains("more than 16 MiB"), "{why}");
        // decompress() itself reads one byte past the bound, no more.
        assert!(decompress(Compression::Lz4, &bomb).is_err());

        #[cfg(feature = "zstd")]
        zstd_bomb();
    }

    #[cfg(feature = "zstd")]
    fn zstd_bomb() {
        // zstd: 800 RLE blocks (type 1) of 128 KiB = 100 MiB in ~3 KiB.
        let mut z = vec![0x28, 0xB5, 0x2F, 0xFD, 0x00, 0x38];
        for i in 0..800u32 {
            let h = u32::from(i == 799) | 1 << 1 | (128 << 10) << 3;
            z.extend_from_slice(&h.to_le_bytes()[..3]);
            z.push(0);
        }
        let why = batch_reason(&items("es/batches/s/zstd", &z));
        assert!(why.contains("more than 16 MiB"), "{why}");
        // A frame asking for a 32 MiB window is refused before decoding.
        let big_window = [0x28, 0xB5, 0x2F, 0xFD, 0x00, 15 << 3, 0x01, 0, 0];
        let why = batch_reason(&items("es/batches/s/zstd", &big_window));
        assert!(why.contains("window"), "{why}");
    }

    #[test]
    fn at_most_1000_events_in_a_batch() {
        let e = event(Format::Json, 7);
        let ok = vec![e.clone(); MAX_EVENTS];
        assert_eq!(items("es/batches/s", &json_batch(&ok)).len(), MAX_EVENTS);
        let over = vec![e; MAX_EVENTS + 1];
        let why = batch_reason(&items("es/batches/s", &json_batch(&over)));
        assert!(why.contains("1001 events"), "{why}");
        let pc = vec![event(Format::Postcard, 7); MAX_EVENTS + 1];
        let why = batch_reason(&items("es/batches/s", &postcard_batch(&pc)));
        assert!(why.contains("1001 events"), "{why}");
    }

    #[test]
    fn unreadable_batches_are_one_unreadable_item_with_a_reason() {
        let one = json_batch(&[event(Format::Json, 1)]);
        for (topic, payload, says) in [
            ("es/batches/s", b"{\"batch\":[".to_vec(), "neither"),
            ("es/batches/s", br#"{"batch":[],"x":1}"#.to_vec(), "neither"),
            ("es/batches/s", b"{\"batch\":[]}".to_vec(), "no events"),
            ("es/batches/s/lz4", one.clone(), "lz4 frame"),
            ("es/batches/s/zstd", one.clone(), "zstd"),
            ("es/batches/s/gzip", one, "unknown batch encoding"),
        ] {
            let items = items(topic, &payload);
            let why = batch_reason(&items);
            assert!(why.contains(says), "{topic}: {why}");
            assert_eq!(items[0].payload, payload, "kept as delivered");
        }
    }

    #[test]
    fn one_unreadable_event_does_not_cost_the_others_and_duplicates_are_stored_once() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut db = SinkDb::open(&d.path().join("sink.db")).expect("open");
        let good: Vec<Vec<u8>> = (1..=3).map(|n| event(Format::Json, n)).collect();
        let mut mixed = good.clone();
        mixed.insert(1, br#"{"not":"an envelope"}"#.to_vec());
        let first = items("es/dev-1/batches/system", &json_batch(&mixed));
        assert_eq!(first.len(), 4);
        let s = db.store_batch(&first, 1).expect("store");
        assert_eq!(
            s,
            SinkStats {
                first: 3,
                unreadable: 1,
                ..Default::default()
            }
        );
        // Event 2 alone, events 2..=4 in an lz4 batch, and a batch that
        // cannot be read at all: only event 4 is new.
        let mut again = items("es/dev-1/events/system", &good[1]);
        let more = vec![good[1].clone(), good[2].clone(), event(Format::Json, 4)];
        again.extend(items(
            "es/dev-1/batches/system/lz4",
            &lz4(&json_batch(&more)),
        ));
        again.extend(items("es/dev-1/batches/system/lz4", b"garbage"));
        let s = db.store_batch(&again, 2).expect("store");
        assert_eq!(
            s,
            SinkStats {
                first: 1,
                duplicates: 3,
                mismatches: 0,
                unreadable: 1,
                ..Default::default()
            }
        );
        for (n, e) in [(1u8, &good[0]), (4, &more[2])] {
            let id = EventId([n; 16]).hyphenated();
            assert_eq!(
                db.digest_of("dev-1", &id).expect("query"),
                Some(digest(e).to_vec())
            );
        }
    }

    /// Every topic of up to five levels from a small alphabet: where the
    /// sink's shape admits a topic, reading it from its end (`of_topic`,
    /// `publisher`, what the stores and receipts use) finds the same
    /// prefix, device and stream or none (then it is set aside), and
    /// `topic_kind` reads a single event where the shape does (field case
    /// F8).
    #[test]
    fn where_a_shape_admits_a_topic_every_reading_agrees() {
        const WORDS: [&str; 9] = [
            "edgespool",
            "gw1",
            "evil",
            "events",
            "batches",
            "lz4",
            "load",
            "holdings",
            "",
        ];
        let filters = [
            "edgespool/+/events/#",
            "+/+/events/#",
            "+/events/#",
            "edgespool/+/events/+",
        ];
        let shapes: Vec<Shape> = filters
            .iter()
            .map(|f| Shape::of_filter(f).expect("a filter that fixes the device"))
            .collect();
        let mut topics: Vec<String> = WORDS.iter().map(|w| (*w).to_owned()).collect();
        let mut last = topics.clone();
        for _ in 1..5 {
            last = last
                .iter()
                .flat_map(|t| WORDS.iter().map(move |w| format!("{t}/{w}")))
                .collect();
            topics.extend(last.iter().cloned());
        }
        let mut admitted = 0;
        for t in &topics {
            for s in &shapes {
                let Ok(id) = s.read(t) else { continue };
                admitted += 1;
                assert_eq!(s.publisher(t), id.device, "{t}");
                assert_eq!(publisher(t), id.device, "{t}");
                // Never another device's: read from the end, the same
                // identity or none (then set aside as forged).
                assert!(of_topic(t).is_none_or(|o| o == id), "{t} under {s}");
                let tail: Vec<&str> = t[id.prefix.len() + 1..].split('/').collect();
                let plain = matches!(
                    tail.as_slice(),
                    ["events", _] | ["batches", _] | ["batches", _, "lz4" | "zstd"]
                );
                if plain {
                    assert_eq!(of_topic(t), Some(id), "{t} under {s}");
                    let single = topic_kind(t) == TopicKind::Single;
                    assert_eq!(single, tail[0] == "events", "{t}");
                }
            }
        }
        assert!(admitted > 100, "{admitted}");
    }
}
