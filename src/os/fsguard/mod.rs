//! Filesystem guards for the spool: one agent per spool, only on a local
//! filesystem, and only in directories nobody else can write.
//!
//! Its one rule: **refuse rather than risk**. WAL needs shared memory and
//! working POSIX locks on one host (<https://www.sqlite.org/wal.html>,
//! "Disadvantages"); NFS, SMB/CIFS, 9p and FUSE do not reliably give them
//! (field case F05), and two agents on one spool would both publish and retire.
//! A directory another user can write is hostile ([`dirs`]); the files the
//! agent keeps there are created exclusively and read back only when their
//! owner and mode say the agent wrote them ([`files`]).

pub mod dirs;
pub mod files;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// An exclusive `flock(2)` on `<spool>.lock`, held for the life of the agent.
/// The file holds the holder's pid, so a second agent can name it.
#[derive(Debug)]
pub struct SpoolLock {
    _file: File,
    path: PathBuf,
}

impl SpoolLock {
    /// Take the lock next to `spool`, or fail at once naming the pid that holds it.
    ///
    /// The lock file is named after the spool's resolved path (symlinks and
    /// `..` followed), so two spellings of one spool share one lock. It is
    /// opened `O_NOFOLLOW` (mode 0600 when new) and must be a regular file
    /// owned by root or this agent: a planted symlink or another user's file
    /// there is refused by name, never written.
    ///
    /// Errors: a sentence naming the lock file (or the holder's pid).
    pub fn acquire(spool: &Path) -> Result<SpoolLock, String> {
        let resolved = resolve(spool);
        let mut p = resolved.as_os_str().to_owned();
        p.push(".lock");
        let path = PathBuf::from(p);
        let shown = path.display();
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o600)
            .open(&path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => format!(
                    "lock file {shown} is a symbolic link; refusing to write through it (someone planted it? check what it points to, then rm {shown})"
                ),
                _ => format!("cannot open lock file {shown}: {e}"),
            })?;
        let meta = file
            .metadata()
            .map_err(|e| format!("cannot stat lock file {shown}: {e}"))?;
        let me = files::euid();
        if !meta.is_file() {
            return Err(format!(
                "lock file {shown} is not a regular file; refusing it (remove it)"
            ));
        }
        if meta.uid() != 0 && meta.uid() != me {
            return Err(format!(
                "lock file {shown} is owned by uid {}, not by root or this agent (uid {me}); refusing it (remove it: rm {shown})",
                meta.uid()
            ));
        }
        // SAFETY: flock on a file descriptor we own; no memory is shared.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(match err.raw_os_error() {
                Some(libc::EWOULDBLOCK) => format!(
                    "spool {} is in use by another edgespool (pid {}, lock file {})",
                    spool.display(),
                    holder.trim(),
                    path.display()
                ),
                _ => format!("cannot lock {}: {err}", path.display()),
            });
        }
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = writeln!(file, "{}", std::process::id());
        Ok(SpoolLock { _file: file, path })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The pid text in the lock file if an agent holds the lock of `spool` now,
/// without taking it (`flock(LOCK_SH | LOCK_NB)` on a read-only handle).
pub fn holder(spool: &Path) -> Option<String> {
    let mut p = resolve(spool).into_os_string();
    p.push(".lock");
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(PathBuf::from(p))
        .ok()?;
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        // SAFETY: as above; release what we just took.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        return None;
    }
    let mut pid = String::new();
    let _ = f.read_to_string(&mut pid);
    Some(pid.trim().to_owned())
}

/// `spool` with symlinks and `..` resolved: the file itself if it exists,
/// else its directory joined with its name.
pub fn resolve(spool: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(spool) {
        return p;
    }
    let dir = spool
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match (std::fs::canonicalize(dir), spool.file_name()) {
        (Ok(d), Some(name)) => d.join(name),
        _ => spool.to_path_buf(),
    }
}

/// `statfs(2)` magic numbers of filesystems the spool refuses (linux/magic.h).
const REFUSED: &[(i64, &str)] = &[
    (0x6969, "nfs"),
    (0x517B, "smb"),
    (0xFF53_4D42, "cifs"),
    (0xFE53_4D42, "smb2"),
    (0x0102_1997, "9p"),
    (0x6573_5546, "fuse"),
    (0x00C3_6400, "ceph"),
];

/// The filesystem type name if `magic` is one the spool refuses.
pub fn refused_fs(magic: i64) -> Option<&'static str> {
    REFUSED.iter().find(|(m, _)| *m == magic).map(|(_, n)| *n)
}

/// Refuse a spool whose directory is on a network or FUSE filesystem, unless
/// `allow` (`spool.allow_network_fs`) is set.
pub fn check_local_fs(spool: &Path, allow: bool) -> Result<(), String> {
    let dir = spool
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("spool directory {} contains a NUL byte", dir.display()))?;
    // SAFETY: statfs writes into the zeroed struct we pass; c is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(format!(
            "statfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let magic = st.f_type as i64;
    match refused_fs(magic) {
        Some(name) if allow => {
            log::warn!("spool directory {} is on {name}; allowed by spool.allow_network_fs, WAL safety is not guaranteed", dir.display());
            Ok(())
        }
        Some(name) => Err(format!(
            "spool directory {} is on a {name} filesystem; WAL needs a local filesystem (set spool.allow_network_fs = true to override)",
            dir.display()
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_spool_names_the_holder() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool.db");
        let _first = SpoolLock::acquire(&spool).unwrap();
        let err = SpoolLock::acquire(&spool).unwrap_err();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
    }

    #[test]
    fn a_symlinked_spelling_of_the_spool_shares_its_lock() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool.db");
        std::fs::write(&spool, b"").unwrap();
        let link = d.path().join("link.db");
        std::os::unix::fs::symlink(&spool, &link).unwrap();
        let _first = SpoolLock::acquire(&spool).unwrap();
        assert!(SpoolLock::acquire(&link).is_err());
        let dotted = d.path().join("sub").join("..").join("spool.db");
        std::fs::create_dir(d.path().join("sub")).unwrap();
        assert!(SpoolLock::acquire(&dotted).is_err());
    }

    #[test]
    fn holder_names_the_running_agent_without_taking_the_lock() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool.db");
        assert_eq!(holder(&spool), None);
        let lock = SpoolLock::acquire(&spool).unwrap();
        assert_eq!(holder(&spool), Some(std::process::id().to_string()));
        drop(lock);
        assert_eq!(holder(&spool), None);
    }

    #[test]
    fn a_lock_file_planted_as_a_symlink_is_refused_and_its_target_untouched() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool.db");
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let lock = resolve(&spool).with_file_name("spool.db.lock");
        std::os::unix::fs::symlink(&victim, &lock).unwrap();
        let err = SpoolLock::acquire(&spool).unwrap_err();
        assert!(err.contains("is a symbolic link"), "{err}");
        assert!(err.contains(&lock.display().to_string()), "{err}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }

    #[test]
    fn the_lock_is_free_again_once_dropped() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool.db");
        drop(SpoolLock::acquire(&spool).unwrap());
        assert!(SpoolLock::acquire(&spool).is_ok());
    }

    #[test]
    fn network_filesystems_are_recognised() {
        assert_eq!(refused_fs(0x6969), Some("nfs"));
        assert_eq!(refused_fs(0x6573_5546), Some("fuse"));
        assert_eq!(refused_fs(0xEF53), None); // ext4
    }

    #[test]
    fn a_local_directory_passes() {
        let d = tempfile::tempdir().unwrap();
        assert!(check_local_fs(&d.path().join("spool.db"), false).is_ok());
    }
}
