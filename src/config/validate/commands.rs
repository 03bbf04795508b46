//! `[commands]` validation: the bounds of the command channel and
//! `[commands.config_push]`. Handlers are in `handlers.rs`.

use super::bounds::{check_range, Bounds};
use super::TEN_YEARS_SECS;
use crate::config::raw::{RawCommands, RawConfigPush};
use crate::config::ConfigPush;
use crate::event::signature::PublicKey;
use std::time::Duration;

/// `[commands]` bounds: payload size, record retention (3600 s..=ten years),
/// records, queue, rates, and a `default_ttl_secs` within the retention.
pub(super) fn check_command_bounds(rc: &RawCommands, bad: &mut impl FnMut(&str, String)) {
    check_range(
        "commands.max_payload_bytes",
        rc.max_payload_bytes,
        256..=1024 * 1024,
        bad,
    );
    let retention = rc.record_retention_secs;
    let key = "commands.record_retention_secs";
    check_range(key, retention, Bounds::at_most(TEN_YEARS_SECS), bad);
    let redelivery = Bounds::at_least(3600).note(", longer than any redelivery window");
    check_range(key, retention, redelivery, bad);
    check_range(
        "commands.max_records",
        rc.max_records,
        1000..=1_000_000,
        bad,
    );
    check_range("commands.max_queued", rc.max_queued, 1..=10_000, bad);
    check_range(
        "commands.max_per_minute_per_scope",
        rc.max_per_minute_per_scope,
        1..=60_000,
        bad,
    );
    check_range(
        "commands.max_per_minute",
        rc.max_per_minute,
        1..=600_000,
        bad,
    );
    check_range(
        "commands.max_answers_per_minute",
        rc.max_answers_per_minute,
        1..=600_000,
        bad,
    );
    if rc.default_ttl_secs == 0 || rc.default_ttl_secs > rc.record_retention_secs {
        // A command may still run only while its record is sure to exist:
        // past the redelivery window a redelivery could find no record.
        bad(
            "commands.default_ttl_secs",
            format!(
                "must be 1..=commands.record_retention_secs ({}) (got {})",
                rc.record_retention_secs, rc.default_ttl_secs
            ),
        );
    }
}

/// Operator keys listed at most (each is one signature check for a signed
/// command that verifies with none of them).
const MAX_OPERATOR_KEYS: usize = 16;

/// `commands.operator_public_keys`: at most [`MAX_OPERATOR_KEYS`] Ed25519
/// public keys, 64 hex digits each, none twice.
pub(super) fn operator_keys(keys: &[String], bad: &mut impl FnMut(&str, String)) -> Vec<PublicKey> {
    let key = "commands.operator_public_keys";
    if keys.len() > MAX_OPERATOR_KEYS {
        bad(
            key,
            format!(
                "at most {MAX_OPERATOR_KEYS} keys (got {}): list the ones in use, old ones \
                 only while commands signed with them may still arrive",
                keys.len()
            ),
        );
    }
    let mut out: Vec<PublicKey> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        match PublicKey::from_hex(k) {
            Ok(p) if out.contains(&p) => bad(&format!("{key}.{i}"), format!("{k:?} is listed twice")),
            Ok(p) => out.push(p),
            Err(_) => bad(
                &format!("{key}.{i}"),
                format!(
                    "must be an Ed25519 public key, 64 hex digits, as `edgespool keygen --out FILE` \
                     prints it (got {:?})",
                    k.chars().take(80).collect::<String>()
                ),
            ),
        }
    }
    out
}

/// `[commands.config_push]`: the mode and its confirmation window.
pub(super) fn validate_push(raw: &RawConfigPush, bad: &mut impl FnMut(&str, String)) -> ConfigPush {
    use crate::config::PushMode;
    let mode = match raw.mode.as_str() {
        "off" => PushMode::Off,
        "overlay" => PushMode::Overlay,
        "signed" => PushMode::Signed,
        other => {
            bad(
                "commands.config_push.mode",
                format!("must be \"off\", \"overlay\" or \"signed\" (got {other:?})"),
            );
            PushMode::Off
        }
    };
    check_range(
        "commands.config_push.confirm_secs",
        raw.confirm_secs,
        5..=3600,
        bad,
    );
    let mut keys = Vec::new();
    for (i, k) in raw.public_keys.iter().enumerate() {
        match crate::event::hex::decode(k.trim()).and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            Some(key) => keys.push(key),
            None => bad(
                &format!("commands.config_push.public_keys.{i}"),
                format!("must be an Ed25519 public key, 64 hex digits (got {k:?})"),
            ),
        }
    }
    if mode == PushMode::Signed && raw.public_keys.is_empty() {
        bad(
            "commands.config_push.public_keys",
            "mode \"signed\" needs at least one public key".to_owned(),
        );
    }
    ConfigPush {
        mode,
        confirm: Duration::from_secs(raw.confirm_secs),
        public_keys: keys,
    }
}
