//! The network-loss rig: a schedule of real faults between the agent and a
//! real broker while readings flow, then a drain, then the agent's spool is
//! compared with what the reference consumer (`edgespool sink`) stored.
//!
//! Faults, all in a userspace TCP proxy (this machine's kernel has no netem
//! and no iptables): blackhole without RST,
//! connection reset, added latency, bandwidth cap, random loss (as the
//! retransmission stalls TCP would show), PUBACKs withheld; plus SIGKILL of
//! the agent and a graceful broker restart (mosquitto with persistence, so
//! the sink's queued messages survive it).
//!
//! Ends with `N passed, N failed` and exits non-zero on any loss, retirement
//! without a PUBACK, or payload mismatch.
//!
//! Environment: `RIG_FAULTS` (default 12), `RIG_SEED` (default: the clock,
//! printed), `RIG_STEP_SECS` (default 2); `EDGESPOOL_AGENT_BIN` and
//! `EDGESPOOL_AGENT_RUNNER` run an ARM build under qemu, as in the
//! integration tests.

#[path = "it/support/mod.rs"]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::agent::AgentProc;
use support::broker::Broker;
use support::env_u64;
use support::proxy::{Mode, Proxy};
use support::sink::SinkProc;

#[derive(Debug, Clone, Copy)]
enum Fault {
    Blackhole(u64),
    Reset,
    Latency(u64),
    Throttle(u64),
    Loss(u64),
    DropPubacks,
    KillAgent,
    RestartBroker,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn schedule(rng: &mut Rng, n: usize) -> Vec<Fault> {
    (0..n)
        .map(|_| match rng.below(8) {
            0 => Fault::Blackhole(1 + rng.below(3)),
            1 => Fault::Reset,
            2 => Fault::Latency(50 + rng.below(250)),
            3 => Fault::Throttle(2_000 + rng.below(18_000)),
            4 => Fault::Loss(5 + rng.below(20)),
            5 => Fault::DropPubacks,
            6 => Fault::KillAgent,
            _ => Fault::RestartBroker,
        })
        .collect()
}

fn main() {
    let faults = env_u64("RIG_FAULTS", 12) as usize;
    let step = Duration::from_secs(env_u64("RIG_STEP_SECS", 2));
    let seed = env_u64(
        "RIG_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    ) | 1;
    let mut rng = Rng(seed);
    let plan = schedule(&mut rng, faults);
    println!(
        "rig: seed {seed}, {faults} faults, step {} s",
        step.as_secs()
    );
    println!("rig: faults run in a userspace TCP proxy (no netem/iptables here)");

    let dir = tempfile::tempdir().expect("tempdir");
    let mut broker = Broker::start_with_config(&format!(
        "persistence true\npersistence_location {}/\nautosave_interval 1\n",
        dir.path().display()
    ));
    let proxy = Proxy::start(broker.port());
    // Ends with the device id: the sink takes the device from the topic.
    let prefix = format!("rig/{}/rig-board", support::unique_suffix());
    let sink_db = dir.path().join("sink.db");
    let filter = format!("{prefix}/events/#");
    let mut sink = SinkProc::spawn_sqlite(broker.port(), &filter, &sink_db, "rig-sink", dir.path());
    sink.wait_subscribed();

    let cfg = dir.path().join("board.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "rig-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 100
checkpoint_interval_secs = 2
acked_retention_secs = 86400
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
client_id = "rig-agent"
reconnect_min_ms = 100
reconnect_max_ms = 1000
connect_timeout_secs = 3
ack_timeout_secs = 4
keep_alive_secs = 5
[[sources]]
name = "system"
kind = "system"
interval_ms = 50
"#,
            d = dir.path().display(),
            url = proxy.url()
        ),
    )
    .expect("write config");
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let started = Instant::now();
    std::thread::sleep(step);

    for (i, f) in plan.iter().enumerate() {
        println!(
            "rig: fault {:>3}/{faults} at {:>5.1} s: {f:?}",
            i + 1,
            started.elapsed().as_secs_f64()
        );
        match *f {
            Fault::Blackhole(secs) => {
                proxy.set_mode(Mode::Blackhole);
                std::thread::sleep(Duration::from_secs(secs));
                proxy.set_mode(Mode::Forward);
            }
            Fault::Reset => proxy.reset_all(),
            Fault::Latency(ms) => {
                proxy.set_latency(Duration::from_millis(ms));
                std::thread::sleep(step);
                proxy.set_latency(Duration::ZERO);
            }
            Fault::Throttle(bps) => {
                proxy.set_rate(bps);
                std::thread::sleep(step);
                proxy.set_rate(0);
            }
            Fault::Loss(pct) => {
                proxy.set_loss(pct);
                std::thread::sleep(step);
                proxy.set_loss(0);
            }
            Fault::DropPubacks => {
                proxy.set_mode(Mode::DropPubacks);
                std::thread::sleep(step);
                proxy.set_mode(Mode::Forward);
            }
            Fault::KillAgent => {
                agent.kill9();
                agent = AgentProc::spawn(&cfg, &[], dir.path());
            }
            Fault::RestartBroker => {
                broker.stop_graceful();
                broker.restart();
            }
        }
        std::thread::sleep(step);
    }
    proxy.set_mode(Mode::Forward);
    agent.terminate(Duration::from_secs(15));

    // Drain with no new readings.
    let unacked = |db: &Path| {
        let s = support::spool::states(db);
        s.n("PENDING") + s.n("SENT")
    };
    let mut drain = AgentProc::spawn(&cfg, &["sources=[]".into()], dir.path());
    let drained = support::wait_for(Duration::from_secs(180), || unacked(&db) == 0);
    drain.terminate(Duration::from_secs(15));
    // Let the sink take what the broker still queues for it.
    let sink_count = || -> i64 {
        rusqlite::Connection::open(&sink_db)
            .and_then(|c| c.query_row("SELECT count(*) FROM received", [], |r| r.get(0)))
            .unwrap_or(0)
    };
    let rows = support::spool::rows(&db);
    // The sink may run under qemu on a loaded machine: wait up to one
    // overall deadline (10 min). A quiet gap is no reason to stop: a slow
    // machine has long ones, and stopping early would report loss.
    let _ = support::wait_for(Duration::from_secs(600), || {
        sink_count() >= rows.len() as i64
    });
    std::thread::sleep(Duration::from_secs(1));
    sink.terminate();

    let sink_conn = rusqlite::Connection::open(&sink_db).expect("open sink db");
    let digest_at_sink = |id: &str| -> Option<Vec<u8>> {
        sink_conn
            .query_row(
                "SELECT payload FROM received WHERE event_id = ?1",
                [id],
                |r| r.get(0),
            )
            .ok()
    };
    let (mut delivered, mut lost, mut retired_unseen, mut payload_differs) = (0, 0, 0, 0);
    for r in &rows {
        match digest_at_sink(&r.event_id) {
            Some(p) => {
                delivered += 1;
                if p != r.payload {
                    payload_differs += 1;
                }
            }
            None => {
                lost += 1;
                if r.state == "ACKED" {
                    retired_unseen += 1;
                }
            }
        }
    }
    let q = |sql: &str| -> i64 { sink_conn.query_row(sql, [], |r| r.get(0)).unwrap_or(-1) };
    let duplicates = q("SELECT coalesce(sum(deliveries - 1), 0) FROM received");
    let mismatches = q("SELECT count(*) FROM mismatches");
    let slowest = q("SELECT coalesce(max(first_ms - ts_ms), 0) FROM received");
    let qc: String = support::spool::open(&db)
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .unwrap_or_else(|e| e.to_string());

    println!(
        "rig: produced {} events, delivered {delivered}, lost {lost}, duplicate deliveries {duplicates}, retired without reaching the broker {retired_unseen}, payload mismatches {}, slowest first delivery {slowest} ms, ran {:.0} s",
        rows.len(),
        mismatches + payload_differs,
        started.elapsed().as_secs_f64()
    );
    let checks = [
        ("readings were produced", !rows.is_empty()),
        ("the spool drained", drained),
        ("no event lost (I1)", lost == 0),
        (
            "no row retired without reaching the broker (I2)",
            retired_unseen == 0,
        ),
        (
            "no payload mismatch for one event id (I3)",
            mismatches == 0 && payload_differs == 0,
        ),
        ("spool quick_check ok", qc == "ok"),
    ];
    let mut failed = 0;
    for (name, ok) in checks {
        println!("rig: {} {name}", if ok { "PASS" } else { "FAIL" });
        if !ok {
            failed += 1;
        }
    }
    println!("{} passed, {} failed", checks.len() - failed, failed);
    if failed > 0 {
        println!("rig: agent log tail:\n{}", drain.log_tail(30));
        // exit() skips destructors: stop the broker and the proxy first, so
        // a failed run leaves no mosquitto behind.
        drop(proxy);
        drop(broker);
        std::process::exit(1);
    }
}
