//! The `write_budget` record (stored by the agent at each summary; its
//! fields are in docs/flash.md, "Write budget") as one line for people:
//!
//! ```text
//! 12.3 MB written in 1 h 2 min (11.9 MB/h, 285.6 MB/day projected), 410 B per reading over 30,000 readings; 3,600 commits/h, 12 checkpoints/h, about 24 fsyncs/h; WAL file 4.0 MiB
//! ```
//!
//! A record that does not parse is shown as it is.

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
    // The window the agent chose (written by builds with the write budget);
    // a record from an older build has none.
    let window = match v["commit_window_ms"].as_u64() {
        None => String::new(),
        Some(w) => {
            let budget = match v["budget_mb_per_day"].as_u64() {
                Some(b) => format!(", budget {b} MB/day"),
                None => String::new(),
            };
            format!(
                "; commit window {w} ms (widest so far {} ms), checkpoints every {} s{budget}",
                n("commit_window_max_ms"),
                n("checkpoint_interval_secs")
            )
        }
    };
    format!(
        "{} written in {} ({}/h, {:.1} MB/day projected), {per_reading}; {} commits/h, {} checkpoints/h, about {} fsyncs/h; WAL file {}{window}",
        volume(n("write_bytes_total") as f64),
        duration(n("window_secs") as f64),
        volume(n("write_bytes_per_hour") as f64),
        v["projected_mb_per_day"].as_f64().unwrap_or(0.0),
        thousands(n("commits_per_hour")),
        thousands(n("checkpoints_per_hour")),
        thousands(n("fsyncs_estimated_per_hour")),
        size(n("wal_file_bytes")),
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
            "projected_mb_per_day": 285.6, "wal_file_bytes": 4_200_000});
        assert_eq!(
            line(&rec.to_string()),
            "12.3 MB written in 1 h 2 min (11.9 MB/h, 285.6 MB/day projected), 410 B per reading over 30,000 readings; 3,600 commits/h, 12 checkpoints/h, about 24 fsyncs/h; WAL file 4.0 MiB"
        );
        // With the window a write budget chose.
        let mut chosen = rec.clone();
        chosen["commit_window_ms"] = 10_000.into();
        chosen["commit_window_max_ms"] = 10_000.into();
        chosen["checkpoint_interval_secs"] = 120.into();
        chosen["budget_mb_per_day"] = 100.into();
        assert!(
            line(&chosen.to_string()).ends_with(
                "WAL file 4.0 MiB; commit window 10000 ms (widest so far 10000 ms), checkpoints every 120 s, budget 100 MB/day"
            ),
            "{}",
            line(&chosen.to_string())
        );
        let none = serde_json::json!({"readings_total": 0});
        assert!(line(&none.to_string()).contains("no readings yet"));
        assert_eq!(line("junk"), "junk");
    }
}
