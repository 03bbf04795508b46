//! Command PUBLISHes taken from the command thread's channel and not yet
//! handled, by tier.
//!
//! Its one rule: **the highest tier waiting is handled first**, oldest
//! first within a tier ([`Tier::rank`]: operator scopes, then pushes, then
//! the rest), so an operator command never waits behind the junk that
//! arrived before it. What it holds is bounded by the inbox's bytes: a
//! PUBLISH's bytes are released only once it is handled.

use super::admission::Tier;
use std::collections::VecDeque;

/// PUBLISHes waiting on the command thread, by tier.
#[derive(Default)]
pub(super) struct Backlog {
    /// Indexed by [`Tier::rank`]: `(connection epoch, PUBLISH)`.
    queues: [VecDeque<(u64, rumqttc::Publish)>; 3],
}

impl Backlog {
    /// Keep `publish` of connection `epoch`, of `tier`.
    pub(super) fn push(&mut self, tier: Tier, epoch: u64, publish: rumqttc::Publish) {
        self.queues[tier.rank()].push_back((epoch, publish));
    }

    /// Whether nothing waits.
    pub(super) fn is_empty(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty)
    }

    /// The oldest PUBLISH of the highest tier waiting.
    pub(super) fn pop(&mut self) -> Option<(u64, rumqttc::Publish)> {
        self.queues.iter_mut().find_map(VecDeque::pop_front)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: u8) -> rumqttc::Publish {
        rumqttc::Publish::new("p/commands", rumqttc::QoS::AtLeastOnce, vec![n])
    }

    #[test]
    fn the_operators_commands_are_taken_first_then_pushes_then_the_rest() {
        let mut b = Backlog::default();
        b.push(Tier::Other, 1, p(1));
        b.push(Tier::Other, 1, p(2));
        b.push(Tier::Push, 1, p(3));
        b.push(Tier::Operator, 2, p(4));
        b.push(Tier::Operator, 2, p(5));
        let order: Vec<(u64, u8)> = std::iter::from_fn(|| b.pop())
            .map(|(e, p)| (e, p.payload[0]))
            .collect();
        assert_eq!(order, [(2, 4), (2, 5), (1, 3), (1, 1), (1, 2)]);
        assert!(b.pop().is_none() && b.is_empty());
    }
}
