//! What crosses between the MQTT thread and the threads it serves: the
//! messages to the delivery thread ([`DeliveryMsg`]), the rows it offers
//! ([`Ready`]), why an offer is refused ([`NotNow`]), and the command
//! subscription the command thread hands in ([`CommandSub`]).
//!
//! Its one rule: these are plain values owned by whoever holds them; nothing
//! here locks, blocks or reaches the network, so either side may pass them
//! at any moment (the MQTT thread sends a [`DeliveryMsg`] without ever
//! waiting on the delivery thread).

use std::sync::Arc;

/// Messages to the delivery thread.
#[derive(Debug)]
pub enum DeliveryMsg {
    /// Acknowledgements or submissions are waiting in [`super::Link::take_progress`],
    /// or the ready queue is running low.
    Progress,
    /// The connection was dropped or rebuilt: these rows are no longer in
    /// flight and none was retired. From now on, offers must carry `epoch`.
    Lost {
        /// The new epoch.
        epoch: u64,
        /// Rows that were in flight.
        rows: Vec<i64>,
        /// Why (for the log).
        reason: String,
        /// The connection ended within a keep-alive of its CONNACK without
        /// carrying a PUBACK (what a broker refusing a publish looks like).
        quick: bool,
        /// The peer (or the network) closed it within a keep-alive of the
        /// oldest row in flight leaving, with no PUBACK since: what a
        /// broker closing on a publish looks like, mid-connection too.
        closed_on_rows: bool,
        /// The watchdog ended it: connected, rows in flight and no PUBACK
        /// for `mqtt.ack_timeout_secs`; the client is rebuilt (counted as
        /// `mqtt_watchdog_rebuilds`).
        watchdog: bool,
    },
    /// CONNACK accepted.
    Connected {
        /// The broker's `session_present` flag (MQTT 3.1.1 §3.2.2.2).
        session_present: bool,
    },
    /// New rows were committed to the spool.
    NewRows,
    /// FAILED rows were requeued (appended again) by `requeue-failed`: an
    /// operator retries them, so a packet limit learned from a dropped
    /// connection is forgotten.
    Requeued,
    /// The agent is stopping: look at the stop flag now.
    Stop,
    /// A PUBLISH on `<topic_prefix>/receipts` (`mqtt.retire_on =
    /// "receipt"`), unread ([`crate::event::receipts::parse`]), received on
    /// the connection of `epoch`. Not yet acknowledged: the delivery thread
    /// acknowledges it once read ([`super::Link::ack`]); at most
    /// [`RECEIPTS_QUEUED_MAX`] wait.
    Receipt {
        /// The connection it came on.
        epoch: u64,
        /// The PUBLISH (its payload, and its packet id for the PUBACK).
        publish: Box<rumqttc::Publish>,
    },
    /// A PUBLISH on `<topic_prefix>/backfill` (the fleet asks for rows
    /// again), unread ([`crate::event::backfill::parse_request`]), received
    /// on the connection of `epoch`. Acknowledged by the delivery thread
    /// once read, as a receipt is; at most [`REQUESTS_QUEUED_MAX`] wait.
    Backfill {
        /// The connection it came on.
        epoch: u64,
        /// The PUBLISH.
        publish: Box<rumqttc::Publish>,
    },
    /// Whether receipts can arrive: the broker granted (`true`) or refused
    /// the subscription to the receipts topic on this connection. Refused,
    /// rows wait: a refusal retires nothing.
    Receipts {
        /// Granted.
        available: bool,
        /// Why not, for the log and health.
        why: Option<String>,
    },
}

/// Receipts waiting for the delivery thread, at most. The broker sends no
/// more than its in-flight window of unacknowledged receipts (mosquitto:
/// 20), so this is reached only by a broker that ignores it; one over it is
/// left unacknowledged and counted (memory stays bounded, nothing is lost:
/// the broker sends it again with the next session).
pub const RECEIPTS_QUEUED_MAX: usize = 1024;

/// Backfill requests waiting for the delivery thread, at most; one over it
/// is left unacknowledged and counted (the broker's in-flight window paces
/// them otherwise: a flood of requests waits at the broker, not here).
pub const REQUESTS_QUEUED_MAX: usize = 16;

/// A row read from the spool, ready to publish.
#[derive(Debug, Clone)]
pub struct Ready {
    /// Spool row id.
    pub row: i64,
    /// `<topic_prefix>/events/<stream>`.
    pub topic: Arc<str>,
    /// The stored payload bytes.
    pub payload: Vec<u8>,
    /// The row's event id, sent as the `event_id` user property under MQTT 5
    /// (`None` for a batch: its events carry their own ids in the payload).
    pub event_id: Option<crate::event::envelope::EventId>,
    /// A batch ([`crate::event::batching`]): every row it carries, `row` first, in
    /// row-id order; one PUBACK retires them all. Empty for a single row.
    pub members: Vec<i64>,
}

/// Why an offer was refused. The rows stay in the spool and are read again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotNow {
    /// The caller's epoch is stale: process the pending [`DeliveryMsg::Lost`] first.
    StaleEpoch,
}

/// Where PUBLISHes on the command topic go: `(connection epoch, publish)`.
pub type CommandSink = Box<dyn Fn(u64, rumqttc::Publish) + Send>;

/// The command subscription.
pub struct CommandSub {
    /// `<topic_prefix>/commands`.
    pub topic: String,
    /// `commands.max_payload_bytes`: sets the incoming packet limit.
    pub max_payload_bytes: usize,
    /// Where its messages go.
    pub sink: CommandSink,
}
