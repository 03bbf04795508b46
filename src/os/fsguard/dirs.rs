//! The directories the agent keeps its files in (the spool's, the state
//! directory, the config's), judged before it writes or believes anything
//! there.
//!
//! Its one rule: **a directory someone else can write is refused, by name,
//! with the fix**. Whoever can create names in a directory can plant what
//! the agent reads back (a last-known-good config it would run, a profile,
//! a damage marker) or a symlink where it writes; whoever can rename in a
//! parent can swap the whole directory. Fine: owned by root or by the
//! agent's uid, writable by no group or other user; a parent may be
//! world-writable only with the sticky bit (`/tmp`). The spool's directory
//! may not be group- or world-writable even with the sticky bit: sticky
//! stops others from renaming or removing the agent's files, not from
//! planting names it has yet to create, and SQLite opens its `-wal` and
//! `-shm` without `O_EXCL` (it must: an existing `-wal` holds commits), so a
//! `-wal` planted before a start would be replayed into the spool.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Which directory is judged, for the messages and the rule on sticky
/// directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `spool.path`'s directory: the spool, its `-wal`/`-shm`, lock, stamp,
    /// marker, storage profile and the confirmed config push. Refused if
    /// group- or world-writable even with the sticky bit.
    Spool,
    /// `$STATE_DIRECTORY` (systemd's `StateDirectory=`): the last-known-good copy.
    State,
    /// The `--config` file's directory: the last-known-good copy when there
    /// is no state directory.
    Config,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Spool => "spool directory",
            Role::State => "state directory",
            Role::Config => "config directory",
        })
    }
}

/// What [`check`] reads of one directory (`stat` after symlinks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirFacts {
    /// Owner uid.
    pub uid: u32,
    /// Mode bits, `0o7777`.
    pub mode: u32,
}

/// Judge `dir` (in `role`) and every directory above it, after symlinks:
/// `dir` itself and each parent must be owned by root or by `me`; `dir`
/// must not be writable by group or others (with the sticky bit allowed
/// except for [`Role::Spool`]), a parent only with the sticky bit. A `dir`
/// that does not exist yet is judged by its parents.
///
/// Errors: a sentence naming the role, the directory (and the parent at
/// fault) and the fix (`chmod go-w DIR`, `chown UID DIR`).
pub fn check(role: Role, dir: &Path) -> Result<(), String> {
    let me = super::files::euid();
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let real = match std::fs::canonicalize(dir) {
        Ok(p) => Some(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{role} {}: {e}", dir.display())),
    };
    if let Some(real) = &real {
        let facts = stat(real).map_err(|e| format!("{role} {}: {e}", dir.display()))?;
        judge(role, dir, None, facts, me)?;
    }
    // Above the real directory, and above each name on the way to it as
    // spelled (whoever can write where a symlink lives can point it away).
    let spelled = absolute(dir);
    let real = real.unwrap_or_else(|| spelled.clone());
    let mut seen = std::collections::BTreeSet::new();
    for parent in real.ancestors().skip(1).chain(spelled.ancestors().skip(1)) {
        if !seen.insert(parent.to_path_buf()) {
            continue;
        }
        let Ok(facts) = stat(parent) else {
            continue; // not there yet: what is above it is judged
        };
        judge(role, dir, Some(parent), facts, me)?;
    }
    Ok(())
}

/// The rule on one directory: `parent` is `None` for `dir` itself.
/// Pure, so each case is tested without other users' files.
pub fn judge(
    role: Role,
    dir: &Path,
    parent: Option<&Path>,
    f: DirFacts,
    me: u32,
) -> Result<(), String> {
    let shown = dir.display();
    let (at, whose) = match parent {
        None => (dir.to_path_buf(), format!("{role} {shown} is")),
        Some(p) => (
            p.to_path_buf(),
            format!("{role} {shown} is under {}, which is", p.display()),
        ),
    };
    if f.uid != 0 && f.uid != me {
        return Err(format!(
            "{whose} owned by uid {}, not by root or this agent (uid {me}): that user can plant files the agent writes or trusts there; chown {me} {} (or move it)",
            f.uid,
            at.display()
        ));
    }
    let writable = f.mode & 0o022 != 0;
    let sticky = f.mode & 0o1000 != 0;
    let refused = match parent {
        None if role == Role::Spool => writable,
        _ => writable && !sticky,
    };
    if !refused {
        return Ok(());
    }
    let why = match (parent, sticky) {
        (None, true) => "other users can plant names the agent has yet to create there (the sticky bit stops renames, not that; SQLite would replay a planted -wal)",
        (None, false) => "other users can plant or replace the files the agent writes and trusts there",
        (Some(_), _) => "other users can replace the whole directory",
    };
    Err(format!(
        "{whose} writable by group or others (mode {:o}): {why}; chmod go-w {}",
        f.mode,
        at.display()
    ))
}

/// Whether this process (its effective uid) can create files in `dir`, or
/// create `dir` itself when it does not exist yet (in its nearest existing
/// ancestor): `faccessat(2)` with `AT_EACCESS` for write and search. An
/// agent that may not write there fails at its first open, after the
/// checks of [`check`] passed.
///
/// Errors: a sentence naming the role, the directory (or the ancestor it
/// would be made in), the uid and the fix.
pub fn check_writable(role: Role, dir: &Path) -> Result<(), String> {
    let me = super::files::euid();
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let spelled = absolute(dir);
    let Some(existing) = spelled.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    let why = match access(existing, libc::W_OK | libc::X_OK) {
        Ok(()) => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {
            "is on a read-only filesystem".to_owned()
        }
        Err(_) => format!("is not writable by this agent (uid {me})"),
    };
    let shown = dir.display();
    if existing == spelled {
        return Err(format!(
            "{role} {shown} {why}: the agent creates its files there; chown {me} {shown} (or run the agent as the user that owns it)"
        ));
    }
    Err(format!(
        "{role} {shown} does not exist and {} {why}, so the agent cannot create it: mkdir -p {shown} && chown {me} {shown}",
        existing.display()
    ))
}

/// Whether this process (its effective uid) may read and write the file
/// at `path` (`faccessat(2)`, `AT_EACCESS`): a spool it may not fails at
/// its first open.
///
/// Errors: the errno (`EACCES`, `EROFS`, ...).
pub fn may_read_write(path: &Path) -> std::io::Result<()> {
    access(path, libc::R_OK | libc::W_OK)
}

/// `faccessat(path, mode, AT_EACCESS)`.
fn access(path: &Path, mode: libc::c_int) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), mode, libc::AT_EACCESS) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn stat(p: &Path) -> std::io::Result<DirFacts> {
    let m = std::fs::metadata(p)?;
    Ok(DirFacts {
        uid: m.uid(),
        mode: m.mode() & 0o7777,
    })
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(uid: u32, mode: u32) -> DirFacts {
        DirFacts { uid, mode }
    }

    const D: &str = "/data/edgespool";

    fn j(role: Role, parent: Option<&str>, facts: DirFacts) -> Result<(), String> {
        judge(role, Path::new(D), parent.map(Path::new), facts, 998)
    }

    #[test]
    fn a_directory_this_uid_cannot_write_or_create_is_named_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let below = d.path().join("a/b");
        assert_eq!(check_writable(Role::Spool, &below), Ok(()));
        assert_eq!(check_writable(Role::Spool, d.path()), Ok(()));
        if super::super::files::euid() == 0 {
            return; // root may write anywhere but a read-only filesystem
        }
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
        let e = check_writable(Role::Spool, d.path()).unwrap_err();
        assert!(e.contains("is not writable by this agent (uid "), "{e}");
        let e = check_writable(Role::Spool, &below).unwrap_err();
        assert!(
            e.contains("does not exist and ") && e.contains("mkdir -p"),
            "{e}"
        );
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }

    #[test]
    fn root_or_the_agents_own_directories_closed_to_others_are_fine() {
        for role in [Role::Spool, Role::State, Role::Config] {
            assert_eq!(j(role, None, f(0, 0o700)), Ok(()));
            assert_eq!(j(role, None, f(998, 0o750)), Ok(()));
            assert_eq!(j(role, None, f(0, 0o755)), Ok(()));
            assert_eq!(j(role, Some("/tmp"), f(0, 0o1777)), Ok(()));
        }
    }

    #[test]
    fn a_directory_others_can_write_is_refused_with_the_fix() {
        for mode in [0o777, 0o770, 0o775, 0o757] {
            let e = j(Role::Config, None, f(0, mode)).unwrap_err();
            assert!(
                e.starts_with("config directory /data/edgespool is writable"),
                "{e}"
            );
            assert!(e.ends_with("chmod go-w /data/edgespool"), "{e}");
        }
        // Sticky is enough for the config's and the state directory...
        assert_eq!(j(Role::Config, None, f(0, 0o1777)), Ok(()));
        assert_eq!(j(Role::State, None, f(0, 0o1770)), Ok(()));
        // ...not for the spool's.
        let e = j(Role::Spool, None, f(0, 0o1777)).unwrap_err();
        assert!(e.contains("mode 1777") && e.contains("-wal"), "{e}");
    }

    #[test]
    fn a_directory_another_user_owns_is_refused_with_the_fix() {
        let e = j(Role::Spool, None, f(65534, 0o700)).unwrap_err();
        assert!(e.contains("owned by uid 65534"), "{e}");
        assert!(e.ends_with("chown 998 /data/edgespool (or move it)"), "{e}");
    }

    #[test]
    fn a_parent_others_can_rename_in_is_refused_by_name() {
        let e = j(Role::Spool, Some("/data"), f(0, 0o777)).unwrap_err();
        assert!(
            e.starts_with("spool directory /data/edgespool is under /data, which is writable"),
            "{e}"
        );
        assert!(e.ends_with("chmod go-w /data"), "{e}");
        let e = j(Role::Spool, Some("/data"), f(1000, 0o755)).unwrap_err();
        assert!(e.contains("under /data, which is owned by uid 1000"), "{e}");
    }

    #[test]
    fn a_temporary_directory_of_this_user_passes_and_a_world_writable_one_does_not() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        assert_eq!(check(Role::Spool, d.path()), Ok(()));
        assert_eq!(check(Role::Spool, &d.path().join("not/yet")), Ok(()));
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check(Role::Spool, d.path()).unwrap_err();
        assert!(e.contains(&d.path().display().to_string()), "{e}");
        let e = check(Role::Spool, &d.path().join("not/yet")).unwrap_err();
        assert!(e.contains("which is writable"), "{e}");
    }
}
