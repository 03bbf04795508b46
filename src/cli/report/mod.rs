//! `edgespool status`: what the spool holds, read from the spool file itself.
//!
//! Its one rule: **status never writes and never holds a read transaction
//! longer than one query**, so it is safe beside a running agent (F01).

mod outage;
mod write_budget;

use crate::spool::{FailedRow, RunRecord, Spool, Stats};
use serde::Serialize;
use std::path::Path;

/// Everything `status` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Spool file.
    pub spool: String,
    /// Counts, WAL size, counters.
    pub stats: Stats,
    /// Rows by state over all streams.
    pub totals: Vec<(String, i64)>,
    /// Newest runs first.
    pub runs: Vec<RunRecord>,
    /// Command records by state, duplicates answered, mean duration.
    pub commands: crate::commands::store::CommandStats,
    /// The newest FAILED rows (at most 10) and why.
    pub failed: Vec<FailedRow>,
    /// The pid holding the spool's lock (a running agent), if any.
    pub running_pid: Option<String>,
    /// Backlog, oldest unacknowledged age and priority per stream (empty
    /// for a spool older than schema 8).
    pub streams: Vec<crate::spool::priority::StreamBacklog>,
    /// What the agent last recorded: `health`, `last_checkpoint`,
    /// `write_budget`, ... as (key, value, updated Unix ms).
    pub agent_state: Vec<(String, String, i64)>,
}

/// Build the report for the spool at `path`.
///
/// Errors: the spool cannot be opened or read (message names the path).
pub fn report(path: &Path, now_ms: i64) -> Result<Report, String> {
    if !path.exists() {
        return Err(format!(
            "spool {} does not exist (has the agent run yet?)",
            path.display()
        ));
    }
    let spool = Spool::open_read_only(path).map_err(|e| e.to_string())?;
    let stats = spool.stats(now_ms).map_err(|e| e.to_string())?;
    let runs = spool.runs(10).map_err(|e| e.to_string())?;
    // Older spools lack the newer tables until an agent migrates them.
    let version = spool.schema_version().map_err(|e| e.to_string())?;
    let commands = if version >= 2 {
        spool.command_stats().map_err(|e| e.to_string())?
    } else {
        Default::default()
    };
    let agent_state = if version >= 3 {
        spool.states().map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    let mut totals: Vec<(String, i64)> = Vec::new();
    for state in ["PENDING", "SENT", "ACKED", "FAILED"] {
        let n = stats
            .by_stream_state
            .iter()
            .filter(|(_, s, _)| s == state)
            .map(|(_, _, n)| n)
            .sum();
        totals.push((state.to_owned(), n));
    }
    Ok(Report {
        spool: path.display().to_string(),
        stats,
        totals,
        runs,
        commands,
        agent_state,
        failed: if version >= 5 {
            spool.failed_rows(10).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        },
        running_pid: crate::os::fsguard::holder(path),
        streams: if version >= 8 {
            spool.backlog_by_stream(now_ms).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        },
    })
}

fn fmt_ms(ms: i64) -> String {
    let secs = ms / 1000;
    format!(
        "{}d{:02}h{:02}m{:02}s",
        secs / 86400,
        secs / 3600 % 24,
        secs / 60 % 60,
        secs % 60
    )
}

/// A stored replay position as `trace T, lap L, line N` (the stored text
/// itself if it does not parse).
fn replay_line(stored: &str) -> String {
    match serde_json::from_str::<crate::event::reading::ReplayPosition>(stored) {
        Ok(p) => format!("trace {}, lap {}, line {}", p.trace_id, p.lap, p.line),
        Err(_) => stored.to_owned(),
    }
}

/// The health record as one line: `ok`, `starting (no connection to the
/// broker yet)` or `degraded: <reason>; <reason>` (an agent before schema 5
/// stored the line itself).
fn health_line(stored: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(stored) {
        Ok(v) if v["state"] == "ok" => "ok".to_owned(),
        Ok(v) if v["state"] == "starting" => {
            "starting (no connection to the broker yet)".to_owned()
        }
        Ok(v) if v["state"] == "degraded" => {
            let reasons: Vec<&str> = v["reasons"]
                .as_array()
                .map(|a| a.iter().filter_map(|r| r.as_str()).collect())
                .unwrap_or_default();
            format!("degraded: {}", reasons.join("; "))
        }
        _ => stored.to_owned(),
    }
}

/// The receipts record (receipt mode) as one line: rows delivered to the
/// broker and not yet stored at the fleet, the oldest one's wait, and what
/// receipts did.
fn receipts_line(stored: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(stored) else {
        return stored.to_owned();
    };
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let oldest = v["oldest_awaiting_ms"]
        .as_i64()
        .map_or(String::new(), |ms| format!(" (oldest {} ago)", fmt_ms(ms)));
    let unavailable = if v["unavailable"].as_bool() == Some(true) {
        "; UNAVAILABLE: the broker refuses the receipts subscription, rows retire on their PUBACK"
    } else {
        ""
    };
    format!(
        "{} rows delivered, not yet stored{oldest}; {} receipts received, {} ids matched no waiting row, {} malformed, {} rows sent again for a missing receipt, {} receipts dropped unread (queue full){unavailable}",
        n("awaiting"),
        n("received"),
        n("unmatched_ids"),
        n("malformed"),
        n("resent"),
        n("dropped"),
    )
}

/// The latency record (`{"puback": {...}, "commit": {...}}`, each with
/// `count`, `p50_seconds`, `p99_seconds`, `max_seconds`) as one line:
/// `PUBACK p50 12.0 ms, p99 40.0 ms, max 81.2 ms (n=1200); commit ...`.
/// The quantiles are estimates from the histogram's buckets.
fn latency_line(stored: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(stored) else {
        return stored.to_owned();
    };
    let ms = |x: &serde_json::Value| {
        x.as_f64()
            .map_or("-".to_owned(), |s| format!("{:.1} ms", s * 1000.0))
    };
    let part = |label: &str, h: &serde_json::Value| match h["count"].as_u64() {
        Some(n) if n > 0 => format!(
            "{label} p50 {}, p99 {}, max {} (n={n})",
            ms(&h["p50_seconds"]),
            ms(&h["p99_seconds"]),
            ms(&h["max_seconds"])
        ),
        _ => format!("{label} none yet"),
    };
    format!(
        "{}; {}",
        part("PUBACK", &v["puback"]),
        part("commit", &v["commit"])
    )
}

/// `r` as JSON for machines: health as `{"state", "reasons", "since_ms"}`,
/// counts as objects (`totals` by state, `rows` by stream then state,
/// `counters` by name), each `agent_state` entry as `{"value",
/// "updated_ms"}` with its value parsed when it is JSON; `outage_budget`
/// is that entry of `agent_state` again (null before an agent stored one;
/// fields in docs/operations.md, "Outage budget").
pub fn to_json(r: &Report) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let parse =
        |v: &str| serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::String(v.into()));
    let mut state = Map::new();
    let mut health = json!({"state": "unknown", "reasons": [], "since_ms": null});
    for (k, v, at) in &r.agent_state {
        let value = parse(v);
        if k == "health" {
            health = match &value {
                Value::Object(_) => value.clone(),
                // An older agent's line.
                Value::String(line) if line == "ok" => {
                    json!({"state": "ok", "reasons": [], "since_ms": at})
                }
                Value::String(line) => json!({"state": "degraded",
                    "reasons": [line.trim_start_matches("degraded: ")], "since_ms": at}),
                _ => health,
            };
        }
        state.insert(k.clone(), json!({"value": value, "updated_ms": at}));
    }
    let mut rows: Map<String, Value> = Map::new();
    for (stream, st, n) in &r.stats.by_stream_state {
        if let Value::Object(m) = rows.entry(stream.clone()).or_insert_with(|| json!({})) {
            m.insert(st.clone(), json!(n));
        }
    }
    let obj = |pairs: &[(String, i64)]| -> Map<String, Value> {
        pairs.iter().map(|(k, v)| (k.clone(), json!(v))).collect()
    };
    json!({
        "spool": r.spool,
        "running_pid": r.running_pid,
        "health": health,
        "totals": obj(&r.totals),
        "rows": rows,
        "oldest_unacked_age_ms": r.stats.oldest_unacked_age_ms,
        "streams": r.streams,
        "db_bytes": r.stats.db_bytes,
        "wal_bytes": r.stats.wal_bytes,
        "counters": obj(&r.stats.counters),
        "failed": r.failed,
        "outage_budget": state.get("outage_budget").cloned().unwrap_or(Value::Null),
        "agent_state": state,
        "commands": r.commands,
        "runs": r.runs,
    })
}

/// Human-readable form of `r`.
pub fn render(r: &Report, now_ms: i64) -> String {
    let mut o = String::new();
    o.push_str(&format!("spool: {}\n", r.spool));
    for (k, v, at) in &r.agent_state {
        if k == "outage_budget" {
            o.push_str(&outage::render(v, *at, now_ms));
            continue;
        }
        let v = match k.as_str() {
            "health" => health_line(v),
            "latency" => latency_line(v),
            "write_budget" => write_budget::line(v),
            "receipts" => receipts_line(v),
            k if k.starts_with("replay_position.") => replay_line(v),
            _ => v.clone(),
        };
        o.push_str(&format!("{k}: {v} ({} ago)\n", fmt_ms(now_ms - at)));
    }
    o.push_str(&format!(
        "size: db {} bytes, wal {} bytes\n",
        r.stats.db_bytes, r.stats.wal_bytes
    ));
    let t: Vec<String> = r.totals.iter().map(|(s, n)| format!("{s}={n}")).collect();
    o.push_str(&format!("rows: {}\n", t.join(" ")));
    match r.stats.oldest_unacked_age_ms {
        Some(a) => o.push_str(&format!("oldest unacknowledged: {} old\n", fmt_ms(a))),
        None => o.push_str("oldest unacknowledged: none\n"),
    }
    o.push_str("by stream:\n");
    for (stream, state, n) in &r.stats.by_stream_state {
        o.push_str(&format!("  {stream:<24} {state:<8} {n}\n"));
    }
    if !r.streams.is_empty() {
        o.push_str("backlog by stream (delivered highest priority first):\n");
        for b in &r.streams {
            let age = b
                .oldest_unacked_age_ms
                .map_or_else(|| "-".to_owned(), |a| format!("oldest {} old", fmt_ms(a)));
            o.push_str(&format!(
                "  {:<24} priority {:<3} backlog {:<8} {age}\n",
                b.stream, b.priority, b.rows
            ));
        }
    }
    if !r.stats.counters.is_empty() {
        o.push_str("counters:\n");
        for (k, v) in &r.stats.counters {
            o.push_str(&format!("  {k:<32} {v}\n"));
        }
    }
    if !r.failed.is_empty() {
        o.push_str("failed rows (newest first; the requeue-failed command sends them again):\n");
        for f in &r.failed {
            o.push_str(&format!(
                "  #{} {} {} ({} ago): {}\n",
                f.id,
                f.stream,
                f.event_id,
                fmt_ms(now_ms - f.failed_ms),
                f.reason
            ));
        }
    }
    let c = &r.commands;
    let by: Vec<String> = c.by_state.iter().map(|(s, n)| format!("{s}={n}")).collect();
    let counter = |name: &str| {
        r.stats
            .counters
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
            .unwrap_or(0)
    };
    o.push_str(&format!(
        "commands: {} | duplicates answered {} | conflicts {} | malformed {} | unanswered {} | mean duration {}\n",
        if by.is_empty() {
            "none".to_owned()
        } else {
            by.join(" ")
        },
        c.duplicates,
        counter("commands_conflicts"),
        counter("commands_malformed"),
        counter("commands_unanswered"),
        c.mean_duration_ms
            .map(|m| format!("{m:.0} ms"))
            .unwrap_or_else(|| "-".into())
    ));
    o.push_str("runs (newest first):\n");
    match &r.running_pid {
        Some(pid) => o.push_str(&format!("agent: running (pid {pid})\n")),
        None => o.push_str("agent: not running\n"),
    }
    for (i, run) in r.runs.iter().enumerate() {
        let end = match run.ended_ms {
            Some(e) => format!("ran {}", fmt_ms(e - run.started_ms)),
            None if run.exit_status.is_none() && i == 0 && r.running_pid.is_some() => {
                format!("running for {}", fmt_ms(now_ms - run.started_ms))
            }
            None if run.exit_status.is_none() => {
                "ended without a clean stop (killed or power cut)".into()
            }
            None => "end unknown".into(),
        };
        o.push_str(&format!(
            "  #{} pid {} v{} started {} ago, {}, status {}{}\n",
            run.id,
            run.pid,
            run.version,
            fmt_ms(now_ms - run.started_ms),
            end,
            run.exit_status.as_deref().unwrap_or("-"),
            run.error
                .as_deref()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latency_record_reads_as_p50_p99_and_max_in_ms() {
        let mut h = crate::metrics::Histogram::new();
        h.observe(std::time::Duration::from_millis(4));
        let rec = serde_json::json!({
            "puback": h.summary_json(),
            "commit": crate::metrics::Histogram::new().summary_json(),
        });
        let line = latency_line(&rec.to_string());
        assert!(line.starts_with("PUBACK p50 "), "{line}");
        assert!(line.contains("max 4.0 ms (n=1)"), "{line}");
        assert!(line.ends_with("commit none yet"), "{line}");
        assert_eq!(latency_line("not json"), "not json");
    }

    #[test]
    fn a_stored_replay_position_reads_as_trace_lap_and_line() {
        let stored = r#"{"trace_id":"fp:ab","fingerprint":"ab","lap":2,"line":41,"offset":900,"shift_ms":0,"pass":{"first":null,"prev":null,"max":null,"step":null}}"#;
        assert_eq!(replay_line(stored), "trace fp:ab, lap 2, line 41");
        assert_eq!(replay_line("junk"), "junk");
    }

    #[test]
    fn the_receipts_record_reads_as_one_line() {
        let rec = serde_json::json!({"awaiting": 7, "oldest_awaiting_ms": 65000, "received": 3,
            "unmatched_ids": 1, "malformed": 2, "resent": 4, "dropped": 5, "unavailable": false});
        let line = receipts_line(&rec.to_string());
        assert!(
            line.starts_with("7 rows delivered, not yet stored (oldest "),
            "{line}"
        );
        assert!(
            line.contains(
                "3 receipts received, 1 ids matched no waiting row, 2 malformed, 4 rows sent again"
            ),
            "{line}"
        );
        assert!(line.contains("5 receipts dropped unread"), "{line}");
        assert!(!line.contains("UNAVAILABLE"));
        let rec = serde_json::json!({"awaiting": 0, "unavailable": true});
        assert!(receipts_line(&rec.to_string()).contains("UNAVAILABLE"));
    }
}
