//! The readings waiting for their commit: `batched` ones for the commit
//! window, `full` ones for the loop's next group commit, under one bound in
//! readings and one in bytes.
//!
//! One rule: **the board's own sources always have room**: the socket and
//! the bridges never hold more than their budget
//! ([`crate::intake::budget`]), so the rest of the bound is theirs, and a
//! reading is refused (with a reply saying so, and counted) only when the
//! buffer is at its bound.

use crate::event::stream::Durability;
use crate::spool::NewEvent;
use std::collections::HashMap;

/// Readings of the board's own sources (`[[sources]]` other than bridges,
/// the agent's events) the buffer always has room for: the socket and the
/// bridges hold at most [`crate::intake::budget::INPUT_MAX_READINGS`] beside
/// them.
const OWN_RESERVED_READINGS: usize = 5_000;
/// Readings held in memory while the spool refuses writes (busy, full); past
/// this the newest are dropped and counted (`readings_dropped_buffer_full`).
pub(super) const MAX_BUFFERED: usize =
    OWN_RESERVED_READINGS + crate::intake::budget::INPUT_MAX_READINGS;
/// Bytes ([`NewEvent::heap_bytes`]) of the board's own readings the buffer
/// always has room for, beside `ingest.max_buffered_bytes` of socket and
/// bridge input: 16 MiB, 5,000 readings of about 3 KiB (a `system` sample
/// is about 2 KiB).
const OWN_RESERVED_BYTES: usize = 16 * 1024 * 1024;

/// Whether a buffer holding `readings` readings of `bytes` bytes takes one
/// more of `add` bytes under the bounds `max_readings` and `max_bytes`. An
/// empty buffer takes any one reading, however large: the byte bound must
/// never refuse every reading of a kind.
pub(super) fn admits(
    readings: usize,
    bytes: usize,
    add: usize,
    max_readings: usize,
    max_bytes: usize,
) -> bool {
    let over_bytes = bytes.saturating_add(add) > max_bytes && bytes > 0;
    readings < max_readings && !over_bytes
}

/// The writer's buffers ([`self`]).
#[derive(Debug)]
pub(super) struct Buffer {
    batched: Vec<NewEvent>,
    full: Vec<NewEvent>,
    /// [`NewEvent::heap_bytes`] of both buffers together.
    bytes: usize,
    /// The byte bound: `ingest.max_buffered_bytes` for the socket and the
    /// bridges, [`OWN_RESERVED_BYTES`] for the board's own readings.
    max_bytes: usize,
    /// Readings refused for a full buffer, not yet counted in the spool.
    overflowed: u64,
    /// Readings refused for a full buffer since health last looked.
    overflowed_since_health: u64,
    /// Readings taken in since start (a running total, for the write
    /// budget's rate).
    taken: u64,
}

impl Buffer {
    /// Empty buffers for `ingest.max_buffered_bytes` of socket and bridge
    /// input (it changes at a restart only).
    pub(super) fn new(input_max_bytes: usize) -> Buffer {
        Buffer {
            batched: Vec::new(),
            full: Vec::new(),
            bytes: 0,
            max_bytes: input_max_bytes.saturating_add(OWN_RESERVED_BYTES),
            overflowed: 0,
            overflowed_since_health: 0,
            taken: 0,
        }
    }

    /// Readings taken in since start (refused ones not counted).
    pub(super) fn taken(&self) -> u64 {
        self.taken
    }

    /// Take `ev` into the buffer of its stream's `durability`, or refuse it
    /// (its producer told so, counted) when the buffers hold
    /// [`MAX_BUFFERED`] readings or their byte bound. False when refused.
    pub(super) fn push(&mut self, ev: NewEvent, durability: Durability) -> bool {
        let add = ev.heap_bytes();
        let readings = self.batched.len() + self.full.len();
        if !admits(readings, self.bytes, add, MAX_BUFFERED, self.max_bytes) {
            ev.refuse("not stored: the agent's in-memory buffer is full (the spool is not keeping up); retry later");
            self.overflowed += 1;
            self.overflowed_since_health += 1;
            return false;
        }
        self.bytes += add;
        self.taken += 1;
        self.lane_mut(durability).push(ev);
        true
    }

    /// The readings of one durability, oldest first.
    pub(super) fn lane(&self, durability: Durability) -> &[NewEvent] {
        match durability {
            Durability::Batched => &self.batched,
            Durability::Full => &self.full,
        }
    }

    fn lane_mut(&mut self, durability: Durability) -> &mut Vec<NewEvent> {
        match durability {
            Durability::Batched => &mut self.batched,
            Durability::Full => &mut self.full,
        }
    }

    /// Readings of one durability waiting.
    pub(super) fn len(&self, durability: Durability) -> usize {
        self.lane(durability).len()
    }

    /// No reading of this durability waits.
    pub(super) fn is_empty(&self, durability: Durability) -> bool {
        self.lane(durability).is_empty()
    }

    /// Bytes of every reading waiting.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The byte bound.
    pub(super) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// The batched buffer holds half the bound (readings or bytes): commit
    /// now, whatever the window (a budget's wide window stops at the bound,
    /// and the rest is room for a commit that fails and retries).
    pub(super) fn half_full(&self) -> bool {
        self.batched.len() >= MAX_BUFFERED / 2 || self.bytes >= self.max_bytes / 2
    }

    /// Whether the loop stops taking queued messages and commits: either
    /// buffer at half its bound, so a group never makes [`Buffer::push`]
    /// refuse a reading that a commit now would have had room for.
    pub(super) fn group_is_full(&self) -> bool {
        self.half_full() || self.full.len() >= MAX_BUFFERED / 2
    }

    /// Empty one durability's buffer (committed), giving its bytes back.
    pub(super) fn clear(&mut self, durability: Durability) {
        let lane = self.lane_mut(durability);
        let freed: usize = lane.iter().map(NewEvent::heap_bytes).sum();
        lane.clear();
        self.bytes = self.bytes.saturating_sub(freed);
    }

    /// Refuse every reading of one durability with `why` (each producer is
    /// told) and empty it. Returns how many were refused, per stream.
    pub(super) fn refuse(&mut self, durability: Durability, why: &str) -> HashMap<String, i64> {
        let mut by_stream: HashMap<String, i64> = HashMap::new();
        for ev in self.lane(durability) {
            *by_stream.entry(ev.stream.clone()).or_default() += 1;
            ev.refuse(why);
        }
        self.clear(durability);
        by_stream
    }

    /// Readings refused for a full buffer not yet counted in the spool.
    pub(super) fn overflowed(&self) -> u64 {
        self.overflowed
    }

    /// Those readings are counted now.
    pub(super) fn overflow_counted(&mut self) {
        self.overflowed = 0;
    }

    /// Readings refused for a full buffer since the last call (health's).
    pub(super) fn take_overflowed_since_health(&mut self) -> u64 {
        std::mem::take(&mut self.overflowed_since_health)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::reading::FieldValue;

    fn reading(text: &str) -> NewEvent {
        NewEvent {
            replay: None,
            stream: "s".into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("t".into(), FieldValue::Text(text.into()))],
            key: None,
            reply: None,
        }
    }

    #[test]
    fn a_reading_is_refused_at_the_count_or_the_byte_bound() {
        assert!(admits(0, 0, 10, 2, 100));
        assert!(admits(1, 90, 10, 2, 100));
        assert!(!admits(2, 0, 1, 2, 100), "the count bound");
        assert!(!admits(1, 91, 10, 2, 100), "the byte bound");
        // An empty buffer takes one reading of any size.
        assert!(admits(0, 0, 1_000, 2, 100));
    }

    #[test]
    fn readings_go_to_the_buffer_of_their_durability_and_give_their_bytes_back() {
        let mut b = Buffer::new(0);
        assert!(b.push(reading("a"), Durability::Batched));
        assert!(b.push(reading("b"), Durability::Full));
        assert_eq!(
            (b.len(Durability::Batched), b.len(Durability::Full)),
            (1, 1)
        );
        let both = b.bytes();
        b.clear(Durability::Full);
        assert!(b.is_empty(Durability::Full));
        assert!(b.bytes() < both && b.bytes() > 0);
        let refused = b.refuse(Durability::Batched, "full");
        assert_eq!(refused.get("s"), Some(&1));
        assert_eq!(b.bytes(), 0);
    }

    #[test]
    fn a_full_buffer_refuses_and_counts_for_the_spool_and_for_health() {
        let mut b = Buffer::new(0);
        // The byte bound is the board's reserve here: fill past it.
        let big = "x".repeat(OWN_RESERVED_BYTES / 2);
        assert!(b.push(reading(&big), Durability::Batched));
        assert!(b.half_full(), "half the bytes: commit now");
        assert!(b.group_is_full());
        assert!(
            !b.push(reading(&big), Durability::Full),
            "past the byte bound"
        );
        assert_eq!(b.overflowed(), 1);
        assert!(b.is_empty(Durability::Full));
        assert_eq!(b.take_overflowed_since_health(), 1);
        assert_eq!(b.take_overflowed_since_health(), 0);
        assert_eq!(b.overflowed(), 1, "still to be counted in the spool");
        b.overflow_counted();
        assert_eq!(b.overflowed(), 0);
    }
}
