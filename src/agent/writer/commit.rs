//! The commits: the writer's two spool connections (the config's
//! `synchronous` for `batched` streams, `synchronous = FULL` for `full`
//! ones), one transaction per commit, the retry of a commit that failed,
//! the refusals the upkeep decides, and the counters waiting to be stored.
//!
//! One rule: a reading is reported stored only after the transaction holding
//! it committed; a transient failure keeps it in memory and retries with
//! backoff, a refusal by policy is counted per reason and stream.

use super::{buffer::MAX_BUFFERED, group::LastGroup, Writer};
use crate::event::envelope::{wall_clock_ms, EventIdGen};
use crate::event::stream::Durability;
use crate::flash::upkeep::{LogEvery, Refusing};
use crate::mqtt::DeliveryMsg;
use crate::spool::{Spool, SpoolError};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A commit that stored its readings: how many, how long its transaction
/// took (append to commit, no checkpoint or capacity check), when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Committed {
    pub(super) rows: usize,
    pub(super) took: Duration,
    pub(super) ended: Instant,
}

/// The spool connections and what committing into them leaves ([`self`]).
pub(super) struct Store {
    /// The writer's connection (the config's `synchronous`).
    batched: Spool,
    /// `synchronous = FULL`: `full` streams, and a window's sync when a
    /// wide window stretched the checkpoint interval.
    full: Spool,
    ids: EventIdGen,
    /// Readings appended this run.
    appended: u64,
    /// A batched commit failed transiently: the next waits until then.
    retry_at: Option<Instant>,
    /// Backoff for storage writes that failed transiently (busy, I/O).
    backoff: crate::os::backoff::Backoff,
    /// Failed commits, logged every 30 s at most.
    errors: LogEvery,
    /// Counter increments not yet stored (a full disk refuses them too).
    pending_counts: HashMap<String, i64>,
    /// Commits on the `synchronous = FULL` connection (each an fsync).
    full_commits: u64,
    /// The last `full` group commit that stored its readings (the next
    /// group waits for its clients, [`super::group`]).
    last_full_group: Option<LastGroup>,
}

impl Store {
    pub(super) fn new(
        batched: Spool,
        full: Spool,
        ids: EventIdGen,
        backoff: crate::os::backoff::Backoff,
    ) -> Store {
        Store {
            batched,
            full,
            ids,
            appended: 0,
            retry_at: None,
            backoff,
            errors: LogEvery::new(Duration::from_secs(30)),
            pending_counts: HashMap::new(),
            full_commits: 0,
            last_full_group: None,
        }
    }

    /// The connection readings of `durability` commit on.
    pub(super) fn conn(&mut self, durability: Durability) -> &mut Spool {
        match durability {
            Durability::Batched => &mut self.batched,
            Durability::Full => &mut self.full,
        }
    }

    /// The writer's connection, to read from.
    pub(super) fn spool(&self) -> &Spool {
        &self.batched
    }

    /// Readings appended this run.
    pub(super) fn appended(&self) -> u64 {
        self.appended
    }

    /// Commits on the `synchronous = FULL` connection this run.
    pub(super) fn full_commits(&self) -> u64 {
        self.full_commits
    }

    /// The last `full` group commit that stored its readings.
    pub(super) fn last_full_group(&self) -> Option<LastGroup> {
        self.last_full_group
    }

    /// When a failed batched commit retries.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// The next batched commit goes ahead whatever the backoff said (a
    /// flush, the stop).
    pub(super) fn retry_now(&mut self) {
        self.retry_at = None;
    }

    /// Add `by` to the counter `name`, stored with the next commit.
    pub(super) fn add_count(&mut self, name: String, by: i64) {
        *self.pending_counts.entry(name).or_default() += by;
    }

    /// Store pending counter increments in one transaction on the
    /// connection of `durability`; kept on failure (a full disk) and
    /// retried, so no drop goes uncounted.
    pub(super) fn flush_counts(&mut self, durability: Durability) {
        if self.pending_counts.is_empty() {
            return;
        }
        let counts: Vec<(String, i64)> = self
            .pending_counts
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        if self.conn(durability).count_many(&counts).is_ok() {
            self.pending_counts.clear();
        }
    }

    /// Append `events` in one transaction on the connection of
    /// `durability`, or on the FULL one when `sync_here` (the window's
    /// commit then syncs the WAL itself).
    fn append(
        &mut self,
        durability: Durability,
        sync_here: bool,
        events: &[crate::spool::NewEvent],
        cfg: &crate::config::Config,
    ) -> Result<usize, SpoolError> {
        let conn = match (sync_here, durability) {
            (true, _) | (false, Durability::Full) => &mut self.full,
            (false, Durability::Batched) => &mut self.batched,
        };
        let appended = conn.append(
            events,
            &mut self.ids,
            &cfg.device_id,
            cfg.mqtt.payload_format,
            wall_clock_ms().0,
        );
        if sync_here {
            self.full_commits += u64::from(appended.is_ok());
        }
        appended
    }
}

impl Writer {
    /// Commit the full-durability readings taken so far, in one transaction
    /// on the FULL connection (one fsync for the group; each reply is sent
    /// after it). A commit that stored readings is the group the next one
    /// waits for stragglers after ([`super::group`]).
    pub(super) fn commit_full(&mut self) {
        if self.buffer.is_empty(Durability::Full) {
            return;
        }
        let group = self.buffer.len(Durability::Full);
        let committed = self.commit(Durability::Full);
        if self.buffer.is_empty(Durability::Full) {
            self.store.full_commits += 1;
        }
        if let Some(c) = committed.filter(|c| c.rows > 0) {
            // Stored (not refused by policy): its clients will send again.
            self.store.last_full_group = Some(LastGroup {
                readings: group,
                took: c.took,
                ended: c.ended,
            });
        }
    }

    /// Commit the buffered readings of `durability` in one transaction.
    /// Busy: keep them and retry (batched ones after the backoff, `full`
    /// ones at the loop's next pass). Disk full or over capacity: refuse
    /// them, counted.
    pub(super) fn commit(&mut self, durability: Durability) -> Option<Committed> {
        self.store.flush_counts(durability);
        let waiting = durability == Durability::Batched
            && self.store.retry_at.is_some_and(|t| Instant::now() < t);
        if self.buffer.is_empty(durability) || waiting {
            return None;
        }
        let conn = self.store.conn(durability);
        if let Some(why) = self.upkeep.admit(conn, Instant::now()) {
            self.refuse(durability, why);
            return None;
        }
        let (committed, retrying) = self.append(durability);
        self.count_overflow(durability, retrying);
        committed
    }

    /// The append of a commit the upkeep admitted, and what follows it.
    /// Returns the commit, and whether a transient failure keeps the
    /// readings for a retry.
    fn append(&mut self, durability: Durability) -> (Option<Committed>, bool) {
        let started = Instant::now();
        // A wide window stretches the checkpoint interval (the WAL's only
        // sync under `synchronous = NORMAL`): the window's commit then syncs
        // the WAL itself, on the FULL connection, so a power cut still loses
        // at most the open window, not the commits since the last
        // checkpoint. A sync adds no bytes; the pages are written once either
        // way.
        let sync_here = self.store.conn(durability).pragmas().synchronous < 2
            && self.upkeep.checkpoint_stretched();
        let events = self.buffer.lane(durability);
        match self
            .store
            .append(durability, sync_here, events, &self.conf.cfg)
        {
            Ok(rows) => {
                let c = Committed {
                    rows,
                    took: started.elapsed(),
                    ended: Instant::now(),
                };
                self.metrics.commit.observe(c.took);
                self.store.appended += rows as u64;
                self.buffer.clear(durability);
                if durability == Durability::Batched {
                    self.store.retry_at = None;
                }
                self.store.backoff.reset();
                let _ = self.peers.to_delivery.send(DeliveryMsg::NewRows);
                let conn = self.store.conn(durability);
                self.upkeep.committed(conn, Instant::now());
                (Some(c), false)
            }
            Err(SpoolError::Full { source, .. }) => {
                // A half-written transaction was rolled back; nothing partial stays.
                self.upkeep.hit_disk_full();
                let n = self.drop_buffer(durability, "disk_full");
                if self.upkeep.refusal_log_due(Instant::now()) {
                    log::error!("ingest: disk full ({source}); {n} readings refused, counted as readings_dropped_disk_full (repeats logged every 30 s)");
                }
                (None, false)
            }
            Err(e) => {
                let at = Instant::now() + self.store.backoff.next_delay();
                if durability == Durability::Batched {
                    self.store.retry_at = Some(at);
                }
                if self.store.errors.due(Instant::now()) {
                    log::error!(
                        "ingest: commit of {} readings failed: {e}; kept in memory and retried (repeats logged every 30 s)",
                        self.buffer.len(durability)
                    );
                }
                (None, true)
            }
        }
    }

    /// Refuse the buffered readings of `durability` for `why`, as the
    /// upkeep decided before the commit.
    fn refuse(&mut self, durability: Durability, why: Refusing) {
        let n = self.drop_buffer(durability, why.reason());
        if let Refusing::Capacity(r) = why {
            if self.upkeep.refusal_log_due(Instant::now()) {
                log::error!("capacity: refusing new readings ({r}); {n} dropped now, counted as readings_dropped_{} (repeats logged every 30 s)", r.reason());
            }
        }
    }

    /// Refuse every buffered reading of `durability` as dropped for
    /// `reason`, counted in all and per stream. Returns how many.
    fn drop_buffer(&mut self, durability: Durability, reason: &str) -> usize {
        let why = format!("not stored: the spool refused new readings ({reason}); retry later");
        let by_stream = self.buffer.refuse(durability, &why);
        let n: i64 = by_stream.values().sum();
        self.metrics.dropped += n as u64;
        self.store
            .add_count(format!("readings_dropped_{reason}"), n);
        for (stream, k) in by_stream {
            self.store
                .add_count(format!("readings_dropped_{reason}.{stream}"), k);
        }
        self.store.flush_counts(durability);
        n as usize
    }

    /// Store the count of readings the full buffer refused, with one ERROR
    /// saying why the buffer was full.
    fn count_overflow(&mut self, durability: Durability, retrying: bool) {
        let n = self.buffer.overflowed();
        if n == 0
            || self
                .store
                .conn(durability)
                .count("readings_dropped_buffer_full", n as i64)
                .is_err()
        {
            return;
        }
        let why = if retrying || self.upkeep.disk_full() {
            "while the spool refused writes"
        } else {
            "readings arrived faster than the spool could commit them"
        };
        log::error!(
            "ingest: {n} readings dropped, counted as readings_dropped_buffer_full: the in-memory buffer ({MAX_BUFFERED} readings, {} bytes) was full {why}",
            self.buffer.max_bytes()
        );
        self.buffer.overflow_counted();
    }
}
