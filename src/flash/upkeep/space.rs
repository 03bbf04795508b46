//! Space: whether the spool takes new readings. The capacity policy
//! ([`capacity_check`]) is judged at most once a second, after the oldest
//! acknowledged rows were given up for room; after SQLITE_FULL nothing is
//! taken until a TRUNCATE checkpoint emptied the WAL and the filesystem has
//! headroom again.
//!
//! One rule: **space is never bought by deleting an unacknowledged row
//! (I6)**: new readings are refused by name instead, and taken again by
//! themselves once space returns.

use super::{Clock, LogEvery, Upkeep};
use crate::flash::maintenance::{capacity_check, fs_free_bytes, Refusal};
use crate::spool::{CheckpointMode, Spool};
use std::time::{Duration, Instant};

/// How long a capacity check's answer holds.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Batches of acknowledged rows a refusal gives up before it refuses.
const PURGE_BATCHES: usize = 4;
/// Free bytes the filesystem needs before readings are taken after a full
/// disk (or `min_free_bytes`, if larger).
const DISK_FULL_HEADROOM: u64 = 1024 * 1024;

/// Why the spool takes no readings now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusing {
    /// SQLITE_FULL was hit and the disk has not come back yet: drop the
    /// readings, counted as `readings_dropped_disk_full`.
    DiskFull,
    /// The capacity policy refuses: drop the readings, counted under the
    /// refusal's reason ([`Refusal::reason`]).
    Capacity(Refusal),
}

impl Refusing {
    /// Counter and log name of the reason (`readings_dropped_<reason>`).
    pub fn reason(&self) -> &'static str {
        match self {
            Refusing::DiskFull => "disk_full",
            Refusing::Capacity(r) => r.reason(),
        }
    }
}

/// What the upkeep keeps about space.
#[derive(Debug)]
pub(super) struct Space {
    /// Last capacity check (its answer holds [`CHECK_EVERY`]).
    pub(super) checked: Option<Instant>,
    /// The answer of the last capacity check.
    refusal: Option<Refusal>,
    /// SQLITE_FULL was hit; cleared once the disk has room again.
    disk_full: bool,
    /// Refusals, logged every 30 s at most.
    log: LogEvery,
}

impl Default for Space {
    fn default() -> Self {
        Space {
            checked: None,
            refusal: None,
            disk_full: false,
            log: LogEvery::new(Duration::from_secs(30)),
        }
    }
}

impl Upkeep {
    /// Before a commit at `now`: whether the spool takes readings, and if
    /// not, why. A full disk keeps refusing until it has recovered; the
    /// capacity policy is checked at most once a second.
    pub fn admit(&mut self, spool: &mut Spool, now: Instant) -> Option<Refusing> {
        let clock = Clock::start(now);
        if self.space.disk_full && !self.recovered_from_disk_full(spool) {
            return Some(Refusing::DiskFull);
        }
        self.capacity_refusal(spool, &clock).map(Refusing::Capacity)
    }

    /// A commit failed with SQLITE_FULL (its transaction rolled back):
    /// readings are refused until the disk has room again.
    pub fn hit_disk_full(&mut self) {
        self.space.disk_full = true;
        self.space.checked = None;
    }

    /// Whether a refusal at `now` is logged: every 30 s at most.
    pub fn refusal_log_due(&mut self, now: Instant) -> bool {
        self.space.log.due(now)
    }

    /// The capacity policy's last answer (`None`: within capacity).
    pub fn refusal(&self) -> Option<Refusal> {
        self.space.refusal
    }

    /// SQLITE_FULL was hit and the disk has not come back yet.
    pub fn disk_full(&self) -> bool {
        self.space.disk_full
    }

    /// Bytes the spool can hold now: the live data it has and the room
    /// left before the capacity policy refuses, the smaller of
    /// `spool.max_bytes` (0: no limit) and live data plus free pages plus
    /// the filesystem's free bytes above `spool.min_free_bytes`. The shares
    /// of local input are taken of it ([`crate::intake::share`]). `None`
    /// when the spool or the filesystem cannot be read.
    pub fn room(&self, spool: &Spool) -> Option<u64> {
        let (used, free_pages) = spool.usage().ok()?;
        let fs_free = fs_free_bytes(&self.dir()).ok()?;
        let cap = self.settings.capacity;
        let disk = used
            .saturating_add(free_pages)
            .saturating_add(fs_free)
            .saturating_sub(cap.min_free_bytes);
        Some(match cap.max_bytes {
            0 => disk,
            max => disk.min(max),
        })
    }

    /// Refuse new readings if the spool or the disk is at its limit, after
    /// dropping the oldest acknowledged rows first (I6: never an
    /// unacknowledged one). Checked at most once a second.
    fn capacity_refusal(&mut self, spool: &mut Spool, clock: &Clock) -> Option<Refusal> {
        let fresh = self
            .space
            .checked
            .is_some_and(|t| clock.now().saturating_duration_since(t) < CHECK_EVERY);
        if fresh {
            return self.space.refusal;
        }
        let cap = self.settings.capacity;
        let dir = self.dir();
        let check = |spool: &Spool| -> Option<Refusal> {
            let (used, free_pages) = spool.usage().ok()?;
            let fs_free = fs_free_bytes(&dir).ok()?;
            capacity_check(&cap, used, free_pages, fs_free)
        };
        let mut refusal = check(spool);
        if refusal.is_some() {
            // Policy: drop the oldest acknowledged rows first, in bounded batches.
            let mut purged = 0;
            for _ in 0..PURGE_BATCHES {
                match spool.purge_acked(i64::MAX, self.settings.purge_batch_rows) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => purged += n,
                }
            }
            if purged > 0 {
                log::warn!("capacity: dropped the {purged} oldest acknowledged rows to make room");
                let _ = spool.count("events_purged_for_space", purged as i64);
                refusal = check(spool);
            }
        }
        self.space.checked = Some(clock.now());
        if refusal.is_none() && self.space.refusal.is_some() {
            log::info!("capacity: space is back; taking readings again");
        }
        self.space.refusal = refusal;
        refusal
    }

    /// After SQLITE_FULL, readings stay off until a TRUNCATE checkpoint has
    /// emptied the WAL into the database and the filesystem has headroom
    /// again ([`DISK_FULL_HEADROOM`], or the configured reserve if larger);
    /// otherwise new appends would eat freed space before the checkpoint and
    /// delivery records that need it.
    fn recovered_from_disk_full(&mut self, spool: &Spool) -> bool {
        let headroom = self
            .settings
            .capacity
            .min_free_bytes
            .max(DISK_FULL_HEADROOM);
        let ok = matches!(spool.checkpoint(CheckpointMode::Truncate), Ok(r) if r.busy == 0)
            && fs_free_bytes(&self.dir()).is_ok_and(|f| f >= headroom);
        if ok {
            log::info!("disk has room again; taking readings again");
            self.space.disk_full = false;
            self.space.checked = None;
        }
        ok
    }

    /// The spool's directory (its filesystem's free space is the disk's).
    pub(super) fn dir(&self) -> std::path::PathBuf {
        self.path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map(std::path::Path::to_path_buf)
            .unwrap_or_else(|| ".".into())
    }
}
