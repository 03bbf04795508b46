//! Who signed a command: the operator's keys, the bytes a command's
//! signature covers, and the one helper that signs them.
//!
//! Its one rule: **the operator is a key the board's own config lists,
//! never a name a command claims** (docs/invariants.md, "Trust boundaries"). A
//! command carries `"signature": "<128 hex>"`, the Ed25519 signature (RFC
//! 8032) of [`signed_bytes`]: the [`Domain::Command`] label, then
//!
//! ```text
//! device_id NUL scope NUL command_id NUL issued_at_ms NUL ttl_secs NUL request_hash
//! ```
//!
//! where `scope` is the command's (`default` when it names none),
//! `issued_at_ms` and `ttl_secs` are written in decimal (empty when the
//! command has none), and `request_hash` is the 32 raw bytes of the sha256
//! of the canonical request ([`super::canonical`]). So a signature is good
//! for one request under one (scope, command id) on one board: replayed, it
//! meets its own record and is answered as a duplicate (I4); moved to
//! another board, scope or id, given other arguments, or stripped of its
//! deadline, it verifies no more. The scope is bound because the record key
//! is (scope, command id): a signature that left it out could be replayed
//! under another scope as a new command. The deadline is bound so that a
//! replay after the record has aged out (past `record_retention_secs`) is
//! `expired` rather than run again: on a trusted clock by the wall clock,
//! on an untrusted one by the time floor the operator's own signed issue
//! times build ([`super::timefloor`]).

use super::Command;
use crate::event::hex;
use crate::event::signature::{Domain, PublicKey, SigningKey, SIGNATURE_BYTES};

/// How a command is signed, judged against the board's operator keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signer {
    /// No `signature`.
    Unsigned,
    /// Its signature verifies with one of `commands.operator_public_keys`.
    Operator,
    /// It carries a signature that verifies with none of them (another
    /// key, another board, scope, id, deadline or request).
    Unknown,
}

/// The board's operator keys (`commands.operator_public_keys`) and the
/// device they sign for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorKeys {
    device_id: String,
    keys: Vec<PublicKey>,
}

impl OperatorKeys {
    /// The keys `keys` of the board `device_id`.
    pub fn new(device_id: &str, keys: &[PublicKey]) -> OperatorKeys {
        OperatorKeys {
            device_id: device_id.to_owned(),
            keys: keys.to_vec(),
        }
    }

    /// How many keys are listed.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is listed.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Who signed `cmd`: one signature check per listed key at most.
    pub fn signer(&self, cmd: &Command) -> Signer {
        let Some(sig) = &cmd.signature else {
            return Signer::Unsigned;
        };
        if self.keys.is_empty() {
            return Signer::Unknown;
        }
        let body = signed_body(&self.device_id, cmd);
        if self
            .keys
            .iter()
            .any(|k| k.verifies(Domain::Command, &body, sig))
        {
            Signer::Operator
        } else {
            Signer::Unknown
        }
    }
}

/// What a command's signature covers after the [`Domain::Command`] label
/// (see the module doc): `device_id`, scope, command id, `issued_at_ms`,
/// `ttl_secs`, each followed by a NUL, then the 32-byte request hash.
fn signed_body(device_id: &str, cmd: &Command) -> Vec<u8> {
    let issued = cmd.issued_at_ms.map(|t| t.to_string()).unwrap_or_default();
    let ttl = cmd.ttl.map(|t| t.as_secs().to_string()).unwrap_or_default();
    let mut b = Vec::with_capacity(device_id.len() + cmd.command_id.len() + 160);
    for part in [
        device_id,
        cmd.scope.as_str(),
        cmd.command_id.as_str(),
        &issued,
        &ttl,
    ] {
        b.extend_from_slice(part.as_bytes());
        b.push(0);
    }
    b.extend_from_slice(&cmd.request_hash);
    b
}

/// Every byte a command's signature is made over for the board
/// `device_id`: the [`Domain::Command`] label, then the body of the module
/// doc. What an operator's own tool signs (docs/commands.md shows it in
/// Python).
pub fn signed_bytes(device_id: &str, cmd: &Command) -> Vec<u8> {
    let mut b = Domain::Command.label().to_vec();
    b.extend_from_slice(&signed_body(device_id, cmd));
    b
}

/// The command message `message` (a JSON object, as sent on the command
/// topic; any `signature` in it is replaced) signed with `key` for the
/// board `device_id`: the message with `"signature"` set to 128 hex digits.
///
/// Errors: the message is no command ([`super::parse`]'s reason), so there
/// is no request hash to sign.
pub fn sign(
    key: &SigningKey,
    device_id: &str,
    message: &serde_json::Value,
) -> Result<serde_json::Value, super::ParseError> {
    let mut unsigned = message.clone();
    if let Some(o) = unsigned.as_object_mut() {
        o.remove("signature");
    }
    let text = unsigned.to_string();
    let cmd = super::parse(text.as_bytes(), usize::MAX)?;
    let sig: [u8; SIGNATURE_BYTES] = key.sign(Domain::Command, &signed_body(device_id, &cmd));
    if let Some(o) = unsigned.as_object_mut() {
        o.insert("signature".to_owned(), hex::encode(&sig).into());
    }
    Ok(unsigned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key() -> SigningKey {
        SigningKey::generate().expect("keygen").0
    }

    fn parsed(v: &serde_json::Value) -> Command {
        super::super::parse(v.to_string().as_bytes(), 65536).expect("a command")
    }

    #[test]
    fn a_command_signed_by_a_listed_key_is_the_operators_for_this_board_only() {
        let (k, other) = (key(), key());
        let ops = OperatorKeys::new("gw1", &[other.public(), k.public()]);
        let msg = json!({"command_id": "c-1", "scope": "ops", "name": "checkpoint",
                         "args": {"mode": "passive"}, "ttl_secs": 60, "issued_at_ms": 1_800_000_000_000i64});
        let signed = sign(&k, "gw1", &msg).expect("signed");
        assert_eq!(signed["signature"].as_str().map(str::len), Some(128));
        assert_eq!(ops.signer(&parsed(&signed)), Signer::Operator);
        assert_eq!(ops.signer(&parsed(&msg)), Signer::Unsigned);
        // Every field the signature binds, changed, and a key not listed.
        let unlisted = sign(&key(), "gw1", &msg).expect("signed");
        let other_board = sign(&k, "gw2", &msg).expect("signed");
        let mut tampered = Vec::new();
        for (field, value) in [
            ("command_id", json!("c-2")),
            ("scope", json!("ops2")),
            ("args", json!({"mode": "truncate"})),
            ("name", json!("flush")),
            ("ttl_secs", json!(3600)),
            ("issued_at_ms", json!(1_900_000_000_000i64)),
        ] {
            let mut t = signed.clone();
            t[field] = value;
            tampered.push(t);
        }
        for field in ["ttl_secs", "issued_at_ms", "scope"] {
            let mut t = signed.clone();
            t.as_object_mut().map(|o| o.remove(field));
            tampered.push(t);
        }
        for m in [unlisted, other_board].iter().chain(&tampered) {
            assert_eq!(ops.signer(&parsed(m)), Signer::Unknown, "{m}");
        }
        // No key listed: a signature makes no one the operator.
        let none = OperatorKeys::new("gw1", &[]);
        assert_eq!(none.signer(&parsed(&signed)), Signer::Unknown);
    }

    #[test]
    fn key_order_and_number_spelling_do_not_change_what_is_signed() {
        let k = key();
        let ops = OperatorKeys::new("gw1", &[k.public()]);
        let signed = sign(
            &k,
            "gw1",
            &json!({"command_id": "c-1", "name": "set-interval",
                    "args": {"source": "system", "interval_ms": 5000}}),
        )
        .expect("signed");
        let sig = signed["signature"].as_str().unwrap_or_default();
        let respelt = format!(
            r#"{{"signature":"{sig}","args":{{"interval_ms":5000.0,"source":"system"}},"name":"set-interval","command_id":"c-1","scope":"default"}}"#
        );
        let cmd = super::super::parse(respelt.as_bytes(), 65536).expect("a command");
        assert_eq!(ops.signer(&cmd), Signer::Operator);
    }

    #[test]
    fn the_signed_bytes_are_the_label_then_nul_separated_fields_then_the_hash() {
        let cmd = parsed(&json!({"command_id": "c-9", "name": "ping", "ttl_secs": 5}));
        let b = signed_bytes("gw1", &cmd);
        let mut want = b"edgespool command v1\0gw1\0default\0c-9\0\x005\0".to_vec();
        want.extend_from_slice(&cmd.request_hash);
        assert_eq!(b, want);
    }
}
