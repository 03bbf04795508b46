//! What a config push may change.
//!
//! Its one rule: **nothing that arrives over the network can widen what the
//! board's own config file allows** (docs/invariants.md, "Trust boundaries"). The
//! local file (root-owned, `/etc/edgespool/`) decides who the board talks to
//! and what it may run; `[commands.config_push]` in it decides what a push
//! may do:
//!
//! - `mode = "off"`: `apply-config` is refused.
//! - `mode = "overlay"` (default): a push is an *overlay*, a TOML document
//!   that may set only the sampling, retention and tuning keys of
//!   [`OVERLAY_KEYS`]; anything else (the broker, TLS files, credentials,
//!   sources' programs, handlers, the spool path, the push policy itself) is
//!   refused, naming each key path.
//! - `mode = "signed"`: additionally a whole config, accepted only with a
//!   valid Ed25519 signature (RFC 8032) by one of `public_keys`, only when
//!   its `device_id` is this board's, and only with a `[signed] serial`
//!   above every serial this board accepted before (kept in the spool, so
//!   an older signed config cannot be replayed, nor one signed for another
//!   board). What it may not change stays the local file's
//!   ([`LOCAL_ONLY`]: the push policy, who the operator is, identity, and
//!   the paths and sockets the agent writes or binds); the answer names
//!   every such key the signed config set to another value. While a signed config is in force an
//!   overlay is refused (it would discard the signed config): send a
//!   signed config instead.
//!
//! Pushed values are bounded tighter than the local file's
//! ([`OVERLAY_BOUNDS`]): a push may tune the board, never make it slow to
//! come back after an outage (an hour-long reconnect backoff) or flood it.
//!
//! Pure: parsing, flattening and checks, no I/O.

use crate::config::{Config, PushMode};
use crate::os::identity::DeviceIdSource;
use ring::signature::{UnparsedPublicKey, ED25519};

/// Key paths an overlay may set. `sources.*` stands for a source's name.
/// Capacity (`spool.max_bytes`, `spool.min_free_bytes`) is not among them:
/// a push could make the board refuse every reading.
pub const OVERLAY_KEYS: &[&str] = &[
    "sources.*.interval_ms",
    "spool.commit_window_ms",
    "spool.acked_retention_secs",
    "spool.purge_batch_rows",
    "spool.checkpoint_interval_secs",
    "spool.checkpoint_wal_bytes",
    "mqtt.keep_alive_secs",
    "mqtt.connect_timeout_secs",
    "mqtt.reconnect_min_ms",
    "mqtt.reconnect_max_ms",
    "mqtt.ack_timeout_secs",
    "agent.summary_interval_secs",
];

/// Bounds on the values an overlay may set (inclusive, in the key's unit),
/// tighter than the local file's: a pushed `reconnect_min_ms =
/// reconnect_max_ms = 3600000` with `keep_alive_secs = 3600` once kept a
/// board away from its broker for 45-75 minutes after a broker restart.
pub const OVERLAY_BOUNDS: &[(&str, u64, u64)] = &[
    ("sources.*.interval_ms", 100, 86_400_000),
    // What a power cut may cost (synchronous = NORMAL): at most 10 s of
    // readings, not the local file's 60.
    ("spool.commit_window_ms", 1, 10_000),
    ("spool.acked_retention_secs", 60, 315_360_000),
    ("spool.purge_batch_rows", 1, 100_000),
    ("spool.checkpoint_interval_secs", 1, 3_600),
    // A WAL that grows past 64 MiB before a checkpoint slows every read.
    ("spool.checkpoint_wal_bytes", 65_536, 67_108_864),
    ("mqtt.keep_alive_secs", 5, 600),
    ("mqtt.connect_timeout_secs", 1, 60),
    ("mqtt.reconnect_min_ms", 100, 60_000),
    ("mqtt.reconnect_max_ms", 1_000, 300_000),
    ("mqtt.ack_timeout_secs", 5, 600),
    ("agent.summary_interval_secs", 10, 3_600),
];

/// Why the local file decides who may push.
const WHO_PUSHES: &str = "the board's own file says who may push";
/// Why the local file decides who the operator is.
const WHO_OPERATES: &str = "the board's own file says who the operator is";
/// Why the board's identity stays.
const IDENTITY: &str = "the board's own file says which board it is";
/// Why what proves a row delivered stays: a push that listed its own
/// receipt key, or went back to PUBACKs, could retire rows the fleet never
/// stored.
const WHO_RETIRES: &str = "the board's own file says what proves a row delivered";
/// Why paths and sockets stay.
const WRITES: &str = "the board's own file says what the agent writes or binds";

/// What a signed whole config may not change, and why: these keys keep the
/// local file's values (the push policy itself, who the operator is, the
/// board's identity, and every path or socket the agent writes or binds).
/// A signed config that sets one to another value is applied without it,
/// and the answer and the log name it ([`crate::push::compose_noting`]).
pub const LOCAL_ONLY: &[(&str, &str)] = &[
    ("commands.config_push", WHO_PUSHES),
    ("commands.operator_public_keys", WHO_OPERATES),
    ("commands.allow_unsigned", WHO_OPERATES),
    ("device_id", IDENTITY),
    ("mqtt.client_id", IDENTITY),
    ("mqtt.topic_prefix", IDENTITY),
    ("mqtt.retire_on", WHO_RETIRES),
    ("mqtt.receipt_public_keys", WHO_RETIRES),
    ("spool.path", WRITES),
    ("spool.allow_network_fs", WRITES),
    ("metrics.textfile", WRITES),
    ("metrics.listen", WRITES),
    ("metrics.listen_public", WRITES),
    ("ingest.socket", WRITES),
    ("ingest.socket_group", WRITES),
    ("ingest.socket_mode", WRITES),
    ("ingest.tcp", WRITES),
    ("ingest.tcp_public", WRITES),
];

/// Why `key` of [`LOCAL_ONLY`] stays the local file's.
pub fn local_only_why(key: &str) -> &'static str {
    LOCAL_ONLY
        .iter()
        .find(|(k, _)| *k == key)
        .map_or("local only", |(_, why)| why)
}

/// The serial of the newest signed config a board accepted (applied, kept
/// or not), in the spool's `agent_state` table under this key: a signed
/// config must carry a higher one.
pub const SERIAL_STATE_KEY: &str = "config_push_serial";

/// The serial of the signed config the board keeps for its next start
/// (confirmed), under this key: a stored signed push with another serial
/// (an older file put back in the state directory) is ignored.
pub const KEPT_SERIAL_STATE_KEY: &str = "config_push_kept_serial";

/// Check a signed whole config `pushed` (its signature already verified)
/// against the local config and the newest serial this board accepted.
///
/// Errors: it is for another board (its `device_id` is not this one's), it
/// names no board (`device_id = "@machine-id"` or `"@hostname"`: it would
/// be every board's), it carries no `[signed] serial`, or its serial is not
/// above `highest`.
pub fn check_signed(local: &Config, pushed: &Config, highest: u64) -> Result<u64, Refused> {
    if pushed.device_id_source != DeviceIdSource::Config {
        return Err(format!(
            "the signed config says device_id = \"@{}\", which every board resolves to its own id: a signed config names the board it is for (this board is {:?})",
            pushed.device_id_source.kind(),
            local.device_id
        ));
    }
    if pushed.device_id != local.device_id {
        return Err(format!(
            "the signed config is for device {:?}; this board is {:?}",
            pushed.device_id, local.device_id
        ));
    }
    let Some(serial) = pushed.signed_serial else {
        return Err(
            "a signed config must carry [signed] serial (above the last one this board accepted)"
                .to_owned(),
        );
    };
    if serial <= highest {
        return Err(format!(
            "signed.serial {serial} is not above {highest}, the newest this board accepted (an older or replayed config)"
        ));
    }
    Ok(serial)
}

/// A push, checked and ready to apply.
#[derive(Debug, Clone, PartialEq)]
pub enum Push {
    /// `key.path=value` overrides for the local config (the `--set` form,
    /// sources addressed by index), from an overlay.
    Overlay(Vec<String>),
    /// A whole config text whose signature verified.
    Signed(String),
}

/// Why a push was refused; the text names each offending key or the cause.
pub type Refused = String;

/// Check `text` pushed with an optional hex `signature` against the board's
/// policy (`base` is the config in force, built from the local file).
///
/// Errors: the mode is off; the overlay is not TOML, sets a key outside
/// [`OVERLAY_KEYS`] (all such keys are listed) or names an unknown source; a
/// signature was given but the mode is not `signed`, or it does not verify.
pub fn check(base: &Config, text: &str, signature: Option<&str>) -> Result<Push, Refused> {
    let policy = &base.config_push;
    match (policy.mode, signature) {
        (PushMode::Off, _) => Err(
            "config push is off on this board (commands.config_push.mode = \"off\" in its local config)"
                .to_owned(),
        ),
        (PushMode::Overlay, Some(_)) => Err(
            "a signed whole config is not accepted: commands.config_push.mode is \"overlay\" (send an overlay of the allowed keys instead)"
                .to_owned(),
        ),
        (PushMode::Signed, Some(sig)) => {
            verify(text.as_bytes(), sig, &policy.public_keys)?;
            Ok(Push::Signed(text.to_owned()))
        }
        (_, None) => overlay_sets(base, text).map(Push::Overlay),
    }
}

/// Verify an Ed25519 `signature_hex` (128 hex digits) over `message` with any
/// of `keys` (32-byte public keys).
pub fn verify(message: &[u8], signature_hex: &str, keys: &[[u8; 32]]) -> Result<(), Refused> {
    let sig = crate::event::hex::decode(signature_hex.trim())
        .filter(|s| s.len() == 64)
        .ok_or("args.signature: must be 128 hex digits (an Ed25519 signature)")?;
    if keys.is_empty() {
        return Err("no commands.config_push.public_keys in the local config".to_owned());
    }
    if keys.iter().any(|k| {
        UnparsedPublicKey::new(&ED25519, k)
            .verify(message, &sig)
            .is_ok()
    }) {
        Ok(())
    } else {
        Err(
            "args.signature: does not verify with any of commands.config_push.public_keys"
                .to_owned(),
        )
    }
}

/// The `--set` overrides an overlay stands for, after checking every key.
fn overlay_sets(base: &Config, text: &str) -> Result<Vec<String>, Refused> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        format!("overlay is not valid TOML: {}", e.message().trim())
    })?;
    let mut leaves = Vec::new();
    flatten("", &toml::Value::Table(table), &mut leaves);
    if leaves.is_empty() {
        return Err("overlay sets no key".to_owned());
    }
    let mut refused = Vec::new();
    let mut sets = Vec::new();
    for (path, value) in leaves {
        if path.contains('\u{0}') {
            refused.push(path);
            continue;
        }
        match allowed(&path) {
            Some(Some(source)) => match base.sources.iter().position(|s| s.name == source) {
                Some(i) => sets.push(format!("sources.{i}.interval_ms={value}")),
                None => refused.push(format!("{path} (no source named {source:?})")),
            },
            Some(None) => sets.push(format!("{path}={value}")),
            None => {
                refused.push(path);
                continue;
            }
        }
        if let Some(why) = out_of_bounds(&path, &value) {
            refused.push(why);
        }
    }
    if refused.is_empty() {
        return Ok(sets);
    }
    // The answer goes back over MQTT: bounded, whatever the keys' size.
    let total = refused.len();
    let mut named: Vec<String> = refused.iter().take(MAX_NAMED).map(|k| shorten(k)).collect();
    if total > MAX_NAMED {
        named.push(format!("and {} more", total - MAX_NAMED));
    }
    Err(format!(
        "an overlay may not set {} (allowed: {})",
        named.join(", "),
        OVERLAY_KEYS.join(", ")
    ))
}

/// Why `value` is outside [`OVERLAY_BOUNDS`] for `path`, if it is.
fn out_of_bounds(path: &str, value: &str) -> Option<String> {
    let pattern = if path.starts_with("sources.") {
        "sources.*.interval_ms"
    } else {
        path
    };
    let (_, lo, hi) = OVERLAY_BOUNDS.iter().find(|(k, _, _)| *k == pattern)?;
    match value.parse::<u64>() {
        Ok(v) if (*lo..=*hi).contains(&v) => None,
        _ => Some(format!(
            "{path} = {} (a push may set {lo}..={hi})",
            shorten(value)
        )),
    }
}

/// Refused keys named in one answer, at most.
const MAX_NAMED: usize = 16;

/// `k`, cut to 80 characters.
fn shorten(k: &str) -> String {
    let k = k.replace('\u{0}', "");
    if k.chars().count() <= 80 {
        k
    } else {
        format!("{}...", k.chars().take(77).collect::<String>())
    }
}

/// `Some(Some(source))` for `sources.<source>.interval_ms`, `Some(None)` for
/// another allowed key, `None` when the key is not allowed.
fn allowed(path: &str) -> Option<Option<String>> {
    if let Some(rest) = path.strip_prefix("sources.") {
        return rest
            .strip_suffix(".interval_ms")
            .filter(|name| !name.is_empty() && !name.contains('.'))
            .map(|name| Some(name.to_owned()));
    }
    OVERLAY_KEYS.contains(&path).then_some(None)
}

/// Leaf values of `v` as (dotted path, TOML value text). Arrays are leaves
/// (no allowed key is an array, so they are refused by path).
fn flatten(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                // A quoted key holding a dot is one key, not a path: it
                // names nothing in the config (refused, shown quoted).
                let k = if k.contains('.') {
                    format!("\"{k}\"\u{0}")
                } else {
                    k.clone()
                };
                let p = if prefix.is_empty() {
                    k
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&p, v, out);
            }
        }
        other => out.push((prefix.to_owned(), other.to_string())),
    }
}

/// True when `a` and `b` differ in anything that decides the MQTT
/// connection (so applying the change must be confirmed by a CONNACK).
pub fn touches_connection(a: &Config, b: &Config) -> bool {
    a.mqtt != b.mqtt
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::signature::{Ed25519KeyPair, KeyPair};

    const BASE: &str = r#"
device_id = "d"
[spool]
path = "/tmp/x/spool.db"
[mqtt]
url = "mqtt://127.0.0.1:1883"
[[sources]]
name = "temp"
kind = "file"
path = "/tmp/t"
interval_ms = 1000
"#;

    fn base(mode: &str, keys: &[String]) -> Config {
        let extra = format!(
            "[commands.config_push]\nmode = \"{mode}\"\npublic_keys = [{}]\n",
            keys.iter()
                .map(|k| format!("\"{k}\""))
                .collect::<Vec<_>>()
                .join(", ")
        );
        crate::config::parse(&format!("{BASE}{extra}"), "test", &[]).unwrap()
    }

    #[test]
    fn an_overlay_of_tuning_keys_becomes_overrides_with_sources_by_name() {
        let b = base("overlay", &[]);
        let p = check(
            &b,
            "[sources.temp]\ninterval_ms = 500\n[spool]\nacked_retention_secs = 3600\n",
            None,
        )
        .unwrap();
        let Push::Overlay(mut sets) = p else {
            panic!("{p:?}")
        };
        sets.sort();
        assert_eq!(
            sets,
            vec![
                "sources.0.interval_ms=500".to_owned(),
                "spool.acked_retention_secs=3600".to_owned()
            ]
        );
    }

    #[test]
    fn an_overlay_that_runs_a_program_or_moves_the_broker_is_refused_naming_each_key() {
        let b = base("overlay", &[]);
        let e = check(
            &b,
            "[mqtt]\nurl = \"mqtt://evil:1883\"\n[[sources]]\nname = \"x\"\nkind = \"exec\"\ncommand = [\"/bin/sh\", \"-c\", \"id\"]\n[commands.config_push]\nmode = \"signed\"\n",
            None,
        )
        .unwrap_err();
        for key in ["mqtt.url", "sources", "commands.config_push.mode"] {
            assert!(e.contains(key), "{e}");
        }
        let e = check(&b, "[sources.nope]\ninterval_ms = 5\n", None).unwrap_err();
        assert!(e.contains("no source named"), "{e}");
        // Capacity could make the board refuse every reading.
        let e = check(&b, "[spool]\nmin_free_bytes = 1000000000000000\n", None).unwrap_err();
        assert!(e.contains("spool.min_free_bytes"), "{e}");
        // A quoted key with dots is one key, not a path.
        let e = check(&b, "\"sources.temp.interval_ms\" = 5\n", None).unwrap_err();
        assert!(e.contains("may not set"), "{e}");
        // The answer stays small whatever the attacker sends.
        let huge: String = (0..500)
            .map(|i| format!("\"{}{i}\" = 1\n", "k".repeat(200)))
            .collect();
        let e = check(&b, &huge, None).unwrap_err();
        assert!(e.len() < 4000, "{} bytes", e.len());
        assert!(e.contains("and 484 more"), "{e}");
    }

    #[test]
    fn mode_off_refuses_every_push_and_overlay_mode_refuses_signatures() {
        let e = check(&base("off", &[]), "[spool]\npurge_batch_rows = 10\n", None).unwrap_err();
        assert!(e.contains("off"), "{e}");
        let e = check(&base("overlay", &[]), BASE, Some("00")).unwrap_err();
        assert!(e.contains("not accepted"), "{e}");
    }

    #[test]
    fn a_signed_config_verifies_only_with_a_listed_key() {
        let rng = ring::rand::SystemRandom::new();
        let doc = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        let other =
            Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).unwrap().as_ref())
                .unwrap();
        let hex = |b: &[u8]| crate::event::hex::encode(b);
        let b = base("signed", &[hex(kp.public_key().as_ref())]);
        let sig = hex(kp.sign(BASE.as_bytes()).as_ref());
        assert_eq!(
            check(&b, BASE, Some(&sig)).unwrap(),
            Push::Signed(BASE.to_owned())
        );
        let wrong = hex(other.sign(BASE.as_bytes()).as_ref());
        assert!(check(&b, BASE, Some(&wrong))
            .unwrap_err()
            .contains("does not verify"));
        let tampered = format!("{BASE}\n# more");
        assert!(check(&b, &tampered, Some(&sig)).is_err());
        assert!(check(&b, BASE, Some("zz")).is_err());
    }

    #[test]
    fn a_signed_config_must_be_for_this_board_with_a_serial_above_the_last() {
        let local = base("overlay", &[]);
        let pushed = |extra: &str| {
            crate::config::parse(&format!("{BASE}{extra}"), "signed push", &[]).unwrap()
        };
        assert_eq!(
            check_signed(&local, &pushed("[signed]\nserial = 3\n"), 2),
            Ok(3)
        );
        let e = check_signed(&local, &pushed("[signed]\nserial = 2\n"), 2).unwrap_err();
        assert!(e.contains("not above 2"), "{e}");
        let e = check_signed(&local, &pushed(""), 0).unwrap_err();
        assert!(e.contains("[signed] serial"), "{e}");
        let other = BASE.replace("device_id = \"d\"", "device_id = \"gw-victim\"");
        let cfg =
            crate::config::parse(&format!("{other}[signed]\nserial = 9\n"), "p", &[]).unwrap();
        let e = check_signed(&local, &cfg, 0).unwrap_err();
        assert!(
            e.contains("for device \"gw-victim\"; this board is \"d\""),
            "{e}"
        );
        let e =
            crate::config::parse(&format!("{BASE}[signed]\nserial = 0\n"), "p", &[]).unwrap_err();
        assert!(e.to_string().contains("signed.serial"), "{e}");
    }

    #[test]
    fn a_signed_config_that_names_no_board_is_refused_even_if_it_resolves_to_this_one() {
        let local = crate::config::parse(BASE, "local", &[]).unwrap();
        // What `device_id = "@machine-id"` in the pushed text resolves to on
        // this board: its own id, but it would be every board's.
        let mut pushed =
            crate::config::parse(&format!("{BASE}[signed]\nserial = 3\n"), "p", &[]).unwrap();
        pushed.device_id_source = DeviceIdSource::MachineId("/etc/machine-id".into());
        let e = check_signed(&local, &pushed, 0).unwrap_err();
        assert!(
            e.contains("\"@machine-id\"") && e.contains("names the board"),
            "{e}"
        );
        pushed.device_id_source = DeviceIdSource::Hostname;
        assert!(check_signed(&local, &pushed, 0).is_err());
    }

    #[test]
    fn pushed_tuning_stays_within_bounds_tighter_than_the_local_file() {
        let b = base("overlay", &[]);
        // An hour-long backoff and keep-alive once kept a board away for an hour.
        let e = check(
            &b,
            "[mqtt]\nreconnect_min_ms = 3600000\nreconnect_max_ms = 3600000\nkeep_alive_secs = 3600\n",
            None,
        )
        .unwrap_err();
        for want in [
            "mqtt.reconnect_min_ms = 3600000 (a push may set 100..=60000)",
            "mqtt.reconnect_max_ms = 3600000 (a push may set 1000..=300000)",
            "mqtt.keep_alive_secs = 3600 (a push may set 5..=600)",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        let e = check(&b, "[sources.temp]\ninterval_ms = 10\n", None).unwrap_err();
        assert!(
            e.contains("sources.temp.interval_ms = 10 (a push may set 100..=86400000)"),
            "{e}"
        );
        // A minute of readings lost to a power cut, a 1 GiB WAL: the local
        // file may choose them, a push may not.
        let e = check(
            &b,
            "[spool]\ncommit_window_ms = 60000\ncheckpoint_wal_bytes = 1073741824\n",
            None,
        )
        .unwrap_err();
        assert!(
            e.contains("spool.commit_window_ms = 60000 (a push may set 1..=10000)")
                && e.contains("spool.checkpoint_wal_bytes = 1073741824"),
            "{e}"
        );
        let e = check(&b, "[mqtt]\nkeep_alive_secs = \"60\"\n", None).unwrap_err();
        assert!(e.contains("keep_alive_secs"), "{e}");
        // Within the bounds: applied.
        assert!(check(
            &b,
            "[mqtt]\nreconnect_max_ms = 300000\nkeep_alive_secs = 600\n",
            None
        )
        .is_ok());
        // Every key an overlay may set has a bound.
        for key in OVERLAY_KEYS {
            assert!(
                OVERLAY_BOUNDS.iter().any(|(k, _, _)| k == key),
                "{key} has no bound"
            );
        }
    }
}
