//! The ledger's steps over a store ([`Books`]): events stored in a batch
//! ([`record`]), and boards' holdings and answers ([`apply_notes`]), each
//! inside the caller's transaction.
//!
//! Its one rule: **one (device, stream) at a time, in key order, its line
//! read before its gaps and written after them**: a store whose reads lock
//! (PostgreSQL's `FOR UPDATE`) then locks lines in the same order in every
//! sink, so two sinks storing one board's events wait for each other and
//! never deadlock; SQLite's `IMMEDIATE` transaction holds the whole file.

use super::{arrive, contiguous, on_gone, on_holdings, Gap, Line};
use super::{ASK_EVERY_MS, GAPS_PER_PASS, MAX_ASK_ROWS};
use crate::event::backfill::{Held, Note, Token};
use crate::sink::batch::{Fate, Item};
use crate::sink::notes::{Ask, BoardNote};
use std::collections::BTreeMap;

/// A (device, stream) of the ledger.
pub type Key = (String, String);

/// What the ledger keeps of a board.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Board {
    /// Its `topic_prefix`, from the topic of its last holdings.
    pub prefix: String,
    /// The nonce of its last holdings.
    pub nonce: Option<Token>,
    /// When its last holdings came, Unix ms.
    pub holdings_ms: Option<i64>,
    /// When it was last asked for rows, Unix ms.
    pub asked_ms: Option<i64>,
    /// Requests made of it.
    pub asks: i64,
    /// Rows asked for, all requests.
    pub asked_rows: i64,
    /// Rows given up (the board no longer holds them, or sent none).
    pub gone_rows: i64,
}

/// A line as stored, with its contiguous mark and the board's last word.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stored {
    /// The line.
    pub line: Line,
    /// Every sequence number up to this is stored.
    pub contiguous: i64,
    /// The board's last holdings of this stream, and when they came.
    pub held: Option<(Held, i64)>,
}

/// Where the ledger lives: one transaction of a store. Every call is part
/// of the caller's transaction; errors abort it.
pub trait Books {
    /// The store's error.
    type Error;
    /// The lines of `keys` (sorted, distinct), created empty where missing,
    /// in the same order; a store with row locks takes them here.
    fn lines(&mut self, keys: &[Key]) -> Result<Vec<Stored>, Self::Error>;
    /// The gaps of `key` (open or gone) overlapping `lo..=hi`, in order.
    fn gaps(&mut self, key: &Key, lo: i64, hi: i64) -> Result<Vec<Gap>, Self::Error>;
    /// The first `limit` open gaps of `key`, in order.
    fn open_gaps(&mut self, key: &Key, limit: usize) -> Result<Vec<Gap>, Self::Error>;
    /// Replace the gaps of `key` starting at `old` by `new`.
    fn replace_gaps(&mut self, key: &Key, old: &[i64], new: &[Gap]) -> Result<(), Self::Error>;
    /// The first sequence number of the lowest gap of `key` (open or gone).
    fn first_gap(&mut self, key: &Key) -> Result<Option<i64>, Self::Error>;
    /// Write the lines back.
    fn put_lines(&mut self, lines: &[(Key, Stored)], now_ms: i64) -> Result<(), Self::Error>;
    /// The board `device` (locked where the store locks rows); `None`: never seen.
    fn board(&mut self, device: &str) -> Result<Option<Board>, Self::Error>;
    /// Write the board back.
    fn put_board(&mut self, device: &str, b: &Board) -> Result<(), Self::Error>;
}

/// A stored event's place in the ledger: its device and stream (the
/// topic's), its sequence number, and whether the event was new to the
/// database (first stored) or found there (a duplicate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// Device and stream.
    pub key: Key,
    /// Its `seq`.
    pub seq: i64,
    /// First stored by this transaction.
    pub first: bool,
}

/// The ledger's view of a committed batch: every event the database now
/// holds with the bytes delivered (first stored, or a duplicate), by the
/// device and stream its topic names (checked when it was read).
pub fn arrivals(items: &[Item], fates: &[Fate]) -> Vec<Arrival> {
    items
        .iter()
        .zip(fates)
        .filter(|(_, f)| f.held())
        .filter_map(|(it, f)| {
            let e = it.read.as_ref().ok()?;
            Some(Arrival {
                key: (e.device_id.clone(), e.stream.clone()),
                seq: e.seq,
                first: *f == Fate::First,
            })
        })
        .collect()
}

/// Apply a batch's stored events to the ledger. Returns the sequence
/// numbers that were new to it.
///
/// Errors: the store's.
pub fn record<B: Books>(b: &mut B, arrivals: &[Arrival], now_ms: i64) -> Result<u64, B::Error> {
    let mut by: BTreeMap<&Key, Vec<(i64, bool)>> = BTreeMap::new();
    for a in arrivals {
        by.entry(&a.key).or_default().push((a.seq, a.first));
    }
    if by.is_empty() {
        return Ok(0);
    }
    let keys: Vec<Key> = by.keys().map(|k| (*k).clone()).collect();
    let lines = b.lines(&keys)?;
    let mut progress = 0;
    let mut out = Vec::with_capacity(keys.len());
    for ((key, seqs), mut st) in by.into_iter().zip(lines) {
        let lo = seqs.iter().map(|s| s.0).min().unwrap_or(0);
        let hi = seqs.iter().map(|s| s.0).max().unwrap_or(0);
        let before = st.line;
        // Gaps lie at or below `known`: a batch wholly above it (the live
        // flow) touches none, and costs no read of them.
        let mut window = match lo <= st.line.known {
            true => b.gaps(key, lo.max(1), hi)?,
            false => Vec::new(),
        };
        let old: Vec<i64> = window.iter().map(|g| g.first).collect();
        let snapshot = window.clone();
        progress += arrive(&mut st.line, &mut window, &seqs, now_ms);
        let gaps_changed = window != snapshot;
        if gaps_changed {
            b.replace_gaps(key, &old, &window)?;
        }
        if st.line == before && !gaps_changed {
            continue;
        }
        st.contiguous = match gaps_changed || st.contiguous != before.newest {
            // Gaps below, or some moved: ask the store.
            true => contiguous(&st.line, b.first_gap(key)?),
            false => st.line.newest,
        };
        out.push((key.clone(), st));
    }
    b.put_lines(&out, now_ms)?;
    Ok(progress)
}

/// What boards' notes did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NotesDone {
    /// Requests to send (signed by the caller).
    pub asks: Vec<Ask>,
    /// Rows given up.
    pub gone_rows: u64,
    /// Notes applied.
    pub applied: u64,
}

/// Apply boards' holdings and answers to the ledger; with `asking` (the
/// sink can sign requests), a board heard from whose last request is
/// [`ASK_EVERY_MS`] old or more is asked for what it delivered, still
/// holds and the database lacks (at most [`MAX_ASK_ROWS`] rows).
///
/// Errors: the store's.
pub fn apply_notes<B: Books>(
    b: &mut B,
    notes: &[BoardNote],
    asking: bool,
    now_ms: i64,
) -> Result<NotesDone, B::Error> {
    let mut done = NotesDone::default();
    let mut sorted: Vec<&BoardNote> = notes.iter().collect();
    sorted.sort_by(|x, y| x.device.cmp(&y.device));
    for n in sorted {
        match &n.note {
            Note::Holdings(h) => {
                let mut board = b.board(&n.device)?.unwrap_or_default();
                board.prefix = n.prefix.clone();
                board.nonce = Some(h.nonce);
                board.holdings_ms = Some(now_ms);
                let due = board
                    .asked_ms
                    .is_none_or(|t| now_ms.saturating_sub(t) >= ASK_EVERY_MS);
                let mut budget = MAX_ASK_ROWS;
                let (ranges, gone) =
                    holdings(b, &n.device, &h.streams, asking && due, &mut budget, now_ms)?;
                board.gone_rows += gone as i64;
                done.gone_rows += gone;
                if !ranges.is_empty() {
                    let ask = Ask {
                        device: n.device.clone(),
                        prefix: n.prefix.clone(),
                        nonce: h.nonce,
                        ranges,
                    };
                    board.asked_ms = Some(now_ms);
                    board.asks += 1;
                    board.asked_rows += ask.rows() as i64;
                    done.asks.push(ask);
                }
                b.put_board(&n.device, &board)?;
            }
            Note::Answer(a) => {
                let gone = answer(b, &n.device, &a.gone, now_ms)?;
                if gone > 0 {
                    let mut board = b.board(&n.device)?.unwrap_or_default();
                    if board.prefix.is_empty() {
                        board.prefix = n.prefix.clone();
                    }
                    board.gone_rows += gone as i64;
                    b.put_board(&n.device, &board)?;
                }
                done.gone_rows += gone;
            }
        }
        done.applied += 1;
    }
    Ok(done)
}

type Ranges = Vec<(String, Vec<(i64, i64)>)>;

/// One board's holdings, stream by stream: the ranges to ask for, and the
/// rows given up.
fn holdings<B: Books>(
    b: &mut B,
    device: &str,
    streams: &[(String, Held)],
    asking: bool,
    budget: &mut u64,
    now_ms: i64,
) -> Result<(Ranges, u64), B::Error> {
    let mut sorted: Vec<&(String, Held)> = streams.iter().collect();
    sorted.sort_by(|x, y| x.0.cmp(&y.0));
    let keys: Vec<Key> = sorted
        .iter()
        .map(|(s, _)| (device.to_owned(), s.clone()))
        .collect();
    let lines = b.lines(&keys)?;
    let (mut ranges, mut gone, mut out) = (Vec::new(), 0, Vec::new());
    for ((key, (_, held)), mut st) in keys.iter().zip(sorted).zip(lines) {
        let mut gaps = b.open_gaps(key, GAPS_PER_PASS)?;
        let old: Vec<i64> = gaps.iter().map(|g| g.first).collect();
        let snapshot = gaps.clone();
        let plan = on_holdings(&mut st.line, &mut gaps, *held, asking, budget, now_ms);
        if gaps != snapshot {
            b.replace_gaps(key, &old, &gaps)?;
        }
        st.contiguous = contiguous(&st.line, b.first_gap(key)?);
        st.held = Some((*held, now_ms));
        gone += plan.gone_rows;
        if !plan.ask.is_empty() {
            ranges.push((key.1.clone(), plan.ask));
        }
        out.push((key.clone(), st));
    }
    b.put_lines(&out, now_ms)?;
    Ok((ranges, gone))
}

/// A board's answer: the ranges it cannot send, given up.
fn answer<B: Books>(
    b: &mut B,
    device: &str,
    gone: &crate::event::backfill::GoneRanges,
    now_ms: i64,
) -> Result<u64, B::Error> {
    let mut sorted: Vec<&(String, Vec<_>)> = gone.iter().filter(|(_, r)| !r.is_empty()).collect();
    sorted.sort_by(|x, y| x.0.cmp(&y.0));
    let keys: Vec<Key> = sorted
        .iter()
        .map(|(s, _)| (device.to_owned(), s.clone()))
        .collect();
    let lines = b.lines(&keys)?;
    let (mut rows, mut out) = (0, Vec::new());
    for ((key, (_, ranges)), mut st) in keys.iter().zip(sorted).zip(lines) {
        let lo = ranges.iter().map(|r| r.0).min().unwrap_or(1);
        let hi = ranges.iter().map(|r| r.1).max().unwrap_or(0);
        let mut window = b.gaps(key, lo, hi)?;
        let old: Vec<i64> = window.iter().map(|g| g.first).collect();
        let n = on_gone(&mut window, ranges, now_ms);
        if n > 0 {
            b.replace_gaps(key, &old, &window)?;
            st.contiguous = contiguous(&st.line, b.first_gap(key)?);
            out.push((key.clone(), st));
        }
        rows += n;
    }
    b.put_lines(&out, now_ms)?;
    Ok(rows)
}
