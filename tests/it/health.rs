//! Health that tells the truth: refusals and outages show as `degraded` with
//! their reason, logged at WARN, and data that can flow keeps flowing;
//! `starting` until the first CONNACK, a listener that cannot bind named,
//! the bounds logged at start the ones in force (issue 36).

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::{append_config, Board};
use crate::support::broker::Broker;
use crate::support::proxy::{Mode, Proxy};
use crate::support::spool::{count_in_state, rows_in_state};
use crate::support::subscriber::Subscriber;
use crate::support::wait_for;
use std::path::Path;
use std::time::Duration;

fn status(db: &Path) -> String {
    run_cli(&["status", "--spool", db.to_str().expect("utf-8")]).1
}

/// A broker that answers the command subscription by closing the connection
/// (aedes does on an ACL deny) must not stop telemetry: after three such
/// closes in a row the agent connects without the subscription (trying it
/// again within seconds, `broker_word.rs`), delivers, and says `commands
/// unavailable`.
#[test]
fn telemetry_flows_when_the_broker_closes_connections_on_the_command_subscription() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::CloseOnSubscribe);
    let prefix = crate::prefix("subkill");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 200);
    let sub = Subscriber::events(broker.port(), &prefix);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || sub.count() >= 10),
        "telemetry did not flow: {} delivered\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(20), || {
            let log = agent.log_text();
            log.contains("ERROR") && log.contains("connecting without it")
        }),
        "{}",
        agent.log_tail(30)
    );
    assert!(proxy.closed_on_packet() >= 3);
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = status(&db);
            s.contains("health: degraded") && s.contains("commands unavailable")
        }),
        "{}",
        status(&db)
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: commands unavailable"));
    agent.terminate(Duration::from_secs(15));
}

/// An event the broker answers by closing the connection (larger than its
/// packet limit) is set aside after `fail_after_disconnects` quick drops,
/// never FAILED for it: the rows behind it are delivered and health names
/// it. The board's own limit (`mqtt.max_packet_bytes`) FAILs it; lifted,
/// `requeue-failed` sends it again, same event id and bytes.
#[test]
fn an_event_the_broker_refuses_by_disconnecting_is_set_aside_and_the_rest_flow() {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_max_publish(2000);
    let prefix = crate::prefix("oversized");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 1000);
    let sub = Subscriber::events(broker.port(), &prefix);
    {
        let mut s = Spool::open(&db, &SpoolOptions::default()).expect("spool");
        let mut ids = EventIdGen::new().expect("ids");
        let ev = |text: String| NewEvent {
            replay: None,
            stream: "big".into(),
            ts_ms: 1,
            clock_trusted: true,
            mono: None,
            fields: vec![("t".into(), FieldValue::Text(text))],
            key: None,
            reply: None,
        };
        let mut evs: Vec<NewEvent> = (0..5).map(|i| ev(format!("small {i}"))).collect();
        evs.push(ev("x".repeat(3000)));
        evs.extend((5..10).map(|i| ev(format!("small {i}"))));
        s.append(&evs, &mut ids, "it-board", Format::Json, 1)
            .expect("append");
    }
    // The test sends requeue-failed unsigned.
    let sets = ["sources=[]".into(), "commands.allow_unsigned=true".into()];
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || sub.count() >= 10),
        "only {} of the 10 small events arrived\n{}",
        sub.count(),
        agent.log_tail(30)
    );
    assert!(
        wait_for(Duration::from_secs(20), || status(&db)
            .contains("set aside after the connection dropped")),
        "{}\n{}",
        status(&db),
        agent.log_tail(30)
    );
    assert!(proxy.closed_on_packet() >= 3);
    assert_eq!(
        count_in_state(&db, "FAILED"),
        0,
        "the broker's word FAILED it"
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: "));
    agent.terminate(Duration::from_secs(15));
    // The board's own limit says it can never go: FAILED at once, named.
    let mut sets_limited = sets.to_vec();
    sets_limited.push("mqtt.max_packet_bytes=2000".into());
    let mut agent = AgentProc::spawn(&cfg, &sets_limited, dir.path());
    assert!(
        wait_for(Duration::from_secs(20), || count_in_state(&db, "FAILED")
            == 1),
        "{:?}\n{}",
        crate::support::spool::count_by_state(&db),
        agent.log_tail(40)
    );
    let failed = rows_in_state(&db, "FAILED");
    assert!(failed[0].payload.len() > 2000, "the wrong row failed");
    assert!(
        wait_for(Duration::from_secs(20), || status(&db)
            .contains("rows FAILED in the spool")),
        "{}",
        status(&db)
    );
    let text = status(&db);
    assert!(
        text.contains("failed rows") && text.contains("exceeds mqtt.max_packet_bytes 2000"),
        "{text}"
    );
    agent.terminate(Duration::from_secs(15));
    assert!(
        sub.deliveries().iter().all(|d| d.payload.len() < 2000),
        "the oversized event was delivered"
    );
    // Both limits lifted, requeue-failed sends it again: appended as a new
    // row with the same event id and bytes, after every other row.
    proxy.set_max_publish(0);
    let mut agent = AgentProc::spawn(&cfg, &sets, dir.path());
    crate::commands::publish(
        broker.port(),
        &format!("{prefix}/commands"),
        br#"{"command_id":"rq-1","name":"requeue-failed"}"#,
        false,
    );
    assert!(
        wait_for(Duration::from_secs(30), || sub
            .deliveries()
            .iter()
            .any(|d| d.payload == failed[0].payload)),
        "the requeued event did not arrive\n{}",
        agent.log_tail(30)
    );
    assert_eq!(count_in_state(&db, "FAILED"), 0);
    agent.terminate(Duration::from_secs(15));
}

/// The broker unreachable: `degraded: not connected ...` within the bound
/// (twice the keep-alive, at least 30 s), logged at WARN with the cause; `ok`
/// again once the broker is back.
#[test]
fn an_unreachable_broker_degrades_health_within_the_bound_and_recovers() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let prefix = crate::prefix("unreachable");
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &prefix, 500);
    let mut agent = AgentProc::spawn(&cfg, &["mqtt.keep_alive_secs=5".into()], dir.path());
    let t = std::time::Instant::now();
    assert!(
        wait_for(Duration::from_secs(60), || status(&db)
            .contains("health: degraded: not connected to")),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    let after = t.elapsed();
    println!(
        "unreachable broker: degraded after {} ms (bound 30 s + a maintenance pass)",
        after.as_millis()
    );
    assert!(
        after >= Duration::from_secs(25),
        "degraded before the bound: {after:?}"
    );
    assert!(agent.logged("WARN", "agent", "] health degraded: not connected"));
    // For machines: health as an object, counts as objects.
    let json = run_cli(&["status", "--json", "--spool", db.to_str().expect("utf-8")]).1;
    let v: serde_json::Value = serde_json::from_str(&json).expect("status --json");
    assert_eq!(v["health"]["state"], "degraded", "{json}");
    assert!(v["health"]["reasons"][0]
        .as_str()
        .is_some_and(|r| r.starts_with("not connected")));
    assert!(v["health"]["since_ms"].as_i64().is_some(), "{json}");
    assert!(
        v["totals"]["PENDING"].as_i64().is_some_and(|n| n > 0),
        "{json}"
    );
    assert!(
        v["counters"].is_object() && v["agent_state"].is_object(),
        "{json}"
    );
    proxy.set_mode(Mode::Forward);
    assert!(
        wait_for(Duration::from_secs(30), || status(&db)
            .contains("health: ok")),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}

/// Under systemd (`JOURNAL_STREAM` set) each line starts with its syslog
/// priority and has no second timestamp; the journal stamps it.
#[test]
fn log_lines_fit_the_journal_when_journal_stream_is_set() {
    let broker = Broker::start();
    let prefix = crate::prefix("journal");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 500);
    let mut agent =
        AgentProc::spawn_with_env(&cfg, &[], dir.path(), &[("JOURNAL_STREAM", "8:4242")]);
    assert!(agent.wait_log(Duration::from_secs(20), "mqtt: connected"));
    agent.terminate(Duration::from_secs(15));
    let log = agent.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for l in &lines {
        assert!(
            ["<3>", "<4>", "<6>", "<7>"]
                .iter()
                .any(|p| l.starts_with(p)),
            "no priority prefix: {l}"
        );
        assert!(
            !l.contains("Z INFO") && !l.contains("Z DEBUG"),
            "a timestamp: {l}"
        );
    }
    // The target is the part, `edgespool::mqtt`, or a module inside it.
    let connected = |l: &&str| {
        l.strip_prefix("<6>edgespool::mqtt").is_some_and(|r| {
            let (module, text) = r.split_once(": ").unwrap_or((r, ""));
            (module.is_empty() || module.starts_with("::")) && text.starts_with("mqtt: connected")
        })
    };
    assert!(lines.iter().any(connected), "{log}");
}

/// The retained `<prefix>/status` says `online` (with version, config sha256
/// and backlog) once connected, and `offline` after a clean stop and after
/// `kill -9` (the broker publishes the will).
#[test]
fn the_retained_status_topic_says_online_then_offline_after_a_stop_or_a_kill() {
    let broker = Broker::start();
    let prefix = crate::prefix("status");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 500);
    let topic = format!("{prefix}/status");
    let last_state = |sub: &Subscriber| -> Option<serde_json::Value> {
        sub.deliveries()
            .iter()
            .rev()
            .find(|d| d.topic == topic)
            .and_then(|d| serde_json::from_slice(&d.payload).ok())
    };
    for how in ["stop", "kill"] {
        let sub = Subscriber::start(broker.port(), &topic);
        assert!(sub.wait_subscribed(Duration::from_secs(10)));
        let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
        assert!(
            wait_for(Duration::from_secs(20), || last_state(&sub)
                .is_some_and(|v| v["state"] == "online")),
            "{how}: no online status\n{}",
            agent.log_tail(20)
        );
        let online = last_state(&sub).expect("online");
        assert_eq!(online["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(
            online["config_sha256"].as_str().map(str::len),
            Some(64),
            "{online}"
        );
        assert!(online["backlog"].is_u64(), "{online}");
        if how == "stop" {
            agent.terminate(Duration::from_secs(15));
        } else {
            agent.kill9();
        }
        assert!(
            wait_for(Duration::from_secs(20), || last_state(&sub)
                .is_some_and(|v| v["state"] == "offline")),
            "{how}: no offline status"
        );
    }
}

/// `GET /metrics` on the agent's listener at 127.0.0.1:`port`: the body, or
/// empty when nothing answers.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// Issue 36: health said `ok` for 55 s while the agent had never
/// connected. Until the first CONNACK it is `starting` (in `status` and in
/// `edgespool_health{state}`), never `ok`; `ok` once the broker answers.
#[test]
fn health_is_starting_until_the_first_connack_never_ok_before() {
    let broker = Broker::start();
    let proxy = Proxy::start(broker.port());
    proxy.set_mode(Mode::Refuse);
    let Board { dir, cfg, db } = Board::new(&proxy.url(), &crate::prefix("starting"), 500);
    let port = crate::support::free_port();
    append_config(&cfg, &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\n"));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let t = std::time::Instant::now();
    let mut seen = Vec::new();
    // Past two maintenance passes (5 s each) and several summaries, well
    // inside the connection grace (30 s at least).
    while t.elapsed() < Duration::from_secs(14) {
        let s = status(&db);
        let line = s
            .lines()
            .find(|l| l.starts_with("health:"))
            .unwrap_or("no health line")
            .to_owned();
        assert!(
            !line.starts_with("health: ok"),
            "ok at {} ms without a connection\n{s}",
            t.elapsed().as_millis()
        );
        seen.push(line);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        seen.last()
            .is_some_and(|l| l.starts_with("health: starting")),
        "{seen:?}\n{}",
        agent.log_tail(20)
    );
    let body = scrape(port);
    assert!(
        body.contains("edgespool_health{state=\"starting\"} 1")
            && body.contains("edgespool_health{state=\"ok\"} 0"),
        "{body}"
    );
    proxy.set_mode(Mode::Forward);
    assert!(
        wait_for(Duration::from_secs(30), || status(&db)
            .contains("health: ok")),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    assert!(
        wait_for(Duration::from_secs(10), || scrape(port)
            .contains("edgespool_health{state=\"ok\"} 1")),
        "{}",
        scrape(port)
    );
    println!(
        "health before the first CONNACK: {} polls over 14 s, none ok (before: ok from the first pass, about 5 s)",
        seen.len()
    );
    agent.terminate(Duration::from_secs(15));
}

/// Issue 36: health said `ok` while `metrics.listen` could not bind. It is
/// degraded from the first record, naming the key, the address and the
/// cause; the agent delivers all the same.
#[test]
fn a_metrics_listener_that_cannot_bind_degrades_health_and_delivery_goes_on() {
    let broker = Broker::start();
    let Board { dir, cfg, db } = Board::new(&broker.url(), &crate::prefix("listen-taken"), 200);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    append_config(&cfg, &format!("[metrics]\nlisten = \"{addr}\"\n"));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let want = format!("health: degraded: not listening: metrics.listen {addr}");
    assert!(
        wait_for(Duration::from_secs(15), || status(&db).contains(&want)
            && count_in_state(&db, "ACKED") > 0),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    assert!(agent.logged(
        "WARN",
        "agent",
        "] health degraded: not listening: metrics.listen"
    ));
    assert!(agent.is_running());
    drop(taken);
    agent.terminate(Duration::from_secs(15));
}

/// Issue 36, the ingest listeners: a TCP address another program holds
/// stopped the start (a restart loop under systemd); the agent now runs
/// without it, and health names it with the socket another process holds.
#[test]
fn ingest_listeners_that_cannot_bind_degrade_health_and_the_agent_runs_on() {
    let broker = Broker::start();
    let Board { dir, cfg, db } = Board::new(&broker.url(), &crate::prefix("ingest-taken"), 200);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let sock = crate::support::board::add_ingest(
        &cfg,
        &format!("tcp = \"{addr}\"\n[[ingest.streams]]\nname = \"pump\"\n"),
    );
    std::fs::create_dir_all(sock.parent().expect("dir")).expect("mkdir");
    let squatter = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let degraded = || {
        let s = status(&db);
        s.contains(&format!("not listening: ingest.tcp {addr}"))
            && s.contains("ingest socket not ours")
            && count_in_state(&db, "ACKED") > 0
    };
    assert!(
        wait_for(Duration::from_secs(20), degraded),
        "{}\n{}",
        status(&db),
        agent.log_tail(20)
    );
    assert!(agent.logged("ERROR", "ingest", &format!("ingest.tcp {addr}: ")));
    assert!(agent.is_running());
    drop((taken, squatter));
    agent.terminate(Duration::from_secs(15));
}

/// Issue 36: the start-up log gave the storage probe's bound (42 GB on the
/// board tried; half the free space) while `spool.max_bytes` held the spool
/// to 1 GiB. The line of the bounds in force names each bound's source.
#[test]
fn the_bounds_logged_at_start_are_the_bounds_in_force() {
    let broker = Broker::start();
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &crate::prefix("bounds"), 500);
    let mut agent = AgentProc::spawn(&cfg, &["spool.max_bytes=1073741824".into()], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || agent
            .log_text()
            .contains("bounds in force:")),
        "{}",
        agent.log_tail(20)
    );
    let log = agent.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("bounds in force:"))
        .expect("the line");
    assert!(
        line.contains("spool bound 1073741824 bytes (spool.max_bytes; the probe proposed ")
            && line.contains("commit window 50 ms (spool.commit_window_ms)"),
        "{line}"
    );
    // No other line gives a spool bound as if it were in force.
    for l in log.lines().filter(|l| l.contains("spool bound")) {
        assert!(
            l.contains("spool bound 1073741824 bytes") || l.contains("proposes"),
            "a bound not in force, not said to be a proposal: {l}"
        );
    }
    println!("{line}");
    agent.terminate(Duration::from_secs(15));
}
