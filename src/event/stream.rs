//! Streams: their names, the agent's own streams, and what a stream can
//! set (durability, delivery priority, live-first, batching).
//!
//! Shared vocabulary at the bottom of the house: sources, ingest streams and
//! the bridge all name streams by these rules, and the spool, the delivery
//! lanes and the config read the same settings. Its one rule: a stream's
//! settings are defined once, here, and validated once, by the config.

use std::time::Duration;

/// Durability class of a stream (`durability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Group-committed every `spool.commit_window_ms` on a `synchronous =
    /// NORMAL` connection: a power cut may lose the readings of the open
    /// window and roll back commits since the last WAL sync.
    #[default]
    Batched,
    /// Committed as soon as taken, on a `synchronous = FULL` connection
    /// (fsync at each commit): once committed, it survives a power cut.
    /// Readings queued while a commit's fsync runs share the next commit
    /// (group commit in `agent::writer::group`; no timer waits for them).
    Full,
}

/// The agent's own events (config fallbacks and the like), published on
/// `<topic_prefix>/events/_agent`.
pub const AGENT_STREAM: &str = "_agent";

/// Stream (and topic suffix) of command result events.
pub const RESULTS_STREAM: &str = "_commands";

/// Delivery priority of the agent's own streams, `_commands` (command
/// results) and `_agent` (the agent's events): they go ahead of every
/// stream a config does not raise above it.
pub const AGENT_STREAM_PRIORITY: u8 = 200;

/// Delivery priority of a stream that sets none: 100 for `durability =
/// "full"` (a reading worth an fsync is worth sending first), 0 otherwise.
pub fn default_priority(durability: Durability) -> u8 {
    match durability {
        Durability::Full => 100,
        Durability::Batched => 0,
    }
}

/// Whether stream `name` matches `pattern`: a name, or a prefix followed by
/// one final `*` (`plant.*`). No other glob syntax.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.len() > prefix.len() && name.starts_with(prefix),
        None => pattern == name,
    }
}

/// The priority a stream gets when no config names it: the agent's own
/// streams (names starting with `_`: `_commands`, `_agent`) get
/// [`AGENT_STREAM_PRIORITY`], every other stream 0.
pub fn fallback_priority(stream: &str) -> u8 {
    if stream.starts_with('_') {
        AGENT_STREAM_PRIORITY
    } else {
        0
    }
}

/// The name rule of a stream (a source's `name`, an ingest stream): 1..=64
/// letters, digits, '-', '_' or '.', not starting with '_' (names starting
/// with '_' are the agent's own: `_commands`, `_agent`). A stream name is a
/// topic level (`<topic_prefix>/<stream>`), so no '/', '+' or '#'.
pub fn stream_name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && !name.starts_with('_') && name.chars().all(topic_safe)
}

/// A character allowed in a topic level the agent builds from a name:
/// ASCII letters, digits, '-', '_' and '.'.
pub fn topic_safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// How a batch's payload is compressed (`compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Sent as built (default).
    #[default]
    None,
    /// One LZ4 frame (lz4_flex, pure Rust).
    Lz4,
    /// One Zstandard frame, ruzstd's fastest level (about zstd level 1).
    /// Only in builds with the `zstd` feature.
    Zstd,
}

impl Compression {
    /// The topic level appended for this compression, if any.
    pub fn topic_suffix(self) -> &'static str {
        match self {
            Compression::None => "",
            Compression::Lz4 => "/lz4",
            Compression::Zstd => "/zstd",
        }
    }
}

/// A stream's batching (`batch_max_events` above 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSpec {
    /// `batch_max_events`: events per PUBLISH, 2..=1000.
    pub max_events: usize,
    /// `batch_max_ms`: the longest the first row of a batch waits for the
    /// batch to fill when no more rows are waiting (0..=600000 ms, default
    /// 1000). A backlog fills batches at once.
    pub max_wait: Duration,
    /// `compression`.
    pub compression: Compression,
}

/// Largest `batch_max_events`.
pub const MAX_BATCH_EVENTS: usize = 1000;

/// What a stream sets, with the same keys wherever a stream is declared
/// (`[[sources]]`, `[[ingest.streams]]`, a bridge source): read and
/// validated once by the config, used as it is by every part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamSettings {
    /// `durability`: `"batched"` (default) or `"full"` (committed at once on
    /// the `synchronous = FULL` connection).
    pub durability: Durability,
    /// `priority`: delivery priority 0..=255, higher first (default
    /// [`default_priority`] of its durability; see `crate::delivery::lanes`).
    pub priority: u8,
    /// `live_first`: new readings of this stream go ahead of its own
    /// backlog (default false; see `crate::delivery::lanes`).
    pub live_first: bool,
    /// `batch_max_events` (above 1), `batch_max_ms`, `compression`: several
    /// events per PUBLISH (`crate::event::batching`); `None`: one each.
    pub batch: Option<BatchSpec>,
}

impl StreamSettings {
    /// A stream that sets nothing: batched, its durability's default
    /// priority, no live-first, no batching (what a stream that an
    /// `ingest.stream_patterns` entry allows gets).
    pub fn plain() -> StreamSettings {
        StreamSettings {
            durability: Durability::Batched,
            priority: default_priority(Durability::Batched),
            live_first: false,
            batch: None,
        }
    }
}

/// Whether a topic level is one a sink reads a device's identity by
/// (`events`, `batches`: `<topic_prefix>/events/<stream>`): no
/// `mqtt.topic_prefix` may contain one.
pub fn reserved_level(level: &str) -> bool {
    matches!(level, "events" | "batches")
}
