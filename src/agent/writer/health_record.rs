//! The agent's health, judged once an upkeep pass from what every thread
//! reports (the link, delivery's FAILED rows, checkpoints, refusals),
//! logged once per reason and recorded for `status` when it changes.
//!
//! One rule: a degraded state names its reasons; health rides a commit
//! with the agent state ([`super::riding`]): a change of state or reasons
//! presses for one (at most once a state period), never each pass. The
//! first record is judged before the loop's first pass and rides the first
//! commit, so `status` does not show the last run's health for this one
//! once anything committed.

use super::Writer;
use crate::agent::health::{assess, grace, Facts, State};
use crate::event::envelope::wall_clock_ms;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// `s` without its digits: a health reason's kind, whatever its figures.
fn without_digits(s: &str) -> String {
    s.chars().filter(|c| !c.is_ascii_digit()).collect()
}

/// What the writer keeps about health ([`self`]).
#[derive(Debug)]
pub(super) struct HealthRecord {
    /// The state last judged (the gauge shows it).
    state: State,
    /// The reasons last stored (without figures), so health is written when
    /// they change or at the summary interval, not each pass.
    kinds: Vec<String>,
    /// When the record last reached the spool.
    stored_at: Option<Instant>,
    /// The record of the last pass, refreshed by the summary.
    record: Option<String>,
    /// Wall ms when the current set of reasons began.
    since: i64,
    /// Another process listens on `ingest.socket` (the agent runs without
    /// it): a reason for the whole run.
    pub(super) socket_taken: Option<String>,
    /// Configured listeners that could not bind: reasons for the whole run.
    pub(super) listeners_down: Vec<String>,
    /// What the spool lost at start: a reason for the whole run.
    pub(super) spool_lost: Option<String>,
    /// Receipts refused, over the last ten minutes.
    refused_receipts: crate::agent::health::RecentGrowth,
}

impl HealthRecord {
    /// No record yet, at wall clock `wall_ms`.
    pub(super) fn new(wall_ms: i64) -> HealthRecord {
        HealthRecord {
            state: State::Starting,
            kinds: Vec::new(),
            stored_at: None,
            record: None,
            since: wall_ms,
            socket_taken: None,
            listeners_down: Vec::new(),
            spool_lost: None,
            refused_receipts: crate::agent::health::RecentGrowth::new(
                crate::agent::health::REFUSED_WINDOW,
            ),
        }
    }

    /// The state last judged ([`State::Starting`] before the first).
    pub(super) fn state(&self) -> State {
        self.state
    }

    /// Judge `state` and its `reasons` (empty unless degraded) at wall
    /// clock `wall_ms`: each reason is logged once when it appears (by its
    /// wording without figures), and again only after it went away. Returns
    /// the record to store when the state or the reasons changed or none was
    /// stored yet; the record is kept for the summary either way.
    pub(super) fn judge(
        &mut self,
        state: State,
        reasons: &[String],
        wall_ms: i64,
    ) -> Option<String> {
        let kinds: Vec<String> = reasons.iter().map(|r| without_digits(r)).collect();
        for (reason, kind) in reasons.iter().zip(&kinds) {
            if !self.kinds.contains(kind) {
                log::warn!("health degraded: {reason}");
            }
        }
        if state == State::Ok && self.state != State::Ok {
            log::info!(
                "health ok{}",
                if self.kinds.is_empty() { "" } else { " again" }
            );
        }
        let changed = kinds != self.kinds || state != self.state;
        if changed {
            self.since = wall_ms;
        }
        let record = serde_json::json!({
            "state": state.name(),
            "reasons": reasons,
            "since_ms": self.since,
        })
        .to_string();
        // Stored when the state or the reasons change; the summary refreshes
        // it once an interval in its own transaction (issue 23: agent state
        // is written only when it changes and at the summary interval).
        let store = changed || self.stored_at.is_none();
        self.record = Some(record.clone());
        self.state = state;
        if !store {
            return None;
        }
        self.kinds = kinds;
        Some(record)
    }

    /// The record reached the spool at `now`.
    pub(super) fn stored(&mut self, now: Instant) {
        self.stored_at = Some(now);
    }

    /// The record of the last pass.
    pub(super) fn record(&self) -> Option<&str> {
        self.record.as_deref()
    }
}

impl Writer {
    /// Judge health from every thread's facts, refresh the retained status,
    /// and store the record when its reasons changed.
    pub(super) fn record_health(&mut self) {
        let link = self.peers.link.health_facts();
        let dropping = if let Some(r) = self.upkeep.refusal() {
            Some(r.to_string())
        } else if self.upkeep.disk_full() {
            Some("disk full".to_owned())
        } else if self.buffer.take_overflowed_since_health() > 0 {
            Some(
                "the in-memory buffer overflowed (readings arrive faster than they commit)"
                    .to_owned(),
            )
        } else {
            None
        };
        let receipts_refused = self.refused_receipts();
        let cfg = &self.conf.cfg;
        let (connacks, _) = self.peers.link.connection_counts();
        let facts = Facts {
            connected: link.connected,
            ever_connected: connacks > 0,
            state_for: link.state_for,
            last_error: link.last_error,
            broker: format!("{}:{}", cfg.mqtt.host, cfg.mqtt.port),
            in_flight: link.in_flight,
            no_puback_for: link.no_puback_for,
            quick_drops: link.quick_drops,
            commands_unavailable: link.commands_unavailable,
            failed_rows: self.store.spool().failed_count().unwrap_or(0),
            deferred: self.peers.delivery_stats.deferred.load(Ordering::Relaxed),
            deferred_why: self.peers.delivery_stats.deferred_why(),
            checkpoint_blocked: self.upkeep.checkpoint_blocked(),
            dropping,
            config_fallback: self.conf.source.fallback.is_some(),
            receipts_unavailable: link.receipts_unavailable,
            awaiting_receipt: self.awaiting_receipt(),
            receipt_timeout: (cfg.mqtt.retire_on == crate::mqtt::RetireOn::Receipt)
                .then_some(cfg.mqtt.receipt_timeout),
            receipts_refused,
            ingest_socket_taken: self.health.socket_taken.clone(),
            write_budget: self.upkeep.budget_verdict().reason(),
            listeners_down: self.health.listeners_down.clone(),
            spool_lost: self.health.spool_lost.clone(),
        };
        // Judged once a pass: a pass early, so `degraded` is recorded within
        // the bound, not up to a pass after it.
        let bound = grace(cfg.mqtt.keep_alive).saturating_sub(self.upkeep.period());
        let health = assess(&facts, bound);
        if let Ok(backlog) = self.store.spool().backlog_estimate() {
            let device = (cfg.device_id.as_str(), cfg.device_id_source.kind());
            self.peers
                .link
                .set_status(device, &self.conf.config_sha, backlog);
        }
        let Some(record) = self
            .health
            .judge(health.state, &health.reasons, wall_clock_ms().0)
        else {
            return;
        };
        self.riding.set_state("health", record, true);
    }

    /// Receipts refused in the last ten minutes, and all refusals by
    /// reason (`unsigned 3, bad_signature 1`).
    fn refused_receipts(&mut self) -> (u64, String) {
        let by = self.peers.delivery_stats.receipts_refused.by_reason();
        let total = by.iter().map(|(_, n)| n).sum();
        let recent = self.health.refused_receipts.observe(Instant::now(), total);
        let named: Vec<String> = by
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        (recent, named.join(", "))
    }

    /// Rows waiting for their receipt and the oldest one's wait.
    pub(super) fn awaiting_receipt(&self) -> (u64, Option<Duration>) {
        let s = &self.peers.delivery_stats;
        let n = s.awaiting_receipt.load(Ordering::Relaxed);
        let age = Duration::from_millis(s.oldest_awaiting_ms.load(Ordering::Relaxed));
        (n, (n > 0).then_some(age))
    }

    /// The backfill record for `status` (when the board announces its
    /// holdings and hears the fleet's requests).
    pub(super) fn backfill_json(&self) -> Option<serde_json::Value> {
        if !self.conf.cfg.mqtt.backfill() {
            return None;
        }
        let b = &self.peers.delivery_stats.backfill;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let refused: serde_json::Map<String, serde_json::Value> = b
            .refused_by_reason()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), serde_json::json!(v)))
            .collect();
        Some(serde_json::json!({
            "holdings": load(&b.holdings),
            "holdings_bytes": load(&b.holdings_bytes),
            "requests": load(&b.requests),
            "refused": refused,
            "requests_dropped": self.peers.link.requests_dropped(),
            "rows_sent": load(&b.rows_sent),
            "rows_gone": load(&b.rows_gone),
            "rows_pending": load(&b.rows_pending),
            "rows_clipped": load(&b.rows_clipped),
            "queued": load(&b.queued),
        }))
    }

    /// The receipts record for `status` (receipt mode only).
    pub(super) fn receipts_json(&self) -> Option<serde_json::Value> {
        if self.conf.cfg.mqtt.retire_on != crate::mqtt::RetireOn::Receipt {
            return None;
        }
        let s = &self.peers.delivery_stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (waiting, oldest) = self.awaiting_receipt();
        let last = load(&s.last_receipt_ms);
        Some(serde_json::json!({
            "awaiting": waiting,
            "oldest_awaiting_ms": oldest.map(|d| d.as_millis() as u64),
            "received": load(&s.receipts),
            "unmatched_ids": load(&s.receipt_unmatched),
            "malformed": s.receipts_refused.malformed.load(Ordering::Relaxed),
            "refused": s.receipts_refused.by_reason().iter().map(|(k, v)| ((*k).to_owned(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "wrong_digest": load(&s.receipt_wrong_digest),
            "resent": load(&s.resent_for_receipt),
            "dropped": self.peers.link.health_facts().receipts_dropped,
            "last_receipt_ms": (last > 0).then_some(last),
            "unavailable": load(&s.receipts_unavailable) == 1,
            "timeout_secs": self.conf.cfg.mqtt.receipt_timeout.as_secs(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reasons(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn health_is_stored_when_its_reasons_change_not_at_every_pass() {
        let mut h = HealthRecord::new(1_000);
        // Nothing stored yet: the first record is.
        let first = h
            .judge(State::Starting, &[], 1_500)
            .expect("the first record is stored");
        assert!(first.contains("\"starting\""), "{first}");
        h.stored(Instant::now());
        let ok = h
            .judge(State::Ok, &[], 2_000)
            .expect("the first CONNACK is stored");
        assert!(ok.contains("\"ok\""), "{ok}");
        h.stored(Instant::now());
        assert_eq!(
            h.judge(State::Ok, &[], 3_000),
            None,
            "unchanged: kept for the summary"
        );
        let degraded = h
            .judge(State::Degraded, &reasons(&["no PUBACK for 31 s"]), 4_000)
            .expect("a new reason is stored");
        assert!(degraded.contains("\"since_ms\":4000"), "{degraded}");
        h.stored(Instant::now());
        // The same reason with other figures is no change.
        assert_eq!(
            h.judge(State::Degraded, &reasons(&["no PUBACK for 45 s"]), 5_000),
            None
        );
        assert!(h.record().is_some_and(|r| r.contains("45 s")));
        let ok = h.judge(State::Ok, &[], 6_000).expect("ok again is stored");
        assert!(ok.contains("\"since_ms\":6000"), "{ok}");
        assert_eq!(h.state(), State::Ok);
    }

    #[test]
    fn a_record_that_did_not_reach_the_spool_is_stored_at_the_next_pass() {
        let mut h = HealthRecord::new(0);
        let full = reasons(&["disk full"]);
        assert!(h.judge(State::Degraded, &full, 1).is_some());
        // Not stored (the spool refused it): the next pass tries again.
        assert!(h.judge(State::Degraded, &full, 2).is_some());
    }
}
