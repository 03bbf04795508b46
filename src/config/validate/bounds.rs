//! The one range check of the config: a number outside its bounds is a
//! problem on its key, worded "must be BOUNDS (got VALUE)" with the bounds
//! as each key has always stated them (`5..=3600`, `at least 5000`,
//! `>= 0`, with a unit where one is named: `1..=1000000 MB a day`).

use std::fmt::{self, Display};
use std::ops::RangeInclusive;

/// The values a key may take, and how its problem words them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds<T> {
    shape: Shape<T>,
    /// Said right after the bounds: a unit (" seconds") or a gloss (" (1 GiB)").
    note: &'static str,
}

#[derive(Debug, Clone, Copy)]
enum Shape<T> {
    /// `lo..=hi`.
    Range(T, T),
    /// `at least lo`.
    AtLeast(T),
    /// `at most hi`.
    AtMost(T),
    /// `>= lo`.
    Ge(T),
    /// `<= hi`.
    Le(T),
}

impl<T> From<RangeInclusive<T>> for Bounds<T> {
    fn from(r: RangeInclusive<T>) -> Self {
        let (lo, hi) = r.into_inner();
        Bounds {
            shape: Shape::Range(lo, hi),
            note: "",
        }
    }
}

impl<T> Bounds<T> {
    fn of(shape: Shape<T>) -> Self {
        Bounds { shape, note: "" }
    }
    /// `lo` or more, worded "at least lo".
    pub(super) fn at_least(lo: T) -> Self {
        Self::of(Shape::AtLeast(lo))
    }
    /// `hi` or less, worded "at most hi".
    pub(super) fn at_most(hi: T) -> Self {
        Self::of(Shape::AtMost(hi))
    }
    /// `lo` or more, worded ">= lo".
    pub(super) fn ge(lo: T) -> Self {
        Self::of(Shape::Ge(lo))
    }
    /// `hi` or less, worded "<= hi".
    pub(super) fn le(hi: T) -> Self {
        Self::of(Shape::Le(hi))
    }
    /// The same bounds with `note` said after them.
    pub(super) fn note(self, note: &'static str) -> Self {
        Bounds { note, ..self }
    }
}

impl<T: PartialOrd> Bounds<T> {
    fn contains(&self, v: &T) -> bool {
        match &self.shape {
            Shape::Range(lo, hi) => lo <= v && v <= hi,
            Shape::AtLeast(lo) | Shape::Ge(lo) => lo <= v,
            Shape::AtMost(hi) | Shape::Le(hi) => v <= hi,
        }
    }
}

impl<T: Display> Display for Bounds<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.shape {
            Shape::Range(lo, hi) => write!(f, "{lo}..={hi}")?,
            Shape::AtLeast(lo) => write!(f, "at least {lo}")?,
            Shape::AtMost(hi) => write!(f, "at most {hi}")?,
            Shape::Ge(lo) => write!(f, ">= {lo}")?,
            Shape::Le(hi) => write!(f, "<= {hi}")?,
        }
        f.write_str(self.note)
    }
}

/// `got`, the value of `key`, within `bounds`; outside them a problem on
/// `key`: "must be {bounds} (got {got})". Returns whether it was within.
pub(super) fn check_range<T: PartialOrd + Display>(
    key: &str,
    got: T,
    bounds: impl Into<Bounds<T>>,
    bad: &mut impl FnMut(&str, String),
) -> bool {
    let bounds = bounds.into();
    let within = bounds.contains(&got);
    if !within {
        bad(key, format!("must be {bounds} (got {got})"));
    }
    within
}

#[cfg(test)]
mod tests {
    use super::{check_range, Bounds};

    fn said<T: PartialOrd + std::fmt::Display>(
        got: T,
        bounds: impl Into<Bounds<T>>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        check_range("k", got, bounds, &mut |key: &str, m: String| {
            out.push(format!("{key}: {m}"))
        });
        out
    }

    #[test]
    fn each_shape_words_its_bounds_as_the_messages_always_did() {
        assert_eq!(said(0u64, 5..=3600), ["k: must be 5..=3600 (got 0)"]);
        assert_eq!(
            said(100u64, Bounds::at_least(5000)),
            ["k: must be at least 5000 (got 100)"]
        );
        assert_eq!(
            said(11u64, Bounds::at_most(10).note(" (ten years)")),
            ["k: must be at most 10 (ten years) (got 11)"]
        );
        assert_eq!(said(-1i64, Bounds::ge(0)), ["k: must be >= 0 (got -1)"]);
        assert_eq!(said(7u64, Bounds::le(6)), ["k: must be <= 6 (got 7)"]);
        assert_eq!(
            said(0u64, Bounds::from(1..=1_000_000).note(" MB a day")),
            ["k: must be 1..=1000000 MB a day (got 0)"]
        );
    }

    #[test]
    fn the_bounds_themselves_are_within() {
        for v in [5u64, 3600] {
            assert!(said(v, 5..=3600).is_empty());
        }
        assert!(said(5000u64, Bounds::at_least(5000)).is_empty());
        assert!(said(10u64, Bounds::at_most(10)).is_empty());
        assert!(said(0i64, Bounds::ge(0)).is_empty());
        assert!(said(6u64, Bounds::le(6)).is_empty());
    }
}
