//! `status` and the metrics on a board without an RTC: what the agent
//! stamped in 1970 reads as "before the clock was set" once the clock is
//! set, never as the 56 years since 1970; and once time sync has vouched
//! for the clock, the oldest waiting row counts from then.
//!
//! The real agent on a clock libfaketime sets (`support::faketime`), the
//! kernel's time-sync answer in a file, no broker (every row waits), and
//! the real `edgespool status`.

use crate::metrics::sample;
use crate::support::agent::{run_cli, run_cli_with, AgentProc};
use crate::support::board::{append_config, Board, NO_BROKER};
use crate::support::faketime::{self, FakeClock};
use crate::support::spool::count_in_state;
use crate::support::wait_for;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Every `N d` figure in `text`, in days (the longest unit `status` uses;
/// ages, and the outage budget's hold time).
fn days_in(text: &str) -> Vec<u64> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[1] == "d")
        .filter_map(|w| w[0].parse().ok())
        .collect()
}

/// No figure of ten years or more in `text`.
fn assert_no_decades(text: &str) {
    let days = days_in(text);
    assert!(
        days.iter().all(|&d| d < 3650),
        "figures of {days:?} days in\n{text}"
    );
}

fn status(db: &Path, env: &[(&str, &str)]) -> String {
    let spool = db.to_str().expect("utf-8");
    let (st, out, err) = run_cli_with(&["status", "--spool", spool], env, Duration::from_secs(30));
    assert!(st.success(), "status failed: {err}");
    out
}

fn status_json(db: &Path) -> serde_json::Value {
    let (st, out, err) = run_cli(&["status", "--json", "--spool", db.to_str().expect("utf-8")]);
    assert!(st.success(), "status --json failed: {err}");
    serde_json::from_str(&out).expect("status --json is JSON")
}

/// The board boots on 1970-01-02 (libfaketime), offline, and takes
/// readings; then its clock is stepped to now by something time sync did
/// not vouch for (`date -s`): `status` must say the waiting rows, the run
/// and its records are from before the clock was set, with no age of ten
/// years or more (on main: "the oldest waiting was appended 20792 d ago",
/// "up 20792 d"), `--json` must flag the age as no age, and the metrics
/// must show 0 and the flag, not 1.8e9 s. Then time sync vouches for the
/// clock: the spool counts the rows from that moment, the oldest waiting
/// age is seconds, and status says the row is from before (`appended
/// before the clock was set (set 2 s ago)`).
#[test]
fn status_says_before_the_clock_was_set_for_what_a_board_stamped_in_1970() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let Board { dir, cfg, db } = Board::new(NO_BROKER, &crate::prefix("clockages"), 100);
    let prom = dir.path().join("edgespool.prom");
    append_config(
        &cfg,
        &format!("[metrics]\ntextfile = \"{}\"\n", prom.display()),
    );
    let now_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let sync = dir.path().join("sync");
    std::fs::write(&sync, "unsynchronized\n").expect("sync file");
    let clock = FakeClock::new(dir.path().join("faketime"), &format!("-{}", now_s - 86_400))
        .with_sync_file(&sync);
    let env = clock.env();
    let mut agent = AgentProc::spawn_with_env(&cfg, &[], dir.path(), &env);
    assert!(
        wait_for(Duration::from_secs(30), || db.exists()
            && count_in_state(&db, "PENDING") >= 10),
        "no readings waiting\n{}",
        agent.log_tail(20)
    );
    // Still in 1970: ages on that clock are ages.
    let text = status(&db, &env);
    assert!(
        text.contains("; the oldest waiting was appended ") && !text.contains("before the clock"),
        "{text}"
    );
    assert_no_decades(&text);

    // `date -s`: the clock is set, time sync has not vouched for it.
    clock.step("+0");
    std::thread::sleep(Duration::from_secs(3));
    let text = status(&db, &env);
    for want in [
        "; the oldest waiting was appended before the clock was set\n",
        "started before the clock was set (run #1, ",
        "oldest appended before the clock was set; ",
    ] {
        assert!(text.contains(want), "{want:?} in\n{text}");
    }
    assert_no_decades(&text);
    let v = status_json(&db);
    assert_eq!(v["oldest_unacked_age_known"], false, "{v}");
    assert!(
        v["oldest_unacked_age_ms"].as_i64().is_some(),
        "the number stays: {v}"
    );
    let metric = |name: &str| {
        std::fs::read_to_string(&prom)
            .ok()
            .and_then(|t| sample(&t, name))
    };
    assert!(
        wait_for(Duration::from_secs(10), || metric(
            "edgespool_oldest_unacked_before_clock_set "
        ) == Some(1.0)),
        "{:?}\n{}",
        std::fs::read_to_string(&prom),
        agent.log_tail(20)
    );
    assert_eq!(
        metric("edgespool_oldest_unacked_age_seconds "),
        Some(0.0),
        "not the decades since 1970"
    );
    // The summary log line says so too, not "oldest_unacked_secs=1.7e9".
    assert!(
        agent.wait_log(Duration::from_secs(10), "oldest_unacked_secs=unknown "),
        "{}",
        agent.log_tail(20)
    );

    // Time sync vouches for the clock: the next commit closes the span and
    // the rows from before count from then.
    std::fs::write(&sync, "synchronized\n").expect("sync file");
    assert!(
        agent.wait_log(Duration::from_secs(20), "clock: set;"),
        "{}",
        agent.log_tail(20)
    );
    // The line is logged inside the transaction: its commit follows.
    let mut text = String::new();
    let counted_from_set = wait_for(Duration::from_secs(5), || {
        text = status(&db, &[]);
        text.contains("; the oldest waiting was appended before the clock was set (set ")
    });
    // 1970 rows count from when the clock was set, and say so.
    assert!(counted_from_set, "{text}");
    assert!(
        text.contains("started before the clock was set (run #1, "),
        "{text}"
    );
    assert_no_decades(&text);
    let v = status_json(&db);
    assert_eq!(v["oldest_unacked_age_known"], true, "{v}");
    assert_eq!(v["oldest_unacked_from_clock_set"], true, "{v}");
    let age = v["oldest_unacked_age_ms"].as_i64().unwrap_or(i64::MAX);
    assert!(
        age < 60_000,
        "counted from when the clock was set: {age} ms"
    );
    assert!(
        wait_for(Duration::from_secs(10), || metric(
            "edgespool_oldest_unacked_before_clock_set "
        ) == Some(0.0)),
        "{:?}",
        std::fs::read_to_string(&prom)
    );
    let secs = metric("edgespool_oldest_unacked_age_seconds ").unwrap_or(f64::MAX);
    assert!(secs < 60.0, "{secs} s");
    agent.terminate(Duration::from_secs(15));
    println!("{text}");
}
