//! PostgreSQL sink throughput, printed (no pass/fail): events/s stored by
//! 1, 2 and 4 `edgespool sink --postgres` processes on one shared
//! subscription, beside a bare `COPY` of the same rows into the same table
//! (the ceiling: one statement, one transaction, no MQTT), and beside the
//! publisher alone (what the broker takes from one QoS 1 publisher with no
//! subscriber: the ceiling of the live runs).
//!
//! Each sink count runs twice, each in its own database:
//! - `live`: the clock runs from the publisher's first publish to the moment
//!   the last event is in the table, so a rate is the slower of publisher,
//!   broker and sinks (all on the same cores);
//! - `backlog`: the sinks subscribe (persistent sessions), stop, the events
//!   are published and queued in the broker, and the sinks start again; the
//!   rate is the sinks' own: from their first commit to their last
//!   (`received_ms`), the first commit's rows left out. This is the figure
//!   set beside `COPY`.
//!
//! PostgreSQL runs with its defaults (fsync on, synchronous_commit on) in a
//! temp dir as the `postgres` user.
//!
//! Run: `cargo bench --bench pgsink` (needs mosquitto and postgresql:
//! `cross/setup-debian.sh`). `BENCH_EVENTS` sets the event count (default
//! 50000); `BENCH_SINKS=1,2` picks sink counts. `store alone` runs the
//! sink's store without MQTT (batches of 500), to tell the database side
//! from the MQTT side.

#[path = "../tests/it/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use edgespool::sink::message::decode;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};
use support::{broker::Broker, postgres::Postgres, publisher, sink::SinkProc};

fn main() {
    let events: usize = std::env::var("BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let counts: Vec<usize> = std::env::var("BENCH_SINKS")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 4]);
    let plan = publisher::Plan {
        events,
        devices: 10,
        dup_every: 0,
        conflicts: 0,
    };
    let pg = Postgres::start(&[]);
    let broker = Broker::start_with_options(support::sink::BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    println!(
        "edgespool pgsink bench: {events} events, 10 devices, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{:<32} {:>12} {:>12}", "", "events/s", "seconds");
    let row = |what: &str, (rate, secs): (f64, f64)| {
        println!("{what:<32} {rate:>12.0} {secs:>12.2}");
    };
    let alone = publisher_rate(&broker, plan);
    row("publisher alone (no sink)", alone);
    let mut one = None;
    for &n in &counts {
        row(
            &format!("{n} sink(s), live"),
            live_rate(&pg, &broker, dir.path(), n, plan),
        );
        let b = backlog_rate(&pg, &broker, dir.path(), n, plan);
        row(&format!("{n} sink(s), from backlog"), b);
        if n == 1 {
            one = Some(b.0);
        }
    }
    row("store alone (no MQTT)", store_rate(&pg, plan));
    let copy = copy_rate(&pg, plan);
    row("bare COPY (ceiling)", copy);
    if let Some(one) = one {
        println!("1 sink from backlog / bare COPY: {:.2}", one / copy.0);
    }
}

/// The plan published to a prefix nobody subscribes to.
fn publisher_rate(broker: &Broker, plan: publisher::Plan) -> (f64, f64) {
    let prefix = format!("bench/alone/{}", support::unique_suffix());
    let sent = publisher::publish(broker.port(), &prefix, plan, Duration::from_secs(600));
    let secs = sent.elapsed.as_secs_f64();
    (plan.events as f64 / secs, secs)
}

/// Sinks `bench-{tag}-{i}` on one shared subscription, subscribed.
fn spawn_sinks(
    broker: &Broker,
    dir: &Path,
    filter: &str,
    conninfo: &str,
    tag: &str,
    n: usize,
) -> Vec<SinkProc> {
    let sinks: Vec<SinkProc> = (0..n)
        .map(|i| {
            SinkProc::spawn(
                broker.port(),
                filter,
                conninfo,
                &format!("bench-{tag}-{i}"),
                &format!("bench{tag}"),
                dir,
            )
        })
        .collect();
    for s in &sinks {
        s.wait_subscribed();
    }
    sinks
}

/// Wait until `want` events are in the table. A `count(*)` scans the whole
/// table, so it runs every 250 ms only (every 50 ms it took a tenth of a
/// core from the sinks); the clocks come from `received_ms`, not from when
/// this notices.
fn wait_stored(db: &mut postgres::Client, want: usize, what: &str) {
    let want = want as i64;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let n: i64 = db
            .query_one("SELECT count(*) FROM events", &[])
            .map(|r| r.get(0))
            .unwrap_or(0);
        if n >= want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} stored {n} of {want} events"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The first and last commit times (`received_ms`, Unix ms) and the rows
/// of the first commit.
fn commit_times(db: &mut postgres::Client) -> (i64, i64, i64) {
    let r = db
        .query_one(
            "SELECT min(received_ms), max(received_ms),
                    count(*) FILTER (WHERE received_ms = (SELECT min(received_ms) FROM events))
             FROM events",
            &[],
        )
        .expect("commit times");
    (r.get(0), r.get(1), r.get(2))
}

fn wall_ms() -> i64 {
    edgespool::event::envelope::wall_clock_ms().0
}

/// The clock runs from the first publish to the last commit
/// (`received_ms`, taken as that commit starts).
fn live_rate(
    pg: &Postgres,
    broker: &Broker,
    dir: &Path,
    n: usize,
    plan: publisher::Plan,
) -> (f64, f64) {
    let conninfo = pg.database(&format!("bench_live_{n}"));
    let prefix = format!("bench/live{n}/{}", support::unique_suffix());
    let filter = format!("{prefix}/+/events/#");
    let mut sinks = spawn_sinks(broker, dir, &filter, &conninfo, &format!("live{n}"), n);
    let mut db = postgres::Client::connect(&conninfo, postgres::NoTls).expect("connect");
    let started = wall_ms();
    let port = broker.port();
    let p = std::thread::spawn(move || {
        publisher::publish(port, &prefix, plan, Duration::from_secs(600))
    });
    wait_stored(&mut db, plan.events, &format!("{n} live sinks"));
    let (_, last, _) = commit_times(&mut db);
    let secs = ((last - started) as f64 / 1000.0).max(0.001);
    let _ = p.join();
    for s in &mut sinks {
        s.terminate();
    }
    (plan.events as f64 / secs, secs)
}

/// The sinks' own rate over a backlog the broker holds for them: from
/// their first commit to their last, the rows of the first commit left out
/// (the clock starts when they are stored). The seconds printed are from
/// the sinks' start to the last row.
fn backlog_rate(
    pg: &Postgres,
    broker: &Broker,
    dir: &Path,
    n: usize,
    plan: publisher::Plan,
) -> (f64, f64) {
    let conninfo = pg.database(&format!("bench_backlog_{n}"));
    let prefix = format!("bench/backlog{n}/{}", support::unique_suffix());
    let filter = format!("{prefix}/+/events/#");
    let tag = format!("backlog{n}");
    // Subscribe once (the sessions persist), then leave.
    for mut s in spawn_sinks(broker, dir, &filter, &conninfo, &tag, n) {
        s.terminate();
    }
    publisher::publish(broker.port(), &prefix, plan, Duration::from_secs(600));
    let mut db = postgres::Client::connect(&conninfo, postgres::NoTls).expect("connect");
    let started = Instant::now();
    let mut sinks = spawn_sinks(broker, dir, &filter, &conninfo, &tag, n);
    wait_stored(&mut db, plan.events, &format!("{n} sinks from backlog"));
    let secs = started.elapsed().as_secs_f64();
    for s in &mut sinks {
        s.terminate();
    }
    let (first, last, at_first) = commit_times(&mut db);
    let commits: i64 = db
        .query_one("SELECT count(DISTINCT received_ms) FROM events", &[])
        .map(|r| r.get(0))
        .unwrap_or(0);
    println!(
        "  ({n} sink(s) from backlog: {commits} commits, {:.0} events each)",
        plan.events as f64 / commits.max(1) as f64
    );
    let span = ((last - first) as f64 / 1000.0).max(0.001);
    ((plan.events as f64 - at_first as f64) / span, secs)
}

/// The sink's store alone: the same events, decoded as the sink decodes
/// them, in batches of 500 through [`PgStore`](edgespool::sink::postgres::PgStore)
/// (what the sink adds to `COPY` on the database's side, without MQTT).
fn store_rate(pg: &Postgres, plan: publisher::Plan) -> (f64, f64) {
    use edgespool::sink::{batch::Item, Store};
    let conninfo = pg.database("bench_store");
    let mut store =
        edgespool::sink::postgres::PgStore::connect(&conninfo, "bench", &Default::default())
            .expect("store");
    let items: Vec<Item> = (0..plan.events)
        .map(|i| {
            let (dev, body) = publisher::envelope(&plan, i, 0);
            Item::new(&format!("bench/store/{dev}/events/load"), &body)
        })
        .collect();
    let started = Instant::now();
    for b in items.chunks(500) {
        store.store_batch(b, wall_ms()).expect("batch");
    }
    let secs = started.elapsed().as_secs_f64();
    (plan.events as f64 / secs, secs)
}

/// COPY of the same rows (decoded as the sink decodes them) in one go.
fn copy_rate(pg: &Postgres, plan: publisher::Plan) -> (f64, f64) {
    let conninfo = pg.database("bench_copy");
    // The sink creates the schema; a store connection migrates it.
    drop(
        edgespool::sink::postgres::PgStore::connect(&conninfo, "bench", &Default::default())
            .expect("schema"),
    );
    let prefix = "bench/copy";
    let mut text = Vec::new();
    for i in 0..plan.events {
        let (dev, body) = publisher::envelope(&plan, i, 0);
        let e = decode(&body).expect("envelope");
        let _ = writeln!(
            text,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t\\\\x{}\t\\\\x{}\t{prefix}/{dev}/events/load",
            e.event_id,
            e.device_id,
            e.stream,
            e.seq,
            e.ts_ms,
            e.clock_trusted,
            0,
            e.fields_json,
            hex(&body),
            hex(&e.digest)
        );
    }
    let mut c = postgres::Client::connect(&conninfo, postgres::NoTls).expect("connect");
    let started = Instant::now();
    let mut w = c
        .copy_in(
            "COPY events (event_id, device_id, stream, seq, ts_ms, clock_trusted, received_ms, fields, payload, digest, topic) FROM STDIN",
        )
        .expect("COPY");
    w.write_all(&text).expect("COPY data");
    w.finish().expect("COPY finish");
    let secs = started.elapsed().as_secs_f64();
    (plan.events as f64 / secs, secs)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
