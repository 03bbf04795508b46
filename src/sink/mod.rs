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
//! - [`clock`]: which clock anchors are believed, and a reading's corrected
//!   time (pure);
//! - [`outbox`]: the receipts a committed batch owes its devices, queued (pure);
//! - [`ledger`]: the replay ledger: per (device, stream) what the database
//!   holds, its gaps, and what boards' holdings and answers change in it
//!   (pure), over each store's transaction;
//! - [`notes`]: boards' holdings and answers as read from their topic, and
//!   the requests for ranges sent back (pure);
//! - [`poller`]: rumqttc's event loop polled to completion on its own thread;
//! - [`committer`]: the store on a thread of its own, one batch with it at most;
//! - [`consume`]: the MQTT session, batches, acknowledgements, receipts;
//! - [`sqlite`]: the single-machine store (rigs and tests); `sqlite_clock`
//!   its clock columns and anchors;
//! - `pg_schema`, `postgres`, `pg_copy`: the fleet store, its schema and migrations, its
//!   fast path (a binary `COPY` of a batch whose keys are all new) (feature `pg-sink`);
//!   `pg_clock` its clock columns, anchors and the lock between them;
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
//! devices get receipts naming what the database holds ([`outbox`]). The
//! same transaction keeps the replay ledger ([`ledger`]): boards announce
//! what they hold, and a database that lacks rows a board still has (a
//! restore from a backup) asks for them again, signed like receipts.
//! Deliveries set aside (unreadable, forged, mismatches, clock anchors not
//! believed) go to side tables of bounded size ([`SideBounds`]). Shared
//! subscriptions (MQTT 5 §4.8.2) spread one filter over N sinks; each sink
//! is stateless, the session lives in the broker under the sink's client id.

pub mod batch;
pub mod clock;
pub mod committer;
pub mod conninfo;
pub mod consume;
pub mod identity;
pub mod ledger;
pub mod message;
pub mod notes;
pub mod outbox;
#[cfg(feature = "pg-sink")]
pub mod pg_clock;
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
mod sqlite_clock;
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
    /// Clock anchors believed ([`clock`]): a boot's first, or one agreeing
    /// with it.
    pub anchors: u64,
    /// Clock anchors kept aside in `clock_refused` with their reason
    /// ([`clock::Refused`]); they move no reading.
    pub anchors_refused: u64,
    /// Readings given a corrected time (`ts_corrected_ms`): at their
    /// insert, or when their boot's anchor came.
    pub corrected: u64,
    /// Boards' holdings and answers applied to the ledger.
    pub notes: u64,
    /// Notes set aside: unreadable, or naming another board than their
    /// topic's.
    pub notes_refused: u64,
    /// Requests for ranges made of boards (backfill).
    pub asks: u64,
    /// Rows those requests named.
    pub asked_rows: u64,
    /// Rows the ledger gave up: boards no longer hold them, or sent none
    /// after repeated requests.
    pub gone_rows: u64,
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
        self.anchors += o.anchors;
        self.anchors_refused += o.anchors_refused;
        self.corrected += o.corrected;
        self.notes += o.notes;
        self.notes_refused += o.notes_refused;
        self.asks += o.asks;
        self.asked_rows += o.asked_rows;
        self.gone_rows += o.gone_rows;
    }
}

/// The summary line's words: `first N duplicates N mismatches N unreadable
/// N forged N side_dropped N receipts N receipts_dropped N oversized N
/// anchors N anchors_refused N corrected N notes N notes_refused N asks N
/// asked_rows N gone_rows N`.
impl std::fmt::Display for SinkStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "first {} duplicates {} mismatches {} unreadable {} forged {} side_dropped {} \
             receipts {} receipts_dropped {} oversized {} anchors {} anchors_refused {} \
             corrected {} notes {} notes_refused {} asks {} asked_rows {} gone_rows {}",
            self.first,
            self.duplicates,
            self.mismatches,
            self.unreadable,
            self.forged,
            self.side_dropped,
            self.receipts,
            self.receipts_dropped,
            self.oversized,
            self.anchors,
            self.anchors_refused,
            self.corrected,
            self.notes,
            self.notes_refused,
            self.asks,
            self.asked_rows,
            self.gone_rows
        )
    }
}

/// How large a side table (`unreadable`, `forged`, `mismatches`,
/// `clock_refused`) may grow:
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

    /// Apply boards' holdings and answers to the ledger in one transaction
    /// ([`ledger::book::apply_notes`]); `asking`: requests may be made (the
    /// sink has a key to sign them). Returns the requests to send. A store
    /// without a ledger applies nothing.
    ///
    /// Errors: as [`Store::commit`].
    fn notes(
        &mut self,
        notes: &[notes::BoardNote],
        asking: bool,
        now_ms: i64,
    ) -> Result<ledger::book::NotesDone, StoreError> {
        let _ = (notes, asking, now_ms);
        Ok(Default::default())
    }

    /// The ledger's figures for the summary line ([`LedgerSummary`]).
    ///
    /// Errors: as [`Store::commit`].
    fn ledger_summary(&mut self) -> Result<LedgerSummary, StoreError> {
        Ok(LedgerSummary::default())
    }
}

/// What the ledger says is missing, all boards: the summary line's
/// `boards_with_gaps N rows_missing N oldest_gap_s N rows_gone N`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LedgerSummary {
    /// Boards with at least one open gap.
    pub boards_with_gaps: u64,
    /// Rows in open gaps (missing, asked for or on their way).
    pub rows_missing: u64,
    /// When the oldest open gap was first seen, Unix ms.
    pub oldest_gap_since_ms: Option<i64>,
    /// Rows given up (gone, with a reason).
    pub rows_gone: u64,
}

impl LedgerSummary {
    /// The summary line's words at wall-clock `now_ms`.
    pub fn words(&self, now_ms: i64) -> String {
        let age = self
            .oldest_gap_since_ms
            .map_or(0, |t| (now_ms - t).max(0) / 1000);
        format!(
            "boards_with_gaps {} rows_missing {} oldest_gap_s {age} rows_gone {}",
            self.boards_with_gaps, self.rows_missing, self.rows_gone
        )
    }
}

/// The SQL of [`LedgerSummary`], the same in both stores.
pub(crate) const LEDGER_SUMMARY: &str = "
SELECT count(DISTINCT CASE WHEN gone_reason IS NULL THEN device_id END),
       CAST(coalesce(sum(CASE WHEN gone_reason IS NULL THEN last_seq - first_seq + 1 END), 0)
            AS BIGINT),
       min(CASE WHEN gone_reason IS NULL THEN since_ms END),
       CAST(coalesce(sum(CASE WHEN gone_reason IS NOT NULL THEN last_seq - first_seq + 1 END),
                     0) AS BIGINT)
FROM ledger_gaps";
