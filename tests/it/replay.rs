//! The whole recorded AirQualityUCI trace (../shared/data), replayed through
//! the real agent into a real broker: every reading the trace holds arrives.

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::spool::{count_by_state, count_in_state, total};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::Path;
use std::time::Duration;

#[test]
fn the_whole_air_quality_trace_is_replayed_and_delivered() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let trace = root.join("../shared/data/AirQualityUCI.csv");
    assert!(
        trace.exists(),
        "{} is missing (the shared data folder sits beside the repository)",
        trace.display()
    );
    let broker = Broker::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("replay");
    let sub = Subscriber::start(broker.port(), &format!("{prefix}/events/#"));
    let db = dir.path().join("spool.db");
    let sets = vec![
        format!("spool.path={}", db.display()),
        format!("mqtt.url={}", broker.url()),
        format!("mqtt.topic_prefix={prefix}"),
        format!("sources.0.path={}", trace.display()),
        "sources.0.speed=0".to_owned(),
        "sources.0.interval_ms=20".to_owned(),
        "spool.commit_window_ms=50".to_owned(),
    ];
    let cfg = root.join("board-configs/airquality-replay.toml");
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(120), || agent
            .log_text()
            .contains("replay finished")),
        "{}",
        agent.log_tail(20)
    );
    let log = agent.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("replay finished"))
        .expect("finished line")
        .to_owned();
    println!("{line}");
    assert!(
        line.contains("9471 rows read, 9326 readings, 16701 cells skipped, 145 rows skipped"),
        "{line}"
    );
    assert!(
        wait_for(Duration::from_secs(120), || total(&db) == 9326
            && count_in_state(&db, "PENDING") + count_in_state(&db, "SENT")
                == 0),
        "{:?}\n{}",
        count_by_state(&db),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    let deliveries = sub.deliveries();
    crate::assert_invariants(&db, &deliveries);
    let r = crate::received(&deliveries);
    assert_eq!(r.times.len(), 9326);
    crate::assert_first_seen_in_order(&r);
    let first = deliveries[0].json();
    assert_eq!(first["fields"]["trace_ts_ms"], 1_078_941_600_000i64);
    assert_eq!(first["fields"]["co_gt"], 2.6);
}
