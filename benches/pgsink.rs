//! PostgreSQL sink throughput, printed (no pass/fail): events/s stored by
//! 1, 2 and 4 `edgespool sink --postgres` processes on one shared
//! subscription, beside a bare `COPY` of the same rows into the same table
//! (the ceiling: one statement, one transaction, no MQTT).
//!
//! Each run has its own database. The clock runs from the publisher's first
//! publish to the moment the last event is in the table, so a rate is the
//! slower of publisher, broker and sinks. PostgreSQL runs with its defaults
//! (fsync on, synchronous_commit on) in a temp dir as the `postgres` user.
//!
//! Run: `cargo bench --bench pgsink` (needs mosquitto and postgresql:
//! `cross/setup-debian.sh`). `BENCH_EVENTS` sets the event count (default 50000).

#[path = "../tests/it/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use edgespool::sink::message::decode;
use std::io::Write;
use std::time::{Duration, Instant};
use support::{broker::Broker, postgres::Postgres, publisher, sink::SinkProc};

fn main() {
    let events: usize = std::env::var("BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
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
    println!("{:<28} {:>12} {:>12}", "", "events/s", "seconds");
    for n in [1usize, 2, 4] {
        let (rate, secs) = sinks_rate(&pg, &broker, dir.path(), n, plan);
        println!(
            "{:<28} {rate:>12.0} {secs:>12.2}",
            format!("{n} sink(s), shared sub")
        );
    }
    let (rate, secs) = copy_rate(&pg, plan);
    println!("{:<28} {rate:>12.0} {secs:>12.2}", "bare COPY (ceiling)");
}

/// A fresh database; its connection string.
fn database(pg: &Postgres, name: &str) -> String {
    let mut c = pg.client();
    // One statement each: DROP/CREATE DATABASE cannot run in the implicit
    // transaction block of a multi-statement string.
    for sql in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("CREATE DATABASE {name}"),
    ] {
        c.batch_execute(&sql).expect("create database");
    }
    format!(
        "{} dbname={name}",
        pg.conninfo().replace(" dbname=postgres", "")
    )
}

fn sinks_rate(
    pg: &Postgres,
    broker: &Broker,
    dir: &std::path::Path,
    n: usize,
    plan: publisher::Plan,
) -> (f64, f64) {
    let conninfo = database(pg, &format!("bench_sinks_{n}"));
    let prefix = format!("bench/{n}/{}", support::unique_suffix());
    let filter = format!("{prefix}/+/events/#");
    let group = format!("bench{n}");
    let mut sinks: Vec<SinkProc> = (0..n)
        .map(|i| {
            SinkProc::spawn(
                broker.port(),
                &filter,
                &conninfo,
                &format!("bench-{n}-{i}"),
                &group,
                dir,
            )
        })
        .collect();
    for s in &sinks {
        s.wait_subscribed();
    }
    let mut db = postgres::Client::connect(&conninfo, postgres::NoTls).expect("connect");
    let started = Instant::now();
    let port = broker.port();
    let p = std::thread::spawn(move || {
        publisher::publish(port, &prefix, plan, Duration::from_secs(600))
    });
    let want = plan.events as i64;
    let done = support::wait_for(Duration::from_secs(600), || {
        db.query_one("SELECT count(*) FROM events", &[])
            .map(|r| r.get::<_, i64>(0) >= want)
            .unwrap_or(false)
    });
    let secs = started.elapsed().as_secs_f64();
    assert!(done, "{n} sinks did not store {want} events");
    let _ = p.join();
    for s in &mut sinks {
        s.terminate();
    }
    (plan.events as f64 / secs, secs)
}

/// COPY of the same rows (decoded as the sink decodes them) in one go.
fn copy_rate(pg: &Postgres, plan: publisher::Plan) -> (f64, f64) {
    let conninfo = database(pg, "bench_copy");
    // The sink creates the schema; a store connection migrates it.
    drop(
        edgespool::sink::postgres::PgStore::connect(&conninfo, "bench", &Default::default())
            .expect("schema"),
    );
    let mut text = Vec::new();
    for i in 0..plan.events {
        let (_, body) = publisher::envelope(&plan, i, 0);
        let e = decode(&body).expect("envelope");
        let _ = writeln!(
            text,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t\\\\x{}\t\\\\x{}",
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
            "COPY events (event_id, device_id, stream, seq, ts_ms, clock_trusted, received_ms, fields, payload, digest) FROM STDIN",
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
