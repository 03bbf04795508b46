//! The PostgreSQL sink over TLS: a test PostgreSQL with `ssl = on`, a
//! server certificate (SAN IP:127.0.0.1) signed by a CA the test makes with
//! openssl, and a pg_hba.conf that takes TCP connections over TLS only
//! (the Unix socket, used by the test to look, stays open).

use crate::support::sink::{self, SinkProc};
use crate::support::{self, broker::Broker, postgres::Postgres, publisher};
use crate::tls::{make_ca, make_cert};
use edgespool::sink::pg_tls::TlsFiles;
use edgespool::sink::postgres::{connect_client, PgStore};
use edgespool::sink::StoreError;
use std::path::Path;
use std::time::Duration;

const HBA: &str = "local all all trust
hostssl all certuser 127.0.0.1/32 cert
hostssl all all 127.0.0.1/32 trust
";

/// The PKI in `dir` (pg CA, server cert, client cert for `certuser`,
/// another CA) and a TLS-only server using it.
fn tls_server(dir: &Path) -> Postgres {
    make_ca(dir, "pg");
    make_ca(dir, "other");
    make_cert(dir, "pg", "server", Some("IP:127.0.0.1"));
    make_cert(dir, "pg", "certuser", None);
    let read = |f: &str| std::fs::read(dir.join(f)).expect("read test PKI");
    let mut pg = Postgres::init();
    pg.put("server.pem", &read("server.pem"));
    pg.put("server.key", &read("server.key"));
    pg.put("root.pem", &read("pg-ca.pem"));
    pg.put("pg_hba.conf", HBA.as_bytes());
    pg.launch(&[
        ("fsync", "off"),
        ("ssl", "on"),
        ("ssl_cert_file", "server.pem"),
        ("ssl_key_file", "server.key"),
        ("ssl_ca_file", "root.pem"),
    ]);
    pg.socket_client()
        .batch_execute("CREATE ROLE certuser LOGIN")
        .expect("create certuser");
    pg
}

fn files(dir: &Path, ca: &str) -> TlsFiles {
    TlsFiles {
        ca: Some(dir.join(ca)),
        ..TlsFiles::default()
    }
}

/// Events stored, or -1 while the schema does not exist.
fn events(c: &mut postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM events", &[])
        .map(|r| r.get(0))
        .unwrap_or(-1)
}

fn tcp(pg: &Postgres, host: &str, extra: &str) -> String {
    format!(
        "host={host} port={} user=postgres dbname=postgres {extra}",
        pg.port()
    )
}

#[test]
fn verify_full_with_the_right_ca_stores_and_a_wrong_ca_or_no_tls_stores_nothing() {
    let pki = tempfile::tempdir().expect("tempdir");
    let pg = tls_server(pki.path());
    let broker = Broker::start_with_options(support::sink::BROKER_EXTRA, false);
    let logs = tempfile::tempdir().expect("tempdir");
    let prefix = crate::prefix("pgtls");
    let filter = format!("{prefix}/+/events/#");
    let ca = pki.path().join("pg-ca.pem").display().to_string();
    let other = pki.path().join("other-ca.pem").display().to_string();
    let full = tcp(&pg, "127.0.0.1", "sslmode=verify-full");
    let sink = |conninfo: &str, id: &str, extra: &[&str]| {
        SinkProc::spawn_with(
            broker.port(),
            &filter,
            conninfo,
            id,
            "tls",
            logs.path(),
            extra,
        )
    };
    let mut db = pg.socket_client();

    // A CA that did not sign the server's certificate: the handshake is
    // refused, named, and the sink exits non-zero before subscribing.
    let mut wrong = sink(&full, "pg-tls-wrong", &["--pg-ca", &other]);
    let st = wrong.wait_exit(Duration::from_secs(30));
    let log = wrong.log_text();
    assert!(st.is_some_and(|s| !s.success()), "{st:?}\n{log}");
    assert!(
        log.contains("TLS handshake with PostgreSQL failed") && log.contains("UnknownIssuer"),
        "{log}"
    );
    assert!(!log.contains("sink: subscribed"), "{log}");

    // Plaintext to a server that takes TLS only: the server's refusal.
    let plain = tcp(&pg, "127.0.0.1", "sslmode=disable");
    let mut refused = sink(&plain, "pg-tls-plain", &[]);
    let st = refused.wait_exit(Duration::from_secs(30));
    let log = refused.log_text();
    assert!(st.is_some_and(|s| !s.success()), "{st:?}\n{log}");
    assert!(
        log.contains("no pg_hba.conf entry") && log.contains("no encryption"),
        "{log}"
    );

    // verify-full without --pg-ca: refused before connecting.
    let mut no_ca = sink(&full, "pg-tls-noca", &[]);
    let st = no_ca.wait_exit(Duration::from_secs(30));
    let log = no_ca.log_text();
    assert!(st.is_some_and(|s| !s.success()), "{st:?}\n{log}");
    assert!(log.contains("sslmode=verify-full needs --pg-ca"), "{log}");
    assert_eq!(events(&mut db), -1, "something was stored");

    // The right CA: events are stored.
    let mut good = sink(&full, "pg-tls-good", &["--pg-ca", &ca]);
    good.wait_subscribed();
    let plan = publisher::Plan {
        events: 200,
        devices: 2,
        dup_every: 0,
        conflicts: 0,
    };
    let sent = publisher::publish(broker.port(), &prefix, plan, Duration::from_secs(60));
    let stored = support::wait_for(Duration::from_secs(60), || {
        events(&mut db) == sent.distinct as i64
    });
    assert!(
        stored,
        "stored {} of {}\n{}",
        events(&mut db),
        sent.distinct,
        support::tail(&good.log_text(), 20)
    );
    let ssl: bool = db
        .query_one(
            "SELECT bool_and(ssl) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
             WHERE application_name = 'pg-tls-good'",
            &[],
        )
        .map(|r| r.get::<_, Option<bool>>(0).unwrap_or(false))
        .expect("pg_stat_ssl");
    assert!(ssl, "the sink's connection is not TLS");
    good.terminate();

    // `sink --stats` speaks TLS too.
    sink::stats_json(&["--postgres", &full, "--pg-ca", &ca]);
}

#[test]
fn verify_ca_ignores_the_host_name_verify_full_does_not_and_client_certs_log_in() {
    let pki = tempfile::tempdir().expect("tempdir");
    let pg = tls_server(pki.path());
    let right = files(pki.path(), "pg-ca.pem");

    // The certificate names 127.0.0.1, not localhost.
    let by_name = |mode: &str| tcp(&pg, "localhost", &format!("sslmode={mode}"));
    match PgStore::connect(&by_name("verify-full"), "vf", &right) {
        Err(StoreError::Fatal(e)) => assert!(e.contains("not valid for name \"localhost\""), "{e}"),
        Err(e) => panic!("expected a fatal error, got {e}"),
        Ok(_) => panic!("verify-full accepted a certificate for another host"),
    }
    drop(PgStore::connect(&by_name("verify-ca"), "vca", &right).expect("verify-ca"));
    drop(PgStore::connect(&by_name("require"), "req", &right).expect("require"));
    // verify-ca still checks the chain.
    match PgStore::connect(
        &by_name("verify-ca"),
        "vca",
        &files(pki.path(), "other-ca.pem"),
    ) {
        Err(StoreError::Fatal(e)) => assert!(e.contains("UnknownIssuer"), "{e}"),
        Err(e) => panic!("expected a fatal error, got {e}"),
        Ok(_) => panic!("verify-ca accepted a certificate from another CA"),
    }

    // `cert` authentication: the client certificate's CN is the user.
    let cert_user = format!(
        "host=127.0.0.1 port={} user=certuser dbname=postgres sslmode=verify-full",
        pg.port()
    );
    match connect_client(&cert_user, &right) {
        Err(StoreError::Fatal(e)) => assert!(e.contains("28000"), "{e}"),
        Err(e) => panic!("expected a fatal login refusal, got {e}"),
        Ok(_) => panic!("cert authentication passed without a client certificate"),
    }
    let with_cert = TlsFiles {
        cert: Some(pki.path().join("certuser.pem")),
        key: Some(pki.path().join("certuser.key")),
        ..right.clone()
    };
    let mut c = connect_client(&cert_user, &with_cert).expect("client certificate login");
    let who: String = c
        .query_one("SELECT current_user::text", &[])
        .map(|r| r.get(0))
        .expect("current_user");
    assert_eq!(who, "certuser");
}
