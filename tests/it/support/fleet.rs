//! The fleet broker layout of docs/fleet.md ("Identity, set-aside deliveries
//! and receipts"), read from that page itself so the tests run what it tells
//! operators to write: its mosquitto settings and ACL, with a password file
//! holding the users [`USERS`], on a real mosquitto.

use super::broker::Broker;
use std::path::{Path, PathBuf};

/// The users of the layout and their passwords: two devices, the sinks'
/// user and the operator.
pub const USERS: [(&str, &str); 4] = [
    ("gw1", "gw1-secret"),
    ("evil", "evil-secret"),
    ("sink", "sink-secret"),
    ("operator", "operator-secret"),
];

const FLEET_DOC: &str = include_str!("../../../docs/fleet.md");

/// The lines of docs/fleet.md's here-document opened by `opening` (up to its
/// closing `end` line).
fn here_doc(opening: &str, end: &str) -> &'static str {
    let start = FLEET_DOC
        .find(opening)
        .unwrap_or_else(|| panic!("docs/fleet.md no longer has {opening:?}"))
        + opening.len();
    let len = FLEET_DOC[start..]
        .find(&format!("\n{end}\n"))
        .unwrap_or_else(|| panic!("docs/fleet.md's {opening:?} has no closing {end}"));
    &FLEET_DOC[start..start + len + 1]
}

/// docs/fleet.md's `/etc/mosquitto/acl`.
pub fn readme_acl() -> &'static str {
    here_doc("cat > /etc/mosquitto/acl <<'ACL'\n", "ACL")
}

/// The opening of docs/fleet.md's ACL for a deeper filter
/// (`fleet/+/+/events/#`), a block inside a list item.
const DEEPER_ACL: &str =
    "  ```text\n  # each device (user name = device id = client id) under any site\n";

/// docs/fleet.md's ACL for a deeper filter (`fleet/+/+/events/#`, the
/// device at level 3), its list item's indent taken off.
pub fn deeper_acl() -> String {
    let start = FLEET_DOC
        .find(DEEPER_ACL)
        .unwrap_or_else(|| panic!("docs/fleet.md no longer has {DEEPER_ACL:?}"))
        + "  ```text\n".len();
    let len = FLEET_DOC[start..]
        .find("  ```\n")
        .unwrap_or_else(|| panic!("docs/fleet.md's {DEEPER_ACL:?} has no closing fence"));
    FLEET_DOC[start..start + len]
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect()
}

/// docs/fleet.md's `identity.conf`, its paths moved into `dir`.
fn readme_conf(dir: &Path) -> String {
    here_doc(
        "cat > /etc/mosquitto/conf.d/identity.conf <<'CONF'\n",
        "CONF",
    )
    .replace(
        "/etc/mosquitto/passwd",
        &dir.join("passwd").display().to_string(),
    )
    .replace("/etc/mosquitto/acl", &dir.join("acl").display().to_string())
}

/// A file in `dir` holding `user`'s password and a newline, for
/// `mqtt.password_file` or `sink --password-file`.
pub fn password_file(dir: &Path, user: &str) -> PathBuf {
    let (_, password) = USERS
        .iter()
        .find(|(u, _)| *u == user)
        .unwrap_or_else(|| panic!("no user {user} in the fleet layout"));
    let path = dir.join(format!("{user}.password"));
    std::fs::write(&path, format!("{password}\n")).expect("write a password file");
    // Readable by its owner only: a password file others can read is refused.
    let private = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600);
    std::fs::set_permissions(&path, private).expect("chmod 600 the password file");
    path
}

/// mosquitto with docs/fleet.md's settings and ACL (and `extra` before them),
/// its password file and ACL written in `dir`.
pub fn broker(dir: &Path, extra: &str) -> Broker {
    broker_with_acl(dir, extra, readme_acl())
}

/// As [`broker`], with the ACL `acl` ([`deeper_acl`], say).
pub fn broker_with_acl(dir: &Path, extra: &str, acl: &str) -> Broker {
    super::broker::password_file(&dir.join("passwd"), &USERS);
    std::fs::write(dir.join("acl"), acl).expect("write the ACL file");
    Broker::start_with_config(&format!("{extra}{}", readme_conf(dir)))
}

/// `sink` arguments that log in as the layout's sinks' user.
pub fn sink_login(dir: &Path) -> Vec<String> {
    vec![
        "--username".into(),
        "sink".into(),
        "--password-file".into(),
        password_file(dir, "sink").display().to_string(),
    ]
}
