//! The board's clocks as Linux keeps them: the boot id, `CLOCK_BOOTTIME`,
//! and whether the kernel says time sync vouches for the wall clock
//! (adjtimex(2)).
//!
//! Its one rule: **a clock reading says what the kernel said**, read at the
//! instant asked for; whether a reading needs a stamp is
//! [`crate::event::clock::wants_stamp`]'s rule, applied here only so every
//! producer reads both clocks the same way ([`reading_now`]).

use crate::event::clock::{self, BootId, MonoStamp, Sync};
use crate::event::envelope::wall_clock_ms;
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where Linux tells the boot id (random(4)).
pub const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// Environment variable naming a file that stands in for the kernel's
/// answer to "is the clock synchronized": `synchronized` or
/// `unsynchronized` (anything else, or no file: unknown). For tests and
/// rigs that play a board whose clock time sync has not yet set; a
/// board's service does not set it.
pub const SYNC_FILE_ENV: &str = "EDGESPOOL_CLOCK_SYNC_FILE";

/// The kernel's maximum error at and above which the wall clock is not
/// synchronized, µs: 16 s, the kernel's `NTP_PHASE_LIMIT`, which it sets
/// at boot and grows by 500 µs a second until a time sync daemon lowers
/// it. systemd's `ntp_synced()` (what `timedatectl` shows as "System clock
/// synchronized") uses this bound and not `STA_UNSYNC`, which a daemon
/// may leave set to keep the kernel off the RTC.
pub const UNSYNCED_MAXERROR_US: i64 = 16_000_000;

/// How long a thread reuses the kernel's answer in [`reading_now`]: a
/// reading taken within a second after the clock was synchronized still
/// carries a stamp, which the fleet finds in agreement with the anchor.
const SYNC_REUSE: Duration = Duration::from_secs(1);

/// This boot's id, read once per process (it cannot change under it);
/// `None` where the file cannot be read or parsed (not Linux, a /proc
/// that hides it).
pub fn boot_id() -> Option<BootId> {
    static ID: OnceLock<Option<BootId>> = OnceLock::new();
    *ID.get_or_init(|| {
        std::fs::read_to_string(BOOT_ID_FILE)
            .ok()
            .and_then(|s| BootId::parse(&s))
    })
}

/// `CLOCK_BOOTTIME` in ms; `None` if the kernel refuses it (clock_gettime(2)
/// fails only for a clock it does not have).
pub fn boottime_ms() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000)
}

/// This boot and `CLOCK_BOOTTIME` now; `None` without either.
pub fn stamp() -> Option<MonoStamp> {
    Some(MonoStamp {
        boot_id: boot_id()?,
        mono_ms: boottime_ms()?,
    })
}

/// Whether the kernel says time sync vouches for the wall clock: adjtimex(2)
/// with no modes (it reads and changes nothing; no privilege needed), or
/// the file [`SYNC_FILE_ENV`] names.
pub fn kernel_sync() -> Sync {
    if let Some(path) = std::env::var_os(SYNC_FILE_ENV).map(PathBuf::from) {
        return match std::fs::read_to_string(path).as_deref().map(str::trim) {
            Ok("synchronized") => Sync::Synchronized { maxerror_us: 0 },
            Ok("unsynchronized") => Sync::Unsynchronized {
                maxerror_us: UNSYNCED_MAXERROR_US,
            },
            _ => Sync::Unknown,
        };
    }
    // SAFETY: an all-zero timex is a valid argument (modes 0: read only).
    let mut tx: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: adjtimex fills the timex we own.
    if unsafe { libc::adjtimex(&mut tx) } < 0 {
        // EPERM under a seccomp filter, ENOSYS under some emulators.
        return Sync::Unknown;
    }
    let maxerror_us = tx.maxerror as i64;
    match maxerror_us < UNSYNCED_MAXERROR_US {
        true => Sync::Synchronized { maxerror_us },
        false => Sync::Unsynchronized { maxerror_us },
    }
}

/// A reading's time: the wall clock now, whether it is past the floor
/// ([`wall_clock_ms`]), and its [`MonoStamp`] read right after it when
/// [`clock::wants_stamp`] says the reading needs one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Wall clock, Unix ms.
    pub wall_ms: i64,
    /// Not before [`crate::event::envelope::CLOCK_FLOOR_MS`].
    pub trusted: bool,
    /// Where `wall_ms` was read on the monotonic clock, if it needs saying.
    pub mono: Option<MonoStamp>,
}

/// The time of a reading taken now (see [`Now`]). The kernel's sync state
/// is asked at most once a second per thread.
pub fn reading_now() -> Now {
    let (wall_ms, trusted) = wall_clock_ms();
    let mono = stamp().filter(|_| clock::wants_stamp(trusted, sync_recently()));
    Now {
        wall_ms,
        trusted,
        mono,
    }
}

/// [`kernel_sync`], reused for [`SYNC_REUSE`] by the calling thread.
fn sync_recently() -> Sync {
    thread_local! {
        static LAST: Cell<Option<(Instant, Sync)>> = const { Cell::new(None) };
    }
    LAST.with(|last| match last.get() {
        Some((at, s)) if at.elapsed() < SYNC_REUSE => s,
        _ => {
            let s = kernel_sync();
            last.set(Some((Instant::now(), s)));
            s
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_boot_has_an_id_and_a_boottime_that_runs_on() {
        let a = stamp().expect("Linux has a boot id and CLOCK_BOOTTIME");
        std::thread::sleep(Duration::from_millis(20));
        let b = stamp().expect("stamp");
        assert_eq!(a.boot_id, b.boot_id);
        assert!(b.mono_ms >= a.mono_ms + 20, "{a:?} {b:?}");
        let uptime: f64 = std::fs::read_to_string("/proc/uptime")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        // /proc/uptime is CLOCK_BOOTTIME too.
        assert!(
            (b.mono_ms as f64 / 1000.0 - uptime).abs() < 2.0,
            "{b:?} {uptime}"
        );
    }

    #[test]
    fn the_kernel_answers_whether_the_clock_is_synchronized() {
        match kernel_sync() {
            Sync::Synchronized { maxerror_us } => assert!(maxerror_us < UNSYNCED_MAXERROR_US),
            Sync::Unsynchronized { maxerror_us } => assert!(maxerror_us >= UNSYNCED_MAXERROR_US),
            // A seccomp filter or an emulator; nothing to check.
            Sync::Unknown => {}
        }
    }
}
