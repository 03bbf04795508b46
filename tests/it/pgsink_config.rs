//! The PostgreSQL sink as the packaged service runs it: `sink --config FILE`
//! with a `[sink]` section, the password in a file only its owner can read,
//! against a real PostgreSQL that asks for a password (scram-sha-256 over
//! TCP). The password never appears in what the sink prints.

use crate::support::{self, broker::Broker, postgres::Postgres, publisher, sink::SinkProc};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SECRET: &str = "s3cret-Pg-pw";

/// TCP logins need a password; the Unix socket (the test's own admin
/// connection) is trusted.
const HBA: &str = "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n";

/// A server with the role `sink` (password [`SECRET`]) owning the database
/// `fleet`.
fn server() -> Postgres {
    let mut pg = Postgres::init();
    pg.put("pg_hba.conf", HBA.as_bytes());
    pg.launch(&[("fsync", "off"), ("password_encryption", "scram-sha-256")]);
    let mut admin = pg.socket_client();
    admin
        .batch_execute(&format!("CREATE ROLE sink LOGIN PASSWORD '{SECRET}'"))
        .expect("create role");
    admin
        .batch_execute("CREATE DATABASE fleet OWNER sink")
        .expect("create database");
    pg
}

/// The superuser on `fleet`, by the trusted socket.
fn fleet_admin(pg: &Postgres) -> postgres::Client {
    let conninfo = format!(
        "host={} port={} user=postgres dbname=fleet",
        pg.dir().display(),
        pg.port()
    );
    postgres::Client::connect(&conninfo, postgres::NoTls).expect("connect to fleet")
}

fn write_mode(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A settings file naming `password_file`; the broker URL in it is `url`.
fn settings(dir: &Path, pg: &Postgres, url: &str, filter: &str, password_file: &Path) -> PathBuf {
    let path = dir.join("sink-fleet.toml");
    let text = format!(
        "[sink]\nurl = \"{url}\"\ntopic = \"{filter}\"\nclient_id = \"pg-config-sink\"\n\
         batch_max = 50\nbatch_ms = 20\n\
         [sink.postgres]\nconninfo = \"host=127.0.0.1 port={} user=sink dbname=fleet\"\n\
         password_file = \"{}\"\n",
        pg.port(),
        password_file.display()
    );
    std::fs::write(&path, text).expect("write settings");
    path
}

#[test]
fn pgsink_from_a_config_file_with_a_password_file_stores_every_event() {
    let pg = server();
    let broker = Broker::start_with_options(support::sink::BROKER_EXTRA, false);
    let dir = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("pgsinkcfg");
    let filter = format!("{prefix}/+/events/#");
    let pw = dir.path().join("sink-fleet.pgpassword");
    write_mode(&pw, &format!("{SECRET}\n"), 0o600);
    // The file's broker URL is wrong on purpose: --url on the line wins.
    let dead = format!("mqtt://127.0.0.1:{}", support::free_port());
    let cfg = settings(dir.path(), &pg, &dead, &filter, &pw);
    let url = format!("mqtt://127.0.0.1:{}", broker.port());
    let cfg_s = cfg.to_str().expect("utf-8");
    let mut sink = SinkProc::launch_only(
        "pg-config-sink",
        dir.path(),
        &["--config", cfg_s, "--url", &url],
        &[],
    );
    sink.wait_subscribed();
    let plan = publisher::Plan {
        events: 300,
        devices: 3,
        dup_every: 10,
        conflicts: 0,
    };
    let sent = publisher::publish(broker.port(), &prefix, plan, Duration::from_secs(120));
    let mut db = fleet_admin(&pg);
    let stored = |db: &mut postgres::Client| {
        db.query_one("SELECT count(*) FROM events", &[])
            .map(|r| r.get::<_, i64>(0))
            .unwrap_or(-1)
    };
    assert!(
        support::wait_for(Duration::from_secs(120), || stored(&mut db)
            == sent.distinct as i64),
        "stored {} of {}\n{}",
        stored(&mut db),
        sent.distinct,
        support::tail(&sink.log_text(), 30)
    );
    let owner: String = db
        .query_one(
            "SELECT tableowner::text FROM pg_tables WHERE tablename = 'events'",
            &[],
        )
        .map(|r| r.get(0))
        .expect("events table owner");
    assert_eq!(owner, "sink", "the sink logged in as its own role");
    sink.terminate();
    let log = sink.log_text();
    assert!(log.contains("password from password file"), "{log}");
    assert!(!log.contains(SECRET), "the password was printed:\n{log}");

    // `--stats` from the same file reads the same database.
    let (status, out, err) =
        crate::support::agent::run_cli(&["sink", "--stats", "--json", "--config", cfg_s]);
    assert_eq!(status.code(), Some(0), "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("stats JSON");
    assert_eq!(
        report["streams"].as_array().map(Vec::len),
        Some(plan.devices),
        "{report}"
    );
    assert!(!out.contains(SECRET) && !err.contains(SECRET));
}

#[test]
fn pgsink_refuses_a_password_file_others_can_read_and_names_the_fix() {
    let pg = server();
    let dir = tempfile::tempdir().expect("tempdir");
    let pw = dir.path().join("open.pgpassword");
    write_mode(&pw, SECRET, 0o640);
    let cfg = settings(dir.path(), &pg, "mqtt://127.0.0.1:1", "t/+/events/#", &pw);
    let (status, out, err) =
        crate::support::agent::run_cli(&["sink", "--config", cfg.to_str().expect("utf-8")]);
    assert_eq!(status.code(), Some(2), "{out}{err}");
    assert!(
        err.contains("mode 0640") && err.contains("chmod 600"),
        "{err}"
    );
    assert!(!err.contains(SECRET) && !out.contains(SECRET), "{err}");
    // Without any password the server refuses the login: fatal, exit 1.
    write_mode(&pw, "wrong\n", 0o600);
    let (status, _, err) = crate::support::agent::run_cli(&[
        "sink",
        "--config",
        cfg.to_str().expect("utf-8"),
        "--stats",
    ]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("password authentication failed"), "{err}");
}

#[test]
fn pgsink_takes_pgpassword_from_the_environment_when_no_file_is_named() {
    let pg = server();
    let conninfo = format!("host=127.0.0.1 port={} user=sink dbname=fleet", pg.port());
    // The schema, so that `--stats` has tables to read once logged in.
    edgespool::sink::postgres::PgStore::connect(
        &format!("{conninfo} password={SECRET}"),
        "setup",
        &Default::default(),
    )
    .expect("migrate as sink");
    let run = |envs: &[(&str, &str)]| {
        crate::support::agent::run_cli_with(
            &["sink", "--stats", "--postgres", &conninfo],
            envs,
            Duration::from_secs(60),
        )
    };
    let (status, out, err) = run(&[("PGPASSWORD", SECRET)]);
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(out.contains("events"), "{out}");
    let dir = tempfile::tempdir().expect("tempdir");
    let passfile = dir.path().join("pgpass");
    write_mode(
        &passfile,
        &format!("127.0.0.1:{}:fleet:sink:{SECRET}\n", pg.port()),
        0o600,
    );
    let passfile_s = passfile.to_str().expect("utf-8");
    let (status, _, err) = run(&[("PGPASSFILE", passfile_s)]);
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("password from PGPASSFILE"), "{err}");
    // A wrong PGPASSWORD is used (and refused by the server), not skipped.
    let (status, _, err) = run(&[("PGPASSWORD", "wrong")]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("password authentication failed"), "{err}");
}

#[test]
fn sink_conninfo_that_fails_to_parse_is_reported_without_its_password() {
    for conninfo in [
        format!("host=127.0.0.1 password={SECRET} port=notaport"),
        format!("host=127.0.0.1 password={SECRET} nosuchkey=1"),
        format!("postgresql://sink:{SECRET}@127.0.0.1:notaport/fleet"),
    ] {
        let (status, out, err) =
            crate::support::agent::run_cli(&["sink", "--stats", "--postgres", &conninfo]);
        assert_eq!(status.code(), Some(2), "{conninfo}: {err}");
        assert!(err.contains("***"), "{err}");
        assert!(
            !err.contains(SECRET) && !out.contains(SECRET),
            "{conninfo}: {err}"
        );
    }
}

/// No password anywhere while the server asks for one: the sink says so
/// and where a password is read from, and exits 2 (its unit does not
/// restart on 2), where it retried forever logging `PostgreSQL not
/// reachable (invalid configuration)`. `--stats` too.
#[test]
fn pgsink_without_a_password_the_server_asks_for_stops_and_says_where_one_goes() {
    let pg = server();
    let conninfo = format!("host=127.0.0.1 port={} user=sink dbname=fleet", pg.port());
    for args in [
        vec!["sink", "--stats", "--postgres", &conninfo],
        vec![
            "sink",
            "--postgres",
            &conninfo,
            "--url",
            "mqtt://127.0.0.1:1",
            "--topic",
            "t/+/events/#",
            "--client-id",
            "no-password",
        ],
    ] {
        let started = std::time::Instant::now();
        let (status, out, err) =
            crate::support::agent::run_cli_with(&args, &[], Duration::from_secs(30));
        assert_eq!(status.code(), Some(2), "{args:?}: {out}{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{err}");
        assert!(
            err.contains("password missing") && err.contains("password_file"),
            "{err}"
        );
        assert!(!err.contains("not reachable"), "{err}");
    }
}
