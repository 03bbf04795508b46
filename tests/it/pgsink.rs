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

use crate::support::{self, broker::Broker, postgres::Postgres, publisher};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The broker settings the README's fleet layout asks for.
pub const BROKER_EXTRA: &str = "max_inflight_messages 1000\nmax_queued_messages 0\n";

/// A sink process.
pub struct SinkProc {
    pub child: Child,
    pub log: PathBuf,
}

impl SinkProc {
    pub fn spawn(
        port: u16,
        filter: &str,
        conninfo: &str,
        id: &str,
        group: &str,
        dir: &Path,
    ) -> SinkProc {
        let n = (1..)
            .find(|n| !dir.join(format!("{id}-{n}.log")).exists())
            .expect("a free log name");
        let log = dir.join(format!("{id}-{n}.log"));
        let f = std::fs::File::create(&log).expect("sink log");
        let child = Command::new(support::agent::bin())
            .args([
                "sink",
                "--url",
                &format!("mqtt://127.0.0.1:{port}"),
                "--topic",
                filter,
            ])
            .args(["--postgres", conninfo, "--client-id", id, "--share", group])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("clone log"))
            .stderr(f)
            .spawn()
            .expect("start the sink");
        SinkProc { child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the sink logged its SUBACK.
    pub fn wait_subscribed(&self) {
        assert!(
            support::wait_for(Duration::from_secs(30), || self
                .log_text()
                .contains("sink: subscribed")),
            "sink did not subscribe:\n{}",
            support::tail(&self.log_text(), 20)
        );
    }

    pub fn kill(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    pub fn terminate(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for SinkProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

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
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
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
            && count(&mut db, "SELECT count(*) FROM duplicates") >= sent.duplicates as i64
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
        count(&mut db, "SELECT count(*) FROM duplicates"),
        sent.duplicates
    );
    let elapsed = started.elapsed();
    for s in &mut sinks {
        s.terminate();
    }

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
    let duplicates = count(&mut db, "SELECT count(*) FROM duplicates");
    let unreadable = count(&mut db, "SELECT count(*) FROM unreadable");
    assert_eq!(unreadable, 0);

    // The consumer's view: no gap in any stream, ten devices.
    let out = Command::new(support::agent::bin())
        .args(["sink", "--stats", "--json", "--postgres", &pg.conninfo()])
        .output()
        .expect("sink --stats");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stats JSON");
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
