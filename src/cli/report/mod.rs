//! `edgespool status`: what the spool holds, read from the spool file itself.
//!
//! Its one rule: **status never writes and never holds a read transaction
//! longer than one query**, so it is safe beside a running agent (F01).

mod outage;
mod state;
mod units;
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
    /// Whether a process (a running agent) holds the spool's lock now.
    pub running: bool,
    /// That process's pid, from the lock file: `None` when none runs, or
    /// while a starting agent has yet to write it.
    pub running_pid: Option<u32>,
    /// Backlog, oldest unacknowledged age and priority per stream (empty
    /// for a spool older than schema 8).
    pub streams: Vec<crate::spool::priority::StreamBacklog>,
    /// What the agent last recorded: `health`, `last_checkpoint`,
    /// `write_budget`, ... as (key, value, updated Unix ms).
    pub agent_state: Vec<(String, String, i64)>,
    /// The streams holding a waiting row appended before the wall clock
    /// was set, and when the spool saw it set (Unix ms): such a row's age
    /// counts from then (`clock_spans`, empty before schema 13).
    pub clock_set: Vec<(String, i64)>,
    /// The wall clock the report was read at, Unix ms: the ages above
    /// count to it.
    pub now_ms: i64,
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
    let holder = crate::os::fsguard::holder(path);
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
        running: holder.is_some(),
        running_pid: holder.and_then(|pid| pid.parse().ok()),
        streams: if version >= 8 {
            spool.backlog_by_stream(now_ms).map_err(|e| e.to_string())?
        } else {
            Vec::new()
        },
        clock_set: if version >= 13 {
            spool.clock_set_for_waiting().map_err(|e| e.to_string())?
        } else {
            Vec::new()
        },
        now_ms,
    })
}

/// `agent_state` keys whose values are text, never parsed as JSON (a
/// device id `123 (from the config)` is not a number).
const TEXT_STATE: &[&str] = &["device_id", "ingest_listeners"];

/// `r` as JSON for machines, every value typed (numbers as numbers, never
/// as text): `running` (bool) and `running_pid` (number, or null when no
/// agent runs or its pid is not written yet), health as `{"state",
/// "reasons", "since_ms"}`, counts as objects (`totals` by state, `rows` by
/// stream then state, `counters` by name, `commands.by_state`), each
/// `agent_state` entry as `{"value", "updated_ms"}` with its value parsed
/// when it is JSON (the text records [`TEXT_STATE`] stay strings);
/// `outage_budget` is that entry of `agent_state` again (null before an
/// agent stored one; fields in docs/operations.md, "Outage budget").
///
/// `oldest_unacked_age_ms` (top level and per stream) stays the number it
/// always was (now less the time it counts from, at least 0, null when
/// nothing waits); beside it `oldest_unacked_ms` is that time (Unix ms),
/// `oldest_unacked_age_known` whether the number is an age
/// ([`crate::event::age::stamp_age`]): false when that time was read
/// before the board's clock was set (a board without an RTC, in 1970: the
/// number is then decades), lies more than a few seconds ahead of the
/// clock now, or the clock now is not set while it was; and
/// `oldest_unacked_from_clock_set` whether that row was appended before
/// the clock was set and counts from when the spool saw it set (the age is
/// the wait since then); both null when nothing waits. docs/operations.md
/// says the same.
pub fn to_json(r: &Report) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let parse = |k: &str, v: &str| match TEXT_STATE.contains(&k) {
        true => Value::String(v.into()),
        false => serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::String(v.into())),
    };
    let mut state = Map::new();
    let mut health = json!({"state": "unknown", "reasons": [], "since_ms": null});
    for (k, v, at) in &r.agent_state {
        let value = parse(k, v);
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
    let set = r.clock_set.iter().map(|(_, ms)| *ms).min();
    let streams: Vec<Value> = r
        .streams
        .iter()
        .map(|b| {
            let mut v = json!(b);
            let set = r.clock_set.iter().find(|(s, _)| *s == b.stream);
            if let Value::Object(m) = &mut v {
                m.extend(oldest_json(b.oldest_unacked_ms, set.map(|s| s.1), r.now_ms));
            }
            v
        })
        .collect();
    let mut oldest = Map::new();
    oldest.insert(
        "oldest_unacked_age_ms".into(),
        json!(r.stats.oldest_unacked_age_ms),
    );
    oldest.insert("oldest_unacked_ms".into(), json!(r.stats.oldest_unacked_ms));
    oldest.extend(oldest_json(r.stats.oldest_unacked_ms, set, r.now_ms));
    let mut v = json!({
        "spool": r.spool,
        "running": r.running,
        "running_pid": r.running_pid,
        "health": health,
        "totals": obj(&r.totals),
        "rows": rows,
        "streams": streams,
        "db_bytes": r.stats.db_bytes,
        "wal_bytes": r.stats.wal_bytes,
        "counters": obj(&r.stats.counters),
        "failed": r.failed,
        "outage_budget": state.get("outage_budget").cloned().unwrap_or(Value::Null),
        "agent_state": state,
        "commands": {
            "by_state": obj(&r.commands.by_state),
            "duplicates": r.commands.duplicates,
            "mean_duration_ms": r.commands.mean_duration_ms,
        },
        "runs": r.runs,
    });
    if let Value::Object(m) = &mut v {
        m.extend(oldest);
    }
    v
}

/// The flags beside an `oldest_unacked_age_ms` whose age counts from
/// `at_ms` (null when nothing waits), seen at `now_ms`, `set_ms` when the
/// spool saw the clock set for that stream's rows appended before it:
/// `oldest_unacked_age_known` (the clock can tell it:
/// [`crate::event::age::stamp_age`]) and `oldest_unacked_from_clock_set`
/// (the row was appended before the clock was set and counts from then).
fn oldest_json(
    at_ms: Option<i64>,
    set_ms: Option<i64>,
    now_ms: i64,
) -> serde_json::Map<String, serde_json::Value> {
    let known = at_ms.map(|at| crate::event::age::stamp_age(at, now_ms).ms().is_some());
    let from_set = at_ms.map(|at| set_ms == Some(at));
    let mut m = serde_json::Map::new();
    m.insert("oldest_unacked_age_known".into(), known.into());
    m.insert("oldest_unacked_from_clock_set".into(), from_set.into());
    m
}

/// Human-readable form of `r`, seen at `now_ms`: the spool, whether an
/// agent runs and its health at the top; then what the agent recorded, one
/// labelled line each ([`state`]); rows, sizes and streams; counters, FAILED
/// rows, commands and the last runs. Every figure has its unit.
pub fn render(r: &Report, now_ms: i64) -> String {
    let get = |k: &str| {
        r.agent_state
            .iter()
            .find(|(key, _, _)| key == k)
            .map(|(_, v, at)| (v.as_str(), *at))
    };
    let mut o = format!("spool: {}\n", r.spool);
    o.push_str(&agent_line(r, now_ms));
    o.push_str(&state::health(get("health"), now_ms, r.running));
    o.push_str(&state::device(get("device_id").map(|(v, _)| v)));
    let recorded = state::recorded(&r.agent_state, now_ms);
    if !recorded.is_empty() {
        o.push('\n');
        o.push_str(&recorded);
    }
    o.push('\n');
    o.push_str(&rows_block(r, now_ms));
    o.push_str(&counters_block(r));
    o.push_str(&failed_block(r, now_ms));
    o.push_str(&commands_line(r));
    o.push('\n');
    o.push_str(&runs_block(r, now_ms));
    o
}

/// `agent: running (pid 4242), up 2 h 10 min`, or not running and how the
/// last run ended.
fn agent_line(r: &Report, now_ms: i64) -> String {
    let pid = r
        .running_pid
        .map_or("unknown".to_owned(), |p| p.to_string());
    match (r.running, r.runs.first()) {
        (true, Some(run)) if run.ended_ms.is_none() && run.exit_status.is_none() => format!(
            "agent: running (pid {pid}), {} (run #{}, v{})\n",
            units::lasted(run.started_ms, now_ms).map_or_else(
                || format!("started {}", units::ago(run.started_ms, now_ms)),
                |up| format!("up {up}")
            ),
            run.id,
            run.version
        ),
        (true, _) => format!("agent: running (pid {pid})\n"),
        (false, None) => "agent: not running (no run recorded)\n".to_owned(),
        (false, Some(run)) => format!(
            "agent: not running; last run #{} {}\n",
            run.id,
            match (run.ended_ms, run.exit_status.as_deref()) {
                (Some(e), Some(st)) => format!("ended {} (status {st})", units::ago(e, now_ms)),
                _ => format!(
                    "started {} and ended without a clean stop",
                    units::ago(run.started_ms, now_ms)
                ),
            }
        ),
    }
}

/// Rows by state, the oldest waiting row, the file sizes, and each stream,
/// seen at `now_ms`.
fn rows_block(r: &Report, now_ms: i64) -> String {
    let total = |st: &str| {
        r.totals
            .iter()
            .find(|(s, _)| s == st)
            .map_or(0, |(_, n)| *n)
    };
    let (pending, sent) = (total("PENDING"), total("SENT"));
    let set = r.clock_set.iter().map(|(_, ms)| *ms).min();
    let oldest = r.stats.oldest_unacked_ms.map_or(String::new(), |at| {
        format!(
            "; the oldest waiting was appended {}",
            appended(at, set, now_ms)
        )
    });
    let mut o = format!(
        "rows: {} waiting ({} PENDING, {} SENT), {} ACKED, {} FAILED{oldest}\n",
        units::count(pending + sent),
        units::count(pending),
        units::count(sent),
        units::count(total("ACKED")),
        units::count(total("FAILED")),
    );
    o.push_str(&format!(
        "size: database {}, WAL {}\n",
        units::size(r.stats.db_bytes),
        units::size(r.stats.wal_bytes)
    ));
    o.push_str(&streams_block(r, now_ms));
    o
}

/// When the oldest waiting row counted from `at_ms` was appended, seen at
/// `now_ms`: as [`units::ago`] says it, with [`units::duration_ms`]'s
/// precision below ten seconds (`1.5 s ago`); `before the clock was set
/// (set 5 s ago)` when `at_ms` is `set_ms`, the time the spool saw the
/// clock set for rows appended before it (their age is not their own).
fn appended(at_ms: i64, set_ms: Option<i64>, now_ms: i64) -> String {
    if set_ms == Some(at_ms) {
        return format!(
            "before the clock was set (set {})",
            units::ago(at_ms, now_ms)
        );
    }
    match crate::event::age::stamp_age(at_ms, now_ms) {
        crate::event::age::StampAge::Age(ms) => format!("{} ago", units::duration_ms(ms)),
        _ => units::ago(at_ms, now_ms),
    }
}

/// One line per stream: its priority and waiting rows (when the spool
/// records them) and how long ago its oldest was appended, seen at
/// `now_ms`; its rows by state.
fn streams_block(r: &Report, now_ms: i64) -> String {
    let by_state = |stream: &str| {
        let parts: Vec<String> = r
            .stats
            .by_stream_state
            .iter()
            .filter(|(s, _, n)| s == stream && *n > 0)
            .map(|(_, st, n)| format!("{} {st}", units::count(*n)))
            .collect();
        if parts.is_empty() {
            "no rows".to_owned()
        } else {
            parts.join(", ")
        }
    };
    let mut o = String::new();
    if r.streams.is_empty() {
        // A spool older than schema 8: no priorities, states only.
        let mut names: Vec<&str> = r
            .stats
            .by_stream_state
            .iter()
            .map(|(s, _, _)| s.as_str())
            .collect();
        names.dedup();
        if !names.is_empty() {
            o.push_str("streams:\n");
        }
        for name in names {
            o.push_str(&format!("  {name:<24} {}\n", by_state(name)));
        }
        return o;
    }
    o.push_str("streams (delivered highest priority first):\n");
    for b in &r.streams {
        let set = r
            .clock_set
            .iter()
            .find(|(s, _)| *s == b.stream)
            .map(|(_, ms)| *ms);
        let oldest = b.oldest_unacked_ms.map_or(String::new(), |at| {
            match units::lasted(at, now_ms).filter(|_| set != Some(at)) {
                Some(d) => format!(", oldest {d}"),
                None => format!(", oldest appended {}", appended(at, set, now_ms)),
            }
        });
        o.push_str(&format!(
            "  {:<24} priority {:<3} {} waiting{oldest}; {}\n",
            b.stream,
            b.priority,
            units::thousands(b.rows),
            by_state(&b.stream)
        ));
    }
    o
}

/// The spool's counters (kept across restarts), one a line.
fn counters_block(r: &Report) -> String {
    if r.stats.counters.is_empty() {
        return String::new();
    }
    let mut o = "counters (kept across restarts):\n".to_owned();
    for (k, v) in &r.stats.counters {
        o.push_str(&format!("  {k:<32} {}\n", units::count(*v)));
    }
    o
}

/// The newest FAILED rows and why.
fn failed_block(r: &Report, now_ms: i64) -> String {
    if r.failed.is_empty() {
        return String::new();
    }
    let mut o =
        "failed rows (newest first; the requeue-failed command sends them again):\n".to_owned();
    for f in &r.failed {
        o.push_str(&format!(
            "  #{} {} {} ({}): {}\n",
            f.id,
            f.stream,
            f.event_id,
            units::ago(f.failed_ms, now_ms),
            f.reason
        ));
    }
    o
}

/// Command records by state and what the command thread counted.
fn commands_line(r: &Report) -> String {
    let c = &r.commands;
    let by: Vec<String> = c
        .by_state
        .iter()
        .map(|(s, n)| format!("{} {s}", units::count(*n)))
        .collect();
    let counter = |name: &str| {
        r.stats
            .counters
            .iter()
            .find(|(k, _)| k == name)
            .map_or(0, |(_, v)| *v)
    };
    format!(
        "commands: {}; {} duplicates answered, {} conflicts, {} malformed, {} unanswered; mean duration {}\n",
        if by.is_empty() { "none recorded".to_owned() } else { by.join(", ") },
        units::count(c.duplicates),
        units::count(counter("commands_conflicts")),
        units::count(counter("commands_malformed")),
        units::count(counter("commands_unanswered")),
        c.mean_duration_ms
            .map_or_else(|| "-".into(), |m| units::duration_ms(m.round() as i64))
    )
}

/// The last runs, newest first: when each started, how long it ran or runs,
/// how it ended.
fn runs_block(r: &Report, now_ms: i64) -> String {
    let mut o = "runs (newest first):\n".to_owned();
    for (i, run) in r.runs.iter().enumerate() {
        let end = match run.ended_ms {
            Some(e) => match units::lasted(run.started_ms, e) {
                Some(d) => format!("ran {d}"),
                // Started before the clock was set and ended after.
                None => format!("ended {}", units::ago(e, now_ms)),
            },
            None if run.exit_status.is_none() && i == 0 && r.running => {
                match units::lasted(run.started_ms, now_ms) {
                    Some(d) => format!("running for {d}"),
                    None => "running".to_owned(),
                }
            }
            None if run.exit_status.is_none() => {
                "ended without a clean stop (killed or power cut)".into()
            }
            None => "end unknown".into(),
        };
        let status = match (&run.exit_status, &run.error) {
            (Some(st), Some(e)) => format!(", status {st}: {e}"),
            (Some(st), None) => format!(", status {st}"),
            (None, _) => String::new(),
        };
        o.push_str(&format!(
            "  #{} pid {} v{}, started {}, {end}{status}\n",
            run.id,
            run.pid,
            run.version,
            units::ago(run.started_ms, now_ms),
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spool::priority::StreamBacklog;

    /// Past the clock floor: a set clock.
    const NOW: i64 = 1_790_000_000_000;

    /// A running agent's spool as `report` would read it, with every
    /// record an agent of this build stores.
    fn running() -> Report {
        let state = |k: &str, v: serde_json::Value, ago_ms: i64| match v {
            serde_json::Value::String(s) => (k.to_owned(), s, NOW - ago_ms),
            v => (k.to_owned(), v.to_string(), NOW - ago_ms),
        };
        let profile = crate::flash::probe::Profile {
            device: 65024,
            fs_type: 61267,
            measured_at_ms: NOW - 7_800_000,
            measurements: crate::flash::probe::Measurements {
                fsync_p50_us: 3258,
                fsync_p99_us: 10985,
                fsync_max_us: 10985,
                write_bytes_per_sec: 221_801_472,
                fs_free_bytes: 54_889_639_936,
                samples: 32,
            },
            derived: crate::flash::probe::Derived {
                commit_window_ms: 110,
                checkpoint_wal_bytes: 4 << 20,
                retry_min_ms: 22,
                retry_max_ms: 1100,
                max_spool_bytes: 27_444_819_968,
            },
        };
        Report {
            spool: "/var/lib/edgespool/spool.db".into(),
            stats: Stats {
                by_stream_state: vec![
                    ("pump".into(), "ACKED".into(), 12_000),
                    ("pump".into(), "PENDING".into(), 20),
                ],
                oldest_unacked_age_ms: Some(185_000),
                oldest_unacked_ms: Some(NOW - 185_000),
                wal_bytes: 4 << 20,
                db_bytes: 106_496,
                counters: vec![("commands_duplicates".into(), 3)],
            },
            totals: vec![
                ("PENDING".into(), 20),
                ("SENT".into(), 0),
                ("ACKED".into(), 12_000),
                ("FAILED".into(), 0),
            ],
            runs: vec![RunRecord {
                id: 4,
                started_ms: NOW - 7_800_000,
                ended_ms: None,
                pid: 4242,
                version: "0.1.0".into(),
                exit_status: None,
                error: None,
            }],
            commands: Default::default(),
            failed: Vec::new(),
            running: true,
            running_pid: Some(4242),
            streams: vec![StreamBacklog {
                stream: "pump".into(),
                priority: 0,
                rows: 20,
                oldest_unacked_age_ms: Some(185_000),
                oldest_unacked_ms: Some(NOW - 185_000),
            }],
            agent_state: vec![
                state("commands_clock_ms", "300005".into(), 1000),
                state("config_push_kept_serial", "11".into(), 60_000),
                state("config_push_serial", "12".into(), 300_000),
                state("device_id", "board-7 (from the config)".into(), 7_800_000),
                state(
                    "health",
                    serde_json::json!({"state": "ok", "reasons": [], "since_ms": NOW - 7_800_000}),
                    12_000,
                ),
                state("ingest_listeners", "tcp 127.0.0.1:47123".into(), 7_800_000),
                state(
                    "last_checkpoint",
                    serde_json::json!({"mode": "passive", "busy": 0, "log_frames": 120,
                        "checkpointed_frames": 120, "wal_file_bytes_before": 491_520,
                        "duration_ms": 3, "at_ms": NOW - 12_000}),
                    12_000,
                ),
                state("storage_profile", serde_json::json!(profile), 7_800_000),
            ],
            clock_set: Vec::new(),
            now_ms: NOW,
        }
    }

    #[test]
    fn the_text_has_units_labels_and_no_json_or_internal_keys() {
        let text = render(&running(), NOW);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "spool: /var/lib/edgespool/spool.db", "{text}");
        assert_eq!(
            lines[1], "agent: running (pid 4242), up 2 h 10 min (run #4, v0.1.0)",
            "{text}"
        );
        assert_eq!(
            lines[2], "health: ok (for 2 h 10 min; recorded 12 s ago)",
            "{text}"
        );
        assert_eq!(lines[3], "device_id: board-7 (from the config)", "{text}");
        for want in [
            "\nlast checkpoint: passive 12 s ago: 120 of 120 WAL frames copied in 3 ms (WAL file 480.0 KiB before)\n",
            "\nstorage: measured 2 h 10 min ago: fsync p50 3.3 ms, p99 11.0 ms, max 11.0 ms (32 samples), sequential writes 221.8 MB/s, 51.1 GiB free; derived: commit window 110 ms, checkpoint at 4.0 MiB of WAL, storage retries after 22 ms up to 1.1 s, spool bound at most 25.6 GiB (half the free space; the smaller of it and spool.max_bytes is in force)\n",
            "\ningest listeners: tcp 127.0.0.1:47123\n",
            "\nsigned config: newest serial accepted 12 (5 min ago; a signed config must carry a higher one), serial 11 kept for the next start\n",
            "\nrows: 20 waiting (20 PENDING, 0 SENT), 12,000 ACKED, 0 FAILED; the oldest waiting was appended 3 min 5 s ago\n",
            "\nsize: database 104.0 KiB, WAL 4.0 MiB\n",
            "\n  pump                     priority 0   20 waiting, oldest 3 min 5 s; 12,000 ACKED, 20 PENDING\n",
            "\n  commands_duplicates              3\n",
            "\n  #4 pid 4242 v0.1.0, started 2 h 10 min ago, running for 2 h 10 min\n",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        assert!(!text.contains('{') && !text.contains('}'), "{text}");
        assert!(!text.contains("commands_clock_ms"), "{text}");
        assert!(!text.contains("0d00h"), "{text}");
        assert!(
            fn_lines(include_str!("mod.rs"), "pub fn render(") < 100,
            "render must stay under 100 lines"
        );
    }

    /// The lines of the function that starts with `head` in `src`.
    fn fn_lines(src: &str, head: &str) -> usize {
        let start = src.find(head).unwrap_or(0);
        let body = &src[start..];
        body.find("\n}\n")
            .map_or(usize::MAX, |end| body[..end].lines().count() + 1)
    }

    #[test]
    fn a_stopped_agent_and_its_last_health_are_said_as_such() {
        let mut r = running();
        r.running = false;
        r.running_pid = None;
        r.runs[0].ended_ms = Some(NOW - 60_000);
        r.runs[0].exit_status = Some("ok".into());
        let text = render(&r, NOW);
        assert!(
            text.contains("\nagent: not running; last run #4 ended 1 min ago (status ok)\n"),
            "{text}"
        );
        assert!(
            text.contains("\nhealth: ok (recorded 12 s ago by a run that has ended: the agent is not running)\n"),
            "{text}"
        );
        assert!(text.contains(", ran 2 h 9 min, status ok\n"), "{text}");
        // Until the first CONNACK.
        r.running = true;
        r.agent_state[4].1 =
            serde_json::json!({"state": "starting", "reasons": [], "since_ms": NOW - 3000})
                .to_string();
        let text = render(&r, NOW);
        assert!(
            text.contains("\nhealth: starting: no connection to the broker yet (for 3 s; recorded 12 s ago)\n"),
            "{text}"
        );
        r.running = false;
        r.agent_state.clear();
        r.runs.clear();
        let text = render(&r, NOW);
        assert!(
            text.contains("\nagent: not running (no run recorded)\n"),
            "{text}"
        );
        assert!(text.contains("\nhealth: not recorded yet"), "{text}");
    }

    /// A board without an RTC: it booted in 1970, ran and appended, and
    /// time sync has set the clock since. Every stamp from before reads as
    /// such, none as 20,700 days.
    fn booted_in_1970() -> Report {
        let booted = 42_000;
        let mut r = running();
        r.stats.oldest_unacked_ms = Some(booted);
        r.stats.oldest_unacked_age_ms = Some(NOW - booted);
        r.streams[0].oldest_unacked_ms = Some(booted);
        r.streams[0].oldest_unacked_age_ms = Some(NOW - booted);
        r.runs[0].started_ms = booted;
        for (k, v, at) in &mut r.agent_state {
            *at = booted + 60_000;
            if k == "health" {
                *v = serde_json::json!({"state": "ok", "reasons": [], "since_ms": booted})
                    .to_string();
            }
        }
        r
    }

    #[test]
    fn times_from_before_the_clock_was_set_say_so_and_never_decades() {
        let text = render(&booted_in_1970(), NOW);
        for want in [
            "\nagent: running (pid 4242), started before the clock was set (run #4, v0.1.0)\n",
            "\nhealth: ok (since before the clock was set; recorded before the clock was set)\n",
            "\nlast checkpoint: passive 12 s ago: ",
            "\nsigned config: newest serial accepted 12 (before the clock was set; ",
            "; the oldest waiting was appended before the clock was set\n",
            "\n  pump                     priority 0   20 waiting, oldest appended before the clock was set; ",
            "\n  #4 pid 4242 v0.1.0, started before the clock was set, running\n",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        assert!(!text.contains(" d "), "an age in days:\n{text}");
        let mut r = booted_in_1970();
        r.running = false;
        r.runs[0].ended_ms = Some(NOW - 60_000);
        r.runs[0].exit_status = Some("ok".into());
        let text = render(&r, NOW);
        assert!(
            text.contains(", started before the clock was set, ended 1 min ago, status ok\n"),
            "{text}"
        );
        let v = to_json(&booted_in_1970());
        assert_eq!(v["oldest_unacked_age_known"], false);
        assert_eq!(v["oldest_unacked_ms"], 42_000);
        assert_eq!(v["oldest_unacked_age_ms"], NOW - 42_000, "the number stays");
        assert_eq!(v["streams"][0]["oldest_unacked_age_known"], false);
        let v = to_json(&running());
        assert_eq!(v["oldest_unacked_age_known"], true);
        assert_eq!(v["streams"][0]["oldest_unacked_age_known"], true);
        assert_eq!(v["streams"][0]["oldest_unacked_age_ms"], 185_000);
    }

    #[test]
    fn rows_counted_from_when_the_clock_was_set_say_they_are_older() {
        let set = NOW - 5_000;
        let mut r = booted_in_1970();
        r.stats.oldest_unacked_ms = Some(set);
        r.stats.oldest_unacked_age_ms = Some(5_000);
        r.streams[0].oldest_unacked_ms = Some(set);
        r.streams[0].oldest_unacked_age_ms = Some(5_000);
        r.clock_set = vec![("pump".into(), set)];
        let text = render(&r, NOW);
        for want in [
            "; the oldest waiting was appended before the clock was set (set 5 s ago)\n",
            " 20 waiting, oldest appended before the clock was set (set 5 s ago); ",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        let v = to_json(&r);
        assert_eq!(v["oldest_unacked_age_known"], true);
        assert_eq!(v["oldest_unacked_from_clock_set"], true);
        assert_eq!(v["oldest_unacked_age_ms"], 5_000);
        assert_eq!(v["streams"][0]["oldest_unacked_from_clock_set"], true);
        // A row appended after the clock was set is older still: its own.
        r.stats.oldest_unacked_ms = Some(set - 60_000);
        let text = render(&r, NOW);
        assert!(
            text.contains("; the oldest waiting was appended 1 min 5 s ago\n"),
            "{text}"
        );
        assert_eq!(to_json(&r)["oldest_unacked_from_clock_set"], false);
        assert_eq!(to_json(&running())["oldest_unacked_from_clock_set"], false);
    }

    #[test]
    fn times_ahead_of_a_clock_stepped_back_say_how_far() {
        let mut r = running();
        let ahead = NOW + 3 * 3_600_000;
        r.stats.oldest_unacked_ms = Some(ahead);
        r.stats.oldest_unacked_age_ms = Some(0);
        r.runs[0].started_ms = ahead;
        let text = render(&r, NOW);
        assert!(
            text.contains("; the oldest waiting was appended at a time 3 h ahead of this clock\n"),
            "{text}"
        );
        assert!(
            text.contains(", started at a time 3 h ahead of this clock, running\n"),
            "{text}"
        );
        assert_eq!(to_json(&r)["oldest_unacked_age_known"], false);
        r.stats = Stats::default();
        assert!(to_json(&r)["oldest_unacked_age_known"].is_null());
        assert!(to_json(&r)["oldest_unacked_from_clock_set"].is_null());
    }

    #[test]
    fn the_json_has_typed_values_and_keeps_every_record() {
        let v = to_json(&running());
        assert_eq!(v["running"], true);
        assert_eq!(v["running_pid"], 4242, "a number, not a string");
        assert_eq!(v["health"]["state"], "ok");
        assert_eq!(v["totals"]["ACKED"], 12_000);
        assert_eq!(v["rows"]["pump"]["PENDING"], 20);
        assert!(v["commands"]["by_state"].is_object(), "{v}");
        assert_eq!(v["agent_state"]["commands_clock_ms"]["value"], 300_005);
        assert_eq!(v["agent_state"]["config_push_serial"]["value"], 12);
        assert_eq!(
            v["agent_state"]["storage_profile"]["value"]["derived"]["commit_window_ms"],
            110
        );
        assert_eq!(
            v["agent_state"]["device_id"]["value"],
            "board-7 (from the config)"
        );
        assert_eq!(v["streams"][0]["rows"], 20);
        assert_eq!(v["runs"][0]["pid"], 4242);
        let mut r = running();
        r.running_pid = None;
        assert!(to_json(&r)["running_pid"].is_null());
        // A text record that happens to read as JSON stays text.
        r.agent_state
            .push(("ingest_listeners".into(), "123".into(), NOW));
        let v = to_json(&r);
        assert_eq!(v["agent_state"]["ingest_listeners"]["value"], "123");
    }
}
