//! The `write_budget` record (stored by the agent with its agent state;
//! its fields are in docs/flash.md, "Write budget") as one line for people:
//!
//! ```text
//! 12.3 MB written in 1 h 2 min (11.9 MB/h), 410 B per reading over 30,000 readings; 3,600 commits/h, 12 checkpoints/h, about 24 fsyncs/h; WAL file 4.0 MiB; projected 85.2 MB/day (measured over 58 min at a 150000 ms window), budget 100 MB/day; commit window 150000 ms (widest so far 150000 ms, at most 300000 ms), checkpoints every 300 s: held: ...
//! ```
//!
//! The projection is the agent's one figure (health, the outage budget and
//! the metrics show the same). A record that does not parse is shown as it
//! is; one from an older build shows what it has.

use super::units::{duration, size, thousands, volume};
use serde_json::Value;

/// The line for the stored record `stored`.
pub(super) fn line(stored: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(stored) else {
        return stored.to_owned();
    };
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let readings = n("readings_total");
    let per_reading = if readings == 0 {
        "no readings yet".to_owned()
    } else {
        format!(
            "{} per reading over {} readings",
            volume(n("bytes_per_reading") as f64),
            thousands(readings)
        )
    };
    let head = format!(
        "{} written in {} ({}/h{}), {per_reading}; {} commits/h, {} checkpoints/h, about {} fsyncs/h; WAL file {}",
        volume(n("write_bytes_total") as f64),
        duration(n("window_secs") as f64),
        volume(n("write_bytes_per_hour") as f64),
        older_projection(&v),
        thousands(n("commits_per_hour")),
        thousands(n("checkpoints_per_hour")),
        thousands(n("fsyncs_estimated_per_hour")),
        size(n("wal_file_bytes")),
    );
    format!("{head}{}{}", projection(&v), window(&v))
}

/// A record written before the one projection (no `projected_at_window_ms`)
/// projected the run's average: shown where it was.
fn older_projection(v: &Value) -> String {
    match (
        v["projected_at_window_ms"].is_null(),
        v["projected_mb_per_day"].as_f64(),
    ) {
        (true, Some(p)) if v.get("commit_window_why").is_none() => {
            format!(", {p:.1} MB/day projected")
        }
        _ => String::new(),
    }
}

/// `; projected P MB/day (measured over T at a W ms window), budget B MB/day`.
fn projection(v: &Value) -> String {
    if v.get("commit_window_why").is_none() {
        return String::new();
    }
    let budget = match v["budget_mb_per_day"].as_u64() {
        Some(b) if v["over_budget"].as_bool() == Some(true) => {
            format!(", over the budget of {b} MB/day")
        }
        Some(b) => format!(", budget {b} MB/day"),
        None => ", no budget".to_owned(),
    };
    match (
        v["projected_mb_per_day"].as_f64(),
        v["projected_at_window_ms"].as_u64(),
    ) {
        (Some(p), Some(w)) => format!(
            "; projected {p:.1} MB/day (measured over {} at a {w} ms window){budget}",
            duration(v["projected_over_secs"].as_u64().unwrap_or(0) as f64)
        ),
        _ => format!("; projected MB/day not measured yet{budget}"),
    }
}

/// `; commit window W ms (widest so far M ms, at most C ms), checkpoints
/// every S s: why` (a record of a build without the write budget has none).
fn window(v: &Value) -> String {
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let Some(w) = v["commit_window_ms"].as_u64() else {
        return String::new();
    };
    let Some(why) = v["commit_window_why"].as_str() else {
        // A build before the one projection.
        let budget = match v["budget_mb_per_day"].as_u64() {
            Some(b) => format!(", budget {b} MB/day"),
            None => String::new(),
        };
        return format!(
            "; commit window {w} ms (widest so far {} ms), checkpoints every {} s{budget}",
            n("commit_window_max_ms"),
            n("checkpoint_interval_secs")
        );
    };
    format!(
        "; commit window {w} ms (widest so far {} ms, at most {} ms), checkpoints every {} s: {why}",
        n("commit_window_max_ms"),
        n("commit_window_ceiling_ms"),
        n("checkpoint_interval_secs")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_write_budget_reads_as_one_line() {
        let rec = serde_json::json!({"window_secs": 3720, "write_bytes_total": 12_300_000u64,
            "write_bytes_per_hour": 11_900_000u64, "commits_total": 3720, "commits_per_hour": 3600,
            "checkpoints_total": 12, "checkpoints_per_hour": 12, "fsyncs_estimated_total": 24,
            "fsyncs_estimated_per_hour": 24, "readings_total": 30_000, "bytes_per_reading": 410,
            "projected_mb_per_day": 85.24, "projected_at_window_ms": 150_000,
            "projected_over_secs": 3480, "commit_window_ms": 150_000,
            "commit_window_max_ms": 150_000, "commit_window_ceiling_ms": 300_000,
            "commit_window_why": "held: projected 85 MB/day is 85 % of the budget",
            "checkpoint_interval_secs": 300, "budget_mb_per_day": 100, "over_budget": false,
            "wal_file_bytes": 4_200_000});
        assert_eq!(
            line(&rec.to_string()),
            "12.3 MB written in 1 h 2 min (11.9 MB/h), 410 B per reading over 30,000 readings; 3,600 commits/h, 12 checkpoints/h, about 24 fsyncs/h; WAL file 4.0 MiB; projected 85.2 MB/day (measured over 58 min at a 150000 ms window), budget 100 MB/day; commit window 150000 ms (widest so far 150000 ms, at most 300000 ms), checkpoints every 300 s: held: projected 85 MB/day is 85 % of the budget"
        );
        let mut over = rec.clone();
        over["over_budget"] = true.into();
        assert!(line(&over.to_string()).contains("over the budget of 100 MB/day"));
        let mut early = rec.clone();
        early["projected_mb_per_day"] = Value::Null;
        early["projected_at_window_ms"] = Value::Null;
        early["budget_mb_per_day"] = Value::Null;
        assert!(
            line(&early.to_string()).contains("; projected MB/day not measured yet, no budget;"),
            "{}",
            line(&early.to_string())
        );
        let none = serde_json::json!({"readings_total": 0});
        assert!(line(&none.to_string()).contains("no readings yet"));
        assert_eq!(line("junk"), "junk");
    }

    #[test]
    fn a_record_of_an_older_build_shows_what_it_has() {
        let rec = serde_json::json!({"window_secs": 3720, "write_bytes_total": 12_300_000u64,
            "write_bytes_per_hour": 11_900_000u64, "commits_per_hour": 3600,
            "checkpoints_per_hour": 12, "fsyncs_estimated_per_hour": 24, "readings_total": 30_000,
            "bytes_per_reading": 410, "projected_mb_per_day": 285.6, "wal_file_bytes": 4_200_000,
            "commit_window_ms": 10_000, "commit_window_max_ms": 10_000,
            "checkpoint_interval_secs": 120, "budget_mb_per_day": 100});
        assert_eq!(
            line(&rec.to_string()),
            "12.3 MB written in 1 h 2 min (11.9 MB/h, 285.6 MB/day projected), 410 B per reading over 30,000 readings; 3,600 commits/h, 12 checkpoints/h, about 24 fsyncs/h; WAL file 4.0 MiB; commit window 10000 ms (widest so far 10000 ms), checkpoints every 120 s, budget 100 MB/day"
        );
    }
}
