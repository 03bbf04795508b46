//! The summary each `agent.summary_interval_secs`: one log line (and
//! systemd STATUS), the write budget, latencies, checkpoint, receipts,
//! health and the command clock recorded for `status` (they ride a commit
//! at most once a state period, [`super::riding`]), the metrics published.
//!
//! One rule: one line per interval, whatever the rate; nothing per reading,
//! and no commit of its own.

use super::Writer;
use crate::delivery::DeliveryStats;
use crate::event::age::{stamp_age, StampAge};
use crate::event::stream::Durability;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Writer {
    pub(super) fn summary(&mut self, stats: &DeliveryStats) {
        let record = self.upkeep.write_record(
            Instant::now(),
            self.store.spool(),
            self.store.appended(),
            self.store.full_commits(),
        );
        let mut states = vec![
            ("write_budget", record.to_string()),
            ("latency", self.latency_json().to_string()),
        ];
        if let Some(b) = self.outage_json() {
            states.push(("outage_budget", b));
        }
        if let Some(c) = self.upkeep.last_checkpoint() {
            states.push(("last_checkpoint", c.to_string()));
        }
        if let Some(r) = self.receipts_json() {
            states.push(("receipts", r.to_string()));
        }
        if let Some(b) = self.backfill_json() {
            states.push(("backfill", b.to_string()));
        }
        if let Some(h) = self.health.record() {
            states.push(("health", h.to_owned()));
        }
        if let Some(s) = self.shares_state() {
            states.push(("ingest_shares", s));
        }
        if let Some(clock) = &self.peers.commands_clock {
            // The command records' clock goes on from here after a crash.
            states.push((
                crate::commands::retention::CLOCK_STATE_KEY,
                clock.now_ms().to_string(),
            ));
        }
        for (key, value) in states {
            self.riding.set_state(key, value, false);
        }
        let wal = std::fs::metadata(crate::spool::wal_path(&self.conf.cfg.spool.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let (backlog, oldest, now) = self.backlog_and_oldest();
        let oldest = match oldest.map(|c| stamp_age(c, now)) {
            None => "0".to_owned(),
            Some(StampAge::Age(ms)) => (ms / 1000).to_string(),
            // Appended before the clock was set, or ahead of it: no age.
            Some(_) => "unknown".to_owned(),
        };
        let line = format!(
            "summary: appended={} submitted={} retired={} requeued={} failed={} buffered={} wal_bytes={wal} backlog={backlog} oldest_unacked_secs={} connected={} dropped={}",
            self.store.appended(),
            stats.submitted.load(Ordering::Relaxed),
            stats.retired.load(Ordering::Relaxed),
            stats.requeued.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
            self.buffer.len(Durability::Batched),
            oldest,
            u8::from(self.peers.link.connected()),
            self.metrics.dropped,
        );
        log::info!("{line}");
        self.run.notifier.status(&line);
        self.store_socket_counts();
        self.publish_metrics(true, true);
    }
}
