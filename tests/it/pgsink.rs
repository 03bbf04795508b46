//! The PostgreSQL sink: three sinks on one shared subscription, a publisher
//! with ten device ids, duplicates and conflicts, two sinks SIGKILLed
//! mid-stream and restarted under the same client id.
//!
//! What mosquitto 2.0 does (checked with mosquitto_sub, and pinned here): a
//! shared-subscription member that is gone but whose session persists
//! (clean_session=false) still gets its round-robin share, queued in its
//! session; nothing is handed to the other members. The queue is delivered
//! when the same client id connects again, together with what it had
//! received and not acknowledged. So the broker here runs with
//! `max_queued_messages 0` (no limit; the default, 1000, would drop QoS 1
//! messages for the dead sink) and the killed sinks are restarted.

use crate::support::sink::{self, SinkProc};
use crate::support::{self, broker::Broker, postgres::Postgres, publisher};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Deliveries of an event already stored (`redeliveries` counts them per
/// event).
const REDELIVERED: &str = "SELECT coalesce(sum(deliveries), 0)::int8 FROM redeliveries";

fn count(c: &mut postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).map(|r| r.get(0)).unwrap_or(-1)
}

/// Events in the table, or -1 before the schema exists.
fn events(c: &mut postgres::Client) -> i64 {
    count(c, "SELECT count(*) FROM events")
}

#[test]
fn three_shared_sinks_two_killed_store_each_event_once_and_count_every_repeat() {
    let total: usize = std::env::var("EDGESPOOL_PGSINK_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let plan = publisher::Plan {
        events: total,
        devices: 10,
        dup_every: 50,
        conflicts: 10,
    };
    let pg = Postgres::start(&[("fsync", "off")]);
    let broker = Broker::start_with_options(support::sink::BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("pgsink");
    let filter = format!("{prefix}/+/events/#");
    let ids = ["pg-sink-a", "pg-sink-b", "pg-sink-c"];
    let spawn = |id: &str| {
        SinkProc::spawn(
            broker.port(),
            &filter,
            &pg.conninfo(),
            id,
            "fleet",
            dir.path(),
        )
    };
    let mut sinks: Vec<SinkProc> = ids.iter().map(|id| spawn(id)).collect();
    for s in &sinks {
        s.wait_subscribed();
    }
    let mut db = pg.client();

    let started = Instant::now();
    let port = broker.port();
    let pub_prefix = prefix.clone();
    let publisher = std::thread::spawn(move || {
        publisher::publish(port, &pub_prefix, plan, Duration::from_secs(600))
    });

    // Kill sink a at 25 %, bring it back once the others stored 5 % more
    // (or the publisher is done); the same for sink b at 55 %.
    let mut kills = Vec::new();
    for (k, at) in [(0usize, 0.25f64), (1, 0.55)] {
        let target = (total as f64 * at) as i64;
        assert!(
            support::wait_for(Duration::from_secs(300), || events(&mut db) >= target),
            "stored {} of {target} before kill {k}",
            events(&mut db)
        );
        sinks[k].kill();
        let at_kill = events(&mut db);
        kills.push((ids[k], at_kill));
        support::wait_for(Duration::from_secs(60), || {
            publisher.is_finished() || events(&mut db) >= at_kill + total as i64 / 20
        });
        sinks[k] = spawn(ids[k]);
        sinks[k].wait_subscribed();
    }
    let sent = publisher.join().expect("publisher");

    let settled = support::wait_for(Duration::from_secs(300), || {
        events(&mut db) == sent.distinct as i64
            && count(&mut db, "SELECT count(*) FROM mismatches") == sent.conflicts as i64
            && count(&mut db, REDELIVERED) >= sent.duplicates as i64
    });
    let logs: String = sinks
        .iter()
        .map(|s| support::tail(&s.log_text(), 8) + "\n")
        .collect();
    assert!(
        settled,
        "events {} of {}, mismatches {} of {}, duplicates {} (>= {})\n{logs}",
        events(&mut db),
        sent.distinct,
        count(&mut db, "SELECT count(*) FROM mismatches"),
        sent.conflicts,
        count(&mut db, REDELIVERED),
        sent.duplicates
    );
    let elapsed = started.elapsed();
    for s in &mut sinks {
        s.terminate();
    }
    // Reconnects other than the two restarts (each one makes the broker
    // send its in-flight window again: more redeliveries).
    let lost: Vec<String> = std::fs::read_dir(dir.path())
        .expect("sink logs")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .flat_map(|t| {
            t.lines()
                .filter(|l| l.contains("WARN"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    println!("pgsink: sink warnings: {lost:?}");

    // Exactly the distinct events, each with the bytes of one of its sends.
    let mut stored: HashMap<String, Vec<u8>> = HashMap::new();
    for r in db
        .query("SELECT event_id::text, digest FROM events", &[])
        .expect("read events")
    {
        stored.insert(r.get(0), r.get(1));
    }
    assert_eq!(stored.len(), sent.distinct);
    for i in 0..plan.events {
        let (_, body) = publisher::envelope(&plan, i, 0);
        let id = format!("{:08x}-0000-4000-8000-{:012x}", i % plan.devices, i);
        let d = stored
            .get(&id)
            .unwrap_or_else(|| panic!("event {id} missing"));
        let mut ok = d.as_slice() == digest(&body);
        if publisher::is_conflict(&plan, i) {
            ok |= d.as_slice() == digest(&publisher::envelope(&plan, i, 1).1);
        }
        assert!(
            ok,
            "event {id} stored with bytes that were never sent for it"
        );
    }
    let duplicates = count(&mut db, REDELIVERED);
    let unreadable = count(&mut db, "SELECT count(*) FROM unreadable");
    assert_eq!(unreadable, 0);

    // The consumer's view: no gap in any stream, ten devices.
    let report = sink::stats_json(&["--postgres", &pg.conninfo()]);
    let streams = report["streams"].as_array().expect("streams");
    assert_eq!(streams.len(), plan.devices);
    assert!(streams.iter().all(|s| s["missing"] == 0), "{report}");
    assert_eq!(report["mismatches"], sent.conflicts);
    println!(
        "pgsink: {} publishes ({} distinct, {} duplicates sent, {} conflicts) in {:.1?}; \
         kills at {:?}; stored {} events, duplicates counted {} ({} redeliveries), \
         mismatches {}, all settled after {:.1?}",
        sent.publishes,
        sent.distinct,
        sent.duplicates,
        sent.conflicts,
        sent.elapsed,
        kills,
        stored.len(),
        duplicates,
        duplicates - sent.duplicates as i64,
        report["mismatches"],
        elapsed
    );
}

fn digest(b: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(b).to_vec()
}

#[test]
fn store_keeps_unreadable_and_mismatches_aside_and_refuses_a_newer_schema() {
    use edgespool::sink::batch::Item;
    use edgespool::sink::postgres::PgStore;
    use edgespool::sink::{Store, StoreError};
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut store =
        PgStore::connect(&pg.conninfo(), "unit", &Default::default()).expect("connect and migrate");
    let plan = publisher::Plan {
        events: 10,
        devices: 2,
        dup_every: 0,
        conflicts: 1,
    };
    let (_, a) = publisher::envelope(&plan, 1, 0);
    let (_, a2) = publisher::envelope(&plan, 1, 1);
    let items: Vec<Item> = [
        &a[..],
        &a[..],
        &a2[..],
        &a2[..],
        b"not an envelope",
        b"{\"event_id\":\"x\"}",
    ]
    .iter()
    // The device the topic names is the envelopes' (`dev-01`).
    .map(|p| Item::new("t/dev-01/events/load", p))
    .collect();
    let s = store.store_batch(&items, 1).expect("batch");
    // The second copy of a2 is a repeat of a mismatch already kept: a duplicate.
    assert_eq!(
        (s.first, s.duplicates, s.mismatches, s.unreadable),
        (1, 2, 1, 2)
    );
    // Delivered again (a sink died before its PUBACK): nothing new but duplicates.
    let s = store.store_batch(&items[..3], 2).expect("batch again");
    assert_eq!((s.first, s.duplicates, s.mismatches), (0, 3, 0));
    let mut db = pg.client();
    assert_eq!(count(&mut db, "SELECT count(*) FROM events"), 1);
    assert_eq!(count(&mut db, "SELECT count(*) FROM mismatches"), 1);
    assert_eq!(count(&mut db, REDELIVERED), 5);
    // One row for them: a and a2 are one key.
    assert_eq!(count(&mut db, "SELECT count(*) FROM redeliveries"), 1);
    assert_eq!(count(&mut db, "SELECT count(*) FROM unreadable"), 2);

    // A second sink migrates nothing (one row per migration, applied
    // once); a schema from a newer sink is refused.
    drop(PgStore::connect(&pg.conninfo(), "again", &Default::default()).expect("second connect"));
    assert_eq!(
        count(&mut db, "SELECT count(*) FROM schema_version"),
        i64::from(edgespool::sink::pg_schema::latest())
    );
    db.execute("INSERT INTO schema_version (version) VALUES (999)", &[])
        .expect("bump version");
    match PgStore::connect(&pg.conninfo(), "old", &Default::default()) {
        Err(StoreError::Fatal(e)) => assert!(e.contains("999"), "{e}"),
        Err(e) => panic!("expected a fatal error, got {e}"),
        Ok(_) => panic!("a newer schema was accepted"),
    }
}

/// A batch holding a key another sink already stored cannot go in by
/// `COPY` (it stores only batches whose keys are all new): it is rolled
/// back and stored with `ON CONFLICT`, and counts what a batch without the
/// fast path would (the new events first, the stored one a duplicate, a
/// stored id with other bytes a mismatch), and stores nothing twice.
#[test]
fn a_batch_with_a_key_already_stored_falls_back_and_counts_the_same() {
    use edgespool::sink::batch::Item;
    use edgespool::sink::postgres::PgStore;
    use edgespool::sink::Store;
    let pg = Postgres::start(&[("fsync", "off")]);
    let connect = |name: &str| {
        PgStore::connect(&pg.conninfo(), name, &Default::default()).expect("connect and migrate")
    };
    let (mut a, mut b) = (connect("a"), connect("b"));
    let plan = publisher::Plan {
        events: 10,
        devices: 1,
        dup_every: 0,
        conflicts: 1,
    };
    let item = |i: usize, variant: u32| {
        let (_, p) = publisher::envelope(&plan, i, variant);
        Item::new("t/dev-00/events/load", &p)
    };
    // Sink a stores events 0 and 1 (all new: the fast path).
    let s = a.store_batch(&[item(0, 0), item(1, 0)], 1).expect("a");
    assert_eq!((s.first, s.duplicates, s.mismatches), (2, 0, 0));
    // Sink b gets 1 again, 2 and 3 new, and 0 with other bytes.
    let batch = [item(2, 0), item(1, 0), item(3, 0), item(0, 1)];
    let s = b.store_batch(&batch, 2).expect("b");
    assert_eq!((s.first, s.duplicates, s.mismatches), (2, 1, 1));
    // And b goes on storing new events.
    let s = b
        .store_batch(&[item(4, 0), item(5, 0)], 3)
        .expect("b again");
    assert_eq!((s.first, s.duplicates, s.mismatches), (2, 0, 0));
    let mut db = pg.client();
    assert_eq!(count(&mut db, "SELECT count(*) FROM events"), 6);
    assert_eq!(count(&mut db, REDELIVERED), 1);
    assert_eq!(count(&mut db, "SELECT count(*) FROM mismatches"), 1);
    // Every row holds the bytes of its first delivery, its digest, its
    // topic and the commit that stored it.
    for i in 0..6 {
        let (_, p) = publisher::envelope(&plan, i, 0);
        let e = edgespool::sink::message::decode(&p).expect("envelope");
        let row = db
            .query_one(
                "SELECT payload, digest, topic, fields::text FROM events WHERE event_id = $1::text::uuid",
                &[&e.event_id],
            )
            .expect("row");
        assert_eq!(row.get::<_, Vec<u8>>(0), p, "event {i}");
        assert_eq!(row.get::<_, Vec<u8>>(1), digest(&p), "event {i}");
        assert_eq!(row.get::<_, String>(2), "t/dev-00/events/load");
        let fields: serde_json::Value =
            serde_json::from_str(&row.get::<_, String>(3)).expect("json");
        let want: serde_json::Value = serde_json::from_str(&e.fields_json).expect("json");
        assert_eq!(fields, want, "event {i}");
    }
}

/// A database that refuses `COPY` itself (here row-level security forced on
/// `events`: "COPY FROM not supported with row-level security", SQLSTATE
/// 0A000) still gets every batch, by `INSERT .. ON CONFLICT`, which it
/// takes: the fast path must not stop the sink where the careful one
/// works.
#[test]
fn a_database_that_refuses_copy_still_gets_every_batch_by_insert() {
    use edgespool::sink::batch::Item;
    use edgespool::sink::postgres::PgStore;
    use edgespool::sink::Store;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut db = pg.client();
    // A role of its own that owns the sink's tables (a superuser bypasses
    // row-level security, so the test cannot run as `postgres`).
    db.batch_execute("CREATE ROLE fleet LOGIN; GRANT USAGE, CREATE ON SCHEMA public TO fleet;")
        .expect("role");
    let conninfo = pg.conninfo().replace("user=postgres", "user=fleet");
    let mut store = PgStore::connect(&conninfo, "rls", &Default::default()).expect("connect");
    db.batch_execute(
        "ALTER TABLE events ENABLE ROW LEVEL SECURITY;
         ALTER TABLE events FORCE ROW LEVEL SECURITY;
         CREATE POLICY everyone ON events USING (true) WITH CHECK (true);",
    )
    .expect("row-level security on events");
    let plan = publisher::Plan {
        events: 10,
        devices: 1,
        dup_every: 0,
        conflicts: 0,
    };
    let item = |i: usize| {
        let (_, p) = publisher::envelope(&plan, i, 0);
        Item::new("t/dev-00/events/load", &p)
    };
    let s = store
        .store_batch(&[item(0), item(1)], 1)
        .expect("a batch on a database that refuses COPY");
    assert_eq!((s.first, s.duplicates, s.mismatches), (2, 0, 0));
    let s = store
        .store_batch(&[item(2), item(1)], 2)
        .expect("the next batch");
    assert_eq!((s.first, s.duplicates, s.mismatches), (1, 1, 0));
    assert_eq!(count(&mut db, "SELECT count(*) FROM events"), 3);
}

/// A deferred constraint trigger that fails `COMMIT` (SQLSTATE 40001, a
/// serialization failure: transient) for every other transaction while
/// `fail_commits.failing` is set.
const FAIL_COMMITS: &str = "
CREATE TABLE fail_commits (failing boolean NOT NULL);
INSERT INTO fail_commits VALUES (true);
CREATE FUNCTION fail_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF (SELECT bool_or(failing) FROM fail_commits) AND txid_current() % 2 = 0 THEN
    RAISE EXCEPTION 'commit refused by the test' USING ERRCODE = '40001';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fail_commit AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_commit();";

/// The store runs on its own thread while the next batch is gathered: if a
/// PUBACK ever left before the commit holding its event, a commit that then
/// failed would lose that event (the broker would not send it again). Here
/// half the commits fail at `COMMIT` while a backlog drains in full batches
/// (one with the store, the next gathered), then the sink is stopped
/// mid-drain and started again: every event must end up stored, once.
#[test]
fn commits_that_fail_and_a_stop_mid_drain_lose_nothing_acknowledged() {
    let total = 6_000;
    let plan = publisher::Plan {
        events: total,
        devices: 3,
        dup_every: 0,
        conflicts: 0,
    };
    let pg = Postgres::start(&[("fsync", "off")]);
    let broker = Broker::start_with_options(support::sink::BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("pgsink-fail");
    let filter = format!("{prefix}/+/events/#");
    let spawn = || {
        SinkProc::spawn(
            broker.port(),
            &filter,
            &pg.conninfo(),
            "pg-fail",
            "g",
            dir.path(),
        )
    };
    // Subscribe (the session persists, the schema is made), leave, and let
    // the broker hold the whole backlog.
    let mut s = spawn();
    s.wait_subscribed();
    s.terminate();
    publisher::publish(broker.port(), &prefix, plan, Duration::from_secs(120));
    let mut db = pg.client();
    db.batch_execute(FAIL_COMMITS).expect("failing commits");
    let mut s = spawn();
    let failed = |s: &SinkProc| s.log_text().matches("commit refused by the test").count();
    assert!(
        support::wait_for(Duration::from_secs(60), || failed(&s) >= 3),
        "the sink met no failing commits:\n{}",
        support::tail(&s.log_text(), 30)
    );
    let stored_while_failing = events(&mut db);
    db.batch_execute("UPDATE fail_commits SET failing = false")
        .expect("commits succeed again");
    // A stop while batches are with the store: what it acknowledged must
    // be committed, what it did not the broker sends again.
    support::wait_for(Duration::from_secs(60), || {
        events(&mut db) >= stored_while_failing + 1_000
    });
    s.terminate();
    let mut s = spawn();
    let all = support::wait_for(Duration::from_secs(120), || events(&mut db) >= total as i64);
    s.terminate();
    assert!(
        all,
        "{} of {total} events stored: a PUBACK left before its commit\n{}",
        events(&mut db),
        support::tail(&s.log_text(), 30)
    );
    assert_eq!(
        count(
            &mut db,
            "SELECT count(DISTINCT (device_id, event_id)) FROM events"
        ),
        total as i64
    );
    assert_eq!(count(&mut db, "SELECT count(*) FROM mismatches"), 0);
    assert!(
        failed(&s) == 0,
        "the last run met no failing commit (the trigger is off)"
    );
}
