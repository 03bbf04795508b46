//! The agent's health, judged once a maintenance pass from what every
//! thread reports (the link, delivery's FAILED rows, checkpoints, refusals),
//! logged once per reason and stored when it changes.
//!
//! One rule: a degraded state names its reasons; health is written to the
//! spool when its reasons change or at the summary interval, never each pass.

use super::Ingest;
use crate::event::envelope::wall_clock_ms;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `s` without its digits: a health reason's kind, whatever its figures.
pub(super) fn without_digits(s: &str) -> String {
    s.chars().filter(|c| !c.is_ascii_digit()).collect()
}

impl Ingest {
    /// Health and write budget into `agent_state`, for `status`.
    /// The health line, stored only when it changes (a commit twice a
    /// second whatever the rate was a large share of the flash writes).
    pub(super) fn record_health(&mut self) {
        let link = self.link.health_facts();
        let dropping = if let Some(r) = self.upkeep.refusal {
            Some(r.to_string())
        } else if self.upkeep.disk_full {
            Some("disk full".to_owned())
        } else if std::mem::take(&mut self.upkeep.buffer_drops) > 0 {
            Some(
                "the in-memory buffer overflowed (readings arrive faster than they commit)"
                    .to_owned(),
            )
        } else {
            None
        };
        let facts = crate::agent::health::Facts {
            connected: link.connected,
            state_for: link.state_for,
            last_error: link.last_error,
            broker: format!("{}:{}", self.cfg.mqtt.host, self.cfg.mqtt.port),
            in_flight: link.in_flight,
            no_puback_for: link.no_puback_for,
            quick_drops: link.quick_drops,
            commands_unavailable: link.commands_unavailable,
            failed_rows: self.spool.failed_count().unwrap_or(0),
            deferred: self.delivery_stats.deferred.load(Ordering::Relaxed),
            checkpoint_blocked: self.upkeep.checkpoint_blocked,
            dropping,
            config_fallback: self.source.fallback.is_some(),
            receipts_unavailable: link.receipts_unavailable,
            awaiting_receipt: self.awaiting_receipt(),
            receipt_timeout: (self.cfg.mqtt.retire_on == crate::mqtt::RetireOn::Receipt)
                .then_some(self.cfg.mqtt.receipt_timeout),
            ingest_socket_taken: self.upkeep.ingest_socket_taken.clone(),
            write_budget: self.budget.verdict().reason(),
        };
        // Judged once a maintenance pass: a pass early, so `degraded` is
        // recorded within the bound, not up to a pass after it.
        let bound = crate::agent::health::grace(self.cfg.mqtt.keep_alive)
            .saturating_sub(self.maintenance_period());
        let health = crate::agent::health::assess(&facts, bound);
        if let Ok(backlog) = self.spool.backlog_estimate() {
            let device = (
                self.cfg.device_id.as_str(),
                self.cfg.device_id_source.kind(),
            );
            self.link.set_status(device, &self.config_sha, backlog);
        }
        // Each reason is logged once when it appears (by its wording
        // without figures), and again only after it went away.
        let kinds: Vec<String> = health.reasons.iter().map(|r| without_digits(r)).collect();
        for (reason, kind) in health.reasons.iter().zip(&kinds) {
            if !self.upkeep.health_kinds.contains(kind) {
                log::warn!("health degraded: {reason}");
            }
        }
        if health.reasons.is_empty() && !self.upkeep.health_kinds.is_empty() {
            log::info!("health ok again");
        }
        if kinds != self.upkeep.health_kinds {
            self.upkeep.health_since = wall_clock_ms().0;
        }
        let record = serde_json::json!({
            "state": if health.reasons.is_empty() { "ok" } else { "degraded" },
            "reasons": health.reasons,
            "since_ms": self.upkeep.health_since,
        });
        let record = record.to_string();
        // Stored when the reasons change; the summary refreshes it once an
        // interval in its own transaction (issue 23: agent state is written
        // only when it changes and at the summary interval).
        let changed = self.upkeep.health_kinds != kinds || self.upkeep.health_stored_at.is_none();
        self.upkeep.health_record = Some(record.clone());
        if !changed {
            return;
        }
        self.upkeep.health_kinds = kinds;
        if self
            .spool
            .set_state("health", &record, wall_clock_ms().0)
            .is_ok()
        {
            self.upkeep.health_stored_at = Some(Instant::now());
        }
    }

    /// Rows waiting for their receipt and the oldest one's wait.
    pub(super) fn awaiting_receipt(&self) -> (u64, Option<Duration>) {
        let s = &self.delivery_stats;
        let n = s.awaiting_receipt.load(Ordering::Relaxed);
        let age = Duration::from_millis(s.oldest_awaiting_ms.load(Ordering::Relaxed));
        (n, (n > 0).then_some(age))
    }

    /// The receipts record for `status` (receipt mode only).
    pub(super) fn receipts_json(&self) -> Option<serde_json::Value> {
        if self.cfg.mqtt.retire_on != crate::mqtt::RetireOn::Receipt {
            return None;
        }
        let s = &self.delivery_stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (waiting, oldest) = self.awaiting_receipt();
        let last = load(&s.last_receipt_ms);
        Some(serde_json::json!({
            "awaiting": waiting,
            "oldest_awaiting_ms": oldest.map(|d| d.as_millis() as u64),
            "received": load(&s.receipts),
            "unmatched_ids": load(&s.receipt_unmatched),
            "malformed": load(&s.receipts_malformed),
            "resent": load(&s.resent_for_receipt),
            "dropped": self.link.health_facts().receipts_dropped,
            "last_receipt_ms": (last > 0).then_some(last),
            "unavailable": load(&s.receipts_unavailable) == 1,
            "timeout_secs": self.cfg.mqtt.receipt_timeout.as_secs(),
        }))
    }
}
