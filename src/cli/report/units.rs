//! Numbers as people read them in `status`: durations in `s`, `min`, `h`,
//! `d`; sizes of files in binary units (`104.0 KiB`, as `ls -h` and `du -h`
//! show them); volumes written and byte rates in decimal units (`1.2 kB/s`,
//! `95 MB/day`), the unit of `spool.write_budget_mb_per_day`; counts with
//! thousands separators.
//!
//! Its one rule: **a figure always carries its unit**, and a value that is
//! not finite or was not measured says so instead of printing a number;
//! a time the board's clock cannot turn into an age ([`stamp_age`]) says
//! why instead of printing one.

use crate::event::age::{stamp_age, StampAge};

/// `n` with thousands separators: `12,000`.
pub(super) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut o = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            o.push(',');
        }
        o.push(c);
    }
    o
}

/// A signed count with thousands separators: `-1,200`.
pub(super) fn count(n: i64) -> String {
    match n {
        n if n < 0 => format!("-{}", thousands(n.unsigned_abs())),
        n => thousands(n as u64),
    }
}

/// Seconds as `12 s`, `3 min 5 s`, `41 h 10 min`, `5 d 2 h` (two units at
/// most, a zero second unit left out: `3 min`, `2 h`); `ever` when not finite.
pub(super) fn duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "ever".to_owned();
    }
    let s = secs.max(0.0).round() as u64;
    let (big, small, big_unit, small_unit) = match s {
        0..=59 => return format!("{s} s"),
        60..=3599 => (s / 60, s % 60, "min", "s"),
        // Hours up to two days: `41 h 10 min` reads better than `1 d 17 h`.
        3600..=172_799 => (s / 3600, s / 60 % 60, "h", "min"),
        _ => (s / 86_400, s / 3600 % 24, "d", "h"),
    };
    if small == 0 {
        format!("{big} {big_unit}")
    } else {
        format!("{big} {big_unit} {small} {small_unit}")
    }
}

/// Milliseconds as [`duration`], and as `N ms` below a second and `1.1 s`
/// below ten (where [`duration`] would round to whole seconds).
pub(super) fn duration_ms(ms: i64) -> String {
    match ms {
        0..=999 => format!("{ms} ms"),
        1000..=9999 => format!("{:.1} s", ms as f64 / 1000.0),
        _ => duration(ms as f64 / 1000.0),
    }
}

/// The age of something stamped `at_ms`, seen at `now_ms`, as
/// [`stamp_age`] judges it: `12 s ago` (a stamp a few seconds ahead is
/// `0 s ago`); `before the clock was set` for a stamp from before the
/// clock floor seen on a set clock (not `20782 d ago`); `at a time 3 h
/// ahead of this clock` for a stamp of a clock stepped back since; `when
/// the clock was set (it is not set now)` for a set stamp seen on a clock
/// back in 1970. Every form reads after `recorded`, `started`, `appended`.
pub(super) fn ago(at_ms: i64, now_ms: i64) -> String {
    match stamp_age(at_ms, now_ms) {
        StampAge::Age(ms) => format!("{} ago", duration(ms as f64 / 1000.0)),
        StampAge::BeforeClockSet => "before the clock was set".to_owned(),
        StampAge::Ahead(ms) => format!(
            "at a time {} ahead of this clock",
            duration(ms as f64 / 1000.0)
        ),
        StampAge::ClockNotSetNow => "when the clock was set (it is not set now)".to_owned(),
    }
}

/// How long from `from_ms` to `to_ms` (a run's start and its end, or now),
/// as [`duration_ms`]; `None` when the clock cannot say ([`stamp_age`]:
/// the start was read before the clock was set, or lies after the end).
pub(super) fn lasted(from_ms: i64, to_ms: i64) -> Option<String> {
    stamp_age(from_ms, to_ms).ms().map(duration_ms)
}

/// A file's size in binary units: `512 B`, `104.0 KiB`, `4.0 MiB`, `1.0 GiB`.
pub(super) fn size(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (u, unit) in UNITS {
        if b >= unit {
            return format!("{:.1} {u}", b as f64 / unit as f64);
        }
    }
    format!("{b} B")
}

/// A volume written or a byte rate in decimal units: `180 B`, `2.5 kB`,
/// `1.0 GB` (1 MB = 10^6 bytes, as `spool.write_budget_mb_per_day`).
pub(super) fn volume(b: f64) -> String {
    const UNITS: [(&str, f64); 4] = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    for (u, unit) in UNITS {
        if b >= unit {
            return format!("{:.1} {u}", b / unit);
        }
    }
    format!("{:.0} B", b.max(0.0))
}

/// A rate with sensible precision: `1.2`, `70`, `0.05`.
pub(super) fn rate(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 || v == 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Microseconds as milliseconds with one decimal: `3.3 ms`.
pub(super) fn us_as_ms(us: u64) -> String {
    format!("{:.1} ms", us as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_say_them() {
        assert_eq!(duration(12.0), "12 s");
        assert_eq!(duration(185.0), "3 min 5 s");
        assert_eq!(duration(180.0), "3 min");
        assert_eq!(duration(171.4), "2 min 51 s");
        assert_eq!(duration(7800.0), "2 h 10 min");
        assert_eq!(duration(7200.0), "2 h");
        assert_eq!(duration(148_200.0), "41 h 10 min");
        assert_eq!(duration(5.0 * 86_400.0 + 7200.0), "5 d 2 h");
        assert_eq!(duration(f64::INFINITY), "ever");
        assert_eq!(duration_ms(400), "400 ms");
        assert_eq!(duration_ms(1100), "1.1 s");
        assert_eq!(duration_ms(12_000), "12 s");
        assert_eq!(ago(1000, 13_000), "12 s ago");
        assert_eq!(ago(13_000, 10_000), "0 s ago", "a step back of 3 s");
    }

    // The clock floor's cases: a board without an RTC.
    #[test]
    fn a_time_the_clock_cannot_age_says_why_instead_of_a_number() {
        let set = 1_790_000_000_000;
        assert_eq!(ago(42_000, set), "before the clock was set");
        assert_eq!(
            ago(set + 3 * 3_600_000, set),
            "at a time 3 h ahead of this clock"
        );
        assert_eq!(
            ago(set, 60_000),
            "when the clock was set (it is not set now)"
        );
        // Both on a clock not set yet: its own age.
        assert_eq!(ago(42_000, 102_000), "1 min ago");
        assert_eq!(lasted(set, set + 7_800_000).as_deref(), Some("2 h 10 min"));
        assert_eq!(lasted(42_000, set), None);
        assert_eq!(lasted(set + 60_000, set), None);
    }

    #[test]
    fn sizes_are_binary_and_volumes_decimal() {
        assert_eq!(size(106_496), "104.0 KiB");
        assert_eq!(size(4 << 20), "4.0 MiB");
        assert_eq!(size(1 << 30), "1.0 GiB");
        assert_eq!(size(512), "512 B");
        assert_eq!(volume(1e9), "1.0 GB");
        assert_eq!(volume(180.0), "180 B");
        assert_eq!(thousands(12_000), "12,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(count(-1200), "-1,200");
        assert_eq!(us_as_ms(3258), "3.3 ms");
    }
}
