//! Groups: what the writer takes from its channel before it commits.
//!
//! Group commit of `full` streams: each pass takes one message, then every
//! message already queued behind it (those that arrived while the previous
//! commit's fsync ran), and commits the `full` readings among them in one
//! transaction: one fsync for the group, and each reading's reply only
//! after it. After a commit of two or more readings, the next group waits
//! for the clients that commit answered to send again (as many readings as
//! it held, beyond those already waiting), until that commit's time has
//! passed since it ended (at most [`MAX_STRAGGLER_WAIT`]): without it,
//! clients that each wait for their reply split into two halves that
//! commit in turn, half the clients per fsync (PostgreSQL's `commit_delay`
//! waits for the same reason). A reading after a commit of one, or of
//! less than [`STRAGGLER_WAIT_FROM`], or after that moment, commits at once.
//!
//! One rule: a group never grows past half the buffer's bound, so taking it
//! never makes the buffer refuse a reading a commit would have had room for.

use super::schedule::Deadlines;
use super::Writer;
use crate::event::stream::Durability;
use crate::intake::IngestMsg;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

/// The longest a `full` group waits for stragglers, however slow its
/// commits.
pub(super) const MAX_STRAGGLER_WAIT: Duration = Duration::from_millis(2);

/// A `full` group waits for stragglers only after a commit that took at
/// least this long (a slow card's sync). A faster commit costs less than
/// the clients' round trip: waiting for them idled the thread longer than
/// a second commit takes (8 clients on a disk syncing in 0.12 ms: 10,000
/// requests/s waiting, 12,000-15,000 without).
pub(super) const STRAGGLER_WAIT_FROM: Duration = Duration::from_micros(500);

/// The last `full` group commit that stored its readings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LastGroup {
    /// Readings it held.
    pub(super) readings: usize,
    /// How long its transaction took.
    pub(super) took: Duration,
    /// When it ended.
    pub(super) ended: Instant,
}

/// Whether the group being taken at `now` waits for stragglers: after
/// `last`, with `full` readings taken and `queued` of them waiting when the
/// pass began (sent during the last commit, so not by the clients it
/// answered). Returns how many `full` readings the group waits for and
/// until when.
pub(super) fn straggler_wait(
    last: Option<LastGroup>,
    full: usize,
    queued: usize,
    now: Instant,
) -> Option<(usize, Instant)> {
    let last = last?;
    if full == 0 || last.readings < 2 || last.took < STRAGGLER_WAIT_FROM {
        return None;
    }
    let want = queued.saturating_add(last.readings);
    let until = (last.ended + last.took).min(now + MAX_STRAGGLER_WAIT);
    Some((want, until))
}

impl Writer {
    /// Take one group: the first message (waiting until `next` for it),
    /// everything queued behind it, and the stragglers of the last `full`
    /// group ([`straggler_wait`]). `Err` when nothing came by `next`
    /// (`Timeout`) or the channel is closed (`Disconnected`).
    pub(super) fn take_a_group(
        &mut self,
        rx: &Receiver<IngestMsg>,
        at: &mut Deadlines,
        next: Instant,
    ) -> Result<(), RecvTimeoutError> {
        // A message already waiting was sent during the last pass; one
        // waited for came after it (from a client it answered, say).
        let (first, waiting) = match rx.try_recv() {
            Ok(m) => (m, true),
            Err(TryRecvError::Empty) => (
                rx.recv_timeout(next.saturating_duration_since(Instant::now()))?,
                false,
            ),
            Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
        };
        let before = self.buffer.len(Durability::Full);
        self.take(first, at);
        // Group commit: what queued behind it joins its commit, and what the
        // last group's clients send next.
        if !self.take_queued(rx, at) {
            return Err(RecvTimeoutError::Disconnected);
        }
        let queued = if waiting {
            self.buffer.len(Durability::Full).saturating_sub(before)
        } else {
            0
        };
        if !self.gather_stragglers(rx, at, queued) {
            return Err(RecvTimeoutError::Disconnected);
        }
        Ok(())
    }

    /// Handle one message of the channel. A count opens the commit window
    /// if none is open.
    fn take(&mut self, msg: IngestMsg, at: &mut Deadlines) {
        match msg {
            IngestMsg::Reading(ev) => self.push(ev),
            IngestMsg::Control(c) => {
                // A control request sees every `full` reading queued before
                // it committed (a reload may change a stream's durability;
                // a flush reports what is stored), as when each committed
                // on arrival.
                self.commit_full();
                self.control(c);
            }
            IngestMsg::Count { name, by } => {
                self.riding.count(name, by);
                // Rides the next commit: one write per window however many
                // arrive.
                at.open_window(Instant::now(), self.upkeep.window());
            }
            IngestMsg::Records { now } => {
                // Delivery records ride the next commit of readings (or
                // commit alone after their wait); a full batch of them
                // makes it now.
                if now {
                    at.close_window(Instant::now());
                } else {
                    at.records_waiting(Instant::now(), self.records_wait());
                }
            }
            IngestMsg::Wake => {}
        }
    }

    /// Take every message already queued (without waiting), until the
    /// channel is empty or a buffer is at half its bound: the group the
    /// next `full` commit commits with one fsync. What a client sent while
    /// the last fsync ran is queued here, so concurrent clients share
    /// commits without any timer. Returns false when the channel is closed.
    fn take_queued(&mut self, rx: &Receiver<IngestMsg>, at: &mut Deadlines) -> bool {
        while !self.buffer.group_is_full() {
            match rx.try_recv() {
                Ok(m) => self.take(m, at),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// Wait for stragglers ([`straggler_wait`]): take what arrives into this
    /// group until it holds what the last group's clients send, or the wait
    /// is over. Returns false when the channel is closed.
    fn gather_stragglers(
        &mut self,
        rx: &Receiver<IngestMsg>,
        at: &mut Deadlines,
        queued: usize,
    ) -> bool {
        let full = self.buffer.len(Durability::Full);
        let last = self.store.last_full_group();
        let Some((want, until)) = straggler_wait(last, full, queued, Instant::now()) else {
            return true;
        };
        while !self.buffer.group_is_full()
            && !self.buffer.is_empty(Durability::Full)
            && self.buffer.len(Durability::Full) < want
        {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match rx.recv_timeout(left) {
                Ok(m) => {
                    self.take(m, at);
                    if !self.take_queued(rx, at) {
                        return false;
                    }
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(readings: usize, took_us: u64, ended: Instant) -> Option<LastGroup> {
        Some(LastGroup {
            readings,
            took: Duration::from_micros(took_us),
            ended,
        })
    }

    #[test]
    fn a_group_waits_for_the_clients_a_slow_commit_of_several_answered() {
        let t = Instant::now();
        // 4 readings in a 1 ms commit that ended now: wait for 4 more
        // beyond the 1 already queued, until its time has passed again.
        assert_eq!(
            straggler_wait(group(4, 1000, t), 1, 1, t),
            Some((5, t + Duration::from_millis(1)))
        );
        // However slow the commit, at most MAX_STRAGGLER_WAIT from now.
        assert_eq!(
            straggler_wait(group(4, 50_000, t), 1, 0, t),
            Some((4, t + MAX_STRAGGLER_WAIT))
        );
    }

    #[test]
    fn a_reading_after_a_commit_of_one_or_a_fast_one_commits_at_once() {
        let t = Instant::now();
        assert_eq!(straggler_wait(None, 1, 0, t), None);
        assert_eq!(straggler_wait(group(1, 5_000, t), 1, 0, t), None);
        assert_eq!(
            straggler_wait(group(8, 120, t), 1, 0, t),
            None,
            "a fast disk"
        );
        // Only `full` readings wait: a batched one has its window.
        assert_eq!(straggler_wait(group(8, 5_000, t), 0, 0, t), None);
    }
}
