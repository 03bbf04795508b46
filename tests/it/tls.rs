//! TLS to a real mosquitto TLS listener, with certificates made by the test
//! (openssl): mutual TLS delivers; a wrong CA and a refused login give a clear
//! error naming the cause while the spool keeps filling.

use crate::support::agent::AgentProc;
use crate::support::broker::{password_file, Broker};
use crate::support::spool::{count_in_state, total};
use crate::support::{run_ok, wait_for};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn openssl(dir: &Path, args: &[&str]) {
    run_ok(
        Command::new("openssl").args(args).current_dir(dir),
        &format!("openssl {args:?} (Debian package openssl)"),
    );
}

/// A P-256 private key in `dir/key`.
fn ec_key(dir: &Path, key: &str) {
    let curve = "ec_paramgen_curve:P-256";
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            curve,
            "-out",
            key,
        ],
    );
}

/// A CA (`<name>-ca.pem`), and certificates it signs.
pub(crate) fn make_ca(dir: &Path, name: &str) {
    let key = format!("{name}-ca.key");
    ec_key(dir, &key);
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            &key,
            "-subj",
            &format!("/CN={name} test CA"),
            "-days",
            "30",
            "-out",
            &format!("{name}-ca.pem"),
        ],
    );
}

pub(crate) fn make_cert(dir: &Path, ca: &str, name: &str, san: Option<&str>) {
    make_cert_days(dir, ca, name, san, "30");
}

/// `days` "-1" gives a certificate whose validity ended yesterday.
fn make_cert_days(dir: &Path, ca: &str, name: &str, san: Option<&str>, days: &str) {
    let key = format!("{name}.key");
    ec_key(dir, &key);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &key,
            "-subj",
            &format!("/CN={name}"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    let ext = format!("{name}.ext");
    let mut text = "basicConstraints=CA:FALSE\n".to_owned();
    if let Some(s) = san {
        text.push_str(&format!("subjectAltName={s}\n"));
    }
    std::fs::write(dir.join(&ext), text).expect("write ext");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}-ca.pem"),
            "-CAkey",
            &format!("{ca}-ca.key"),
            "-CAcreateserial",
            "-days",
            days,
            "-extfile",
            &ext,
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

fn pki(dir: &Path) {
    make_ca(dir, "good");
    make_ca(dir, "other");
    make_cert(dir, "good", "server", Some("IP:127.0.0.1"));
    make_cert(dir, "good", "client", None);
}

fn config(dir: &Path, port: u16, mqtt_extra: &str) -> PathBuf {
    let cfg = dir.join("board.toml");
    let d = dir.display();
    std::fs::write(
        &cfg,
        format!(
            r#"device_id = "tls-board"
[spool]
path = "{d}/spool.db"
commit_window_ms = 50
[mqtt]
url = "mqtts://127.0.0.1:{port}"
reconnect_min_ms = 200
reconnect_max_ms = 1000
connect_timeout_secs = 3
{mqtt_extra}
[[sources]]
name = "system"
kind = "system"
interval_ms = 50
"#
        ),
    )
    .expect("write config");
    cfg
}

#[test]
fn mutual_tls_delivers_and_a_readable_key_is_warned_about() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let broker = Broker::start_tls(
        dir.path(),
        "require_certificate true\nallow_anonymous true\n",
    );
    let d = dir.path().display();
    let cfg = config(
        dir.path(),
        broker.port(),
        &format!("ca_file = \"{d}/good-ca.pem\"\nclient_cert_file = \"{d}/client.pem\"\nclient_key_file = \"{d}/client.key\""),
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        dir.path().join("client.key"),
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(20), || db.exists()
            && count_in_state(&db, "ACKED") >= 10),
        "{}",
        agent.log_tail(30)
    );
    assert!(
        agent.log_text().contains("mqtt.client_key_file"),
        "no warning about the readable key"
    );
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn a_wrong_ca_gives_a_clear_rate_limited_error_and_the_spool_keeps_filling() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let broker = Broker::start_tls(
        dir.path(),
        "require_certificate false\nallow_anonymous true\n",
    );
    let d = dir.path().display();
    let cfg = config(
        dir.path(),
        broker.port(),
        &format!("ca_file = \"{d}/other-ca.pem\""),
    );
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &["mqtt.reconnect_max_ms=200".into()], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(20), "TLS failed"),
        "{}",
        agent.log_tail(30)
    );
    let before = total(&db);
    std::thread::sleep(Duration::from_secs(4));
    assert!(total(&db) > before, "the spool stopped filling");
    assert_eq!(count_in_state(&db, "ACKED"), 0);
    let log = agent.log_text();
    let loud = log
        .lines()
        .filter(|l| {
            l.contains("TLS failed")
                && (l.contains(" INFO ") || l.contains(" WARN ") || l.contains(" ERROR "))
        })
        .count();
    assert!(
        loud <= 2,
        "{loud} loud TLS error lines in a few seconds: not rate-limited"
    );
    assert!(
        log.contains("check mqtt.ca_file"),
        "the error does not name what to check"
    );
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn a_refused_login_names_the_cause_and_the_spool_keeps_filling() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let pw = dir.path().join("passwd");
    password_file(&pw, &[("board", "right-password")]);
    let broker = Broker::start_tls(
        dir.path(),
        &format!(
            "require_certificate false\nallow_anonymous false\npassword_file {}\n",
            pw.display()
        ),
    );
    let d = dir.path().display();
    std::fs::write(dir.path().join("secret"), "wrong-password\n").expect("secret");
    let private = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600);
    std::fs::set_permissions(dir.path().join("secret"), private).expect("chmod 600 secret");
    let cfg = config(
        dir.path(),
        broker.port(),
        &format!(
            "ca_file = \"{d}/good-ca.pem\"\nusername = \"board\"\npassword_file = \"{d}/secret\""
        ),
    );
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        agent.wait_log(Duration::from_secs(20), "the broker refused the login"),
        "{}",
        agent.log_tail(30)
    );
    assert!(agent.log_text().contains("check mqtt.username"));
    let before = total(&db);
    assert!(wait_for(Duration::from_secs(30), || total(&db) > before));
    // The right password: delivery starts without touching the spool.
    std::fs::write(dir.path().join("secret"), "right-password\n").expect("secret");
    assert!(
        wait_for(Duration::from_secs(20), || count_in_state(&db, "ACKED") > 0),
        "{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
}

#[test]
fn an_expired_server_certificate_is_named_and_the_spool_keeps_filling() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    // Replace the server certificate by one that expired yesterday.
    make_cert_days(dir.path(), "good", "server", Some("IP:127.0.0.1"), "-1");
    let broker = Broker::start_tls(
        dir.path(),
        "require_certificate false\nallow_anonymous true\n",
    );
    let d = dir.path().display();
    let cfg = config(
        dir.path(),
        broker.port(),
        &format!("ca_file = \"{d}/good-ca.pem\""),
    );
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let line = agent
        .await_line(Duration::from_secs(20), "TLS failed")
        .to_lowercase();
    assert!(
        line.contains("expired"),
        "the error does not say the certificate expired: {line}"
    );
    let before = total(&db);
    std::thread::sleep(Duration::from_secs(2));
    assert!(total(&db) > before, "the spool stopped filling");
    assert_eq!(count_in_state(&db, "ACKED"), 0);
    agent.terminate(Duration::from_secs(15));
}
