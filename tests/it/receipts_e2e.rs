//! Receipts end to end (issue 22): the real agent binary in receipt mode
//! (`mqtt.retire_on = "receipt"`), real mosquitto brokers, the real
//! `edgespool sink` publishing receipts after its commits, and the same
//! scenarios in the default puback mode to show what receipts are for.
//!
//! - A local broker in front (agent -> local mosquitto, persistence on,
//!   bridged to a cloud mosquitto -> sink): the bridge cut, 200 rows
//!   PUBACKed by the local broker, the local broker restarted (SIGTERM,
//!   or SIGKILL), the bridge restored. In receipt mode all 200 reach the
//!   sink's database and every row ends ACKED; in puback mode the rows the
//!   restart lost are ACKED at the agent and missing from the database.
//! - A queue cap (`max_queued_messages 5`): 500 events for a sink whose
//!   persistent session is offline. In receipt mode the agent sends again
//!   what the broker dropped, after its receipt timeout, until all 500
//!   are stored; in puback mode they are lost.
//! - Three sinks on a shared subscription storing into PostgreSQL, two of
//!   them SIGKILLed mid-stream and restarted; two agents in receipt mode
//!   and a bulk publisher as ten more devices: every row an agent retired
//!   is in the database with the digest the agent stored, checked while
//!   the stream runs as well as at the end.
//!
//! Each test prints its figures (`cargo nextest run --no-capture`).

use crate::refusals::status_json;
use crate::support::agent::AgentProc;
use crate::support::board::{edit_config, write_board};
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::sink::{SinkProc, BROKER_EXTRA};
use crate::support::{poll, spool, tail, unique_suffix, wait_for};
use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// When a row is retired at the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RetireOn {
    Puback,
    Receipt,
}

impl RetireOn {
    fn key(self) -> &'static str {
        match self {
            RetireOn::Puback => "puback",
            RetireOn::Receipt => "receipt",
        }
    }
}

/// The receipt timeout of every agent here (the minimum the config takes).
const RECEIPT_TIMEOUT_SECS: u64 = 10;

/// A board config with no sources (the spool is seeded), publishing to
/// `url` under `prefix` (which ends with `device`, as the sink requires),
/// retiring rows on `retire_on`.
fn board_config(dir: &Path, url: &str, prefix: &str, device: &str, retire_on: RetireOn) -> PathBuf {
    assert!(
        prefix.ends_with(&format!("/{device}")),
        "the sink takes the device from the prefix's last level: {prefix} for {device}"
    );
    let path = write_board(dir, url, prefix, "");
    edit_config(&path, |t| {
        t.replacen(
            "device_id = \"it-board\"\n",
            &format!("device_id = \"{device}\"\nsources = []\n"),
            1,
        )
        .replacen(
            &format!("topic_prefix = \"{prefix}\"\n"),
            &format!(
                "topic_prefix = \"{prefix}\"\nretire_on = \"{}\"\nreceipt_public_keys = [\"{}\"]\nreceipt_timeout_secs = {RECEIPT_TIMEOUT_SECS}\n",
                retire_on.key(),
                crate::support::keys::fleet_key().key.public().hex()
            ),
            1,
        )
    });
    path
}

/// Append `n` readings of stream `load` for `device` to the spool at `db`
/// (created if absent), as the agent would have.
fn seed(db: &Path, device: &str, n: usize) {
    let mut s = Spool::open(db, &SpoolOptions::default()).expect("open the spool to seed it");
    let mut ids = EventIdGen::new().expect("event ids");
    let now = edgespool::event::envelope::wall_clock_ms().0;
    let mut done = 0;
    while done < n {
        let end = (done + 1000).min(n);
        let evs: Vec<NewEvent> = (done..end)
            .map(|i| {
                let fields = vec![
                    ("n".to_owned(), FieldValue::Num(i as f64)),
                    ("load1".to_owned(), FieldValue::Num((i % 97) as f64 / 10.0)),
                ];
                NewEvent::new("load", now + i as i64, true, fields)
            })
            .collect();
        s.append(&evs, &mut ids, device, Format::Json, now)
            .expect("append the seeded readings");
        done = end;
    }
}

/// A row of the agent's spool as the checks need it.
#[derive(Debug, Clone)]
struct SpoolRow {
    event_id: String,
    digest: Vec<u8>,
    state: String,
}

/// Every row of the spool at `db`, in row order.
fn spool_rows(db: &Path) -> Vec<SpoolRow> {
    let c = spool::open(db);
    let mut st = c
        .prepare("SELECT event_id, digest, state FROM event_states ORDER BY id")
        .unwrap_or_else(|e| panic!("prepare the spool rows of {}: {e}", db.display()));
    let rows = st
        .query_map([], |r| {
            Ok(SpoolRow {
                event_id: r.get(0)?,
                digest: r.get(1)?,
                state: r.get(2)?,
            })
        })
        .unwrap_or_else(|e| panic!("read the spool rows of {}: {e}", db.display()));
    rows.map(|r| r.unwrap_or_else(|e| panic!("a spool row of {}: {e}", db.display())))
        .collect()
}

/// The receipts record the agent keeps for `status` (written every
/// summary, 2 s here); `Null` before the first.
fn receipts_state(db: &Path) -> serde_json::Value {
    status_json(db)["agent_state"]["receipts"]["value"].clone()
}

/// A field of [`receipts_state`] (0 while absent).
fn receipts_field(db: &Path, key: &str) -> u64 {
    receipts_state(db)[key].as_u64().unwrap_or(0)
}

/// Rows the agent logged as sent again for a missing receipt, per round
/// (`no receipt for N rows within ...`), over every run whose log is in
/// `dir`.
fn resend_rounds(dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut logs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.starts_with("agent-") && n.ends_with(".log"))
        })
        .collect();
    logs.sort();
    logs.iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| {
                    let rest = l.split("no receipt for ").nth(1)?;
                    rest.split_whitespace().next()?.parse::<u64>().ok()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Rows sent again for a missing receipt, in all (see [`resend_rounds`]).
fn resent_logged(dir: &Path) -> u64 {
    resend_rounds(dir).iter().sum()
}

/// event id -> digest of what the SQLite sink at `db` holds for `device`
/// (empty before the sink created it).
fn sqlite_stored(db: &Path, device: &str) -> HashMap<String, Vec<u8>> {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return HashMap::new();
    };
    let _ = c.busy_timeout(Duration::from_secs(5));
    let Ok(mut st) = c.prepare("SELECT event_id, digest FROM received WHERE device_id = ?1") else {
        return HashMap::new();
    };
    st.query_map([device], |r| Ok((r.get(0)?, r.get(1)?)))
        .and_then(|rows| rows.collect())
        .unwrap_or_default()
}

/// Deliveries the SQLite sink at `db` counted beyond the first, all devices.
fn sqlite_duplicates(db: &Path) -> i64 {
    rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .and_then(|c| {
            c.query_row(
                "SELECT coalesce(sum(deliveries - 1), 0) FROM received",
                [],
                |r| r.get(0),
            )
        })
        .unwrap_or(-1)
}

/// A JSON envelope the sink stores as an event of `device`, stream
/// `marker`: published after everything else on one path, it is stored
/// after everything that path still delivers (one session queue, in order).
fn marker(device: &str) -> (String, Vec<u8>) {
    let id = "7e570000-0000-4000-8000-00000000abcd".to_owned();
    let body = format!(
        r#"{{"event_id":"{id}","device_id":"{device}","stream":"marker","seq":1,"ts_ms":1800000000000,"clock_trusted":true,"fields":{{"m":1}}}}"#
    );
    (id, body.into_bytes())
}

/// The agent never gave up acknowledging a receipt: an acknowledgement
/// the MQTT client had no room for used to be dropped, holding a slot of
/// the broker's in-flight window for the agent until the session ended
/// (with a stock mosquitto, 20 of them stopped receipts altogether).
fn assert_no_lost_acks(agent: &AgentProc) {
    let log = agent.log_text();
    let lost: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("could not acknowledge"))
        .collect();
    assert!(
        lost.is_empty(),
        "{} acknowledgements of receipts given up, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(3)]
    );
}

/// The agent's rows checked against what a sink stored: retired rows
/// missing from the store, and rows stored with other bytes.
#[derive(Debug, Default)]
struct Check {
    rows: usize,
    acked: usize,
    stored: usize,
    /// ACKED at the agent, not in the store.
    retired_missing: Vec<String>,
    /// In the store with a digest other than the spool's.
    other_bytes: Vec<String>,
}

fn check_rows(rows: &[SpoolRow], stored: &HashMap<String, Vec<u8>>) -> Check {
    let mut c = Check {
        rows: rows.len(),
        ..Check::default()
    };
    for r in rows {
        let acked = r.state == "ACKED";
        c.acked += usize::from(acked);
        match stored.get(&r.event_id) {
            Some(d) => {
                c.stored += 1;
                if *d != r.digest {
                    c.other_bytes.push(r.event_id.clone());
                }
            }
            None if acked => c.retired_missing.push(r.event_id.clone()),
            None => {}
        }
    }
    c
}

/// How the local broker is restarted while its bridge is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restart {
    /// SIGTERM (an upgrade, `systemctl restart`, an orderly reboot):
    /// mosquitto writes its persistence file on the way out.
    Sigterm,
    /// SIGKILL once an autosave (every second here) has written the rows.
    SigkillAfterAutosave,
    /// SIGKILL with mosquitto's stock `autosave_interval` (1800 s, what
    /// Debian's mosquitto.conf leaves it at): a crash, an OOM kill or a
    /// power cut before the next save.
    SigkillStockAutosave,
}

impl Restart {
    /// What the local broker's config needs for this restart.
    fn extra(self) -> &'static str {
        match self {
            // Read after the test broker's `autosave_interval 1`.
            Restart::SigkillStockAutosave => "autosave_interval 1800\n",
            Restart::Sigterm | Restart::SigkillAfterAutosave => "",
        }
    }
}

/// What one bridge scenario ended with.
#[derive(Debug)]
struct BridgeOutcome {
    mode: RetireOn,
    restart: Restart,
    rows: usize,
    acked: usize,
    /// Agent rows in the sink's database.
    stored: usize,
    /// ACKED at the agent, not in the sink's database.
    lost: usize,
    resent: u64,
    duplicates: i64,
    /// From the bridge restored until the end state.
    settle: Duration,
    /// Receipts the agent read, and ids in them that matched no waiting row.
    receipts: (u64, u64),
}

const BRIDGE_ROWS: usize = 200;

/// agent -> local mosquitto (persistence on, bridged out through a proxy)
/// -> cloud mosquitto -> sink (SQLite). The bridge is cut, the agent
/// publishes 200 seeded rows, the local broker is restarted, the bridge
/// is restored.
fn bridge_scenario(mode: RetireOn, restart: Restart) -> BridgeOutcome {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptbridge");
    let device = "it-board";
    let prefix = format!("{base}/{device}");
    let tag = unique_suffix();
    let cloud = Broker::start_with_options(BROKER_EXTRA, false);
    let proxy = Proxy::start(cloud.port());
    let local_id = format!("bridge-local-{tag}");
    // mosquitto.conf(5), "Configuring Bridges": events out, receipts in;
    // a persistent bridge session at both ends.
    let bridge = format!(
        "connection cloud\n\
         address 127.0.0.1:{port}\n\
         topic {prefix}/# out 1\n\
         topic {prefix}/receipts in 1\n\
         cleansession false\n\
         local_clientid {local_id}\n\
         remote_clientid bridge-{tag}\n\
         bridge_protocol_version mqttv311\n\
         keepalive_interval 5\n\
         restart_timeout 1\n\
         {extra}",
        port = proxy.port(),
        extra = restart.extra()
    );
    let mut local = Broker::start_persistent(&bridge, true);
    let bridge_up = |local: &Broker| {
        local
            .log_text()
            .matches(&format!("Received CONNACK on connection {local_id}"))
            .count()
    };
    let sink_db = dir.path().join("sink.db");
    let mut sink = SinkProc::spawn_sqlite(
        cloud.port(),
        &format!("{base}/+/events/#"),
        &sink_db,
        &format!("cloud-sink-{tag}"),
        dir.path(),
    );
    sink.wait_subscribed();
    assert!(
        wait_for(Duration::from_secs(30), || bridge_up(&local) >= 1),
        "the bridge did not connect:\n{}",
        tail(&local.log_text(), 30)
    );

    // Cut the bridge; the local broker notices at once (the proxy closes
    // the connection) and queues for it from now on.
    proxy.set_mode(Mode::Refuse);
    assert!(
        wait_for(Duration::from_secs(20), || proxy.active_connections() == 0),
        "the proxy still holds {} connections",
        proxy.active_connections()
    );
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let db = agent_dir.join("spool.db");
    seed(&db, device, BRIDGE_ROWS);
    let cfg = board_config(&agent_dir, &local.url(), &prefix, device, mode);
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);

    // Every row PUBACKed by the local broker: retired (puback), or waiting
    // for its receipt (receipt).
    let pubacked = match mode {
        RetireOn::Puback => wait_for(Duration::from_secs(60), || {
            spool::count_in_state(&db, "ACKED") == BRIDGE_ROWS as i64
        }),
        RetireOn::Receipt => poll(Duration::from_secs(60), Duration::from_millis(500), || {
            receipts_field(&db, "awaiting") >= BRIDGE_ROWS as u64
        }),
    };
    assert!(
        pubacked,
        "{mode:?}: the local broker did not PUBACK all {BRIDGE_ROWS} rows: spool {:?}, receipts {}\n{}",
        spool::count_by_state(&db),
        receipts_state(&db),
        agent.log_tail(30)
    );
    if mode == RetireOn::Receipt {
        assert_eq!(
            spool::count_in_state(&db, "ACKED"),
            0,
            "a row was retired with the bridge cut (no receipt can have come)"
        );
    }
    assert_eq!(
        sqlite_stored(&sink_db, device).len(),
        0,
        "the cut bridge let an event through"
    );

    // The local broker restarted, as after an upgrade, a reboot or a crash.
    let saves = |local: &Broker| {
        local
            .log_text()
            .matches("Saving in-memory database")
            .count()
    };
    match restart {
        Restart::Sigterm => local.restart_graceful(),
        Restart::SigkillAfterAutosave => {
            let before = saves(&local);
            assert!(
                wait_for(Duration::from_secs(10), || saves(&local) > before),
                "no autosave within 10 s:\n{}",
                tail(&local.log_text(), 20)
            );
            local.restart();
        }
        Restart::SigkillStockAutosave => {
            assert_eq!(saves(&local), 0, "an autosave ran with the stock interval");
            local.restart();
        }
    }
    let connected_before = bridge_up(&local);
    proxy.set_mode(Mode::Forward);
    let restored = Instant::now();
    assert!(
        wait_for(Duration::from_secs(60), || bridge_up(&local)
            > connected_before),
        "the bridge did not reconnect after the restore:\n{}",
        tail(&local.log_text(), 30)
    );

    match mode {
        RetireOn::Receipt => {
            let all = wait_for(Duration::from_secs(120), || {
                spool::count_in_state(&db, "ACKED") == BRIDGE_ROWS as i64
                    && sqlite_stored(&sink_db, device).len() == BRIDGE_ROWS
            });
            assert!(
                all,
                "receipt mode: {} of {BRIDGE_ROWS} rows ACKED, {} in the sink's database, \
                 {:.1?} after the bridge was restored; receipts {}\n--- agent ---\n{}\n--- sink ---\n{}",
                spool::count_in_state(&db, "ACKED"),
                sqlite_stored(&sink_db, device).len(),
                restored.elapsed(),
                receipts_state(&db),
                agent.log_tail(30),
                tail(&sink.log_text(), 10)
            );
        }
        RetireOn::Puback => {
            // A marker published to the local broker after the restart goes
            // out behind whatever the bridge still holds: once it is stored,
            // the rest of that path has been delivered.
            let (marker_id, body) = marker(device);
            crate::commands::publish(
                local.port(),
                &format!("{prefix}/events/marker"),
                &body,
                false,
            );
            assert!(
                wait_for(Duration::from_secs(60), || sqlite_stored(&sink_db, device)
                    .contains_key(&marker_id)),
                "the marker did not reach the sink's database\n--- local broker ---\n{}\n--- sink ---\n{}",
                tail(&local.log_text(), 30),
                tail(&sink.log_text(), 10)
            );
        }
    }
    let settle = restored.elapsed();
    let resent = match mode {
        RetireOn::Receipt => resent_logged(&agent_dir),
        RetireOn::Puback => 0,
    };
    if mode == RetireOn::Receipt {
        // The receipts record is written each summary (2 s).
        poll(Duration::from_secs(10), Duration::from_millis(500), || {
            receipts_field(&db, "received") > 0
        });
    }
    agent.terminate(Duration::from_secs(15));
    sink.terminate();
    assert_no_lost_acks(&agent);

    let rows = spool_rows(&db);
    let stored = sqlite_stored(&sink_db, device);
    let c = check_rows(&rows, &stored);
    assert!(
        c.other_bytes.is_empty(),
        "{mode:?}/{restart:?}: events stored with bytes other than the spool's: {:?}",
        c.other_bytes
    );
    BridgeOutcome {
        mode,
        restart,
        rows: c.rows,
        acked: c.acked,
        stored: c.stored,
        lost: c.retired_missing.len(),
        resent,
        duplicates: sqlite_duplicates(&sink_db),
        settle,
        receipts: (
            receipts_field(&db, "received"),
            receipts_field(&db, "unmatched_ids"),
        ),
    }
}

fn print_bridge(o: &BridgeOutcome) {
    println!(
        "bridge {:?} mode, local broker restarted by {:?}: {} rows, {} ACKED at the agent, \
         {} in the sink's database, {} ACKED and lost, {} sent again for a missing receipt, {} duplicate deliveries at the \
         sink, {:.1?} from the bridge restored to the end state, receipts read {} (ids matching \
         no waiting row {})",
        o.mode,
        o.restart,
        o.rows,
        o.acked,
        o.stored,
        o.lost,
        o.resent,
        o.duplicates,
        o.settle,
        o.receipts.0,
        o.receipts.1
    );
}

#[test]
fn behind_a_restarted_local_broker_receipt_mode_stores_all_200_rows() {
    for restart in [
        Restart::Sigterm,
        Restart::SigkillAfterAutosave,
        Restart::SigkillStockAutosave,
    ] {
        let o = bridge_scenario(RetireOn::Receipt, restart);
        print_bridge(&o);
        assert_eq!(
            (o.rows, o.acked, o.stored, o.lost),
            (BRIDGE_ROWS, BRIDGE_ROWS, BRIDGE_ROWS, 0),
            "{o:?}"
        );
    }
}

#[test]
fn behind_a_restarted_local_broker_puback_mode_retires_rows_the_cloud_never_got() {
    for restart in [
        Restart::Sigterm,
        Restart::SigkillAfterAutosave,
        Restart::SigkillStockAutosave,
    ] {
        let o = bridge_scenario(RetireOn::Puback, restart);
        print_bridge(&o);
        assert_eq!(o.acked, BRIDGE_ROWS, "puback mode retires on the PUBACK");
        assert_eq!(o.stored + o.lost, BRIDGE_ROWS, "{o:?}");
        // Measured on mosquitto 2.0.11: a SIGTERM or a SIGKILL after an
        // autosave loses nothing (the persistence file has the bridge's
        // queue), so nothing is asserted for those; a SIGKILL before any
        // save (checked above) loses every row, every time.
        if restart == Restart::SigkillStockAutosave {
            assert_eq!(o.lost, BRIDGE_ROWS, "{o:?}");
        }
    }
}

/// What one queue-cap scenario ended with.
#[derive(Debug)]
struct CapOutcome {
    mode: RetireOn,
    rows: usize,
    acked: usize,
    stored: usize,
    lost: usize,
    resent: u64,
    duplicates: i64,
    /// Rows sent again per round of the receipt timeout.
    rounds: Vec<u64>,
    /// Times mosquitto logged that it began dropping for a client.
    drop_episodes: usize,
    /// From the sink back until the end state.
    settle: Duration,
}

const CAP_ROWS: usize = 500;
/// The broker of the queue-cap scenario: at most 5 messages queued for a
/// client, in flight or offline.
const CAP_BROKER: &str = "max_queued_messages 5\n";

/// One mosquitto with a queue cap; the sink's persistent session is
/// created, then the sink stays away while the agent publishes 500 rows,
/// then it comes back under the same client id.
fn queue_cap_scenario(mode: RetireOn) -> CapOutcome {
    let broker = Broker::start_with_options(CAP_BROKER, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptcap");
    let device = "it-board";
    let prefix = format!("{base}/{device}");
    let filter = format!("{base}/+/events/#");
    let sink_db = dir.path().join("sink.db");
    let sink_id = format!("cap-sink-{}", unique_suffix());
    let mut sink = SinkProc::spawn_sqlite(broker.port(), &filter, &sink_db, &sink_id, dir.path());
    sink.wait_subscribed();
    sink.terminate();
    assert!(
        sink.wait_exit(Duration::from_secs(15)).is_some(),
        "the sink did not stop"
    );

    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let db = agent_dir.join("spool.db");
    seed(&db, device, CAP_ROWS);
    let cfg = board_config(&agent_dir, &broker.url(), &prefix, device, mode);
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);
    let pubacked = match mode {
        RetireOn::Puback => wait_for(Duration::from_secs(60), || {
            spool::count_in_state(&db, "ACKED") == CAP_ROWS as i64
        }),
        RetireOn::Receipt => poll(Duration::from_secs(60), Duration::from_millis(500), || {
            receipts_field(&db, "awaiting") >= CAP_ROWS as u64
        }),
    };
    assert!(
        pubacked,
        "{mode:?}: the broker did not PUBACK all {CAP_ROWS} rows: spool {:?}, receipts {}\n{}",
        spool::count_by_state(&db),
        receipts_state(&db),
        agent.log_tail(30)
    );

    let back = Instant::now();
    let mut sink = SinkProc::spawn_sqlite(broker.port(), &filter, &sink_db, &sink_id, dir.path());
    sink.wait_subscribed();
    match mode {
        RetireOn::Receipt => {
            let all = wait_for(Duration::from_secs(150), || {
                spool::count_in_state(&db, "ACKED") == CAP_ROWS as i64
                    && sqlite_stored(&sink_db, device).len() == CAP_ROWS
            });
            assert!(
                all,
                "receipt mode: {} of {CAP_ROWS} rows ACKED, {} in the sink's database, \
                 {:.1?} after the sink came back; receipts {}\n--- agent ---\n{}\n--- sink ---\n{}",
                spool::count_in_state(&db, "ACKED"),
                sqlite_stored(&sink_db, device).len(),
                back.elapsed(),
                receipts_state(&db),
                agent.log_tail(30),
                tail(&sink.log_text(), 10)
            );
        }
        RetireOn::Puback => {
            // The marker goes behind what the broker kept for the sink; it
            // may itself meet the cap while that drains: sent again (same
            // id and bytes) until stored.
            let (marker_id, body) = marker(device);
            let topic = format!("{prefix}/events/marker");
            let mut last = None::<Instant>;
            assert!(
                wait_for(Duration::from_secs(60), || {
                    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
                        crate::commands::publish(broker.port(), &topic, &body, false);
                        last = Some(Instant::now());
                    }
                    sqlite_stored(&sink_db, device).contains_key(&marker_id)
                }),
                "the marker did not reach the sink's database\n--- sink ---\n{}",
                tail(&sink.log_text(), 10)
            );
        }
    }
    let settle = back.elapsed();
    let resent = resent_logged(&agent_dir);
    agent.terminate(Duration::from_secs(15));
    sink.terminate();
    assert_no_lost_acks(&agent);
    let rows = spool_rows(&db);
    let stored = sqlite_stored(&sink_db, device);
    let c = check_rows(&rows, &stored);
    assert!(
        c.other_bytes.is_empty(),
        "{mode:?}: events stored with bytes other than the spool's: {:?}",
        c.other_bytes
    );
    CapOutcome {
        mode,
        rows: c.rows,
        acked: c.acked,
        stored: c.stored,
        lost: c.retired_missing.len(),
        resent,
        rounds: resend_rounds(&agent_dir),
        duplicates: sqlite_duplicates(&sink_db),
        drop_episodes: broker
            .log_text()
            .matches("Outgoing messages are being dropped")
            .count(),
        settle,
    }
}

fn print_cap(o: &CapOutcome) {
    println!(
        "queue cap ({}), {:?} mode: {} rows, {} ACKED at the agent, {} in the sink's database, \
         {} ACKED and lost, {} sent again for a missing receipt (per round {:?}), {} duplicate \
         deliveries at the sink, {} times the broker began dropping, {:.1?} from the sink back \
         to the end state",
        CAP_BROKER.trim(),
        o.mode,
        o.rows,
        o.acked,
        o.stored,
        o.lost,
        o.resent,
        o.rounds,
        o.duplicates,
        o.drop_episodes,
        o.settle
    );
}

#[test]
fn a_queue_cap_for_an_offline_sink_receipt_mode_sends_again_until_all_500_are_stored() {
    let o = queue_cap_scenario(RetireOn::Receipt);
    print_cap(&o);
    assert_eq!(
        (o.rows, o.acked, o.stored, o.lost),
        (CAP_ROWS, CAP_ROWS, CAP_ROWS, 0),
        "{o:?}"
    );
    assert!(
        o.resent > 0,
        "nothing was sent again, so the cap dropped nothing: {o:?}"
    );
}

#[test]
fn a_queue_cap_for_an_offline_sink_puback_mode_retires_rows_the_broker_dropped() {
    let o = queue_cap_scenario(RetireOn::Puback);
    print_cap(&o);
    assert_eq!(o.acked, CAP_ROWS, "puback mode retires on the PUBACK");
    assert_eq!(o.stored + o.lost, CAP_ROWS, "{o:?}");
    // 500 rows for a session that may hold 5: the loss is certain.
    assert!(o.lost > 0, "the queue cap lost nothing: {o:?}");
}

/// event id -> digest of the PostgreSQL store's events of `device`.
#[cfg(feature = "pg-sink")]
fn pg_stored(c: &mut postgres::Client, device: &str) -> HashMap<String, Vec<u8>> {
    c.query(
        "SELECT event_id::text, digest FROM events WHERE device_id = $1",
        &[&device],
    )
    .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    .unwrap_or_default()
}

#[cfg(feature = "pg-sink")]
fn pg_count(c: &mut postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).map(|r| r.get(0)).unwrap_or(-1)
}

/// One agent of the shared-subscription scenario.
#[cfg(feature = "pg-sink")]
struct Board {
    device: String,
    dir: PathBuf,
    db: PathBuf,
    proc: AgentProc,
}

/// Every agent's spool read first, then the store: a row ACKED in the
/// spool must be in the store already (the store only grows), with the
/// spool's digest. Returns (rows ACKED, rows checked in all); panics on a
/// row retired before its event was stored.
#[cfg(feature = "pg-sink")]
fn assert_retired_are_stored(boards: &[Board], c: &mut postgres::Client, when: &str) -> usize {
    let mut acked = 0;
    for b in boards {
        let rows = spool_rows(&b.db);
        let stored = pg_stored(c, &b.device);
        let check = check_rows(&rows, &stored);
        assert!(
            check.retired_missing.is_empty(),
            "{when}: {} rows of {} were retired (ACKED) and their events are not in the \
             database, e.g. {:?}\n{}",
            check.retired_missing.len(),
            b.device,
            &check.retired_missing[..check.retired_missing.len().min(5)],
            b.proc.log_tail(20)
        );
        assert!(
            check.other_bytes.is_empty(),
            "{when}: events of {} stored with a digest other than the spool's: {:?}",
            b.device,
            &check.other_bytes[..check.other_bytes.len().min(5)]
        );
        acked += check.acked;
    }
    acked
}

/// The last `sink: first N duplicates N ...` numbers of a sink's log.
fn sink_line(log: &str) -> Option<String> {
    log.lines()
        .rev()
        .find(|l| l.contains("sink: first ") && l.contains(" receipts "))
        .map(|l| l[l.find("sink: first ").unwrap_or(0)..].to_owned())
}

/// Rows per agent; two agents, and the publisher's bulk beside them.
#[cfg(feature = "pg-sink")]
const SHARED_AGENT_ROWS: usize = 5_000;
#[cfg(feature = "pg-sink")]
const SHARED_PUBLISHED: usize = 10_000;

#[cfg(feature = "pg-sink")]
#[test]
fn three_shared_sinks_two_killed_every_row_an_agent_retired_is_stored_with_its_digest() {
    use crate::support::{postgres::Postgres, publisher};
    let pg = Postgres::start(&[("fsync", "off")]);
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptshare");
    let filter = format!("{base}/+/events/#");
    let ids = ["rcpt-sink-a", "rcpt-sink-b", "rcpt-sink-c"];
    let spawn =
        |id: &str| SinkProc::spawn(broker.port(), &filter, &pg.conninfo(), id, "g", dir.path());
    let mut sinks: Vec<SinkProc> = ids.iter().map(|id| spawn(id)).collect();
    for s in &sinks {
        s.wait_subscribed();
    }
    let mut db = pg.client();

    // Two agents in receipt mode with a backlog each.
    let mut boards: Vec<Board> = ["agent-a", "agent-b"]
        .iter()
        .map(|device| {
            let bdir = dir.path().join(device);
            std::fs::create_dir_all(&bdir).expect("agent dir");
            let bdb = bdir.join("spool.db");
            seed(&bdb, device, SHARED_AGENT_ROWS);
            let cfg = board_config(
                &bdir,
                &broker.url(),
                &format!("{base}/{device}"),
                device,
                RetireOn::Receipt,
            );
            Board {
                device: (*device).to_owned(),
                proc: AgentProc::spawn(&cfg, &[], &bdir),
                dir: bdir,
                db: bdb,
            }
        })
        .collect();
    // Ten more devices in bulk beside them, with duplicates of their own.
    let plan = publisher::Plan {
        events: SHARED_PUBLISHED,
        devices: 10,
        dup_every: 50,
        conflicts: 0,
    };
    let started = Instant::now();
    let port = broker.port();
    let pub_prefix = base.clone();
    let bulk = std::thread::spawn(move || {
        publisher::publish(port, &pub_prefix, plan, Duration::from_secs(300))
    });
    let total = 2 * SHARED_AGENT_ROWS + SHARED_PUBLISHED;
    let events = |db: &mut postgres::Client| pg_count(db, "SELECT count(*) FROM events");

    // Kill sink a at 25 % of the events stored, bring it back once 5 % more
    // are; the same for sink b at 55 %. The rows retired so far are checked
    // at each kill and each restart.
    let mut kills = Vec::new();
    let mut checks = Vec::new();
    for (k, at) in [(0usize, 0.25f64), (1, 0.55)] {
        let target = (total as f64 * at) as i64;
        assert!(
            wait_for(Duration::from_secs(120), || events(&mut db) >= target),
            "stored {} of {target} before kill {k}",
            events(&mut db)
        );
        sinks[k].kill();
        let at_kill = events(&mut db);
        kills.push((ids[k], at_kill));
        checks.push(assert_retired_are_stored(
            &boards,
            &mut db,
            &format!("at the kill of {}", ids[k]),
        ));
        wait_for(Duration::from_secs(60), || {
            events(&mut db) >= at_kill + total as i64 / 20
        });
        sinks[k] = spawn(ids[k]);
        sinks[k].wait_subscribed();
        checks.push(assert_retired_are_stored(
            &boards,
            &mut db,
            &format!("at the restart of {}", ids[k]),
        ));
    }
    let sent = bulk.join().expect("the bulk publisher panicked");

    // The end: every agent row retired, every event stored; checked on the
    // way there too.
    let mut last_check = Instant::now();
    let settled = wait_for(Duration::from_secs(150), || {
        if last_check.elapsed() >= Duration::from_secs(2) {
            checks.push(assert_retired_are_stored(
                &boards,
                &mut db,
                "while settling",
            ));
            last_check = Instant::now();
        }
        boards
            .iter()
            .all(|b| spool::count_in_state(&b.db, "ACKED") == SHARED_AGENT_ROWS as i64)
            && events(&mut db) == total as i64
    });
    let logs: String = sinks
        .iter()
        .map(|s| tail(&s.log_text(), 5) + "\n")
        .collect();
    assert!(
        settled,
        "ACKED {:?} of {SHARED_AGENT_ROWS} each, events {} of {total}\n{logs}\n{}",
        boards
            .iter()
            .map(|b| spool::count_in_state(&b.db, "ACKED"))
            .collect::<Vec<_>>(),
        events(&mut db),
        boards
            .iter()
            .map(|b| b.proc.log_tail(10))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let elapsed = started.elapsed();
    let acked = assert_retired_are_stored(&boards, &mut db, "at the end");
    assert_eq!(acked, 2 * SHARED_AGENT_ROWS);

    let mut resent = Vec::new();
    for b in &mut boards {
        b.proc.terminate(Duration::from_secs(15));
        assert_no_lost_acks(&b.proc);
        resent.push((b.device.clone(), resent_logged(&b.dir)));
    }
    for s in &mut sinks {
        s.terminate();
    }
    // Duplicates: the store's count (every repeat, every sink: `deliveries`
    // of each event's `redeliveries` row), and the sinks' own counts (the
    // killed runs logged theirs every 10 s at most, so only the last runs'
    // final lines are whole).
    let dup_table = pg_count(
        &mut db,
        "SELECT coalesce(sum(deliveries), 0)::int8 FROM redeliveries",
    );
    let dup_agents = pg_count(
        &mut db,
        "SELECT coalesce(sum(deliveries), 0)::int8 FROM redeliveries
         WHERE device_id IN ('agent-a', 'agent-b')",
    );
    assert!(
        dup_table >= sent.duplicates as i64,
        "the store counted {dup_table} duplicates, the publisher sent {}",
        sent.duplicates
    );
    assert_eq!(pg_count(&mut db, "SELECT count(*) FROM mismatches"), 0);
    assert_eq!(pg_count(&mut db, "SELECT count(*) FROM unreadable"), 0);
    assert_eq!(pg_count(&mut db, "SELECT count(*) FROM forged"), 0);
    let sink_lines: Vec<String> = std::fs::read_dir(dir.path())
        .expect("sink logs")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rcpt-sink-"))
        .filter_map(|e| {
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some(format!(
                "{}: {}",
                e.file_name().to_string_lossy(),
                sink_line(&text).unwrap_or_else(|| "no summary yet".into())
            ))
        })
        .collect();
    println!(
        "shared: {total} events ({} from 2 agents in receipt mode, {} publishes from 10 \
         devices of the bulk publisher with {} duplicates sent) stored by 3 sinks on \
         $share/g, kills at {kills:?}; all stored and every agent row ACKED after {elapsed:.1?}; \
         rows sent again for a missing receipt {resent:?}; duplicates in the store {dup_table} \
         ({dup_agents} of the agents' events, {} beyond the publisher's own); retired rows \
         checked against the store {} times (ACKED then: {checks:?})",
        2 * SHARED_AGENT_ROWS,
        sent.publishes,
        sent.duplicates,
        dup_table - sent.duplicates as i64,
        checks.len() + 1,
    );
    for l in &sink_lines {
        println!("shared: {l}");
    }
}

/// A sink committing every delivery on its own (`--batch-max 1`: one
/// receipt per event, the most an agent can be sent) behind a mosquitto
/// with its stock limits (20 messages in flight per client, 1,000 queued):
/// 2,000 rows in receipt mode all end ACKED. Before the fix in
/// `mqtt::link` (acknowledgements that found the client's request channel
/// full were dropped) this stalled with rows sent again every 10 s and
/// never retired (1,951 and 1,981 of 2,000 ACKED after 120 s).
#[test]
fn a_sink_receipting_each_event_through_a_stock_mosquitto_gets_every_row_retired() {
    const ROWS: usize = 2_000;
    let broker = Broker::start_with_options("", false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptstock");
    let device = "it-board";
    let sink_db = dir.path().join("sink.db");
    let mut sink = SinkProc::spawn_sqlite_with(
        broker.port(),
        &format!("{base}/+/events/#"),
        &sink_db,
        &format!("stock-sink-{}", unique_suffix()),
        dir.path(),
        &["--batch-max", "1"],
    );
    sink.wait_subscribed();
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let db = agent_dir.join("spool.db");
    seed(&db, device, ROWS);
    let cfg = board_config(
        &agent_dir,
        &broker.url(),
        &format!("{base}/{device}"),
        device,
        RetireOn::Receipt,
    );
    let started = Instant::now();
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);
    let all = wait_for(Duration::from_secs(100), || {
        spool::count_in_state(&db, "ACKED") == ROWS as i64
    });
    let elapsed = started.elapsed();
    assert!(
        all,
        "{} of {ROWS} rows ACKED after {elapsed:.1?}, {} stored; receipts {}\n{}",
        spool::count_in_state(&db, "ACKED"),
        sqlite_stored(&sink_db, device).len(),
        receipts_state(&db),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    sink.terminate();
    assert_no_lost_acks(&agent);
    let c = check_rows(&spool_rows(&db), &sqlite_stored(&sink_db, device));
    assert!(
        c.retired_missing.is_empty() && c.other_bytes.is_empty(),
        "retired and not stored: {:?}; other bytes: {:?}",
        c.retired_missing,
        c.other_bytes
    );
    let r = receipts_state(&db);
    println!(
        "stock mosquitto, sink --batch-max 1: {ROWS} rows ACKED after {elapsed:.1?}; {} rows sent \
         again for a missing receipt; receipts received {}, ids matching no waiting row {}; \
         sink: {}; mosquitto began dropping {} times",
        resent_logged(&agent_dir),
        r["received"],
        r["unmatched_ids"],
        sink.log_text()
            .lines()
            .rev()
            .find(|l| l.contains(" receipts "))
            .and_then(|l| l.split("sink: ").nth(1))
            .unwrap_or("no summary"),
        broker
            .log_text()
            .matches("Outgoing messages are being dropped")
            .count()
    );
}

/// Issue 33 item 2: receipts are taken at the pace they can be matched,
/// never dropped for lack of room. Before, with `receipt_window = 100000`
/// and a backlog of about 30,000 rows, the sink stored every row in 4 s but
/// 61 receipts were dropped unread (a queue of 64), 30,447 rows were sent
/// again after the 300 s receipt timeout and the drain took 304 s. Here the
/// receipt timeout (300 s) is far beyond the drain: a row sent again would
/// mean a receipt lost on the board.
#[test]
fn a_large_receipt_window_drains_a_backlog_with_no_receipt_dropped_and_nothing_sent_again() {
    const ROWS: usize = 30_000;
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptwindow");
    let device = "it-board";
    let sink_db = dir.path().join("sink.db");
    let mut sink = SinkProc::spawn_sqlite(
        broker.port(),
        &format!("{base}/+/events/#"),
        &sink_db,
        &format!("window-sink-{}", unique_suffix()),
        dir.path(),
    );
    sink.wait_subscribed();
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let db = agent_dir.join("spool.db");
    seed(&db, device, ROWS);
    let cfg = board_config(
        &agent_dir,
        &broker.url(),
        &format!("{base}/{device}"),
        device,
        RetireOn::Receipt,
    );
    edit_config(&cfg, |t| {
        t.replacen(
            &format!("receipt_timeout_secs = {RECEIPT_TIMEOUT_SECS}\n"),
            "receipt_timeout_secs = 300\nreceipt_window = 100000\n",
            1,
        )
    });
    let started = Instant::now();
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);
    let all = poll(Duration::from_secs(240), Duration::from_millis(500), || {
        spool::count_in_state(&db, "ACKED") == ROWS as i64
    });
    let elapsed = started.elapsed();
    let stored_at = sqlite_stored(&sink_db, device).len();
    assert!(
        all,
        "{} of {ROWS} rows ACKED after {elapsed:.1?} ({stored_at} stored); receipts {}\n{}",
        spool::count_in_state(&db, "ACKED"),
        receipts_state(&db),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    sink.terminate();
    let r = receipts_state(&db);
    println!(
        "receipt_window 100000, {ROWS}-row backlog: all ACKED after {elapsed:.1?}; receipts {} \
         received, {} dropped, {} rows sent again",
        r["received"], r["dropped"], r["resent"]
    );
    assert_eq!(r["dropped"].as_u64(), Some(0), "{r}");
    assert_eq!(r["resent"].as_u64(), Some(0), "{r}");
    assert_eq!(
        resent_logged(&agent_dir),
        0,
        "rows sent again for a missing receipt"
    );
    assert!(
        elapsed < Duration::from_secs(240),
        "the drain waited for receipt timeouts"
    );
}

/// Issue 33 item 2, the sink's half: a backlog the broker holds for a sink
/// (docs/fleet.md's layout, 1,000 deliveries in flight) gets a receipt for
/// every event, none dropped. Before the fix in `sink::consume` (receipts
/// waited until no PUBACK at all was queued, and at most 64 were out), 20,000
/// events with `--batch-max 10` were all stored but 953 receipts were
/// dropped and 9,530 events never receipted: a board would have sent them
/// again after its receipt timeout (the wire bench's 302 s drain of 100,000
/// rows, `duplicates 5500 receipts_dropped 11`).
#[test]
fn a_sink_draining_a_backlog_receipts_every_event_and_drops_no_receipt() {
    use crate::support::{publisher, subscriber::Subscriber};
    const EVENTS: usize = 20_000;
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptbacklog");
    let sink_db = dir.path().join("sink.db");
    let id = format!("backlog-sink-{}", unique_suffix());
    let filter = format!("{base}/+/events/#");
    // Small batches: many receipts per round trip of the broker's PUBACK.
    let spawn = || {
        SinkProc::spawn_sqlite_with(
            broker.port(),
            &filter,
            &sink_db,
            &id,
            dir.path(),
            &["--batch-max", "10"],
        )
    };
    // The session and its subscription; the backlog queues while it is away.
    let mut sink = spawn();
    sink.wait_subscribed();
    sink.terminate();
    let receipts = Subscriber::start(broker.port(), &format!("{base}/+/receipts"));
    let plan = publisher::Plan {
        events: EVENTS,
        devices: 1,
        dup_every: 0,
        conflicts: 0,
    };
    publisher::publish(broker.port(), &base, plan, Duration::from_secs(300));
    let started = Instant::now();
    let mut sink = spawn();
    let key = crate::support::keys::fleet_key().key.public();
    let receipted = || {
        let mut ids = std::collections::HashSet::new();
        for d in receipts.deliveries() {
            let r = edgespool::event::receipts::parse(&d.payload).expect("a receipt");
            assert_eq!(r.check("dev-00", &[key]), Ok(()), "{}", d.topic);
            ids.extend(r.stored.into_iter().flat_map(|(_, e)| e).map(|(i, _)| i));
        }
        ids.len()
    };
    let stored = poll(Duration::from_secs(120), Duration::from_millis(500), || {
        sqlite_stored(&sink_db, "dev-00").len() == EVENTS
    });
    let stored_in = started.elapsed();
    assert!(stored, "{}", tail(&sink.log_text(), 20));
    // Every receipt is due once the last batch has committed.
    let all = poll(Duration::from_secs(30), Duration::from_millis(500), || {
        receipted() == EVENTS
    });
    sink.terminate();
    let line = sink_line(&sink.log_text()).unwrap_or_default();
    println!(
        "{EVENTS} events queued for an offline sink (--batch-max 10): stored in {stored_in:.1?}, \
         {} receipted; {line}",
        receipted()
    );
    assert!(all, "{} of {EVENTS} events receipted; {line}", receipted());
    assert!(line.contains(" receipts_dropped 0 "), "{line}");
}

/// Issue 33 item 2: a board that retires on PUBACKs again, with a
/// persistent session kept from when it retired on receipts, leaves the
/// receipts subscription once a receipt shows the session still has it, so
/// receipts stop queuing for it at the broker.
#[test]
fn a_board_back_in_puback_mode_leaves_its_receipts_subscription() {
    let broker = Broker::start_with_options("", true);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("rcptleave");
    let device = "it-board";
    let db = dir.path().join("spool.db");
    seed(&db, device, 10);
    let prefix = format!("{base}/{device}");
    let cfg = board_config(
        dir.path(),
        &broker.url(),
        &prefix,
        device,
        RetireOn::Receipt,
    );
    edit_config(&cfg, |t| {
        t.replacen(
            "[mqtt]\n",
            "[mqtt]\nclean_session = false\nsession_expiry_secs = 3600\n",
            1,
        )
    });
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    // Commands, then receipts.
    assert!(
        wait_for(Duration::from_secs(30), || broker
            .log_text()
            .matches("Sending SUBACK")
            .count()
            >= 2),
        "{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
    // A receipt the session queues while the board is away.
    let stale = crate::support::keys::signed_receipts(
        device,
        &[("load", "00000000-0000-4000-8000-000000000001", b"x")],
    );
    crate::commands::publish(
        broker.port(),
        &format!("{prefix}/receipts"),
        &stale[0],
        false,
    );
    edit_config(&cfg, |t| {
        t.replacen("retire_on = \"receipt\"", "retire_on = \"puback\"", 1)
    });
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(30), "session_present=true"),
        "{}",
        agent.log_tail(20)
    );
    assert!(
        broker.wait_log(Duration::from_secs(30), "Received UNSUBSCRIBE"),
        "the board kept its receipts subscription:\n{}\n{}",
        tail(&broker.log_text(), 20),
        agent.log_tail(20)
    );
    assert!(agent.logged("INFO", "mqtt", "leaving "));
    agent.terminate(Duration::from_secs(15));
    // A board that never retired on receipts sends no UNSUBSCRIBE at all
    // (mosquitto answers one for a subscription it lacks with an error
    // code, which the MQTT client logs as a WARN).
    assert_eq!(broker.log_text().matches("Received UNSUBSCRIBE").count(), 1);
}
