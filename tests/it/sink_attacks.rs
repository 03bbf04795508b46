//! The fleet side attacked as another device or a local user would (issue
//! 33), against the real `edgespool` binary, a real mosquitto and the real
//! sink (SQLite, and PostgreSQL where the store's path differs). Each test
//! names what it found before the fix.
//!
//! - One message never stalls the sink: a 17 MiB publish on a device's own
//!   topic (over the sink's 16 MiB incoming limit) is read on one session
//!   with a raised limit, set aside in `unreadable` with its topic, size and
//!   reason, and acknowledged; the events published after it are stored.
//!   Before: the sink reconnected, got it again, and stored nothing more.
//! - Side tables are bounded per device: 12,000 forged envelopes from one
//!   device leave another device's `forged` row in place. Before: the global
//!   bound (10,000 rows, oldest first) evicted it.
//! - Password files: the sink's `--password-file` (and `password_file` of its
//!   settings file) and the agent's `mqtt.password_file` are refused when
//!   group or others may read them, or when the name is a symbolic link.
//!   Before: the sink started with a 0644 file, the agent logged in through a
//!   symlink.
//! - Client ids bound to users in docs/fleet.md's layout (read from the page):
//!   another device connecting under the sink's or a board's client id kicks
//!   neither and wipes no session. Before: it kicked them and the sink's
//!   persistent session was wiped (every PUBACKed event queued in it lost).
//!   In receipt mode a wiped sink session loses nothing: the board sends
//!   again what has no receipt.
//! - The device is read at the one level the sink's filter fixes (F8): a
//!   subscription to `edgespool/#` in the sink's session lets `evil` deliver
//!   `edgespool/evil/gw1/events/load` claiming gw1; it is set aside in
//!   `forged`, under evil. Before: 4 of evil's readings stored as gw1's. A
//!   filter that fixes no device level is refused at start (exit 2), and so
//!   is a shared subscription's group that is no MQTT 5 ShareName (empty, or
//!   with a `/`, `+` or `#`), from `--share` or `$share/` in the filter.
//! - One event sent again and again grows no table (F6): 200 batches of
//!   1,000 copies leave one `redeliveries` row counting 199,999. Before:
//!   199,999 rows in `duplicates`, 13.7 MB.
//!
//! Each test prints its before/after figure (`--no-capture`).

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use crate::support::sink::{SinkProc, BROKER_EXTRA};
use crate::support::{spool, tail, unique_suffix, wait_for};
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS, RecvTimeoutError};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A JSON envelope of `device`, stream `load`, number `n` (`tag` keeps two
/// devices' ids apart when they should be).
fn envelope(device: &str, tag: u32, n: u32) -> Vec<u8> {
    format!(
        r#"{{"event_id":"{tag:08x}-0000-4000-8000-{n:012x}","device_id":"{device}","stream":"load","seq":{seq},"ts_ms":{ts},"clock_trusted":true,"fields":{{"n":{n}}}}}"#,
        seq = n + 1,
        ts = 1_800_000_000_000u64 + u64::from(n),
    )
    .into_bytes()
}

/// Publish `msgs` at QoS 1 as one client (`login`: user and password;
/// `client_id`: the id to claim, else a unique one) and wait for every
/// PUBACK; panics after 120 s.
fn publish_all(
    port: u16,
    login: Option<(&str, &str)>,
    client_id: Option<&str>,
    msgs: Vec<(String, Vec<u8>)>,
) {
    let id = client_id.map_or_else(|| format!("attacker-{}", unique_suffix()), str::to_owned);
    let mut o = MqttOptions::new(id.clone(), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_max_packet_size(1 << 20, 32 << 20);
    o.set_inflight(100);
    if let Some((u, p)) = login {
        o.set_credentials(u, p);
    }
    let (client, mut conn) = Client::new(o, 200);
    let n = msgs.len();
    let sender = std::thread::spawn(move || {
        for (topic, payload) in msgs {
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
                .expect("queue a publish");
        }
        client
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut acked = 0;
    while acked < n {
        assert!(Instant::now() < deadline, "{id}: {acked} of {n} PUBACKs");
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Err(e)) => panic!("{id}: {e} after {acked} of {n} PUBACKs"),
            Err(RecvTimeoutError::Disconnected) => panic!("{id}: event loop closed"),
        }
    }
    let client = sender.join().expect("publisher thread");
    let _ = client.try_disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(200));
}

/// Connect as `client_id` (with `login`, clean session as given), hold the
/// connection `hold`, disconnect. Whether the broker accepted it.
fn connect_as(
    port: u16,
    login: Option<(&str, &str)>,
    client_id: &str,
    clean: bool,
    hold: Duration,
) -> bool {
    let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_clean_session(clean);
    if let Some((u, p)) = login {
        o.set_credentials(u, p);
    }
    let (client, mut conn) = Client::new(o, 10);
    let mut accepted = false;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match conn.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(c)))) => {
                accepted = c.code == rumqttc::ConnectReturnCode::Success;
                break;
            }
            Ok(Err(_)) => break,
            _ => {}
        }
    }
    let until = Instant::now() + hold;
    while accepted && Instant::now() < until {
        if let Ok(Err(_)) = conn.recv_timeout(Duration::from_millis(50)) {
            break;
        }
    }
    let _ = client.try_disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(200));
    accepted
}

/// The sink's store, as these tests read it.
enum Db {
    Sqlite(PathBuf),
    #[cfg(feature = "pg-sink")]
    Postgres(crate::support::postgres::Postgres),
}

impl Db {
    fn sqlite(dir: &Path) -> Db {
        Db::Sqlite(dir.join("sink.db"))
    }

    /// One number a query gives (-1 while it cannot be read); `sqlite` and
    /// `pg` say the same in each dialect.
    fn number(&self, sqlite: &str, pg: &str) -> i64 {
        match self {
            Db::Sqlite(p) => rusqlite::Connection::open(p)
                .and_then(|c| {
                    c.busy_timeout(Duration::from_secs(5))?;
                    c.query_row(sqlite, [], |r| r.get(0))
                })
                .unwrap_or(-1),
            #[cfg(feature = "pg-sink")]
            Db::Postgres(pg_) => pg_
                .client()
                .query_one(pg, &[])
                .map(|r| r.get(0))
                .unwrap_or(-1),
        }
    }

    /// Events stored for `device`.
    fn events_of(&self, device: &str) -> i64 {
        self.number(
            &format!("SELECT count(*) FROM received WHERE device_id = '{device}'"),
            &format!("SELECT count(*) FROM events WHERE device_id = '{device}'"),
        )
    }

    /// Rows of a side table whose topic is `topic`.
    fn side_rows(&self, table: &str, topic: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table} WHERE topic = '{topic}'");
        self.number(&sql, &sql)
    }

    /// The sink, storing here, as client `id` with more `args`.
    fn spawn_sink(&self, port: u16, filter: &str, id: &str, dir: &Path, args: &[&str]) -> SinkProc {
        match self {
            Db::Sqlite(p) => SinkProc::spawn_sqlite_with(port, filter, p, id, dir, args),
            #[cfg(feature = "pg-sink")]
            Db::Postgres(pg) => {
                let conninfo = pg.conninfo();
                let mut all = vec!["--postgres", &conninfo, "--client-id", id];
                all.extend_from_slice(args);
                SinkProc::launch_args(port, filter, id, dir, &all)
            }
        }
    }
}

/// A number of the sink's last summary line (`sink: first N ...`), 0 when
/// the word is not there.
fn summary(log: &str, word: &str) -> u64 {
    log.lines()
        .rev()
        .find(|l| l.contains("sink: first "))
        .and_then(|line| {
            let w: Vec<&str> = line.split_whitespace().collect();
            w.windows(2)
                .find(|p| p[0] == word)
                .and_then(|p| p[1].parse().ok())
        })
        .unwrap_or(0)
}

/// Events of gw1 published after the 17 MiB message.
const AFTER_BIG: u32 = 20;

/// A 17 MiB publish on `evil`'s own events topic, then 20 events of gw1:
/// every one of gw1's events is stored, the big one is kept aside with its
/// topic, size and reason (its first 64 KiB at most), acknowledged, and the
/// sink runs on. Before: 0 of 20 stored, the sink reconnecting for ever.
fn a_17_mib_publish_does_not_stall(db: Db) {
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sink = db.spawn_sink(
        broker.port(),
        "edgespool/+/events/#",
        "big-sink",
        dir.path(),
        &[],
    );
    sink.wait_subscribed();
    let big = vec![b'x'; 17 << 20];
    let big_topic = "edgespool/evil/events/load";
    publish_all(broker.port(), None, None, vec![(big_topic.to_owned(), big)]);
    let gw1: Vec<(String, Vec<u8>)> = (0..AFTER_BIG)
        .map(|n| {
            (
                "edgespool/gw1/events/load".to_owned(),
                envelope("gw1", 1, n),
            )
        })
        .collect();
    publish_all(broker.port(), None, None, gw1);
    let all = wait_for(Duration::from_secs(60), || {
        db.events_of("gw1") == i64::from(AFTER_BIG)
    });
    let stored = db.events_of("gw1");
    println!(
        "events of gw1 stored after a 17 MiB publish: {stored} of {AFTER_BIG}; \
         sink reconnects: {}",
        sink.log_text().matches("connection lost").count()
    );
    assert!(
        all,
        "{stored} of {AFTER_BIG} events stored after the 17 MiB publish\n{}",
        tail(&sink.log_text(), 20)
    );
    assert_eq!(db.side_rows("unreadable", big_topic), 1);
    let (bytes, kept) = (
        db.number(
            "SELECT payload_bytes FROM unreadable",
            "SELECT payload_bytes FROM unreadable",
        ),
        db.number(
            "SELECT length(payload) FROM unreadable",
            "SELECT octet_length(payload)::int8 FROM unreadable",
        ),
    );
    assert_eq!(bytes, 17 << 20, "the delivered size is kept");
    assert!(kept <= 64 << 10, "{kept} bytes of the payload kept");
    let reason = match &db {
        Db::Sqlite(p) => rusqlite::Connection::open(p)
            .and_then(|c| c.query_row("SELECT reason FROM unreadable", [], |r| r.get(0)))
            .unwrap_or_default(),
        #[cfg(feature = "pg-sink")]
        Db::Postgres(pg) => pg
            .client()
            .query_one("SELECT reason FROM unreadable", &[])
            .map(|r| r.get(0))
            .unwrap_or_default(),
    };
    let reason: String = reason;
    assert!(reason.contains("17825"), "{reason}");
    assert!(
        sink.log_text().contains("WARN") && sink.log_text().contains("17825"),
        "no WARN naming the size:\n{}",
        tail(&sink.log_text(), 20)
    );
    for l in sink
        .log_text()
        .lines()
        .filter(|l| l.contains("incoming limit"))
    {
        println!("{l}");
    }
    // Acknowledged: a sink started again under the same id gets nothing more.
    sink.terminate();
    assert_eq!(summary(&sink.log_text(), "oversized"), 1);
    let again = db.spawn_sink(
        broker.port(),
        "edgespool/+/events/#",
        "big-sink",
        dir.path(),
        &[],
    );
    again.wait_subscribed();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(db.side_rows("unreadable", big_topic), 1, "delivered again");
    assert!(!again.log_text().contains("over the incoming limit"));
}

#[test]
fn a_17_mib_publish_does_not_stall_the_sqlite_sink() {
    let dir = tempfile::tempdir().expect("tempdir");
    a_17_mib_publish_does_not_stall(Db::sqlite(dir.path()));
}

#[cfg(feature = "pg-sink")]
#[test]
fn a_17_mib_publish_does_not_stall_the_postgres_sink() {
    let pg = crate::support::postgres::Postgres::start(&[("fsync", "off")]);
    a_17_mib_publish_does_not_stall(Db::Postgres(pg));
}

/// Forged envelopes the junk device sends (more than the global bound).
const JUNK: u32 = 12_000;

/// `evil2` claims one reading of gw1 (forged, kept under evil2), then `junk`
/// sends 12,000 envelopes claiming gw1 on its own topic. With the default
/// bounds evil2's row stays; junk keeps at most its own share. Before:
/// evil2's row was evicted (0 of 1 kept).
fn one_devices_junk_keeps_another_devices_evidence(db: Db) {
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut sink = db.spawn_sink(
        broker.port(),
        "edgespool/+/events/#",
        "bounds-sink",
        dir.path(),
        &[],
    );
    sink.wait_subscribed();
    let evidence = "edgespool/evil2/events/load";
    publish_all(
        broker.port(),
        None,
        None,
        vec![(evidence.to_owned(), envelope("gw1", 2, 0))],
    );
    assert!(
        wait_for(Duration::from_secs(20), || db.side_rows("forged", evidence)
            == 1),
        "evil2's forged envelope was not set aside\n{}",
        tail(&sink.log_text(), 20)
    );
    let junk_topic = "edgespool/junk/events/load";
    let junk: Vec<(String, Vec<u8>)> = (0..JUNK)
        .map(|n| (junk_topic.to_owned(), envelope("gw1", 3, n)))
        .collect();
    publish_all(broker.port(), None, None, junk);
    let settled = wait_for(Duration::from_secs(120), || {
        db.number(
            "SELECT coalesce(sum(dropped), 0) + (SELECT count(*) FROM forged) FROM side_drops",
            "SELECT coalesce(sum(dropped), 0)::int8 + (SELECT count(*) FROM forged) FROM side_drops",
        ) > i64::from(JUNK)
    });
    let kept = db.side_rows("forged", evidence);
    let junk_kept = db.side_rows("forged", junk_topic);
    println!(
        "after {JUNK} forged envelopes from junk: evil2's forged row kept {kept} of 1, \
         junk's rows kept {junk_kept}"
    );
    assert!(
        settled,
        "the sink did not take the junk\n{}",
        tail(&sink.log_text(), 20)
    );
    assert_eq!(
        kept, 1,
        "one device's junk evicted another device's forged row"
    );
    assert!(
        junk_kept <= 1_000,
        "junk kept {junk_kept} rows, over its own share"
    );
    sink.terminate();
}

#[test]
fn one_devices_junk_keeps_another_devices_evidence_in_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    one_devices_junk_keeps_another_devices_evidence(Db::sqlite(dir.path()));
}

#[cfg(feature = "pg-sink")]
#[test]
fn one_devices_junk_keeps_another_devices_evidence_in_postgres() {
    let pg = crate::support::postgres::Postgres::start(&[("fsync", "off")]);
    one_devices_junk_keeps_another_devices_evidence(Db::Postgres(pg));
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The sink with `args` (a password file among them) exits 2 at once, and
/// says `words` on stderr. Before: it started (no exit within 10 s).
fn sink_refuses(dir: &Path, port: u16, args: &[&str], words: &[&str]) {
    let db = dir.join("sink.db");
    let url = format!("mqtt://127.0.0.1:{port}");
    let mut all = vec!["--url", &url, "--topic", "edgespool/+/events/#"];
    all.extend(["--db", db.to_str().expect("UTF-8 path")]);
    all.extend_from_slice(args);
    let mut sink = SinkProc::launch_only("pw-sink", dir, &all, &[]);
    let status = sink.wait_exit(Duration::from_secs(10));
    let log = sink.log_text();
    println!("sink {args:?}: exit {status:?}: {}", log.trim());
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "the sink was not refused:\n{log}"
    );
    for w in words {
        assert!(log.contains(w), "{w:?} not in:\n{log}");
    }
}

#[test]
fn the_sink_refuses_a_password_file_others_can_read_or_a_symlink() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = Broker::start();
    let file = dir.path().join("sink.password");
    std::fs::write(&file, "secret\n").expect("write");
    let shown = file.display().to_string();
    chmod(&file, 0o644);
    let args = ["--username", "sink", "--password-file", shown.as_str()];
    sink_refuses(
        dir.path(),
        broker.port(),
        &args,
        &[&shown, "0644", "chmod 600"],
    );
    chmod(&file, 0o640);
    sink_refuses(
        dir.path(),
        broker.port(),
        &args,
        &[&shown, "0640", "chmod 600"],
    );
    // A symlink to a file of the right mode: the name is refused, the
    // target never read.
    chmod(&file, 0o600);
    let link = dir.path().join("link.password");
    std::os::unix::fs::symlink(&file, &link).expect("symlink");
    let shown_link = link.display().to_string();
    let args = ["--username", "sink", "--password-file", shown_link.as_str()];
    sink_refuses(
        dir.path(),
        broker.port(),
        &args,
        &[&shown_link, "symbolic link"],
    );
    // The settings file's password_file, the same.
    chmod(&file, 0o604);
    let settings = dir.path().join("sink.toml");
    std::fs::write(
        &settings,
        format!("[sink]\nusername = \"sink\"\npassword_file = \"{shown}\"\n"),
    )
    .expect("write settings");
    let s = settings.display().to_string();
    sink_refuses(
        dir.path(),
        broker.port(),
        &["--config", &s],
        &[&shown, "0604", "chmod 600"],
    );
    // Mode 0600, the file itself: it runs.
    chmod(&file, 0o600);
    let db = dir.path().join("ok.db");
    let mut sink = SinkProc::spawn_sqlite_with(
        broker.port(),
        "edgespool/+/events/#",
        &db,
        "pw-ok",
        dir.path(),
        &["--username", "sink", "--password-file", &shown],
    );
    sink.wait_subscribed();
    sink.terminate();
}

/// A board config logging in to docs/fleet.md's broker as gw1 with the
/// password file `password_file`.
fn gw1_config(dir: &Path, url: &str, password_file: &Path) -> PathBuf {
    let path = dir.join("board.toml");
    std::fs::write(
        &path,
        format!(
            r#"device_id = "gw1"
sources = []
[spool]
path = "{spool}"
[mqtt]
url = "{url}"
topic_prefix = "edgespool/gw1"
username = "gw1"
password_file = "{pw}"
reconnect_min_ms = 100
reconnect_max_ms = 500
connect_timeout_secs = 2
"#,
            spool = dir.join("spool.db").display(),
            pw = password_file.display()
        ),
    )
    .expect("write the board config");
    path
}

/// Whether the broker's log says gw1 logged in (`... as <id> (... u'gw1').`).
fn gw1_logged_in(broker: &Broker) -> bool {
    broker.log_text().contains("u'gw1'")
}

#[test]
fn the_agent_refuses_a_symlinked_or_group_readable_mqtt_password_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = crate::support::fleet::broker(dir.path(), "");
    let real = crate::support::fleet::password_file(dir.path(), "gw1");
    chmod(&real, 0o600);
    // Where a local user planted a link (the attack pointed it at
    // /etc/shadow): the agent must not follow it, whatever it points at.
    let link = dir.path().join("planted.password");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    let cfg = gw1_config(dir.path(), &broker.url(), &link);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let refused = wait_for(Duration::from_secs(10), || {
        agent.log_text().contains("symbolic link")
    });
    let followed = gw1_logged_in(&broker);
    println!("agent with a symlinked mqtt.password_file: logged in {followed}, refused {refused}");
    assert!(!followed, "the agent followed the symlink and logged in");
    assert!(
        refused,
        "no refusal naming the link:\n{}",
        agent.log_tail(20)
    );
    assert!(agent.log_text().contains(&link.display().to_string()));
    agent.terminate(Duration::from_secs(15));

    // Group-readable: refused too, naming the mode and what to run.
    chmod(&real, 0o640);
    let cfg = gw1_config(dir.path(), &broker.url(), &real);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let refused = wait_for(Duration::from_secs(10), || {
        let log = agent.log_text();
        log.contains("0640") && log.contains("chmod 600")
    });
    let logged_in = gw1_logged_in(&broker);
    println!("agent with a 0640 mqtt.password_file: logged in {logged_in}, refused {refused}");
    assert!(
        !logged_in,
        "the agent logged in with a group-readable password file"
    );
    assert!(
        refused,
        "no refusal naming the mode:\n{}",
        agent.log_tail(20)
    );
    // Fixed while it runs: read again at the next connect.
    chmod(&real, 0o600);
    assert!(
        wait_for(Duration::from_secs(15), || gw1_logged_in(&broker)),
        "the agent did not log in once the file was 0600:\n{}",
        agent.log_tail(20)
    );
    agent.terminate(Duration::from_secs(15));
}

/// gw1's events published while the sink is away.
const QUEUED: u32 = 5;

/// docs/fleet.md's layout (its mosquitto settings and ACL read from the
/// page): `evil` connects under the sink's client id and under gw1's, with
/// a clean session. Neither the sink nor the board is kicked, and the
/// sink's persistent session keeps what was queued in it. Before: each
/// connection closed the sink's or the board's, and 5 of 5 PUBACKed events
/// queued for the sink were lost with its session.
#[test]
fn in_the_fleet_layout_another_device_cannot_take_a_sinks_or_a_boards_client_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = crate::support::fleet::broker(dir.path(), BROKER_EXTRA);
    let evil = Some(("evil", "evil-secret"));
    let sink_id = "sink";
    let db = Db::sqlite(dir.path());
    let login = crate::support::fleet::sink_login(dir.path());
    let login: Vec<&str> = login.iter().map(String::as_str).collect();
    let filter = "edgespool/+/events/#";
    let mut sink = db.spawn_sink(broker.port(), filter, sink_id, dir.path(), &login);
    sink.wait_subscribed();
    let pw = crate::support::fleet::password_file(dir.path(), "gw1");
    chmod(&pw, 0o600);
    let agent_dir = dir.path().join("gw1");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let cfg = gw1_config(&agent_dir, &broker.url(), &pw);
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);
    assert!(
        wait_for(Duration::from_secs(20), || gw1_logged_in(&broker)),
        "gw1 did not log in:\n{}",
        agent.log_tail(20)
    );

    // Take-overs: evil under the sink's id and under the board's (the
    // agent's default `edgespool-<device_id>`, and the user name).
    let mut taken = 0;
    for id in [sink_id, "edgespool-gw1", "gw1", sink_id, "edgespool-gw1"] {
        if connect_as(broker.port(), evil, id, true, Duration::from_millis(300)) {
            taken += 1;
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let log = broker.log_text();
    let kicked = log
        .matches("already connected, closing old connection")
        .count();
    let sink_lost = sink.log_text().matches("connection lost").count();
    println!(
        "{taken} connections of evil under the sink's or gw1's client id: \
         {kicked} take-overs, the sink reconnected {sink_lost} times"
    );
    let kicks = tail(&log, 30);
    let sink_kicked = tail(&sink.log_text(), 20);

    // The wipe: the sink away, gw1's events queued in its session (PUBACKed
    // by the broker), evil connects under the sink's id with a clean start.
    sink.terminate();
    let gw1 = Some(("gw1", "gw1-secret"));
    let events: Vec<(String, Vec<u8>)> = (0..QUEUED)
        .map(|n| {
            (
                "edgespool/gw1/events/load".to_owned(),
                envelope("gw1", 4, n),
            )
        })
        .collect();
    agent.terminate(Duration::from_secs(15));
    publish_all(broker.port(), gw1, None, events);
    connect_as(
        broker.port(),
        evil,
        sink_id,
        true,
        Duration::from_millis(300),
    );
    let mut sink = db.spawn_sink(broker.port(), filter, sink_id, dir.path(), &login);
    sink.wait_subscribed();
    let all = wait_for(Duration::from_secs(15), || {
        db.events_of("gw1") == i64::from(QUEUED)
    });
    println!(
        "after evil's clean start under the sink's client id: {} of {QUEUED} queued events stored",
        db.events_of("gw1")
    );
    sink.terminate();
    assert_eq!(kicked, 0, "a client was kicked:\n{kicks}");
    assert_eq!(sink_lost, 0, "the sink was kicked:\n{sink_kicked}");
    assert!(
        all,
        "the sink's session was wiped\n{}",
        tail(&sink.log_text(), 20)
    );
}

/// Rows the board publishes while its sink is away.
const ROWS: usize = 40;

/// A board config for `device` under `prefix`, no sources (the spool is
/// seeded), retiring rows on `retire_on` with a 10 s receipt timeout.
fn receipt_board(dir: &Path, url: &str, prefix: &str, device: &str, retire_on: &str) -> PathBuf {
    let path = dir.join("board.toml");
    std::fs::write(
        &path,
        format!(
            r#"device_id = "{device}"
sources = []
[spool]
path = "{spool}"
commit_window_ms = 50
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
retire_on = "{retire_on}"
receipt_public_keys = ["{fleet}"]
receipt_timeout_secs = 10
reconnect_min_ms = 100
reconnect_max_ms = 800
connect_timeout_secs = 2
ack_timeout_secs = 3
[agent]
summary_interval_secs = 1
"#,
            spool = dir.join("spool.db").display(),
            fleet = crate::support::keys::fleet_key().key.public().hex(),
        ),
    )
    .expect("write the board config");
    path
}

/// Append `n` readings of stream `load` to the spool at `db`.
fn seed(db: &Path, device: &str, n: usize) {
    use edgespool::event::envelope::{EventIdGen, Format};
    use edgespool::event::reading::FieldValue;
    use edgespool::spool::{NewEvent, Spool, SpoolOptions};
    let mut s = Spool::open(db, &SpoolOptions::default()).expect("open the spool to seed it");
    let mut ids = EventIdGen::new().expect("event ids");
    let now = edgespool::event::envelope::wall_clock_ms().0;
    let evs: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                "load",
                now + i as i64,
                true,
                vec![("n".into(), FieldValue::Num(i as f64))],
            )
        })
        .collect();
    s.append(&evs, &mut ids, device, Format::Json, now)
        .expect("append the seeded readings");
}

/// What a wiped sink session cost, by how the board retires rows.
struct Wiped {
    acked: i64,
    stored: i64,
}

/// On a broker that lets anyone take a client id (not docs/fleet.md's
/// layout): the sink's session is created, the sink goes away, the board
/// publishes 40 rows (the broker PUBACKs them and queues them for the sink),
/// a clean-start connection under the sink's client id wipes the session,
/// the sink comes back. Returns the rows ACKED at the board and stored by
/// the sink once `settle` has passed (or all are both).
fn wipe_the_sinks_session(retire_on: &str, settle: Duration) -> Wiped {
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = crate::prefix("wipe");
    let device = "it-board";
    let filter = format!("{base}/+/events/#");
    let db = Db::sqlite(dir.path());
    let sink_id = format!("wiped-sink-{}", unique_suffix());
    let mut sink = db.spawn_sink(broker.port(), &filter, &sink_id, dir.path(), &[]);
    sink.wait_subscribed();
    sink.terminate();
    let agent_dir = dir.path().join("agent");
    std::fs::create_dir_all(&agent_dir).expect("agent dir");
    let spool_db = agent_dir.join("spool.db");
    seed(&spool_db, device, ROWS);
    let cfg = receipt_board(
        &agent_dir,
        &broker.url(),
        &format!("{base}/{device}"),
        device,
        retire_on,
    );
    // The broker has a row queued for the sink's session once it forwards
    // it to a subscriber (the status record and the ACKED states ride later
    // commits: on an idle board up to a checkpoint interval later).
    let sub =
        crate::support::subscriber::Subscriber::events(broker.port(), &format!("{base}/{device}"));
    assert!(sub.wait_subscribed(Duration::from_secs(10)));
    let mut agent = AgentProc::spawn(&cfg, &[], &agent_dir);
    let delivered = wait_for(Duration::from_secs(30), || sub.count() >= ROWS);
    assert!(
        delivered,
        "the broker did not take every row ({} of {ROWS}):\n{}",
        sub.count(),
        agent.log_tail(20)
    );
    assert!(connect_as(
        broker.port(),
        None,
        &sink_id,
        true,
        Duration::from_millis(200)
    ));
    let mut sink = db.spawn_sink(broker.port(), &filter, &sink_id, dir.path(), &[]);
    sink.wait_subscribed();
    wait_for(settle, || {
        spool::count_in_state(&spool_db, "ACKED") == ROWS as i64
            && db.events_of(device) == ROWS as i64
    });
    let out = Wiped {
        acked: spool::count_in_state(&spool_db, "ACKED"),
        stored: db.events_of(device),
    };
    println!(
        "{retire_on} mode, the sink's session wiped with {ROWS} rows queued: {} ACKED at the \
         board, {} stored by the sink",
        out.acked, out.stored
    );
    agent.terminate(Duration::from_secs(15));
    sink.terminate();
    out
}

#[test]
fn in_receipt_mode_a_wiped_sink_session_loses_nothing() {
    let w = wipe_the_sinks_session("receipt", Duration::from_secs(60));
    assert_eq!((w.acked, w.stored), (ROWS as i64, ROWS as i64));
}

/// What the layout's client ids prevent: in puback mode the wipe loses
/// every row it held (ACKED at the board, never stored).
#[test]
fn in_puback_mode_a_wiped_sink_session_loses_what_it_held() {
    let w = wipe_the_sinks_session("puback", Duration::from_secs(5));
    assert_eq!(w.acked, ROWS as i64);
    assert_eq!(
        w.stored, 0,
        "the wipe lost nothing: the test no longer wipes"
    );
}

/// The JSON batch of `events` (`{"batch":[e1,e2,...]}`).
fn json_batch(events: &[&[u8]]) -> Vec<u8> {
    let mut out = br#"{"batch":["#.to_vec();
    out.extend_from_slice(&events.join(&b','));
    out.extend_from_slice(b"]}");
    out
}

/// docs/fleet.md's mosquitto settings and ACL, except that the sinks' user
/// may read all of `edgespool/#` (an operator's wider grant): each device
/// is still kept to writing under its own `edgespool/<name>/`.
fn wide_read_broker(dir: &Path) -> Broker {
    crate::support::broker::password_file(&dir.join("passwd"), &crate::support::fleet::USERS);
    let acl = crate::support::fleet::readme_acl().replace(
        "topic read edgespool/+/events/#\n",
        "topic read edgespool/#\n",
    );
    assert!(acl.contains("user sink\ntopic read edgespool/#\n"), "{acl}");
    std::fs::write(dir.join("acl"), acl).expect("write the ACL file");
    Broker::start_with_config(&format!(
        "{BROKER_EXTRA}allow_anonymous false\npassword_file {}\nacl_file {}\n\
         use_username_as_clientid true\n",
        dir.join("passwd").display(),
        dir.join("acl").display()
    ))
}

/// Topics under evil's own prefix (the ACL lets it write there) whose levels
/// after it name gw1 where a sink reading the device from the level before
/// `events`/`batches` (counted from the end) finds it; each carries an
/// envelope claiming gw1, so the claim agrees with what such a sink reads.
fn crafted_as_gw1() -> Vec<(String, Vec<u8>)> {
    let one = |n| envelope("gw1", 0xf8, n);
    vec![
        ("edgespool/evil/gw1/events/load".to_owned(), one(1)),
        ("edgespool/evil/x/gw1/events/load".to_owned(), one(2)),
        (
            "edgespool/evil/gw1/batches/load".to_owned(),
            json_batch(&[&one(3), &one(4)]),
        ),
        ("edgespool/evil/events/gw1/events/load".to_owned(), one(5)),
        ("edgespool/evil/events/load/gw1".to_owned(), one(6)),
    ]
}

/// Field case F8 (attacker review): the sink's persistent session holds a
/// subscription wider than docs/fleet.md's (`edgespool/#`: a filter an
/// older run was started with, which the broker keeps in the session after
/// the sink is restarted with the page's filter, or one made by hand under
/// the sink's client id), and the ACL lets the sinks' user read it. Device
/// `evil` publishes, under its own prefix, topics that end in
/// `gw1/events/load`, envelopes claiming gw1. Nothing is stored as gw1's but
/// gw1's own reading; each crafted delivery is set aside in `forged` with
/// its topic and a reason naming the shape, under evil. Before: the sink
/// took the device from the level before the last `events`, and stored
/// 4 of evil's readings as gw1's.
#[test]
fn a_wide_subscription_in_the_sinks_session_cannot_make_a_device_write_as_another() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = wide_read_broker(dir.path());
    let db = Db::sqlite(dir.path());
    let login = crate::support::fleet::sink_login(dir.path());
    let login: Vec<&str> = login.iter().map(String::as_str).collect();
    // The session as an earlier filter left it: `sink`'s, not clean,
    // subscribed to all of edgespool/#.
    {
        let mut o = MqttOptions::new("sink", "127.0.0.1", broker.port());
        o.set_clean_session(false);
        o.set_credentials("sink", "sink-secret");
        let (c, mut conn) = Client::new(o, 10);
        c.subscribe("edgespool/#", QoS::AtLeastOnce)
            .expect("queue the subscribe");
        let subscribed = (0..50).any(|_| {
            matches!(
                conn.recv_timeout(Duration::from_millis(200)),
                Ok(Ok(Event::Incoming(Incoming::SubAck(_))))
            )
        });
        assert!(subscribed, "the wide subscription was not granted");
        let _ = c.try_disconnect();
        let _ = conn.recv_timeout(Duration::from_millis(200));
    }
    let filter = "edgespool/+/events/#";
    let mut sink = db.spawn_sink(broker.port(), filter, "sink", dir.path(), &login);
    sink.wait_subscribed();
    let crafted = crafted_as_gw1();
    let n = crafted.len() as i64;
    publish_all(broker.port(), Some(("evil", "evil-secret")), None, crafted);
    let real = envelope("gw1", 0xf8, 0);
    publish_all(
        broker.port(),
        Some(("gw1", "gw1-secret")),
        None,
        vec![("edgespool/gw1/events/load".to_owned(), real.clone())],
    );
    // Every crafted delivery is in once gw1's own (sent last, on the same
    // session) is.
    let settled = wait_for(Duration::from_secs(30), || {
        db.number(
            "SELECT count(*) FROM received WHERE topic = 'edgespool/gw1/events/load'",
            "",
        ) == 1
    });
    let as_gw1 = db.number(
        "SELECT count(*) FROM received WHERE device_id = 'gw1' AND topic <> 'edgespool/gw1/events/load'",
        "",
    );
    let forged = db.number(
        "SELECT count(*) FROM forged WHERE topic LIKE 'edgespool/evil/%'",
        "",
    );
    println!(
        "a wide subscription in the sink's session: {as_gw1} of evil's readings \
         stored as gw1's, {forged} set aside in forged; gw1's own: {}",
        db.events_of("gw1") - as_gw1
    );
    let log = sink.log_text();
    sink.terminate();
    assert!(settled, "not settled\n{}", tail(&log, 20));
    assert_eq!(as_gw1, 0, "evil wrote as gw1\n{}", tail(&log, 20));
    let told = log
        .lines()
        .filter(|l| l.contains("WARN  edgespool::sink::consume") && l.contains("not of the shape"))
        .count();
    assert_eq!(told, 1, "one WARN a connection\n{}", tail(&log, 20));
    assert_eq!(db.events_of("gw1"), 1, "gw1's own reading is stored");
    let forged_by_evil = db.number(
        "SELECT count(*) FROM forged WHERE topic LIKE 'edgespool/evil/%' AND device_id = 'evil'",
        "",
    );
    assert_eq!(forged_by_evil, forged, "set aside under evil's bounds");
    assert!(forged >= n, "{forged} of {n} crafted deliveries set aside");
    let c = rusqlite::Connection::open(dir.path().join("sink.db")).expect("open the sink db");
    let reasons: Vec<(String, String)> = c
        .prepare("SELECT topic, reason FROM forged WHERE topic LIKE 'edgespool/evil/%'")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<rusqlite::Result<_>>()
        })
        .expect("forged rows");
    for (topic, reason) in reasons {
        assert!(
            reason.contains("edgespool/<device>/events/<stream>"),
            "{topic}: {reason}"
        );
    }
}

/// Field case F8: a filter that names no level for the device (no `events`
/// or `batches` level before its last) is refused at start, exit 2, with the
/// filter and the shape the sink reads. Before: the sink subscribed it and
/// read the device from the end of each topic.
#[test]
fn the_sink_refuses_a_filter_that_fixes_no_device_level() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("sink.db");
    let db = db.to_str().expect("UTF-8 path");
    // Nothing listens on the port: a sink that accepts the filter keeps
    // trying to connect (and is stopped after 5 s).
    let port = crate::support::free_port();
    for filter in [
        "edgespool/#",
        "#",
        "edgespool/+/+/#",
        "edgespool/+/events/+/#",
        "events/#",
        "edgespool/events/+/events/#",
    ] {
        let mut sink = SinkProc::launch_args(
            port,
            filter,
            "narrow",
            dir.path(),
            &["--db", db, "--client-id", "narrow"],
        );
        let status = sink.wait_exit(Duration::from_secs(5));
        let log = sink.log_text();
        sink.terminate();
        assert_eq!(status.and_then(|s| s.code()), Some(2), "{filter}:\n{log}");
        assert!(
            log.contains(&format!("{filter:?}")) && log.contains("<device>/events/<stream>"),
            "{filter}:\n{log}"
        );
    }
}

/// A shared subscription's group must be a ShareName (MQTT 5 §4.8.2: at
/// least one character, no `/`, `+` or `#`), wherever it comes from: a
/// `$share/GROUP/` in `--topic` or `--share GROUP`. Each is refused at start,
/// exit 2, naming the filter as it would be subscribed and the rule; so is a
/// group given twice. Before: `$share//edgespool/+/events/#` was accepted
/// (the group empty), and `--share a/b` subscribed group `a` to a filter
/// one level deeper than the one given.
#[test]
fn the_sink_refuses_a_shared_subscription_group_that_is_no_share_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("sink.db");
    let db = db.to_str().expect("UTF-8 path");
    // Nothing listens on the port: a sink that accepts the group keeps
    // trying to connect (and is stopped after 5 s).
    let port = crate::support::free_port();
    let page = "edgespool/+/events/#";
    for (topic, share, named, rule) in [
        (
            "$share//edgespool/+/events/#",
            None,
            "$share//edgespool/+/events/#",
            "§4.8.2",
        ),
        (
            "$share/in+gest/edgespool/+/events/#",
            None,
            "$share/in+gest/edgespool/+/events/#",
            "§4.8.2",
        ),
        (page, Some(""), "$share//edgespool/+/events/#", "§4.8.2"),
        (
            page,
            Some("a/b"),
            "$share/a/b/edgespool/+/events/#",
            "§4.8.2",
        ),
        (page, Some("#"), "$share/#/edgespool/+/events/#", "§4.8.2"),
        (
            "$share/g/edgespool/+/events/#",
            Some("h"),
            "$share/h/$share/g/edgespool/+/events/#",
            "shared twice",
        ),
    ] {
        let mut args = vec!["--db", db, "--client-id", "shared"];
        args.extend(share.iter().flat_map(|g| ["--share", *g]));
        let mut sink = SinkProc::launch_args(port, topic, "shared", dir.path(), &args);
        let status = sink.wait_exit(Duration::from_secs(5));
        let log = sink.log_text();
        sink.terminate();
        let case = format!("--topic {topic:?} --share {share:?}");
        assert_eq!(status.and_then(|s| s.code()), Some(2), "{case}:\n{log}");
        assert!(
            log.contains(&format!("{named:?}")) && log.contains(rule),
            "{case}:\n{log}"
        );
    }
}

/// Batches of the same event a device sends again and again (field case
/// F6).
const F6_BATCHES: usize = 200;
/// Copies of the event in each.
const F6_COPIES: usize = 1000;

/// Field case F6 (attacker review): one device sends the same event in 200
/// batches of 1,000 copies each, 200,000 deliveries of one stored event.
/// PostgreSQL keeps one `redeliveries` row for it, counting 199,999, and
/// `sink --stats` says 199,999 duplicates. Before: `duplicates` got one row
/// per redelivery, 199,999 rows (about 13 MB).
#[cfg(feature = "pg-sink")]
#[test]
fn a_device_sending_one_event_again_and_again_grows_no_table() {
    let pg = crate::support::postgres::Postgres::start(&[("fsync", "off")]);
    let broker = Broker::start_with_options(BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let db = Db::Postgres(pg);
    let mut sink = db.spawn_sink(
        broker.port(),
        "edgespool/+/events/#",
        "f6-sink",
        dir.path(),
        &[],
    );
    sink.wait_subscribed();
    let one = envelope("gw1", 0xf6, 0);
    let batch = json_batch(&vec![&one[..]; F6_COPIES]);
    let topic = "edgespool/gw1/batches/load".to_owned();
    let msgs = vec![(topic, batch); F6_BATCHES];
    let deliveries = (F6_BATCHES * F6_COPIES) as i64;
    publish_all(broker.port(), None, None, msgs);
    let Db::Postgres(pg) = &db else {
        unreachable!("a PostgreSQL store")
    };
    let new_shape = |pg: &crate::support::postgres::Postgres| -> bool {
        pg.client()
            .query_one("SELECT to_regclass('redeliveries') IS NOT NULL", &[])
            .map(|r| r.get(0))
            .unwrap_or(false)
    };
    let (table, counted) = match new_shape(pg) {
        true => ("redeliveries", "coalesce(sum(deliveries), 0)::int8"),
        false => ("duplicates", "count(*)"),
    };
    let redelivered = format!("SELECT {counted} FROM {table}");
    let all = wait_for(Duration::from_secs(120), || {
        db.number("", &redelivered) == deliveries - 1
    });
    let rows = db.number("", &format!("SELECT count(*) FROM {table}"));
    let bytes = db.number(
        "",
        &format!("SELECT pg_total_relation_size('{table}')::int8"),
    );
    println!(
        "{F6_BATCHES} batches of {F6_COPIES} copies of one event: table {table} holds {rows} \
         rows, {bytes} bytes (with its indexes), counting {} redeliveries",
        db.number("", &redelivered)
    );
    let report = crate::support::sink::stats_json(&["--postgres", &pg.conninfo()]);
    sink.terminate();
    assert!(all, "{}", tail(&sink.log_text(), 20));
    assert_eq!(report["duplicates"], deliveries - 1, "{report}");
    assert_eq!(report["events"], 1, "{report}");
    assert_eq!(
        summary(&sink.log_text(), "duplicates"),
        (deliveries - 1) as u64
    );
    assert_eq!(rows, 1, "one row per redelivered event");
    assert!(bytes < 64 << 10, "{bytes} bytes");
}
