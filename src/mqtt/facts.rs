//! The connection's story across reconnects: what the MQTT thread keeps
//! about its connections ([`ConnState`]: when the state last changed, why
//! the last one ended, quick drops, a command subscription the broker will
//! not take) and the copy health reads ([`LinkFacts`]).
//!
//! Its one rule: only the MQTT thread writes the story; health gets a copy
//! taken under the shared lock, never a reference into it, so a health
//! check cannot hold the lock the connection needs.

use std::time::{Duration, Instant};

/// The connection's story for health and backoff.
#[derive(Debug)]
pub(super) struct ConnState {
    /// When `connected` last changed.
    pub(super) since: Instant,
    /// Why the last connection ended or the last attempt failed.
    pub(super) last_error: Option<String>,
    /// When this connection's CONNACK arrived.
    pub(super) connacked_at: Option<Instant>,
    /// This connection carried a PUBACK.
    pub(super) had_puback: bool,
    /// The command SUBSCRIBE went out on this connection and no SUBACK came.
    pub(super) awaiting_suback: bool,
    /// Connections in a row that ended within a keep-alive of CONNACK
    /// without a PUBACK.
    pub(super) quick_drops: u32,
    /// Connections in a row that ended while the command SUBSCRIBE waited.
    pub(super) sub_kills: u32,
    /// Connect without the command subscription until then.
    pub(super) skip_sub_until: Option<Instant>,
    /// The next wait before trying the command subscription again.
    pub(super) sub_retry: Duration,
    /// Why commands cannot arrive, if they cannot.
    pub(super) commands_unavailable: Option<String>,
    /// Why receipts cannot arrive, if they cannot (receipt mode only).
    pub(super) receipts_unavailable: Option<String>,
    /// The SUBSCRIBEs of this connection whose SUBACK has not come, in the
    /// order sent (a broker answers them in that order).
    pub(super) subacks_due: std::collections::VecDeque<Sub>,
    /// This connection ended by an error from the peer or the network (not
    /// by our watchdog, a reconfigure or a stop).
    pub(super) peer_closed: bool,
}

impl ConnState {
    /// A story that starts now: disconnected, nothing failed yet.
    pub(super) fn new() -> ConnState {
        ConnState {
            since: Instant::now(),
            last_error: None,
            connacked_at: None,
            had_puback: false,
            awaiting_suback: false,
            quick_drops: 0,
            sub_kills: 0,
            skip_sub_until: None,
            sub_retry: SUB_RETRY_MIN,
            commands_unavailable: None,
            receipts_unavailable: None,
            subacks_due: std::collections::VecDeque::new(),
            peer_closed: false,
        }
    }
}

/// What a SUBSCRIBE was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sub {
    /// `<topic_prefix>/commands`.
    Commands,
    /// `<topic_prefix>/receipts`.
    Receipts,
    /// `<topic_prefix>/backfill`.
    Backfill,
}

/// First wait before subscribing to commands again after the broker closed
/// connections on the subscription; doubles up to [`SUB_RETRY_MAX`].
pub(super) const SUB_RETRY_MIN: Duration = Duration::from_secs(600);
/// Longest wait before trying the command subscription again.
pub(super) const SUB_RETRY_MAX: Duration = Duration::from_secs(3600);

/// What [`super::Link::health_facts`] reports.
#[derive(Debug, Clone)]
pub struct LinkFacts {
    /// Connected now.
    pub connected: bool,
    /// How long in the current state.
    pub state_for: Duration,
    /// Why the last connection ended.
    pub last_error: Option<String>,
    /// Rows submitted, not acknowledged.
    pub in_flight: usize,
    /// Since the oldest in-flight row was submitted or the last PUBACK.
    pub no_puback_for: Option<Duration>,
    /// See [`crate::agent::health::Facts::quick_drops`].
    pub quick_drops: u32,
    /// Why commands cannot arrive.
    pub commands_unavailable: Option<String>,
    /// Why receipts cannot arrive (receipt mode; delivery then retires rows
    /// on their PUBACK).
    pub receipts_unavailable: Option<String>,
    /// Receipts dropped since start because [`super::RECEIPTS_QUEUED_MAX`]
    /// were waiting.
    pub receipts_dropped: u64,
}
