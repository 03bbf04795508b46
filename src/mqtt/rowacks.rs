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
//! the old poller changes nothing. A PUBACK the map cannot match ends the
//! connection ([`Ev::End`] to the MQTT thread), never a guess, and nothing
//! after it is applied.

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
        }
    }

    /// Take `ev` if it is a row's (an outgoing PUBLISH, a PUBACK): `None`
    /// when it was handled here, else `ev` for the MQTT thread. A handled
    /// event that must end the connection comes back as [`Ev::End`].
    pub(super) fn take(&mut self, ev: Ev) -> Option<Ev> {
        let done = match ev {
            Ev::OutgoingPublish(pkid) => self.apply(|s, _| on_outgoing_publish(s, pkid)),
            Ev::PubAck {
                pkid,
                refused: None,
            } => self.apply(|s, notify| on_puback(s, pkid, notify)),
            Ev::PubAck {
                pkid,
                refused: Some(r),
            } => self.apply(|s, notify| on_refused_puback(s, pkid, r, notify)),
            other => return Some(other),
        };
        match done {
            Ok(()) => None,
            Err(why) => {
                self.ended = true;
                Some(Ev::End(why))
            }
        }
    }

    /// `f` under the lock if the connection is still this one; then the
    /// delivery thread is told if `f` asked for it (outside the lock).
    fn apply(
        &mut self,
        f: impl FnOnce(&mut Shared, &mut bool) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut notify = false;
        {
            let mut s = lock(&self.shared);
            if self.ended || s.epoch != self.epoch {
                return Ok(());
            }
            f(&mut s, &mut notify)?;
        }
        if notify {
            let _ = self.to_delivery.send(DeliveryMsg::Progress);
        }
        Ok(())
    }
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
        Ok(STATUS_ROW) => s.pump(),
        Ok(row) => {
            s.conn.had_puback = true;
            match s.batches.remove(&row) {
                Some(rows) => s.acked.extend(rows),
                None => s.acked.push(row),
            }
            if let Some(d) = sent {
                s.puback_latency.observe(d);
            }
            s.progress_at = if s.ack.is_empty() {
                None
            } else {
                Some(Instant::now())
            };
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
    let row = match s.ack.on_puback(pkid) {
        Ok(row) => row,
        Err(e) => return Err(format!("ack correlation: {e}")),
    };
    if r.transient() {
        return Err(format!("{r}; sending it again after the backoff"));
    }
    s.pump();
    if row == STATUS_ROW {
        log::warn!("mqtt: the retained online status was refused: {r}");
        return Ok(());
    }
    for row in s.members(row) {
        s.refused.push((row, r));
    }
    *notify = !s.notified;
    s.notified = true;
    Ok(())
}
