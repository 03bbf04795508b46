//! `edgespool keygen`: writes a new Ed25519 private key for the fleet's
//! receipts (`sink --receipt-key`), backfill requests or an operator's
//! commands, and prints its public key, the 64 hex digits a board lists in
//! its config (`mqtt.receipt_public_keys`, `commands.operator_public_keys`).
//!
//! Its one rule: **a key file is only ever created, never overwritten or
//! reached through a link**: `--out` and `--out.pub` are opened
//! `O_CREAT | O_EXCL | O_NOFOLLOW`, the private key with mode 0600, and a
//! name that exists (a file, a planted symlink) is refused (exit 2).

use std::io::Write;
use std::path::{Path, PathBuf};

use super::spec::KEYGEN;
use super::{args, failed, help, Failure, Outcome};
use crate::event::signature::{pem_encode, SigningKey};
use crate::os::fsguard::files::create_new;

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &KEYGEN)? else {
        return help::print(&KEYGEN);
    };
    let Some(out) = a.out else {
        return Err(Failure::usage_of(&KEYGEN, "--out FILE is required"));
    };
    let public = write_key_pair(&out)?;
    println!("{public}");
    Ok(())
}

/// `FILE.pub` beside `out`.
fn pub_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

/// Write a new key to `out` (0600) and its public key to `out.pub` (0644);
/// returns the public key's hex. Neither name may exist.
fn write_key_pair(out: &Path) -> Result<String, Failure> {
    let pub_file = pub_path(out);
    for p in [out, pub_file.as_path()] {
        if std::fs::symlink_metadata(p).is_ok() {
            eprintln!(
                "edgespool: keygen: {} exists ({}); a key is never overwritten: choose a new name or remove it",
                p.display(),
                crate::os::fsguard::files::describe(p)
            );
            return Err(Failure::Invalid);
        }
    }
    let (key, der) = SigningKey::generate().map_err(|e| failed(format_args!("keygen: {e}")))?;
    let public = key.public().hex();
    write_new(out, 0o600, pem_encode("PRIVATE KEY", &der).as_bytes())?;
    if let Err(f) = write_new(&pub_file, 0o644, format!("{public}\n").as_bytes()) {
        // Leave no private key without its public half named beside it.
        let _ = std::fs::remove_file(out);
        return Err(f);
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Both names survive a power cut once the directory is synced.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(public)
}

fn write_new(path: &Path, mode: u32, bytes: &[u8]) -> Result<(), Failure> {
    let mut f = create_new(path, mode).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            eprintln!(
                "edgespool: keygen: {} exists; a key is never overwritten",
                path.display()
            );
            return Failure::Invalid;
        }
        failed(format_args!(
            "keygen: cannot create {}: {e}",
            path.display()
        ))
    })?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| failed(format_args!("keygen: cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_pair_is_written_private_and_never_over_an_existing_name() {
        let d = tempfile::tempdir().expect("tempdir");
        let out = d.path().join("receipt.key");
        let public = write_key_pair(&out).expect("keygen");
        assert_eq!(public.len(), 64);
        let mode = std::fs::metadata(&out).expect("key").permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "private: mode {mode:o}");
        let pem = crate::os::fsguard::files::read_secret(&out).expect("read back");
        let key = SigningKey::from_pem(&pem).expect("a PEM key");
        assert_eq!(key.public().hex(), public);
        let pub_text = std::fs::read_to_string(pub_path(&out)).expect(".pub");
        assert_eq!(pub_text, format!("{public}\n"));
        // Again on the same name: refused, the key untouched.
        assert!(matches!(write_key_pair(&out), Err(Failure::Invalid)));
        assert_eq!(std::fs::read(&out).expect("key"), pem);
        // A planted symlink is never followed.
        let target = d.path().join("target");
        let link = d.path().join("link.key");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert!(matches!(write_key_pair(&link), Err(Failure::Invalid)));
        assert!(!target.exists(), "nothing written through the link");
    }
}
