//! When the writer acts: the commit window (opened by its first reading or
//! count, closed after `spool.commit_window_ms` or at once when the buffer
//! is half full), the upkeep's next pass, the next summary, and how long the
//! loop may sleep until the nearest of them.
//!
//! One rule: **the loop never sleeps past a deadline**, and never polls: it
//! wakes for a message or the nearest deadline. Pure: time is passed in.

use std::time::{Duration, Instant};

/// How soon the loop comes round while `full` readings wait (a commit that
/// failed retries) or a pushed config waits for its confirmation.
pub(super) const HURRY: Duration = Duration::from_millis(200);

/// What the commit window's decision looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WindowState {
    /// Batched readings wait.
    pub(super) buffered: bool,
    /// The buffer holds half its bound.
    pub(super) half_full: bool,
    /// A commit that failed waits for this moment to retry.
    pub(super) retry_at: Option<Instant>,
}

/// The writer's deadlines ([`self`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Deadlines {
    /// When the open commit window closes (`None`: none is open).
    commit_at: Option<Instant>,
    /// Delivery records wait for a commit of readings to ride until then,
    /// then commit alone (`None`: none wait).
    records_at: Option<Instant>,
    /// The upkeep's next pass.
    upkeep_at: Instant,
    /// The next summary.
    summary_at: Instant,
}

impl Deadlines {
    /// At start (`now`): no window open, the first pass one `upkeep_period`
    /// on, the first summary one `summary_interval` on.
    pub(super) fn new(now: Instant, upkeep_period: Duration, summary_interval: Duration) -> Self {
        Deadlines {
            commit_at: None,
            records_at: None,
            upkeep_at: now + upkeep_period,
            summary_at: now + summary_interval,
        }
    }

    /// The latest moment the loop may sleep until: the nearest deadline, or
    /// [`HURRY`] from `now` when something waits to be retried or judged.
    pub(super) fn next_wake(&self, now: Instant, hurry: bool) -> Instant {
        let mut next = self.upkeep_at.min(self.summary_at);
        for c in [self.commit_at, self.records_at].into_iter().flatten() {
            next = next.min(c);
        }
        if hurry {
            next = next.min(now + HURRY);
        }
        next
    }

    /// A count to store arrived at `now`: it opens a window if none is open
    /// (stored by the next commit, one write per window however many arrive).
    pub(super) fn open_window(&mut self, now: Instant, window: Duration) {
        self.commit_at.get_or_insert(now + window);
    }

    /// Delivery records arrived at `now`: they ride the next commit of
    /// readings, or commit alone once they have waited `wait`.
    pub(super) fn records_waiting(&mut self, now: Instant, wait: Duration) {
        self.records_at.get_or_insert(now + wait);
    }

    /// Close the commit window at `now` (open or not): what waits commits
    /// at once.
    pub(super) fn close_window(&mut self, now: Instant) {
        self.commit_at = Some(now);
    }

    /// Whether to commit the batched buffer at `now`. The window opens with
    /// its first reading and closes `window` later; a buffer at half its
    /// bound closes it at once, unless a failed commit waits to retry.
    pub(super) fn commit_due(&mut self, now: Instant, window: Duration, s: WindowState) -> bool {
        if s.buffered && self.commit_at.is_none() {
            self.commit_at = Some(now + window);
        }
        if s.half_full && s.retry_at.is_none_or(|t| now >= t) {
            self.commit_at = Some(now);
        }
        if self.records_at.is_some_and(|t| now >= t) {
            self.commit_at.get_or_insert(now);
        }
        self.commit_at.is_some_and(|c| now >= c)
    }

    /// After a commit at `now`: readings it left (refused for now, or
    /// waiting for a retry) open the next window.
    pub(super) fn committed(&mut self, now: Instant, window: Duration, still_buffered: bool) {
        self.commit_at = still_buffered.then(|| now + window);
        // The commit took every delivery record waiting.
        self.records_at = None;
    }

    /// Whether the upkeep's pass is due at `now`.
    pub(super) fn upkeep_due(&self, now: Instant) -> bool {
        now >= self.upkeep_at
    }

    /// After a pass at `now` that asked to come back after `wake_in`.
    pub(super) fn upkeep_after(&mut self, now: Instant, wake_in: Duration) {
        self.upkeep_at = now + wake_in;
    }

    /// Whether the summary is due at `now`.
    pub(super) fn summary_due(&self, now: Instant) -> bool {
        now >= self.summary_at
    }

    /// After a summary at `now`.
    pub(super) fn summary_after(&mut self, now: Instant, interval: Duration) {
        self.summary_at = now + interval;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_millis(200);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn start() -> (Instant, Deadlines) {
        let t = Instant::now();
        (
            t,
            Deadlines::new(t, Duration::from_secs(5), Duration::from_secs(60)),
        )
    }

    fn buffered() -> WindowState {
        WindowState {
            buffered: true,
            half_full: false,
            retry_at: None,
        }
    }

    #[test]
    fn a_reading_opens_the_window_and_is_committed_when_it_closes() {
        let (t, mut d) = start();
        assert!(!d.commit_due(t, WINDOW, buffered()), "wait for the window");
        assert_eq!(d.next_wake(t, false), t + WINDOW);
        // A later reading does not move the open window.
        assert!(!d.commit_due(t + ms(150), WINDOW, buffered()));
        assert!(d.commit_due(t + ms(200), WINDOW, buffered()), "commit now");
        d.committed(t + ms(200), WINDOW, false);
        assert_eq!(d.next_wake(t + ms(200), false), t + Duration::from_secs(5));
    }

    #[test]
    fn nothing_buffered_opens_no_window() {
        let (t, mut d) = start();
        let idle = WindowState {
            buffered: false,
            ..buffered()
        };
        assert!(!d.commit_due(t + Duration::from_secs(1), WINDOW, idle));
        assert_eq!(d.next_wake(t, false), t + Duration::from_secs(5));
    }

    #[test]
    fn a_half_full_buffer_commits_at_once_unless_a_failed_commit_waits() {
        let (t, mut d) = start();
        let half = WindowState {
            half_full: true,
            ..buffered()
        };
        assert!(d.commit_due(t, WINDOW, half));
        let waiting = WindowState {
            retry_at: Some(t + ms(500)),
            ..half
        };
        let (t, mut d) = start();
        assert!(!d.commit_due(t, WINDOW, waiting), "the retry waits");
        assert!(d.commit_due(t + ms(500), WINDOW, waiting), "then commits");
    }

    #[test]
    fn readings_left_by_a_commit_open_the_next_window() {
        let (t, mut d) = start();
        assert!(!d.commit_due(t, WINDOW, buffered()));
        assert!(d.commit_due(t + WINDOW, WINDOW, buffered()));
        d.committed(t + WINDOW, WINDOW, true);
        assert_eq!(d.next_wake(t + WINDOW, false), t + 2 * WINDOW);
    }

    #[test]
    fn a_count_opens_a_window_but_never_moves_an_open_one() {
        let (t, mut d) = start();
        d.open_window(t, WINDOW);
        d.open_window(t + ms(100), WINDOW);
        assert_eq!(d.next_wake(t, false), t + WINDOW);
        let idle = WindowState {
            buffered: false,
            ..buffered()
        };
        assert!(
            d.commit_due(t + WINDOW, WINDOW, idle),
            "the counts are stored"
        );
    }

    #[test]
    fn the_loop_sleeps_until_the_nearest_deadline_or_hurries() {
        let (t, mut d) = start();
        assert_eq!(d.next_wake(t, false), t + Duration::from_secs(5));
        assert_eq!(d.next_wake(t, true), t + HURRY);
        assert!(!d.upkeep_due(t + ms(4999)));
        assert!(d.upkeep_due(t + Duration::from_secs(5)));
        // A pass that left work over comes back sooner.
        d.upkeep_after(t + Duration::from_secs(5), ms(250));
        assert_eq!(d.next_wake(t + Duration::from_secs(5), false), t + ms(5250));
        assert!(!d.summary_due(t + Duration::from_secs(59)));
        assert!(d.summary_due(t + Duration::from_secs(60)));
        d.summary_after(t + Duration::from_secs(60), Duration::from_secs(60));
        assert!(!d.summary_due(t + Duration::from_secs(61)));
    }

    #[test]
    fn delivery_records_ride_the_next_commit_or_commit_alone_after_their_wait() {
        let (t, mut d) = start();
        let idle = WindowState {
            buffered: false,
            ..buffered()
        };
        d.records_waiting(t, Duration::from_secs(60));
        // A reading's window comes first: the records ride it.
        assert!(!d.commit_due(t + ms(100), WINDOW, buffered()));
        assert!(d.commit_due(t + ms(300), WINDOW, buffered()));
        d.committed(t + ms(300), WINDOW, false);
        assert_eq!(d.next_wake(t + ms(300), false), t + Duration::from_secs(5));
        // No reading: alone, once they waited.
        d.records_waiting(t + ms(400), Duration::from_secs(60));
        assert!(!d.commit_due(t + Duration::from_secs(30), WINDOW, idle));
        assert!(d.commit_due(t + ms(60_400), WINDOW, idle));
    }
}
