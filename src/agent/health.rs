//! The agent's health, judged once a maintenance pass from what every
//! thread reports (the link, delivery's FAILED rows, checkpoints, refusals),
//! logged once per reason and stored when it changes.
//!
//! One rule: a degraded state names its reasons; health is written to the
//! spool when its reasons change or at the summary interval, never each pass.

use super::Ingest;
use crate::envelope::wall_clock_ms;
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
        let facts = crate::health::Facts {
            connected: link.connected,
            state_for: link.state_for,
            last_error: link.last_error,
            broker: format!("{}:{}", self.cfg.mqtt.host, self.cfg.mqtt.port),
            in_flight: link.in_flight,
            no_puback_for: link.no_puback_for,
            quick_drops: link.quick_drops,
            commands_unavailable: link.commands_unavailable,
            failed_since_start: self.recent_failures(),
            checkpoint_blocked: self.upkeep.checkpoint_blocked,
            dropping,
            config_fallback: self.source.fallback.is_some(),
            ingest_socket_taken: self.upkeep.ingest_socket_taken.clone(),
        };
        // Judged once a maintenance pass: a pass early, so `degraded` is
        // recorded within the bound, not up to a pass after it.
        let bound = crate::health::grace(self.cfg.mqtt.keep_alive)
            .saturating_sub(self.maintenance_period());
        let health = crate::health::assess(&facts, bound);
        if let Ok(backlog) = self.spool.backlog_estimate() {
            self.link.set_status(&self.config_sha, backlog);
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
        let stale = self
            .upkeep
            .health_stored_at
            .is_none_or(|t| t.elapsed() >= self.cfg.agent.summary_interval);
        if self.upkeep.health_kinds == kinds && !stale {
            return;
        }
        self.upkeep.health_kinds = kinds;
        if self
            .spool
            .set_state("health", &record.to_string(), wall_clock_ms().0)
            .is_ok()
        {
            self.upkeep.health_stored_at = Some(Instant::now());
        }
    }

    /// Rows FAILED since start, while the last one is under 10 minutes old
    /// (then health may be ok again; `status` keeps the rows and reasons).
    pub(super) fn recent_failures(&mut self) -> u64 {
        let failed = self.delivery_stats.failed.load(Ordering::Relaxed);
        if failed > self.upkeep.failed_seen.0 {
            self.upkeep.failed_seen = (failed, Some(Instant::now()));
        }
        match self.upkeep.failed_seen.1 {
            Some(t) if t.elapsed() < Duration::from_secs(600) => failed,
            _ => 0,
        }
    }
}
