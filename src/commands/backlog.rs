//! Command PUBLISHes taken from the command thread's channel and not yet
//! handled, by tier.
//!
//! Its one rule: **the highest tier waiting is handled first**, oldest
//! first within a tier ([`Tier::rank`]: the operator's signed commands,
//! then pushes, then the rest), so an operator command never waits behind the junk that
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

    /// The oldest PUBLISH of the highest tier waiting, with that tier.
    pub(super) fn pop(&mut self) -> Option<(Tier, u64, rumqttc::Publish)> {
        [Tier::Operator, Tier::Push, Tier::Other]
            .into_iter()
            .find_map(|t| {
                let (epoch, p) = self.queues[t.rank()].pop_front()?;
                Some((t, epoch, p))
            })
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
        let order: Vec<(Tier, u64, u8)> = std::iter::from_fn(|| b.pop())
            .map(|(t, e, p)| (t, e, p.payload[0]))
            .collect();
        use Tier::{Operator as O, Other as X, Push as P};
        assert_eq!(
            order,
            [(O, 2, 4), (O, 2, 5), (P, 1, 3), (X, 1, 1), (X, 1, 2)]
        );
        assert!(b.pop().is_none() && b.is_empty());
    }
}
