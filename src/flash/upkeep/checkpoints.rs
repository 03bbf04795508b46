//! The policy's checkpoints: run when [`checkpoint_due`] says, each outcome
//! recorded (busy, log and checkpointed frames, for `status`), and a reader
//! that keeps several in a row from finishing noticed as a pinned WAL (F01).
//!
//! One rule: a PASSIVE that could not finish is "skipped", not an error
//! (litestream's reading); only a run of them over seconds is a pin.

use super::{Clock, LogEvery, Upkeep, WAL_FRAME_BYTES};
use crate::flash::maintenance::{checkpoint_due, CheckpointInputs};
use crate::spool::{CheckpointMode, CheckpointResult, Spool};
use std::time::{Duration, Instant};

/// Incomplete checkpoints in a row, over at least [`PINNED_AFTER`], that
/// make a pinned WAL.
const PINNED_RUN: u32 = 3;
/// See [`PINNED_RUN`].
const PINNED_AFTER: Duration = Duration::from_secs(2);

/// What the upkeep keeps about its checkpoints.
#[derive(Debug)]
pub(super) struct Checkpoints {
    /// When the last one ended.
    last: Instant,
    /// The last one's outcome, for `status` (stored at the summary).
    record: Option<serde_json::Value>,
    /// Run since start.
    count: u64,
    /// Consecutive incomplete ones: since when, how many.
    incomplete_run: Option<(Instant, u32)>,
    /// A run of incomplete ones says a reader pins the WAL.
    blocked: bool,
    /// Failures (and failed free-page steps), logged every 30 s at most.
    pub(super) errors: LogEvery,
}

impl Checkpoints {
    pub(super) fn new(now: Instant) -> Checkpoints {
        Checkpoints {
            last: now,
            record: None,
            count: 0,
            incomplete_run: None,
            blocked: false,
            errors: LogEvery::new(Duration::from_secs(30)),
        }
    }

    /// Note an incomplete (or complete) checkpoint at `now`; true when the
    /// run of incomplete ones makes a pinned WAL. One incomplete PASSIVE is
    /// routine (the delivery thread was mid-read); a reader pins the WAL
    /// when several in a row, over seconds, cannot finish.
    fn note(&mut self, incomplete: bool, now: Instant) -> bool {
        let (first, n) = match (incomplete, self.incomplete_run) {
            (false, _) => (now, 0),
            (true, Some((t, n))) => (t, n + 1),
            (true, None) => (now, 1),
        };
        self.incomplete_run = incomplete.then_some((first, n));
        n >= PINNED_RUN && now.saturating_duration_since(first) >= PINNED_AFTER
    }
}

/// What one checkpoint of the policy did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointOutcome {
    /// The mode it ran in.
    pub mode: CheckpointMode,
    /// SQLite's answer; `None` when it failed (logged, skipped).
    pub result: Option<CheckpointResult>,
    /// A reader pins the WAL (health is degraded while it does).
    pub blocked: bool,
}

impl Upkeep {
    /// Checkpoints the policy ran since start.
    pub fn checkpoints(&self) -> u64 {
        self.checkpoints.count
    }

    /// The last checkpoint's outcome as `status` shows it
    /// (`last_checkpoint`): mode, busy, frames, the bytes before, duration.
    pub fn last_checkpoint(&self) -> Option<&serde_json::Value> {
        self.checkpoints.record.as_ref()
    }

    /// A run of checkpoints found the WAL pinned by a reader (F01).
    pub fn checkpoint_blocked(&self) -> bool {
        self.checkpoints.blocked
    }

    /// Run the checkpoint the policy asks for now, if any, and record it (in
    /// memory: written to `agent_state` at the summary interval, not with a
    /// commit of its own each time).
    pub(super) fn checkpoint_if_due(
        &mut self,
        spool: &mut Spool,
        clock: &Clock,
    ) -> Option<CheckpointOutcome> {
        let written = spool.wal().frames_since_checkpoint() * WAL_FRAME_BYTES;
        let inputs = CheckpointInputs {
            written_bytes: written,
            threshold_bytes: self.settings.checkpoint_wal_bytes,
            since_last: clock.now().saturating_duration_since(self.checkpoints.last),
            interval: self.checkpoint_interval(),
        };
        let mode = checkpoint_due(&inputs)?;
        Some(self.run_checkpoint(spool, mode, written, clock))
    }

    /// Run the checkpoint `mode` and record its outcome (for `status` and
    /// health). `written`: the bytes written since the last one, for the record.
    pub(super) fn run_checkpoint(
        &mut self,
        spool: &mut Spool,
        mode: CheckpointMode,
        written: u64,
        clock: &Clock,
    ) -> CheckpointOutcome {
        let wal = std::fs::metadata(crate::spool::wal_path(&self.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let t = Instant::now();
        let res = spool.checkpoint(mode);
        let took = t.elapsed();
        let now = clock.now();
        let c = &mut self.checkpoints;
        c.last = now;
        c.count += 1;
        let r = match res {
            Ok(r) => r,
            Err(e) => {
                if c.errors.due(now) {
                    log::warn!(
                        "checkpoint {mode:?} failed: {e} (skipped; repeats logged every 30 s)"
                    );
                }
                return CheckpointOutcome {
                    mode,
                    result: None,
                    blocked: c.blocked,
                };
            }
        };
        let blocked = c.note(r.busy != 0 || r.checkpointed_frames < r.log_frames, now);
        let at_ms = crate::event::envelope::wall_clock_ms().0;
        c.record = Some(
            serde_json::json!({"mode": format!("{mode:?}").to_lowercase(), "busy": r.busy,
            "log_frames": r.log_frames, "checkpointed_frames": r.checkpointed_frames,
            "written_bytes_before": written, "wal_file_bytes_before": wal,
            "duration_ms": took.as_millis() as u64, "at_ms": at_ms}),
        );
        if blocked {
            let _ = spool.count("wal_checkpoint_blocked", 1);
            if !c.blocked {
                log::warn!("checkpoint {mode:?} blocked: busy={} log={} checkpointed={} wal_bytes={wal}: a reader is pinning the WAL; health degraded", r.busy, r.log_frames, r.checkpointed_frames);
            }
        } else if c.blocked {
            log::info!(
                "checkpoint {mode:?} completed again (log={}); WAL no longer pinned",
                r.log_frames
            );
        } else {
            log::debug!(
                "checkpoint {mode:?}: log={} checkpointed={} in {} ms",
                r.log_frames,
                r.checkpointed_frames,
                took.as_millis()
            );
        }
        c.blocked = blocked;
        // A checkpoint closes a span of the write budget's measurement.
        self.mark_budget(spool, now);
        CheckpointOutcome {
            mode,
            result: Some(r),
            blocked,
        }
    }
}
