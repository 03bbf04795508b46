//! The summary each `agent.summary_interval_secs`: one log line (and
//! systemd STATUS), the write budget and latencies stored for `status`, the
//! metrics published.
//!
//! One rule: one line per interval, whatever the rate; nothing per reading.

use super::Ingest;
use crate::delivery::DeliveryStats;
use crate::event::envelope::wall_clock_ms;
use std::sync::atomic::Ordering;

impl Ingest {
    /// What this run has cost the flash so far, for `status`: bytes the
    /// kernel sent to the block layer for this process (`/proc/self/io`),
    /// commits on every connection, checkpoints, and what follows per hour,
    /// per reading and per day.
    pub(super) fn write_budget(&self) -> serde_json::Value {
        let (since, bytes0) = self.upkeep.budget_since;
        let bytes = crate::flash::maintenance::proc_write_bytes()
            .unwrap_or(bytes0)
            .saturating_sub(bytes0);
        let elapsed = since.elapsed();
        let commits = self.spool.wal().commits();
        let checkpoints = self.upkeep.checkpoints;
        // synchronous=NORMAL fsyncs only at checkpoints (the WAL, then the
        // database: https://www.sqlite.org/wal.html#sync); FULL at every commit.
        let fsyncs = 2 * checkpoints + self.upkeep.full_commits;
        let per_hour = |n: u64| crate::flash::maintenance::per_hour(n, elapsed);
        let readings = self.appended.max(1);
        serde_json::json!({
            "window_secs": elapsed.as_secs(),
            "write_bytes_total": bytes,
            "write_bytes_per_hour": per_hour(bytes),
            "commits_total": commits,
            "commits_per_hour": per_hour(commits),
            "checkpoints_total": checkpoints,
            "checkpoints_per_hour": per_hour(checkpoints),
            "fsyncs_estimated_total": fsyncs,
            "fsyncs_estimated_per_hour": per_hour(fsyncs),
            "readings_total": self.appended,
            "bytes_per_reading": bytes / readings,
            "projected_mb_per_day": per_hour(bytes) as f64 * 24.0 / 1e6,
            "commit_window_ms": self.window.get().as_millis() as u64,
            "commit_window_max_ms": self.budget.largest().as_millis() as u64,
            "checkpoint_interval_secs": self.checkpoint_interval().as_secs(),
            "budget_mb_per_day": self.cfg.spool.write_budget_bytes_per_day.map(|b| b / 1_000_000),
            "budget_projected_mb_per_day": self.budget.projected_mb_per_day(),
            "over_budget": self.budget.verdict() != &crate::flash::write_budget::Verdict::Within,
            "wal_file_bytes": std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
                .map(|m| m.len())
                .unwrap_or(0),
        })
    }

    pub(super) fn summary(&mut self, stats: &DeliveryStats) {
        let mut states = vec![
            ("write_budget", self.write_budget().to_string()),
            ("latency", self.latency_json().to_string()),
        ];
        if let Some(b) = self.outage_json() {
            states.push(("outage_budget", b));
        }
        if let Some(c) = &self.upkeep.last_checkpoint_json {
            states.push(("last_checkpoint", c.to_string()));
        }
        if let Some(r) = self.receipts_json() {
            states.push(("receipts", r.to_string()));
        }
        if let Some(h) = &self.upkeep.health_record {
            states.push(("health", h.clone()));
        }
        // Sequence numbers reach the file at the summary interval (and
        // every 10,000 readings: `persist_seqs_if_due`).
        if self.spool.persist_seqs().is_ok() {
            self.upkeep.seqs_persisted = std::time::Instant::now();
        }
        if self.spool.set_states(&states, wall_clock_ms().0).is_ok()
            && self.upkeep.health_record.is_some()
        {
            self.upkeep.health_stored_at = Some(std::time::Instant::now());
        }
        let wal = std::fs::metadata(crate::spool::wal_path(&self.cfg.spool.path))
            .map(|m| m.len())
            .unwrap_or(0);
        let (backlog, age) = self.backlog_and_age();
        let line = format!(
            "summary: appended={} submitted={} retired={} requeued={} failed={} buffered={} wal_bytes={wal} backlog={backlog} oldest_unacked_secs={} connected={} dropped={}",
            self.appended,
            stats.submitted.load(Ordering::Relaxed),
            stats.retired.load(Ordering::Relaxed),
            stats.requeued.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed),
            self.buffer.len(),
            age.map_or(0, |a| a.as_secs()),
            u8::from(self.link.connected()),
            self.metrics.dropped,
        );
        log::info!("{line}");
        self.notifier.status(&line);
        self.store_socket_counts();
        self.publish_metrics(true, true);
    }
}
