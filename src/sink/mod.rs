//! `edgespool sink`: the reference consumer.
//!
//! ```text
//!  broker ──QoS 1 (persistent session, optionally $share/GROUP/..)──▶ consume
//!     ▲                                                               │ batch (size, age, pause)
//!     └──────────── PUBACK, in arrival order, after COMMIT ◀── store: one transaction per batch
//! ```
//!
//! - [`message`]: payload → columns and digest (pure);
//! - [`unbatch`]: a batched publish (`<prefix>/batches/...`, maybe lz4 or
//!   zstd) into one delivery item per event (pure);
//! - [`batch`]: what became of each delivery, and when a batch is due (pure);
//! - [`consume`]: the MQTT session, batches, acknowledgements;
//! - [`sqlite`]: the single-machine store (rigs and tests);
//! - `pg_schema`, `postgres`: the fleet store, its schema and migrations (feature `pg-sink`);
//! - `stats`: `sink --stats` (feature `pg-sink` for PostgreSQL).
//!
//! The one rule: **a delivery is acknowledged only after the transaction
//! holding it has committed**. QoS 1 is "at least once" (MQTT 3.1.1 §4.3.2,
//! MQTT 5 §4.3.2): the broker keeps an unacknowledged message in the
//! client's session and sends it again, so a sink killed at any point loses
//! nothing, and every event id keeps the digest of its first payload, so a
//! second delivery is counted as a duplicate, or as a payload mismatch (which
//! must be zero: I3) if its bytes differ. Shared subscriptions (MQTT 5
//! §4.8.2) spread one filter over N sinks; each sink is stateless, the
//! session lives in the broker under the sink's client id.

pub mod batch;
pub mod consume;
pub mod message;
#[cfg(feature = "pg-sink")]
pub mod pg_schema;
#[cfg(feature = "pg-sink")]
pub mod pg_tls;
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
    /// Deliveries that were not an edgespool envelope.
    pub unreadable: u64,
}

impl std::ops::AddAssign for SinkStats {
    fn add_assign(&mut self, o: SinkStats) {
        self.first += o.first;
        self.duplicates += o.duplicates;
        self.mismatches += o.mismatches;
        self.unreadable += o.unreadable;
    }
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
}

/// Where batches go. One transaction per call.
pub trait Store {
    /// Store `items` in one transaction and return what became of them.
    /// `Ok` means committed; only then may they be acknowledged.
    ///
    /// Errors: [`StoreError`]; nothing of the batch may be acknowledged.
    fn store_batch(&mut self, items: &[batch::Item], now_ms: i64) -> Result<SinkStats, StoreError>;
}
