//! The agent's side of [`crate::flash::outage`]: a sample of what was appended,
//! retired and written at each maintenance pass and summary, and the
//! outage budget built from them at the summary (stored for `status` as
//! `outage_budget`, rendered into the metrics).
//!
//! Its one rule: **sampling stays cheap for the writer thread**: it reads
//! the rows appended since the last sample (a range read on the row id),
//! two index reads and the `/proc/self/io` counter, whatever the spool's size.

use super::Writer;
use crate::event::envelope::wall_clock_ms;
use crate::flash::outage::{Budget, Meter, Room, Sample};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the writer keeps for the outage budget.
#[derive(Debug)]
pub(super) struct OutageState {
    /// The moving averages.
    meter: Meter,
    /// Highest row id counted so far (`None` until the first sample, which
    /// starts from the spool's newest row: rows of earlier runs are not
    /// this run's ingest).
    after_id: Option<i64>,
    /// Per stream: readings and stored bytes appended this run.
    totals: BTreeMap<String, (u64, u64)>,
    /// Monotonic origin of the samples.
    origin: Instant,
    /// `/proc/self/io` write_bytes at the first sample.
    write0: Option<u64>,
    /// The budget of the last summary, for the metrics.
    pub(super) last: Option<Budget>,
}

impl Default for OutageState {
    fn default() -> Self {
        OutageState {
            meter: Meter::new(300.0),
            after_id: None,
            totals: BTreeMap::new(),
            origin: Instant::now(),
            write0: None,
            last: None,
        }
    }
}

impl Writer {
    /// Take one sample (at each maintenance pass and summary). A spool read
    /// that fails skips this sample; the next one counts what it missed.
    pub(super) fn sample_outage(&mut self) {
        let window = self.conf.cfg.agent.rate_window.as_secs_f64();
        let o = &mut self.outage;
        if o.meter.window_secs() != window {
            // A reload changed the window: start over on the new one.
            o.meter = Meter::new(window);
        }
        let after = match o.after_id {
            Some(id) => id,
            None => match self.store.spool().newest_id() {
                Ok(id) => {
                    o.after_id = Some(id);
                    id
                }
                Err(_) => return,
            },
        };
        let Ok(appended) = self.store.spool().appended_since(after) else {
            return;
        };
        for a in appended {
            let t = o.totals.entry(a.stream).or_default();
            t.0 += a.rows;
            t.1 += a.bytes;
            o.after_id = o.after_id.max(Some(a.newest_id));
        }
        let write = crate::os::proc_io::proc_write_bytes().unwrap_or(0);
        let write0 = *o.write0.get_or_insert(write);
        let sample = Sample {
            at_secs: o.origin.elapsed().as_secs_f64(),
            wall_ms: wall_clock_ms().0,
            streams: o.totals.clone(),
            retired: self.peers.delivery_stats.retired.load(Ordering::Relaxed),
            write_bytes: write.saturating_sub(write0),
            connected: self.peers.link.connected(),
            backlog: self.store.spool().backlog_estimate().unwrap_or(0),
        };
        o.meter.record(sample);
    }

    /// The budget now: the meter's rates and the spool's room as the
    /// capacity policy judges it (`spool.max_bytes`, `spool.min_free_bytes`).
    /// `None` when the spool's usage or the filesystem's free space cannot
    /// be read now: no room is made up (the record of the last summary stays,
    /// and `status` shows its age).
    pub(super) fn outage_budget(&self) -> Option<Budget> {
        let spool = self.store.spool();
        let (used, free_pages) = spool.usage().ok()?;
        let dir = super::super::startup::spool_dir(&self.conf.cfg);
        let fs_free = crate::flash::maintenance::fs_free_bytes(&dir).ok()?;
        let cap = self.upkeep.settings().capacity;
        let room = Room {
            used_bytes: used,
            max_bytes: cap.max_bytes,
            free_bytes: fs_free.saturating_add(free_pages),
            reserve_bytes: cap.min_free_bytes,
            rows: spool.rows_estimate().ok()?,
            backlog_rows: spool.backlog_estimate().ok()?,
        };
        Some(crate::flash::outage::budget(&self.outage.meter, room))
    }

    /// At the summary: a fresh sample, then the budget, kept for the
    /// metrics and returned as JSON for `status` (`outage_budget`); `None`
    /// when it cannot be judged now ([`Writer::outage_budget`]).
    pub(super) fn outage_json(&mut self) -> Option<String> {
        self.sample_outage();
        let mut b = self.outage_budget()?;
        // One projection of the flash writes everywhere: the write budget's
        // (measured from checkpoint to checkpoint), not the meter's moving
        // average over a rate window a wide commit window does not fill.
        b.flash_mb_per_day = self.upkeep.projected_mb_per_day();
        let json = serde_json::to_string(&b).ok()?;
        self.outage.last = Some(b);
        Some(json)
    }
}
