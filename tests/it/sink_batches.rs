//! `edgespool sink` takes batched publishes (`<prefix>/batches/<stream>`,
//! plain and lz4) beside single ones (`<prefix>/events/<stream>`) and stores
//! every event once, whichever way and however often it arrived.

use crate::support::broker::Broker;
use crate::support::sink::{sqlite_received, SinkProc, BROKER_EXTRA};
use crate::support::{tail, wait_for};
use edgespool::event::envelope::{encode, Envelope, EventId, Format};
use edgespool::event::reading::FieldValue;
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
use std::io::Write;
use std::path::Path;
use std::time::Duration;

/// Event `i` (0..) as the agent stores it: a JSON envelope of stream `load`.
fn event(i: u32) -> (String, Vec<u8>) {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(&0x5eed_0000u32.to_be_bytes());
    id[12..].copy_from_slice(&i.to_be_bytes());
    let fields = vec![
        ("load1".to_owned(), FieldValue::Num(f64::from(i) / 8.0)),
        ("note".to_owned(), FieldValue::Text(format!("event {i}"))),
    ];
    let env = Envelope {
        event_id: EventId(id),
        device_id: "dev-1",
        stream: "load",
        seq: u64::from(i) + 1,
        ts_ms: 1_800_000_000_000 + i64::from(i),
        clock_trusted: true,
        mono: None,
        fields: &fields,
    };
    (
        EventId(id).hyphenated(),
        encode(Format::Json, &env).expect("encode"),
    )
}

/// `{"batch":[` + envelopes joined by `,` + `]}` (docs/fleet.md,
/// "Batched and compressed publishes").
fn json_batch(range: std::ops::Range<u32>) -> Vec<u8> {
    let events: Vec<Vec<u8>> = range.map(|i| event(i).1).collect();
    let mut out = br#"{"batch":["#.to_vec();
    out.extend_from_slice(&events.join(&b','));
    out.extend_from_slice(b"]}");
    out
}

fn lz4(plain: &[u8]) -> Vec<u8> {
    let mut enc = lz4_flex::frame::FrameEncoder::new(Vec::new());
    enc.write_all(plain).expect("lz4");
    enc.finish().expect("lz4")
}

/// Publish at QoS 1, in order, and return once the broker acknowledged all.
fn publish_all(port: u16, msgs: Vec<(String, Vec<u8>)>) {
    let mut o = MqttOptions::new(
        format!("batch-pub-{}", crate::support::unique_suffix()),
        "127.0.0.1",
        port,
    );
    o.set_keep_alive(Duration::from_secs(10));
    o.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = Client::new(o, 64);
    let n = msgs.len();
    for (topic, payload) in msgs {
        client
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .expect("queue publish");
    }
    let mut acked = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while acked < n {
        assert!(std::time::Instant::now() < deadline, "{acked}/{n} PUBACKs");
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => panic!("publisher connection failed: {e}"),
        }
    }
    let _ = client.disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(200));
}

fn wait_deliveries(sink: &SinkProc, db: &Path, distinct: usize, deliveries: i64) {
    let ok = wait_for(Duration::from_secs(30), || {
        let s = sqlite_received(db);
        s.len() == distinct && s.values().map(|v| v.1).sum::<i64>() == deliveries
    });
    let s = sqlite_received(db);
    assert!(
        ok,
        "sink holds {} events, {} deliveries (want {distinct}, {deliveries})\n{}",
        s.len(),
        s.values().map(|v| v.1).sum::<i64>(),
        tail(&sink.log_text(), 30)
    );
}

#[test]
fn batches_plain_and_lz4_and_singles_are_stored_once_per_event() {
    let broker = Broker::start_with_config(BROKER_EXTRA);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("sink.db");
    let prefix = crate::prefix("sink_batches");
    // docs/fleet.md's filter form; the sink subscribes the batches twin itself.
    let filter = format!("{prefix}/+/events/#");
    let mut sink = SinkProc::spawn_sqlite(broker.port(), &filter, &db, "batch-sink", dir.path());
    sink.wait_subscribed();
    assert!(
        sink.log_text()
            .contains(&format!("subscribed {filter} {prefix}/+/batches/#")),
        "{}",
        tail(&sink.log_text(), 10)
    );

    let batches = format!("{prefix}/dev-1/batches/load");
    let singles = format!("{prefix}/dev-1/events/load");
    let mut msgs = vec![
        // Events 0..50 in one batch.
        (batches.clone(), json_batch(0..50)),
        // 25..50 again (as after a reconnect) and 50..75 new, lz4.
        (format!("{batches}/lz4"), lz4(&json_batch(25..75))),
        // Neither an lz4 frame nor anything else: counted, acknowledged.
        (format!("{batches}/lz4"), b"not an lz4 frame".to_vec()),
    ];
    // 40..50 once more, alone.
    msgs.extend((40..50).map(|i| (singles.clone(), event(i).1)));
    publish_all(broker.port(), msgs);

    // 75 events; deliveries: 50 + 50 + 10.
    wait_deliveries(&sink, &db, 75, 110);
    let s = sqlite_received(&db);
    for i in 0..75 {
        let (id, payload) = event(i);
        let (got, n) = s.get(&id).unwrap_or_else(|| panic!("event {i} not stored"));
        assert_eq!(got, &payload, "event {i}: the bytes the agent stored");
        let want = 1 + i64::from((25..50).contains(&i)) + i64::from((40..50).contains(&i));
        assert_eq!(*n, want, "event {i} deliveries");
    }

    // Every delivery was acknowledged after its commit: started again under
    // the same client id, the sink gets nothing back from the broker's
    // session before a new single event (QoS 1 messages of one session are
    // delivered in order, MQTT 3.1.1 §4.6).
    sink.terminate();
    let log = sink.log_text();
    assert!(
        log.contains("sink: first 75 duplicates 35 mismatches 0 unreadable 1"),
        "{}",
        tail(&log, 20)
    );
    assert!(log.contains("unreadable batch on"), "{}", tail(&log, 20));
    let sink = SinkProc::spawn_sqlite(broker.port(), &filter, &db, "batch-sink", dir.path());
    sink.wait_subscribed();
    publish_all(broker.port(), vec![(singles, event(75).1)]);
    wait_deliveries(&sink, &db, 76, 111);
}

/// The PostgreSQL store, fed what a batched delivery unpacks to: the
/// readable events stored (a duplicate of a single delivery counted), the
/// unreadable event and the unreadable batch kept in `unreadable` with their
/// reasons.
#[cfg(feature = "pg-sink")]
#[test]
fn postgres_store_keeps_unreadable_batches_with_their_reason() {
    use crate::support::postgres::Postgres;
    use edgespool::sink::postgres::PgStore;
    use edgespool::sink::unbatch::items;
    use edgespool::sink::Store;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut store =
        PgStore::connect(&pg.conninfo(), "unit", &Default::default()).expect("connect and migrate");
    let single = items("p/dev-1/events/load", &event(1).1);
    let s = store.store_batch(&single, 1).expect("single");
    assert_eq!((s.first, s.unreadable), (1, 0));

    let mut plain = json_batch(0..3);
    // An object that is no envelope, as a fourth event.
    plain.truncate(plain.len() - 2);
    plain.extend_from_slice(br#",{"not":"an envelope"}]}"#);
    let mut delivered = items("p/dev-1/batches/load/lz4", &lz4(&plain));
    assert_eq!(delivered.len(), 4);
    delivered.extend(items("p/dev-1/batches/load/zstd", b"not a zstd frame"));
    let s = store.store_batch(&delivered, 2).expect("batch");
    assert_eq!(
        (s.first, s.duplicates, s.mismatches, s.unreadable),
        (2, 1, 0, 2)
    );
    let mut db = pg.client();
    let rows = db
        .query(
            "SELECT event_id::text, payload FROM events ORDER BY seq",
            &[],
        )
        .expect("events");
    assert_eq!(rows.len(), 3);
    for (i, r) in rows.iter().enumerate() {
        let (id, payload) = event(i as u32);
        assert_eq!(r.get::<_, String>(0), id);
        assert_eq!(r.get::<_, Vec<u8>>(1), payload);
    }
    let reasons: Vec<String> = db
        .query("SELECT reason FROM unreadable ORDER BY reason", &[])
        .expect("unreadable")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[1].starts_with("unreadable batch: zstd"),
        "{reasons:?}"
    );
    assert!(reasons[0].contains("event_id"), "{reasons:?}");
}
