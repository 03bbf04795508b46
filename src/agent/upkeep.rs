//! Upkeep between commits: retention of acknowledged rows in bounded
//! batches with a checkpoint between them (F02), the checkpoint policy and
//! its outcome (a reader pinning the WAL is noticed, F01), sequence numbers
//! persisted, free pages given back, and the spool file's identity checked.
//!
//! One rule: a pass holds the write lock for a bounded time; what is left
//! goes to the next pass, which then comes sooner.

use super::{Ingest, Upkeep, WAL_FRAME_BYTES};
use crate::event::envelope::wall_clock_ms;
use crate::spool::CheckpointMode;
use std::path::Path;
use std::time::{Duration, Instant};

/// Longest a maintenance pass keeps deleting (each batch holds the write
/// lock; the delivery thread's commits wait behind it).
pub(super) const MAINTENANCE_BUDGET: Duration = Duration::from_millis(100);
/// The next pass when the last one left work over.
pub(super) const MAINTENANCE_AGAIN: Duration = Duration::from_millis(250);
/// Longest the RESTART after a bulk step (a retention batch, a free-page
/// step) waits for readers to leave the WAL, holding new writers off
/// meanwhile, so the next step writes the WAL from its beginning. The copy
/// itself is done before, by a PASSIVE checkpoint that holds nobody off.
pub(super) const RESET_WAIT: Duration = Duration::from_millis(50);
/// The same wait when a pass checks whether the reader that pinned the WAL
/// a bulk step left has gone ([`Ingest::bulk_step_allowed`]).
pub(super) const PIN_CHECK_WAIT: Duration = Duration::from_millis(10);
/// For this long after a pin began, the check runs at every quick pass
/// ([`MAINTENANCE_AGAIN`]); past it, at the normal period, with one log line.
pub(super) const PIN_QUICK_CHECKS: Duration = Duration::from_secs(2);
/// Free pages given back per pass (1 MiB of 4 KiB pages): one step is one
/// transaction, so this also bounds what it adds to the WAL.
pub(super) const SHRINK_STEP_PAGES: u64 = 256;

impl Upkeep {
    pub(super) fn new(spool: &Path, verdict: Option<crate::spool::integrity::Verdict>) -> Upkeep {
        Upkeep {
            identity: crate::flash::maintenance::file_identity(spool),
            shm: crate::flash::maintenance::file_identity(&crate::spool::shm_path(spool)),
            shm_warned: None,
            fatal: None,
            verdict,
            damaged: false,
            last_checkpoint: Instant::now(),
            last_checkpoint_json: None,
            checkpoints: 0,
            seqs_persisted: Instant::now(),
            health_kinds: Vec::new(),
            health_stored_at: None,
            health_record: None,
            health_since: wall_clock_ms().0,
            buffer_drops: 0,
            more_work: false,
            capacity_checked: None,
            refusal: None,
            checkpoint_blocked: false,
            incomplete_run: None,
            bulk_pinned: None,
            budget_since: (
                Instant::now(),
                crate::flash::maintenance::proc_write_bytes().unwrap_or(0),
            ),
            full_commits: 0,
            last_refusal_log: None,
            last_checkpoint_error: None,
            disk_full: false,
            wall_anchor: (wall_clock_ms().0, Instant::now()),
            clock_step_logged: false,
            ingest_socket_taken: None,
            reading_bytes: 512,
        }
    }
}

impl Ingest {
    /// Retention in bounded batches with a checkpoint between them (F02), the
    /// checkpoint policy, the spool-file identity check, and the health and
    /// write-budget record for `status`.
    pub(super) fn maintain(&mut self) {
        let found = self
            .upkeep
            .verdict
            .as_ref()
            .and_then(|v| v.lock().unwrap_or_else(|p| p.into_inner()).clone());
        if let Some(damage) = found {
            let msg = format!(
                "spool {} is damaged ({damage}); stopping to move it aside and start a fresh spool",
                self.cfg.spool.path.display()
            );
            log::error!("{msg}");
            self.upkeep.fatal = Some(msg);
            self.upkeep.damaged = true;
            return;
        }
        if let Some(id) = self.upkeep.identity {
            if crate::flash::maintenance::file_identity(&self.cfg.spool.path) != Some(id) {
                let msg = format!(
                    "spool {} was removed or replaced under the running agent; stopping without claiming durability (the supervisor restarts a clean process)",
                    self.cfg.spool.path.display()
                );
                log::error!("{msg}");
                self.upkeep.fatal = Some(msg);
                return;
            }
        }
        self.check_shm();
        let retention_ms = self.cfg.spool.acked_retention.as_millis() as i64;
        let (anchor_wall, anchor_mono) = self.upkeep.wall_anchor;
        let expected = anchor_wall + anchor_mono.elapsed().as_millis() as i64;
        let wall = wall_clock_ms().0;
        let now = crate::flash::maintenance::retention_now(wall, expected);
        if now != wall && !self.upkeep.clock_step_logged {
            log::warn!(
                "wall clock stepped by {} s since start; retention keeps judging ages by monotonic time",
                (wall - expected) / 1000
            );
            self.upkeep.clock_step_logged = true;
        }
        let cutoff = now - retention_ms;
        // Retention rides with the checkpoint cadence (issue 23: at every
        // pass it was a commit, and a checkpoint, every 5 s once rows began
        // to age out), sooner only while a pass left work over.
        // While a reader pins the WAL the last bulk step left, every pass
        // (at the normal period) checks whether it has gone.
        let retention_due = self.upkeep.more_work
            || self.upkeep.bulk_pinned.is_some()
            || self
                .retention_at
                .is_none_or(|t| t.elapsed() >= self.checkpoint_interval());
        self.upkeep.more_work = false;
        let purged = if retention_due && self.bulk_step_allowed() {
            self.retention_at = Some(Instant::now());
            self.retain(cutoff)
        } else {
            0
        };
        if purged > 0 {
            log::debug!("retention: deleted {purged} acknowledged rows");
        }
        self.persist_seqs_if_due();
        if !self.upkeep.more_work && self.upkeep.bulk_pinned.is_none() {
            self.shrink_step();
        }
        self.checkpoint_if_due();
        self.observe_budget();
        self.record_health();
        self.sample_outage();
    }

    /// The `-shm` file still the one opened (same device and inode). Every
    /// connection of this agent maps the WAL index it opened, unlinked or
    /// not, so removing the file breaks nothing here at once; but the next
    /// process to open the spool (`status`, a backup, a second agent) builds
    /// a fresh index that knows nothing of this one's WAL frames, and reads
    /// stale pages or, writing, damages the spool. A WARN names the file and
    /// that, once per change of what is at the path.
    fn check_shm(&mut self) {
        let Some(opened) = self.upkeep.shm else {
            return;
        };
        let shm = crate::spool::shm_path(&self.cfg.spool.path);
        let now = crate::flash::maintenance::file_identity(&shm);
        if now == Some(opened) || self.upkeep.shm_warned == Some(now) {
            return;
        }
        let what = if now.is_none() {
            "was removed"
        } else {
            "was replaced by another file"
        };
        log::warn!(
            "spool -shm file {} {what} under the running agent: this agent keeps the WAL index it mapped, but any other process that opens the spool now (status, a backup) builds a new one without this agent's WAL frames and can read stale data or, writing, damage the spool; stop the agent cleanly and start it again to rebuild the -shm safely",
            shm.display()
        );
        self.upkeep.shm_warned = Some(now);
    }

    /// Delete acknowledged rows appended before `cutoff` in batches, a
    /// checkpoint between full batches that starts the WAL over (F02;
    /// [`Ingest::reset_after_bulk_step`]); a reader still in the WAL stops
    /// the pass there. A pass starts batches for at most about
    /// [`MAINTENANCE_BUDGET`] (each holds the write lock, and so does the
    /// wait for readers after it, up to [`RESET_WAIT`]; the delivery
    /// thread's commits wait behind both); what is left is done at the next
    /// pass, which then comes sooner. Returns the rows deleted.
    fn retain(&mut self, cutoff: i64) -> usize {
        let started = Instant::now();
        let mut purged = 0;
        loop {
            if started.elapsed() >= MAINTENANCE_BUDGET {
                self.upkeep.more_work = true;
                return purged;
            }
            let batch = self.cfg.spool.purge_batch_rows;
            match self.spool.purge_acked(cutoff, batch) {
                Ok(n) => {
                    purged += n;
                    if n < batch {
                        // The last batch: the checkpoint policy copies it.
                        return purged;
                    }
                    // More may follow: copy this batch back and start the
                    // WAL over before the next one (F02); a reader still in
                    // it holds the rest until it leaves.
                    if !self.reset_after_bulk_step() {
                        // Checked again soon: most pins are a read ending.
                        self.upkeep.more_work = true;
                        return purged;
                    }
                }
                Err(e) => {
                    log::warn!("retention skipped: {e}");
                    return purged;
                }
            }
        }
    }

    /// Feed the write budget what this process wrote and appended, and put
    /// the window it chooses in force for the next commit window of every
    /// thread ([`crate::flash::write_budget`]). Without a budget the window stays.
    pub(super) fn observe_budget(&mut self) {
        let Some(write_bytes) = crate::flash::maintenance::proc_write_bytes() else {
            return;
        };
        if !self.buffer.is_empty() {
            self.upkeep.reading_bytes = self.buffered_bytes / self.buffer.len();
        }
        let m = crate::flash::write_budget::Measured {
            write_bytes,
            readings: self.appended,
            bound_readings: super::MAX_BUFFERED,
            bound_bytes: self.max_buffered_bytes(),
            bytes_per_reading: self.upkeep.reading_bytes,
        };
        let before = self.budget.window();
        if !self.budget.observe(Instant::now(), &m) {
            return;
        }
        let after = self.budget.window();
        self.window.set(after);
        log::info!(
            "write budget: projected {:.0} MB/day at a {} ms commit window (budget {} MB/day): commit window now {} ms, time-driven checkpoints every {} s",
            self.budget.projected_mb_per_day().unwrap_or(0.0),
            before.as_millis(),
            self.cfg.spool.write_budget_bytes_per_day.unwrap_or(0) / 1_000_000,
            after.as_millis(),
            self.checkpoint_interval().as_secs()
        );
    }

    /// Run the checkpoint the policy asks for now, and record the outcome
    /// in memory (written to `agent_state` at the summary interval, not with
    /// a commit of its own each time).
    pub(super) fn checkpoint_if_due(&mut self) {
        let written = self.spool.wal().frames_since_checkpoint() * WAL_FRAME_BYTES;
        let inputs = crate::flash::maintenance::CheckpointInputs {
            written_bytes: written,
            threshold_bytes: self.cfg.spool.checkpoint_wal_bytes,
            since_last: self.upkeep.last_checkpoint.elapsed(),
            interval: self.checkpoint_interval(),
        };
        let Some(mode) = crate::flash::maintenance::checkpoint_due(&inputs) else {
            return;
        };
        self.run_checkpoint(mode, written);
    }

    /// The time-driven checkpoint interval now: `spool.checkpoint_interval_secs`,
    /// stretched to follow a wide commit window
    /// ([`crate::flash::write_budget::checkpoint_interval`]).
    pub(super) fn checkpoint_interval(&self) -> Duration {
        crate::flash::write_budget::checkpoint_interval(
            self.cfg.spool.checkpoint_interval,
            self.window.get(),
        )
    }

    /// Whether a bulk step (a retention batch, a free-page step) may write
    /// now ([`crate::flash::maintenance::bulk_gate`]). While a reader pins the WAL
    /// the last one left, a check copies what it can (PASSIVE), then waits
    /// at most [`PIN_CHECK_WAIT`] for readers to leave (RESTART), at every
    /// quick pass for [`PIN_QUICK_CHECKS`], then at the normal period.
    /// Neither is recorded as a checkpoint outcome: health and
    /// `wal_checkpoint_blocked` keep judging the policy's own checkpoints.
    pub(super) fn bulk_step_allowed(&mut self) -> bool {
        let pinned_for = self.upkeep.bulk_pinned.map(|(t, _)| t.elapsed());
        let interval = self.checkpoint_interval();
        let go = match crate::flash::maintenance::bulk_gate(pinned_for, interval) {
            crate::flash::maintenance::BulkGate::Go => return true,
            crate::flash::maintenance::BulkGate::Anyway => true,
            crate::flash::maintenance::BulkGate::IfReaderLeft => {
                // The copy without holding writers off first; the RESTART
                // judges (it also waits for a reader on an older snapshot).
                let _ = self.spool.checkpoint(CheckpointMode::Passive);
                self.readers_left_wal(PIN_CHECK_WAIT)
            }
        };
        let long = pinned_for.is_some_and(|d| d >= PIN_QUICK_CHECKS);
        match self.upkeep.bulk_pinned {
            _ if go => self.upkeep.bulk_pinned = None,
            // A short read (status, a one-off query) ends soon: look again
            // at the next quick pass.
            Some(_) if !long => self.upkeep.more_work = true,
            Some((since, false)) => {
                log::info!(
                    "retention and free-page steps held: the spool's WAL cannot start over (most often another process's read transaction: status, a backup, the sqlite3 shell); they resume when it can, or one step every {} s",
                    interval.as_secs()
                );
                self.upkeep.bulk_pinned = Some((since, true));
            }
            _ => {}
        }
        go
    }

    /// After a bulk step: copy it back (PASSIVE, recorded like every policy
    /// checkpoint), then wait at most [`RESET_WAIT`] for readers to leave
    /// the WAL (RESTART, which first copies what the PASSIVE could not) so
    /// the next write starts it from its beginning. False, and the pin
    /// noted for [`Ingest::bulk_step_allowed`], when a reader stayed.
    fn reset_after_bulk_step(&mut self) -> bool {
        // A reader on an older snapshot leaves the PASSIVE short; the
        // RESTART waits for it too, then copies the rest.
        self.run_checkpoint(CheckpointMode::Passive, 0);
        let reset = self.readers_left_wal(RESET_WAIT);
        if !reset {
            self.upkeep.bulk_pinned = Some((Instant::now(), false));
        }
        reset
    }

    /// A RESTART checkpoint waiting at most `wait`: true when every reader
    /// has left the WAL, so the next write starts it from its beginning.
    /// Not recorded as a checkpoint outcome.
    fn readers_left_wal(&self, wait: Duration) -> bool {
        matches!(
            self.spool.checkpoint_within(CheckpointMode::Restart, wait),
            Ok(r) if r.busy == 0 && r.checkpointed_frames == r.log_frames
        )
    }

    /// Run the checkpoint `mode` and record its outcome (in memory, for
    /// `status` and health).
    pub(super) fn run_checkpoint(&mut self, mode: CheckpointMode, written: u64) {
        let wal = std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let t = Instant::now();
        let res = self.spool.checkpoint(mode);
        let took = t.elapsed();
        self.upkeep.last_checkpoint = Instant::now();
        self.upkeep.checkpoints += 1;
        let now = wall_clock_ms().0;
        match res {
            Ok(r) => {
                let incomplete = r.busy != 0 || r.checkpointed_frames < r.log_frames;
                // One incomplete PASSIVE is routine (the delivery thread was
                // mid-read); a reader pins the WAL when several in a row,
                // over seconds, cannot finish.
                let (first, n) = match (incomplete, self.upkeep.incomplete_run) {
                    (false, _) => (Instant::now(), 0),
                    (true, Some((t, n))) => (t, n + 1),
                    (true, None) => (Instant::now(), 1),
                };
                self.upkeep.incomplete_run = incomplete.then_some((first, n));
                let blocked = n >= 3 && first.elapsed() >= Duration::from_secs(2);
                self.upkeep.last_checkpoint_json = Some(
                    serde_json::json!({"mode": format!("{mode:?}").to_lowercase(), "busy": r.busy,
                    "log_frames": r.log_frames, "checkpointed_frames": r.checkpointed_frames,
                    "written_bytes_before": written, "wal_file_bytes_before": wal,
                    "duration_ms": took.as_millis() as u64, "at_ms": now}),
                );
                if blocked {
                    let _ = self.spool.count("wal_checkpoint_blocked", 1);
                    if !self.upkeep.checkpoint_blocked {
                        log::warn!("checkpoint {mode:?} blocked: busy={} log={} checkpointed={} wal_bytes={wal}: a reader is pinning the WAL; health degraded", r.busy, r.log_frames, r.checkpointed_frames);
                    }
                } else if self.upkeep.checkpoint_blocked {
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
                self.upkeep.checkpoint_blocked = blocked;
            }
            Err(e) => {
                if self
                    .upkeep
                    .last_checkpoint_error
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::warn!(
                        "checkpoint {mode:?} failed: {e} (skipped; repeats logged every 30 s)"
                    );
                    self.upkeep.last_checkpoint_error = Some(Instant::now());
                }
            }
        }
    }

    /// Sequence numbers reach `streams` every 10,000 readings here, and at
    /// the summary interval ([`Ingest::summary`]) (an append writes only its
    /// rows; a restart reads the rows appended since the last persist, so
    /// this bounds startup work).
    pub(super) fn persist_seqs_if_due(&mut self) {
        let due = self.spool.appended_since_persist() >= 10_000;
        if due && self.spool.persist_seqs().is_ok() {
            self.upkeep.seqs_persisted = Instant::now();
        }
    }

    /// Give free pages back in a bounded step (at most
    /// [`SHRINK_STEP_PAGES`] a pass) once they exceed the live data plus 8 MiB, then copy the moved pages back
    /// and start the WAL over (issue: the spool gives space back). The
    /// caller skips it while the last bulk step's WAL is pinned
    /// ([`Ingest::bulk_step_allowed`]).
    pub(super) fn shrink_step(&mut self) {
        match self.spool.shrink_step(8 * 1024 * 1024, SHRINK_STEP_PAGES) {
            Ok(0) => {}
            Ok(n) => {
                log::debug!("spool: gave {n} free pages back to the filesystem");
                self.upkeep.more_work = n >= SHRINK_STEP_PAGES;
                // The moved pages go to the database now, one step at a time.
                if !self.reset_after_bulk_step() {
                    // The check comes at the quick pass, as after a batch.
                    self.upkeep.more_work = true;
                }
            }
            Err(e) => {
                if self
                    .upkeep
                    .last_checkpoint_error
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::warn!("incremental vacuum skipped: {e}");
                    self.upkeep.last_checkpoint_error = Some(Instant::now());
                }
            }
        }
    }
}
