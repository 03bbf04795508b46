//! `edgespool sink`: the reference consumer.
//!
//! ```text
//!  broker ──QoS 1 (persistent session, optionally $share/GROUP/..)──▶ consume
//!     ▲                                                               │ batch (size, age, pause)
//!     └──────────── PUBACK, in arrival order, after COMMIT ◀── store: one transaction per batch
//! ```
//!
//! - [`message`]: payload → columns and digest (pure);
//! - [`identity`]: the device and stream a topic names; an envelope that
//!   claims another is forged (pure);
//! - [`unbatch`]: a batched publish (`<prefix>/batches/...`, maybe lz4 or
//!   zstd) into one delivery item per event (pure);
//! - [`batch`]: what became of each delivery, and when a batch is due (pure);
//! - [`outbox`]: the receipts a committed batch owes its devices, queued (pure);
//! - [`poller`]: rumqttc's event loop polled to completion on its own thread;
//! - [`committer`]: the store on a thread of its own, one batch with it at most;
//! - [`consume`]: the MQTT session, batches, acknowledgements, receipts;
//! - [`sqlite`]: the single-machine store (rigs and tests);
//! - `pg_schema`, `postgres`, `pg_copy`: the fleet store, its schema and migrations, its
//!   fast path (a binary `COPY` of a batch whose keys are all new) (feature `pg-sink`);
//! - [`conninfo`]: a conninfo shown without its passwords (pure);
//! - `pg_password`, `pg_tls`: where the PostgreSQL password comes from,
//!   TLS (feature `pg-sink`);
//! - `stats`: `sink --stats` (feature `pg-sink` for PostgreSQL).
//!
//! The one rule: **a delivery is acknowledged only after the transaction
//! holding it has committed**. QoS 1 is "at least once" (MQTT 3.1.1 §4.3.2,
//! MQTT 5 §4.3.2): the broker keeps an unacknowledged message in the
//! client's session and sends it again, so a sink killed at any point loses
//! nothing, and every event id keeps the digest of its first payload, so a
//! second delivery is counted as a duplicate, or as a payload mismatch (which
//! must be zero: I3) if its bytes differ. Identity comes from the topic
//! ([`identity`]), keys are (device, event id), and after each commit the
//! devices get receipts naming what the database holds ([`outbox`]).
//! Deliveries set aside (unreadable, forged, mismatches) go to side tables
//! of bounded size ([`SideBounds`]). Shared subscriptions (MQTT 5
//! §4.8.2) spread one filter over N sinks; each sink is stateless, the
//! session lives in the broker under the sink's client id.

pub mod batch;
pub mod committer;
pub mod conninfo;
pub mod consume;
pub mod identity;
pub mod message;
pub mod outbox;
#[cfg(feature = "pg-sink")]
pub mod pg_copy;
#[cfg(feature = "pg-sink")]
pub mod pg_password;
#[cfg(feature = "pg-sink")]
pub mod pg_schema;
#[cfg(feature = "pg-sink")]
pub mod pg_tls;
pub mod poller;
#[cfg(feature = "pg-sink")]
pub mod postgres;
pub mod sqlite;
pub mod stats;
pub mod unbatch;

pub use consume::{run, SinkOptions};
pub use sqlite::{envelope_identity, SinkDb};

/// What a sink has seen (this process, or a batch of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SinkStats {
    /// Events stored the first time.
    pub first: u64,
    /// Deliveries of an event id already stored, same payload.
    pub duplicates: u64,
    /// Deliveries of a stored event id with different payload bytes.
    pub mismatches: u64,
    /// Deliveries that were not an edgespool envelope (oversized ones
    /// included).
    pub unreadable: u64,
    /// Deliveries over the incoming limit, read on a session with a raised
    /// limit and set aside (counted in `unreadable` too).
    pub oversized: u64,
    /// Envelopes of another device or stream than their topic's (set aside).
    pub forged: u64,
    /// Rows dropped from a side table, oldest first, to keep it within
    /// [`SideBounds`].
    pub side_dropped: u64,
    /// Receipts published (handed to the MQTT client, QoS 1).
    pub receipts: u64,
    /// Receipts given up because the queue they wait in was full (the agent
    /// sends those rows again after its timeout, and gets a receipt then).
    pub receipts_dropped: u64,
}

impl std::ops::AddAssign for SinkStats {
    fn add_assign(&mut self, o: SinkStats) {
        self.first += o.first;
        self.duplicates += o.duplicates;
        self.mismatches += o.mismatches;
        self.unreadable += o.unreadable;
        self.oversized += o.oversized;
        self.forged += o.forged;
        self.side_dropped += o.side_dropped;
        self.receipts += o.receipts;
        self.receipts_dropped += o.receipts_dropped;
    }
}

/// The summary line's words: `first N duplicates N mismatches N unreadable
/// N forged N side_dropped N receipts N receipts_dropped N oversized N`.
impl std::fmt::Display for SinkStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "first {} duplicates {} mismatches {} unreadable {} forged {} side_dropped {} \
             receipts {} receipts_dropped {} oversized {}",
            self.first,
            self.duplicates,
            self.mismatches,
            self.unreadable,
            self.forged,
            self.side_dropped,
            self.receipts,
            self.receipts_dropped,
            self.oversized
        )
    }
}

/// How large a side table (`unreadable`, `forged`, `mismatches`) may grow:
/// anyone with publish rights can fill one, so each has a row count and a
/// byte bound per device and for the whole table (counted in `side_drops`
/// and [`SinkStats::side_dropped`]).
///
/// A row belongs to the device that published it (the topic's, see
/// [`identity::publisher`]), so one device's junk evicts only its own oldest
/// rows. Over the table's bounds, every device keeps its newest rows
/// evenly: rows go from the devices that hold the most, oldest first (a
/// device with few rows keeps them while many devices flood).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideBounds {
    /// Most rows kept per table, all devices.
    pub rows: i64,
    /// Most bytes of one payload kept (a longer one is cut there; its
    /// digest and `payload_bytes` still describe the whole delivery).
    pub payload_bytes: usize,
    /// Most payload bytes kept per table, all devices.
    pub table_bytes: i64,
    /// Most rows kept per table for one device.
    pub device_rows: i64,
    /// Most payload bytes kept per table for one device.
    pub device_bytes: i64,
}

impl Default for SideBounds {
    /// 10,000 rows and 64 MiB per table, 1,000 rows and 8 MiB per device,
    /// 64 KiB per payload.
    fn default() -> SideBounds {
        SideBounds {
            rows: 10_000,
            payload_bytes: 64 << 10,
            table_bytes: 64 << 20,
            device_rows: 1_000,
            device_bytes: 8 << 20,
        }
    }
}

impl SideBounds {
    /// The part of `payload` a side table keeps.
    pub fn cut<'a>(&self, payload: &'a [u8]) -> &'a [u8] {
        &payload[..payload.len().min(self.payload_bytes)]
    }
}

/// What a committed batch did: its counters, and the fate of each item in
/// order (the receipts come from these).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// Counters.
    pub stats: SinkStats,
    /// One per item, in order.
    pub fates: Vec<batch::Fate>,
}

/// A store failure, by what the caller does.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The batch did not commit and may succeed later (connection lost,
    /// deadlock, server restarting): drop the batch unacknowledged, reconnect,
    /// and let the broker deliver it again.
    #[error("store unavailable (will retry): {0}")]
    Transient(String),
    /// Retrying cannot help (schema newer than this sink, permission denied,
    /// a file that cannot be written): exit non-zero.
    #[error("store failed: {0}")]
    Fatal(String),
    /// The store's settings cannot work (the server asks for a password
    /// and none was given, a conninfo the client refuses): the operator
    /// fixes them; exit 2, so a supervisor does not restart into the same
    /// answer.
    #[error("store settings cannot work: {0}")]
    Settings(String),
}

/// Where batches go. One transaction per call.
pub trait Store {
    /// Store `items` in one transaction and return what became of each.
    /// `Ok` means committed; only then may they be acknowledged, and only
    /// the items whose fate is [`batch::Fate::held`] receipted.
    ///
    /// Errors: [`StoreError`]; nothing of the batch may be acknowledged.
    fn commit(&mut self, items: &[batch::Item], now_ms: i64) -> Result<Stored, StoreError>;

    /// As [`Store::commit`], the counters only.
    ///
    /// Errors: as [`Store::commit`].
    fn store_batch(&mut self, items: &[batch::Item], now_ms: i64) -> Result<SinkStats, StoreError> {
        self.commit(items, now_ms).map(|s| s.stats)
    }
}
