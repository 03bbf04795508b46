//! The sink takes a device's identity from its topic, keeps what it sets
//! aside within bounds, tells each device what its database holds
//! (receipts), and migrates the files and databases of older sinks.
//!
//! - a publisher that a mosquitto ACL (`pattern write edgespool/%u/#`) keeps
//!   to its own prefix cannot store events as another device: on the other
//!   device's topic the broker drops them, on its own topic an envelope
//!   claiming the other device is set aside as forged; under the ACL
//!   docs/fleet.md gives for a deeper filter (`pattern write fleet/+/%u/#`,
//!   the sink on `fleet/+/+/events/#`) the broker drops them at level 3;
//! - receipts (`<prefix>/receipts`, read back with `receipts::parse`) name
//!   exactly the events the store holds with the bytes delivered, a
//!   duplicate delivery again, never a mismatch, a forged or an unreadable
//!   one; with SQLite and with PostgreSQL;
//! - side tables stay within their bounds under 200 junk deliveries;
//! - a database of the old schema (event id alone as key) migrates.

use crate::support::broker::Broker;
use crate::support::sink::{self, SinkProc, BROKER_EXTRA};
use crate::support::{tail, unique_suffix, wait_for};
use edgespool::event::envelope::{encode, Envelope, EventId, Format};
use edgespool::event::reading::FieldValue;
use edgespool::sink::batch::{Fate, Item};
use edgespool::sink::{SideBounds, SinkDb, Store};
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Event `n` of `device`, as the agent stores it (`variant` 0), or with
/// other bytes under the same id. The id depends on `n` only: two devices
/// may well send the same one.
pub(crate) fn envelope(device: &str, n: u32, variant: u32) -> (String, Vec<u8>) {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(&0x1d00_0000_u32.to_be_bytes());
    id[12..].copy_from_slice(&n.to_be_bytes());
    let fields = vec![
        ("load1".to_owned(), FieldValue::Num(f64::from(n) / 4.0)),
        ("variant".to_owned(), FieldValue::Num(f64::from(variant))),
    ];
    let env = Envelope {
        event_id: EventId(id),
        device_id: device,
        stream: "load",
        seq: u64::from(n),
        ts_ms: 1_800_000_000_000 + i64::from(n),
        clock_trusted: true,
        mono: None,
        fields: &fields,
    };
    (
        EventId(id).hyphenated(),
        encode(Format::Json, &env).expect("encode"),
    )
}

fn json_batch(events: &[Vec<u8>]) -> Vec<u8> {
    let mut out = br#"{"batch":["#.to_vec();
    out.extend_from_slice(&events.join(&b','));
    out.extend_from_slice(b"]}");
    out
}

/// An MQTT client, with a login or anonymous, that subscribes `filters`
/// and records what it gets, and publishes at QoS 1.
struct Peer {
    id: String,
    client: Client,
    state: Arc<PeerState>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct PeerState {
    got: Mutex<Vec<(String, Vec<u8>)>>,
    acked: AtomicUsize,
    ready: AtomicBool,
    stop: AtomicBool,
}

impl Peer {
    fn start(port: u16, login: Option<(&str, &str)>, filters: &[&str]) -> Peer {
        let id = format!("peer-{}-{}", login.map_or("anon", |l| l.0), unique_suffix());
        let mut o = MqttOptions::new(id.clone(), "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(5));
        o.set_max_packet_size(4 << 20, 4 << 20);
        if let Some((user, password)) = login {
            o.set_credentials(user, password);
        }
        let (client, mut conn) = Client::new(o, 256);
        let state = Arc::new(PeerState::default());
        let (c, st) = (client.clone(), state.clone());
        let filters: Vec<String> = filters.iter().map(|f| (*f).to_owned()).collect();
        let thread = std::thread::spawn(move || {
            while !st.stop.load(Ordering::SeqCst) {
                match conn.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(Event::Incoming(Incoming::ConnAck(_)))) if filters.is_empty() => {
                        st.ready.store(true, Ordering::SeqCst)
                    }
                    Ok(Ok(Event::Incoming(Incoming::ConnAck(_)))) => {
                        let subs = filters
                            .iter()
                            .map(|f| rumqttc::SubscribeFilter::new(f.clone(), QoS::AtLeastOnce));
                        let _ = c.try_subscribe_many(subs);
                    }
                    Ok(Ok(Event::Incoming(Incoming::SubAck(_)))) => {
                        st.ready.store(true, Ordering::SeqCst)
                    }
                    Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => st
                        .got
                        .lock()
                        .expect("peer lock")
                        .push((p.topic.clone(), p.payload.to_vec())),
                    Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => {
                        st.acked.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
                    Ok(Err(_)) => std::thread::sleep(Duration::from_millis(100)),
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
        });
        let peer = Peer {
            id,
            client,
            state,
            thread: Some(thread),
        };
        assert!(
            wait_for(Duration::from_secs(10), || peer
                .state
                .ready
                .load(Ordering::SeqCst)),
            "peer {} did not connect and subscribe",
            peer.id
        );
        peer
    }

    fn publish(&self, topic: &str, payload: &[u8]) {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload.to_vec())
            .expect("queue publish");
    }

    /// Wait for `n` PUBACKs in all.
    fn wait_acked(&self, n: usize) {
        assert!(
            wait_for(Duration::from_secs(30), || self
                .state
                .acked
                .load(Ordering::SeqCst)
                >= n),
            "{}: {} of {n} PUBACKs",
            self.id,
            self.state.acked.load(Ordering::SeqCst)
        );
    }

    fn got(&self) -> Vec<(String, Vec<u8>)> {
        self.state.got.lock().expect("peer lock").clone()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = self.client.try_disconnect();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every receipt `peer` got (each must parse), from the `from`-th message
/// on: the topic and the `(stream, event id)` pairs it names.
fn receipts(peer: &Peer, from: usize) -> Vec<(String, Vec<(String, String)>)> {
    peer.got()
        .into_iter()
        .skip(from)
        .map(|(topic, payload)| {
            let r = edgespool::event::receipts::parse(&payload).unwrap_or_else(|e| {
                panic!(
                    "receipt on {topic} does not parse ({e}): {}",
                    String::from_utf8_lossy(&payload)
                )
            });
            let ids = r
                .stored
                .into_iter()
                .flat_map(|(s, ids)| {
                    ids.into_iter()
                        .map(move |(id, _)| (s.clone(), id.hyphenated()))
                })
                .collect();
            (topic, ids)
        })
        .collect()
}

/// The event ids named by `peer`'s receipts on `topic` (from the `from`-th
/// message on), all of stream `load`.
fn receipted(peer: &Peer, topic: &str, from: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (t, ids) in receipts(peer, from) {
        assert_eq!(t, topic, "a receipt on another topic");
        for (stream, id) in ids {
            assert_eq!(stream, "load");
            out.insert(id);
        }
    }
    out
}

/// The sink's store, as the test reads it.
enum Db {
    Sqlite(std::path::PathBuf),
    #[cfg(feature = "pg-sink")]
    Postgres(crate::support::postgres::Postgres),
}

impl Db {
    /// Event ids stored for `device`.
    fn ids(&self, device: &str) -> BTreeSet<String> {
        self.strings(
            "SELECT event_id FROM received WHERE device_id = ?1",
            "SELECT event_id::text FROM events WHERE device_id = $1",
            device,
        )
    }

    /// `count(*)` of a table (-1 while it cannot be read).
    fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        match self {
            Db::Sqlite(p) => rusqlite::Connection::open(p)
                .and_then(|c| c.query_row(&sql, [], |r| r.get(0)))
                .unwrap_or(-1),
            #[cfg(feature = "pg-sink")]
            Db::Postgres(pg) => pg
                .client()
                .query_one(sql.as_str(), &[])
                .map(|r| r.get(0))
                .unwrap_or(-1),
        }
    }

    fn strings(&self, sqlite: &str, pg: &str, arg: &str) -> BTreeSet<String> {
        match self {
            Db::Sqlite(p) => {
                let Ok(c) = rusqlite::Connection::open(p) else {
                    return BTreeSet::new();
                };
                let Ok(mut st) = c.prepare(sqlite) else {
                    return BTreeSet::new();
                };
                st.query_map([arg], |r| r.get(0))
                    .and_then(|rows| rows.collect())
                    .unwrap_or_default()
            }
            #[cfg(feature = "pg-sink")]
            Db::Postgres(p) => p
                .client()
                .query(pg, &[&arg])
                .map(|rows| rows.iter().map(|r| r.get(0)).collect())
                .unwrap_or_default(),
        }
    }

    fn spawn_sink(&self, port: u16, filter: &str, id: &str, dir: &Path) -> SinkProc {
        match self {
            Db::Sqlite(p) => SinkProc::spawn_sqlite(port, filter, p, id, dir),
            #[cfg(feature = "pg-sink")]
            Db::Postgres(pg) => SinkProc::spawn(port, filter, &pg.conninfo(), id, "fleet", dir),
        }
    }
}

/// The numbers of the sink's last `sink: first ...` summary that names
/// receipts (the sink's own line; the command's line after it has fewer
/// counters).
fn summary(log: &str, word: &str) -> u64 {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("sink: first ") && l.contains(" receipts "))
        .unwrap_or_else(|| panic!("no summary line:\n{}", tail(log, 20)));
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .find(|w| w[0] == word)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or_else(|| panic!("no {word} in {line:?}"))
}

fn receipts_name_exactly_what_the_store_holds(db: Db) {
    let broker = Broker::start_with_config(BROKER_EXTRA);
    let dir = tempfile::tempdir().expect("tempdir");
    let filter = "edgespool/+/events/#";
    let mut sink = db.spawn_sink(broker.port(), filter, "receipt-sink", dir.path());
    sink.wait_subscribed();
    let gw1 = Peer::start(broker.port(), None, &["edgespool/gw1/receipts"]);
    let evil = Peer::start(broker.port(), None, &["edgespool/evil/receipts"]);

    // Events 1..=5 alone, 6..=8 in a batch, one junk delivery; and an
    // envelope claiming to be gw1's event 9 on evil's own topic.
    for n in 1..=5 {
        gw1.publish("edgespool/gw1/events/load", &envelope("gw1", n, 0).1);
    }
    let batch: Vec<Vec<u8>> = (6..=8).map(|n| envelope("gw1", n, 0).1).collect();
    gw1.publish("edgespool/gw1/batches/load", &json_batch(&batch));
    gw1.publish("edgespool/gw1/events/load", b"not an envelope");
    evil.publish("edgespool/evil/events/load", &envelope("gw1", 9, 0).1);
    gw1.wait_acked(7);
    evil.wait_acked(1);

    let want: BTreeSet<String> = (1..=8).map(|n| envelope("gw1", n, 0).0).collect();
    let topic = "edgespool/gw1/receipts";
    let all = wait_for(Duration::from_secs(30), || {
        db.ids("gw1") == want && receipted(&gw1, topic, 0) == want && db.count("forged") == 1
    });
    assert!(
        all,
        "stored {:?}, receipted {:?}, forged {}\n{}",
        db.ids("gw1"),
        receipted(&gw1, topic, 0),
        db.count("forged"),
        tail(&sink.log_text(), 20)
    );
    assert!(db.ids("evil").is_empty());

    // Again: event 3 with its bytes (a duplicate: receipted again), event
    // 4 with other bytes (a mismatch: not receipted).
    let before = gw1.got().len();
    gw1.publish("edgespool/gw1/events/load", &envelope("gw1", 3, 0).1);
    gw1.publish("edgespool/gw1/events/load", &envelope("gw1", 4, 1).1);
    gw1.wait_acked(9);
    let again = BTreeSet::from([envelope("gw1", 3, 0).0]);
    assert!(
        wait_for(Duration::from_secs(30), || db.count("mismatches") == 1
            && receipted(&gw1, topic, before) == again),
        "after the repeat: receipted {:?}, mismatches {}\n{}",
        receipted(&gw1, topic, before),
        db.count("mismatches"),
        tail(&sink.log_text(), 20)
    );
    // Nothing more comes, and evil was told nothing.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(receipted(&gw1, topic, before), again);
    assert!(evil.got().is_empty(), "{:?}", receipts(&evil, 0));

    sink.terminate();
    let log = sink.log_text();
    let n = |w: &str| summary(&log, w);
    assert_eq!(
        (n("first"), n("duplicates"), n("mismatches")),
        (8, 1, 1),
        "{}",
        tail(&log, 10)
    );
    assert_eq!((n("unreadable"), n("forged")), (1, 1), "{}", tail(&log, 10));
    assert_eq!(
        n("receipts") as usize,
        gw1.got().len(),
        "every receipt the sink published reached gw1, and only those"
    );
    println!(
        "receipts: {} published for {} events and one duplicate",
        gw1.got().len(),
        want.len()
    );
}

#[test]
fn receipts_from_sqlite_name_exactly_the_stored_events_and_a_duplicate() {
    let dir = tempfile::tempdir().expect("tempdir");
    receipts_name_exactly_what_the_store_holds(Db::Sqlite(dir.path().join("sink.db")));
}

#[cfg(feature = "pg-sink")]
#[test]
fn receipts_from_postgres_name_exactly_the_stored_events_and_a_duplicate() {
    let pg = crate::support::postgres::Postgres::start(&[("fsync", "off")]);
    receipts_name_exactly_what_the_store_holds(Db::Postgres(pg));
}

/// mosquitto in docs/fleet.md's fleet layout (its ACL read from that page):
/// each device writes only under `edgespool/<its name>/` and reads its own
/// receipts; the sinks' user reads events and batches and writes receipts;
/// no anonymous client.
fn acl_broker(dir: &Path) -> Broker {
    crate::support::fleet::broker(dir, BROKER_EXTRA)
}

/// docs/fleet.md's ACL for a deeper filter (read from the page), on
/// mosquitto with the layout's settings: a sink on `fleet/+/+/events/#`
/// reads the device at level 3 and says so at start; evil's events claiming
/// gw1 on gw1's level are denied by the broker whatever the site level
/// (`siteA`, or `evil` itself, where `pattern write fleet/%u/#` would have
/// let them through), so none is stored; gw1's own event is stored and
/// receipted on its prefix.
#[test]
fn the_deeper_filters_acl_binds_the_level_the_sink_reads_as_the_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let acl = crate::support::fleet::deeper_acl();
    let broker = crate::support::fleet::broker_with_acl(dir.path(), BROKER_EXTRA, &acl);
    let login = crate::support::fleet::sink_login(dir.path());
    let login: Vec<&str> = login.iter().map(String::as_str).collect();
    let db = dir.path().join("sink.db");
    let filter = "fleet/+/+/events/#";
    let sink = SinkProc::spawn_sqlite_with(broker.port(), filter, &db, "sink", dir.path(), &login);
    sink.wait_subscribed();
    let log = sink.log_text();
    assert!(
        log.contains("fleet/+/<device>/events/<stream> (device = level 3 of fleet/+/+/events/#)"),
        "{log}"
    );
    // Each on a connection of its own: mosquitto closes the connection of a
    // denied QoS 1 PUBLISH, and what was queued behind it is lost with it.
    let denied = "Denied PUBLISH from evil";
    for (n, topic) in [
        (1, "fleet/siteA/gw1/events/load"),
        (2, "fleet/evil/gw1/events/load"),
    ] {
        let intruder = Peer::start(broker.port(), Some(("evil", "evil-secret")), &[]);
        intruder.publish(topic, &envelope("gw1", 20 + n as u32, 1).1);
        assert!(
            wait_for(Duration::from_secs(10), || broker
                .log_text()
                .matches(denied)
                .count()
                >= n),
            "the broker did not deny {topic}:\n{}",
            tail(&broker.log_text(), 20)
        );
    }
    let gw1 = Peer::start(
        broker.port(),
        Some(("gw1", "gw1-secret")),
        &["fleet/siteA/gw1/receipts"],
    );
    let (id, real) = envelope("gw1", 20, 0);
    gw1.publish("fleet/siteA/gw1/events/load", &real);
    gw1.wait_acked(1);
    assert!(
        wait_for(Duration::from_secs(30), || !gw1.got().is_empty()),
        "no receipt on fleet/siteA/gw1/receipts\n{}",
        tail(&sink.log_text(), 20)
    );
    let stored = sink::sqlite_received(&db);
    assert_eq!(
        stored.keys().collect::<Vec<_>>(),
        vec![&id],
        "{}",
        tail(&sink.log_text(), 20)
    );
    assert_eq!(stored[&id].0, real);
}

#[cfg(feature = "pg-sink")]
#[test]
fn a_device_kept_to_its_prefix_by_the_acl_cannot_store_events_as_another() {
    use crate::support::postgres::Postgres;
    let pg = Postgres::start(&[("fsync", "off")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = acl_broker(dir.path());
    let login = crate::support::fleet::sink_login(dir.path());
    let login: Vec<&str> = login.iter().map(String::as_str).collect();
    let mut sink = SinkProc::spawn_with(
        broker.port(),
        "edgespool/+/events/#",
        &pg.conninfo(),
        "acl-sink",
        "fleet",
        dir.path(),
        &login,
    );
    sink.wait_subscribed();
    let gw1 = Peer::start(
        broker.port(),
        Some(("gw1", "gw1-secret")),
        &["edgespool/gw1/receipts"],
    );

    let (x, real) = envelope("gw1", 7, 0);
    // On gw1's topic: denied by the broker. mosquitto 2.0.11 with an
    // `acl_file` answers a denied QoS 1 PUBLISH of a 3.1.1 client with a
    // PUBACK (reason code 135 in it) and then closes the connection (its
    // log: "Bad socket read/write"; rumqttc reads the end of the stream),
    // and what the client had queued behind it is lost with the
    // connection: so on a connection of its own, before evil's other one
    // (the layout's client id is the user name: two connections as evil
    // would take each other's session).
    let intruder = Peer::start(broker.port(), Some(("evil", "evil-secret")), &[]);
    intruder.publish("edgespool/gw1/events/load", &envelope("gw1", 7, 1).1);
    let denied = "Denied PUBLISH from evil";
    assert!(
        broker.wait_log(Duration::from_secs(10), denied),
        "the broker did not deny the publish:\n{}",
        tail(&broker.log_text(), 20)
    );
    drop(intruder);
    let evil = Peer::start(
        broker.port(),
        Some(("evil", "evil-secret")),
        &["edgespool/gw1/receipts", "edgespool/evil/receipts"],
    );
    // On its own topic, claiming to be gw1: set aside as forged.
    evil.publish("edgespool/evil/events/load", &envelope("gw1", 7, 2).1);
    evil.publish(
        "edgespool/evil/batches/load",
        &json_batch(&[envelope("gw1", 8, 2).1]),
    );
    // Inside its own prefix, with a topic whose last `events` follows
    // "gw1" (the ACL allows edgespool/evil/#): not of the shape the filter
    // fixes, set aside before it is read.
    evil.publish(
        "edgespool/evil/events/gw1/events/load",
        &envelope("gw1", 7, 3).1,
    );
    evil.publish(
        "edgespool/evil/batches/gw1/events/load",
        &envelope("gw1", 7, 4).1,
    );
    // Its own event with the same id: evil's, stored, no conflict with gw1's.
    let (_, own) = envelope("evil", 7, 0);
    evil.publish("edgespool/evil/events/load", &own);
    evil.wait_acked(5);
    gw1.publish("edgespool/gw1/events/load", &real);
    gw1.wait_acked(1);

    let mut db = pg.client();
    let count = |db: &mut postgres::Client, sql: &str| -> i64 {
        db.query_one(sql, &[]).map(|r| r.get(0)).unwrap_or(-1)
    };
    let settled = wait_for(Duration::from_secs(30), || {
        count(&mut db, "SELECT count(*) FROM events") == 2
            && count(&mut db, "SELECT count(*) FROM forged") == 4
    });
    assert!(
        settled,
        "events {}, forged {}\n{}",
        count(&mut db, "SELECT count(*) FROM events"),
        count(&mut db, "SELECT count(*) FROM forged"),
        tail(&sink.log_text(), 20)
    );
    let rows = db
        .query(
            "SELECT device_id, event_id::text, payload, topic FROM events ORDER BY device_id",
            &[],
        )
        .expect("events");
    let got: Vec<(String, String, Vec<u8>, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "evil".to_owned(),
                x.clone(),
                own.clone(),
                "edgespool/evil/events/load".to_owned()
            ),
            (
                "gw1".to_owned(),
                x.clone(),
                real.clone(),
                "edgespool/gw1/events/load".to_owned()
            ),
        ],
        "gw1's real reading is stored for gw1, evil's for evil"
    );
    assert_eq!(count(&mut db, "SELECT count(*) FROM mismatches"), 0);
    for r in db
        .query("SELECT topic, reason FROM forged", &[])
        .expect("forged")
    {
        let (topic, reason): (String, String) = (r.get(0), r.get(1));
        assert!(topic.starts_with("edgespool/evil/"), "{topic}");
        let nested = topic.contains("/gw1/");
        assert!(
            if nested {
                reason.contains("is not of the shape this sink reads")
            } else {
                reason.contains("\"gw1\"") && reason.contains("\"evil\"")
            },
            "{topic}: {reason}"
        );
    }

    // Receipts: gw1 hears of its event, evil of its own, and nothing of
    // gw1's (the ACL lets it subscribe, and filters what it reads).
    let gw1_topic = "edgespool/gw1/receipts";
    let evil_topic = "edgespool/evil/receipts";
    assert!(
        wait_for(Duration::from_secs(10), || receipted(&gw1, gw1_topic, 0)
            == BTreeSet::from([x.clone()])
            && !evil.got().is_empty()),
        "gw1 {:?}, evil {:?}",
        receipts(&gw1, 0),
        receipts(&evil, 0)
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(receipted(&evil, evil_topic, 0), BTreeSet::from([x.clone()]));

    let report = sink::stats_json(&["--postgres", &pg.conninfo()]);
    assert_eq!(report["forged"], 4, "{report}");
    assert_eq!(report["events"], 2, "{report}");
    sink.terminate();
    assert_eq!(summary(&sink.log_text(), "forged"), 4);
}

/// 200 junk deliveries of 256 KiB and 100 forged ones against small bounds
/// (50 rows, 4 KiB per payload): the newest 50 of each are kept, cut, the
/// rest dropped and counted; `sink --stats` says so.
#[cfg(feature = "pg-sink")]
#[test]
fn postgres_side_tables_keep_the_newest_within_their_bounds() {
    use crate::support::postgres::Postgres;
    use edgespool::sink::postgres::PgStore;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut store = PgStore::connect(&pg.conninfo(), "bounds", &Default::default())
        .expect("connect and migrate");
    let bounds = SideBounds {
        rows: 50,
        payload_bytes: 4096,
        table_bytes: 1 << 20,
        ..SideBounds::default()
    };
    store.set_side_bounds(bounds);
    let pad = vec![b'j'; 256 << 10];
    let mut dropped = 0;
    for chunk in 0..10 {
        let items: Vec<Item> = (0..20)
            .map(|k| {
                let mut p = format!("junk-{:03}-", chunk * 20 + k).into_bytes();
                p.extend_from_slice(&pad);
                Item::new("edgespool/gw1/events/load", &p)
            })
            .chain((0..10).map(|k| {
                let (_, e) = envelope("gw1", chunk * 10 + k, 0);
                Item::new("edgespool/evil/events/load", &e)
            }))
            .collect();
        let s = store.commit(&items, 1).expect("store");
        assert_eq!((s.stats.unreadable, s.stats.forged), (20, 10));
        assert!(s.fates.iter().all(|f| !f.held()));
        dropped += s.stats.side_dropped;
    }
    assert_eq!(dropped, 150 + 50);
    let mut db = pg.client();
    let kept: Vec<(String, i32, i64)> = db
        .query(
            "SELECT convert_from(substring(payload FROM 1 FOR 8), 'UTF8'),
                    octet_length(payload), payload_bytes
             FROM unreadable ORDER BY id",
            &[],
        )
        .expect("unreadable")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(kept.len(), 50);
    assert_eq!(kept[0].0, "junk-150", "the oldest went first");
    assert!(kept
        .iter()
        .all(|(_, n, whole)| *n == 4096 && *whole == (256 << 10) + 9));
    let one =
        |db: &mut postgres::Client, sql: &str| -> i64 { db.query_one(sql, &[]).expect(sql).get(0) };
    assert_eq!(one(&mut db, "SELECT count(*) FROM forged"), 50);
    assert_eq!(
        one(&mut db, "SELECT sum(dropped)::int8 FROM side_drops"),
        200
    );
    let report = sink::stats_json(&["--postgres", &pg.conninfo()]);
    assert_eq!(
        (
            &report["unreadable"],
            &report["forged"],
            &report["side_dropped"]
        ),
        (&200.into(), &100.into(), &200.into()),
        "{report}"
    );
    let text = sink::stats(&["--postgres", &pg.conninfo()]);
    assert!(text.contains("side tables: 200 rows dropped"), "{text}");
}

/// Bounds per device, then per table, in PostgreSQL: one device's 20 forged
/// envelopes leave a and b theirs (the junk keeps its own 4); with six
/// more devices the table's 10 rows go evenly, a and b keeping theirs.
#[cfg(feature = "pg-sink")]
#[test]
fn postgres_side_tables_bound_each_device_and_take_from_the_largest() {
    use crate::support::postgres::Postgres;
    use edgespool::sink::postgres::PgStore;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut store =
        PgStore::connect(&pg.conninfo(), "fair", &Default::default()).expect("connect and migrate");
    store.set_side_bounds(SideBounds {
        rows: 10,
        payload_bytes: 1024,
        table_bytes: 1 << 20,
        device_rows: 4,
        device_bytes: 1 << 20,
    });
    let forged = |dev: &str, n: u32| {
        Item::new(
            &format!("edgespool/{dev}/events/load"),
            &envelope("gw1", n, 0).1,
        )
    };
    let mut items = vec![forged("a", 0), forged("b", 1)];
    items.extend((0..20).map(|n| forged("junk", 100 + n)));
    store.commit(&items, 1).expect("store");
    let mut db = pg.client();
    let per_device = |db: &mut postgres::Client| -> Vec<(String, i64)> {
        db.query(
            "SELECT device_id, count(*) FROM forged GROUP BY device_id ORDER BY device_id",
            &[],
        )
        .expect("forged")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    assert_eq!(
        per_device(&mut db),
        vec![("a".into(), 1), ("b".into(), 1), ("junk".into(), 4)]
    );
    let more: Vec<Item> = (0..6)
        .flat_map(|d| (0..2).map(move |n| (d, n)))
        .map(|(d, n)| forged(&format!("d{d}"), 200 + n))
        .collect();
    store.commit(&more, 2).expect("store");
    let v = per_device(&mut db);
    assert_eq!(v.iter().map(|(_, n)| n).sum::<i64>(), 10, "{v:?}");
    assert_eq!(
        (&v[0], &v[1]),
        (&("a".into(), 1), &("b".into(), 1)),
        "{v:?}"
    );
    assert!(v.iter().all(|(_, n)| (1..=2).contains(n)), "{v:?}");
}

/// The measurement behind the bound, through the real sink with its
/// default bounds: 20 junk deliveries of 1 MiB (incompressible) grew
/// `unreadable` by 21.8 MB; now each keeps its first 64 KiB.
#[cfg(feature = "pg-sink")]
#[test]
fn twenty_mib_of_junk_through_the_sink_keeps_64_kib_each() {
    use crate::support::postgres::Postgres;
    let pg = Postgres::start(&[("fsync", "off")]);
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sink = SinkProc::spawn(
        broker.port(),
        "edgespool/+/events/#",
        &pg.conninfo(),
        "junk-sink",
        "fleet",
        dir.path(),
    );
    sink.wait_subscribed();
    let mut db = pg.client();
    let size = |db: &mut postgres::Client| -> i64 {
        db.query_one("SELECT pg_total_relation_size('unreadable')", &[])
            .map(|r| r.get(0))
            .unwrap_or(-1)
    };
    let before = size(&mut db);
    let junk = Peer::start(broker.port(), None, &[]);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20 {
        let p: Vec<u8> = (0..1 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        junk.publish("edgespool/junk/events/load", &p);
    }
    junk.wait_acked(20);
    let count = |db: &mut postgres::Client| -> i64 {
        db.query_one("SELECT count(*) FROM unreadable", &[])
            .map(|r| r.get(0))
            .unwrap_or(-1)
    };
    assert!(
        wait_for(Duration::from_secs(60), || count(&mut db) == 20),
        "{} of 20 kept\n{}",
        count(&mut db),
        tail(&sink.log_text(), 20)
    );
    let grown = size(&mut db) - before;
    println!("unreadable grew by {grown} bytes for 20 x 1 MiB of junk");
    assert!(grown < 3 << 20, "unreadable grew by {grown} bytes");
    sink.terminate();
}

/// The SQLite store under 200 forged deliveries against small bounds.
#[test]
fn sqlite_side_tables_keep_the_newest_within_their_bounds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sink.db");
    let mut db = SinkDb::open(&path).expect("open");
    db.set_side_bounds(SideBounds {
        rows: 50,
        payload_bytes: 4096,
        table_bytes: 1 << 20,
        ..SideBounds::default()
    });
    let mut dropped = 0;
    for chunk in 0..10 {
        let items: Vec<Item> = (0..20)
            .map(|k| {
                Item::new(
                    "edgespool/evil/events/load",
                    &envelope("gw1", chunk * 20 + k, 0).1,
                )
            })
            .collect();
        let s = db.commit(&items, 1).expect("store");
        assert_eq!(s.stats.forged, 20);
        assert!(s.fates.iter().all(|f| *f == Fate::Forged));
        dropped += s.stats.side_dropped;
    }
    assert_eq!(dropped, 150);
    let c = rusqlite::Connection::open(&path).expect("open");
    let n: i64 = c
        .query_row("SELECT count(*) FROM forged", [], |r| r.get(0))
        .expect("count");
    assert_eq!(n, 50);
    let oldest: String = c
        .query_row(
            "SELECT CAST(payload AS TEXT) FROM forged ORDER BY rowid LIMIT 1",
            [],
            |r| r.get(0),
        )
        .expect("oldest");
    assert!(oldest.contains(&envelope("gw1", 150, 0).0), "{oldest}");
    let r = edgespool::sink::stats::from_sqlite(&path, 0).expect("stats");
    assert_eq!((r.forged, r.side_dropped, r.events), (200, 150, 0));
}

/// What version 1 of the PostgreSQL schema created (a frozen copy: the
/// database an older sink left).
#[cfg(feature = "pg-sink")]
const PG_V1: &str = "
CREATE TABLE schema_version (version integer PRIMARY KEY,
                             applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO schema_version (version) VALUES (1);
CREATE TABLE events (
    event_id uuid PRIMARY KEY, device_id text NOT NULL, stream text NOT NULL,
    seq bigint NOT NULL, ts_ms bigint NOT NULL, clock_trusted boolean NOT NULL,
    received_ms bigint NOT NULL, fields jsonb NOT NULL, payload bytea NOT NULL,
    digest bytea NOT NULL);
CREATE INDEX events_latest ON events (device_id, stream, seq DESC);
CREATE INDEX events_ts ON events (ts_ms);
CREATE INDEX events_received ON events USING brin (received_ms);
CREATE TABLE duplicates (event_id uuid NOT NULL, received_ms bigint NOT NULL,
                         sink text NOT NULL);
CREATE TABLE mismatches (event_id uuid NOT NULL, digest bytea NOT NULL,
    payload bytea NOT NULL, topic text NOT NULL, received_ms bigint NOT NULL,
    sink text NOT NULL, PRIMARY KEY (event_id, digest));
CREATE TABLE unreadable (id bigserial PRIMARY KEY, topic text NOT NULL,
    payload bytea NOT NULL, reason text NOT NULL, received_ms bigint NOT NULL,
    sink text NOT NULL);
";

fn sha256(b: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(b).to_vec()
}

#[cfg(feature = "pg-sink")]
#[test]
fn a_postgres_database_of_the_old_schema_migrates() {
    use crate::support::postgres::Postgres;
    use edgespool::sink::postgres::PgStore;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut db = pg.client();
    db.batch_execute(PG_V1).expect("the version 1 schema");
    let (x, real) = envelope("gw1", 1, 0);
    let (_, other) = envelope("gw1", 1, 1);
    db.execute(
        "INSERT INTO events VALUES ($1::text::uuid, 'gw1', 'load', 1, 5, true, 1, '{}', $2, $3)",
        &[&x, &real, &sha256(&real)],
    )
    .expect("old event");
    db.execute(
        "INSERT INTO mismatches VALUES ($1::text::uuid, $2, $3, 'edgespool/gw1/events/load', 2, 'old')",
        &[&x, &sha256(&other), &other],
    )
    .expect("old mismatch");
    for (at, sink) in [(3_i64, "old"), (6, "old2")] {
        db.execute(
            "INSERT INTO duplicates VALUES ($1::text::uuid, $2, $3)",
            &[&x, &at, &sink],
        )
        .expect("old duplicate");
    }
    db.execute(
        "INSERT INTO unreadable (topic, payload, reason, received_ms, sink)
         VALUES ('edgespool/gw1/events/load', $1, 'junk', 4, 'old')",
        &[&vec![b'j'; 100 << 10]],
    )
    .expect("old junk");

    let mut store = PgStore::connect(&pg.conninfo(), "new", &Default::default()).expect("migrate");
    let versions: Vec<i32> = db
        .query("SELECT version FROM schema_version ORDER BY version", &[])
        .expect("versions")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let latest = edgespool::sink::pg_schema::latest();
    assert_eq!(versions, (1..=latest).collect::<Vec<i32>>());
    let pkey: String = db
        .query_one(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'events_pkey'",
            &[],
        )
        .expect("events key")
        .get(0);
    assert_eq!(pkey, "PRIMARY KEY (device_id, event_id)");
    let (cut, whole, device, publisher): (i32, i64, Option<String>, String) = {
        let r = db
            .query_one(
                "SELECT octet_length(u.payload), u.payload_bytes, m.device_id, u.device_id
                 FROM unreadable u, mismatches m",
                &[],
            )
            .expect("old rows");
        (r.get(0), r.get(1), r.get(2), r.get(3))
    };
    assert_eq!(
        publisher, "gw1",
        "the old junk has its publisher (version 3)"
    );
    assert_eq!(
        (cut, whole),
        (64 << 10, 100 << 10),
        "the old junk cut to the bound"
    );
    assert_eq!(
        device.as_deref(),
        Some("gw1"),
        "the old mismatch has its device"
    );

    // Version 6: the two old duplicates are one row of gw1's event (the
    // device of its stored event), counting both.
    let redelivered = |db: &mut postgres::Client| -> Vec<(String, String, i64, i64, i64, String)> {
        db.query(
            "SELECT device_id, event_id::text, deliveries, first_ms, last_ms, sink
             FROM redeliveries",
            &[],
        )
        .expect("redeliveries")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect()
    };
    let row = |n: i64, last: i64, sink: &str| {
        vec![("gw1".to_owned(), x.clone(), n, 3, last, sink.to_owned())]
    };
    assert_eq!(redelivered(&mut db), row(2, 6, "old2"));
    // A sink of version 5 still running fails its next duplicate loudly
    // (undefined table: a fatal class), never writes rows no one counts.
    let old = db
        .execute(
            "INSERT INTO duplicates (device_id, event_id, received_ms, sink)
             VALUES ('gw1', $1::text::uuid, 7, 'v5')",
            &[&x],
        )
        .expect_err("the old table is gone");
    assert_eq!(
        old.as_db_error().map(|e| e.code().clone()),
        Some(postgres::error::SqlState::UNDEFINED_TABLE),
        "{old}"
    );

    // gw1's event again (a duplicate of the old row), the old mismatch
    // again (already recorded: a duplicate), and evil's event of the same
    // id (another device: stored first).
    let (_, evil) = envelope("evil", 1, 0);
    let items = vec![
        Item::new("edgespool/gw1/events/load", &real),
        Item::new("edgespool/gw1/events/load", &other),
        Item::new("edgespool/evil/events/load", &evil),
    ];
    let s = store.commit(&items, 10).expect("store after the migration");
    assert_eq!(s.fates, vec![Fate::Duplicate, Fate::Mismatch, Fate::First]);
    assert_eq!(
        (s.stats.first, s.stats.duplicates, s.stats.mismatches),
        (1, 2, 0)
    );
    // Both counted in the one row, the newest by this sink.
    assert_eq!(redelivered(&mut db), row(4, 10, "new"));
    let topics: Vec<(String, Option<String>)> = db
        .query(
            "SELECT device_id, topic FROM events ORDER BY device_id",
            &[],
        )
        .expect("events")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        topics,
        vec![
            (
                "evil".to_owned(),
                Some("edgespool/evil/events/load".to_owned())
            ),
            ("gw1".to_owned(), None),
        ]
    );
    // A second sink finds nothing to do.
    drop(PgStore::connect(&pg.conninfo(), "again", &Default::default()).expect("again"));
    let n: i64 = db
        .query_one("SELECT count(*) FROM schema_version", &[])
        .expect("count")
        .get(0);
    assert_eq!(n, i64::from(latest));
}

/// The SQLite file older sinks wrote (no `user_version`).
const SQLITE_V1: &str = "
CREATE TABLE received (event_id TEXT PRIMARY KEY, topic TEXT NOT NULL,
    digest BLOB NOT NULL, payload BLOB NOT NULL, ts_ms INTEGER,
    first_ms INTEGER NOT NULL, deliveries INTEGER NOT NULL DEFAULT 1);
CREATE TABLE mismatches (event_id TEXT NOT NULL, digest BLOB NOT NULL,
    payload BLOB NOT NULL, at_ms INTEGER NOT NULL);
";

#[test]
fn a_sqlite_file_of_the_old_schema_migrates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sink.db");
    let (x, real) = envelope("gw1", 1, 0);
    let (y, odd) = envelope("gw1", 2, 0);
    {
        let c = rusqlite::Connection::open(&path).expect("create");
        c.execute_batch(SQLITE_V1).expect("old schema");
        c.execute(
            "INSERT INTO received VALUES (?1, 'edgespool/gw1/events/load', ?2, ?3, 5, 6, 2)",
            rusqlite::params![x, sha256(&real), real],
        )
        .expect("old event");
        // A row whose topic names no device.
        c.execute(
            "INSERT INTO received VALUES (?1, 'elsewhere', ?2, ?3, 5, 6, 1)",
            rusqlite::params![y, sha256(&odd), odd],
        )
        .expect("old event");
        c.execute(
            "INSERT INTO mismatches VALUES (?1, x'00', ?2, 7)",
            rusqlite::params![x, vec![b'j'; 100 << 10]],
        )
        .expect("old mismatch");
    }
    let mut db = SinkDb::open(&path).expect("open and migrate");
    let c = rusqlite::Connection::open(&path).expect("open");
    let version: i32 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .expect("version");
    assert_eq!(version, edgespool::sink::sqlite::VERSION);
    let rows: Vec<(String, String, String, i64)> = {
        let mut st = c
            .prepare(
                "SELECT device_id, stream, event_id, deliveries FROM received ORDER BY event_id",
            )
            .expect("prepare");
        let rows = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .expect("query");
        rows.map(|r| r.expect("row")).collect()
    };
    assert_eq!(
        rows,
        vec![
            ("gw1".to_owned(), "load".to_owned(), x.clone(), 2),
            (String::new(), String::new(), y.clone(), 1),
        ]
    );
    let (dev, cut, whole): (String, i64, i64) = c
        .query_row(
            "SELECT device_id, length(payload), payload_bytes FROM mismatches",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("mismatch");
    assert_eq!((dev.as_str(), cut, whole), ("gw1", 64 << 10, 100 << 10));

    let (_, evil) = envelope("evil", 1, 0);
    let items = vec![
        Item::new("edgespool/gw1/events/load", &real),
        Item::new("edgespool/evil/events/load", &evil),
    ];
    let s = db.commit(&items, 10).expect("store after the migration");
    assert_eq!(s.fates, vec![Fate::Duplicate, Fate::First]);
    drop(db);
    // Opened again: nothing to do. A newer file is refused.
    drop(SinkDb::open(&path).expect("open again"));
    c.execute_batch("PRAGMA user_version = 99").expect("bump");
    match SinkDb::open(&path) {
        Err(e) => assert!(e.to_string().contains("99"), "{e}"),
        Ok(_) => panic!("a newer file was accepted"),
    }
    let report = sink::stats_json(&["--db", path.to_str().expect("UTF-8 path")]);
    assert_eq!(
        (&report["events"], &report["mismatches"]),
        (&3.into(), &1.into()),
        "{report}"
    );
}
