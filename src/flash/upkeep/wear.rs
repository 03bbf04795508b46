//! Flash wear: the write budget told what this process wrote and appended
//! at each checkpoint (it chooses the commit window and makes the one
//! projection of MB/day, [`crate::flash::write_budget`]), and the record of
//! what the run has cost the flash, for `status`.
//!
//! One rule: the commit window in force has **one holder**, the budget's
//! [`Controller`]; every commit of the writer reads it through
//! [`super::Upkeep::window`] (delivery records ride those commits).

use super::Upkeep;
use crate::flash::maintenance::per_hour;
use crate::flash::write_budget::{BudgetSettings, BufferBound, Controller, Mark, Verdict};
use crate::os::proc_io::proc_write_bytes;
use crate::spool::Spool;
use std::time::Instant;

/// What the writer holds, for the write budget's bound on the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Readings appended this run (batched and full), a running total.
    pub appended: u64,
    /// Readings taken into the buffer this run (batched and full), a
    /// running total: the write budget's rate.
    pub taken: u64,
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
    /// Readings appended this run, as last told.
    appended: u64,
    /// Readings taken into the buffer this run, as last told.
    taken: u64,
    /// The buffer's bound as last told.
    bound: BufferBound,
    /// When the budget was last given a span boundary.
    marked: Option<Instant>,
}

impl Wear {
    pub(super) fn new(settings: BudgetSettings, now: Instant) -> Wear {
        Wear {
            budget: Controller::new(settings),
            since: (now, proc_write_bytes().unwrap_or(0)),
            appended: 0,
            taken: 0,
            bound: BufferBound {
                readings: usize::MAX,
                bytes: usize::MAX,
                bytes_per_reading: 512,
            },
            marked: None,
        }
    }
}

impl Upkeep {
    /// The write budget's verdict at its last decision (a health reason
    /// when over).
    pub fn budget_verdict(&self) -> &Verdict {
        self.wear.budget.verdict()
    }

    /// The projection of this process's flash writes, MB/day: the one
    /// figure `status`, health, the outage budget and the metrics show
    /// (None before the first span).
    pub fn projected_mb_per_day(&self) -> Option<f64> {
        self.wear.budget.projected_mb_per_day()
    }

    /// Readings appended this run (a running total), and the buffer as it
    /// stands, for the next span boundary.
    pub(super) fn note_load(&mut self, load: &Load) {
        let w = &mut self.wear;
        w.appended = w.appended.max(load.appended);
        w.taken = w.taken.max(load.taken);
        w.bound.readings = load.bound_readings;
        w.bound.bytes = load.bound_bytes;
        if let Some(mean) = load.buffered_bytes.checked_div(load.buffered) {
            w.bound.bytes_per_reading = mean;
        }
    }

    /// `rows` more readings were appended; `taken` were taken so far.
    pub(super) fn note_appended(&mut self, rows: usize, taken: u64) {
        self.wear.appended += rows as u64;
        self.wear.taken = self.wear.taken.max(taken);
    }

    /// A span boundary at `now` (a checkpoint ended, or an idle board went
    /// two checkpoint intervals without one): tell the write budget, and put
    /// the window it chooses in force for the next commit window.
    pub(super) fn mark_budget(&mut self, spool: &Spool, now: Instant) {
        let Some(write_bytes) = proc_write_bytes() else {
            return;
        };
        let w = &mut self.wear;
        w.marked = Some(now);
        let before = w.budget.window();
        let m = Mark {
            at: now,
            write_bytes,
            readings: w.appended,
            taken: w.taken,
            commits: spool.wal().commits(),
        };
        if !w.budget.mark(m, &w.bound) {
            return;
        }
        log::info!(
            "write budget: projected {:.0} MB/day at a {} ms commit window (budget {} MB/day): commit window now {} ms, time-driven checkpoints every {} s ({})",
            self.wear.budget.projected_mb_per_day().unwrap_or(0.0),
            before.as_millis(),
            self.wear.budget.settings().bytes_per_day.unwrap_or(0) / 1_000_000,
            self.wear.budget.window().as_millis(),
            self.checkpoint_interval().as_secs(),
            self.wear.budget.why(),
        );
    }

    /// At a pass: a board that wrote nothing for two checkpoint intervals
    /// has no checkpoint to close a span: the pass closes one.
    pub(super) fn mark_if_idle(&mut self, spool: &Spool, now: Instant) {
        let idle = self
            .wear
            .marked
            .is_none_or(|t| now.saturating_duration_since(t) >= 2 * self.checkpoint_interval());
        if idle {
            self.mark_budget(spool, now);
        }
    }

    /// What this run has cost the flash so far, for `status`
    /// (`write_budget`): bytes the kernel sent to the block layer for this
    /// process (`/proc/self/io`), commits on every connection of `spool`,
    /// checkpoints, per hour and per reading; the write budget's one
    /// projection of MB/day, the window in force and why. `appended`:
    /// readings appended this run; `full_commits`: commits on a
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
        let projection = budget.projection();
        let settings = budget.settings();
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
            "projected_mb_per_day": projection.map(|p| p.mb_per_day),
            "projected_at_window_ms": projection.map(|p| p.window.as_millis() as u64),
            "projected_over_secs": projection.map(|p| p.span.as_secs()),
            "commit_window_ms": self.window().as_millis() as u64,
            "commit_window_max_ms": budget.largest().as_millis() as u64,
            "commit_window_ceiling_ms": settings.max_window.as_millis() as u64,
            "commit_window_why": budget.why(),
            "checkpoint_interval_secs": self.checkpoint_interval().as_secs(),
            "budget_mb_per_day": settings.bytes_per_day.map(|b| b / 1_000_000),
            "over_budget": budget.verdict() != &Verdict::Within,
            "wal_file_bytes": std::fs::metadata(crate::spool::wal_path(&self.path))
                .map(|m| m.len())
                .unwrap_or(0),
        })
    }
}
