//! Commands over MQTT, each run at most once.
//!
//! Commands arrive as JSON on `<topic_prefix>/commands` (QoS 1, persistent
//! session, manual acknowledgements). Its one rule: **a (scope, command_id)
//! has its side effect at most once (I4)**: the receipt is claimed atomically
//! in SQLite (`INSERT .. ON CONFLICT DO NOTHING`) and committed, with
//! `synchronous = FULL`, *before* the PUBLISH is acknowledged; the result is
//! stored with the record and appended to the spool as an event in the same
//! transaction that ends the command.
//!
//! Message: `{"command_id": "c-1", "name": "ping", "args": {..},
//! "ttl_secs": 60, "scope": "ops", "issued_at_ms": 1790000000000,
//! "signature": "<128 hex>"}`; `command_id` and `name` are required, the
//! rest optional (`scope` defaults to `default`). Unknown fields are
//! rejected. A command signed by one of `commands.operator_public_keys` is
//! the operator's ([`signed`], [`admission`]).
//!
//! Files: [`worker`] (the command thread: its loop, receipt, admission,
//! dispatch), `inbox` (the bounded hand-off from the MQTT thread),
//! `backlog` (what the thread has taken and not yet handled, by tier),
//! `message` (what reaches the thread), `lanes` (where a command runs; the
//! lane threads), `hold` (commands held back, unacknowledged), `results`
//! (ending a command), `recovery` (commands left unfinished at start),
//! `records` (when records are purged; the agent clock persisted), `quiet`
//! (repeated log lines kept few), [`store`] (records and result events),
//! [`retention`] (how long records live, on the agent's monotonic clock),
//! [`rate`] (rate limits), [`admission`] (who gets room: the operator's
//! reserved share of every bound, global budgets), [`signed`] (who signed
//! a command: the operator's keys), [`timefloor`] (a time the board knows
//! has passed, for signed deadlines on an untrusted clock), [`exec_handler`]
//! (operator-declared programs), [`builtin`] (built-in handlers).

pub mod admission;
mod backlog;
pub mod builtin;
pub mod exec_handler;
mod hold;
mod inbox;
mod lanes;
mod message;
mod quiet;
pub mod rate;
mod records;
mod recovery;
mod results;
pub mod retention;
pub mod settings;
pub mod signed;
pub mod store;
pub mod timefloor;
pub mod worker;

pub use settings::{CommandsConfig, ExecHandler, ParamKind, ParamSpec};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::time::Duration;

/// Built-in command names (exec handlers may not reuse them).
pub const BUILTINS: &[&str] = &[
    "ping",
    "status",
    "set-interval",
    "flush",
    "checkpoint",
    "requeue-failed",
    "apply-config",
    "reload-config",
];

/// Scope used when a command names none.
pub const DEFAULT_SCOPE: &str = "default";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCommand {
    command_id: String,
    name: String,
    #[serde(default)]
    args: serde_json::Map<String, serde_json::Value>,
    ttl_secs: Option<u64>,
    scope: Option<String>,
    issued_at_ms: Option<i64>,
    signature: Option<String>,
}

/// A parsed, validated command.
#[derive(Debug, Clone, PartialEq)]
pub struct Command {
    /// Who issued it; ids are unique per scope.
    pub scope: String,
    /// The idempotency key within the scope.
    pub command_id: String,
    /// Handler name.
    pub name: String,
    /// Arguments.
    pub args: serde_json::Map<String, serde_json::Value>,
    /// Time to live from issue (or from receipt when the issue time is
    /// unknown or the clock is not trusted).
    pub ttl: Option<Duration>,
    /// Operator's wall-clock issue time, Unix ms.
    pub issued_at_ms: Option<i64>,
    /// Canonical form of (name, args): keys sorted, integral numbers without
    /// a fraction, no whitespace.
    pub canonical: String,
    /// sha256 of `canonical`: the request hash.
    pub request_hash: [u8; 32],
    /// `signature`: an Ed25519 signature ([`signed`] says over what), 128
    /// hex digits in the message. Not part of the request hash: the same
    /// request signed or not is one command.
    pub signature: Option<[u8; crate::event::signature::SIGNATURE_BYTES]>,
}

/// Why a command message could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Larger than `commands.max_payload_bytes`.
    #[error("command payload of {len} bytes exceeds commands.max_payload_bytes {max}")]
    TooLarge {
        /// Payload size.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// Not UTF-8.
    #[error("command payload is not UTF-8 text")]
    NotUtf8,
    /// Not a valid command object.
    #[error("malformed command: {detail}")]
    Malformed {
        /// What is wrong.
        detail: String,
        /// The `command_id`, if one could be read.
        command_id: Option<String>,
    },
}

impl ParseError {
    /// The command id, when the payload had a readable one.
    pub fn command_id(&self) -> Option<&str> {
        match self {
            ParseError::Malformed { command_id, .. } => command_id.as_deref(),
            _ => None,
        }
    }
}

/// Whether `s` is a scope a command may name (1..=64 of
/// `[A-Za-z0-9-_.:@]`).
pub fn valid_scope(s: &str) -> bool {
    ident_ok(s, 64)
}

fn ident_ok(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '@'))
}

/// Parse and validate a command message.
///
/// Errors: [`ParseError`] naming what is wrong; the caller answers with a
/// `rejected` result and counts it.
pub fn parse(payload: &[u8], max_bytes: usize) -> Result<Command, ParseError> {
    if payload.len() > max_bytes {
        return Err(ParseError::TooLarge {
            len: payload.len(),
            max: max_bytes,
        });
    }
    let text = std::str::from_utf8(payload).map_err(|_| ParseError::NotUtf8)?;
    let raw: RawCommand = serde_json::from_str(text).map_err(|e| {
        let command_id = serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| {
                v.get("command_id")
                    .and_then(|c| c.as_str())
                    .map(str::to_owned)
            })
            .filter(|c| ident_ok(c, 128));
        ParseError::Malformed {
            detail: e.to_string(),
            command_id,
        }
    })?;
    let bad = |detail: String| ParseError::Malformed {
        detail,
        command_id: ident_ok(&raw.command_id, 128).then(|| raw.command_id.clone()),
    };
    if !ident_ok(&raw.command_id, 128) {
        return Err(bad(format!(
            "command_id must be 1..=128 of [A-Za-z0-9-_.:@] (got {:?})",
            truncate(&raw.command_id, 64)
        )));
    }
    let scope = raw
        .scope
        .clone()
        .unwrap_or_else(|| DEFAULT_SCOPE.to_owned());
    if !ident_ok(&scope, 64) {
        return Err(bad(format!(
            "scope must be 1..=64 of [A-Za-z0-9-_.:@] (got {:?})",
            truncate(&scope, 64)
        )));
    }
    if !ident_ok(&raw.name, 64) {
        return Err(bad(format!(
            "name must be 1..=64 of [A-Za-z0-9-_.:@] (got {:?})",
            truncate(&raw.name, 64)
        )));
    }
    if raw.ttl_secs == Some(0) {
        return Err(bad("ttl_secs must be at least 1".into()));
    }
    let signature = match &raw.signature {
        None => None,
        Some(s) => Some(
            crate::event::hex::decode(s)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| {
                    bad(format!(
                        "signature must be 128 hex digits, an Ed25519 signature (got {} characters)",
                        s.chars().count()
                    ))
                })?,
        ),
    };
    let canonical = canonical(&raw.name, &raw.args);
    let request_hash: [u8; 32] = Sha256::digest(canonical.as_bytes()).into();
    Ok(Command {
        scope,
        command_id: raw.command_id,
        name: raw.name,
        args: raw.args,
        ttl: raw.ttl_secs.map(Duration::from_secs),
        issued_at_ms: raw.issued_at_ms,
        canonical,
        request_hash,
        signature,
    })
}

fn truncate(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// Canonical JSON of `{"args": args, "name": name}`: object keys sorted,
/// numbers with an integral value written as integers (`1.0` == `1`), no
/// whitespace. Key order and number formatting in the message therefore do
/// not change the request hash.
pub fn canonical(name: &str, args: &serde_json::Map<String, serde_json::Value>) -> String {
    fn norm(v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::Number(n) => match n.as_f64() {
                Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
                    Value::from(f as i64)
                }
                _ => v.clone(),
            },
            Value::Array(a) => Value::Array(a.iter().map(norm).collect()),
            Value::Object(o) => {
                let sorted: std::collections::BTreeMap<&String, serde_json::Value> =
                    o.iter().map(|(k, v)| (k, norm(v))).collect();
                Value::Object(sorted.into_iter().map(|(k, v)| (k.clone(), v)).collect())
            }
            _ => v.clone(),
        }
    }
    let doc = serde_json::json!({
        "args": norm(&serde_json::Value::Object(args.clone())),
        "name": name,
    });
    // serde_json's Map keeps keys sorted (no preserve_order feature), and the
    // normalisation above sorts explicitly too.
    doc.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_and_number_format_do_not_change_the_request_hash() {
        let a = parse(br#"{"command_id":"c-1","name":"set-interval","args":{"source":"s","interval_ms":1000}}"#, 4096).unwrap();
        let b = parse(br#"{"name":"set-interval","args":{"interval_ms":1000.0,"source":"s"},"command_id":"c-1"}"#, 4096).unwrap();
        assert_eq!(a.request_hash, b.request_hash);
        let c = parse(br#"{"command_id":"c-1","name":"set-interval","args":{"source":"s","interval_ms":1001}}"#, 4096).unwrap();
        assert_ne!(a.request_hash, c.request_hash);
    }

    /// Found by the `command` fuzz target: without serde_json's
    /// `float_roundtrip`, `18446749747034551616` parsed to the f64 one unit
    /// above the nearest (`1.8446749747034554e19`, not `1.844674974703455e19`),
    /// so the same command resent with that number spelt another way hashed
    /// differently (a conflict instead of the stored result), and the
    /// canonical form did not read back as itself.
    #[test]
    fn a_number_spelt_in_full_or_in_exponent_form_gives_one_request_hash() {
        let spellings = [
            "18446749747034551616",
            "18446749747034550272",
            "1.844674974703455e19",
            "184467497470345502.72e2",
        ];
        let hashes: Vec<String> = spellings
            .iter()
            .map(|n| {
                let msg = format!(r#"{{"command_id":"c-2","name":"x","args":{{"n":{n}}}}}"#);
                let c = parse(msg.as_bytes(), 4096).unwrap();
                assert_eq!(
                    c.canonical, r#"{"args":{"n":1.844674974703455e+19},"name":"x"}"#,
                    "{n}"
                );
                let again: serde_json::Value = serde_json::from_str(&c.canonical).unwrap();
                assert_eq!(
                    again.to_string(),
                    c.canonical,
                    "canonical form reads back as itself"
                );
                crate::event::hex::encode(&c.request_hash)
            })
            .collect();
        assert!(hashes.windows(2).all(|w| w[0] == w[1]), "{hashes:?}");
    }

    #[test]
    fn scope_defaults_and_ttl_is_read() {
        let c = parse(br#"{"command_id":"c-1","name":"ping","ttl_secs":5}"#, 4096).unwrap();
        assert_eq!(c.scope, DEFAULT_SCOPE);
        assert_eq!(c.ttl, Some(Duration::from_secs(5)));
    }

    #[test]
    fn malformed_payloads_are_rejected_with_a_reason() {
        assert_eq!(parse(&[0xff, 0xfe], 4096), Err(ParseError::NotUtf8));
        assert!(matches!(
            parse(b"{}", 1),
            Err(ParseError::TooLarge { len: 2, max: 1 })
        ));
        let e = parse(br#"{"command_id":"c-9","name":"ping","argz":{}}"#, 4096).unwrap_err();
        assert_eq!(e.command_id(), Some("c-9"));
        assert!(e.to_string().contains("unknown field `argz`"), "{e}");
        assert!(parse(br#"{"name":"ping"}"#, 4096).is_err());
        assert!(parse(br#"{"command_id":"a b","name":"ping"}"#, 4096).is_err());
        assert!(parse(br#"{"command_id":"c","name":"ping","ttl_secs":0}"#, 4096).is_err());
        assert!(parse(b"[1,2,3]", 4096).is_err());
    }
}
