//! What the agent recorded in the spool's `agent_state` table, as labelled
//! lines for people: one line per known key (the outage budget a short
//! block), measurements with their units, each with its age.
//!
//! Its one rule: **no raw JSON and no internal key reaches the text**: a
//! known key is rendered by its own function, a record that does not parse
//! is named as such, the agent's internal bookkeeping ([`INTERNAL`]) is left
//! to `status --json`, and a key this build does not know is shown only when
//! its value is a short plain word.

use super::units::{ago, duration, duration_ms, size, us_as_ms, volume};
use crate::event::age::{stamp_age, StampAge};
use serde_json::Value;

/// Keys the agent keeps for itself (the command records' clock, the
/// commands' time floor), in `--json` only.
const INTERNAL: &[&str] = &[
    crate::commands::retention::CLOCK_STATE_KEY,
    crate::commands::timefloor::ISSUED_STATE_KEY,
    crate::commands::timefloor::OFFSET_STATE_KEY,
];

/// The `agent_state` keys of replayed streams' positions:
/// `replay_position.<stream>` (written by the spool's `replay_key`).
const REPLAY_POSITION_PREFIX: &str = "replay_position.";

/// Keys rendered at the top of the report ([`health`], [`device`]) rather
/// than in [`recorded`]'s block.
const AT_THE_TOP: &[&str] = &["health", "device_id"];

/// The keys of [`recorded`]'s block, in the order shown; `replay_position.*`
/// and unknown keys follow.
const ORDER: &[&str] = &[
    "latency",
    "write_budget",
    "outage_budget",
    "last_checkpoint",
    "storage_profile",
    "receipts",
    "ingest_listeners",
    crate::push::policy::SERIAL_STATE_KEY,
];

/// The `health:` line: `ok`, `starting: no connection to the broker yet`,
/// `degraded: <reason>; <reason>` or the state the agent recorded, then how long it has held and the record's age; when
/// no agent runs, that the record is a past run's. `stored` is the record
/// (`{"state","reasons","since_ms"}`, or an older agent's line) stored at
/// `at_ms`; `None` before any agent recorded one.
pub(super) fn health(stored: Option<(&str, i64)>, now_ms: i64, running: bool) -> String {
    let Some((stored, at_ms)) = stored else {
        return "health: not recorded yet (no agent has run a maintenance pass on this spool)\n"
            .to_owned();
    };
    let (line, since) = match serde_json::from_str::<Value>(stored) {
        Ok(v) if v["state"].is_string() => {
            let state = v["state"].as_str().unwrap_or_default();
            let reasons: Vec<&str> = v["reasons"]
                .as_array()
                .map(|a| a.iter().filter_map(|r| r.as_str()).collect())
                .unwrap_or_default();
            let line = match (state, reasons.is_empty()) {
                // No CONNACK yet this run, and nothing wrong yet.
                ("starting", true) => "starting: no connection to the broker yet".to_owned(),
                (_, true) => state.to_owned(),
                (_, false) => format!("{state}: {}", reasons.join("; ")),
            };
            (line, v["since_ms"].as_i64())
        }
        // An agent before schema 5 stored the line itself.
        _ => (stored.to_owned(), None),
    };
    let held = since.map(|s| stamp_age(s, now_ms));
    let when = match (running, held) {
        (true, Some(StampAge::Age(ms))) => format!(
            "for {}; recorded {}",
            duration(ms as f64 / 1000.0),
            ago(at_ms, now_ms)
        ),
        (true, Some(StampAge::BeforeClockSet)) => format!(
            "since before the clock was set; recorded {}",
            ago(at_ms, now_ms)
        ),
        (true, _) => format!("recorded {}", ago(at_ms, now_ms)),
        (false, _) => format!(
            "recorded {} by a run that has ended: the agent is not running",
            ago(at_ms, now_ms)
        ),
    };
    format!("health: {line} ({when})\n")
}

/// The `device_id:` line: the id the spool's rows are published as and
/// where it came from (`board-7 (from @machine-id: /etc/machine-id)`).
pub(super) fn device(stored: Option<&str>) -> String {
    match stored {
        Some(d) => format!("device_id: {d}\n"),
        None => String::new(),
    }
}

/// The agent's records other than those at the top, one labelled line each
/// (the outage budget a block), in [`ORDER`], then the replay positions,
/// then keys this build does not know.
pub(super) fn recorded(state: &[(String, String, i64)], now_ms: i64) -> String {
    let get = |k: &str| state.iter().find(|(key, _, _)| key == k);
    let mut o = String::new();
    for key in ORDER {
        let Some((_, v, at)) = get(key) else {
            continue;
        };
        let age = ago(*at, now_ms);
        let line = match *key {
            "latency" => format!("latency (recorded {age}): {}", latency_line(v)),
            "write_budget" => format!("writes (recorded {age}): {}", super::write_budget::line(v)),
            "outage_budget" => {
                o.push_str(&super::outage::render(v, *at, now_ms));
                continue;
            }
            "last_checkpoint" => format!("last checkpoint: {}", checkpoint_line(v, *at, now_ms)),
            "storage_profile" => format!("storage: {}", storage_line(v, now_ms)),
            "receipts" => format!("receipts (recorded {age}): {}", receipts_line(v)),
            "ingest_listeners" => format!("ingest listeners: {}", listeners_line(v)),
            _ => format!(
                "signed config: {}",
                serials_line(
                    v,
                    *at,
                    now_ms,
                    get(crate::push::policy::KEPT_SERIAL_STATE_KEY)
                )
            ),
        };
        o.push_str(&line);
        o.push('\n');
    }
    if get(crate::push::policy::SERIAL_STATE_KEY).is_none() {
        if let Some((_, kept, _)) = get(crate::push::policy::KEPT_SERIAL_STATE_KEY) {
            o.push_str(&format!(
                "signed config: serial {kept} kept for the next start\n"
            ));
        }
    }
    for (k, v, at) in state {
        if let Some(stream) = k.strip_prefix(REPLAY_POSITION_PREFIX) {
            o.push_str(&format!(
                "replay of {stream}: {} ({})\n",
                replay_line(v),
                ago(*at, now_ms)
            ));
        }
    }
    o.push_str(&unknown(state));
    o
}

/// Keys this build does not know (a newer agent's): a short plain value
/// as `key: value`, anything else named for `--json`.
fn unknown(state: &[(String, String, i64)]) -> String {
    let known = |k: &str| {
        ORDER.contains(&k)
            || AT_THE_TOP.contains(&k)
            || INTERNAL.contains(&k)
            || k == crate::push::policy::KEPT_SERIAL_STATE_KEY
            || k.starts_with(REPLAY_POSITION_PREFIX)
    };
    let mut o = String::new();
    let mut hidden = Vec::new();
    for (k, v, _) in state.iter().filter(|(k, _, _)| !known(k)) {
        let plain = v.len() <= 80 && !v.starts_with(['{', '[']) && !v.contains('\n');
        match plain {
            true => o.push_str(&format!("{k}: {v}\n")),
            false => hidden.push(k.as_str()),
        }
    }
    if !hidden.is_empty() {
        o.push_str(&format!(
            "also recorded (see --json): {}\n",
            hidden.join(", ")
        ));
    }
    o
}

/// The storage profile the agent measured (or reused) at its start, as one
/// line of measurements and the knobs derived from them (what the config
/// sets itself wins over them).
fn storage_line(stored: &str, now_ms: i64) -> String {
    let Ok(p) = serde_json::from_str::<crate::flash::probe::Profile>(stored) else {
        return "the stored profile does not parse (see --json)".to_owned();
    };
    let (m, d) = (&p.measurements, &p.derived);
    format!(
        "measured {}: fsync p50 {}, p99 {}, max {} ({} samples), sequential writes {}/s, {} free; derived: commit window {}, checkpoint at {} of WAL, storage retries after {} up to {}, spool bound at most {} (half the free space; the smaller of it and spool.max_bytes is in force)",
        ago(p.measured_at_ms, now_ms),
        us_as_ms(m.fsync_p50_us),
        us_as_ms(m.fsync_p99_us),
        us_as_ms(m.fsync_max_us),
        m.samples,
        volume(m.write_bytes_per_sec as f64),
        size(m.fs_free_bytes),
        duration_ms(d.commit_window_ms as i64),
        size(d.checkpoint_wal_bytes),
        duration_ms(d.retry_min_ms as i64),
        duration_ms(d.retry_max_ms as i64),
        size(d.max_spool_bytes),
    )
}

/// The last checkpoint's record (`mode`, `busy`, `log_frames`,
/// `checkpointed_frames`, `wal_file_bytes_before`, `duration_ms`, `at_ms`)
/// as `passive 12 s ago: 120 of 120 WAL frames copied in 3 ms (WAL file
/// 480.0 KiB before)`.
fn checkpoint_line(stored: &str, at_ms: i64, now_ms: i64) -> String {
    let Ok(v) = serde_json::from_str::<Value>(stored) else {
        return format!(
            "the record does not parse (see --json; {})",
            ago(at_ms, now_ms)
        );
    };
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let (log, copied) = (n("log_frames"), n("checkpointed_frames"));
    let mut line = format!(
        "{} {}: {copied} of {log} WAL frames copied in {} (WAL file {} before)",
        v["mode"].as_str().unwrap_or("?"),
        ago(v["at_ms"].as_i64().unwrap_or(at_ms), now_ms),
        duration_ms(n("duration_ms") as i64),
        size(n("wal_file_bytes_before")),
    );
    if n("busy") != 0 {
        line.push_str("; busy: a reader or writer held part of the WAL");
    }
    if copied < log {
        line.push_str(&format!("; {} frames left for the next", log - copied));
    }
    line
}

/// What the ingest socket listens on (`unix PATH (mode 660), tcp
/// ADDR`), or `none` (`off`).
fn listeners_line(stored: &str) -> String {
    match stored {
        "off" | "" => "none".to_owned(),
        s => s.to_owned(),
    }
}

/// The newest signed config's serial and the one kept for the next start.
fn serials_line(
    serial: &str,
    at_ms: i64,
    now_ms: i64,
    kept: Option<&(String, String, i64)>,
) -> String {
    let mut line = format!(
        "newest serial accepted {serial} ({}; a signed config must carry a higher one)",
        ago(at_ms, now_ms)
    );
    if let Some((_, k, _)) = kept {
        line.push_str(&format!(", serial {k} kept for the next start"));
    }
    line
}

/// A stored replay position as `trace T, lap L, line N` (the stored text
/// itself if it does not parse).
pub(super) fn replay_line(stored: &str) -> String {
    match serde_json::from_str::<crate::event::reading::ReplayPosition>(stored) {
        Ok(p) => format!("trace {}, lap {}, line {}", p.trace_id, p.lap, p.line),
        Err(_) => stored.to_owned(),
    }
}

/// The receipts record (receipt mode) as one line: rows delivered to the
/// broker and not yet stored at the fleet, the oldest one's wait, and what
/// receipts did.
pub(super) fn receipts_line(stored: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(stored) else {
        return stored.to_owned();
    };
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let oldest = v["oldest_awaiting_ms"]
        .as_i64()
        .map_or(String::new(), |ms| {
            format!(" (oldest waiting {})", duration_ms(ms))
        });
    let unavailable = if v["unavailable"].as_bool() == Some(true) {
        "; UNAVAILABLE: the broker refuses the receipts subscription, rows retire on their PUBACK"
    } else {
        ""
    };
    format!(
        "{} rows delivered, not yet stored{oldest}; {} receipts received, {} ids matched no waiting row (already retired: a repeat, or a row sent again for the fleet's backfill), {} malformed, {} rows sent again for a missing receipt, {} receipts dropped unread (queue full){unavailable}",
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
pub(super) fn latency_line(stored: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(stored) else {
        return stored.to_owned();
    };
    let ms = |x: &Value| {
        x.as_f64()
            .map_or("-".to_owned(), |s| format!("{:.1} ms", s * 1000.0))
    };
    let part = |label: &str, h: &Value| match h["count"].as_u64() {
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
    fn a_measurement_record_says_when_it_was_recorded_before_its_figures() {
        let state = vec![(
            "write_budget".to_owned(),
            r#"{"commit_window_ms":300000,"commit_window_why":"held"}"#.to_owned(),
            1_000,
        )];
        let text = recorded(&state, 56_000);
        assert!(text.starts_with("writes (recorded 55 s ago): "), "{text}");
        assert!(text.trim_end().ends_with(": held"), "{text}");
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
            line.starts_with("7 rows delivered, not yet stored (oldest waiting "),
            "{line}"
        );
        assert!(
            line.contains(
                "3 receipts received, 1 ids matched no waiting row (already retired: a repeat, or a row sent again for the fleet's backfill), 2 malformed, 4 rows sent again"
            ),
            "{line}"
        );
        assert!(line.contains("5 receipts dropped unread"), "{line}");
        assert!(!line.contains("UNAVAILABLE"));
        let rec = serde_json::json!({"awaiting": 0, "unavailable": true});
        assert!(receipts_line(&rec.to_string()).contains("UNAVAILABLE"));
    }
}
