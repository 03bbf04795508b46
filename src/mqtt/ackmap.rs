//! Packet id ↔ spool row bookkeeping: which row a PUBACK retires.
//!
//! Pure, no I/O. Its one rule: **never guess**. A PUBACK retires a row only if
//! that row's publish was observed leaving with that packet id; on anything
//! unexpected the caller gets an [`Inconsistency`], must drop the map with
//! [`AckMap::reset`], rebuild the MQTT client and replay the rows from the spool.
//!
//! # How the mapping works with stock rumqttc (0.25.1, checked against its source)
//! - `Client::try_publish` returns no packet id. We record the row in a FIFO of
//!   submitted rows ([`AckMap::submitted`]) *before* the request enters
//!   rumqttc's channel, and only from the one thread that owns the client.
//! - rumqttc reports `Event::Outgoing(Outgoing::Publish(pkid))` when a publish
//!   request leaves its channel and gets its packet id, in channel order. A
//!   packet-id collision is reported as `Outgoing::AwaitAck` first and as
//!   `Outgoing::Publish` only when the held publish really goes out, and the
//!   event loop takes no new request meanwhile, so the order still holds. So
//!   the front of the FIFO is the row carrying that packet id
//!   ([`AckMap::on_outgoing_publish`]).
//! - `Incoming::PubAck(pkid)` retires the row mapped to `pkid`
//!   ([`AckMap::on_puback`]); the mapping is removed at once, so a reused
//!   packet id maps afresh.
//! - The client is rebuilt after every disconnect (rumqttc's own re-send
//!   after a resumed session, and its silent drop of pending publishes after a
//!   CONNACK without session present, are never relied on). A re-send of a
//!   mapped packet id therefore cannot happen here and is treated as an
//!   inconsistency.
//!
//! Subscribes share rumqttc's packet-id counter but are reported as
//! `Outgoing::Subscribe`, which this map never sees.

use heapless::{Deque, Vec as HVec};

/// Largest in-flight window the map can hold (publishes submitted and not yet
/// acknowledged). The config validates `mqtt.inflight_window` against it.
pub const MAX_WINDOW: usize = 128;

/// Something that cannot be explained by the model above. The caller drops the
/// map ([`AckMap::reset`]), rebuilds the client and replays every affected row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    /// A publish left with `pkid` but no submitted row was waiting for an id.
    #[error("outgoing publish with packet id {pkid} but no submitted row was waiting")]
    UnexpectedPublish {
        /// The packet id rumqttc reported.
        pkid: u16,
    },
    /// A publish left with `pkid` while `pkid` still maps to an unacknowledged row.
    #[error("packet id {pkid} reused while still mapped to an unacknowledged row")]
    PacketIdInUse {
        /// The packet id rumqttc reported.
        pkid: u16,
    },
    /// A PUBACK arrived for a packet id that maps to no row.
    #[error("PUBACK for packet id {pkid}, which maps to no row")]
    UnknownAck {
        /// The packet id of the PUBACK.
        pkid: u16,
    },
    /// More rows than [`MAX_WINDOW`] were submitted.
    #[error("in-flight window overflow (more than {MAX_WINDOW} rows)")]
    WindowOverflow,
}

/// The in-flight window: rows submitted to the client and not yet acknowledged.
///
/// `R` is the caller's row handle (the spool row id). Memory is fixed:
/// at most [`MAX_WINDOW`] rows, whatever the backlog.
#[derive(Debug)]
pub struct AckMap<R: Copy> {
    /// Submitted rows still waiting for rumqttc to assign a packet id, oldest first.
    queued: Deque<R, MAX_WINDOW>,
    /// Rows whose publish left with a packet id, not yet acknowledged.
    mapped: HVec<(u16, R), MAX_WINDOW>,
}

impl<R: Copy> Default for AckMap<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R: Copy> AckMap<R> {
    /// An empty map.
    pub fn new() -> Self {
        AckMap {
            queued: Deque::new(),
            mapped: HVec::new(),
        }
    }

    /// Rows in flight: submitted and not yet acknowledged.
    pub fn len(&self) -> usize {
        self.queued.len() + self.mapped.len()
    }

    /// True when nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Record `row` as about to be submitted; call right before `try_publish`.
    ///
    /// Errors: [`Inconsistency::WindowOverflow`] past [`MAX_WINDOW`] rows.
    pub fn submitted(&mut self, row: R) -> Result<(), Inconsistency> {
        if self.len() >= MAX_WINDOW {
            return Err(Inconsistency::WindowOverflow);
        }
        self.queued
            .push_back(row)
            .map_err(|_| Inconsistency::WindowOverflow)
    }

    /// Undo the last [`AckMap::submitted`] because `try_publish` refused the
    /// request (channel full): it never entered rumqttc, so it will get no id.
    pub fn submit_failed(&mut self) -> Option<R> {
        self.queued.pop_back()
    }

    /// rumqttc reported `Outgoing::Publish(pkid)`: the oldest submitted row now
    /// travels with `pkid`.
    pub fn on_outgoing_publish(&mut self, pkid: u16) -> Result<(), Inconsistency> {
        if self.mapped.iter().any(|(p, _)| *p == pkid) {
            return Err(Inconsistency::PacketIdInUse { pkid });
        }
        let row = self
            .queued
            .pop_front()
            .ok_or(Inconsistency::UnexpectedPublish { pkid })?;
        self.mapped
            .push((pkid, row))
            .map_err(|_| Inconsistency::WindowOverflow)
    }

    /// A PUBACK (QoS 1, MQTT 3.1.1 §3.4) arrived for `pkid`: returns the row it
    /// retires and frees the packet id.
    pub fn on_puback(&mut self, pkid: u16) -> Result<R, Inconsistency> {
        let pos = self
            .mapped
            .iter()
            .position(|(p, _)| *p == pkid)
            .ok_or(Inconsistency::UnknownAck { pkid })?;
        Ok(self.mapped.swap_remove(pos).1)
    }

    /// Every row in flight, in no particular order.
    pub fn rows(&self) -> impl Iterator<Item = R> + '_ {
        self.mapped
            .iter()
            .map(|(_, r)| *r)
            .chain(self.queued.iter().copied())
    }

    /// Drop all bookkeeping and return every row that was in flight (mapped
    /// first, then queued). None of them is retired: they are replay-eligible.
    pub fn reset(&mut self) -> std::vec::Vec<R> {
        let mut rows: std::vec::Vec<R> = self.mapped.iter().map(|(_, r)| *r).collect();
        while let Some(r) = self.queued.pop_front() {
            rows.push(r);
        }
        self.mapped.clear();
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puback_retires_the_row_that_left_with_that_packet_id() {
        let mut m = AckMap::new();
        m.submitted(10).unwrap();
        m.submitted(11).unwrap();
        m.on_outgoing_publish(1).unwrap();
        m.on_outgoing_publish(2).unwrap();
        assert_eq!(m.on_puback(2), Ok(11));
        assert_eq!(m.on_puback(1), Ok(10));
        assert!(m.is_empty());
    }

    #[test]
    fn submitted_row_without_outgoing_event_is_not_retired_by_an_ack() {
        let mut m = AckMap::new();
        m.submitted(10).unwrap();
        // The row never left: a PUBACK for id 1 cannot be for it.
        assert_eq!(m.on_puback(1), Err(Inconsistency::UnknownAck { pkid: 1 }));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn outgoing_publish_without_submitted_row_is_an_inconsistency() {
        let mut m: AckMap<i64> = AckMap::new();
        assert_eq!(
            m.on_outgoing_publish(7),
            Err(Inconsistency::UnexpectedPublish { pkid: 7 })
        );
    }

    #[test]
    fn packet_id_reused_while_mapped_is_an_inconsistency() {
        let mut m = AckMap::new();
        m.submitted(1).unwrap();
        m.submitted(2).unwrap();
        m.on_outgoing_publish(5).unwrap();
        assert_eq!(
            m.on_outgoing_publish(5),
            Err(Inconsistency::PacketIdInUse { pkid: 5 })
        );
        // Nothing was popped for the refused event: row 2 still waits.
        assert_eq!(m.reset(), vec![1, 2]);
    }

    #[test]
    fn packet_id_is_free_again_once_acknowledged() {
        let mut m = AckMap::new();
        m.submitted(1).unwrap();
        m.on_outgoing_publish(3).unwrap();
        assert_eq!(m.on_puback(3), Ok(1));
        m.submitted(2).unwrap();
        m.on_outgoing_publish(3).unwrap();
        assert_eq!(m.on_puback(3), Ok(2));
        // A second ack for the same id is unknown now.
        assert_eq!(m.on_puback(3), Err(Inconsistency::UnknownAck { pkid: 3 }));
    }

    #[test]
    fn refused_submission_is_taken_back_from_the_fifo() {
        let mut m = AckMap::new();
        m.submitted(1).unwrap();
        m.submitted(2).unwrap();
        assert_eq!(m.submit_failed(), Some(2));
        m.on_outgoing_publish(1).unwrap();
        assert_eq!(
            m.on_outgoing_publish(2),
            Err(Inconsistency::UnexpectedPublish { pkid: 2 })
        );
    }

    #[test]
    fn reset_returns_every_row_in_flight_and_empties_the_map() {
        let mut m = AckMap::new();
        for r in 0..5 {
            m.submitted(r).unwrap();
        }
        m.on_outgoing_publish(1).unwrap();
        m.on_outgoing_publish(2).unwrap();
        let mut rows = m.reset();
        rows.sort();
        assert_eq!(rows, vec![0, 1, 2, 3, 4]);
        assert!(m.is_empty());
        assert_eq!(m.on_puback(1), Err(Inconsistency::UnknownAck { pkid: 1 }));
    }

    #[test]
    fn window_is_bounded() {
        let mut m = AckMap::new();
        for r in 0..MAX_WINDOW {
            m.submitted(r).unwrap();
        }
        assert_eq!(m.submitted(9999), Err(Inconsistency::WindowOverflow));
        assert_eq!(m.len(), MAX_WINDOW);
    }

    /// Exhaustive over a small model: every interleaving of submit / outgoing /
    /// ack / refusal for up to 4 rows and 3 packet ids (ids wrap as in
    /// rumqttc), checked against a reference model. A retirement is correct
    /// only if the acked packet id was the last one the row left with.
    #[test]
    fn exhaustive_small_interleavings_never_retire_a_wrong_row() {
        #[derive(Clone, Copy, Debug)]
        enum Op {
            Submit,
            Refuse,
            Out(u16),
            Ack(u16),
        }
        let ops = [
            Op::Submit,
            Op::Refuse,
            Op::Out(1),
            Op::Out(2),
            Op::Out(3),
            Op::Ack(1),
            Op::Ack(2),
            Op::Ack(3),
        ];
        let depth = 6;
        let mut seqs: std::vec::Vec<std::vec::Vec<Op>> = vec![vec![]];
        for _ in 0..depth {
            let mut next = vec![];
            for s in &seqs {
                for op in ops {
                    let mut t = s.clone();
                    t.push(op);
                    next.push(t);
                }
            }
            seqs = next;
        }
        let mut checked = 0usize;
        for seq in seqs {
            let mut m = AckMap::new();
            // Reference: the wire truth, which row each packet id carries.
            let mut wire: std::collections::HashMap<u16, u32> = Default::default();
            let mut waiting: std::collections::VecDeque<u32> = Default::default();
            let mut next_row = 0u32;
            for op in seq {
                match op {
                    Op::Submit => {
                        if m.submitted(next_row).is_ok() {
                            waiting.push_back(next_row);
                        }
                        next_row += 1;
                    }
                    Op::Refuse => {
                        let got = m.submit_failed();
                        assert_eq!(got, waiting.pop_back());
                    }
                    Op::Out(p) => {
                        let res = m.on_outgoing_publish(p);
                        #[allow(clippy::map_entry)] // the branches do more than insert
                        if wire.contains_key(&p) {
                            assert_eq!(res, Err(Inconsistency::PacketIdInUse { pkid: p }));
                            m.reset();
                            wire.clear();
                            waiting.clear();
                        } else if let Some(r) = waiting.pop_front() {
                            assert!(res.is_ok());
                            wire.insert(p, r);
                        } else {
                            assert!(res.is_err());
                        }
                    }
                    Op::Ack(p) => match (m.on_puback(p), wire.remove(&p)) {
                        (Ok(r), Some(w)) => assert_eq!(r, w, "wrong row retired"),
                        (Err(_), None) => {}
                        (got, want) => panic!("ack {p}: got {got:?}, want {want:?}"),
                    },
                }
                checked += 1;
            }
        }
        assert!(checked > 1_000_000);
    }
}
