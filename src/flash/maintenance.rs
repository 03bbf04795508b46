//! Maintenance policy for slow flash: checkpoint cadence, capacity and the
//! gate between retention batches (the write budget is
//! [`super::write_budget`], health is the agent's).
//!
//! Its one rule: **space is never bought by deleting an unacknowledged row
//! (I6)**: when the spool or the disk is short, new readings are refused by
//! an explicit policy (after dropping the oldest *acknowledged* rows) and
//! counted; everything resumes by itself when space returns.
//!
//! The decisions are pure functions of measured inputs, unit-tested here;
//! the reader of `statvfs(2)` they are fed from sits beside them
//! ([`fs_free_bytes`]); `/proc/self/io` is read in
//! [`crate::os::proc_io`].

use crate::spool::CheckpointMode;
use std::path::Path;
use std::time::Duration;

/// What the checkpoint policy looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckpointInputs {
    /// Bytes of WAL frames written since the last checkpoint copied them
    /// back ([`crate::spool::WalWatch::frames_since_checkpoint`] times the frame
    /// size), never the `-wal` file's length: after a checkpoint SQLite keeps
    /// the file at `journal_size_limit`, so its length says nothing about
    /// what is new.
    pub written_bytes: u64,
    /// PASSIVE once this many bytes were written since the last checkpoint.
    pub threshold_bytes: u64,
    /// Time since the last checkpoint.
    pub since_last: Duration,
    /// PASSIVE at least this often while something was written.
    pub interval: Duration,
}

/// The checkpoint to run now, if any: PASSIVE on a written-bytes or time
/// threshold (litestream's first tier;
/// <https://www.sqlite.org/c3ref/wal_checkpoint_v2.html>). PASSIVE never
/// waits for a reader or a writer, so no pass can hold the write lock for a
/// busy timeout; the WAL restarts from its beginning at the first write after
/// a complete checkpoint, and `journal_size_limit` trims the file then.
/// TRUNCATE is kept for explicit requests (the `checkpoint` command, leaving
/// a disk-full state).
pub fn checkpoint_due(i: &CheckpointInputs) -> Option<CheckpointMode> {
    if i.written_bytes == 0 {
        return None;
    }
    if i.written_bytes >= i.threshold_bytes || i.since_last >= i.interval {
        return Some(CheckpointMode::Passive);
    }
    None
}

/// Whether a bulk step (a retention batch, a free-page step) may write
/// now, given how long a reader has kept the WAL the last one left from
/// starting over (`None`: it started over). Bulk steps write a batch's worth
/// of pages each; into a WAL that cannot start over they pile up (F02 on
/// top of F01), so after a pin they wait for the reader to leave, and one
/// goes ahead anyway once per checkpoint `interval` (F01's bound: the limit
/// plus one interval of writes; retention still progresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkGate {
    /// No pin: write.
    Go,
    /// Pinned for less than an interval: write only if the reader has left.
    IfReaderLeft,
    /// Pinned for an interval or more: write one step regardless.
    Anyway,
}

/// [`BulkGate`] for a pin held `pinned_for` (`None`: none) and the
/// time-driven checkpoint `interval`.
pub fn bulk_gate(pinned_for: Option<Duration>, interval: Duration) -> BulkGate {
    match pinned_for {
        None => BulkGate::Go,
        Some(d) if d >= interval => BulkGate::Anyway,
        Some(_) => BulkGate::IfReaderLeft,
    }
}

/// Capacity limits from `[spool]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// `max_bytes`: live data in the spool (pages in use), 0 = no limit.
    pub max_bytes: u64,
    /// `min_free_bytes`: free space kept on the spool's filesystem.
    pub min_free_bytes: u64,
}

/// Why new readings are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The spool holds `max_bytes` of live pages.
    SpoolFull {
        /// Bytes in use.
        used: u64,
        /// The limit.
        max: u64,
    },
    /// The filesystem is down to its reserve and the spool has no free pages to reuse.
    DiskReserve {
        /// Free bytes on the filesystem plus free pages inside the spool.
        free: u64,
        /// The reserve.
        reserve: u64,
    },
}

impl Refusal {
    /// Counter and log name of the reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::SpoolFull { .. } => "spool_full",
            Refusal::DiskReserve { .. } => "disk_reserve",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::SpoolFull { used, max } => write!(
                f,
                "spool holds {used} bytes of live data, spool.max_bytes is {max}"
            ),
            Refusal::DiskReserve { free, reserve } => write!(
                f,
                "{free} bytes free for the spool, spool.min_free_bytes reserve is {reserve}"
            ),
        }
    }
}

/// Whether to refuse new readings now. `used` = live pages in the spool,
/// `free_pages` = free pages inside the file (reused before the file grows),
/// `fs_free` = free bytes on the filesystem, all in bytes.
pub fn capacity_check(cap: &Capacity, used: u64, free_pages: u64, fs_free: u64) -> Option<Refusal> {
    if cap.max_bytes > 0 && used >= cap.max_bytes {
        return Some(Refusal::SpoolFull {
            used,
            max: cap.max_bytes,
        });
    }
    let free = fs_free.saturating_add(free_pages);
    if free < cap.min_free_bytes {
        return Some(Refusal::DiskReserve {
            free,
            reserve: cap.min_free_bytes,
        });
    }
    None
}

/// Free bytes for an unprivileged writer on the filesystem holding `dir`.
pub fn fs_free_bytes(dir: &Path) -> std::io::Result<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: statvfs fills the zeroed struct we own; c is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // widths differ between targets
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Device and inode of a file, to notice it being removed or replaced.
pub fn file_identity(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// Past this gap between the wall clock and the monotonic expectation, the
/// wall clock is taken to have been stepped (time sync after a boot in 1970,
/// an operator's `date -s`).
pub const CLOCK_STEP_MS: i64 = 3_600_000;

/// The "now" retention judges ages by: the wall clock, unless it has moved
/// more than [`CLOCK_STEP_MS`] away from `expected_ms` (the wall time at
/// start plus monotonic time since), in which case the expectation. A clock
/// stepped forward by years then purges nothing by itself, and one stepped
/// back keeps everything until real time has passed.
pub fn retention_now(wall_ms: i64, expected_ms: i64) -> i64 {
    if (wall_ms - expected_ms).abs() > CLOCK_STEP_MS {
        expected_ms
    } else {
        wall_ms
    }
}

/// Rate per hour of `delta` over `elapsed`.
pub fn per_hour(delta: u64, elapsed: Duration) -> u64 {
    if elapsed.is_zero() {
        return 0;
    }
    (delta as f64 * 3600.0 / elapsed.as_secs_f64()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> CheckpointInputs {
        CheckpointInputs {
            written_bytes: 100_000,
            threshold_bytes: 1_000_000,
            since_last: Duration::from_secs(1),
            interval: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_bulk_step_after_a_pin_waits_for_the_reader_or_one_interval() {
        let interval = Duration::from_secs(30);
        assert_eq!(bulk_gate(None, interval), BulkGate::Go);
        assert_eq!(
            bulk_gate(Some(Duration::ZERO), interval),
            BulkGate::IfReaderLeft
        );
        assert_eq!(
            bulk_gate(Some(Duration::from_millis(29_999)), interval),
            BulkGate::IfReaderLeft
        );
        assert_eq!(bulk_gate(Some(interval), interval), BulkGate::Anyway);
        assert_eq!(
            bulk_gate(Some(Duration::from_secs(3600)), interval),
            BulkGate::Anyway
        );
    }

    #[test]
    fn no_checkpoint_below_thresholds_or_with_nothing_written() {
        assert_eq!(checkpoint_due(&inputs()), None);
        let mut i = inputs();
        i.written_bytes = 0;
        i.since_last = Duration::from_secs(3600);
        assert_eq!(checkpoint_due(&i), None);
    }

    #[test]
    fn passive_on_the_written_bytes_or_time_threshold() {
        let mut i = inputs();
        i.written_bytes = 1_000_000;
        assert_eq!(checkpoint_due(&i), Some(CheckpointMode::Passive));
        let mut i = inputs();
        i.since_last = Duration::from_secs(30);
        assert_eq!(checkpoint_due(&i), Some(CheckpointMode::Passive));
    }

    #[test]
    fn a_wal_file_kept_at_its_limit_does_not_trigger_checkpoints() {
        // The regression behind the flash-wear issue: the policy never sees
        // the file length, only what was written since the last checkpoint.
        let mut i = inputs();
        i.written_bytes = 4096 + 24;
        assert_eq!(checkpoint_due(&i), None);
    }

    #[test]
    fn capacity_refuses_on_the_spool_limit_and_the_disk_reserve() {
        let cap = Capacity {
            max_bytes: 1000,
            min_free_bytes: 500,
        };
        assert_eq!(capacity_check(&cap, 999, 0, 10_000), None);
        assert_eq!(
            capacity_check(&cap, 1000, 0, 10_000),
            Some(Refusal::SpoolFull {
                used: 1000,
                max: 1000
            })
        );
        assert_eq!(
            capacity_check(&cap, 10, 0, 499),
            Some(Refusal::DiskReserve {
                free: 499,
                reserve: 500
            })
        );
        // Free pages inside the spool are reused before the file grows.
        assert_eq!(capacity_check(&cap, 10, 100, 450), None);
        let unlimited = Capacity {
            max_bytes: 0,
            min_free_bytes: 0,
        };
        assert_eq!(capacity_check(&unlimited, u64::MAX, 0, 0), None);
    }

    #[test]
    fn a_stepped_clock_does_not_move_retention() {
        let expected = 1_800_000_000_000;
        assert_eq!(retention_now(expected + 5_000, expected), expected + 5_000);
        let ten_years = 10 * 365 * 86_400_000;
        assert_eq!(retention_now(expected + ten_years, expected), expected);
        assert_eq!(retention_now(expected - ten_years, expected), expected);
    }

    #[test]
    fn rates_per_hour() {
        assert_eq!(per_hour(100, Duration::from_secs(36)), 10_000);
        assert_eq!(per_hour(100, Duration::ZERO), 0);
    }

    #[test]
    fn files_have_an_identity_until_removed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, "x").unwrap();
        let a = file_identity(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(file_identity(&p), None);
        std::fs::write(&p, "y").unwrap();
        let b = file_identity(&p);
        assert!(b.is_some());
        let _ = a;
    }
}
