//! The writer's side of [`crate::intake::share`]: the spool's capacity and
//! its row marks told to the peers' shares at each upkeep pass, the local
//! input found unacknowledged at start carried over, and each mqtt
//! bridge's readings charged to its share as they are buffered.
//!
//! Its one rule: **local input never takes the board's own room**: a
//! bridge's reading past its share or the input's is refused before it is
//! buffered (its message stays with its broker), as a socket client's is
//! before it is handed over ([`crate::ingest::conn`]).

use super::figures::ROW_SCAN_LIMIT;
use super::Writer;
use crate::intake::share::{PeerId, Shares};
use crate::source::SourceKind;
use crate::spool::{NewEvent, Spool, SpoolError};
use std::sync::Arc;
use std::time::Instant;

/// `(newest row id, acknowledged mark)`: every row at or below the mark is
/// acknowledged or FAILED. Two index reads (retention keeps the newest row,
/// so the mark is never above it).
fn marks(spool: &Spool) -> Result<(i64, i64), SpoolError> {
    let newest = spool.newest_id()?;
    let backlog = i64::try_from(spool.backlog_estimate()?).unwrap_or(i64::MAX);
    Ok((newest, newest.saturating_sub(backlog)))
}

impl Writer {
    /// Whether `stream` is the board's own: a `[[sources]]` entry other
    /// than a bridge, or the agent's (`_agent`, `_commands`). Every other
    /// stream is local input (the socket's, the bridges').
    fn own_stream(&self, stream: &str) -> bool {
        stream.starts_with('_')
            || self
                .conf
                .cfg
                .sources
                .iter()
                .any(|s| s.name == stream && !matches!(s.kind, SourceKind::Mqtt(_)))
    }

    /// The bridge a reading of `stream` comes from, if any.
    fn bridge_of(&self, stream: &str) -> Option<PeerId> {
        self.conf
            .cfg
            .sources
            .iter()
            .find(|s| s.name == stream && matches!(s.kind, SourceKind::Mqtt(_)))
            .map(|s| PeerId::Bridge(s.name.clone()))
    }

    /// Take the peers' shares (at start, from the socket ingest): the
    /// device id's length, the capacity, and the local input the spool
    /// holds unacknowledged from before, carried until delivered. The spool
    /// keeps no peer per row, so it counts for the input's share under no
    /// peer. Its bytes are read from the rows above the acknowledged mark
    /// when they are few (at most [`ROW_SCAN_LIMIT`] of them, estimated);
    /// past that the whole backlog's estimated bytes count as local input,
    /// the safe side, rather than reading it all at start.
    pub(in crate::agent) fn take_shares(&mut self, shares: Option<Arc<Shares>>) {
        let Some(sh) = shares else { return };
        sh.set_device_id_bytes(self.conf.cfg.device_id.len());
        let spool = self.store.spool();
        if let Some(room) = self.upkeep.room(spool) {
            sh.set_capacity(room);
        }
        if let Ok((newest, acked)) = marks(spool) {
            if newest > acked {
                let carried = self.input_backlog_bytes(acked, newest);
                // Said only when there is some: a backlog of the board's
                // own readings is no local input.
                if carried > 0 {
                    log::info!(
                    "ingest: {carried} bytes of local input not yet delivered from before this start count against ingest.max_spool_share_input_percent until delivered (no peer: the spool keeps none per row)"
                );
                }
                sh.carry(carried, newest);
            }
        }
        self.peers.shares = Some(sh);
    }

    /// Bytes of local input in the rows above `acked` up to `newest`.
    fn input_backlog_bytes(&self, acked: i64, newest: i64) -> u64 {
        let spool = self.store.spool();
        let live = spool.usage().map_or(u64::MAX, |(live, _)| live);
        let rows = spool.rows_estimate().unwrap_or(0).max(1);
        let backlog = u64::try_from(newest - acked).unwrap_or(0);
        let estimate = u64::try_from(u128::from(live) * u128::from(backlog) / u128::from(rows))
            .unwrap_or(u64::MAX)
            .min(live);
        if estimate > ROW_SCAN_LIMIT {
            return estimate;
        }
        match spool.appended_since(acked) {
            Ok(by_stream) => by_stream
                .iter()
                .filter(|a| !self.own_stream(&a.stream))
                .map(|a| a.bytes)
                .sum(),
            Err(_) => estimate,
        }
    }

    /// At each upkeep pass: the capacity now, every stored reading bound
    /// to the newest row id, what the acknowledged mark passed given back.
    pub(super) fn refresh_shares(&mut self) {
        let Some(sh) = &self.peers.shares else { return };
        let spool = self.store.spool();
        if let Some(room) = self.upkeep.room(spool) {
            sh.set_capacity(room);
        }
        if let Ok((newest, acked)) = marks(spool) {
            sh.bound(newest);
            sh.retire(acked, Instant::now());
        }
    }

    /// Charge a bridge's reading to its share before it is buffered; past
    /// its share or the input's it is refused (its message stays with its
    /// broker), counted `readings_refused_<reason>`. True when it may be
    /// buffered (any other reading).
    pub(super) fn bridge_admits(&mut self, ev: &NewEvent) -> bool {
        let Some(sh) = self.peers.shares.clone() else {
            return true;
        };
        let Some(bridge) = self.bridge_of(&ev.stream) else {
            return true;
        };
        let now = Instant::now();
        let Err(over) = sh.charge(&bridge, sh.cost(&ev.stream, &ev.fields), now) else {
            return true;
        };
        ev.refuse(&over.to_string());
        self.metrics.dropped += 1;
        self.riding.count(over.counter(), 1);
        if let Some(n) = sh.log_due(&over, now) {
            log::warn!("ingest: {n} bridge readings refused for {} since the last such line; the last: {over} (repeats logged every 30 s)", over.reason());
        }
        false
    }

    /// For `status` (`ingest_shares`): what local input holds of its share.
    pub(super) fn shares_state(&self) -> Option<String> {
        self.peers.shares.as_ref().and_then(|s| s.describe())
    }
}
