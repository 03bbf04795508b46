//! The write budget: the commit window that keeps the agent's flash writes
//! within `spool.write_budget_mb_per_day`, chosen from the measured rate.
//!
//! One rule: **the window widens only up to the loss window the operator
//! accepts (`spool.max_commit_window_ms`) and to the buffer's bound, never
//! past them**; `full` streams and commands commit at once whatever it says
//! (they never wait for a window). When the budget cannot be met within
//! that, the verdict says so, with the projected MB/day and what would meet
//! it, for health.
//!
//! The model: with the agent's schema each commit dirties about the same few
//! pages whatever it holds (the tail leaf of `events`, the delivery mark),
//! so the bytes a day written at a window `W` scale about as `1/W`
//! (<https://www.sqlite.org/fileformat.html#the_write_ahead_log>: one frame
//! per page changed per commit). A wider window is `W * projected / goal`;
//! the part that does not shrink with the window (the payload bytes
//! themselves, the summary) makes that an overestimate, which the next
//! measurement corrects. Pure: time and byte counts are passed in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The commit window in force, read by the threads that commit on it (the
/// writer for readings, delivery for acknowledgement records). Its one
/// holder is the [`Controller`] that chooses it (held by the storage
/// upkeep, [`crate::flash::upkeep`]): only the controller sets it, so no
/// copy is kept equal by hand on a reload. Cloning shares it.
#[derive(Debug, Clone)]
pub struct SharedWindow(Arc<AtomicU64>);

impl SharedWindow {
    /// A handle holding `window` (at least 1 ms). Made by the
    /// [`Controller`]; one made elsewhere is a fixed window (a test's).
    pub fn new(window: Duration) -> SharedWindow {
        let w = SharedWindow(Arc::new(AtomicU64::new(1)));
        w.set(window);
        w
    }

    /// The window now.
    pub fn get(&self) -> Duration {
        Duration::from_millis(self.0.load(Ordering::Relaxed))
    }

    /// Put `window` in force (rounded down to whole ms, at least 1 ms): the
    /// controller's alone.
    fn set(&self, window: Duration) {
        let ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        self.0.store(ms, Ordering::Relaxed);
    }
}

/// Measure at least this long between decisions (a checkpoint writes in
/// bursts; a shorter span would see it or not by chance).
pub const MEASURE_SPAN: Duration = Duration::from_secs(20);
/// Aim this far under the budget when widening...
const GOAL_PCT: u64 = 80;
/// ...widen once the projection is over this share of it...
const WIDEN_PCT: u64 = 95;
/// ...and narrow again (towards the configured window) only under this.
const NARROW_PCT: u64 = 40;
/// Commits per checkpoint the checkpoint cadence follows the window with
/// ([`checkpoint_interval`]).
pub const COMMITS_PER_CHECKPOINT: u32 = 12;
/// The longest time-driven checkpoint interval the window can stretch it to
/// (the WAL byte threshold still checkpoints sooner).
pub const MAX_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(300);

/// The budget's settings, from `[spool]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSettings {
    /// `write_budget_mb_per_day` in bytes a day (10^6 bytes per MB); `None`:
    /// no budget, the window stays `base_window`.
    pub bytes_per_day: Option<u64>,
    /// `commit_window_ms` (or the storage probe's): the window with no
    /// budget, and the narrowest one with a budget.
    pub base_window: Duration,
    /// `max_commit_window_ms`: the widest window a budget may choose.
    pub max_window: Duration,
}

/// What was measured since the last decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// Bytes this process sent to the block layer (`/proc/self/io`
    /// `write_bytes`), a running total.
    pub write_bytes: u64,
    /// Readings appended (batched streams), a running total.
    pub readings: u64,
    /// The buffer's bound in readings and in bytes, and the mean bytes a
    /// buffered reading takes ([`crate::spool::NewEvent::heap_bytes`]).
    pub bound_readings: usize,
    /// See `bound_readings`.
    pub bound_bytes: usize,
    /// See `bound_readings`.
    pub bytes_per_reading: usize,
}

/// Whether the budget holds at the chosen window.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// No budget, or within it (or not measured yet).
    Within,
    /// Over the budget at the widest window allowed.
    Over {
        /// Projected MB/day at the current window.
        projected_mb_per_day: f64,
        /// The budget, MB/day.
        budget_mb_per_day: f64,
        /// The window the model says would meet it, ms.
        needed_window_ms: u64,
        /// What stopped the window: `spool.max_commit_window_ms` or the
        /// buffer's bound.
        limit: &'static str,
        /// The window it stopped at, ms.
        limit_ms: u64,
    },
}

impl Verdict {
    /// The health reason for an `Over` verdict, naming the projection and
    /// what would meet the budget.
    pub fn reason(&self) -> Option<String> {
        match self {
            Verdict::Within => None,
            Verdict::Over {
                projected_mb_per_day,
                budget_mb_per_day,
                needed_window_ms,
                limit,
                limit_ms,
            } => Some(format!(
                "write budget exceeded: projected {projected_mb_per_day:.0} MB/day at a {limit_ms} ms commit window, the widest allowed (stopped by {limit}), spool.write_budget_mb_per_day is {budget_mb_per_day:.0}: a window of about {needed_window_ms} ms, or a budget of {:.0} MB/day, would meet it",
                projected_mb_per_day.ceil()
            )),
        }
    }
}

/// The commit window controller, and the window's one holder.
#[derive(Debug)]
pub struct Controller {
    settings: BudgetSettings,
    /// The window in force, shared with its readers ([`Controller::reader`]).
    window: SharedWindow,
    largest: Duration,
    /// Start of the current measurement: when, and the totals then.
    since: Option<(Instant, u64, u64)>,
    verdict: Verdict,
    /// The last projection, MB/day.
    projected: Option<f64>,
}

impl Controller {
    /// A controller at the base window.
    pub fn new(settings: BudgetSettings) -> Controller {
        Controller {
            window: SharedWindow::new(settings.base_window),
            largest: settings.base_window,
            settings,
            since: None,
            verdict: Verdict::Within,
            projected: None,
        }
    }

    /// New settings (a config reload): the window starts again from the
    /// base, measured afresh; its readers see the change.
    pub fn reconfigure(&mut self, settings: BudgetSettings) {
        if settings != self.settings {
            self.largest = self.largest.max(settings.base_window);
            self.window.set(settings.base_window);
            self.settings = settings;
            self.since = None;
            self.verdict = Verdict::Within;
            self.projected = None;
        }
    }

    /// A handle on the window in force, for the threads that commit on it.
    pub fn reader(&self) -> SharedWindow {
        self.window.clone()
    }

    /// The settings in force.
    pub fn settings(&self) -> BudgetSettings {
        self.settings
    }

    /// The commit window now.
    pub fn window(&self) -> Duration {
        self.window.get()
    }

    /// The widest window chosen since the agent started.
    pub fn largest(&self) -> Duration {
        self.largest
    }

    /// The budget's verdict at the last decision.
    pub fn verdict(&self) -> &Verdict {
        &self.verdict
    }

    /// The last projection of MB/day (None before the first full span).
    pub fn projected_mb_per_day(&self) -> Option<f64> {
        self.projected
    }

    /// Feed the totals at `now`; at most once per [`MEASURE_SPAN`] this
    /// projects the MB/day of the span and, with a budget, picks the window.
    /// Returns true when the window changed.
    pub fn observe(&mut self, now: Instant, m: &Measured) -> bool {
        let Some((t0, bytes0, readings0)) = self.since else {
            self.since = Some((now, m.write_bytes, m.readings));
            return false;
        };
        let span = now.saturating_duration_since(t0);
        if span < MEASURE_SPAN {
            return false;
        }
        self.since = Some((now, m.write_bytes, m.readings));
        let per_day = m.write_bytes.saturating_sub(bytes0) as f64 * 86_400.0 / span.as_secs_f64();
        self.projected = Some(per_day / 1e6);
        let Some(budget) = self.settings.bytes_per_day else {
            return false;
        };
        let budget = budget as f64;
        let rate = m.readings.saturating_sub(readings0) as f64 / span.as_secs_f64();
        let (bound, bound_name) = self.bound(rate, m);
        let w = self.window().as_secs_f64();
        let target = if per_day > budget * WIDEN_PCT as f64 / 100.0 {
            w * per_day / (budget * GOAL_PCT as f64 / 100.0)
        } else if per_day < budget * NARROW_PCT as f64 / 100.0 {
            // Narrow halfway to where the model puts the goal: the part
            // that does not scale with the window would otherwise make it
            // overshoot and swing back.
            (w + w * per_day / (budget * GOAL_PCT as f64 / 100.0)) / 2.0
        } else {
            w
        };
        // Whole ms: the window is kept in ms ([`SharedWindow`]).
        let needed = Duration::from_millis((target.clamp(0.0, 86_400.0) * 1000.0).round() as u64);
        let chosen = needed.clamp(
            self.settings.base_window,
            bound.max(self.settings.base_window),
        );
        // The buffer's bound is no whole number of ms: what is held is.
        let chosen = Duration::from_millis(u64::try_from(chosen.as_millis()).unwrap_or(u64::MAX));
        // Over only as measured at the widest window: while it still widens,
        // the next span tells.
        self.verdict = if per_day > budget && chosen < needed && chosen == self.window() {
            Verdict::Over {
                projected_mb_per_day: per_day / 1e6,
                budget_mb_per_day: budget / 1e6,
                needed_window_ms: needed.as_millis() as u64,
                limit: bound_name,
                limit_ms: chosen.as_millis() as u64,
            }
        } else {
            Verdict::Within
        };
        let changed = chosen != self.window();
        self.window.set(chosen);
        self.largest = self.largest.max(chosen);
        changed
    }

    /// The widest window allowed now and what sets it: the operator's loss
    /// window, or half the buffer's bound at the measured rate (so a window
    /// of readings never fills the buffer a failing commit then needs).
    fn bound(&self, rate: f64, m: &Measured) -> (Duration, &'static str) {
        let max = self.settings.max_window;
        if rate <= 0.0 {
            return (max, "spool.max_commit_window_ms");
        }
        let by_count = m.bound_readings as f64 / 2.0 / rate;
        let by_bytes = m.bound_bytes as f64 / 2.0 / (rate * m.bytes_per_reading.max(1) as f64);
        let buffer = Duration::from_secs_f64(by_count.min(by_bytes).clamp(0.0, 86_400.0));
        if buffer < max {
            (buffer, "the in-memory buffer's bound")
        } else {
            (max, "spool.max_commit_window_ms")
        }
    }
}

/// The time-driven checkpoint interval at commit window `window`: the
/// configured interval, or [`COMMITS_PER_CHECKPOINT`] windows if longer (at
/// most [`MAX_CHECKPOINT_INTERVAL`], never under the configured one). A
/// checkpoint copies every page changed since the last one into the
/// database and syncs twice; with a few commits between checkpoints it
/// rewrites the same hot pages (the tail leaf, the delivery mark) once per
/// commit, which doubles what a wide window saved in the WAL.
pub fn checkpoint_interval(configured: Duration, window: Duration) -> Duration {
    let follow = (window * COMMITS_PER_CHECKPOINT).min(MAX_CHECKPOINT_INTERVAL);
    configured.max(follow)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn settings(budget_mb: Option<u64>) -> BudgetSettings {
        BudgetSettings {
            bytes_per_day: budget_mb.map(|b| b * MB),
            base_window: Duration::from_millis(200),
            max_window: Duration::from_secs(10),
        }
    }

    fn measured(bytes: u64, readings: u64) -> Measured {
        Measured {
            write_bytes: bytes,
            readings,
            bound_readings: 15_000,
            bound_bytes: 32 * 1024 * 1024,
            bytes_per_reading: 300,
        }
    }

    /// Feed `mb_per_day` for one span and return whether the window changed.
    fn span(
        c: &mut Controller,
        t: &mut Instant,
        total: &mut u64,
        mb_per_day: u64,
        rate: u64,
        readings: &mut u64,
    ) -> bool {
        *t += MEASURE_SPAN;
        *total += mb_per_day * MB * MEASURE_SPAN.as_secs() / 86_400;
        *readings += rate * MEASURE_SPAN.as_secs();
        c.observe(*t, &measured(*total, *readings))
    }

    #[test]
    fn without_a_budget_the_window_stays_the_configured_one() {
        let mut c = Controller::new(settings(None));
        let (mut t, mut total, mut n) = (Instant::now(), 0, 0);
        c.observe(t, &measured(0, 0));
        assert!(!span(&mut c, &mut t, &mut total, 5_000, 100, &mut n));
        assert_eq!(c.window(), Duration::from_millis(200));
        assert_eq!(c.verdict(), &Verdict::Within);
        assert!(c
            .projected_mb_per_day()
            .is_some_and(|p| (p - 5_000.0).abs() < 1.0));
    }

    #[test]
    fn over_the_budget_the_window_widens_in_proportion_to_the_excess() {
        let mut c = Controller::new(settings(Some(100)));
        let (mut t, mut total, mut n) = (Instant::now(), 0, 0);
        c.observe(t, &measured(0, 0));
        // 400 MB/day at 200 ms: the goal (80 MB/day) needs 5x the window.
        assert!(span(&mut c, &mut t, &mut total, 400, 1, &mut n));
        assert_eq!(c.window(), Duration::from_millis(1000));
        assert_eq!(c.largest(), Duration::from_millis(1000));
        assert_eq!(c.verdict(), &Verdict::Within);
        // Within the band: it stays.
        assert!(!span(&mut c, &mut t, &mut total, 60, 1, &mut n));
        assert_eq!(c.window(), Duration::from_millis(1000));
    }

    #[test]
    fn the_window_never_passes_the_operators_loss_window_and_health_says_what_would_meet_the_budget(
    ) {
        let mut c = Controller::new(settings(Some(100)));
        let (mut t, mut total, mut n) = (Instant::now(), 0, 0);
        c.observe(t, &measured(0, 0));
        span(&mut c, &mut t, &mut total, 8_000, 100, &mut n);
        assert_eq!(c.window(), Duration::from_secs(10));
        // Not yet measured at the ceiling: no verdict yet.
        assert_eq!(c.verdict(), &Verdict::Within);
        span(&mut c, &mut t, &mut total, 160, 100, &mut n);
        let why = c.verdict().reason().expect("over the budget");
        assert!(
            why.contains("projected 160 MB/day at a 10000 ms commit window"),
            "{why}"
        );
        assert!(
            why.contains("stopped by spool.max_commit_window_ms"),
            "{why}"
        );
        assert!(why.contains("a window of about 20000 ms"), "{why}");
        // Once within the budget, the verdict clears.
        span(&mut c, &mut t, &mut total, 90, 100, &mut n);
        assert_eq!(c.verdict(), &Verdict::Within);
    }

    #[test]
    fn the_window_stops_at_half_the_buffers_bound() {
        let mut c = Controller::new(BudgetSettings {
            max_window: Duration::from_secs(60),
            ..settings(Some(100))
        });
        let (mut t, mut total, mut n) = (Instant::now(), 0, 0);
        c.observe(t, &measured(0, 0));
        // 1,000 readings/s: 15,000 readings hold 15 s, half of it is 7.5 s.
        span(&mut c, &mut t, &mut total, 50_000, 1_000, &mut n);
        assert_eq!(c.window(), Duration::from_millis(7500));
        span(&mut c, &mut t, &mut total, 1_000, 1_000, &mut n);
        let why = c.verdict().reason().expect("over the budget");
        assert!(why.contains("the in-memory buffer's bound"), "{why}");
    }

    #[test]
    fn far_under_the_budget_the_window_narrows_but_not_below_the_configured_one() {
        let mut c = Controller::new(settings(Some(100)));
        let (mut t, mut total, mut n) = (Instant::now(), 0, 0);
        c.observe(t, &measured(0, 0));
        span(&mut c, &mut t, &mut total, 5_000, 10, &mut n);
        assert_eq!(c.window(), Duration::from_secs(10));
        // The rate fell: 10 MB/day at 10 s; narrowing halfway each span.
        assert!(span(&mut c, &mut t, &mut total, 10, 1, &mut n));
        assert!(c.window() < Duration::from_secs(10));
        for _ in 0..50 {
            span(&mut c, &mut t, &mut total, 1, 1, &mut n);
        }
        assert_eq!(c.window(), Duration::from_millis(200));
        assert_eq!(c.largest(), Duration::from_secs(10));
    }

    #[test]
    fn a_short_span_decides_nothing() {
        let mut c = Controller::new(settings(Some(100)));
        let t = Instant::now();
        c.observe(t, &measured(0, 0));
        assert!(!c.observe(t + Duration::from_secs(5), &measured(100 * MB, 10)));
        assert_eq!(c.window(), Duration::from_millis(200));
        assert_eq!(c.projected_mb_per_day(), None);
    }

    #[test]
    fn the_checkpoint_cadence_follows_a_wide_window_up_to_its_cap() {
        let ckpt = Duration::from_secs(30);
        assert_eq!(checkpoint_interval(ckpt, Duration::from_millis(200)), ckpt);
        assert_eq!(
            checkpoint_interval(ckpt, Duration::from_secs(10)),
            Duration::from_secs(120)
        );
        assert_eq!(
            checkpoint_interval(ckpt, Duration::from_secs(60)),
            MAX_CHECKPOINT_INTERVAL
        );
        let long = Duration::from_secs(3600);
        assert_eq!(checkpoint_interval(long, Duration::from_secs(10)), long);
    }
}
