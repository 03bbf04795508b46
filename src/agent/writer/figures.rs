//! The agent's side of [`crate::metrics`]: gather [`Figures`] at the summary
//! interval, publish the rendering to the listener's snapshot, write the
//! textfile, and keep the latency summary `status` shows.
//!
//! Its one rule: **gathering stays cheap for the writer thread**: counts by
//! stream and state need a scan of the spool (as `status` does), so they
//! are taken only while the spool's live data is under [`ROW_SCAN_LIMIT`];
//! past it, the backlog, the oldest unacknowledged age (index reads) and
//! the FAILED rows (the small `failed` table, which health counts every
//! pass anyway) still are.

use super::Writer;
use crate::event::envelope::wall_clock_ms;
use crate::event::stream::Durability;
use crate::metrics::{Figures, Histogram, Snapshot, Textfile};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Largest live spool data (bytes) for which rows are counted by stream and
/// state: the count reads every row, which on an SD card at about 20 MB/s
/// is under a second at this size.
pub(super) const ROW_SCAN_LIMIT: u64 = 16 * 1024 * 1024;

/// What the writer keeps for metrics.
#[derive(Debug, Default)]
pub(super) struct MetricsState {
    /// The rendering the listener serves.
    pub(super) snapshot: Snapshot,
    /// `metrics.textfile` writes and their rate-limited warnings.
    pub(super) textfile: Textfile,
    /// Duration of each commit of a commit window, this run.
    pub(super) commit: Histogram,
    /// Readings refused this run, every reason (for the summary line).
    pub(super) dropped: u64,
    /// The row counts were skipped for size, and that was logged.
    pub(super) scan_skip_logged: bool,
}

impl Writer {
    /// `(backlog, oldest unacknowledged row's append stamp, now)`, Unix ms
    /// on the wall clock: both index reads. Whether the stamp has an age is
    /// the caller's to judge ([`crate::event::age::stamp_age`]).
    pub(super) fn backlog_and_oldest(&self) -> (u64, Option<i64>, i64) {
        let spool = self.store.spool();
        let backlog = spool.backlog_estimate().unwrap_or(0);
        let oldest = spool.oldest_unacked_ms().ok().flatten();
        (backlog, oldest, wall_clock_ms().0)
    }

    /// Rows by (stream, state) if the spool is small enough to count them.
    fn row_counts(&mut self) -> Option<Vec<(String, String, i64)>> {
        let live = self.store.spool().usage().map(|(live, _)| live).ok()?;
        if live > ROW_SCAN_LIMIT {
            if !self.metrics.scan_skip_logged {
                log::info!(
                    "metrics: the spool holds {live} bytes of live data, over {ROW_SCAN_LIMIT}: rows by stream and state are not counted (a full scan) until it is smaller; backlog and oldest age still are"
                );
                self.metrics.scan_skip_logged = true;
            }
            return None;
        }
        self.metrics.scan_skip_logged = false;
        let t = Instant::now();
        let rows = self
            .store
            .spool()
            .stats(wall_clock_ms().0)
            .ok()?
            .by_stream_state;
        log::debug!("metrics: rows counted in {} ms", t.elapsed().as_millis());
        Some(rows)
    }

    /// Everything the metrics show now. `count_rows`: also count rows by
    /// stream and state (see [`ROW_SCAN_LIMIT`]).
    pub(super) fn figures(&mut self, count_rows: bool) -> Figures {
        let (backlog, oldest, now) = self.backlog_and_oldest();
        let rows = if count_rows { self.row_counts() } else { None };
        // Under the same size bound as the row counts (it reads the backlog).
        let streams = rows
            .as_ref()
            .and_then(|_| self.store.spool().backlog_by_stream(wall_clock_ms().0).ok());
        let (connacks, _) = self.peers.link.connection_counts();
        let (at_ms, _) = wall_clock_ms();
        Figures {
            rows,
            streams,
            backlog,
            // The metrics tell a stamp without an age from this (the gauge
            // of a stamp before the clock was set).
            oldest_unacked_age_secs: oldest.map_or(0.0, |c| (now - c).max(0) as f64 / 1000.0),
            connected: self.peers.link.connected(),
            reconnects: connacks.saturating_sub(1),
            puback: self.peers.link.puback_latency(),
            commit: self.metrics.commit,
            counters: self.store.spool().counters().unwrap_or_default(),
            write_bytes: crate::os::proc_io::proc_write_bytes().unwrap_or(0),
            checkpoints: self.upkeep.checkpoints(),
            appended: self.store.appended(),
            acked: self.peers.delivery_stats.retired.load(Ordering::Relaxed),
            at_unix_secs: at_ms as f64 / 1000.0,
            receipts: self.receipt_figures(),
            outage: self.outage.last.clone(),
            write_budget: Some(crate::metrics::write_budget::BudgetFigures {
                budget_bytes_per_day: self
                    .upkeep
                    .settings()
                    .budget
                    .bytes_per_day
                    .map(|b| b as f64),
                window_secs: self.upkeep.window().as_secs_f64(),
                over: self.upkeep.budget_verdict().reason().is_some(),
            }),
            health: Some(self.health.state().name()),
            failed_rows: self.store.spool().failed_count().ok(),
        }
    }

    /// Render the figures for the listener and, when `textfile`, write
    /// `metrics.textfile`. Nothing to do with both outputs off.
    pub(super) fn publish_metrics(&mut self, count_rows: bool, textfile: bool) {
        let m = &self.conf.cfg.metrics;
        if m.textfile.is_none() && m.listen.is_none() {
            return;
        }
        let listen = m.listen.is_some();
        let mut text = crate::metrics::render(&self.figures(count_rows));
        if let (true, Some(path)) = (textfile, self.conf.cfg.metrics.textfile.clone()) {
            self.metrics.textfile.write(&path, &text);
        }
        // The listener's scrape only: node_exporter, which reads the
        // textfile, has `process_*` of its own.
        if let Some(p) = listen.then(crate::metrics::process::read).flatten() {
            text.push_str(&crate::metrics::process::render(&p));
        }
        self.metrics.snapshot.publish(text);
    }

    /// PUBACK and commit latency as `status` shows them (p50, p99, max).
    pub(super) fn latency_json(&self) -> serde_json::Value {
        serde_json::json!({
            "puback": self.peers.link.puback_latency().summary_json(),
            "commit": self.metrics.commit.summary_json(),
        })
    }

    /// At start: a first snapshot (no row counts: startup work does not
    /// grow with the spool), then `metrics.listen` if set; a failure to bind
    /// is an ERROR and a health reason for the run, and the agent runs on
    /// without it.
    pub(in crate::agent) fn start_metrics(&mut self) -> Option<crate::metrics::listen::Listener> {
        self.publish_metrics(false, false);
        let addr = self.conf.cfg.metrics.listen?;
        match crate::metrics::listen::start(addr, self.metrics.snapshot.clone()) {
            Ok(l) => {
                log::info!("metrics: serving GET /metrics on http://{addr}");
                Some(l)
            }
            Err(e) => {
                log::error!(
                    "metrics.listen {addr}: cannot listen: {e}; running without the metrics listener"
                );
                self.health.listeners_down.push(format!(
                    "metrics.listen {addr}: {e} (no scrape reaches this agent)"
                ));
                None
            }
        }
    }

    /// At a clean stop: the last textfile, then the listener stops.
    pub(in crate::agent) fn stop_metrics(
        &mut self,
        listener: Option<crate::metrics::listen::Listener>,
    ) {
        self.publish_metrics(true, true);
        if let Some(l) = listener {
            let deadline = Instant::now() + Duration::from_secs(1);
            crate::os::threads::join_within(l.stop(), deadline, "the metrics listener");
        }
    }

    /// Move the ingest socket's counter increments into the spool's
    /// counters (they ride the next commit).
    pub(in crate::agent) fn store_socket_counts(&mut self) {
        let Some(c) = &self.peers.socket_counts else {
            return;
        };
        for (k, v) in c.take() {
            self.riding.count(k, v);
        }
    }

    /// Take the peers' shares of the spool ([`super::shares`]), and record
    /// in `agent_state` (`ingest_listeners`, shown by `status`) what
    /// the ingest socket listens on; "off" replaces an earlier entry. A
    /// socket another process holds becomes an `_agent` event and a health
    /// reason for the run; a TCP address that could not be bound, a health
    /// reason for the run.
    pub(in crate::agent) fn note_socket_ingest(&mut self, s: &crate::ingest::SocketIngest) {
        self.take_shares(s.shares());
        let now = crate::event::envelope::wall_clock_ms().0;
        if let Some(why) = s.conflict() {
            self.agent_event("ingest_socket_taken", &why);
            self.health.socket_taken = Some(why);
        }
        if let Some(why) = s.tcp_down() {
            self.health.listeners_down.push(why);
        }
        let spool = self.store.conn(Durability::Batched);
        let had = spool
            .states()
            .is_ok_and(|v| v.iter().any(|(k, _, _)| k == "ingest_listeners"));
        match s.describe() {
            Some(d) => {
                let _ = spool.set_state("ingest_listeners", &d, now);
            }
            None if had => {
                let _ = spool.set_state("ingest_listeners", "off", now);
            }
            None => {}
        }
    }

    /// Receipt mode's figures for the metrics.
    fn receipt_figures(&self) -> Option<crate::metrics::ReceiptFigures> {
        if self.conf.cfg.mqtt.retire_on != crate::mqtt::RetireOn::Receipt {
            return None;
        }
        let s = &self.peers.delivery_stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (awaiting, oldest) = self.awaiting_receipt();
        Some(crate::metrics::ReceiptFigures {
            awaiting,
            oldest_awaiting_secs: oldest.map_or(0.0, |d| d.as_secs_f64()),
            received: load(&s.receipts),
            unmatched_ids: load(&s.receipt_unmatched),
            refused: s.receipts_refused.by_reason(),
            wrong_digest: load(&s.receipt_wrong_digest),
            resent: load(&s.resent_for_receipt),
            dropped: self.peers.link.health_facts().receipts_dropped,
            unavailable: load(&s.receipts_unavailable) == 1,
            timeout_secs: self.conf.cfg.mqtt.receipt_timeout.as_secs_f64(),
        })
    }
}
