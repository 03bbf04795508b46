//! What one broker connection says about a row is judged per connection:
//! a refusing PUBACK (MQTT 5 reason code 0x80 or more) or a Maximum Packet
//! Size from CONNACK smaller than the row defers the row for the rest of
//! that connection; the next connection judges it again.
//!
//! Its one rule: **a row becomes FAILED only when the board's own config
//! says so (its `mqtt.max_payload_bytes`, `mqtt.max_packet_bytes`), or when
//! the broker refused it on `mqtt.fail_after_disconnects` connections of
//! this run**; one hostile or misconfigured connection never fails a
//! backlog for good (issue 21: a v5 CONNACK with Maximum Packet Size 128,
//! or a PUBACK 0x87 to everything, once failed every pending row).

use super::Delivery;
use crate::spool::Spool;
use std::collections::HashMap;

/// Rows with a deferral on record, at most; past it a refusal still defers
/// the row for its connection, only its count is not kept.
const MAX_DEFERRED: usize = 10_000;

/// A row the broker would not take on some connections of this run.
#[derive(Debug, Clone)]
pub(super) struct Deferral {
    /// Connections (epochs) that refused it.
    connections: u32,
    /// The last of them: the row waits while it is the current one.
    epoch: u64,
    /// Why, as the last connection said.
    pub(super) reason: String,
}

/// Rows deferred in this run, by row id.
pub(super) type Deferred = HashMap<i64, Deferral>;

impl Delivery {
    /// Whether `row` waits for another connection (refused on this one).
    pub(super) fn deferred_now(&self, row: i64) -> bool {
        self.deferred
            .get(&row)
            .is_some_and(|d| d.epoch == self.epoch)
    }

    /// The broker refused `row` on this connection for `why` (counted
    /// under `events_failed_<counter>` when it goes FAILED): it waits for
    /// the next connection, or goes FAILED once refused on
    /// `fail_after_disconnects` connections. `event_id` names the event
    /// in the log (its id, or `in row N` where only the row is known).
    pub(super) fn defer(
        &mut self,
        spool: &mut Spool,
        (row, event_id): (i64, &dyn std::fmt::Display),
        why: &str,
        counter: &str,
    ) {
        let epoch = self.epoch;
        let room = self.deferred.len() < MAX_DEFERRED;
        let n = match self.deferred.get_mut(&row) {
            Some(d) if d.epoch == epoch => return,
            Some(d) => {
                d.connections += 1;
                d.epoch = epoch;
                d.reason = why.to_owned();
                d.connections
            }
            None if room => {
                self.deferred.insert(
                    row,
                    Deferral {
                        connections: 1,
                        epoch,
                        reason: why.to_owned(),
                    },
                );
                1
            }
            None => 1,
        };
        let limit = self.cfg.fail_after_disconnects.max(1);
        if n >= limit {
            self.deferred.remove(&row);
            let why = format!("{why} (on {n} connections)");
            self.fail(spool, row, event_id, &why, counter);
            return;
        }
        log::warn!(
            "delivery: event {event_id} refused on this connection ({why}); it waits for the next connection ({n} of {limit} before it goes FAILED)"
        );
        self.stats.deferred.store(
            self.deferred_count() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Rows waiting for another connection now.
    pub(super) fn deferred_count(&self) -> usize {
        self.deferred
            .values()
            .filter(|d| d.epoch == self.epoch)
            .count()
    }

    /// A new connection: nothing waits any more (each row is judged again).
    pub(super) fn deferrals_expire(&mut self) {
        self.stats
            .deferred
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// `row` was delivered or resolved: its deferral record goes.
    pub(super) fn forget_deferral(&mut self, row: i64) {
        self.deferred.remove(&row);
    }
}
