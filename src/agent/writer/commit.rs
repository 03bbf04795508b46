//! The commits: the writer's two spool connections (the config's
//! `synchronous` for `batched` streams, `synchronous = FULL` for `full`
//! ones), one transaction per commit with what rides it ([`super::riding`]:
//! counters, delivery records, agent state), the retry of a commit that
//! failed, and the refusals the upkeep decides.
//!
//! One rule: a reading is reported stored only after the transaction holding
//! it committed; a transient failure keeps it (and what rode with it) in
//! memory and retries with backoff, a refusal by policy is counted per
//! reason and stream.

use super::{buffer::MAX_BUFFERED, group::LastGroup, Writer};
use crate::event::envelope::{wall_clock_ms, EventIdGen};
use crate::event::stream::Durability;
use crate::flash::upkeep::{LogEvery, Refusing};
use crate::mqtt::DeliveryMsg;
use crate::spool::{Riders, Rode, Spool, SpoolError, WallClock};
use std::sync::atomic::Ordering;
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

    /// Append `events` with `riders` in one transaction on the connection
    /// of `durability`, or on the FULL one when `sync_here` (the window's
    /// commit then syncs the WAL itself).
    fn append(
        &mut self,
        (durability, sync_here): (Durability, bool),
        events: &[crate::spool::NewEvent],
        riders: &Riders<'_>,
        cfg: &crate::config::Config,
    ) -> Result<(usize, Rode), SpoolError> {
        let conn = match (sync_here, durability) {
            (true, _) | (false, Durability::Full) => &mut self.full,
            (false, Durability::Batched) => &mut self.batched,
        };
        // The rows' append time, and whether time sync has set the clock it
        // is read from: rows appended while it has not are kept by
        // retention from when it is ([`WallClock`]).
        let (now_ms, trusted) = wall_clock_ms();
        let clock = WallClock::judge(trusted, crate::os::clock::kernel_sync());
        let riders = Riders {
            clock: Some(clock),
            ..*riders
        };
        let appended = conn.append_riding(
            events,
            &mut self.ids,
            (&cfg.device_id, cfg.mqtt.payload_format),
            now_ms,
            &riders,
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

    /// Commit the buffered readings of `durability`, and what rides with
    /// them ([`super::riding`]), in one transaction; with no readings, what
    /// rides alone. Busy: keep both and retry (batched ones after the
    /// backoff, `full` ones at the loop's next pass). Disk full or over
    /// capacity: refuse the readings, counted (the counts ride).
    pub(super) fn commit(&mut self, durability: Durability) -> Option<Committed> {
        let waiting = durability == Durability::Batched
            && self.store.retry_at.is_some_and(|t| Instant::now() < t);
        if waiting {
            return None;
        }
        if !self.buffer.is_empty(durability) {
            let conn = self.store.conn(durability);
            if let Some(why) = self.upkeep.admit(conn, Instant::now()) {
                self.refuse(durability, why);
            }
        }
        if self.buffer.is_empty(durability) && !self.rides_waiting(Instant::now()) {
            return None;
        }
        let (committed, retrying) = self.append(durability);
        self.count_overflow(retrying);
        committed
    }

    /// Whether anything waits to ride a commit at `now`.
    pub(super) fn rides_waiting(&self, now: Instant) -> bool {
        self.riding.counts_waiting()
            || self.peers.ledger.waiting()
            || self.riding.states_due(now, self.state_period())
            || self.final_ride
    }

    /// How often agent state rides a commit at most: once a checkpoint
    /// interval (at most five minutes), since a page written more often is
    /// still copied back once per checkpoint ([`super::riding`]); the
    /// summary's records change once a summary interval anyway.
    pub(super) fn state_period(&self) -> Duration {
        self.upkeep
            .checkpoint_interval()
            .min(crate::flash::write_budget::MAX_CHECKPOINT_INTERVAL)
    }

    /// How long agent state waits for a commit to ride before it opens a
    /// window alone (an idle or offline board): a state period, at least a
    /// summary interval (what the summary wrote in a commit of its own
    /// before issue 35).
    pub(super) fn idle_state_period(&self) -> Duration {
        self.state_period()
            .max(self.conf.cfg.agent.summary_interval)
    }

    /// How long delivery records wait for a commit of readings to ride
    /// before they commit alone: a state period, at most a summary
    /// interval, at least the commit window.
    pub(super) fn records_wait(&self) -> Duration {
        self.state_period()
            .min(self.conf.cfg.agent.summary_interval)
            .max(self.upkeep.window())
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
        let now = Instant::now();
        let mut taken = self.peers.ledger.take();
        // The delivery thread's counters ride with the writer's own (and
        // are kept with them when the commit fails).
        for (name, by) in std::mem::take(&mut taken.counts) {
            self.riding.count(name, by);
        }
        let ride = self.riding.take(now, self.state_period(), self.final_ride);
        let riders = Riders {
            counts: &ride.counts,
            states: &ride.states,
            delivery: Some((&taken.sent, &taken.acked)),
            seqs: self.final_ride,
            // Judged where the commit's time is read (`Store::append`).
            clock: None,
        };
        let events = self.buffer.lane(durability);
        let appended = self
            .store
            .append((durability, sync_here), events, &riders, &self.conf.cfg);
        let rode = appended.as_ref().map(|(_, rode)| *rode);
        match rode {
            Ok(rode) => {
                self.riding.stored(&ride, now);
                if ride.states.iter().any(|(k, _)| k == "health") {
                    self.health.stored(now);
                }
                self.peers
                    .delivery_stats
                    .retired
                    .fetch_add(rode.retired as u64, Ordering::Relaxed);
                self.peers.ledger.committed(taken);
            }
            Err(_) => {
                self.riding.restore(ride);
                self.peers.ledger.restore(taken);
            }
        }
        match appended.map(|(rows, _)| rows) {
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
                if rows > 0 {
                    let _ = self.peers.to_delivery.send(DeliveryMsg::NewRows);
                }
                let taken = self.buffer.taken();
                let conn = self.store.conn(durability);
                self.upkeep.committed(conn, Instant::now(), (rows, taken));
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
        self.riding.count(format!("readings_dropped_{reason}"), n);
        for (stream, k) in by_stream {
            self.riding
                .count(format!("readings_dropped_{reason}.{stream}"), k);
        }
        n as usize
    }

    /// Count the readings the full buffer refused (the count rides the
    /// next commit), with one ERROR saying why the buffer was full.
    fn count_overflow(&mut self, retrying: bool) {
        let n = self.buffer.overflowed();
        if n == 0 {
            return;
        }
        self.riding
            .count("readings_dropped_buffer_full".to_owned(), n as i64);
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
