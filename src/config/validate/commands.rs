//! `[commands]` validation: `[commands.config_push]`.

use crate::config::raw::RawConfigPush;
use crate::config::ConfigPush;
use std::time::Duration;

/// `[commands.config_push]`: the mode and its confirmation window.
pub(super) fn validate_push(raw: &RawConfigPush, bad: &mut impl FnMut(&str, String)) -> ConfigPush {
    use crate::policy::PushMode;
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
    if !(5..=3600).contains(&raw.confirm_secs) {
        bad(
            "commands.config_push.confirm_secs",
            format!("must be 5..=3600 (got {})", raw.confirm_secs),
        );
    }
    let mut keys = Vec::new();
    for (i, k) in raw.public_keys.iter().enumerate() {
        match crate::policy::decode_hex(k.trim()).and_then(|b| <[u8; 32]>::try_from(b).ok()) {
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
