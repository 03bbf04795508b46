//! Ed25519 signatures (RFC 8032): the fleet's keys, and the one check a
//! board runs on anything that retires data or grants a privilege.
//!
//! Its one rule: **a proof is a signature by a key the board's own config
//! lists, never a name another party can claim** (docs/invariants.md, "Trust
//! boundaries"). Each kind of signed message starts with its own domain
//! label ([`Domain`]), so a signature over one kind is never valid for
//! another (a signed receipt cannot be replayed as a command).
//!
//! Keys travel as 64 hex digits (the 32-byte public key), private keys as
//! PKCS#8 in PEM (`-----BEGIN PRIVATE KEY-----`), the form `edgespool
//! keygen` writes and `openssl genpkey -algorithm ed25519` writes too.
//! Pure: nothing here reads a file; the caller hands the bytes in.

use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivatePkcs8KeyDer;

/// Bytes of an Ed25519 signature.
pub const SIGNATURE_BYTES: usize = 64;

/// What a signature is over: the first bytes of every signed message, so a
/// signature made for one kind never verifies as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// A receipt: "the fleet's database stored these events of this board".
    Receipt,
    /// A backfill request: "send these ranges of this board again".
    Backfill,
    /// A command from the operator (its reserved room).
    Command,
}

impl Domain {
    /// The label the signed bytes start with, ending in a NUL.
    pub fn label(self) -> &'static [u8] {
        match self {
            Domain::Receipt => b"edgespool receipt v2\0",
            Domain::Backfill => b"edgespool backfill v1\0",
            Domain::Command => b"edgespool command v1\0",
        }
    }
}

/// A public key (32 bytes), as a board's config lists it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey(pub [u8; 32]);

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({})", self.hex())
    }
}

/// Why a key or a key file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not 64 hex digits.
    #[error("a public key is 64 hex digits (32 bytes), got {0:?}")]
    PublicHex(String),
    /// Not a PEM `PRIVATE KEY` (PKCS#8) block.
    #[error("not a PEM private key (-----BEGIN PRIVATE KEY-----, PKCS#8): {0}")]
    Pem(String),
    /// PKCS#8 of another algorithm, or damaged.
    #[error("not an Ed25519 private key: {0}")]
    NotEd25519(String),
    /// The system's random source failed.
    #[error("no randomness for a new key: {0}")]
    Random(String),
}

impl PublicKey {
    /// Parse 64 hex digits (either case).
    ///
    /// Errors: [`KeyError::PublicHex`].
    pub fn from_hex(s: &str) -> Result<PublicKey, KeyError> {
        let bytes = crate::event::hex::decode(s.trim())
            .filter(|b| b.len() == 32)
            .ok_or_else(|| KeyError::PublicHex(s.chars().take(80).collect()))?;
        let mut k = [0u8; 32];
        k.copy_from_slice(&bytes);
        Ok(PublicKey(k))
    }

    /// 64 lowercase hex digits.
    pub fn hex(&self) -> String {
        crate::event::hex::encode(&self.0)
    }

    /// Whether `sig` is this key's signature of `domain` + `body`.
    pub fn verifies(&self, domain: Domain, body: &[u8], sig: &[u8; SIGNATURE_BYTES]) -> bool {
        let mut msg = Vec::with_capacity(domain.label().len() + body.len());
        msg.extend_from_slice(domain.label());
        msg.extend_from_slice(body);
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(&msg, sig)
            .is_ok()
    }
}

/// A private key that signs (the sink's receipt key, an operator's key).
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The private half stays out of logs.
        write!(f, "SigningKey(public {})", self.public().hex())
    }
}

impl SigningKey {
    /// A new key from the system's random source, with its PKCS#8 document
    /// to store: v1 (RFC 8410: the 32-byte seed alone), the form openssl
    /// reads and writes (ring's own v2 document is one openssl refuses).
    ///
    /// Errors: [`KeyError::Random`].
    pub fn generate() -> Result<(SigningKey, Vec<u8>), KeyError> {
        use ring::rand::SecureRandom;
        /// PKCS#8 v1 of an Ed25519 seed up to the seed (RFC 8410 §7).
        const V1_PREFIX: [u8; 16] = [
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        let mut seed = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut seed)
            .map_err(|e| KeyError::Random(e.to_string()))?;
        let mut der = V1_PREFIX.to_vec();
        der.extend_from_slice(&seed);
        let key = SigningKey::from_pkcs8_der(&der)?;
        Ok((key, der))
    }

    /// A key from its PKCS#8 DER (v1, as openssl writes it, or v2).
    ///
    /// Errors: [`KeyError::NotEd25519`].
    pub fn from_pkcs8_der(der: &[u8]) -> Result<SigningKey, KeyError> {
        Ed25519KeyPair::from_pkcs8_maybe_unchecked(der)
            .map(|pair| SigningKey { pair })
            .map_err(|e| KeyError::NotEd25519(e.to_string()))
    }

    /// A key from a PEM `PRIVATE KEY` block.
    ///
    /// Errors: [`KeyError::Pem`], [`KeyError::NotEd25519`].
    pub fn from_pem(pem: &[u8]) -> Result<SigningKey, KeyError> {
        let der =
            PrivatePkcs8KeyDer::from_pem_slice(pem).map_err(|e| KeyError::Pem(e.to_string()))?;
        SigningKey::from_pkcs8_der(der.secret_pkcs8_der())
    }

    /// Its public key.
    pub fn public(&self) -> PublicKey {
        let mut k = [0u8; 32];
        k.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey(k)
    }

    /// The signature of `domain` + `body`.
    pub fn sign(&self, domain: Domain, body: &[u8]) -> [u8; SIGNATURE_BYTES] {
        let mut msg = Vec::with_capacity(domain.label().len() + body.len());
        msg.extend_from_slice(domain.label());
        msg.extend_from_slice(body);
        let mut out = [0u8; SIGNATURE_BYTES];
        out.copy_from_slice(self.pair.sign(&msg).as_ref());
        out
    }
}

/// `der` as a PEM block labelled `label` (`PRIVATE KEY`), 64 columns.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(char::from(B64[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_round_trips_through_pem_and_its_signatures_verify() {
        let (key, der) = SigningKey::generate().expect("keygen");
        let pem = pem_encode("PRIVATE KEY", &der);
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----\n"));
        let again = SigningKey::from_pem(pem.as_bytes()).expect("parse pem");
        assert_eq!(again.public(), key.public());
        let sig = again.sign(Domain::Receipt, b"body");
        let public = PublicKey::from_hex(&key.public().hex()).expect("hex");
        assert!(public.verifies(Domain::Receipt, b"body", &sig));
        assert!(
            !public.verifies(Domain::Receipt, b"bodY", &sig),
            "other bytes"
        );
        assert!(
            !public.verifies(Domain::Command, b"body", &sig),
            "a receipt's signature is no command's"
        );
        let (other, _) = SigningKey::generate().expect("keygen");
        assert!(!other.public().verifies(Domain::Receipt, b"body", &sig));
    }

    #[test]
    fn an_openssl_pkcs8_v1_key_is_read() {
        // `openssl genpkey -algorithm ed25519` (PKCS#8 v1, no public key),
        // RFC 8410 section 10.3's example key.
        let pem = b"-----BEGIN PRIVATE KEY-----\n\
MC4CAQAwBQYDK2VwBCIEINTuctv5E1hK1bbY8fdp+K06/nwoy/HU++CXqI9EdVhC\n\
-----END PRIVATE KEY-----\n";
        let k = SigningKey::from_pem(pem).expect("openssl's form");
        assert_eq!(
            k.public().hex(),
            "19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1"
        );
    }

    #[test]
    fn malformed_keys_are_refused_with_their_reason() {
        assert!(matches!(
            PublicKey::from_hex("abcd"),
            Err(KeyError::PublicHex(_))
        ));
        assert!(matches!(
            PublicKey::from_hex(&"zz".repeat(32)),
            Err(KeyError::PublicHex(_))
        ));
        assert!(matches!(
            SigningKey::from_pem(b"hello"),
            Err(KeyError::Pem(_))
        ));
        let not_ed = pem_encode("PRIVATE KEY", &[0x30, 0x03, 0x02, 0x01, 0x00]);
        assert!(matches!(
            SigningKey::from_pem(not_ed.as_bytes()),
            Err(KeyError::NotEd25519(_))
        ));
    }

    #[test]
    fn pem_base64_matches_the_rfc_4648_vectors() {
        for (raw, b64) in [
            (&b"f"[..], "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
        ] {
            let pem = pem_encode("X", raw);
            assert_eq!(pem.lines().nth(1), Some(b64), "{raw:?}");
        }
    }
}
