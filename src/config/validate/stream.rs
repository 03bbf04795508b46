//! A stream's settings, read once for every place a stream is declared
//! (`[[sources]]`, a bridge source, `[[ingest.streams]]`): `durability`,
//! `priority`, `live_first`, `batch_max_events`, `batch_max_ms`,
//! `compression` ([`StreamSettings`]).

use super::bounds::check_range;
use crate::config::raw::RawStreamDecl;
use crate::event::batching::supported;
use crate::event::stream::{
    default_priority, BatchSpec, Compression, Durability, StreamSettings, MAX_BATCH_EVENTS,
};
use std::time::Duration;

/// The settings `raw` gives a stream; `k` makes a key's path, `bad`
/// records a problem (a bad value is reported and its default assumed, so
/// every problem of a config is found in one pass).
pub(super) fn stream_settings(
    raw: &RawStreamDecl,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> StreamSettings {
    let durability = durability(raw.durability.as_deref(), &k("durability"), bad);
    let batch = batching(
        (
            raw.batch_max_events,
            raw.batch_max_ms,
            raw.compression.as_deref(),
        ),
        k,
        bad,
    );
    StreamSettings {
        durability,
        priority: raw.priority.unwrap_or_else(|| default_priority(durability)),
        live_first: raw.live_first.unwrap_or(false),
        batch,
    }
}

/// A stream's batching keys:
/// `batch_max_events` 1..=1000 (default 1: every event its own PUBLISH),
/// `batch_max_ms` 0..=600000 (default 1000), `compression` `"none"`,
/// `"lz4"` or `"zstd"` (only with batches; zstd only in builds with it).
/// `k` makes a key's path. `None`: no batching.
fn batching(
    (max_events, max_ms, compression): (Option<usize>, Option<u64>, Option<&str>),
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<BatchSpec> {
    let events = max_events.unwrap_or(1);
    check_range(&k("batch_max_events"), events, 1..=MAX_BATCH_EVENTS, bad);
    let ms = max_ms.unwrap_or(1000);
    check_range(&k("batch_max_ms"), ms, 0..=600_000, bad);
    let compression = match compression {
        None | Some("none") => Compression::None,
        Some("lz4") => Compression::Lz4,
        Some("zstd") => Compression::Zstd,
        Some(other) => {
            bad(
                &k("compression"),
                format!("must be \"none\", \"lz4\" or \"zstd\" (got {other:?})"),
            );
            Compression::None
        }
    };
    if !supported(compression) {
        bad(
            &k("compression"),
            "\"zstd\" is not in this build (built without the `zstd` feature, as the armv7 and armv6 packages are): use \"lz4\"".to_owned(),
        );
    }
    if events <= 1 {
        if compression != Compression::None {
            bad(
                &k("compression"),
                "compresses batches: set batch_max_events above 1 too".to_owned(),
            );
        }
        if max_ms.is_some() {
            bad(
                &k("batch_max_ms"),
                "applies to batches: set batch_max_events above 1 too".to_owned(),
            );
        }
        return None;
    }
    Some(BatchSpec {
        max_events: events.min(MAX_BATCH_EVENTS),
        max_wait: Duration::from_millis(ms.min(600_000)),
        compression,
    })
}

/// A stream's `durability`:
/// `"batched"` (the default) or `"full"`; anything else is a problem on
/// `key`, and batched is assumed.
fn durability(raw: Option<&str>, key: &str, bad: &mut impl FnMut(&str, String)) -> Durability {
    match raw {
        None | Some("batched") => Durability::Batched,
        Some("full") => Durability::Full,
        Some(other) => {
            bad(
                key,
                format!("must be \"batched\" or \"full\" (got {other:?})"),
            );
            Durability::Batched
        }
    }
}
