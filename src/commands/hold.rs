//! Commands held back: PUBLISHes the command thread cannot take now (a lane
//! full, records at their cap, the spool refusing writes), parked in memory
//! or left at the broker, and the episode they belong to.
//!
//! Its one rule: **a held-back PUBLISH stays unacknowledged**, so the
//! broker keeps it whatever happens to the agent; an episode is logged once
//! when it starts (a warning at most every 10 min) and once when it ends.

use super::admission::Tier;
use super::lanes::Route;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A held-back episode starting within this long of the last warned one
/// is logged at debug level only.
const HOLD_WARNING_INTERVAL: Duration = Duration::from_secs(600);

/// A PUBLISH held back in memory, unacknowledged, until it can be taken.
pub(super) struct Parked {
    /// Connection it arrived on (only that one may acknowledge it).
    pub(super) epoch: u64,
    pub(super) publish: rumqttc::Publish,
    /// Where it runs (`None`: not parseable; only the spool's room matters).
    pub(super) route: Option<Route>,
    /// Its share of the bounds.
    pub(super) tier: Tier,
}

/// An episode of new commands left unacknowledged.
pub(super) struct Hold {
    /// Connection of the latest PUBLISH the inbox could not forward.
    pub(super) dropped_epoch: Option<u64>,
    parked: u64,
    dropped: u64,
    why: String,
}

impl Hold {
    /// Log the end of the episode; `how` says how the ones not kept come
    /// back. Returns how many commands were held back in all.
    pub(super) fn ended(&self, how: &str) -> u64 {
        log::info!(
            "commands: room again ({} before); {} commands were parked, {} not kept; {how}",
            self.why,
            self.parked,
            self.dropped
        );
        self.parked + self.dropped
    }
}

/// The command thread's held-back commands.
#[derive(Default)]
pub(super) struct HeldBack {
    /// Held back in memory, oldest first.
    pub(super) parked: VecDeque<Parked>,
    episode: Option<Hold>,
    last_warning: Option<Instant>,
}

impl HeldBack {
    /// Whether an episode is under way.
    pub(super) fn holding(&self) -> bool {
        self.episode.is_some()
    }

    /// Whether the episode under way ends with a reconnect (the inbox left
    /// some PUBLISHes at the broker).
    pub(super) fn redelivers(&self) -> bool {
        self.episode
            .as_ref()
            .is_some_and(|h| h.dropped_epoch.is_some())
    }

    /// End the episode, if one is under way.
    pub(super) fn end(&mut self) -> Option<Hold> {
        self.episode.take()
    }

    /// Start an episode of held-back commands (logged once), or count into
    /// the current one.
    fn hold(&mut self, why: impl FnOnce() -> String) -> &mut Hold {
        let HeldBack {
            episode,
            last_warning,
            ..
        } = self;
        episode.get_or_insert_with(|| {
            let why = why();
            let msg = format!(
                "commands: {why}; not acknowledging new commands: the broker keeps them, \
                 they are taken once there is room"
            );
            if last_warning.is_some_and(|t| t.elapsed() < HOLD_WARNING_INTERVAL) {
                log::debug!("{msg}");
            } else {
                log::warn!("{msg} (logged at most every 10 min)");
                *last_warning = Some(Instant::now());
            }
            Hold {
                dropped_epoch: None,
                parked: 0,
                dropped: 0,
                why,
            }
        })
    }

    /// Keep `publish` (of connection `epoch`, running on `route`, of
    /// `tier`) unacknowledged, in memory, until it can be taken; `why` it
    /// cannot now.
    pub(super) fn park(
        &mut self,
        epoch: u64,
        publish: rumqttc::Publish,
        (route, tier): (Option<Route>, Tier),
        why: String,
    ) {
        self.hold(|| why).parked += 1;
        self.parked.push_back(Parked {
            epoch,
            publish,
            route,
            tier,
        });
    }

    /// `n` PUBLISHes, the latest of connection `epoch`, were neither taken
    /// nor kept: only a redelivery brings them back.
    pub(super) fn dropped(&mut self, epoch: u64, n: u64, why: impl FnOnce() -> String) {
        let h = self.hold(why);
        h.dropped += n;
        h.dropped_epoch = Some(epoch);
    }
}
