//! Retention and free pages: acknowledged rows deleted in bounded batches
//! with a checkpoint between them that starts the WAL over (F02), free
//! pages given back a step at a time, and the gate that holds both while a
//! reader keeps the WAL from starting over (F01 on top of F02).
//!
//! One rule: **only acknowledged rows go (I6)**, judged by the agent's own
//! clock: a wall clock stepped by more than
//! [`crate::flash::maintenance::CLOCK_STEP_MS`] moves nothing by itself.

use super::{Clock, Upkeep};
use crate::flash::maintenance::{bulk_gate, retention_now, BulkGate};
use crate::spool::{CheckpointMode, Spool};
use std::time::{Duration, Instant};

/// Longest the RESTART after a bulk step (a retention batch, a free-page
/// step) waits for readers to leave the WAL, holding new writers off
/// meanwhile, so the next step writes the WAL from its beginning. The copy
/// itself is done before, by a PASSIVE checkpoint that holds nobody off.
pub const RESET_WAIT: Duration = Duration::from_millis(50);
/// The same wait when a pass checks whether the reader that pinned the WAL
/// a bulk step left has gone.
pub const PIN_CHECK_WAIT: Duration = Duration::from_millis(10);
/// For this long after a pin began, the check runs at every quick pass
/// ([`super::AGAIN`]); past it, at the normal period, with one log line.
pub const PIN_QUICK_CHECKS: Duration = Duration::from_secs(2);
/// Free pages given back per pass (1 MiB of 4 KiB pages): one step is one
/// transaction, so this also bounds what it adds to the WAL.
pub const SHRINK_STEP_PAGES: u64 = 256;
/// Free pages are given back once they exceed the live data by this much.
const SHRINK_SLACK_BYTES: u64 = 8 * 1024 * 1024;
/// Sequence numbers reach `streams` at least every this many readings (a
/// restart reads the rows appended since the last persist).
const PERSIST_SEQS_EVERY: u64 = 10_000;

/// What the upkeep keeps about retention and bulk steps.
#[derive(Debug)]
pub(super) struct Retention {
    /// When retention last ran (it runs with the checkpoint cadence).
    at: Option<Instant>,
    /// The last pass left retention or space to give back for the next one.
    pub(super) more_work: bool,
    /// Since when a reader has kept the WAL a bulk step left from starting
    /// over, and whether that was logged; further bulk steps wait.
    pub(super) bulk_pinned: Option<(Instant, bool)>,
    /// Wall clock and monotonic clock at start, to notice clock steps.
    wall_anchor: (i64, Instant),
    clock_step_logged: bool,
}

impl Retention {
    pub(super) fn new(now: Instant, wall_ms: i64) -> Retention {
        Retention {
            at: None,
            more_work: false,
            bulk_pinned: None,
            wall_anchor: (wall_ms, now),
            clock_step_logged: false,
        }
    }
}

impl Upkeep {
    /// Retention, when due: it rides with the checkpoint cadence (issue 23:
    /// at every pass it was a commit, and a checkpoint, every 5 s once rows
    /// began to age out), sooner only while a pass left work over. While a
    /// reader pins the WAL the last bulk step left, every pass (at the
    /// normal period) checks whether it has gone. Returns the rows deleted.
    pub(super) fn retain_if_due(
        &mut self,
        spool: &mut Spool,
        clock: &Clock,
        wall_ms: i64,
    ) -> usize {
        let cutoff = self.retention_cutoff(clock.at, wall_ms);
        let r = &self.retention;
        let interval = self.checkpoint_interval();
        let due = r.more_work
            || r.bulk_pinned.is_some()
            || r.at
                .is_none_or(|t| clock.now().saturating_duration_since(t) >= interval);
        self.retention.more_work = false;
        if !due || !self.bulk_step_allowed(spool, clock) {
            return 0;
        }
        self.retention.at = Some(clock.now());
        let purged = self.retain(spool, cutoff, clock);
        if purged > 0 {
            log::debug!("retention: deleted {purged} acknowledged rows");
        }
        purged
    }

    /// Rows appended before this wall time (ms) and acknowledged may go:
    /// `acked_retention` before now, where now is the wall clock unless it
    /// stepped away from the time at start plus the monotonic time since.
    fn retention_cutoff(&mut self, now: Instant, wall_ms: i64) -> i64 {
        let r = &mut self.retention;
        let (anchor_wall, anchor_mono) = r.wall_anchor;
        let expected = anchor_wall + now.saturating_duration_since(anchor_mono).as_millis() as i64;
        let judged = retention_now(wall_ms, expected);
        if judged != wall_ms && !r.clock_step_logged {
            log::warn!(
                "wall clock stepped by {} s since start; retention keeps judging ages by monotonic time",
                (wall_ms - expected) / 1000
            );
            r.clock_step_logged = true;
        }
        judged - self.settings.acked_retention.as_millis() as i64
    }

    /// Delete acknowledged rows appended before `cutoff` in batches, a
    /// checkpoint between full batches that starts the WAL over (F02); a
    /// reader still in the WAL stops the pass there. A pass starts batches
    /// for at most about [`super::PASS_BUDGET`] of work (each holds the
    /// write lock, and so does the wait for readers after it, up to
    /// [`RESET_WAIT`]; the delivery thread's commits wait behind both); what
    /// is left is done at the next pass, which then comes sooner.
    fn retain(&mut self, spool: &mut Spool, cutoff: i64, clock: &Clock) -> usize {
        let started = clock.spent();
        let mut purged = 0;
        loop {
            if clock.spent().saturating_sub(started) >= super::PASS_BUDGET {
                self.retention.more_work = true;
                return purged;
            }
            let batch = self.settings.purge_batch_rows;
            match spool.purge_acked_at(cutoff, batch, clock_now()) {
                Ok(n) => {
                    purged += n;
                    if n < batch {
                        // The last batch: the checkpoint policy copies it.
                        return purged;
                    }
                    // More may follow: copy this batch back and start the
                    // WAL over before the next one (F02); a reader still in
                    // it holds the rest until it leaves.
                    if !self.reset_after_bulk_step(spool, clock) {
                        // Checked again soon: most pins are a read ending.
                        self.retention.more_work = true;
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

    /// Whether a bulk step (a retention batch, a free-page step) may write
    /// now ([`bulk_gate`]). While a reader pins the WAL the last one left, a
    /// check copies what it can (PASSIVE), then waits at most
    /// [`PIN_CHECK_WAIT`] for readers to leave (RESTART), at every quick pass
    /// for [`PIN_QUICK_CHECKS`], then at the normal period. Neither is
    /// recorded as a checkpoint outcome: health and `wal_checkpoint_blocked`
    /// keep judging the policy's own checkpoints.
    fn bulk_step_allowed(&mut self, spool: &Spool, clock: &Clock) -> bool {
        let now = clock.now();
        let pinned_for = self
            .retention
            .bulk_pinned
            .map(|(t, _)| now.saturating_duration_since(t));
        let interval = self.checkpoint_interval();
        let go = match bulk_gate(pinned_for, interval) {
            BulkGate::Go => return true,
            BulkGate::Anyway => true,
            BulkGate::IfReaderLeft => {
                // The copy without holding writers off first; the RESTART
                // judges (it also waits for a reader on an older snapshot).
                let _ = spool.checkpoint(CheckpointMode::Passive);
                readers_left_wal(spool, PIN_CHECK_WAIT)
            }
        };
        let long = pinned_for.is_some_and(|d| d >= PIN_QUICK_CHECKS);
        let r = &mut self.retention;
        match r.bulk_pinned {
            _ if go => r.bulk_pinned = None,
            // A short read (status, a one-off query) ends soon: look again
            // at the next quick pass.
            Some(_) if !long => r.more_work = true,
            Some((since, false)) => {
                log::info!(
                    "retention and free-page steps held: the spool's WAL cannot start over (most often another process's read transaction: status, a backup, the sqlite3 shell); they resume when it can, or one step every {} s",
                    interval.as_secs()
                );
                r.bulk_pinned = Some((since, true));
            }
            _ => {}
        }
        go
    }

    /// After a bulk step: copy it back (PASSIVE, recorded like every policy
    /// checkpoint), then wait at most [`RESET_WAIT`] for readers to leave
    /// the WAL (RESTART, which first copies what the PASSIVE could not) so
    /// the next write starts it from its beginning. False, and the pin
    /// noted for the bulk-step gate, when a reader stayed.
    fn reset_after_bulk_step(&mut self, spool: &mut Spool, clock: &Clock) -> bool {
        // A reader on an older snapshot leaves the PASSIVE short; the
        // RESTART waits for it too, then copies the rest.
        self.run_checkpoint(spool, CheckpointMode::Passive, 0, clock);
        let reset = readers_left_wal(spool, RESET_WAIT);
        if !reset {
            self.retention.bulk_pinned = Some((clock.now(), false));
        }
        reset
    }

    /// Sequence numbers reach `streams` every [`PERSIST_SEQS_EVERY`]
    /// readings here, and at the writer's summary interval (an append writes
    /// only its rows; a restart reads the rows appended since the last
    /// persist, so this bounds startup work).
    pub(super) fn persist_seqs_if_due(&mut self, spool: &mut Spool) {
        if spool.appended_since_persist() >= PERSIST_SEQS_EVERY {
            let _ = spool.persist_seqs();
        }
    }

    /// Give free pages back in a bounded step (at most [`SHRINK_STEP_PAGES`]
    /// a pass) once they exceed the live data plus 8 MiB, then copy the
    /// moved pages back and start the WAL over (issue: the spool gives space
    /// back). The caller skips it while the last bulk step's WAL is pinned.
    pub(super) fn shrink_step(&mut self, spool: &mut Spool, clock: &Clock) {
        match spool.shrink_step(SHRINK_SLACK_BYTES, SHRINK_STEP_PAGES) {
            Ok(0) => {}
            Ok(n) => {
                log::debug!("spool: gave {n} free pages back to the filesystem");
                self.retention.more_work = n >= SHRINK_STEP_PAGES;
                // The moved pages go to the database now, one step at a time.
                if !self.reset_after_bulk_step(spool, clock) {
                    // The check comes at the quick pass, as after a batch.
                    self.retention.more_work = true;
                }
            }
            Err(e) => {
                if self.checkpoints.errors.due(clock.now()) {
                    log::warn!("incremental vacuum skipped: {e}");
                }
            }
        }
    }
}

/// A RESTART checkpoint waiting at most `wait`: true when every reader has
/// left the WAL, so the next write starts it from its beginning. Not
/// recorded as a checkpoint outcome.
fn readers_left_wal(spool: &Spool, wait: Duration) -> bool {
    matches!(
        spool.checkpoint_within(CheckpointMode::Restart, wait),
        Ok(r) if r.busy == 0 && r.checkpointed_frames == r.log_frames
    )
}

/// Whether the wall clock now is still the unset one (before the floor,
/// `CLOCK_FLOOR_MS`: a board without RTC that has not been set), so an open
/// clock span's rows may age by it ([`Spool::purge_acked_at`]). A clock past
/// the floor is `Settled` here whatever the kernel says of time sync: it
/// may have been stepped (`date -s`, a GPS or modem script) without time
/// sync ever vouching for it, and the 1970 rows would then read 56 years
/// old (found by a review: 99 of 100 such rows purged within 40 s), so an
/// open span holds them until a commit with a vouched-for clock closes it.
fn clock_now() -> crate::spool::WallClock {
    match crate::event::envelope::wall_clock_ms().1 {
        true => crate::spool::WallClock::Settled,
        false => crate::spool::WallClock::Unsettled,
    }
}
