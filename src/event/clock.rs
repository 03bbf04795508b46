//! True time on boards without a real-time clock: which boot a reading was
//! taken in and how long after that boot began (its [`MonoStamp`]), and the
//! clock anchor a board publishes once time sync vouches for its wall
//! clock ([`Anchor`], on stream [`CLOCK_STREAM`]).
//!
//! Shared vocabulary: the agent stamps readings and appends anchors, the
//! sink corrects readings by anchors. Its one rule: **a correction never
//! crosses a boot.** A reading's true time is the anchor's wall time less
//! the distance between them on that boot's monotonic clock,
//! `anchor.wall_ms - (anchor.mono_ms - reading.mono_ms)` ([`Anchor::corrected_ms`]),
//! and only for a reading of the anchor's boot taken before it.
//!
//! The monotonic clock is Linux's `CLOCK_BOOTTIME`: it counts from boot,
//! is never stepped, runs at the rate time sync disciplines the wall clock
//! to, and, unlike `CLOCK_MONOTONIC`, keeps counting while the board is
//! suspended (clock_gettime(2)): a reading taken before a suspend and an
//! anchor taken after it are as far apart as they were in true time.

use crate::event::hex;
use crate::event::reading::{FieldValue, Fields};

/// The stream of clock anchors, published on `<topic_prefix>/events/_clock`
/// (an agent stream: its name starts with `_`).
pub const CLOCK_STREAM: &str = "_clock";

/// A boot's identity: the 128 random bits Linux draws at each boot
/// (`/proc/sys/kernel/random/boot_id`, random(4)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BootId(pub [u8; 16]);

impl BootId {
    /// The id in `s`: 32 hex digits, with or without the hyphens of the
    /// 8-4-4-4-12 form the kernel writes, either case, around them
    /// whitespace only (the kernel's file ends in a newline). `None` for
    /// anything else.
    pub fn parse(s: &str) -> Option<BootId> {
        let s = s.trim();
        let digits: String = match s.len() {
            32 => s.to_owned(),
            36 if [8, 13, 18, 23].iter().all(|&i| s.as_bytes()[i] == b'-') => {
                s.chars().filter(|&c| c != '-').collect()
            }
            _ => return None,
        };
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let bytes = hex::decode(&digits)?;
        Some(BootId(bytes.try_into().ok()?))
    }

    /// 32 lowercase hex digits, no hyphens: the form on the wire (JSON),
    /// in the sink's SQLite file and in journald's `_BOOT_ID`, so
    /// `journalctl -b <id>` finds the boot.
    pub fn simple(&self) -> String {
        hex::encode(&self.0)
    }
}

/// Where on its boot's monotonic line a reading was taken: the boot and
/// `CLOCK_BOOTTIME` in milliseconds, read at the instant the reading's
/// `ts_ms` was read from the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonoStamp {
    /// The boot it was taken in.
    pub boot_id: BootId,
    /// `CLOCK_BOOTTIME`, ms since that boot began.
    pub mono_ms: u64,
}

/// What the kernel says of the wall clock (adjtimex(2), read by
/// `crate::os::clock::kernel_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// Time sync vouches for it: the kernel's maximum error is below 16 s.
    Synchronized {
        /// The kernel's maximum error, µs.
        maxerror_us: i64,
    },
    /// No time sync has vouched for it since boot (or not for hours).
    Unsynchronized {
        /// The kernel's maximum error, µs (16 s or more).
        maxerror_us: i64,
    },
    /// The kernel would not say (a seccomp filter, an emulator).
    Unknown,
}

/// Whether a reading whose wall clock is `trusted` (past the floor) when
/// the kernel says `sync` carries a [`MonoStamp`]: when the wall clock may
/// still be stepped by time sync, so that the fleet can move it then.
/// Past the floor and synchronized, it is right and needs none (a
/// synchronized board adds no bytes); when the kernel will not say, no
/// anchor can ever come, and it gets none either, as before stamps
/// existed. A wall clock before the floor is wrong whatever the kernel
/// says.
pub fn wants_stamp(trusted: bool, sync: Sync) -> bool {
    !trusted || matches!(sync, Sync::Unsynchronized { .. })
}

/// Field names of an anchor event.
pub mod field {
    /// The boot, as [`super::BootId::simple`] writes it.
    pub const BOOT_ID: &str = "boot_id";
    /// `CLOCK_BOOTTIME`, ms.
    pub const MONO_MS: &str = "mono_ms";
    /// The wall clock at the same instant, Unix ms.
    pub const WALL_MS: &str = "wall_ms";
    /// The kernel's maximum error of the wall clock then (adjtimex(2)'s
    /// `maxerror`), µs.
    pub const MAXERROR_US: &str = "maxerror_us";
}

/// A clock anchor: one instant read on both clocks of a boot once time
/// sync vouched for the wall clock. Published as an event of
/// [`CLOCK_STREAM`] whose envelope carries the same instant (`ts_ms`,
/// `boot_id`, `mono_ms`) and whose fields ([`Anchor::fields`]) say it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    /// The boot and its monotonic clock at the instant.
    pub at: MonoStamp,
    /// The wall clock at the instant, Unix ms.
    pub wall_ms: i64,
}

impl Anchor {
    /// The wall clock less the monotonic one: Unix ms at which the boot
    /// began, on the synchronized clock. Two anchors of one boot agree
    /// when these agree (neither clock is stepped between them unless
    /// someone steps the wall clock).
    pub fn offset_ms(&self) -> i64 {
        self.wall_ms.saturating_sub(self.at.mono_ms as i64)
    }

    /// The true time of a reading taken at `mono_ms` on this anchor's boot,
    /// Unix ms; `None` for a reading taken after the anchor (its wall
    /// clock was already vouched for).
    pub fn corrected_ms(&self, mono_ms: u64) -> Option<i64> {
        (mono_ms <= self.at.mono_ms).then(|| self.wall_ms - (self.at.mono_ms - mono_ms) as i64)
    }

    /// The anchor event's fields, `maxerror_us` the kernel's figure.
    pub fn fields(&self, maxerror_us: i64) -> Fields {
        vec![
            (
                field::BOOT_ID.into(),
                FieldValue::Text(self.at.boot_id.simple()),
            ),
            (
                field::MONO_MS.into(),
                FieldValue::Num(self.at.mono_ms as f64),
            ),
            (field::WALL_MS.into(), FieldValue::Num(self.wall_ms as f64)),
            (
                field::MAXERROR_US.into(),
                FieldValue::Num(maxerror_us as f64),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boot_id_reads_from_the_kernels_file_and_its_simple_form_only() {
        let kernel = "378e97e1-f481-4124-9e58-221d16d6b54f\n";
        let id = BootId::parse(kernel).unwrap();
        assert_eq!(id.simple(), "378e97e1f48141249e58221d16d6b54f");
        assert_eq!(BootId::parse(&id.simple()), Some(id));
        assert_eq!(BootId::parse("378E97E1F48141249E58221D16D6B54F"), Some(id));
        for bad in [
            "",
            "378e97e1f48141249e58221d16d6b54",
            "378e97e1-f481-4124-9e58221d16d6b54f0",
            "378e97e1f48141249e58221d16d6b5g4",
            "378e97e1-f481-4124-9e58-221d16d6b5-f",
            "+378e97e1f48141249e58221d16d6b54",
        ] {
            assert_eq!(BootId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_reading_is_moved_by_its_distance_from_the_anchor_on_the_monotonic_clock() {
        let anchor = Anchor {
            at: MonoStamp {
                boot_id: BootId([1; 16]),
                mono_ms: 600_000,
            },
            wall_ms: 1_790_000_600_000,
        };
        assert_eq!(anchor.offset_ms(), 1_790_000_000_000);
        // Taken 9 minutes 59 s before the anchor, 1 s after boot.
        assert_eq!(anchor.corrected_ms(1_000), Some(1_790_000_001_000));
        assert_eq!(anchor.corrected_ms(600_000), Some(1_790_000_600_000));
        assert_eq!(anchor.corrected_ms(600_001), None);
    }

    #[test]
    fn only_a_clock_time_sync_may_still_step_is_stamped() {
        let (on, off) = (
            Sync::Synchronized { maxerror_us: 8000 },
            Sync::Unsynchronized {
                maxerror_us: 16_000_000,
            },
        );
        assert!(!wants_stamp(true, on));
        assert!(wants_stamp(true, off));
        assert!(!wants_stamp(true, Sync::Unknown));
        for s in [on, off, Sync::Unknown] {
            assert!(wants_stamp(false, s), "{s:?}");
        }
    }

    #[test]
    fn an_anchors_fields_say_its_instant_again() {
        let a = Anchor {
            at: MonoStamp {
                boot_id: BootId([0xab; 16]),
                mono_ms: 42,
            },
            wall_ms: 1_790_000_000_000,
        };
        let f = a.fields(1500);
        assert_eq!(f[0], ("boot_id".into(), FieldValue::Text("ab".repeat(16))));
        assert_eq!(f[1], ("mono_ms".into(), FieldValue::Num(42.0)));
        assert_eq!(f[2], ("wall_ms".into(), FieldValue::Num(1.79e12)));
        assert_eq!(f[3], ("maxerror_us".into(), FieldValue::Num(1500.0)));
    }
}
