//! What rides a commit of readings: the bookkeeping that must reach the
//! file (delivery records, the sequence book) or may (counters, agent
//! state), written in the same transaction as the readings instead of a
//! commit of its own (issue 35: bookkeeping commits were the larger part of
//! what a slow board wrote).
//!
//! One rule: **a rider never makes a commit happen**; it is written by the
//! next commit the writer makes anyway (a commit window of readings, or one
//! the rider's own deadline opens), and it is kept for the next one when
//! that commit fails.

use super::seqs::{SeqBook, StreamSeq};
use super::{SpoolError, SQL_COUNTER_ADD, SQL_SET_STATE};
use rusqlite::params;
use std::collections::HashMap;

/// What rides one append transaction besides its rows
/// ([`super::Spool::append_riding`]). The clock ([`Riders::clock`]) is no
/// rider of its own: it never makes a commit happen, so [`Riders::is_empty`]
/// ignores it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Riders<'a> {
    /// Counter increments (`counters`), name and amount.
    pub counts: &'a [(String, i64)],
    /// `agent_state` entries, key and value, stamped with the append's time.
    pub states: &'a [(String, String)],
    /// Delivery records ([`super::Spool::record_delivery`]): rows submitted
    /// (only the highest counts) and rows acknowledged.
    pub delivery: Option<(&'a [i64], &'a [i64])>,
    /// Write the sequence book (`streams.last_seq` and the row id it covers,
    /// [`super::Spool::persist_seqs`]).
    pub seqs: bool,
    /// The wall clock the commit's time was read from: a span of rows
    /// appended before the clock was set (schema 13's `clock_spans`) opens
    /// or closes with this commit when it changed ([`super::WallClock`]);
    /// nothing is written when it did not. `None`: the appender does not
    /// say (tests, tools), and no span opens or closes.
    pub clock: Option<super::WallClock>,
}

impl Riders<'_> {
    /// Nothing rides.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
            && self.states.is_empty()
            && self
                .delivery
                .is_none_or(|(s, a)| s.is_empty() && a.is_empty())
            && !self.seqs
    }
}

/// What the riders of one commit did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rode {
    /// Rows the delivery records retired.
    pub retired: usize,
    /// The sequence book was written.
    pub seqs: bool,
}

/// Write `riders` inside `tx`. `book` is the sequence book as it stands,
/// `issued` the numbers this transaction issued (not in the book until it
/// commits).
pub(super) fn ride(
    tx: &rusqlite::Transaction<'_>,
    err: &dyn Fn(rusqlite::Error) -> SpoolError,
    riders: &Riders<'_>,
    (book, issued): (&SeqBook, &HashMap<String, StreamSeq>),
    now_ms: i64,
) -> Result<Rode, SpoolError> {
    let mut rode = Rode::default();
    if let Some((sent, acked)) = riders.delivery {
        if !sent.is_empty() || !acked.is_empty() {
            rode.retired = super::delivery::fold_in(tx, err, sent, acked)?;
        }
    }
    if !riders.counts.is_empty() {
        let mut st = tx.prepare_cached(SQL_COUNTER_ADD).map_err(err)?;
        for (name, by) in riders.counts {
            st.execute(params![name, by]).map_err(err)?;
        }
    }
    if !riders.states.is_empty() {
        let mut st = tx.prepare_cached(SQL_SET_STATE).map_err(err)?;
        for (key, value) in riders.states {
            st.execute(params![key, value, now_ms]).map_err(err)?;
        }
    }
    if riders.seqs && (book.dirty || !issued.is_empty()) {
        let seqs: Vec<StreamSeq> = book
            .streams
            .iter()
            .filter(|(name, _)| !issued.contains_key(*name))
            .chain(issued.iter())
            .map(|(_, s)| *s)
            .collect();
        super::seqs::write_seqs(tx, err, &seqs)?;
        rode.seqs = true;
    }
    Ok(rode)
}
