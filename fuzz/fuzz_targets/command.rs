//! A command message: topic and payload bytes, as the MQTT thread routes a
//! PUBLISH (`topic == <topic_prefix>/commands`, a string comparison) and the
//! command worker parses it with `commands::parse`, up to the request hash.
//!
//! Input: topic bytes, a 0 byte, payload bytes (no 0 byte: all payload).
//!
//! Bounds asserted, for a message that parses:
//! - the request hash is the sha256 of the canonical form, which is itself
//!   JSON with no whitespace;
//! - what `commands::canonical` promises: the hash does not change when the
//!   message's keys are reordered (every object, at every depth) or its
//!   numbers re-spelt (`1` as `1.0` and `1e0` when its magnitude is below
//!   9e15, the bound the canonical form states; any other number in
//!   exponent form, which denotes the same f64);
//! - the ids are what the parser promises (1..=128 / 1..=64 safe characters).
#![no_main]

use edgespool::commands::{self, Command};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// `commands.max_payload_bytes` default.
const MAX_PAYLOAD: usize = 65536;
const TOPIC: &[u8] = b"edgespool/board/commands";

fuzz_target!(|data: &[u8]| {
    let (topic, payload) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (TOPIC, data),
    };
    if topic != TOPIC || payload.is_empty() {
        // Not the command topic: acknowledged and ignored; an empty payload
        // clears a retained command. Neither is parsed.
        return;
    }
    let Ok(cmd) = commands::parse(payload, MAX_PAYLOAD) else {
        return;
    };
    check(&cmd);
    let respelt = respell(&cmd, 0);
    let again = commands::parse(respelt.as_bytes(), usize::MAX)
        .unwrap_or_else(|e| panic!("re-spelt message refused: {e}\n{respelt}"));
    assert_eq!(
        edgespool::event::hex::encode(&again.request_hash),
        edgespool::event::hex::encode(&cmd.request_hash),
        "request hash changed by key order or number spelling:\n{}\n{}",
        cmd.canonical,
        again.canonical
    );
    let other = respell(&cmd, 1);
    let third = commands::parse(other.as_bytes(), usize::MAX)
        .unwrap_or_else(|e| panic!("re-spelt message refused: {e}\n{other}"));
    assert_eq!(
        third.request_hash, cmd.request_hash,
        "{}\n{}",
        cmd.canonical, third.canonical
    );
});

fn check(cmd: &Command) {
    let digest: [u8; 32] = Sha256::digest(cmd.canonical.as_bytes()).into();
    assert_eq!(digest, cmd.request_hash);
    let v: Value = serde_json::from_str(&cmd.canonical).expect("canonical form is JSON");
    assert_eq!(
        serde_json::to_string(&v).ok().as_deref(),
        Some(cmd.canonical.as_str())
    );
    let safe = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.:@".contains(&c))
    };
    assert!(safe(&cmd.command_id, 128) && safe(&cmd.scope, 64) && safe(&cmd.name, 64));
}

/// The message again with every object's keys in reverse order and every
/// number spelt another way (`variant` picks which).
fn respell(cmd: &Command, variant: u8) -> String {
    let mut out = String::from("{");
    out.push_str(&format!("\"name\":{},", Value::from(cmd.name.clone())));
    out.push_str("\"args\":");
    write_value(&Value::Object(cmd.args.clone()), variant, &mut out);
    out.push_str(&format!(
        ",\"command_id\":{}}}",
        Value::from(cmd.command_id.clone())
    ));
    out
}

fn write_value(v: &Value, variant: u8, out: &mut String) {
    match v {
        Value::Object(m) => {
            out.push('{');
            for (i, (k, v)) in m.iter().rev().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(k.clone()).to_string());
                out.push(':');
                write_value(v, variant, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(v, variant, out);
            }
            out.push(']');
        }
        Value::Number(n) => {
            let small_integer = n
                .as_i64()
                .map(|i| i.unsigned_abs() < 9_000_000_000_000_000)
                .or_else(|| n.as_u64().map(|u| u < 9_000_000_000_000_000))
                .unwrap_or(false);
            if small_integer {
                let s = n.to_string();
                out.push_str(&if variant == 0 {
                    format!("{s}.0")
                } else {
                    format!("{s}e0")
                });
            } else if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                // Same f64, another spelling.
                out.push_str(&if variant == 0 {
                    format!("{f:e}")
                } else {
                    format!("{f:E}")
                });
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&other.to_string()),
    }
}
