//! Flash wear: the write budget fed what this process wrote and appended at
//! each pass (it chooses the commit window, [`crate::flash::write_budget`]),
//! and the record of what the run has cost the flash so far, for `status`.
//!
//! One rule: the commit window in force has **one holder**, the budget's
//! [`Controller`]; every thread that commits on it reads it through
//! [`super::Upkeep::window_reader`].

use super::Upkeep;
use crate::flash::maintenance::{per_hour, proc_write_bytes};
use crate::flash::write_budget::{BudgetSettings, Controller, Measured, Verdict};
use crate::spool::Spool;
use std::time::Instant;

/// What the writer holds, for the write budget's bound on the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Readings appended this run (batched and full), a running total.
    pub appended: u64,
    /// Readings waiting in the batched buffer now.
    pub buffered: usize,
    /// Bytes ([`crate::spool::NewEvent::heap_bytes`]) of every reading
    /// buffered now.
    pub buffered_bytes: usize,
    /// The buffer's bound, in readings.
    pub bound_readings: usize,
    /// The buffer's bound, in bytes.
    pub bound_bytes: usize,
}

/// What the upkeep keeps about flash wear.
#[derive(Debug)]
pub(super) struct Wear {
    /// Chooses the commit window from the measured writes, and holds it.
    pub(super) budget: Controller,
    /// Baseline of the run's record: (when, `/proc/self/io` write_bytes).
    since: (Instant, u64),
    /// Mean bytes of a buffered reading when last seen (for the budget's
    /// bound on the window).
    reading_bytes: usize,
}

impl Wear {
    pub(super) fn new(settings: BudgetSettings, now: Instant) -> Wear {
        Wear {
            budget: Controller::new(settings),
            since: (now, proc_write_bytes().unwrap_or(0)),
            reading_bytes: 512,
        }
    }
}

impl Upkeep {
    /// The write budget's verdict at its last decision (a health reason
    /// when over).
    pub fn budget_verdict(&self) -> &Verdict {
        self.wear.budget.verdict()
    }

    /// Feed the write budget what this process wrote and appended, and put
    /// the window it chooses in force for the next commit window of every
    /// thread. Without a budget the window stays.
    pub(super) fn observe_budget(&mut self, now: Instant, load: &Load) {
        let Some(write_bytes) = proc_write_bytes() else {
            return;
        };
        let w = &mut self.wear;
        if let Some(mean) = load.buffered_bytes.checked_div(load.buffered) {
            w.reading_bytes = mean;
        }
        let m = Measured {
            write_bytes,
            readings: load.appended,
            bound_readings: load.bound_readings,
            bound_bytes: load.bound_bytes,
            bytes_per_reading: w.reading_bytes,
        };
        let before = w.budget.window();
        if !w.budget.observe(now, &m) {
            return;
        }
        let after = w.budget.window();
        log::info!(
            "write budget: projected {:.0} MB/day at a {} ms commit window (budget {} MB/day): commit window now {} ms, time-driven checkpoints every {} s",
            w.budget.projected_mb_per_day().unwrap_or(0.0),
            before.as_millis(),
            w.budget.settings().bytes_per_day.unwrap_or(0) / 1_000_000,
            after.as_millis(),
            self.checkpoint_interval().as_secs()
        );
    }

    /// What this run has cost the flash so far, for `status`
    /// (`write_budget`): bytes the kernel sent to the block layer for this
    /// process (`/proc/self/io`), commits on every connection of `spool`,
    /// checkpoints, and what follows per hour, per reading and per day.
    /// `appended`: readings appended this run; `full_commits`: commits on a
    /// `synchronous = FULL` connection (each an fsync).
    pub fn write_record(
        &self,
        now: Instant,
        spool: &Spool,
        appended: u64,
        full_commits: u64,
    ) -> serde_json::Value {
        let (since, bytes0) = self.wear.since;
        let bytes = proc_write_bytes().unwrap_or(bytes0).saturating_sub(bytes0);
        let elapsed = now.saturating_duration_since(since);
        let commits = spool.wal().commits();
        let checkpoints = self.checkpoints();
        // synchronous=NORMAL fsyncs only at checkpoints (the WAL, then the
        // database: https://www.sqlite.org/wal.html#sync); FULL at every commit.
        let fsyncs = 2 * checkpoints + full_commits;
        let per_hour = |n: u64| per_hour(n, elapsed);
        let readings = appended.max(1);
        let budget = &self.wear.budget;
        serde_json::json!({
            "window_secs": elapsed.as_secs(),
            "write_bytes_total": bytes,
            "write_bytes_per_hour": per_hour(bytes),
            "commits_total": commits,
            "commits_per_hour": per_hour(commits),
            "checkpoints_total": checkpoints,
            "checkpoints_per_hour": per_hour(checkpoints),
            "fsyncs_estimated_total": fsyncs,
            "fsyncs_estimated_per_hour": per_hour(fsyncs),
            "readings_total": appended,
            "bytes_per_reading": bytes / readings,
            "projected_mb_per_day": per_hour(bytes) as f64 * 24.0 / 1e6,
            "commit_window_ms": self.window().as_millis() as u64,
            "commit_window_max_ms": budget.largest().as_millis() as u64,
            "checkpoint_interval_secs": self.checkpoint_interval().as_secs(),
            "budget_mb_per_day": budget.settings().bytes_per_day.map(|b| b / 1_000_000),
            "budget_projected_mb_per_day": budget.projected_mb_per_day(),
            "over_budget": budget.verdict() != &Verdict::Within,
            "wal_file_bytes": std::fs::metadata(crate::spool::wal_path(&self.path))
                .map(|m| m.len())
                .unwrap_or(0),
        })
    }
}
