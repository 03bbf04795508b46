//! The replay ledger's arithmetic: per (device, stream), which sequence
//! numbers the database holds, as the highest one accounted for and the
//! gaps below it, and what a board's holdings and answers change in it.
//!
//! Pure: no I/O, time passed in. [`book`] runs these steps over a store's
//! transaction ([`book::Books`]: [`sqlite`], and `pg` for PostgreSQL): it
//! loads a [`Line`] and the gaps a change touches, applies one of the
//! functions here inside the transaction that stores the events, and writes
//! the result back. Its one rule: **the ledger moves only on what the
//! database holds or a board says**: an event stored (or found stored: a
//! duplicate is reconciled, never counted as progress) closes its sequence
//! number; a board's holdings open the gaps its database lacks and say
//! which of them can be asked for; a board's answer (or its holdings'
//! oldest sequence number) makes a gap permanent, with the reason. A gap is
//! never guessed closed, and never waited on forever: one asked for
//! [`MAX_ASKS`] times without a row arriving is given up, with that reason.
//!
//! Sequence numbers start at 1 on every board stream, so an accounted range
//! is `1..=known`: a database that starts empty, or is restored, sees what
//! it lacks from the first holdings.

use crate::event::backfill::{GoneReason, Held};

pub mod book;
#[cfg(feature = "pg-sink")]
pub mod pg;
pub mod sqlite;

/// Rows one request may name, at most (the board bounds it again).
pub const MAX_ASK_ROWS: u64 = 50_000;
/// Ranges one request may name, at most.
pub const MAX_ASK_RANGES: usize = 64;
/// Times a gap is asked for without a row of it arriving before it is
/// given up (marked gone, reason [`GIVEN_UP`]).
pub const MAX_ASKS: i32 = 8;
/// A board is asked at most once in this long (ms), whatever the sinks.
pub const ASK_EVERY_MS: i64 = 20_000;
/// Open gaps read per stream when a board's holdings come (the rest wait
/// for the next holdings).
pub const GAPS_PER_PASS: usize = 1000;
/// The reason of a gap given up after [`MAX_ASKS`] requests.
pub const GIVEN_UP: &str = "asked 8 times; the board sent none of it";

/// One (device, stream) of the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Line {
    /// The highest sequence number accounted for: stored, or announced by
    /// the board (then the gap up to it is open).
    pub known: i64,
    /// The highest sequence number stored.
    pub newest: i64,
    /// Events stored at a sequence number already covered (another event
    /// id: a board whose spool was replaced numbers again from 1).
    pub repeats: i64,
}

/// Sequence numbers `first..=last` the database lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// First missing.
    pub first: i64,
    /// Last missing.
    pub last: i64,
    /// When it was first seen, Unix ms.
    pub since_ms: i64,
    /// Requests that named it since a row of it last arrived.
    pub asks: i32,
    /// When it was last asked for, Unix ms.
    pub asked_ms: Option<i64>,
    /// Given up: why, and when. `None`: open.
    pub gone: Option<(String, i64)>,
}

impl Gap {
    /// An open gap seen at `now`.
    pub fn open(first: i64, last: i64, now: i64) -> Gap {
        Gap {
            first,
            last,
            since_ms: now,
            asks: 0,
            asked_ms: None,
            gone: None,
        }
    }

    /// Sequence numbers in it.
    pub fn rows(&self) -> u64 {
        (self.last - self.first + 1).max(0) as u64
    }

    /// Whether it is still open (not given up).
    pub fn is_open(&self) -> bool {
        self.gone.is_none()
    }

    /// The same gap over `first..=last` (a part of it).
    fn part(&self, first: i64, last: i64) -> Gap {
        Gap {
            first,
            last,
            ..self.clone()
        }
    }
}

/// Apply stored events' sequence numbers (`seqs`, any order, repeats
/// allowed) to `line` and `window`: the gaps that overlap
/// `min(seqs)..=max(seqs)`, in order; on return `window` holds what
/// replaces them (closed parts gone, new gaps added below a sequence number
/// that jumped ahead). Returns how many were new sequence numbers.
///
/// A number at or below `known` outside every gap was covered already: a
/// repeat (counted in [`Line::repeats`] when `first` says the event itself
/// was new to the database), never progress. A gap a row of which arrives
/// starts its asks over. Numbers below 1 are no board's and are ignored.
pub fn arrive(line: &mut Line, window: &mut Vec<Gap>, seqs: &[(i64, bool)], now_ms: i64) -> u64 {
    let mut sorted: Vec<(i64, bool)> = seqs.iter().copied().filter(|(s, _)| *s >= 1).collect();
    sorted.sort_unstable();
    sorted.dedup_by_key(|(s, _)| *s);
    let mut progress = 0;
    for (seq, first) in sorted {
        line.newest = line.newest.max(seq);
        if seq > line.known {
            if seq > line.known + 1 {
                window.push(Gap::open(line.known + 1, seq - 1, now_ms));
            }
            line.known = seq;
            progress += 1;
            continue;
        }
        match window.iter().position(|g| g.first <= seq && seq <= g.last) {
            Some(i) => {
                let g = window.remove(i);
                let mut parts = Vec::new();
                if g.first < seq {
                    parts.push(g.part(g.first, seq - 1));
                }
                if seq < g.last {
                    parts.push(g.part(seq + 1, g.last));
                }
                for p in parts.iter_mut() {
                    p.asks = 0;
                }
                for (k, p) in parts.into_iter().enumerate() {
                    window.insert(i + k, p);
                }
                progress += 1;
            }
            None if first => line.repeats += 1,
            None => {}
        }
    }
    progress
}

/// What a board's holdings did to one stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Ranges to ask the board for, in order.
    pub ask: Vec<(i64, i64)>,
    /// Rows given up now (below the board's oldest, or asked too often).
    pub gone_rows: u64,
}

/// Apply a board's holdings of one stream (`held`) to `line` and its open
/// gaps (`gaps`, in order, at most [`GAPS_PER_PASS`]; replaced in place):
/// the range the board announced beyond `known` opens as a gap; the part of
/// every gap below the board's oldest sequence number is given up (reason
/// `retention`); gaps asked [`MAX_ASKS`] times are given up; and when
/// `asking`, the open parts the board says it delivered and still holds
/// are asked for, oldest first, taking at most `budget` rows (which it
/// lowers) and [`MAX_ASK_RANGES`] ranges.
pub fn on_holdings(
    line: &mut Line,
    gaps: &mut Vec<Gap>,
    held: Held,
    asking: bool,
    budget: &mut u64,
    now_ms: i64,
) -> Plan {
    let mut plan = Plan::default();
    if held.newest > line.known {
        gaps.push(Gap::open(line.known + 1, held.newest, now_ms));
        line.known = held.newest;
    }
    let retention = format!(
        "{}: the board keeps seq {} and later only",
        GoneReason::Retention.word(),
        held.oldest
    );
    let mut out = Vec::with_capacity(gaps.len() + 1);
    for g in gaps.drain(..) {
        if !g.is_open() {
            out.push(g);
            continue;
        }
        let mut rest = g;
        if rest.first < held.oldest {
            let cut = rest.last.min(held.oldest - 1);
            let mut gone = rest.part(rest.first, cut);
            gone.gone = Some((retention.clone(), now_ms));
            plan.gone_rows += gone.rows();
            out.push(gone);
            if cut == rest.last {
                continue;
            }
            rest = rest.part(cut + 1, rest.last);
        }
        // Delivered (below `pending`) and held: what may be asked for.
        let lo = rest.first.max(held.oldest);
        let hi = rest.last.min(held.pending - 1).min(held.newest);
        if lo <= hi && rest.asks >= MAX_ASKS {
            let mut given = rest.part(lo, hi);
            given.gone = Some((GIVEN_UP.to_owned(), now_ms));
            plan.gone_rows += given.rows();
            out.push(given);
            if hi < rest.last {
                out.push(rest.part(hi + 1, rest.last));
            }
            continue;
        }
        if asking && lo <= hi && *budget > 0 && plan.ask.len() < MAX_ASK_RANGES {
            let take = (hi - lo + 1).min(*budget as i64);
            plan.ask.push((lo, lo + take - 1));
            *budget -= take as u64;
            rest.asks += 1;
            rest.asked_ms = Some(now_ms);
        }
        out.push(rest);
    }
    *gaps = out;
    plan
}

/// Give up the parts of `window` (the gaps overlapping the answer's
/// ranges, in order; replaced in place) that a board answered it cannot
/// send: `gone` as `(first, last, reason)`. Returns the rows given up.
pub fn on_gone(window: &mut Vec<Gap>, gone: &[(i64, i64, GoneReason)], now_ms: i64) -> u64 {
    let mut rows = 0;
    for &(f, l, why) in gone {
        let reason = format!("{}: the board answered it cannot send it", why.word());
        let mut out = Vec::with_capacity(window.len() + 2);
        for g in window.drain(..) {
            if !g.is_open() || g.last < f || g.first > l {
                out.push(g);
                continue;
            }
            if g.first < f {
                out.push(g.part(g.first, f - 1));
            }
            let mut gone = g.part(g.first.max(f), g.last.min(l));
            gone.gone = Some((reason.clone(), now_ms));
            rows += gone.rows();
            out.push(gone);
            if g.last > l {
                out.push(g.part(l + 1, g.last));
            }
        }
        *window = out;
    }
    rows
}

/// The contiguous mark of a stream: every sequence number up to it is
/// stored. `first_gap`: the first sequence number of its lowest gap (open
/// or gone), if any.
pub fn contiguous(line: &Line, first_gap: Option<i64>) -> i64 {
    match first_gap {
        Some(f) => f - 1,
        None => line.newest.min(line.known),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn firsts(seqs: impl IntoIterator<Item = i64>) -> Vec<(i64, bool)> {
        seqs.into_iter().map(|s| (s, true)).collect()
    }

    fn spans(gaps: &[Gap]) -> Vec<(i64, i64, bool)> {
        gaps.iter()
            .map(|g| (g.first, g.last, g.is_open()))
            .collect()
    }

    #[test]
    fn arrivals_in_order_leave_no_gap_and_a_jump_opens_one() {
        let mut line = Line::default();
        let mut w = Vec::new();
        assert_eq!(arrive(&mut line, &mut w, &firsts(1..=300), 5), 300);
        assert!(w.is_empty());
        assert_eq!(arrive(&mut line, &mut w, &firsts([305, 306]), 6), 2);
        assert_eq!(spans(&w), vec![(301, 304, true)]);
        assert_eq!((line.known, line.newest), (306, 306));
        assert_eq!(contiguous(&line, Some(301)), 300);
        // 302 fills the middle: two gaps, asks start over.
        w[0].asks = 3;
        assert_eq!(arrive(&mut line, &mut w, &firsts([302]), 7), 1);
        assert_eq!(spans(&w), vec![(301, 301, true), (303, 304, true)]);
        assert!(w.iter().all(|g| g.asks == 0 && g.since_ms == 6));
    }

    #[test]
    fn duplicates_are_reconciled_never_counted_as_progress() {
        let mut line = Line::default();
        let mut w = Vec::new();
        arrive(&mut line, &mut w, &firsts(1..=10), 1);
        // The same events again (duplicates): nothing moves.
        let dups: Vec<(i64, bool)> = (1..=10).map(|s| (s, false)).collect();
        assert_eq!(arrive(&mut line, &mut w, &dups, 2), 0);
        assert_eq!(line.repeats, 0);
        // Another event at a covered number: a repeat, not progress.
        assert_eq!(arrive(&mut line, &mut w, &[(4, true)], 3), 0);
        assert_eq!(line.repeats, 1);
        // A duplicate whose number the ledger had as missing closes it
        // (the database holds the event): reconciled.
        let mut w = vec![Gap::open(11, 20, 0)];
        line.known = 20;
        assert_eq!(arrive(&mut line, &mut w, &[(15, false)], 4), 1);
        assert_eq!(spans(&w), vec![(11, 14, true), (16, 20, true)]);
        // Nonsense numbers are no board's.
        assert_eq!(arrive(&mut line, &mut w, &[(0, true), (-5, true)], 5), 0);
    }

    #[test]
    fn holdings_open_the_lost_tail_give_up_what_retention_took_and_ask_for_the_rest() {
        // A database restored to seq 300 of 1,000; the board keeps 351..
        // and has delivered everything.
        let mut line = Line {
            known: 300,
            newest: 300,
            repeats: 0,
        };
        let mut gaps = Vec::new();
        let held = Held {
            oldest: 351,
            newest: 1000,
            pending: 1001,
        };
        let mut budget = MAX_ASK_ROWS;
        let plan = on_holdings(&mut line, &mut gaps, held, true, &mut budget, 9);
        assert_eq!(plan.ask, vec![(351, 1000)]);
        assert_eq!(plan.gone_rows, 50);
        assert_eq!(spans(&gaps), vec![(301, 350, false), (351, 1000, true)]);
        assert!(gaps[0]
            .gone
            .as_ref()
            .is_some_and(|(r, _)| r.starts_with("retention")));
        assert_eq!((gaps[1].asks, gaps[1].asked_ms), (1, Some(9)));
        assert_eq!(line.known, 1000);
        assert_eq!(budget, MAX_ASK_ROWS - 650);
    }

    #[test]
    fn rows_not_yet_delivered_are_not_asked_for_and_budgets_bound_a_request() {
        let mut line = Line {
            known: 10,
            newest: 10,
            repeats: 0,
        };
        let mut gaps = vec![Gap::open(3, 4, 0)];
        // The board has 1..=100 000 and has delivered up to 60 000.
        let held = Held {
            oldest: 1,
            newest: 100_000,
            pending: 60_001,
        };
        let mut budget = 1_000;
        let plan = on_holdings(&mut line, &mut gaps, held, true, &mut budget, 1);
        assert_eq!(plan.ask, vec![(3, 4), (11, 1008)]);
        assert_eq!(budget, 0);
        // Not asking (rate limit): nothing asked, gaps still opened.
        let mut line = Line::default();
        let mut gaps = Vec::new();
        let mut budget = 10;
        let plan = on_holdings(&mut line, &mut gaps, held, false, &mut budget, 1);
        assert!(plan.ask.is_empty());
        assert_eq!(spans(&gaps), vec![(1, 100_000, true)]);
    }

    #[test]
    fn a_gap_asked_too_often_is_given_up_never_waited_on_forever() {
        let mut line = Line {
            known: 20,
            newest: 20,
            repeats: 0,
        };
        let mut gaps = vec![Gap::open(5, 6, 0)];
        let held = Held {
            oldest: 1,
            newest: 20,
            pending: 21,
        };
        for i in 0..MAX_ASKS {
            let mut budget = MAX_ASK_ROWS;
            let plan = on_holdings(&mut line, &mut gaps, held, true, &mut budget, i as i64);
            assert_eq!(plan.ask, vec![(5, 6)]);
        }
        let mut budget = MAX_ASK_ROWS;
        let plan = on_holdings(&mut line, &mut gaps, held, true, &mut budget, 99);
        assert!(plan.ask.is_empty());
        assert_eq!(plan.gone_rows, 2);
        assert_eq!(gaps[0].gone.as_ref().map(|g| g.0.as_str()), Some(GIVEN_UP));
    }

    #[test]
    fn an_answer_gives_up_exactly_the_ranges_named() {
        let mut w = vec![Gap::open(301, 1000, 0)];
        let rows = on_gone(
            &mut w,
            &[
                (301, 350, GoneReason::Retention),
                (990, 2000, GoneReason::Beyond),
            ],
            5,
        );
        assert_eq!(rows, 50 + 11);
        assert_eq!(
            spans(&w),
            vec![(301, 350, false), (351, 989, true), (990, 1000, false)]
        );
        // A gone part stays gone when its rows come after all: they close it.
        let mut line = Line {
            known: 1000,
            newest: 1000,
            repeats: 0,
        };
        assert_eq!(arrive(&mut line, &mut w, &firsts([320]), 6), 1);
        assert_eq!(
            spans(&w),
            vec![
                (301, 319, false),
                (321, 350, false),
                (351, 989, true),
                (990, 1000, false)
            ]
        );
    }
}
