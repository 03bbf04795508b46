//! The connection's story across reconnects: what the MQTT thread keeps
//! about its connections ([`ConnState`]: when the state last changed, why
//! the last one ended, quick drops, the command subscription's record
//! ([`super::subjudge`])) and the copy health reads ([`LinkFacts`]).
//!
//! Its one rule: only the MQTT thread writes the story; health gets a copy
//! taken under the shared lock, never a reference into it, so a health
//! check cannot hold the lock the connection needs.

use super::subjudge::SubJudge;
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
    /// Connections in a row that ended within a keep-alive of CONNACK
    /// without a PUBACK.
    pub(super) quick_drops: u32,
    /// Whether the command SUBSCRIBE goes out, and when again.
    pub(super) sub: SubJudge,
    /// Why commands cannot arrive, if the broker refused the subscription
    /// (SUBACK); [`ConnState::commands_unavailable`] adds the judge's word.
    pub(super) sub_refused: Option<String>,
    /// Why receipts cannot arrive, if they cannot (receipt mode only).
    pub(super) receipts_unavailable: Option<String>,
    /// Puback mode: an UNSUBSCRIBE from a receipts subscription the session
    /// kept was sent on this connection.
    pub(super) left_receipts: bool,
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
            quick_drops: 0,
            sub: SubJudge::new(),
            sub_refused: None,
            receipts_unavailable: None,
            left_receipts: false,
            subacks_due: std::collections::VecDeque::new(),
            peer_closed: false,
        }
    }

    /// Why commands cannot arrive now, if they cannot: the broker refused
    /// the subscription, or closes connections on it.
    pub(super) fn commands_unavailable(&self) -> Option<String> {
        self.sub_refused
            .clone()
            .or_else(|| self.sub.why_off(Instant::now()))
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
