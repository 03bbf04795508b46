//! The bookkeeping of each row's packet, done on the poller thread as the
//! event loop reports it ([`RowAcks`]): a PUBLISH leaving (its packet id
//! matched to the oldest row submitted), its PUBACK (the row retired
//! through the delivery thread, the window refilled), and a PUBACK that
//! refuses it (MQTT 5). Two events per row in a single-event drain: done
//! here, neither wakes the MQTT thread, which sees the rest (CONNACK,
//! SUBACK, incoming PUBLISH, failures).
//!
//! Its one rule: **only while the connection is the one of its epoch.** A
//! [`RowAcks`] is made for one connection before its poller starts; once
//! the MQTT thread has ended that connection (`MqttThread::lose`: the epoch
//! moves on, the ack map is dropped and its rows replayed), a late event of
//! the old poller changes nothing and ends that poller ([`Take::Gone`]).
//! Until then what arrives is real: a PUBACK that comes after the MQTT
//! thread decided to end the connection (a stop, new settings) still
//! retires its row. A PUBACK the map cannot match ends the connection
//! ([`Ev::End`] to the MQTT thread), never a guess, and nothing after it is
//! applied. A publish with packet id 0 is QoS 0 (the retained `offline`
//! status at a stop), never a row's: it goes to the MQTT thread, whose wake
//! it is.

use super::handoff::DeliveryMsg;
use super::shared::{lock, Shared, SENT_AT_MAX};
use super::status::STATUS_ROW;
use super::wire::{Ev, PubAckRefusal};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One connection's row bookkeeping, for its poller thread.
pub(super) struct RowAcks {
    shared: Arc<Mutex<Shared>>,
    to_delivery: Sender<DeliveryMsg>,
    /// The epoch of the connection this is for.
    epoch: u64,
    /// An inconsistency ended the connection: apply nothing more.
    ended: bool,
    /// The MQTT thread was woken for a request to end the connection.
    woke: bool,
    /// ... and is to be woken now (seen under the lock in `apply`).
    wake_due: bool,
}

impl RowAcks {
    /// For the connection about to start (the shared epoch as it is now:
    /// it moves on only when that connection is lost).
    pub(super) fn new(shared: Arc<Mutex<Shared>>, to_delivery: Sender<DeliveryMsg>) -> RowAcks {
        let epoch = lock(&shared).epoch;
        RowAcks {
            shared,
            to_delivery,
            epoch,
            ended: false,
            woke: false,
            wake_due: false,
        }
    }

    /// Take `ev` if it is a row's (an outgoing QoS 1 PUBLISH, a PUBACK).
    /// A handled event that must end the connection comes back as
    /// [`Ev::End`] to forward.
    pub(super) fn take(&mut self, ev: Ev) -> Take {
        let done = match ev {
            Ev::OutgoingPublish(pkid) if pkid != 0 => {
                self.apply(|s, _| on_outgoing_publish(s, pkid))
            }
            Ev::PubAck {
                pkid,
                refused: None,
            } => self.apply(|s, notify| on_puback(s, pkid, notify)),
            Ev::PubAck {
                pkid,
                refused: Some(r),
            } => self.apply(|s, notify| on_refused_puback(s, pkid, r, notify)),
            other => return Take::Forward(other),
        };
        match done {
            Ok(true) if self.woke_now() => {
                Take::Forward(Ev::Other("a request to reconnect".into()))
            }
            Ok(true) => Take::Handled,
            Ok(false) => Take::Gone,
            Err(why) => {
                self.ended = true;
                Take::Forward(Ev::End(why))
            }
        }
    }

    /// Once per connection: a redelivery or new settings wait for the MQTT
    /// thread, which row events no longer wake. They wake it with the
    /// DISCONNECT they queue, but a full request channel can refuse that
    /// DISCONNECT; the next row event wakes it then.
    fn woke_now(&mut self) -> bool {
        std::mem::take(&mut self.wake_due)
    }

    /// `f` under the lock if the connection is still this one (`Ok(false)`
    /// once it is not); then the delivery thread is told if `f` asked for
    /// it (outside the lock). Acknowledgements of incoming PUBLISHes that
    /// found the request channel full are handed to it again after each
    /// row event (the channel drains as the event loop runs).
    fn apply(
        &mut self,
        f: impl FnOnce(&mut Shared, &mut bool) -> Result<(), String>,
    ) -> Result<bool, String> {
        let mut notify = false;
        {
            let mut s = lock(&self.shared);
            if s.epoch != self.epoch {
                return Ok(false);
            }
            if self.ended {
                return Ok(true);
            }
            f(&mut s, &mut notify)?;
            if !s.acks_due.is_empty() {
                s.pump();
            }
            if !self.woke && (s.redeliver || s.reconfigure.is_some()) {
                self.woke = true;
                self.wake_due = true;
            }
        }
        if notify {
            let _ = self.to_delivery.send(DeliveryMsg::Progress);
        }
        Ok(true)
    }
}

/// What became of one event ([`RowAcks::take`]).
#[derive(Debug)]
pub(super) enum Take {
    /// A row's, handled.
    Handled,
    /// Not a row's (or an [`Ev::End`]): for the MQTT thread.
    Forward(Ev),
    /// The connection was lost: this poller has nothing left to do.
    Gone,
}

/// The watchdog's clock after the map changed: none while nothing is in
/// flight (the next submit starts it), else from now.
fn progressed(s: &mut Shared) {
    s.progress_at = if s.ack.is_empty() {
        None
    } else {
        Some(Instant::now())
    };
}

/// A PUBLISH left with `pkid`: the ack map matches it to the oldest row
/// submitted (or knows it as a re-send), and the time it left is noted for
/// the PUBACK latency. Errors: an inconsistency that ends the connection.
fn on_outgoing_publish(s: &mut Shared, pkid: u16) -> Result<(), String> {
    if let Err(e) = s.ack.on_outgoing_publish(pkid) {
        return Err(format!("ack correlation: {e}"));
    }
    s.sent_at.retain(|(p, _)| *p != pkid);
    if s.sent_at.len() >= SENT_AT_MAX {
        s.sent_at.pop_front();
    }
    s.sent_at.push_back((pkid, Instant::now()));
    Ok(())
}

/// PUBACK: the row it acknowledges is retired (through the delivery
/// thread); the window refills from here. The first PUBACK of a connection
/// marks it as having carried data (`conn.had_puback`: the MQTT thread
/// resets its backoff then). Errors: an inconsistency that ends the
/// connection (the map is dropped, rows replayed).
fn on_puback(s: &mut Shared, pkid: u16, notify: &mut bool) -> Result<(), String> {
    let sent = s
        .sent_at
        .iter()
        .position(|(p, _)| *p == pkid)
        .and_then(|i| s.sent_at.remove(i))
        .map(|(_, t)| t.elapsed());
    match s.ack.on_puback(pkid) {
        // The status or a note (a stand-in row): nothing to retire.
        Ok(r) if r < 0 => {
            progressed(s);
            s.pump();
        }
        Ok(row) => {
            s.conn.had_puback = true;
            match s.batches.remove(&row) {
                Some(rows) => s.acked.extend(rows),
                None => s.acked.push(row),
            }
            if let Some(d) = sent {
                s.puback_latency.observe(d);
            }
            progressed(s);
            // Refill the window from here: no thread hop per PUBACK.
            s.pump();
            let wanted = s.acked.len() >= 64 || s.ready.len() < s.window;
            *notify = wanted && !s.notified;
            s.notified |= wanted;
        }
        Err(e) => return Err(format!("ack correlation: {e}")),
    }
    Ok(())
}

/// A PUBACK with a reason code of 0x80 or more (MQTT 5.0 §3.4.2.1): the
/// row is not delivered. A refusal about the moment (quota exceeded,
/// packet id in use) ends the connection, so the row is sent again after
/// the backoff; any other goes to the delivery thread to be marked FAILED
/// with its reason, and the rows behind it flow. Errors: why the
/// connection must end.
fn on_refused_puback(
    s: &mut Shared,
    pkid: u16,
    r: PubAckRefusal,
    notify: &mut bool,
) -> Result<(), String> {
    s.sent_at.retain(|(p, _)| *p != pkid);
    if r.transient() {
        // The row stays in the map: the connection ends for it, and the
        // map's reset hands it back with the rest in flight (`Lost.rows`).
        return Err(format!("{r}; sending it again after the backoff"));
    }
    let row = match s.ack.on_puback(pkid) {
        Ok(row) => row,
        Err(e) => return Err(format!("ack correlation: {e}")),
    };
    progressed(s);
    s.pump();
    if row == STATUS_ROW {
        log::warn!("mqtt: the retained online status was refused: {r}");
        return Ok(());
    }
    if row < 0 {
        log::warn!("mqtt: the board's holdings or a backfill answer was refused: {r}");
        return Ok(());
    }
    for row in s.members(row) {
        s.refused.push((row, r));
    }
    *notify = !s.notified;
    s.notified = true;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mqtt::new;
    use std::sync::atomic::AtomicBool;

    type ToDelivery = std::sync::mpsc::Receiver<DeliveryMsg>;

    /// A connected link with `rows` in the ack FIFO, submitted in order
    /// (no client: nothing is pumped), its row bookkeeping, and what the
    /// delivery thread would receive.
    fn connected(rows: &[i64]) -> (Arc<Mutex<Shared>>, RowAcks, ToDelivery) {
        let (tx, rx) = std::sync::mpsc::channel();
        let cfg = crate::mqtt::settings::test_config();
        let (link, _thread) = new(cfg, tx.clone(), Arc::new(AtomicBool::new(false)), None);
        let shared = link.shared.clone();
        {
            let mut s = lock(&shared);
            s.connected = true;
            for &r in rows {
                s.ack.submitted(r).expect("room in the map");
            }
        }
        let acks = RowAcks::new(shared.clone(), tx);
        (shared, acks, rx)
    }

    fn puback(pkid: u16) -> Ev {
        Ev::PubAck {
            pkid,
            refused: None,
        }
    }

    #[test]
    fn a_qos_0_publish_is_the_mqtt_threads_and_takes_no_row() {
        // The retained `offline` status at a stop goes out at QoS 0 as
        // packet id 0 while rows wait in the FIFO: matched, it would give
        // row 5 packet id 0 and row 6 the packet id of row 5.
        let (shared, mut acks, _to_delivery) = connected(&[5, 6]);
        assert!(matches!(
            acks.take(Ev::OutgoingPublish(0)),
            Take::Forward(Ev::OutgoingPublish(0))
        ));
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Handled));
        assert!(matches!(acks.take(Ev::OutgoingPublish(2)), Take::Handled));
        assert!(matches!(acks.take(puback(1)), Take::Handled));
        assert_eq!(lock(&shared).acked, vec![5]);
        assert!(matches!(acks.take(puback(2)), Take::Handled));
        let s = lock(&shared);
        assert_eq!(s.acked, vec![5, 6]);
        assert!(s.ack.is_empty() && s.progress_at.is_none());
        assert!(s.conn.had_puback);
    }

    #[test]
    fn after_the_connection_is_lost_nothing_is_applied_and_the_poller_ends() {
        let (shared, mut acks, _to_delivery) = connected(&[5]);
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Handled));
        {
            // What `MqttThread::lose` does: a new epoch, the map dropped.
            let mut s = lock(&shared);
            s.epoch += 1;
            s.ack.reset();
            s.ack.submitted(9).expect("room");
        }
        assert!(matches!(acks.take(puback(1)), Take::Gone));
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Gone));
        let s = lock(&shared);
        assert!(s.acked.is_empty());
        assert_eq!(s.ack.len(), 1, "the new connection's row is untouched");
    }

    #[test]
    fn a_puback_the_map_cannot_match_ends_the_connection_and_nothing_after_it_counts() {
        let (shared, mut acks, _to_delivery) = connected(&[5, 6]);
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Handled));
        assert!(matches!(acks.take(Ev::OutgoingPublish(2)), Take::Handled));
        match acks.take(puback(7)) {
            Take::Forward(Ev::End(why)) => assert!(why.contains("ack correlation"), "{why}"),
            other => panic!("an unknown packet id was taken as {other:?}"),
        }
        assert!(matches!(acks.take(puback(1)), Take::Handled));
        assert!(
            lock(&shared).acked.is_empty(),
            "a PUBACK applied after the end"
        );
    }

    #[test]
    fn a_refused_puback_hands_its_row_over_as_refused_and_restarts_the_clock() {
        let (shared, mut acks, _to_delivery) = connected(&[5, 6]);
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Handled));
        assert!(matches!(acks.take(Ev::OutgoingPublish(2)), Take::Handled));
        let refusal = PubAckRefusal {
            code: 0x87,
            name: "not_authorized",
        };
        let ev = Ev::PubAck {
            pkid: 1,
            refused: Some(refusal),
        };
        assert!(matches!(acks.take(ev), Take::Handled));
        let s = lock(&shared);
        assert_eq!(s.refused, vec![(5, refusal)]);
        assert!(s.acked.is_empty());
        assert!(s.progress_at.is_some(), "row 6 is still in flight");
    }

    #[test]
    fn a_refusal_about_the_moment_ends_the_connection_with_its_row_still_in_flight() {
        let (shared, mut acks, _to_delivery) = connected(&[5, 6]);
        assert!(matches!(acks.take(Ev::OutgoingPublish(1)), Take::Handled));
        assert!(matches!(acks.take(Ev::OutgoingPublish(2)), Take::Handled));
        let ev = Ev::PubAck {
            pkid: 1,
            refused: Some(PubAckRefusal {
                code: 0x97,
                name: "quota_exceeded",
            }),
        };
        match acks.take(ev) {
            Take::Forward(Ev::End(why)) => assert!(why.contains("0x97"), "{why}"),
            other => panic!("a quota refusal was taken as {other:?}"),
        }
        let mut s = lock(&shared);
        assert!(s.refused.is_empty() && s.acked.is_empty());
        // What `MqttThread::lose` hands back for replay: both rows.
        let mut back = s.ack.reset();
        back.sort_unstable();
        assert_eq!(back, vec![5, 6]);
    }
}
