//! Batched publishes: several events of one stream in one PUBLISH, for
//! metered links.
//!
//! One job: gather a batched stream's rows and build the batch's topic and
//! payload. Each event keeps its id and its stored bytes; the batch is only
//! a wrapper. Every row in a batch is retired by that PUBLISH's PUBACK and
//! nothing else ([`crate::mqtt`] maps the packet id to all of them); after a
//! lost connection the rows are read again and batches may be rebuilt with
//! other members, so a consumer deduplicates per event id.
//!
//! Wire format (docs/fleet.md, "Batched and compressed publishes"):
//! - topic `<topic_prefix>/batches/<stream>`, or with `/lz4` or `/zstd`
//!   appended when compressed (a stream name holds no `/`);
//! - JSON events: `{"batch":[` + each event's JSON bytes joined by `,` +
//!   `]}`;
//! - postcard events: postcard's encoding of a sequence of byte strings:
//!   varint count, then each event as varint length + its bytes
//!   (<https://postcard.jamesmunns.com/wire-format>, "seq" and "byte
//!   array");
//! - a batch never mixes the two (a format change starts a new batch);
//! - compressed: the payload above as one standard LZ4 frame
//!   (<https://github.com/lz4/lz4/blob/dev/doc/lz4_Frame_format.md>) or one
//!   Zstandard frame (RFC 8878).

use crate::event::stream::Compression;
use std::time::Instant;

/// The wire format of a stored payload (batches never mix them): JSON
/// when it parses as JSON, postcard otherwise.
pub fn is_json(payload: &[u8]) -> bool {
    payload.first() == Some(&b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_ok()
}

/// The payload of a batch of `events` (all JSON, or all postcard; see the
/// module doc), compressed as `compression` says.
///
/// Errors: a text naming the failure (postcard encoding, compression); the
/// rows then go out one by one.
pub fn payload(events: &[&[u8]], json: bool, compression: Compression) -> Result<Vec<u8>, String> {
    let plain = if json {
        let len: usize = events.iter().map(|e| e.len() + 1).sum();
        let mut out = Vec::with_capacity(len + 12);
        out.extend_from_slice(b"{\"batch\":[");
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(e);
        }
        out.extend_from_slice(b"]}");
        out
    } else {
        postcard::to_allocvec(events).map_err(|e| format!("postcard batch: {e}"))?
    };
    compress(&plain, compression)
}

fn compress(plain: &[u8], compression: Compression) -> Result<Vec<u8>, String> {
    match compression {
        Compression::None => Ok(plain.to_vec()),
        Compression::Lz4 => {
            use std::io::Write;
            let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(plain.len() / 2));
            enc.write_all(plain).map_err(|e| format!("lz4: {e}"))?;
            enc.finish().map_err(|e| format!("lz4: {e}"))
        }
        #[cfg(feature = "zstd")]
        Compression::Zstd => Ok(ruzstd::encoding::compress_to_vec(
            plain,
            ruzstd::encoding::CompressionLevel::Fastest,
        )),
        #[cfg(not(feature = "zstd"))]
        Compression::Zstd => Err("this build has no zstd (the `zstd` feature)".to_owned()),
    }
}

/// Whether this build can compress with `c`.
pub fn supported(c: Compression) -> bool {
    c != Compression::Zstd || cfg!(feature = "zstd")
}

/// A batch being gathered for one stream: rows in row-id order.
#[derive(Debug)]
pub struct Pending<R> {
    /// The rows, oldest first.
    pub rows: Vec<R>,
    /// Whether the rows are JSON (see [`is_json`]).
    pub json: bool,
    /// Sum of the rows' payload bytes.
    pub bytes: usize,
    /// When the first row joined.
    pub since: Instant,
}

impl<R> Pending<R> {
    /// A batch holding `row` (`len` payload bytes).
    pub fn new(row: R, json: bool, len: usize) -> Pending<R> {
        Pending {
            rows: vec![row],
            json,
            bytes: len,
            since: Instant::now(),
        }
    }

    /// The uncompressed payload size with one more event of `len` bytes:
    /// an upper bound for JSON (12 bytes of wrapper and a comma each) and
    /// for postcard (at most 5 bytes of varint each and for the count).
    pub fn size_with(&self, len: usize) -> usize {
        self.bytes + len + 6 * (self.rows.len() + 1) + 12
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_batch_is_an_object_holding_the_events_verbatim() {
        let a = br#"{"event_id":"a","x":1}"#;
        let b = br#"{"event_id":"b","x":2.5}"#;
        let p = payload(&[a, b], true, Compression::None).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&p).unwrap();
        assert_eq!(v["batch"][0]["event_id"], "a");
        assert_eq!(v["batch"][1]["x"], 2.5);
        assert_eq!(
            std::str::from_utf8(&p).unwrap(),
            r#"{"batch":[{"event_id":"a","x":1},{"event_id":"b","x":2.5}]}"#
        );
    }

    #[test]
    fn a_postcard_batch_is_a_sequence_of_byte_strings() {
        let a: &[u8] = &[1, 2, 3];
        let b: &[u8] = &[9; 200];
        let p = payload(&[a, b], false, Compression::None).unwrap();
        // count 2, len 3, bytes, len 200 (varint 0xC8 0x01), bytes.
        assert_eq!(&p[..5], &[2, 3, 1, 2, 3]);
        assert_eq!(&p[5..7], &[0xC8, 0x01]);
        let back: Vec<Vec<u8>> = postcard::from_bytes(&p).unwrap();
        assert_eq!(back, vec![a.to_vec(), b.to_vec()]);
    }

    #[test]
    fn lz4_and_zstd_batches_decompress_to_the_plain_batch() {
        let ev = br#"{"event_id":"0b1c","stream":"tele","fields":{"t":21.5,"rh":40.25}}"#;
        let events: Vec<&[u8]> = (0..50).map(|_| &ev[..]).collect();
        let plain = payload(&events, true, Compression::None).unwrap();
        let lz = payload(&events, true, Compression::Lz4).unwrap();
        assert!(
            lz.len() < plain.len() / 4,
            "{} vs {}",
            lz.len(),
            plain.len()
        );
        let mut back = Vec::new();
        std::io::Read::read_to_end(&mut lz4_flex::frame::FrameDecoder::new(&lz[..]), &mut back)
            .unwrap();
        assert_eq!(back, plain);
        #[cfg(feature = "zstd")]
        {
            let z = payload(&events, true, Compression::Zstd).unwrap();
            assert!(z.len() < plain.len() / 4, "{} vs {}", z.len(), plain.len());
            let mut back = Vec::new();
            let mut dec = ruzstd::decoding::StreamingDecoder::new(&z[..]).unwrap();
            std::io::Read::read_to_end(&mut dec, &mut back).unwrap();
            assert_eq!(back, plain);
        }
    }

    #[test]
    fn the_size_bound_covers_the_built_payload() {
        let big = vec![b'7'; 300];
        let json = format!("{{\"v\":{}}}", String::from_utf8(big).unwrap());
        let mut p = Pending::new((), true, json.len());
        for _ in 1..40 {
            p.rows.push(());
            p.bytes += json.len();
        }
        let events: Vec<&[u8]> = (0..40).map(|_| json.as_bytes()).collect();
        let built = payload(&events, true, Compression::None).unwrap();
        assert!(p.size_with(0) >= built.len());
        let pc = payload(&events, false, Compression::None).unwrap();
        assert!(p.size_with(0) >= pc.len());
    }

    #[test]
    fn a_compressed_frame_of_incompressible_bytes_stays_within_the_room_kept() {
        // xorshift bytes: nothing to compress.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..200_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let events: Vec<&[u8]> = noise.chunks(10_000).collect();
        let plain = payload(&events, false, Compression::None).unwrap();
        let room = plain.len() / 128 + 64;
        let lz = payload(&events, false, Compression::Lz4).unwrap();
        assert!(
            lz.len() <= plain.len() + room,
            "lz4 {} > {} + {room}",
            lz.len(),
            plain.len()
        );
        #[cfg(feature = "zstd")]
        {
            let z = payload(&events, false, Compression::Zstd).unwrap();
            assert!(
                z.len() <= plain.len() + room,
                "zstd {} > {} + {room}",
                z.len(),
                plain.len()
            );
        }
    }
}
