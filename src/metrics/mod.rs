//! Metrics: the agent's figures in the Prometheus text exposition format
//! 0.0.4, for a node_exporter textfile (`metrics.textfile`) and an optional
//! loopback HTTP listener (`metrics.listen`, [`listen`]).
//!
//! Its one rule: **metrics are a snapshot the ingest thread renders at the
//! summary interval; nothing here touches the spool or blocks delivery**.
//! The agent gathers [`Figures`] (spool counts and counters it already reads
//! for `status`, the connection, two latency [`Histogram`]s) and [`render`]s
//! them into a [`Snapshot`] that the listener and the textfile only copy.
//! Memory is fixed: a histogram is an array of bucket counts, never a list of
//! samples; label values come from the config (streams) or from code.
//!
//! Format rules followed here (cited from
//! <https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format>):
//! every family has one `# HELP` and one `# TYPE` line before its samples,
//! and its samples are one group; a sample line is
//! `name{label="value",...} value`; label values escape `\`, `"` and newline
//! as `\\`, `\"` and `\n`, HELP text escapes `\` and newline; a histogram
//! has cumulative `_bucket{le="..."}` samples ending with `le="+Inf"`, which
//! equals `_count`, and a `_sum`. Names follow
//! <https://prometheus.io/docs/practices/naming/>: an `edgespool_` prefix,
//! `_total` on counters, base units (seconds, bytes).

pub mod listen;
pub mod outage;
pub mod process;
pub mod write_budget;

/// `[metrics]`: Prometheus metrics ([`crate::metrics`]). Off by default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetricsConfig {
    /// `textfile`: an absolute path (for node_exporter's textfile collector,
    /// e.g. `/var/lib/node_exporter/textfile_collector/edgespool.prom`),
    /// replaced whole at every `agent.summary_interval_secs` and at a clean
    /// stop. Unset: no file.
    pub textfile: Option<PathBuf>,
    /// `listen`: `IP:port` of an HTTP listener serving `GET /metrics`
    /// (e.g. `127.0.0.1:9469`). Unset: no listener. A non-loopback address
    /// needs `listen_public`.
    pub listen: Option<std::net::SocketAddr>,
    /// `listen_public`: allow `listen` on an address other hosts can reach
    /// (default false).
    pub listen_public: bool,
}

use crate::event::age::StampAge;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the latency histograms' buckets: 1 ms to 30 s,
/// wide enough for an SD card's fsync stalls (hundreds of ms to seconds)
/// and a broker's PUBACK over a slow link. Observations above 30 s fall in
/// the `+Inf` bucket only.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The media type of the text format 0.0.4, for the HTTP `Content-Type`.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A latency histogram with the fixed [`LATENCY_BUCKETS`]: bucket counts,
/// sum, count and the largest observation. Fixed size whatever the number
/// of observations.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last is above 30 s.
    counts: [u64; LATENCY_BUCKETS.len() + 1],
    /// Sum of observations, seconds.
    sum: f64,
    /// Largest observation, seconds.
    max: f64,
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Histogram {
        Histogram::default()
    }

    /// Record one duration.
    pub fn observe(&mut self, d: Duration) {
        self.observe_secs(d.as_secs_f64());
    }

    /// Record one value in seconds (negative or not finite counts as 0).
    pub fn observe_secs(&mut self, secs: f64) {
        let v = if secs.is_finite() && secs > 0.0 {
            secs
        } else {
            0.0
        };
        let i = LATENCY_BUCKETS
            .iter()
            .position(|&le| v <= le)
            .unwrap_or(LATENCY_BUCKETS.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.max = self.max.max(v);
    }

    /// Observations recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Sum of observations, seconds.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Largest observation, seconds (0 when empty).
    pub fn max(&self) -> f64 {
        self.max
    }

    /// `(le, cumulative count)` per bucket, ending with `(+Inf, count)`.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            out.push((
                LATENCY_BUCKETS.get(i).copied().unwrap_or(f64::INFINITY),
                acc,
            ));
        }
        out
    }

    /// The `q` quantile (0..=1) estimated from the buckets the way
    /// Prometheus' `histogram_quantile` does (linear within the bucket that
    /// holds the rank), capped at the largest observation; `None` when empty.
    /// It is an estimate: its error is at most the width of that bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * n as f64;
        let mut below = 0u64;
        let mut lower = 0.0;
        for (i, &c) in self.counts.iter().enumerate() {
            let upper = LATENCY_BUCKETS.get(i).copied().unwrap_or(self.max);
            if c > 0 && (below + c) as f64 >= rank {
                let within = (rank - below as f64) / c as f64;
                return Some((lower + (upper - lower) * within).min(self.max));
            }
            below += c;
            lower = upper;
        }
        Some(self.max)
    }

    /// `{"count", "p50_seconds", "p99_seconds", "max_seconds"}` for `status`
    /// (quantiles are bucket estimates, null when nothing was observed).
    pub fn summary_json(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count(),
            "p50_seconds": self.quantile(0.5),
            "p99_seconds": self.quantile(0.99),
            "max_seconds": self.max,
        })
    }
}

/// Everything one rendering shows, gathered by the agent at the summary
/// interval. Counts are as the spool's `status` derives them.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Rows by `(stream, state)`; states are `PENDING`, `SENT`, `ACKED`, `FAILED`.
    /// `None`: the spool could not be read this time (the families are left out).
    pub rows: Option<Vec<(String, String, i64)>>,
    /// Backlog, oldest unacknowledged age and priority per stream; `None`
    /// when the rows were not counted (the families are left out).
    pub streams: Option<Vec<crate::spool::priority::StreamBacklog>>,
    /// Rows not yet acknowledged, at most (`Spool::backlog_estimate`).
    pub backlog: u64,
    /// Age of the oldest unacknowledged row, seconds (0 when there is none),
    /// counted to [`Figures::at_unix_secs`]; shown only when the clock can
    /// tell it (`waited_secs`).
    pub oldest_unacked_age_secs: f64,
    /// Connected to the broker now.
    pub connected: bool,
    /// CONNACKs accepted after the first one of this run.
    pub reconnects: u64,
    /// Time from a publish leaving to its PUBACK, this run.
    pub puback: Histogram,
    /// Duration of each spool commit of a commit window, this run.
    pub commit: Histogram,
    /// The spool's persistent counters `(name, value)`: drops, FAILED
    /// reasons, command outcomes (kept across restarts in the spool).
    pub counters: Vec<(String, i64)>,
    /// `write_bytes` of `/proc/self/io`: bytes this process sent to the
    /// block layer since it started.
    pub write_bytes: u64,
    /// Checkpoints run this run.
    pub checkpoints: u64,
    /// Readings appended this run.
    pub appended: u64,
    /// Rows retired on PUBACK this run.
    pub acked: u64,
    /// Wall clock of the gathering, Unix seconds.
    pub at_unix_secs: f64,
    /// Receipt mode's figures; `None` when rows retire on their PUBACK.
    pub receipts: Option<ReceiptFigures>,
    /// The outage budget of the last summary; `None` before the first
    /// (the families are left out).
    pub outage: Option<crate::flash::outage::Budget>,
    /// The write budget; `None`: the families are left out.
    pub write_budget: Option<write_budget::BudgetFigures>,
    /// The agent's health state, one of [`HEALTH_STATES`]; `None`: left out.
    pub health: Option<&'static str>,
    /// FAILED rows in the spool now (the `failed` table's count, cheap at
    /// any spool size); `None` when the spool could not be read.
    pub failed_rows: Option<u64>,
}

/// The states `edgespool_health{state}` lists, one sample each (1 for the
/// state in force, 0 for the others: a state set).
pub const HEALTH_STATES: [&str; 3] = ["ok", "starting", "degraded"];

/// What receipt mode (`mqtt.retire_on = "receipt"`) shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReceiptFigures {
    /// Rows PUBACKed and waiting for their receipt.
    pub awaiting: u64,
    /// How long the oldest of them has waited, seconds (0 when none).
    pub oldest_awaiting_secs: f64,
    /// Receipts read, this run.
    pub received: u64,
    /// Event ids receipts named that matched no waiting row, this run.
    pub unmatched_ids: u64,
    /// Receipts refused whole, by reason (malformed, unsigned, other_board,
    /// untrusted_key, bad_signature), this run.
    pub refused: [(&'static str, u64); 5],
    /// Event ids signed receipts named with another digest than the
    /// waiting row's bytes, this run.
    pub wrong_digest: u64,
    /// Rows sent again because their receipt did not come in time, this run.
    pub resent: u64,
    /// Receipts left unacknowledged, this run, because the MQTT thread's
    /// queue to the delivery thread was full (a broker ignoring its own
    /// in-flight window; it sends them again with the next session).
    pub dropped: u64,
    /// The broker refuses the receipts subscription now.
    pub unavailable: bool,
    /// `mqtt.receipt_timeout_secs`: health calls receipts stopped once the
    /// oldest row has waited twice this.
    pub timeout_secs: f64,
}

/// Receipt mode's families.
fn render_receipts(o: &mut Out, r: &ReceiptFigures) {
    let families: [(&str, &str, &str, f64); 9] = [
        ("edgespool_rows_awaiting_receipt", "gauge", "Rows the broker acknowledged that the fleet's database has not yet receipted (waiting, or sent again).", r.awaiting as f64),
        ("edgespool_oldest_awaiting_receipt_age_seconds", "gauge", "How long the oldest row not yet stored at the fleet has waited since its first PUBACK (re-sends do not reset it; 0 when none).", r.oldest_awaiting_secs),
        ("edgespool_receipts_total", "counter", "Receipts read, this run.", r.received as f64),
        ("edgespool_receipt_unmatched_ids_total", "counter", "Event ids in receipts that matched no waiting row (nothing retired for them: a repeated receipt, or one for a row sent again for the fleet's backfill), this run.", r.unmatched_ids as f64),
        ("edgespool_receipt_wrong_digest_ids_total", "counter", "Event ids in signed receipts named with another digest than the waiting row's bytes (nothing retired for them), this run.", r.wrong_digest as f64),
        ("edgespool_rows_resent_for_receipt_total", "counter", "Rows published again because their receipt did not come within mqtt.receipt_timeout_secs, this run.", r.resent as f64),
        ("edgespool_receipts_dropped_total", "counter", "Receipts left unacknowledged because 1024 already waited for the delivery thread (a broker ignoring its in-flight window sends them again with the next session), this run.", r.dropped as f64),
        ("edgespool_receipts_unavailable", "gauge", "1 while the broker refuses the receipts subscription (rows then wait: a refusal retires nothing), else 0.", if r.unavailable { 1.0 } else { 0.0 }),
        ("edgespool_receipt_timeout_seconds", "gauge", "mqtt.receipt_timeout_secs: a row PUBACKed and not receipted within it is sent again; health calls receipts stopped at twice it.", r.timeout_secs),
    ];
    for (name, kind, help, v) in families {
        o.single(name, kind, help, v);
    }
    o.family(
        "edgespool_receipts_refused_total",
        "counter",
        "Receipts refused whole (they retire nothing), by reason: malformed, unsigned (version 1), other_board, untrusted_key (not in mqtt.receipt_public_keys), bad_signature (forged or altered), this run.",
    );
    for (reason, n) in r.refused {
        o.sample(
            "edgespool_receipts_refused_total",
            &[("reason", reason)],
            n as f64,
        );
    }
}

/// The spool counter of MQTT clients rebuilt by the watchdog (connected,
/// rows in flight, no PUBACK for `mqtt.ack_timeout_secs`: the stall of
/// rumqtt issues 1014/1056); the delivery thread adds to it, `status` and
/// `edgespool_mqtt_watchdog_rebuilds_total` show it.
pub const WATCHDOG_REBUILDS: &str = "mqtt_watchdog_rebuilds";

/// Spool counters of opens that found committed rows gone, and the cause
/// each is shown under in `edgespool_spool_opened_with_loss_total`.
const LOSS_AT_OPEN: [(&str, &str); 3] = [
    ("spool_opened_without_wal", "wal_lost"),
    ("spool_moved_aside_without_wal", "wal_lost_moved_aside"),
    ("spool_moved_aside_corrupt", "damaged_moved_aside"),
];

/// The spool states, in the order rows flow.
const STATES: [&str; 4] = ["PENDING", "SENT", "ACKED", "FAILED"];

/// Reasons a reading is refused that the agent counts, shown as 0 before
/// they first happen (`readings_dropped_<reason>` counters).
const DROP_REASONS: [&str; 5] = [
    "buffer_full",
    "disk_full",
    "spool_full",
    "disk_reserve",
    "lost_at_shutdown",
];

/// Why a local peer's reading is refused before it is stored
/// (`readings_refused_<reason>`, [`crate::intake::share`]).
const PEER_REFUSALS: [&str; 3] = ["peer_rate", "peer_share", "input_share"];

/// Why the delivery thread marks a row FAILED (`events_failed_<reason>`),
/// shown as 0 before they first happen. `disconnects` and `puback_<reason>`
/// are not listed: only spools from before the broker's word deferred rows
/// instead of failing them hold such counters, and they are shown as found.
const FAIL_REASONS: [&str; 3] = ["oversized", "packet_too_large", "digest_mismatch"];

/// Final command states counted as `commands_<state>`.
const COMMAND_STATES: [&str; 5] = ["completed", "failed", "rejected", "expired", "interrupted"];

/// Other command counters: (spool counter, metric, HELP).
const COMMAND_COUNTERS: [(&str, &str, &str); 9] = [
    (
        "commands_received",
        "edgespool_commands_received_total",
        "Commands received and recorded (new command ids).",
    ),
    (
        "commands_duplicates",
        "edgespool_commands_duplicates_total",
        "Commands answered with their stored result (a redelivery or a resend).",
    ),
    (
        "commands_retained_duplicates",
        "edgespool_commands_retained_duplicates_total",
        "Retained commands seen again and not run again.",
    ),
    (
        "commands_conflicts",
        "edgespool_commands_conflicts_total",
        "Commands refused: a known command id with another request.",
    ),
    (
        "commands_malformed",
        "edgespool_commands_malformed_total",
        "Command messages that could not be parsed.",
    ),
    (
        "commands_unsigned",
        "edgespool_commands_unsigned_total",
        "Commands with a side effect refused because no operator key signed them (or their signature verified with none).",
    ),
    (
        "commands_rate_limited",
        "edgespool_commands_rate_limited_total",
        "Commands refused by the per-scope rate limit.",
    ),
    (
        "commands_held_back",
        "edgespool_commands_held_back_total",
        "Command messages held back unacknowledged while their lane was full.",
    ),
    (
        "commands_unanswered",
        "edgespool_commands_unanswered_total",
        "Command messages no operator key signed acknowledged and dropped unanswered over commands.max_answers_per_minute.",
    ),
];

/// Escape a label value: `\` → `\\`, `"` → `\"`, newline → `\n`.
pub fn escape_label_value(v: &str) -> String {
    let mut o = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

/// Escape HELP text: `\` → `\\`, newline → `\n`.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value as the format writes floats (`+Inf`, `-Inf`, `NaN`).
fn value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        format!("{v}")
    }
}

/// The exposition text being written.
struct Out(String);

impl Out {
    /// `# HELP` and `# TYPE` of a family.
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    /// One sample line.
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape_label_value(val));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {}", value(v));
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, v: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], v);
    }

    /// A histogram family from `h`.
    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        for (le, n) in h.cumulative() {
            self.sample(&bucket, &[("le", &value(le))], n as f64);
        }
        self.sample(&format!("{name}_sum"), &[], h.sum());
        self.sample(&format!("{name}_count"), &[], h.count() as f64);
    }

    /// A counter family labelled `label`, one sample per `known` value (0
    /// when the spool has no such counter yet) and per other counter found
    /// under `prefix`.
    fn counter_by(
        &mut self,
        f: &Figures,
        (name, help, label): (&str, &str, &str),
        prefix: &str,
        known: &[&str],
    ) {
        self.family(name, "counter", help);
        let mut values: Vec<(String, i64)> = known.iter().map(|k| ((*k).to_owned(), 0)).collect();
        for (counter, v) in &f.counters {
            // Per-stream copies (`<name>.<stream>`) are left out: by reason only.
            let Some(key) = counter.strip_prefix(prefix).filter(|k| !k.contains('.')) else {
                continue;
            };
            match values.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = *v,
                None => values.push((key.to_owned(), *v)),
            }
        }
        for (k, v) in &values {
            self.sample(name, &[(label, k)], *v as f64);
        }
    }
}

/// The value of the spool counter `name` (0 when absent).
fn counter(f: &Figures, name: &str) -> i64 {
    f.counters
        .iter()
        .find(|(k, _)| k == name)
        .map_or(0, |(_, v)| *v)
}

/// `f` in the Prometheus text exposition format 0.0.4 (see the module doc):
/// every family with HELP and TYPE, newline-terminated.
pub fn render(f: &Figures) -> String {
    let mut o = Out(String::with_capacity(8 * 1024));
    o.family(
        "edgespool_build_info",
        "gauge",
        "Always 1; the version label is the agent's version.",
    );
    o.sample(
        "edgespool_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1.0,
    );
    render_spool(&mut o, f);
    render_link(&mut o, f);
    if let Some(r) = &f.receipts {
        render_receipts(&mut o, r);
    }
    render_drops(&mut o, f);
    o.single(
        "edgespool_write_bytes_total",
        "counter",
        "Bytes this process sent to the block layer (write_bytes of /proc/self/io).",
        f.write_bytes as f64,
    );
    o.single(
        "edgespool_checkpoints_total",
        "counter",
        "WAL checkpoints run, this run.",
        f.checkpoints as f64,
    );
    render_commands(&mut o, f);
    if let Some(b) = &f.outage {
        outage::render(&mut o, b);
    }
    if let Some(b) = &f.write_budget {
        write_budget::render(&mut o, b);
    }
    render_health(&mut o, f);
    o.single(
        "edgespool_metrics_timestamp_seconds",
        "gauge",
        "Wall clock when these figures were gathered, Unix seconds.",
        f.at_unix_secs,
    );
    o.0
}

/// The link and what went through it: connection, reconnects, watchdog
/// rebuilds, PUBACK and commit latency, readings appended, rows retired.
fn render_link(o: &mut Out, f: &Figures) {
    o.single(
        "edgespool_mqtt_connected",
        "gauge",
        "1 while connected to the broker (CONNACK accepted, not yet lost), else 0.",
        if f.connected { 1.0 } else { 0.0 },
    );
    o.single(
        "edgespool_mqtt_reconnects_total",
        "counter",
        "Connections accepted by the broker after the first one of this run.",
        f.reconnects as f64,
    );
    o.single(
        "edgespool_mqtt_watchdog_rebuilds_total",
        "counter",
        "MQTT clients rebuilt by the watchdog: connected, rows in flight and no PUBACK for mqtt.ack_timeout_secs (kept across restarts in the spool).",
        counter(f, WATCHDOG_REBUILDS) as f64,
    );
    o.histogram(
        "edgespool_puback_latency_seconds",
        "Time from a publish leaving the agent to its PUBACK, this run.",
        &f.puback,
    );
    o.histogram(
        "edgespool_spool_commit_duration_seconds",
        "Duration of each spool commit of a commit window, this run.",
        &f.commit,
    );
    o.single(
        "edgespool_readings_appended_total",
        "counter",
        "Readings committed to the spool, this run.",
        f.appended as f64,
    );
    o.single(
        "edgespool_rows_acked_total",
        "counter",
        "Rows retired (on their PUBACK, or in receipt mode on their receipt), this run.",
        f.acked as f64,
    );
}

/// Readings dropped and refused, rows FAILED: by reason.
fn render_drops(o: &mut Out, f: &Figures) {
    let mut lost = f.clone();
    // `readings_lost_at_shutdown` is a drop by another name.
    for (k, _) in lost.counters.iter_mut() {
        if k == "readings_lost_at_shutdown" {
            *k = "readings_dropped_lost_at_shutdown".to_owned();
        }
    }
    o.counter_by(
        &lost,
        (
            "edgespool_readings_dropped_total",
            "Readings refused and not stored, by reason (kept in the spool across restarts).",
            "reason",
        ),
        "readings_dropped_",
        &DROP_REASONS,
    );
    o.counter_by(
        f,
        (
            "edgespool_readings_refused_total",
            "Readings of local peers (ingest socket, TCP port, mqtt bridges) refused over their byte rate or share of the spool, by reason (kept in the spool across restarts).",
            "reason",
        ),
        "readings_refused_",
        &PEER_REFUSALS,
    );
    o.counter_by(
        f,
        (
            "edgespool_rows_failed_total",
            "Rows marked FAILED by policy, by reason (kept in the spool across restarts).",
            "reason",
        ),
        "events_failed_",
        &FAIL_REASONS,
    );
}

/// The health state set and the opens that found rows gone.
fn render_health(o: &mut Out, f: &Figures) {
    if let Some(state) = f.health {
        let name = "edgespool_health";
        o.family(
            name,
            "gauge",
            "The agent's health, one sample per state: 1 for the state in force (starting: no CONNACK yet this run; degraded: edgespool status names why), 0 for the others.",
        );
        for s in HEALTH_STATES {
            o.sample(name, &[("state", s)], if s == state { 1.0 } else { 0.0 });
        }
    }
    let name = "edgespool_spool_opened_with_loss_total";
    o.family(
        name,
        "counter",
        "Starts that found committed rows gone, by cause: wal_lost (the -wal was gone; the rows in the file kept), wal_lost_moved_aside (every commit was in the lost -wal; the file moved aside), damaged_moved_aside (the file moved aside as damaged). Kept in the spool across restarts.",
    );
    for (counter_name, cause) in LOSS_AT_OPEN {
        o.sample(name, &[("cause", cause)], counter(f, counter_name) as f64);
    }
}

/// Rows by state and stream, backlog and the oldest unacknowledged age.
fn render_spool(o: &mut Out, f: &Figures) {
    if let Some(rows) = &f.rows {
        o.family(
            "edgespool_spool_rows_by_state",
            "gauge",
            "Rows in the spool by state, all streams.",
        );
        for st in STATES {
            let n: i64 = rows.iter().filter(|(_, s, _)| s == st).map(|r| r.2).sum();
            o.sample("edgespool_spool_rows_by_state", &[("state", st)], n as f64);
        }
        o.family(
            "edgespool_spool_rows",
            "gauge",
            "Rows in the spool by stream and state.",
        );
        for (stream, st, n) in rows {
            o.sample(
                "edgespool_spool_rows",
                &[("stream", stream), ("state", st)],
                *n as f64,
            );
        }
    }
    if let Some(streams) = &f.streams {
        render_stream_backlog(o, streams, (f.at_unix_secs * 1000.0).round() as i64);
    }
    if let Some(n) = f.failed_rows {
        o.single(
            "edgespool_spool_failed_rows",
            "gauge",
            "FAILED rows in the spool (kept, not delivered, until an operator requeues them); shown at any spool size.",
            n as f64,
        );
    }
    o.single(
        "edgespool_spool_backlog_rows",
        "gauge",
        "Rows not yet acknowledged, at most (FAILED rows and acknowledgements out of order count too).",
        f.backlog as f64,
    );
    // The gathering has the age and its clock only: the time the age
    // counts from is the clock less the age (ms apart at most).
    let now_ms = (f.at_unix_secs * 1000.0).round() as i64;
    let from_ms = now_ms - (f.oldest_unacked_age_secs * 1000.0).round() as i64;
    let before_set = f.oldest_unacked_age_secs > 0.0
        && crate::event::age::stamp_age(from_ms, now_ms) == StampAge::BeforeClockSet;
    o.single(
        "edgespool_oldest_unacked_age_seconds",
        "gauge",
        "Age of the oldest unacknowledged row by its append wall time (for a row appended before the clock was set, from when the spool saw it set), seconds; 0 when every row is acknowledged, or when the clock cannot tell (edgespool_oldest_unacked_before_clock_set).",
        waited_secs(from_ms, now_ms),
    );
    o.single(
        "edgespool_oldest_unacked_before_clock_set",
        "gauge",
        "1 while the oldest unacknowledged row was appended before the board's clock was set (a 1970 time) and the spool has yet to see it set (its first commit once time sync vouches for the clock): its age is unknown and shown as 0; 0 otherwise.",
        f64::from(u8::from(before_set)),
    );
}

/// What the age gauges show for a row whose age counts from `from_ms`,
/// seen at `now_ms` (Unix ms): its age in seconds when the clock can tell
/// one ([`crate::event::age::stamp_age`]), else 0, never the 56 years from
/// 1970 nor a negative age. 0 is the one figure no true wait is below: a
/// row appended before the clock was set has waited at least since then,
/// and the spool counts it from then once a commit sees the clock set by
/// time sync (`spool::clock_spans`), so a backlog that stays stuck still ages
/// past an alert's threshold.
fn waited_secs(from_ms: i64, now_ms: i64) -> f64 {
    match crate::event::age::stamp_age(from_ms, now_ms) {
        StampAge::Age(ms) => ms as f64 / 1000.0,
        _ => 0.0,
    }
}

/// Backlog and oldest unacknowledged age per stream, labelled with the
/// stream's delivery priority, the ages seen at `now_ms` (Unix ms).
fn render_stream_backlog(
    o: &mut Out,
    streams: &[crate::spool::priority::StreamBacklog],
    now_ms: i64,
) {
    o.family(
        "edgespool_stream_backlog_rows",
        "gauge",
        "Rows not yet acknowledged per stream (FAILED rows not counted), with the stream's delivery priority.",
    );
    for b in streams {
        let prio = b.priority.to_string();
        o.sample(
            "edgespool_stream_backlog_rows",
            &[("stream", &b.stream), ("priority", &prio)],
            b.rows as f64,
        );
    }
    o.family(
        "edgespool_stream_oldest_unacked_age_seconds",
        "gauge",
        "Age of the stream's oldest unacknowledged row by its append wall time, seconds; 0 when it has none, or when the clock cannot tell (appended before the clock was set, or ahead of it).",
    );
    for b in streams {
        let prio = b.priority.to_string();
        o.sample(
            "edgespool_stream_oldest_unacked_age_seconds",
            &[("stream", &b.stream), ("priority", &prio)],
            b.oldest_unacked_ms
                .map_or(0.0, |from| waited_secs(from, now_ms)),
        );
    }
}

/// Command counters from the spool.
fn render_commands(o: &mut Out, f: &Figures) {
    for (counter_name, metric, help) in COMMAND_COUNTERS {
        o.single(metric, "counter", help, counter(f, counter_name) as f64);
    }
    let name = "edgespool_commands_finished_total";
    o.family(
        name,
        "counter",
        "Commands that reached a final state, by state.",
    );
    for st in COMMAND_STATES {
        o.sample(
            name,
            &[("state", st)],
            counter(f, &format!("commands_{st}")) as f64,
        );
    }
}

/// The last rendering, shared between the ingest thread (which replaces it)
/// and the listener (which copies it out). Never held across I/O.
#[derive(Debug, Clone, Default)]
pub struct Snapshot(Arc<Mutex<String>>);

impl Snapshot {
    /// An empty snapshot (served as an empty body until the first rendering).
    pub fn new() -> Snapshot {
        Snapshot::default()
    }

    /// Replace the text.
    pub fn publish(&self, text: String) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = text;
    }

    /// A copy of the text.
    pub fn text(&self) -> String {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Replace `path` with `text` so a reader sees the old file or the new one,
/// whole: write `<path>.tmp-<pid>` in the same directory (created
/// exclusively, never through a symlink, mode 0644 so node_exporter's user
/// can read it), then rename over `path`. No fsync: the file is rewritten
/// every summary interval and flash writes are the scarce resource; after a
/// power cut it may be old or empty until the next interval. The temporary
/// name does not end in `.prom`, so node_exporter's textfile collector never
/// reads a half-written file.
///
/// Errors: the directory is missing or not writable, the disk is full; the
/// old file is untouched and the temporary file removed.
pub fn write_textfile(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    if std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_file()) {
        let _ = std::fs::remove_file(&tmp);
    }
    let res = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// How often a textfile that keeps failing is warned about.
const TEXTFILE_WARN_EVERY: Duration = Duration::from_secs(600);

/// Writes `metrics.textfile` and rate-limits its warnings: the first failure
/// is a WARN naming the path, repeats at most every 10 minutes, and the
/// first success after failures an INFO. A failure never stops the agent.
#[derive(Debug, Default)]
pub struct Textfile {
    /// When the last warning was logged, while failing.
    warned_at: Option<Instant>,
    /// Failures since the last success.
    failures: u64,
}

impl Textfile {
    /// Write `text` to `path` (see [`write_textfile`]), logging as above.
    pub fn write(&mut self, path: &Path, text: &str) {
        match write_textfile(path, text) {
            Ok(()) => {
                if self.failures > 0 {
                    log::info!(
                        "metrics.textfile {}: written again after {} failed attempts",
                        path.display(),
                        self.failures
                    );
                }
                *self = Textfile::default();
            }
            Err(e) => {
                self.failures += 1;
                if self
                    .warned_at
                    .is_none_or(|t| t.elapsed() >= TEXTFILE_WARN_EVERY)
                {
                    log::warn!(
                        "metrics.textfile {}: cannot write: {e} ({} failed attempts; repeats logged every 10 min)",
                        path.display(),
                        self.failures
                    );
                    self.warned_at = Some(Instant::now());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// A sample line parsed back: name, labels, value.
    type Sample = (String, Vec<(String, String)>, f64);

    fn is_name(s: &str) -> bool {
        let mut c = s.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
    }

    /// Parse `name{k="v",...} value` strictly (the 0.0.4 grammar, without
    /// timestamps); panics with the line on anything else.
    fn parse_sample(line: &str) -> Sample {
        let (head, val) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let v = match val {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("value in {line}")),
        };
        let Some((name, rest)) = head.split_once('{') else {
            assert!(is_name(head), "name in {line}");
            return (head.to_owned(), Vec::new(), v);
        };
        assert!(is_name(name), "name in {line}");
        let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("{line}"));
        let mut labels = Vec::new();
        let mut chars = body.chars().peekable();
        while chars.peek().is_some() {
            let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
            assert!(is_name(&key), "label name {key:?} in {line}");
            assert_eq!(chars.next(), Some('"'), "{line}");
            let mut val = String::new();
            loop {
                match chars.next() {
                    Some('\\') => match chars.next() {
                        Some('\\') => val.push('\\'),
                        Some('"') => val.push('"'),
                        Some('n') => val.push('\n'),
                        other => panic!("bad escape {other:?} in {line}"),
                    },
                    Some('"') => break,
                    Some('\n') | None => panic!("unterminated label value in {line}"),
                    Some(c) => val.push(c),
                }
            }
            labels.push((key, val));
            match chars.next() {
                Some(',') | None => {}
                other => panic!("expected ',' got {other:?} in {line}"),
            }
        }
        (name.to_owned(), labels, v)
    }

    /// Check the whole text: HELP and TYPE once per family, before its
    /// samples, samples of a family in one group, every line in grammar.
    /// Returns family → (type, samples).
    fn check(text: &str) -> BTreeMap<String, (String, Vec<Sample>)> {
        assert!(text.ends_with('\n'));
        let mut fams: BTreeMap<String, (String, Vec<Sample>)> = BTreeMap::new();
        let mut helped = BTreeSet::new();
        let mut current: Option<String> = None;
        let mut closed = BTreeSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default().to_owned();
                assert!(is_name(&name) && helped.insert(name.clone()), "{line}");
                if let Some(c) = current.replace(name) {
                    closed.insert(c);
                }
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("{line}"));
                assert_eq!(
                    Some(name),
                    current.as_deref(),
                    "TYPE after its HELP: {line}"
                );
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                assert!(fams
                    .insert(name.to_owned(), (kind.to_owned(), Vec::new()))
                    .is_none());
            } else {
                assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
                let s = parse_sample(line);
                let fam = current
                    .clone()
                    .unwrap_or_else(|| panic!("sample before HELP: {line}"));
                let (kind, samples) = fams
                    .get_mut(&fam)
                    .unwrap_or_else(|| panic!("no TYPE: {line}"));
                let ok = match kind.as_str() {
                    "histogram" => [
                        format!("{fam}_bucket"),
                        format!("{fam}_sum"),
                        format!("{fam}_count"),
                    ]
                    .contains(&s.0),
                    "counter" => s.0 == fam && fam.ends_with("_total"),
                    _ => s.0 == fam,
                };
                assert!(ok, "sample {} outside its family {fam}", s.0);
                assert!(!closed.contains(&fam));
                samples.push(s);
            }
        }
        for (name, (kind, samples)) in &fams {
            assert!(helped.contains(name), "{name} has no HELP");
            if kind == "histogram" {
                check_histogram(name, samples);
            }
        }
        fams
    }

    fn check_histogram(name: &str, samples: &[Sample]) {
        let buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.0.ends_with("_bucket"))
            .map(|s| {
                let le = &s.1.iter().find(|(k, _)| k == "le").expect("le").1;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().expect("le")
                };
                (le, s.2)
            })
            .collect();
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
            "{name}: {buckets:?}"
        );
        let last = buckets.last().expect("buckets");
        assert_eq!(last.0, f64::INFINITY, "{name} ends with +Inf");
        let count = samples
            .iter()
            .find(|s| s.0 == format!("{name}_count"))
            .expect("_count")
            .2;
        assert_eq!(last.1, count, "{name}: +Inf bucket equals _count");
        assert!(samples.iter().any(|s| s.0 == format!("{name}_sum")));
    }

    fn figures() -> Figures {
        let mut puback = Histogram::new();
        for ms in [0.5, 3.0, 3.0, 40.0, 900.0, 45_000.0] {
            puback.observe_secs(ms / 1000.0);
        }
        Figures {
            rows: Some(vec![
                ("system".into(), "ACKED".into(), 40),
                ("system".into(), "PENDING".into(), 2),
                ("we\"ird\\str\neam".into(), "FAILED".into(), 1),
            ]),
            streams: Some(vec![
                crate::spool::priority::StreamBacklog {
                    stream: "_commands".into(),
                    priority: 200,
                    rows: 0,
                    oldest_unacked_age_ms: None,
                    oldest_unacked_ms: None,
                },
                crate::spool::priority::StreamBacklog {
                    stream: "system".into(),
                    priority: 0,
                    rows: 2,
                    oldest_unacked_age_ms: Some(1500),
                    oldest_unacked_ms: Some(1_700_000_000_250 - 1500),
                },
            ]),
            backlog: 3,
            oldest_unacked_age_secs: 1.5,
            connected: true,
            reconnects: 2,
            puback,
            commit: Histogram::new(),
            counters: vec![
                ("readings_dropped_disk_full".into(), 7),
                ("readings_dropped_disk_full.system".into(), 7),
                ("readings_dropped_new_reason".into(), 1),
                ("events_failed_oversized".into(), 1),
                ("commands_received".into(), 4),
                ("commands_completed".into(), 3),
                ("readings_lost_at_shutdown".into(), 2),
                ("mqtt_watchdog_rebuilds".into(), 3),
                ("spool_opened_without_wal".into(), 1),
            ],
            write_bytes: 4096,
            checkpoints: 5,
            appended: 43,
            acked: 40,
            at_unix_secs: 1_700_000_000.25,
            receipts: None,
            // Readings this run, none in the window: the hold time is +Inf.
            outage: Some(crate::flash::outage::budget(
                &{
                    let mut m = crate::flash::outage::Meter::new(60.0);
                    for at in [0.0, 5.0] {
                        m.record(crate::flash::outage::Sample {
                            at_secs: at,
                            streams: [("we\"ird".to_owned(), (3, 300))].into(),
                            ..Default::default()
                        });
                    }
                    m
                },
                crate::flash::outage::Room {
                    used_bytes: 4096,
                    max_bytes: 8192,
                    free_bytes: 1 << 30,
                    rows: 2,
                    backlog_rows: 2,
                    ..Default::default()
                },
            )),
            write_budget: Some(write_budget::BudgetFigures {
                budget_bytes_per_day: Some(1e8),
                window_secs: 10.0,
                over: false,
            }),
            health: Some("degraded"),
            failed_rows: Some(1),
        }
    }

    fn value_of(
        f: &BTreeMap<String, (String, Vec<Sample>)>,
        name: &str,
        labels: &[(&str, &str)],
    ) -> f64 {
        let fam = name
            .trim_end_matches("_bucket")
            .trim_end_matches("_sum")
            .trim_end_matches("_count");
        f.get(fam)
            .or_else(|| f.get(name))
            .and_then(|(_, s)| {
                s.iter().find(|s| {
                    s.0 == name
                        && labels
                            .iter()
                            .all(|(k, v)| s.1.iter().any(|(a, b)| a == k && b == v))
                })
            })
            .map(|s| s.2)
            .unwrap_or_else(|| panic!("no {name}{labels:?}"))
    }

    #[test]
    fn every_line_is_in_the_grammar_and_every_family_has_help_and_type() {
        let fams = check(&render(&figures()));
        for name in [
            "edgespool_spool_rows",
            "edgespool_spool_rows_by_state",
            "edgespool_oldest_unacked_age_seconds",
            "edgespool_oldest_unacked_before_clock_set",
            "edgespool_mqtt_connected",
            "edgespool_mqtt_reconnects_total",
            "edgespool_puback_latency_seconds",
            "edgespool_spool_commit_duration_seconds",
            "edgespool_readings_dropped_total",
            "edgespool_rows_failed_total",
            "edgespool_write_bytes_total",
            "edgespool_checkpoints_total",
            "edgespool_commands_received_total",
            "edgespool_commands_finished_total",
            "edgespool_write_budget_bytes_per_day",
            "edgespool_write_budget_exceeded",
            "edgespool_commit_window_seconds",
        ] {
            assert!(fams.contains_key(name), "{name} missing");
        }
        // An empty histogram renders too.
        check(&render(&Figures::default()));
    }

    #[test]
    fn rows_and_counters_carry_their_labels_and_values() {
        let f = check(&render(&figures()));
        assert_eq!(
            value_of(&f, "edgespool_spool_rows_by_state", &[("state", "ACKED")]),
            40.0
        );
        assert_eq!(
            value_of(&f, "edgespool_spool_rows_by_state", &[("state", "SENT")]),
            0.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_spool_rows",
                &[("stream", "system"), ("state", "PENDING")]
            ),
            2.0
        );
        assert_eq!(value_of(&f, "edgespool_mqtt_connected", &[]), 1.0);
        assert_eq!(
            value_of(&f, "edgespool_mqtt_watchdog_rebuilds_total", &[]),
            3.0
        );
        // Shown as 0 before the first rebuild.
        let none = check(&render(&Figures::default()));
        assert_eq!(
            value_of(&none, "edgespool_mqtt_watchdog_rebuilds_total", &[]),
            0.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_readings_dropped_total",
                &[("reason", "disk_full")]
            ),
            7.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_readings_dropped_total",
                &[("reason", "buffer_full")]
            ),
            0.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_readings_dropped_total",
                &[("reason", "new_reason")]
            ),
            1.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_readings_dropped_total",
                &[("reason", "lost_at_shutdown")]
            ),
            2.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_rows_failed_total",
                &[("reason", "oversized")]
            ),
            1.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_commands_finished_total",
                &[("state", "completed")]
            ),
            3.0
        );
        assert_eq!(
            value_of(&f, "edgespool_puback_latency_seconds_count", &[]),
            6.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_puback_latency_seconds_bucket",
                &[("le", "0.005")]
            ),
            3.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_puback_latency_seconds_bucket",
                &[("le", "30")]
            ),
            5.0
        );
    }

    /// Issue 36: the FAILED count was left out past 16 MiB of live data
    /// (with the row counts), and `EdgespoolRowsFailed` fell silent.
    #[test]
    fn failed_rows_and_health_are_shown_without_the_row_counts() {
        let mut figs = figures();
        figs.rows = None;
        figs.streams = None;
        let f = check(&render(&figs));
        assert!(!f.contains_key("edgespool_spool_rows_by_state"));
        assert_eq!(value_of(&f, "edgespool_spool_failed_rows", &[]), 1.0);
        for (state, v) in [("ok", 0.0), ("starting", 0.0), ("degraded", 1.0)] {
            assert_eq!(value_of(&f, "edgespool_health", &[("state", state)]), v);
        }
        assert_eq!(
            value_of(
                &f,
                "edgespool_spool_opened_with_loss_total",
                &[("cause", "wal_lost")]
            ),
            1.0
        );
        assert_eq!(
            value_of(
                &f,
                "edgespool_spool_opened_with_loss_total",
                &[("cause", "damaged_moved_aside")]
            ),
            0.0
        );
    }

    #[test]
    fn the_process_families_follow_the_client_library_names_and_types() {
        let text = process::render(&process::ProcessFigures {
            cpu_seconds: 1.5,
            resident_bytes: 8 << 20,
            virtual_bytes: 64 << 20,
            start_time_secs: 1_699_999_000.0,
            open_fds: Some(12),
            max_fds: Some(1024),
        });
        let f = check(&text);
        assert_eq!(value_of(&f, "process_cpu_seconds_total", &[]), 1.5);
        assert_eq!(f["process_cpu_seconds_total"].0, "counter");
        assert_eq!(value_of(&f, "process_open_fds", &[]), 12.0);
        assert_eq!(value_of(&f, "process_max_fds", &[]), 1024.0);
        assert_eq!(
            value_of(&f, "process_resident_memory_bytes", &[]),
            (8 << 20) as f64
        );
        assert_eq!(
            value_of(&f, "process_start_time_seconds", &[]),
            1_699_999_000.0
        );
        // Appended to a rendering, the whole stays one valid exposition.
        check(&(render(&figures()) + &text));
    }

    #[test]
    fn receipt_mode_shows_its_timeout_beside_the_oldest_wait() {
        let mut figs = figures();
        figs.receipts = Some(ReceiptFigures {
            awaiting: 3,
            oldest_awaiting_secs: 700.0,
            received: 0,
            unmatched_ids: 0,
            refused: [
                ("malformed", 0),
                ("unsigned", 0),
                ("other_board", 0),
                ("untrusted_key", 0),
                ("bad_signature", 0),
            ],
            wrong_digest: 0,
            resent: 0,
            dropped: 0,
            unavailable: false,
            timeout_secs: 300.0,
        });
        let f = check(&render(&figs));
        assert_eq!(
            value_of(&f, "edgespool_receipt_timeout_seconds", &[]),
            300.0
        );
        assert_eq!(
            value_of(&f, "edgespool_oldest_awaiting_receipt_age_seconds", &[]),
            700.0
        );
    }

    /// A board without an RTC appended in 1970; time sync has set the
    /// clock since, and the spool has yet to see it set.
    #[test]
    fn the_age_gauges_never_show_the_decades_since_1970() {
        let set_ms: i64 = 1_790_000_000_000;
        let mut f = figures();
        f.at_unix_secs = set_ms as f64 / 1000.0;
        f.oldest_unacked_age_secs = (set_ms - 42_000) as f64 / 1000.0;
        if let Some(s) = f.streams.as_mut() {
            s[1].oldest_unacked_ms = Some(42_000);
            s[1].oldest_unacked_age_ms = Some(set_ms - 42_000);
        }
        let m = check(&render(&f));
        let sys = [("stream", "system"), ("priority", "0")];
        assert_eq!(
            value_of(&m, "edgespool_oldest_unacked_age_seconds", &[]),
            0.0
        );
        assert_eq!(
            value_of(&m, "edgespool_stream_oldest_unacked_age_seconds", &sys),
            0.0
        );
        assert_eq!(
            value_of(&m, "edgespool_oldest_unacked_before_clock_set", &[]),
            1.0
        );
        // Once the spool counts it from when the clock was set: 5 min.
        f.oldest_unacked_age_secs = 300.0;
        if let Some(s) = f.streams.as_mut() {
            s[1].oldest_unacked_ms = Some(set_ms - 300_000);
        }
        let m = check(&render(&f));
        assert_eq!(
            value_of(&m, "edgespool_oldest_unacked_age_seconds", &[]),
            300.0
        );
        assert_eq!(
            value_of(&m, "edgespool_stream_oldest_unacked_age_seconds", &sys),
            300.0
        );
        assert_eq!(
            value_of(&m, "edgespool_oldest_unacked_before_clock_set", &[]),
            0.0
        );
        // A row stamped by a clock a day ahead, stepped back since.
        if let Some(s) = f.streams.as_mut() {
            s[1].oldest_unacked_ms = Some(set_ms + 86_400_000);
        }
        let m = check(&render(&f));
        assert_eq!(
            value_of(&m, "edgespool_stream_oldest_unacked_age_seconds", &sys),
            0.0
        );
    }

    #[test]
    fn backlog_per_stream_carries_the_stream_and_its_priority() {
        let f = check(&render(&figures()));
        let sys = [("stream", "system"), ("priority", "0")];
        assert_eq!(value_of(&f, "edgespool_stream_backlog_rows", &sys), 2.0);
        assert_eq!(
            value_of(&f, "edgespool_stream_oldest_unacked_age_seconds", &sys),
            1.5
        );
        let cmd = [("stream", "_commands"), ("priority", "200")];
        assert_eq!(value_of(&f, "edgespool_stream_backlog_rows", &cmd), 0.0);
        assert_eq!(
            value_of(&f, "edgespool_stream_oldest_unacked_age_seconds", &cmd),
            0.0
        );
    }

    #[test]
    fn label_values_are_escaped_and_parse_back_to_the_stream_name() {
        let text = render(&figures());
        assert!(text.contains(r#"stream="we\"ird\\str\neam""#), "{text}");
        let f = check(&text);
        let s = &f["edgespool_spool_rows"].1;
        assert!(s
            .iter()
            .any(|s| s.1.iter().any(|(_, v)| v == "we\"ird\\str\neam")));
        assert_eq!(escape_help("a\\b\nc"), "a\\\\b\\nc");
    }

    #[test]
    fn quantiles_are_bucket_estimates_capped_at_the_max() {
        let mut h = Histogram::new();
        assert_eq!(h.quantile(0.5), None);
        for _ in 0..99 {
            h.observe(Duration::from_millis(2));
        }
        h.observe(Duration::from_millis(700));
        let p50 = h.quantile(0.5).expect("p50");
        assert!((0.001..=0.0025).contains(&p50), "{p50}");
        let p99 = h.quantile(0.99).expect("p99");
        assert!(p99 <= 0.0025, "{p99}");
        assert_eq!(h.quantile(1.0), Some(0.7));
        assert_eq!(h.max(), 0.7);
        let mut slow = Histogram::new();
        slow.observe(Duration::from_secs(90));
        let p = slow.quantile(0.5).expect("p50");
        assert!((30.0..=90.0).contains(&p), "{p}");
        assert_eq!(slow.cumulative().last(), Some(&(f64::INFINITY, 1)));
    }

    #[test]
    fn memory_stays_fixed_whatever_the_number_of_observations() {
        let mut h = Histogram::new();
        let size = std::mem::size_of_val(&h);
        for i in 0..100_000u64 {
            h.observe_secs((i % 40) as f64);
        }
        assert_eq!(std::mem::size_of_val(&h), size);
        assert_eq!(h.count(), 100_000);
        h.observe_secs(f64::NAN);
        h.observe_secs(-1.0);
        assert_eq!(h.cumulative()[0].1, 100_000 / 40 + 2);
    }

    #[test]
    fn the_textfile_is_replaced_whole_and_a_failure_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("edgespool.prom");
        write_textfile(&path, "a 1\n").expect("write");
        write_textfile(&path, "a 2\n").expect("rewrite");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "a 2\n");
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
        assert_eq!(names.len(), 1);
        let missing = dir.path().join("no-such-dir/edgespool.prom");
        assert!(write_textfile(&missing, "a 1\n").is_err());
        let mut t = Textfile::default();
        t.write(&missing, "a 1\n");
        t.write(&missing, "a 1\n");
        assert_eq!(t.failures, 2);
        t.write(&path, "a 3\n");
        assert_eq!(t.failures, 0);
    }
}
