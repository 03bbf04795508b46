//! The files the agent keeps beside its spool and its config (stamps,
//! markers, the storage profile, the last-known-good copy, config pushes,
//! probe scratch files), written and read back as if another user could
//! write the directory.
//!
//! Its one rule: **a file is written only through a name the agent has just
//! created** (`O_CREAT | O_EXCL | O_NOFOLLOW`, then renamed over the old
//! name), so no planted symlink is ever followed and no planted file's owner
//! is kept; **and state read back is believed only when its owner and mode
//! say the agent wrote it**: a regular file (opened `O_NOFOLLOW`), owned by
//! root or by the agent's own uid, writable by nobody else. A secret (a
//! password file, [`read_secret`]) is read only from a regular file named
//! itself (`O_NOFOLLOW`) that group and others cannot read.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Largest state file [`read_trusted`] reads: 16 MiB (a config, a profile,
/// a push; none comes near).
pub const MAX_STATE_BYTES: u64 = 16 * 1024 * 1024;

/// The agent's effective uid (the owner of every file it creates).
pub fn euid() -> u32 {
    // SAFETY: geteuid(2) cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// Why a file read back is not believed. The message completes "`<path>` is
/// ignored: ..."; the caller names the path, says what it does instead
/// (measure again, run without it, refuse) and logs a WARN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Distrust {
    /// The name is a symbolic link: planted, never followed.
    #[error("it is a symbolic link (never followed: someone planted it?)")]
    Symlink,
    /// A directory, FIFO, socket or device where a file should be.
    #[error("it is not a regular file")]
    NotRegular,
    /// Another user owns it: they wrote it, or can rewrite it.
    #[error("it is owned by uid {owner}, not by root or this agent (uid {me})")]
    Owner {
        /// The file's owner.
        owner: u32,
        /// The agent's effective uid.
        me: u32,
    },
    /// Group or others may write it.
    #[error("it is writable by group or others (mode {mode:o})")]
    Writable {
        /// The permission bits.
        mode: u32,
    },
    /// Larger than [`MAX_STATE_BYTES`].
    #[error("it is {bytes} bytes, more than any file the agent writes there")]
    TooLarge {
        /// Its length.
        bytes: u64,
    },
    /// It could not be opened or read (permissions, I/O).
    #[error("cannot read it: {0}")]
    Unreadable(String),
}

/// Whether a file with metadata `m` (of the open file, from `fstat`) may be
/// believed as the agent's own state.
///
/// Errors: [`Distrust`], naming the first rule it breaks.
pub fn trusted(m: &Metadata) -> Result<(), Distrust> {
    if m.file_type().is_symlink() {
        return Err(Distrust::Symlink);
    }
    if !m.is_file() {
        return Err(Distrust::NotRegular);
    }
    let me = euid();
    if m.uid() != 0 && m.uid() != me {
        return Err(Distrust::Owner { owner: m.uid(), me });
    }
    if m.mode() & 0o022 != 0 {
        return Err(Distrust::Writable {
            mode: m.mode() & 0o7777,
        });
    }
    Ok(())
}

/// Read `path` whole if it is the agent's own state ([`trusted`]): opened
/// `O_NOFOLLOW | O_NONBLOCK` (a planted FIFO cannot hang the start), judged
/// on the open file. `Ok(None)`: there is no such file.
///
/// Errors: [`Distrust`] (a symlink, another owner, a loose mode, too large,
/// unreadable).
pub fn read_trusted(path: &Path) -> Result<Option<Vec<u8>>, Distrust> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(Distrust::Symlink),
        Err(e) => return Err(Distrust::Unreadable(e.to_string())),
    };
    let m = f
        .metadata()
        .map_err(|e| Distrust::Unreadable(e.to_string()))?;
    trusted(&m)?;
    if m.len() > MAX_STATE_BYTES {
        return Err(Distrust::TooLarge { bytes: m.len() });
    }
    let mut bytes = Vec::with_capacity(m.len() as usize);
    f.take(MAX_STATE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Distrust::Unreadable(e.to_string()))?;
    if bytes.len() as u64 > MAX_STATE_BYTES {
        return Err(Distrust::TooLarge {
            bytes: bytes.len() as u64,
        });
    }
    Ok(Some(bytes))
}

/// Largest secret file [`read_secret`] reads: 1 MiB (a password, a libpq
/// password file; none comes near).
pub const MAX_SECRET_BYTES: u64 = 1 << 20;

/// Why a secret file (a password) is refused. The message completes
/// "`<setting> <path>`: ..." and says what to do; the caller names the
/// setting and the path.
#[derive(Debug, thiserror::Error)]
pub enum SecretRefused {
    /// The name is a symbolic link: never followed for a secret (a link a
    /// local user planted would hand the reader's rights to its target).
    #[error("it is a symbolic link, never followed for a password: name the file itself")]
    Symlink,
    /// A directory, FIFO, socket or device.
    #[error("it is not a regular file")]
    NotRegular,
    /// Group or others may read it (libpq asks the same of a password file).
    #[error("mode {mode:04o} lets group or others read it; chmod 600 it (owned by the user that reads it)")]
    Readable {
        /// The permission bits.
        mode: u32,
    },
    /// Larger than [`MAX_SECRET_BYTES`].
    #[error("it is {bytes} bytes, more than a password file holds")]
    TooLarge {
        /// Its length.
        bytes: u64,
    },
    /// It does not exist or could not be opened or read.
    #[error("cannot read it: {0}")]
    Unreadable(std::io::Error),
}

/// Read the secret file `path` whole: opened `O_NOFOLLOW | O_NONBLOCK` (a
/// planted symlink is refused, a planted FIFO cannot hang the reader),
/// judged on the open file: a regular file that group and others can
/// neither read nor write (mode 0600 or stricter).
///
/// Errors: [`SecretRefused`].
pub fn read_secret(path: &Path) -> Result<Vec<u8>, SecretRefused> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(SecretRefused::Symlink),
        Err(e) => return Err(SecretRefused::Unreadable(e)),
    };
    let m = f.metadata().map_err(SecretRefused::Unreadable)?;
    if !m.is_file() {
        return Err(SecretRefused::NotRegular);
    }
    if m.mode() & 0o077 != 0 {
        return Err(SecretRefused::Readable {
            mode: m.mode() & 0o7777,
        });
    }
    let mut bytes = Vec::with_capacity(m.len().min(MAX_SECRET_BYTES) as usize);
    f.take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(SecretRefused::Unreadable)?;
    if bytes.len() as u64 > MAX_SECRET_BYTES {
        return Err(SecretRefused::TooLarge {
            bytes: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// Create `path` as a new file of the agent's with `mode` (narrowed by the
/// umask): `O_CREAT | O_EXCL | O_NOFOLLOW`, so an existing name (a planted
/// symlink or file) is an error, never opened.
///
/// Errors: the name exists (`AlreadyExists`), the directory is not
/// writable, the disk is full.
pub fn create_new(path: &Path, mode: u32) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(mode)
        .open(path)
}

/// What an existing name is, for a warning: "a symbolic link", "a regular
/// file owned by uid 65534", "a directory".
pub fn describe(path: &Path) -> String {
    match std::fs::symlink_metadata(path) {
        Err(e) => format!("unreadable ({e})"),
        Ok(m) if m.file_type().is_symlink() => "a symbolic link".into(),
        Ok(m) if m.is_dir() => "a directory".into(),
        Ok(m) if m.is_file() => format!("a regular file owned by uid {}", m.uid()),
        Ok(_) => "not a regular file".into(),
    }
}

/// Replace `path` with `bytes` atomically: a new temporary file
/// `<path>.tmp-<pid>` ([`create_new`]) in the same directory, written,
/// fsynced, renamed over `path` (the rename replaces the name, so a planted
/// symlink at `path` is replaced, its target never touched), then the
/// directory fsynced. The file is the agent's (owner: its uid), with `mode`
/// (0600 or 0640); if the old file was already the agent's own regular file,
/// its group and its group-read bit are kept instead. On any error the old
/// file is untouched and the temporary file removed.
///
/// Errors: the temporary name exists and is not a stale regular file of
/// the agent's (a planted symlink), the directory is not writable, the disk
/// is full, the rename failed.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let me = euid();
    let own_old = std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file() && m.uid() == me);
    let mode = match &own_old {
        Some(m) => 0o600 | (m.mode() & 0o040),
        None => mode & 0o640,
    };
    // A stale temporary file from a killed run of ours is ours to replace.
    if std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_file() && m.uid() == me) {
        let _ = std::fs::remove_file(&tmp);
    }
    let mut f = create_new(&tmp, mode)?;
    let res = (|| {
        if let Some(m) = &own_old {
            if m.gid() != f.metadata()?.gid() {
                std::os::unix::fs::fchown(&f, None, Some(m.gid()))?;
            }
        }
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    drop(f);
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Rename `from` to `to` only if `to` does not exist, atomically:
/// `renameat2(RENAME_NOREPLACE)` (Linux 3.15; renameat2(2)), or, on a
/// filesystem that does not support that flag (EINVAL), a hard link to `to`
/// (link(2) fails with EEXIST on an existing name) and `from` unlinked.
///
/// Errors: `to` exists (`AlreadyExists`), or the rename, link or unlink
/// failed; `to` is never replaced.
pub fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(ErrorKind::InvalidInput, e))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call; no memory is shared.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
        return Err(e);
    }
    std::fs::hard_link(from, to)?;
    std::fs::remove_file(from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn only_the_agents_own_regular_files_are_believed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state");
        assert_eq!(read_trusted(&p), Ok(None));
        std::fs::write(&p, "mine").unwrap();
        chmod(&p, 0o640);
        assert_eq!(read_trusted(&p), Ok(Some(b"mine".to_vec())));
        chmod(&p, 0o664);
        assert_eq!(read_trusted(&p), Err(Distrust::Writable { mode: 0o664 }));
        chmod(&p, 0o600);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert_eq!(read_trusted(&link), Err(Distrust::Symlink));
        assert_eq!(read_trusted(d.path()), Err(Distrust::NotRegular));
        if euid() == 0 {
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            assert_eq!(
                read_trusted(&p),
                Err(Distrust::Owner {
                    owner: 65534,
                    me: 0
                })
            );
        }
    }

    #[test]
    fn a_secret_is_read_only_from_a_private_regular_file_named_itself() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("password");
        std::fs::write(&p, "s3cret\n").unwrap();
        chmod(&p, 0o600);
        assert_eq!(read_secret(&p).unwrap(), b"s3cret\n");
        chmod(&p, 0o400);
        assert!(read_secret(&p).is_ok());
        for mode in [0o640, 0o604, 0o644, 0o620] {
            chmod(&p, mode);
            let e = read_secret(&p).unwrap_err();
            assert!(matches!(e, SecretRefused::Readable { mode: m } if m == mode));
            assert!(e.to_string().contains("chmod 600"), "{e}");
        }
        chmod(&p, 0o600);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(matches!(read_secret(&link), Err(SecretRefused::Symlink)));
        assert!(matches!(
            read_secret(d.path()),
            Err(SecretRefused::NotRegular)
        ));
        assert!(matches!(
            read_secret(&d.path().join("absent")),
            Err(SecretRefused::Unreadable(_))
        ));
        let c =
            std::ffi::CString::new(d.path().join("fifo").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(
            read_secret(&d.path().join("fifo")),
            Err(SecretRefused::NotRegular)
        ));
    }

    #[test]
    fn a_planted_fifo_is_refused_without_hanging() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("fifo");
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read_trusted(&p), Err(Distrust::NotRegular));
    }

    #[test]
    fn a_replace_through_a_planted_symlink_replaces_the_link_not_its_target() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let p = d.path().join("state");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        replace(&p, b"new", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.is_file());
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
    }

    #[test]
    fn a_replaced_file_never_keeps_a_planted_owner() {
        if euid() != 0 {
            return; // chown to another user needs root
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state");
        std::fs::write(&p, "theirs").unwrap();
        chmod(&p, 0o666);
        std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
        replace(&p, b"ours", 0o640).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0));
        assert_eq!(m.mode() & 0o777, 0o640);
        assert_eq!(read_trusted(&p), Ok(Some(b"ours".to_vec())));
    }

    #[test]
    fn a_replace_keeps_the_group_read_bit_of_the_agents_own_file_and_nothing_wider() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state");
        std::fs::write(&p, "old").unwrap();
        chmod(&p, 0o600);
        replace(&p, b"new", 0o640).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        chmod(&p, 0o666);
        replace(&p, b"newer", 0o600).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o640);
    }

    #[test]
    fn create_new_never_opens_an_existing_name() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let p = d.path().join("scratch");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        assert!(create_new(&p, 0o600).is_err());
        assert_eq!(describe(&p), "a symbolic link");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }
}
