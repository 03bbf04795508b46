//! The storage upkeep of one spool file, as one type that owns its state:
//! retention of acknowledged rows in bounded batches with a checkpoint
//! between them (F02), the checkpoint policy and its outcome (a reader
//! pinning the WAL is noticed, F01), sequence numbers persisted, free pages
//! given back, the capacity checks and the refusal they lead to, a full disk
//! and the way back from it, the spool file's identity, and the write
//! budget's commit window (whose only holder it is).
//!
//! [`Upkeep`] is driven as mini-redis' `Db` (`purge_expired_keys`) and
//! litestream's `DB.monitor` are: one call a pass, [`Upkeep::tick`], with
//! the time passed in, returning what the writer needs (when to come back,
//! whether to stop, what the pass did); the commit path asks it before a
//! commit ([`Upkeep::admit`]) and tells it after one ([`Upkeep::committed`],
//! [`Upkeep::hit_disk_full`]). The decisions themselves are the pure
//! functions of [`super::maintenance`] and [`super::write_budget`]; this
//! module feeds them and keeps what they decided.
//!
//! Files: `checkpoints` (the policy's checkpoints and their record),
//! `retention` (retention, free pages, the bulk-step gate), `space`
//! (capacity, a full disk), `watch` (the file's identity, its `-shm`, the
//! background integrity check), `wear` (the write budget and the flash-write
//! record for `status`).
//!
//! One rule: **a pass holds the write lock for a bounded time**; what is
//! left goes to the next pass, which then comes sooner. Space is never
//! bought by deleting an unacknowledged row (I6).

mod checkpoints;
mod retention;
mod space;
mod watch;
mod wear;

pub use checkpoints::CheckpointOutcome;
pub use space::Refusing;
pub use watch::Fatal;
pub use wear::Load;

use super::maintenance::Capacity;
use super::write_budget::BudgetSettings;
use crate::spool::Spool;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes one WAL frame takes: a 4096-byte page and its 24-byte frame header
/// (<https://www.sqlite.org/fileformat.html#the_write_ahead_log>).
pub const WAL_FRAME_BYTES: u64 = 4096 + 24;
/// Longest a pass keeps deleting (each batch holds the write lock; the
/// delivery thread's commits wait behind it).
pub const PASS_BUDGET: Duration = Duration::from_millis(100);
/// The next pass when the last one left work over.
pub const AGAIN: Duration = Duration::from_millis(250);
/// The longest period between passes, whatever the checkpoint interval.
pub const MAX_PERIOD: Duration = Duration::from_secs(5);

/// The WAL brake for a checkpoint threshold of `checkpoint_wal_bytes`, in
/// frames ([`crate::spool::WalWatch::set_brake_frames`]). The brake fires
/// after the commit that crosses it, so it sits below twice the threshold
/// by about the largest transaction (a retention batch), which keeps the WAL
/// within twice the threshold.
pub fn brake_frames(checkpoint_wal_bytes: u64) -> i64 {
    (3 * checkpoint_wal_bytes / 2 / WAL_FRAME_BYTES) as i64
}

/// The upkeep's settings, from `[spool]` (`agent::startup::upkeep_settings` assembles them; flash
/// owns their shape). All but the file apply live ([`Upkeep::reconfigure`]).
#[derive(Debug, Clone, PartialEq)]
pub struct UpkeepSettings {
    /// `acked_retention_secs`: acknowledged rows appended longer ago go.
    pub acked_retention: Duration,
    /// `purge_batch_rows`: rows deleted per retention transaction.
    pub purge_batch_rows: usize,
    /// `checkpoint_interval_secs`: the PASSIVE checkpoint cadence (a wide
    /// commit window stretches it, [`super::write_budget::checkpoint_interval`]).
    pub checkpoint_interval: Duration,
    /// `checkpoint_wal_bytes`: a PASSIVE checkpoint once this much is written.
    pub checkpoint_wal_bytes: u64,
    /// `max_bytes` / `min_free_bytes`: when new readings are refused.
    pub capacity: Capacity,
    /// The write budget and the commit window it starts from.
    pub budget: BudgetSettings,
}

/// What one pass ([`Upkeep::tick`]) did and asks of the writer.
#[derive(Debug, Clone, PartialEq)]
pub struct Pass {
    /// Come back after this long: [`AGAIN`] when the pass left work over
    /// (retention, free pages, a pinned WAL to look at), else the period.
    pub wake_in: Duration,
    /// Set when the writer must stop (exit non-zero; the supervisor restarts
    /// a clean process). The pass did nothing else.
    pub fatal: Option<Fatal>,
    /// Acknowledged rows retention deleted.
    pub purged: usize,
    /// The last checkpoint the policy ran in this pass, if any.
    pub checkpoint: Option<CheckpointOutcome>,
}

/// A pass's time: the `now` it was given, advanced by the real time the
/// pass's own work has taken since. A checkpoint is stamped when it ended
/// and a pass's deletions stop at [`PASS_BUDGET`] of real work, while a test
/// that passes an hour later sees an hour later.
#[derive(Debug, Clone, Copy)]
struct Clock {
    at: Instant,
    started: Instant,
}

impl Clock {
    fn start(at: Instant) -> Clock {
        Clock {
            at,
            started: Instant::now(),
        }
    }

    fn now(&self) -> Instant {
        self.at + self.started.elapsed()
    }

    /// Real time this pass has worked.
    fn spent(&self) -> Duration {
        self.started.elapsed()
    }
}

/// "Repeats logged every 30 s": true at most once per `every`.
#[derive(Debug, Clone, Copy)]
pub struct LogEvery {
    every: Duration,
    last: Option<Instant>,
}

impl LogEvery {
    /// A gate that opens at most once per `every`.
    pub const fn new(every: Duration) -> LogEvery {
        LogEvery { every, last: None }
    }

    /// Whether to log now; notes the line as logged when it says so.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) > self.every);
        if due {
            self.last = Some(now);
        }
        due
    }
}

/// The storage upkeep of one spool file ([`self`]).
#[derive(Debug)]
pub struct Upkeep {
    /// The spool file.
    path: PathBuf,
    settings: UpkeepSettings,
    watch: watch::Watch,
    retention: retention::Retention,
    checkpoints: checkpoints::Checkpoints,
    space: space::Space,
    wear: wear::Wear,
}

impl Upkeep {
    /// The upkeep of the spool at `path` (already open: its identity and its
    /// `-shm`'s are taken now), at monotonic `now` and wall clock `wall_ms`
    /// (retention judges ages against both, so a stepped wall clock moves
    /// nothing by itself).
    pub fn new(path: &Path, settings: UpkeepSettings, now: Instant, wall_ms: i64) -> Upkeep {
        Upkeep {
            path: path.to_path_buf(),
            watch: watch::Watch::new(path),
            retention: retention::Retention::new(now, wall_ms),
            checkpoints: checkpoints::Checkpoints::new(now),
            space: space::Space::default(),
            wear: wear::Wear::new(settings.budget, now),
            settings,
        }
    }

    /// Stop at the next pass when the background integrity check `verdict`
    /// finds the file damaged ([`crate::spool::integrity::spawn_check`]).
    pub fn watch_integrity(&mut self, verdict: crate::spool::integrity::Verdict) {
        self.watch.verdict = Some(verdict);
    }

    /// One pass at `now` (monotonic) and `wall_ms` (the wall clock): the
    /// file's identity and the integrity check, retention in bounded batches
    /// with a checkpoint between them (F02), sequence numbers persisted, a
    /// step of free pages given back, the checkpoint the policy asks for,
    /// and the write budget's span boundaries. A fatal finding stops the
    /// pass there.
    pub fn tick(&mut self, spool: &mut Spool, now: Instant, wall_ms: i64, load: &Load) -> Pass {
        let clock = Clock::start(now);
        let mut pass = Pass {
            wake_in: self.period(),
            fatal: self.watch.fatal(&self.path),
            purged: 0,
            checkpoint: None,
        };
        if pass.fatal.is_some() {
            return pass;
        }
        self.watch.check_shm(&self.path);
        pass.purged = self.retain_if_due(spool, &clock, wall_ms);
        self.persist_seqs_if_due(spool);
        if !self.retention.more_work && self.retention.bulk_pinned.is_none() {
            self.shrink_step(spool, &clock);
        }
        self.note_load(load);
        pass.checkpoint = self.checkpoint_if_due(spool, &clock);
        self.mark_if_idle(spool, clock.now());
        if self.retention.more_work {
            pass.wake_in = AGAIN;
        }
        pass
    }

    /// After a commit of `rows` readings at `now`, with `taken` readings
    /// taken into the buffer this run so far (a running total): the
    /// checkpoint the policy asks for, if any.
    pub fn committed(
        &mut self,
        spool: &mut Spool,
        now: Instant,
        (rows, taken): (usize, u64),
    ) -> Option<CheckpointOutcome> {
        self.note_appended(rows, taken);
        self.checkpoint_if_due(spool, &Clock::start(now))
    }

    /// New settings (a config reload), applied live: the checks against the
    /// capacity start over when it changes, the WAL brake follows the
    /// checkpoint threshold, and the commit window starts again from the
    /// configured one when the window or the budget changes. Returns what
    /// changed, in `apply-config`'s words.
    pub fn reconfigure(&mut self, new: UpkeepSettings, spool: &Spool) -> Vec<&'static str> {
        let mut applied = Vec::new();
        let cur = &self.settings;
        if (
            new.budget.base_window,
            new.acked_retention,
            new.purge_batch_rows,
            new.checkpoint_interval,
        ) != (
            cur.budget.base_window,
            cur.acked_retention,
            cur.purge_batch_rows,
            cur.checkpoint_interval,
        ) {
            applied.push("spool (commit window, retention, checkpoints)");
        }
        if (new.capacity, new.checkpoint_wal_bytes) != (cur.capacity, cur.checkpoint_wal_bytes) {
            self.space.checked = None;
            spool
                .wal()
                .set_brake_frames(brake_frames(new.checkpoint_wal_bytes));
            applied.push("spool (capacity, checkpoint threshold)");
        }
        let budget = self.wear.budget.settings();
        if new.budget != budget {
            if (new.budget.bytes_per_day, new.budget.max_window)
                != (budget.bytes_per_day, budget.max_window)
            {
                applied.push("spool (write budget)");
            }
            self.wear.budget.reconfigure(new.budget);
        }
        self.settings = new;
        applied
    }

    /// The settings in force.
    pub fn settings(&self) -> &UpkeepSettings {
        &self.settings
    }

    /// How often a pass runs when none left work over: the checkpoint
    /// interval, at most [`MAX_PERIOD`].
    pub fn period(&self) -> Duration {
        self.settings.checkpoint_interval.min(MAX_PERIOD)
    }

    /// The commit window in force (the write budget's choice, or the
    /// configured one).
    pub fn window(&self) -> Duration {
        self.wear.budget.window()
    }

    /// The time-driven checkpoint interval now: `checkpoint_interval`,
    /// stretched to follow a wide commit window
    /// ([`super::write_budget::checkpoint_interval`]).
    pub fn checkpoint_interval(&self) -> Duration {
        super::write_budget::checkpoint_interval(self.settings.checkpoint_interval, self.window())
    }

    /// A wide window stretched the checkpoint interval past the configured
    /// one: the WAL's only sync under `synchronous = NORMAL` comes that much
    /// later, so a batched commit syncs the WAL itself.
    pub fn checkpoint_stretched(&self) -> bool {
        self.checkpoint_interval() > self.settings.checkpoint_interval
    }
}

#[cfg(test)]
mod tests;
