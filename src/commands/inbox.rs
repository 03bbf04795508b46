//! The bounded hand-off of command PUBLISHes from the MQTT thread to the
//! command thread: the [`Inbox`] (the MQTT thread's side) and its
//! [`InboxMeter`] (the command thread's side).
//!
//! Its one rule: **the inbox never holds more than its limit in bytes of
//! payloads not yet taken** (one PUBLISH always passes when nothing is
//! held) **beyond its tier's share**: the limit is what other commands may
//! fill, `apply-config` from other scopes a sixth more, operator scopes a
//! third more ([`Tier::headroom`]), the tier read from the message's
//! `scope` and `name` ([`peek`]). So a quarter of the bytes is always the
//! operator's, and the limit being at least four of the largest commands,
//! that quarter holds one. A PUBLISH that does not fit is not forwarded and
//! not acknowledged, so the broker keeps it; the meter counts it, and the
//! command thread has the broker redeliver it once there is room.

use super::admission::{peek, Tier};
use super::message::CmdMsg;
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
    /// `commands.operator_scopes`.
    operator_scopes: Arc<[String]>,
}

impl Inbox {
    /// An inbox sending to the command thread's channel `tx`, holding at
    /// most `limit` bytes of other commands, and a third more for commands
    /// in `operator_scopes` ([`Tier::headroom`]).
    pub fn new(tx: Sender<CmdMsg>, limit: usize, operator_scopes: &[String]) -> Inbox {
        Inbox {
            tx,
            meter: Arc::new(InboxMeter {
                bytes: AtomicUsize::new(0),
                limit,
                dropped: Mutex::new(None),
            }),
            operator_scopes: operator_scopes.into(),
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
        let tier: Tier = peek(&publish.payload, &self.operator_scopes);
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

    fn publish(len: usize) -> rumqttc::Publish {
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, vec![b'x'; len])
    }

    #[test]
    fn the_inbox_forwards_up_to_its_bytes_and_notes_what_it_left_at_the_broker() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100, &[]);
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

    fn command(scope: &str, name: &str) -> rumqttc::Publish {
        let payload = format!(
            r#"{{"command_id":"c","scope":"{scope}","name":"{name}","pad":"{}"}}"#,
            "x".repeat(40)
        );
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, payload)
    }

    #[test]
    fn other_scopes_fill_the_limit_and_the_operator_keeps_a_third_more() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 900, &["ops".to_owned()]);
        let meter = inbox.meter();
        let junk = command("j1", "ping");
        let n = junk.payload.len();
        for _ in 0..20 {
            inbox.offer(1, junk.clone());
        }
        let taken = rx.try_iter().count();
        assert_eq!(taken, 900 / n, "other scopes: up to the limit");
        assert_eq!(meter.take_dropped(), Some((1, (20 - taken) as u64)));
        // A push fits in the next sixth, the operator's commands in the
        // third, and arrive marked as such.
        inbox.offer(1, command("j1", "apply-config"));
        inbox.offer(1, command("ops", "ping"));
        inbox.offer(1, command("ops", "ping"));
        let tiers: Vec<Tier> = rx
            .try_iter()
            .filter_map(|m| match m {
                CmdMsg::Incoming { tier, .. } => Some(tier),
                _ => None,
            })
            .collect();
        assert_eq!(tiers, [Tier::Push, Tier::Operator, Tier::Operator]);
        assert!(meter.held() <= 1200);
        assert_eq!(meter.take_dropped(), None);
        // Full to the operator's share too: the next one stays at the broker.
        for _ in 0..5 {
            inbox.offer(1, command("ops", "ping"));
        }
        assert!(rx.try_iter().count() < 5);
        assert!(meter.held() <= 1200);
    }

    #[test]
    fn one_command_larger_than_the_inbox_still_passes_when_nothing_is_held() {
        let (tx, rx) = std::sync::mpsc::channel();
        let inbox = Inbox::new(tx, 100, &[]);
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
