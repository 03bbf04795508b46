//! Integration tests: the real `edgespool` binary, a real mosquitto started
//! on a free port, real SQLite files, real SIGKILL, and a userspace TCP fault
//! proxy where a fault must be placed between agent and broker.

mod support;

mod aedes;
mod backfill;
mod batches;
mod bridge;
mod broker_word;
mod cli;
mod commands;
mod config;
mod dashboards;
mod delivery;
mod docs;
mod exec_sources;
mod export;
mod faults;
mod health;
mod hostile_dirs;
mod identity;
mod ingest;
mod lost_wal;
mod metrics;
mod modes;
mod mqtt5;
mod outage;
mod packaging;
mod peers;
#[cfg(feature = "pg-sink")]
mod pgsink;
#[cfg(feature = "pg-sink")]
mod pgsink_config;
#[cfg(feature = "pg-sink")]
mod pgtls;
mod powercut;
mod priority;
mod rebuilds;
mod receipts;
mod receipts_e2e;
mod refusals;
mod replay;
mod rollback;
mod sink_attacks;
mod sink_batches;
mod sink_identity;
mod spool;
mod standalone;
mod status_clock;
mod storage;
mod structure;
mod systemd;
mod tls;
mod trial;
#[cfg(feature = "pg-sink")]
mod truetime;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
pub use support::board::{prefix, v311, write_config};
use support::subscriber::Delivery;

/// Run the agent with no sources until the spool holds no PENDING or SENT
/// row (60 s at most, else panic with the counts and the log), then stop it.
pub fn drain(cfg: &Path, dir: &Path, db: &Path) {
    let mut agent = support::agent::AgentProc::spawn(cfg, &["sources=[]".into()], dir);
    let drained = support::wait_for(std::time::Duration::from_secs(60), || {
        let c = support::spool::count_by_state(db);
        !c.contains_key("PENDING") && !c.contains_key("SENT")
    });
    assert!(
        drained,
        "spool did not drain: {:?}\n{}",
        support::spool::count_by_state(db),
        agent.log_tail(40)
    );
    agent.terminate(std::time::Duration::from_secs(15));
}

/// The event id of a delivered payload.
pub fn event_id(d: &Delivery) -> String {
    let v: serde_json::Value = serde_json::from_slice(&d.payload).expect("payload is JSON");
    v["event_id"].as_str().expect("event_id").to_owned()
}

/// What a receiver saw, grouped.
pub struct Received {
    /// event id → every distinct payload seen for it.
    pub payloads: HashMap<String, HashSet<Vec<u8>>>,
    /// event id → times delivered.
    pub times: HashMap<String, usize>,
    /// (stream, seq) in order of first delivery of each event id.
    pub first_seen: Vec<(String, i64)>,
}

pub fn received(deliveries: &[Delivery]) -> Received {
    let mut r = Received {
        payloads: HashMap::new(),
        times: HashMap::new(),
        first_seen: Vec::new(),
    };
    for d in deliveries {
        let v: serde_json::Value = serde_json::from_slice(&d.payload).expect("payload is JSON");
        let id = v["event_id"].as_str().expect("event_id").to_owned();
        let n = r.times.entry(id.clone()).or_insert(0);
        if *n == 0 {
            r.first_seen.push((
                v["stream"].as_str().unwrap_or_default().to_owned(),
                v["seq"].as_i64().unwrap_or(-1),
            ));
        }
        *n += 1;
        r.payloads.entry(id).or_default().insert(d.payload.clone());
    }
    r
}

/// The invariants every scenario ends with (docs/invariants.md), given a
/// drained spool:
/// I1 every row's event id reached the receiver; I2 every ACKED row was
/// received (the broker had it); I3 no event id ever carried two payloads,
/// and the payload received is the one stored; and the spool passes
/// `PRAGMA quick_check`.
pub fn assert_invariants(db: &Path, deliveries: &[Delivery]) {
    let r = received(deliveries);
    for (id, p) in &r.payloads {
        assert_eq!(
            p.len(),
            1,
            "I3: event {id} arrived with {} different payloads",
            p.len()
        );
    }
    let rows = support::spool::rows(db);
    assert!(!rows.is_empty(), "the scenario produced no rows");
    let mut missing = Vec::new();
    for row in &rows {
        match r.payloads.get(&row.event_id) {
            None => missing.push((row.id, row.state.clone())),
            Some(p) => assert!(
                p.contains(&row.payload),
                "I3: event {} arrived with a payload other than the stored one",
                row.event_id
            ),
        }
    }
    assert!(
        missing.is_empty(),
        "I1/I2: {} of {} rows never reached the receiver (first: {:?})",
        missing.len(),
        rows.len(),
        &missing[..missing.len().min(5)]
    );
    let conn = support::spool::open(db);
    let qc: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .expect("quick_check");
    assert_eq!(qc, "ok");
}

/// Per stream, the first deliveries come in sequence order (I7).
pub fn assert_first_seen_in_order(r: &Received) {
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    for (stream, seq) in &r.first_seen {
        let prev = last.insert(stream, *seq).unwrap_or(0);
        assert!(
            *seq > prev,
            "I7: stream {stream}: seq {seq} first delivered after seq {prev}"
        );
    }
}
