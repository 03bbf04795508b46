//! The fleet's receipt key in the tests: one key per test process, its
//! PEM file (mode 0600) where `sink --receipt-key` reads it, the TOML a
//! board in receipt mode needs to trust it, and receipts signed with it as
//! a sink would sign them.

use edgespool::event::envelope::EventId;
use edgespool::event::signature::{pem_encode, SigningKey};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The test process's fleet key and its file.
pub struct FleetKey {
    _dir: tempfile::TempDir,
    /// The PEM file, mode 0600.
    pub file: PathBuf,
    /// The key itself.
    pub key: SigningKey,
}

/// The fleet key of this test process (made on first use).
pub fn fleet_key() -> &'static FleetKey {
    static KEY: OnceLock<FleetKey> = OnceLock::new();
    KEY.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir for the fleet key");
        let (key, der) = SigningKey::generate().expect("keygen");
        let file = dir.path().join("receipt.key");
        std::fs::write(&file, pem_encode("PRIVATE KEY", &der)).expect("write the fleet key");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the fleet key");
        FleetKey {
            _dir: dir,
            file,
            key,
        }
    })
}

/// The `[mqtt]` lines of a board in receipt mode trusting the fleet key.
pub fn receipt_mode_toml() -> String {
    format!(
        "retire_on = \"receipt\"\nreceipt_public_keys = [\"{}\"]\n",
        fleet_key().key.public().hex()
    )
}

/// The payloads of receipts for `board`'s `events` (`(stream, event id,
/// payload bytes)`), signed by the fleet key as a sink signs them.
pub fn signed_receipts(board: &str, events: &[(&str, &str, &[u8])]) -> Vec<Vec<u8>> {
    signed_receipts_by(&fleet_key().key, board, events)
}

/// [`signed_receipts`] signed by `key`.
pub fn signed_receipts_by(
    key: &SigningKey,
    board: &str,
    events: &[(&str, &str, &[u8])],
) -> Vec<Vec<u8>> {
    use sha2::Digest;
    let named: Vec<(&str, EventId, [u8; 32])> = events
        .iter()
        .map(|(s, id, payload)| {
            (
                *s,
                EventId::parse(id).expect("an event id"),
                sha2::Sha256::digest(payload).into(),
            )
        })
        .collect();
    edgespool::event::receipts::encode(board, &named, key)
}
