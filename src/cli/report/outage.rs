//! The `outage_budget` record ([`crate::flash::outage::Budget`] as JSON, stored
//! by the agent at each summary) as a short block for people:
//!
//! ```text
//! outage budget (5 min averages, 2 s ago): 1.2 readings/s (180 B/s) -> the spool holds 41 h 10 min before spool.max_bytes (1.0 GiB); backlog 12,000 rows drains in 3 min at 70 rows/s (measured now); flash 95 MB/day
//!   pump                     1.0 readings/s    150 B/s
//! ```
//!
//! Its one rule: **what was not measured says so** ("not measured yet"; a
//! delivery rate kept from before an outage says when it was measured).

use super::units::{ago, duration, rate, size, thousands, volume};
use serde_json::Value;

/// The hold part: `-> the spool holds 41 h 10 min before spool.max_bytes (1.0 GiB)`.
fn hold_part(b: &Value) -> String {
    let h = &b["hold"];
    if h.is_null() {
        return " -> hold time not measured yet".to_owned();
    }
    let what = match h["bound"].as_str() {
        Some("max_bytes") => "spool.max_bytes",
        _ => "the spool.min_free_bytes reserve",
    };
    let bound = size(h["bound_bytes"].as_u64().unwrap_or(0));
    match h["secs"].as_f64() {
        Some(s) if s <= 0.0 => {
            format!(" -> the spool REFUSES readings now: {what} ({bound}) is reached")
        }
        Some(s) => format!(
            " -> the spool holds {} before {what} ({bound})",
            duration(s)
        ),
        None => " -> the spool does not grow (nothing arrives)".to_owned(),
    }
}

/// The drain part: `backlog 12,000 rows drains in 3 min at 70 rows/s (measured 2 min ago)`.
fn drain_part(b: &Value, now_ms: i64) -> String {
    let backlog = b["spool"]["backlog_rows"].as_u64().unwrap_or(0);
    let d = &b["delivery"];
    let at = match (
        d["measured_at_ms"].as_i64(),
        b["delivery_current"].as_bool(),
    ) {
        (_, Some(true)) => "measured now".to_owned(),
        (Some(ms), _) => format!("last measured {}, while connected", ago(ms, now_ms)),
        (None, _) => String::new(),
    };
    match (b["drain_secs"].as_f64(), d["rows_per_sec"].as_f64()) {
        (_, _) if backlog == 0 => "backlog empty".to_owned(),
        (Some(s), Some(r)) => format!(
            "backlog {} rows drains in {} at {} rows/s ({at})",
            thousands(backlog),
            duration(s),
            rate(r)
        ),
        _ => format!(
            "backlog {} rows: drain time not measured yet (no delivery with rows waiting this run)",
            thousands(backlog)
        ),
    }
}

/// The block for the stored record `stored`, updated at `at_ms`, seen at
/// `now_ms`; a record that does not parse is shown as it is.
pub(super) fn render(stored: &str, at_ms: i64, now_ms: i64) -> String {
    let ago = ago(at_ms, now_ms);
    let Ok(b) = serde_json::from_str::<Value>(stored) else {
        return format!("outage_budget: {stored} ({ago})\n");
    };
    let window = duration(b["window_secs"].as_f64().unwrap_or(0.0));
    let head = format!("outage budget ({window} averages, {ago}):");
    let i = &b["ingest"];
    let Some(readings) = i["readings_per_sec"].as_f64() else {
        let drain = drain_part(&b, now_ms);
        return format!("{head} ingest rate not measured yet; {drain}\n");
    };
    let flash = b["flash_mb_per_day"]
        .as_f64()
        .map_or("not measured yet".to_owned(), |mb| {
            format!("{} MB/day", rate(mb))
        });
    let mut o = format!(
        "{head} {} readings/s ({}/s){}; {}; flash {flash}\n",
        rate(readings),
        volume(i["bytes_per_sec"].as_f64().unwrap_or(0.0)),
        hold_part(&b),
        drain_part(&b, now_ms),
    );
    if let Some(streams) = i["streams"].as_object() {
        for (name, r) in streams {
            o.push_str(&format!(
                "  {name:<24} {:>8} readings/s {:>10}/s\n",
                rate(r["readings_per_sec"].as_f64().unwrap_or(0.0)),
                volume(r["bytes_per_sec"].as_f64().unwrap_or(0.0)),
            ));
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flash::outage::{budget, DeliveryRate, Meter, Room, Sample};
    use std::collections::BTreeMap;

    #[test]
    fn no_readings_yet_says_not_measured_yet() {
        let b = budget(
            &Meter::new(300.0),
            Room {
                backlog_rows: 5,
                ..Room::default()
            },
        );
        let text = render(&serde_json::to_string(&b).unwrap(), 0, 2000);
        assert!(text.starts_with("outage budget (5 min averages, 2 s ago): ingest rate not measured yet; backlog 5 rows: drain time not measured yet"), "{text}");
        assert_eq!(render("junk", 0, 0), "outage_budget: junk (0 s ago)\n");
    }

    #[test]
    fn an_offline_budget_names_its_bound_and_when_delivery_was_measured() {
        let mut m = Meter::new(300.0);
        for (at, n, connected) in [(0.0, 0, true), (100.0, 120, true), (200.0, 240, false)] {
            m.record(Sample {
                at_secs: at,
                wall_ms: (at * 1000.0) as i64,
                streams: BTreeMap::from([("pump".to_owned(), (n, n * 150))]),
                retired: 7000 * (at as u64).min(100) / 100,
                connected,
                backlog: 1,
                ..Sample::default()
            });
        }
        assert_eq!(
            m.delivery(),
            Some(DeliveryRate {
                rows_per_sec: 70.0,
                span_secs: 100.0,
                measured_at_ms: 100_000
            })
        );
        let room = Room {
            used_bytes: 0,
            max_bytes: 1_000_000_000,
            free_bytes: u64::MAX / 2,
            reserve_bytes: 0,
            rows: 12_000,
            backlog_rows: 12_000,
        };
        let b = budget(
            &m,
            Room {
                used_bytes: 12_000 * 150,
                ..room
            },
        );
        let text = render(&serde_json::to_string(&b).unwrap(), 200_000, 202_000);
        let first = text.lines().next().unwrap();
        assert!(
            first.contains(" 1.2 readings/s (180 B/s) -> the spool holds "),
            "{first}"
        );
        assert!(first.contains(" before spool.max_bytes (953.7 MiB); backlog 12,000 rows drains in 2 min 51 s at 70 rows/s (last measured 1 min 42 s ago, while connected)"), "{first}");
        assert!(first.contains("; flash "), "{first}");
        assert!(
            text.lines()
                .nth(1)
                .unwrap()
                .trim_start()
                .starts_with("pump"),
            "{text}"
        );
    }
}
