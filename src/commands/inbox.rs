//! The bounded hand-off of command PUBLISHes from the MQTT thread to the
//! command thread: the [`Inbox`] (the MQTT thread's side) and its
//! [`InboxMeter`] (the command thread's side).
//!
//! Its one rule: **the inbox never holds more than its limit in bytes of
//! payloads not yet taken** (one PUBLISH always passes when nothing is
//! held) **beyond its tier's share**: the limit is what other commands may
//! fill, unsigned `apply-config` a sixth more, commands signed by an
//! operator key a third more ([`Tier::headroom`]), the tier judged from the
//! message's `name` and, when it carries one, its signature ([`peek`]: a
//! signature is checked here, so a forged one gets no operator bytes). So
//! a quarter of the bytes is always the operator's, and the limit being at
//! least four of the largest commands, that quarter holds one. A PUBLISH that does not fit is not forwarded and
//! not acknowledged, so the broker keeps it; the meter counts it, and the
//! command thread has the broker redeliver it once there is room.

use super::admission::{peek, Tier};
use super::message::CmdMsg;
use super::signed::OperatorKeys;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

/// Bytes of command payloads the [`Inbox`] holds at most: 4 MiB, or four
/// of the largest commands if that is more.
pub fn inbox_limit(max_payload_bytes: usize) -> usize {
    (4 * 1024 * 1024).max(4 * max_payload_bytes)
}

/// The command thread's side of the [`Inbox`]: bytes held, and PUBLISHes
/// the MQTT thread could not forward. Its limit is other commands' share;
/// operator commands may take a third more ([`Tier::headroom`]).
#[derive(Debug)]
pub struct InboxMeter {
    bytes: AtomicUsize,
    limit: usize,
    /// `(connection epoch of the latest, how many)` not forwarded.
    dropped: Mutex<Option<(u64, u64)>>,
}

impl InboxMeter {
    fn cost(p: &rumqttc::Publish) -> usize {
        p.payload.len().max(1)
    }

    /// `p` was taken (answered or claimed) or dropped: its bytes are free.
    pub(super) fn release(&self, p: &rumqttc::Publish) {
        let n = Self::cost(p);
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_sub(n))
            });
    }

    /// Bytes held now: forwarded, not yet released.
    pub(super) fn held(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Bytes held at most.
    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// `(connection epoch of the latest, how many)` PUBLISHes not forwarded
    /// since the last call, if any.
    pub(super) fn take_dropped(&self) -> Option<(u64, u64)> {
        self.dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// The MQTT thread's hand-off of command PUBLISHes to the command thread,
/// bounded by bytes: a PUBLISH that would take the bytes held over the limit
/// is not forwarded and not acknowledged (the broker keeps it), and the
/// command thread has the broker redeliver it once there is room.
#[derive(Debug, Clone)]
pub struct Inbox {
    tx: Sender<CmdMsg>,
    meter: Arc<InboxMeter>,
    /// `commands.operator_public_keys`, and the board they sign for.
    keys: Arc<OperatorKeys>,
    /// `commands.max_payload_bytes`: a larger message is not parsed here.
    max_payload_bytes: usize,
}

impl Inbox {
    /// An inbox sending to the command thread's channel `tx`, holding at
    /// most `limit` bytes of other commands, and a third more for commands
    /// signed by one of `keys` ([`Tier::headroom`]); a message over
    /// `max_payload_bytes` is never judged the operator's.
    pub fn new(
        tx: Sender<CmdMsg>,
        limit: usize,
        keys: OperatorKeys,
        max_payload_bytes: usize,
    ) -> Inbox {
        Inbox {
            tx,
            meter: Arc::new(InboxMeter {
                bytes: AtomicUsize::new(0),
                limit,
                dropped: Mutex::new(None),
            }),
            keys: Arc::new(keys),
            max_payload_bytes,
        }
    }

    /// The command thread's side.
    pub fn meter(&self) -> Arc<InboxMeter> {
        self.meter.clone()
    }

    /// Forward a PUBLISH received on connection `epoch`, if it fits in its
    /// tier's share (one always does when nothing is held). Called by the
    /// MQTT thread; never blocks.
    pub fn offer(&self, epoch: u64, publish: rumqttc::Publish) {
        let n = InboxMeter::cost(&publish);
        let tier: Tier = peek(&publish.payload, self.max_payload_bytes, &self.keys);
        let m = &self.meter;
        let cap = tier.headroom(m.limit);
        let fits = m
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                (b == 0 || b + n <= cap).then_some(b + n)
            })
            .is_ok();
        if !fits {
            let mut d = m.dropped.lock().unwrap_or_else(|p| p.into_inner());
            let count = d.map_or(0, |(_, c)| c);
            *d = Some((epoch, count + 1));
            return;
        }
        if let Err(e) = self.tx.send(CmdMsg::Incoming {
            epoch,
            publish,
            tier,
        }) {
            // The command thread is gone (stopping).
            if let CmdMsg::Incoming { publish, .. } = e.0 {
                m.release(&publish);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::signature::SigningKey;

    fn publish(len: usize) -> rumqttc::Publish {
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, vec![b'x'; len])
    }

    #[test]
    fn the_inbox_forwards_up_to_its_bytes_and_notes_what_it_left_at_the_broker() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100, OperatorKeys::new("gw1", &[]), 65536);
        let meter = inbox.meter();
        inbox.offer(1, publish(60));
        inbox.offer(1, publish(30));
        inbox.offer(1, publish(20)); // 110 > 100: left at the broker
        inbox.offer(2, publish(20));
        assert_eq!(rx.try_iter().count(), 2);
        assert_eq!(meter.held(), 90);
        assert_eq!(meter.take_dropped(), Some((2, 2)), "latest epoch, count");
        assert_eq!(meter.take_dropped(), None);
        meter.release(&publish(60));
        inbox.offer(3, publish(20));
        assert_eq!(rx.try_iter().count(), 1);
        assert_eq!(meter.held(), 50);
    }

    fn command(name: &str, key: Option<&SigningKey>) -> rumqttc::Publish {
        let msg = serde_json::json!({"command_id": "c", "scope": "ops", "name": name,
                                     "args": {"pad": "x".repeat(400)}});
        let msg = match key {
            Some(k) => crate::commands::signed::sign(k, "gw1", &msg).expect("signed"),
            None => msg,
        };
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, msg.to_string())
    }

    #[test]
    fn other_commands_fill_the_limit_and_the_operators_signed_ones_a_third_more() {
        let (k, stranger) = (
            SigningKey::generate().expect("keygen").0,
            SigningKey::generate().expect("keygen").0,
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let keys = OperatorKeys::new("gw1", &[k.public()]);
        let junk = command("ping", None);
        let n = junk.payload.len();
        let inbox = Inbox::new(tx, 18 * n, keys, 65536);
        let meter = inbox.meter();
        for _ in 0..20 {
            inbox.offer(1, junk.clone());
        }
        let taken = rx.try_iter().count();
        assert_eq!(taken, 18, "other commands: up to the limit");
        assert_eq!(meter.take_dropped(), Some((1, 2)));
        // Neither the old operator scope nor a stranger's signature gets
        // the operator's bytes.
        inbox.offer(1, command("ping", Some(&stranger)));
        assert_eq!(rx.try_iter().count(), 0);
        assert_eq!(meter.take_dropped(), Some((1, 1)));
        // A push fits in the next sixth, the operator's signed commands in
        // the third, and arrive marked as such.
        inbox.offer(1, command("apply-config", None));
        inbox.offer(1, command("ping", Some(&k)));
        inbox.offer(1, command("ping", Some(&k)));
        let tiers: Vec<Tier> = rx
            .try_iter()
            .filter_map(|m| match m {
                CmdMsg::Incoming { tier, .. } => Some(tier),
                _ => None,
            })
            .collect();
        assert_eq!(tiers, [Tier::Push, Tier::Operator, Tier::Operator]);
        assert!(meter.held() <= 24 * n);
        assert_eq!(meter.take_dropped(), None);
        // Full to the operator's share too: the next one stays at the broker.
        for _ in 0..5 {
            inbox.offer(1, command("ping", Some(&k)));
        }
        assert!(rx.try_iter().count() < 5);
        assert!(meter.held() <= 24 * n);
    }

    #[test]
    fn one_command_larger_than_the_inbox_still_passes_when_nothing_is_held() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100, OperatorKeys::new("gw1", &[]), 65536);
        inbox.offer(1, publish(500));
        assert_eq!(rx.try_iter().count(), 1);
        inbox.offer(1, publish(1));
        assert_eq!(rx.try_iter().count(), 0);
        assert_eq!(inbox.meter().take_dropped(), Some((1, 1)));
    }

    #[test]
    fn the_inbox_holds_four_mib_or_four_of_the_largest_commands() {
        assert_eq!(inbox_limit(65_536), 4 * 1024 * 1024);
        assert_eq!(inbox_limit(1024 * 1024), 4 * 1024 * 1024);
        assert_eq!(inbox_limit(2 * 1024 * 1024), 8 * 1024 * 1024);
    }
}
