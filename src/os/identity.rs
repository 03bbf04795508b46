//! The board's `device_id` when the config names its source instead of a
//! name: `@machine-id` (derived from `/etc/machine-id`) or `@hostname` (the
//! kernel's host name, sanitized).
//!
//! Its one rule: **the raw machine id never leaves this module**. The id
//! derived from it is systemd's application-specific id
//! (`sd_id128_get_machine_app_specific(3)`: HMAC-SHA256 keyed with the
//! machine id over [`APP_ID`]), of which the first 12 hex digits follow
//! [`MACHINE_ID_PREFIX`]; `systemd-id128 machine-id --app-specific=<APP_ID>`
//! prints the same digits on the board. Stable while `/etc/machine-id`
//! is (reboots, upgrades, reinstalls of the package); another board, another
//! id. The machine id cannot be read back from it.

use crate::event::stream::topic_safe;
use std::path::{Path, PathBuf};

/// The file `@machine-id` reads by default (machine-id(5)).
pub const MACHINE_ID_FILE: &str = "/etc/machine-id";

/// Environment variable naming another file for `@machine-id`: for tests
/// and rigs that run several "boards" on one machine. A board's service
/// does not set it.
pub const MACHINE_ID_ENV: &str = "EDGESPOOL_MACHINE_ID_FILE";

/// What a `@machine-id` device id starts with.
pub const MACHINE_ID_PREFIX: &str = "es-";

/// edgespool's application id (a fixed random 128-bit value), the message
/// of the HMAC: `59059745eaf64aef817b21555c34a3fb`.
pub const APP_ID: [u8; 16] = [
    0x59, 0x05, 0x97, 0x45, 0xea, 0xf6, 0x4a, 0xef, 0x81, 0x7b, 0x21, 0x55, 0x5c, 0x34, 0xa3, 0xfb,
];

/// Host names every unconfigured image has: as device ids they would make
/// every board the same board.
const SHARED_HOSTNAMES: &[&str] = &[
    "localhost",
    "localhost.localdomain",
    "(none)",
    // The names board images ship with: every board flashed from the image
    // has it until someone renames it.
    "raspberrypi",
    "raspberry",
    "pi",
    "debian",
    "ubuntu",
    "armbian",
    "dietpi",
    "orangepi",
    "bananapi",
    "rockpi",
    "radxa",
    "beaglebone",
    "odroid",
    "alarm",
    "alarmpi",
    "openwrt",
    "yocto",
    "buildroot",
    "raspberrypi4-64",
    "qemux86-64",
];

/// Where the running `device_id` came from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceIdSource {
    /// Written in the config as it is.
    #[default]
    Config,
    /// `@machine-id`, derived from this file.
    MachineId(PathBuf),
    /// `@hostname`, the kernel's host name.
    Hostname,
}

impl DeviceIdSource {
    /// A short name: `config`, `machine-id` or `hostname`.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceIdSource::Config => "config",
            DeviceIdSource::MachineId(_) => "machine-id",
            DeviceIdSource::Hostname => "hostname",
        }
    }

    /// For logs and `status`: `the config`, `@machine-id: /etc/machine-id`,
    /// `@hostname`.
    pub fn describe(&self) -> String {
        match self {
            DeviceIdSource::Config => "the config".to_owned(),
            DeviceIdSource::MachineId(p) => format!("@machine-id: {}", p.display()),
            DeviceIdSource::Hostname => "@hostname".to_owned(),
        }
    }
}

/// The file `@machine-id` reads: [`MACHINE_ID_ENV`] when set and not
/// empty, else [`MACHINE_ID_FILE`].
pub fn machine_id_path() -> PathBuf {
    match std::env::var_os(MACHINE_ID_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(MACHINE_ID_FILE),
    }
}

/// The device id derived from the machine id in `path`.
///
/// Errors (the message names the file and the fix): it cannot be read, is
/// empty, `uninitialized` (first boot not finished), or not 32 hex digits.
pub fn from_machine_id(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let fix = format!(
        "create it with `systemd-machine-id-setup` (or `dbus-uuidgen --ensure={shown}`), or set device_id to a name of your own"
    );
    let text = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}: {fix}"))?;
    let text = String::from_utf8_lossy(&text);
    let id = text.trim();
    if id.is_empty() {
        return Err(format!("{shown} is empty: {fix}"));
    }
    if id == "uninitialized" {
        return Err(format!(
            "{shown} says \"uninitialized\" (the first boot has not finished): {fix}"
        ));
    }
    let bytes = parse_machine_id(id).ok_or_else(|| {
        format!("{shown} does not hold a machine id (32 hex digits, not all zero): {fix}")
    })?;
    Ok(derive(&bytes))
}

/// The 16 bytes of a machine id written as 32 hex digits (either case);
/// `None` for anything else and for the null id.
fn parse_machine_id(id: &str) -> Option<[u8; 16]> {
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(id.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    (out != [0u8; 16]).then_some(out)
}

/// [`MACHINE_ID_PREFIX`] and the first 12 hex digits of the app-specific id.
fn derive(machine_id: &[u8; 16]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, machine_id);
    let tag = ring::hmac::sign(&key, &APP_ID);
    let digits: String = tag.as_ref()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{MACHINE_ID_PREFIX}{digits}")
}

/// The device id made of the kernel's host name.
///
/// Errors: the host name cannot be read, or it is one every unconfigured
/// image shares (`localhost`) or has nothing usable left after sanitizing.
pub fn from_hostname() -> Result<String, String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname(2) writes at
    // most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(format!(
            "cannot read the host name: {}",
            std::io::Error::last_os_error()
        ));
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    sanitize_hostname(&String::from_utf8_lossy(&buf[..end]))
}

/// `name` lower-cased, every character a device id may not hold made a
/// '-', at most 64 characters.
///
/// Errors: a name every unconfigured image shares, or nothing left.
pub fn sanitize_hostname(name: &str) -> Result<String, String> {
    let fix = "set a host name of its own on the board (hostnamectl set-hostname NAME), or set device_id to a name of your own";
    let name = name.trim();
    if SHARED_HOSTNAMES.contains(&name.to_ascii_lowercase().as_str()) {
        return Err(format!(
            "the host name is {name:?}, the one every unconfigured board has: {fix}"
        ));
    }
    let clean: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if topic_safe(c) { c } else { '-' })
        .take(64)
        .collect();
    let clean = clean.trim_matches(['-', '.']).to_owned();
    if clean.is_empty() {
        return Err(format!("the host name {name:?} leaves no device id: {fix}"));
    }
    Ok(clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    // Vectors from `systemd-id128 machine-id --app-specific=59059745eaf64aef817b21555c34a3fb`
    // with /etc/machine-id bind-mounted over by a file holding each id.
    #[test]
    fn machine_id_gives_systemds_app_specific_id() {
        let a = file("0123456789abcdef0123456789abcdef\n");
        let b = file("fedcba9876543210fedcba9876543210\n");
        assert_eq!(from_machine_id(a.path()).unwrap(), "es-f2d8805e11fc");
        assert_eq!(from_machine_id(b.path()).unwrap(), "es-9e4021d22a13");
    }

    #[test]
    fn the_id_never_contains_the_machine_id() {
        let a = file("0123456789abcdef0123456789abcdef\n");
        let id = from_machine_id(a.path()).unwrap();
        assert!(!"0123456789abcdef0123456789abcdef".contains(&id[3..]));
    }

    #[test]
    fn a_missing_empty_or_malformed_machine_id_names_the_file_and_the_fix() {
        let empty = file("\n");
        let unin = file("uninitialized\n");
        let short = file("0123456789abcdef\n");
        let zero = file("00000000000000000000000000000000\n");
        let junk = file("0123456789abcdef0123456789abcdeg\n");
        let missing = empty.path().with_extension("missing");
        for (p, what) in [
            (missing.as_path(), "cannot read"),
            (empty.path(), "is empty"),
            (unin.path(), "uninitialized"),
            (short.path(), "does not hold a machine id"),
            (zero.path(), "does not hold a machine id"),
            (junk.path(), "does not hold a machine id"),
        ] {
            let e = from_machine_id(p).unwrap_err();
            assert!(e.contains(&p.display().to_string()), "{e}");
            assert!(e.contains(what), "{e}");
            assert!(e.contains("systemd-machine-id-setup"), "{e}");
        }
    }

    #[test]
    fn hostnames_are_sanitized_to_device_id_characters() {
        assert_eq!(sanitize_hostname("Gw-07.plant").unwrap(), "gw-07.plant");
        assert_eq!(sanitize_hostname("gw 07/a+b").unwrap(), "gw-07-a-b");
        assert_eq!(sanitize_hostname(&"x".repeat(100)).unwrap().len(), 64);
        assert!(sanitize_hostname("localhost").is_err());
        assert!(sanitize_hostname("LOCALHOST.localdomain").is_err());
        assert!(sanitize_hostname("+++").is_err());
        // Stock image names: two boards flashed from one image share them.
        for stock in [
            "raspberrypi",
            "RaspberryPi",
            "debian",
            "orangepi",
            "beaglebone",
        ] {
            let e = sanitize_hostname(stock).expect_err(stock);
            assert!(e.contains("every unconfigured board"), "{e}");
        }
        assert_eq!(
            sanitize_hostname("raspberrypi-07").unwrap(),
            "raspberrypi-07"
        );
    }
}
