//! A batched publish as the sink reads it: `sink::unbatch::items`, which the
//! sink's MQTT session calls on every delivery (topic, then payload:
//! decompress, split into events, decode each).
//!
//! Input: one byte choosing the topic (a single event, a plain batch, an lz4
//! batch, a zstd batch, an unknown encoding), then the payload bytes.
//!
//! Bounds asserted: a delivery becomes at most `MAX_EVENTS` items (one
//! unreadable item for a batch that cannot be read at all), each holding
//! its bytes (an event of the batch, or the delivery as it came), no item
//! larger than the decompression bound, and a batch never yields both an
//! unreadable-batch item and events.
#![no_main]

use edgespool::sink::message::Unreadable;
use edgespool::sink::unbatch::{items, MAX_DECOMPRESSED, MAX_EVENTS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, payload)) = data.split_first() else {
        return;
    };
    let topic = [
        "es/dev/events/tele",
        "es/dev/batches/tele",
        "es/dev/batches/tele/lz4",
        "es/dev/batches/tele/zstd",
        "es/dev/batches/tele/gzip",
    ][usize::from(which) % 5];
    let out = items(topic, payload);
    assert!(!out.is_empty(), "a delivery became no item");
    assert!(out.len() <= MAX_EVENTS, "{} items", out.len());
    let whole_refused = out
        .iter()
        .any(|i| matches!(i.read, Err(Unreadable::Batch(_))));
    if whole_refused {
        assert_eq!(out.len(), 1, "a refused batch is one item");
        assert_eq!(out[0].payload, payload, "kept as delivered");
    }
    for i in &out {
        assert!(i.payload.len() <= MAX_DECOMPRESSED.max(payload.len()));
        assert_eq!(i.topic, topic);
    }
});
