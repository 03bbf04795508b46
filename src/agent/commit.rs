//! The ingest thread's commit loop: readings from every producer wait in a
//! buffer for their commit window (or, for `full` streams, commit on the
//! `synchronous = FULL` connection as soon as the loop comes round), and are
//! refused by name when the spool or the disk is at its limit.
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
//! One rule: a reading is reported stored only after the transaction holding
//! it committed; a transient failure keeps it in memory and retries with
//! backoff, a refusal by policy is counted per reason and stream.

use super::upkeep::MAINTENANCE_AGAIN;
use super::{spool_dir, Ingest, MAX_BUFFERED, OWN_RESERVED_BYTES};
use crate::delivery::DeliveryStats;
use crate::event::envelope::wall_clock_ms;
use crate::event::stream::AGENT_STREAM;
use crate::intake::IngestMsg;
use crate::mqtt::DeliveryMsg;
use crate::spool::{CheckpointMode, NewEvent, Spool, SpoolError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

/// The longest a `full` group waits for stragglers, however slow its
/// commits ([`Ingest::gather_stragglers`]).
pub(super) const MAX_STRAGGLER_WAIT: Duration = Duration::from_millis(2);

/// A `full` group waits for stragglers only after a commit that took at
/// least this long (a slow card's sync). A faster commit costs less than
/// the clients' round trip: waiting for them idled the thread longer than
/// a second commit takes (8 clients on a disk syncing in 0.12 ms: 10,000
/// requests/s waiting, 12,000-15,000 without).
pub(super) const STRAGGLER_WAIT_FROM: Duration = Duration::from_micros(500);

impl Ingest {
    /// Take a reading into the buffer (a full-durability one into
    /// `full_buffer`, committed by the loop's next [`Ingest::commit_full`]
    /// with whatever else is queued), or refuse it when the buffer holds [`MAX_BUFFERED`]
    /// readings or its byte bound ([`Ingest::max_buffered_bytes`]). The
    /// socket and the bridges never hold more than their budget of either
    /// ([`crate::intake::budget`]), so the board's own sources always have
    /// the rest: they are refused only when their own readings fill it.
    pub(super) fn push(&mut self, ev: NewEvent) {
        let bytes = ev.heap_bytes();
        let over_bytes = self.buffered_bytes.saturating_add(bytes) > self.max_buffered_bytes()
            && self.buffered_bytes > 0;
        if self.buffer.len() + self.full_buffer.len() >= MAX_BUFFERED || over_bytes {
            ev.refuse("not stored: the agent's in-memory buffer is full (the spool is not keeping up); retry later");
            self.dropped += 1;
            self.metrics.dropped += 1;
            self.upkeep.buffer_drops += 1;
            return;
        }
        self.buffered_bytes += bytes;
        if self.cfg.stream_durability(&ev.stream) == crate::event::stream::Durability::Full {
            self.full_buffer.push(ev);
        } else {
            self.buffer.push(ev);
        }
    }

    /// The buffer holds half its bound (readings or bytes): commit now,
    /// whatever the window (a budget's wide window stops at the bound).
    pub(super) fn buffer_half_full(&self) -> bool {
        self.buffer.len() >= MAX_BUFFERED / 2
            || self.buffered_bytes >= self.max_buffered_bytes() / 2
    }

    /// Whether the loop stops taking queued messages and commits: either
    /// buffer at half its bound, so the group never makes [`Ingest::push`]
    /// refuse a reading that a commit now would have had room for.
    fn group_is_full(&self) -> bool {
        self.buffer_half_full() || self.full_buffer.len() >= MAX_BUFFERED / 2
    }

    /// Handle one message of the ingest channel. A count opens the commit
    /// window (`commit_at`) if none is open.
    fn take(&mut self, msg: IngestMsg, commit_at: &mut Option<Instant>) {
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
                *self.pending_counts.entry(name).or_default() += by;
                // Stored by the next commit (which flushes counts first):
                // one write per window however many arrive.
                commit_at.get_or_insert_with(|| Instant::now() + self.window.get());
            }
            IngestMsg::Wake => {}
        }
    }

    /// Take every message already queued (without waiting), until the
    /// channel is empty or a buffer is at half its bound: the group the
    /// next [`Ingest::commit_full`] commits with one fsync. What a client
    /// sent while the last fsync ran is queued here, so concurrent
    /// clients share commits without any timer. Returns false when the
    /// channel is closed.
    fn take_queued(&mut self, rx: &Receiver<IngestMsg>, commit_at: &mut Option<Instant>) -> bool {
        while !self.group_is_full() {
            match rx.try_recv() {
                Ok(m) => self.take(m, commit_at),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// Wait for stragglers: when `full` readings are taken and the last
    /// `full` commit stored two or more, take what arrives into this group
    /// too, until it holds the last group's readings more than `queued`
    /// (the `full` readings that were waiting when the pass began: sent
    /// during the last commit, so not by the clients it answered), or
    /// until that commit's transaction time has passed since it ended (and
    /// at most [`MAX_STRAGGLER_WAIT`] from now). So the clients answered by
    /// the last commit join this one. Returns false when the channel is
    /// closed.
    fn gather_stragglers(
        &mut self,
        rx: &Receiver<IngestMsg>,
        commit_at: &mut Option<Instant>,
        queued: usize,
    ) -> bool {
        let Some((last_group, took, ended)) = self.last_full_group else {
            return true;
        };
        if self.full_buffer.is_empty() || last_group < 2 || took < STRAGGLER_WAIT_FROM {
            return true;
        }
        let want = queued.saturating_add(last_group);
        let until = (ended + took).min(Instant::now() + MAX_STRAGGLER_WAIT);
        while !self.group_is_full() && !self.full_buffer.is_empty() && self.full_buffer.len() < want
        {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match rx.recv_timeout(left) {
                Ok(m) => {
                    self.take(m, commit_at);
                    if !self.take_queued(rx, commit_at) {
                        return false;
                    }
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }

    /// The byte bound of the buffer: `ingest.max_buffered_bytes` for the
    /// socket and the bridges and [`OWN_RESERVED_BYTES`] for the board's own
    /// readings.
    pub(super) fn max_buffered_bytes(&self) -> usize {
        self.cfg
            .ingest
            .max_buffered_bytes
            .saturating_add(OWN_RESERVED_BYTES)
    }

    /// Empty `buffer` (committed or refused), giving its bytes back.
    pub(super) fn clear_buffer(&mut self) {
        let freed: usize = self.buffer.iter().map(NewEvent::heap_bytes).sum();
        self.buffered_bytes = self.buffered_bytes.saturating_sub(freed);
        self.buffer.clear();
    }

    /// Commit the full-durability readings taken so far, in one transaction
    /// on the FULL connection (one fsync for the group; each reply is sent
    /// after it). The same commit path as the batched one, run with the two
    /// connections and buffers exchanged for the call.
    pub(super) fn commit_full(&mut self) {
        if self.full_buffer.is_empty() {
            return;
        }
        std::mem::swap(&mut self.spool, &mut self.full_spool);
        std::mem::swap(&mut self.buffer, &mut self.full_buffer);
        let retry_at = self.retry_at.take();
        let (group, appended) = (self.buffer.len(), self.appended);
        self.commit();
        if self.buffer.is_empty() {
            self.upkeep.full_commits += 1;
        }
        if self.appended > appended {
            // Stored (not refused by policy): its clients will send again.
            let (took, ended) = self.last_commit;
            self.last_full_group = Some((group, took, ended));
        }
        self.retry_at = retry_at;
        std::mem::swap(&mut self.buffer, &mut self.full_buffer);
        std::mem::swap(&mut self.spool, &mut self.full_spool);
    }

    /// Commit the buffer in one transaction; on a transient error keep it and
    /// retry after a second.
    /// Refuse the buffered readings if the spool or the disk is at its limit,
    /// after dropping the oldest acknowledged rows first (I6: never an
    /// unacknowledged one). Checked at most once a second.
    pub(super) fn capacity_refusal(&mut self) -> Option<crate::flash::maintenance::Refusal> {
        let fresh = self
            .upkeep
            .capacity_checked
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
        if fresh {
            return self.upkeep.refusal;
        }
        let cap = self.cfg.spool.capacity;
        let dir = spool_dir(&self.cfg);
        let check = |spool: &Spool| -> Option<crate::flash::maintenance::Refusal> {
            let (used, free_pages) = spool.usage().ok()?;
            let fs_free = crate::flash::maintenance::fs_free_bytes(&dir).ok()?;
            crate::flash::maintenance::capacity_check(&cap, used, free_pages, fs_free)
        };
        let mut refusal = check(&self.spool);
        if refusal.is_some() {
            // Policy: drop the oldest acknowledged rows first, in bounded batches.
            let mut purged = 0;
            for _ in 0..4 {
                match self
                    .spool
                    .purge_acked(i64::MAX, self.cfg.spool.purge_batch_rows)
                {
                    Ok(0) | Err(_) => break,
                    Ok(n) => purged += n,
                }
            }
            if purged > 0 {
                log::warn!("capacity: dropped the {purged} oldest acknowledged rows to make room");
                let _ = self.spool.count("events_purged_for_space", purged as i64);
                refusal = check(&self.spool);
            }
        }
        self.upkeep.capacity_checked = Some(Instant::now());
        if refusal.is_none() && self.upkeep.refusal.is_some() {
            log::info!("capacity: space is back; taking readings again");
        }
        self.upkeep.refusal = refusal;
        refusal
    }

    /// After SQLITE_FULL, ingest stays off until a TRUNCATE checkpoint has
    /// emptied the WAL into the database and the filesystem has headroom
    /// again (1 MiB, or the configured reserve if larger); otherwise new
    /// appends would eat freed space before the checkpoint and delivery
    /// records that need it.
    pub(super) fn recovered_from_disk_full(&mut self) -> bool {
        let headroom = self.cfg.spool.capacity.min_free_bytes.max(1024 * 1024);
        let ok = matches!(self.spool.checkpoint(CheckpointMode::Truncate), Ok(r) if r.busy == 0)
            && crate::flash::maintenance::fs_free_bytes(&spool_dir(&self.cfg))
                .is_ok_and(|f| f >= headroom);
        if ok {
            log::info!("disk has room again; taking readings again");
            self.upkeep.disk_full = false;
            self.upkeep.capacity_checked = None;
        }
        ok
    }

    /// Count `n` readings of the buffer as dropped for `reason`, per stream.
    pub(super) fn drop_buffer(&mut self, reason: &str) -> usize {
        let mut by_stream: HashMap<String, i64> = HashMap::new();
        let why = format!("not stored: the spool refused new readings ({reason}); retry later");
        for ev in &self.buffer {
            *by_stream.entry(ev.stream.clone()).or_default() += 1;
            ev.refuse(&why);
        }
        let n = self.buffer.len();
        self.clear_buffer();
        self.metrics.dropped += n as u64;
        *self
            .pending_counts
            .entry(format!("readings_dropped_{reason}"))
            .or_default() += n as i64;
        for (stream, k) in by_stream {
            *self
                .pending_counts
                .entry(format!("readings_dropped_{reason}.{stream}"))
                .or_default() += k;
        }
        self.flush_counts();
        n
    }

    /// Store pending counter increments in one transaction; kept on failure
    /// (a full disk) and retried, so no drop goes uncounted.
    pub(super) fn flush_counts(&mut self) {
        if self.pending_counts.is_empty() {
            return;
        }
        let counts: Vec<(String, i64)> = self
            .pending_counts
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        if self.spool.count_many(&counts).is_ok() {
            self.pending_counts.clear();
        }
    }

    /// Commit the buffer in one transaction. Busy: keep it and retry after a
    /// second. Disk full or over capacity: refuse these readings, counted.
    pub(super) fn commit(&mut self) {
        self.flush_counts();
        if self.buffer.is_empty() || self.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        if self.upkeep.disk_full && !self.recovered_from_disk_full() {
            self.drop_buffer("disk_full");
            return;
        }
        if let Some(r) = self.capacity_refusal() {
            let n = self.drop_buffer(r.reason());
            if self
                .upkeep
                .last_refusal_log
                .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
            {
                log::error!("capacity: refusing new readings ({r}); {n} dropped now, counted as readings_dropped_{} (repeats logged every 30 s)", r.reason());
                self.upkeep.last_refusal_log = Some(Instant::now());
            }
            return;
        }
        let started = Instant::now();
        // A wide window stretches the checkpoint interval (the WAL's only
        // sync under `synchronous = NORMAL`): the window's commit then syncs
        // the WAL itself, on the FULL connection, so a power cut still loses
        // at most the open window, not the commits since the last
        // checkpoint. A sync adds no bytes; the pages are written once either
        // way.
        let sync_here = self.spool.pragmas().synchronous < 2
            && self.checkpoint_interval() > self.cfg.spool.checkpoint_interval;
        if sync_here {
            std::mem::swap(&mut self.spool, &mut self.full_spool);
        }
        let appended = self.spool.append(
            &self.buffer,
            &mut self.ids,
            &self.cfg.device_id,
            self.cfg.mqtt.payload_format,
            wall_clock_ms().0,
        );
        if sync_here {
            std::mem::swap(&mut self.spool, &mut self.full_spool);
            self.upkeep.full_commits += u64::from(appended.is_ok());
        }
        match appended {
            Ok(n) => {
                self.last_commit = (started.elapsed(), Instant::now());
                self.observe_commit(self.last_commit.0);
                self.appended += n as u64;
                self.clear_buffer();
                self.retry_at = None;
                self.storage_backoff.reset();
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
                self.checkpoint_if_due();
            }
            Err(SpoolError::Full { source, .. }) => {
                // A half-written transaction was rolled back; nothing partial stays.
                self.upkeep.disk_full = true;
                let n = self.drop_buffer("disk_full");
                self.upkeep.capacity_checked = None;
                if self
                    .upkeep
                    .last_refusal_log
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::error!("ingest: disk full ({source}); {n} readings refused, counted as readings_dropped_disk_full (repeats logged every 30 s)");
                    self.upkeep.last_refusal_log = Some(Instant::now());
                }
            }
            Err(e) => {
                self.retry_at = Some(Instant::now() + self.storage_backoff.next_delay());
                if self
                    .last_error_log
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(30))
                {
                    log::error!(
                        "ingest: commit of {} readings failed: {e}; kept in memory and retried (repeats logged every 30 s)",
                        self.buffer.len()
                    );
                    self.last_error_log = Some(Instant::now());
                }
            }
        }
        if self.dropped > 0
            && self
                .spool
                .count("readings_dropped_buffer_full", self.dropped as i64)
                .is_ok()
        {
            let why = if self.retry_at.is_some() || self.upkeep.disk_full {
                "while the spool refused writes"
            } else {
                "readings arrived faster than the spool could commit them"
            };
            log::error!(
                "ingest: {} readings dropped, counted as readings_dropped_buffer_full: the in-memory buffer ({MAX_BUFFERED} readings, {} bytes) was full {why}",
                self.dropped,
                self.max_buffered_bytes()
            );
            self.dropped = 0;
        }
    }

    /// The ingest loop: sleeps until a message or the nearest deadline
    /// (the open commit window, maintenance, the summary), never on a
    /// polling timer, so an idle agent wakes about once per maintenance pass.
    pub(super) fn run_until_stopped(
        &mut self,
        rx: &Receiver<IngestMsg>,
        stop: &AtomicBool,
        hup: &AtomicBool,
        stats: &DeliveryStats,
    ) {
        let mut commit_at: Option<Instant> = None;
        let mut maint_at = Instant::now() + self.maintenance_period();
        let mut summary_at = Instant::now() + self.cfg.agent.summary_interval;
        while !stop.load(Ordering::Relaxed) {
            self.heartbeat.beat();
            let mut next = maint_at.min(summary_at);
            if let Some(c) = commit_at {
                next = next.min(c);
            }
            if !self.full_buffer.is_empty() || self.pending_push.is_some() {
                // A full-durability commit that failed retries soon; a pushed
                // config waits for its confirmation.
                next = next.min(Instant::now() + Duration::from_millis(200));
            }
            // A message already waiting was sent during the last pass; one
            // waited for came after it (from a client it answered, say).
            let first = match rx.try_recv() {
                Ok(m) => Ok((m, true)),
                Err(TryRecvError::Empty) => rx
                    .recv_timeout(next.saturating_duration_since(Instant::now()))
                    .map(|m| (m, false)),
                Err(TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
            };
            match first {
                Ok((m, waiting)) => {
                    let before = self.full_buffer.len();
                    self.take(m, &mut commit_at);
                    // Group commit: what queued behind it joins its commit,
                    // and what the last group's clients send next.
                    if !self.take_queued(rx, &mut commit_at) {
                        break;
                    }
                    let queued = if waiting {
                        self.full_buffer.len().saturating_sub(before)
                    } else {
                        0
                    };
                    if !self.gather_stragglers(rx, &mut commit_at, queued) {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if hup.swap(false, Ordering::Relaxed) {
                log::info!("SIGHUP: reloading {}", self.source.path.display());
                match self.reload() {
                    Ok(v) => log::info!("config reloaded: {v}"),
                    Err(e) => log::error!("{e}"),
                }
            }
            let now = Instant::now();
            self.judge_pending_push();
            // The `full` readings of this pass, in one commit (and those
            // whose commit failed, retried).
            self.commit_full();
            if !self.buffer.is_empty() && commit_at.is_none() {
                // The window opens with its first reading.
                commit_at = Some(now + self.window.get());
            }
            if self.buffer_half_full() && self.retry_at.is_none_or(|t| now >= t) {
                // A wide window never holds the buffer past half its bound:
                // the rest is room for a commit that fails and retries.
                commit_at = Some(now);
            }
            if commit_at.is_some_and(|c| now >= c) {
                self.commit();
                commit_at = (!self.buffer.is_empty()).then(|| now + self.window.get());
            }
            if now >= maint_at {
                self.maintain();
                maint_at = now
                    + if self.upkeep.more_work {
                        MAINTENANCE_AGAIN
                    } else {
                        self.maintenance_period()
                    };
                if self.upkeep.fatal.is_some() {
                    break;
                }
            }
            if now >= summary_at {
                self.summary(stats);
                summary_at = now + self.cfg.agent.summary_interval;
            }
        }
    }

    /// Maintenance (retention, checkpoints, health) runs this often.
    pub(super) fn maintenance_period(&self) -> Duration {
        self.cfg
            .spool
            .checkpoint_interval
            .min(Duration::from_secs(5))
    }

    /// Append an event on the `_agent` stream (config fallbacks and the like),
    /// so operators see it on `<topic_prefix>/events/_agent`.
    pub(super) fn agent_event(&mut self, kind: &str, detail: &str) {
        let (ts_ms, clock_trusted) = wall_clock_ms();
        self.push(NewEvent {
            replay: None,
            stream: AGENT_STREAM.into(),
            ts_ms,
            clock_trusted,
            fields: vec![
                (
                    "event".into(),
                    crate::event::reading::FieldValue::Text(kind.into()),
                ),
                (
                    "detail".into(),
                    crate::event::reading::FieldValue::Text(detail.into()),
                ),
            ],
            key: None,
            reply: None,
        });
    }

    /// At the stop: commit what the sampler produced and what is buffered
    /// (retrying for up to 10 s), and persist the sequence numbers.
    pub(super) fn commit_what_is_left(&mut self, rx: &Receiver<IngestMsg>) {
        while let Ok(m) = rx.try_recv() {
            match m {
                IngestMsg::Reading(r) => self.push(r),
                IngestMsg::Count { name, by } => {
                    *self.pending_counts.entry(name).or_default() += by;
                }
                IngestMsg::Control(_) | IngestMsg::Wake => {}
            }
        }
        self.flush_counts();
        self.commit_full();
        let _ = self.spool.persist_seqs();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.buffer.is_empty() && Instant::now() < deadline {
            self.retry_at = None;
            self.commit();
            if !self.buffer.is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}
