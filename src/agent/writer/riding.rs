//! What rides the writer's commits ([`crate::spool::Riders`]): counter
//! increments, the delivery records of the ledger
//! ([`crate::delivery::ledger`]), and the agent state `status` reads (the
//! summary's records, health, the command clock).
//!
//! One rule: **nothing here makes a commit of its own**. Counters and
//! delivery records ride the next commit (of readings, or alone after
//! their wait); agent state rides at most once per state period (the
//! checkpoint interval, at most five minutes: a page written more often is
//! copied back once per checkpoint anyway; the summary's records change
//! once a summary interval), and opens a window of its own only when
//! health's reasons changed, or when nothing else committed for an idle
//! period (a state period, at least a summary interval: `status` stays
//! current on an idle or offline board) (issue 35).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// What waits to ride the next commit ([`self`]).
#[derive(Debug, Default)]
pub(super) struct Riding {
    /// Counter increments not yet stored (a full disk refuses them too).
    counts: HashMap<String, i64>,
    /// The latest value of each agent state entry not yet stored.
    states: BTreeMap<String, String>,
    /// When agent state last reached the spool.
    stored_at: Option<Instant>,
    /// A change `status` must show without waiting for readings (health's
    /// reasons changed): it opens a window once the period allows.
    pressing: bool,
}

/// What one commit took from [`Riding`]; given back when it fails.
#[derive(Debug, Default)]
pub(super) struct Ride {
    pub(super) counts: Vec<(String, i64)>,
    pub(super) states: Vec<(String, String)>,
}

impl Riding {
    /// Add `by` to the counter `name`, stored with the next commit.
    pub(super) fn count(&mut self, name: String, by: i64) {
        *self.counts.entry(name).or_default() += by;
    }

    /// Counter increments wait.
    pub(super) fn counts_waiting(&self) -> bool {
        !self.counts.is_empty()
    }

    /// Set the state entry `key` to `value` (stored at the next state ride);
    /// `pressing`: see [`Riding::pressing`].
    pub(super) fn set_state(&mut self, key: &str, value: String, pressing: bool) {
        self.states.insert(key.to_owned(), value);
        self.pressing |= pressing;
    }

    /// Whether agent state may ride a commit at `now`, once per `period`.
    pub(super) fn states_due(&self, now: Instant, period: Duration) -> bool {
        !self.states.is_empty()
            && self
                .stored_at
                .is_none_or(|t| now.saturating_duration_since(t) >= period)
    }

    /// Whether state that waits must open a window of its own at `now`.
    pub(super) fn pressing(&self, now: Instant, period: Duration) -> bool {
        self.pressing && self.states_due(now, period)
    }

    /// Whether state that waits opens a window at `now`: when pressing
    /// (once a `period`), or once it has not reached the spool for
    /// `idle_period` (nothing else committed: a window already open is
    /// not opened again, so with readings flowing this adds no commit).
    pub(super) fn opens_window(
        &self,
        now: Instant,
        period: Duration,
        idle_period: Duration,
    ) -> bool {
        self.pressing(now, period) || self.states_due(now, idle_period)
    }

    /// Take what rides a commit at `now`: the counters, and the state when
    /// due (or `all_states`, at the stop).
    pub(super) fn take(&mut self, now: Instant, period: Duration, all_states: bool) -> Ride {
        let states = if all_states || self.states_due(now, period) {
            std::mem::take(&mut self.states).into_iter().collect()
        } else {
            Vec::new()
        };
        Ride {
            counts: self.counts.drain().collect(),
            states,
        }
    }

    /// The commit holding `ride` stored it at `now`.
    pub(super) fn stored(&mut self, ride: &Ride, now: Instant) {
        if !ride.states.is_empty() {
            self.stored_at = Some(now);
            self.pressing = false;
        }
    }

    /// The commit holding `ride` failed: what it took waits again (a newer
    /// state value set meanwhile wins).
    pub(super) fn restore(&mut self, ride: Ride) {
        for (k, v) in ride.counts {
            *self.counts.entry(k).or_default() += v;
        }
        for (k, v) in ride.states {
            self.states.entry(k).or_insert(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(60);

    #[test]
    fn state_rides_at_most_once_a_period_and_counts_every_commit() {
        let t = Instant::now();
        let mut r = Riding::default();
        r.set_state("write_budget", "{}".into(), false);
        r.count("x".into(), 2);
        let first = r.take(t, PERIOD, false);
        assert_eq!(first.states.len(), 1, "the first state rides at once");
        r.stored(&first, t);
        r.set_state("write_budget", "{\"a\":1}".into(), false);
        r.count("x".into(), 1);
        let next = r.take(t + Duration::from_secs(30), PERIOD, false);
        assert!(next.states.is_empty(), "within the period: kept in memory");
        assert_eq!(next.counts, vec![("x".to_owned(), 1)]);
        r.stored(&next, t + Duration::from_secs(30));
        assert!(r.states_due(t + PERIOD, PERIOD));
        assert!(!r.pressing(t + PERIOD, PERIOD), "nothing pressing");
    }

    #[test]
    fn an_idle_board_stores_its_state_once_an_idle_period() {
        // Found by tests/it/outage.rs: offline with no readings, the
        // outage budget never reached the spool and `status` kept the
        // record of the last commit.
        let t = Instant::now();
        let idle = 2 * PERIOD;
        let mut r = Riding::default();
        r.set_state("outage_budget", "{}".into(), false);
        assert!(r.opens_window(t, PERIOD, idle), "never stored: at once");
        let ride = r.take(t, PERIOD, false);
        r.stored(&ride, t);
        r.set_state("outage_budget", "{\"a\":1}".into(), false);
        assert!(
            !r.opens_window(t + PERIOD, PERIOD, idle),
            "rides, never opens, within it"
        );
        assert!(r.opens_window(t + idle, PERIOD, idle));
    }

    #[test]
    fn a_health_change_presses_once_the_period_allows() {
        let t = Instant::now();
        let mut r = Riding::default();
        r.set_state("health", "ok".into(), true);
        let ride = r.take(t, PERIOD, false);
        r.stored(&ride, t);
        r.set_state("health", "degraded".into(), true);
        assert!(!r.pressing(t + Duration::from_secs(10), PERIOD));
        assert!(r.pressing(t + PERIOD, PERIOD));
    }

    #[test]
    fn a_failed_commit_gives_back_what_it_took_and_a_newer_value_wins() {
        let t = Instant::now();
        let mut r = Riding::default();
        r.count("x".into(), 2);
        r.set_state("health", "old".into(), false);
        let ride = r.take(t, PERIOD, false);
        r.count("x".into(), 1);
        r.set_state("health", "new".into(), false);
        r.restore(ride);
        let again = r.take(t, PERIOD, false);
        assert_eq!(again.counts, vec![("x".to_owned(), 3)]);
        assert_eq!(again.states, vec![("health".to_owned(), "new".to_owned())]);
    }
}
