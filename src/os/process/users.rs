//! Users and groups: whether the agent may run a program as another user,
//! and the ids of a user or group named in the config.
//!
//! Its one rule: a name is resolved once, at validation, through the
//! system's own databases (`getpwnam_r`, `getgrnam_r`, so NSS is honoured);
//! a child is switched by id, never by a name looked up after the fork.

use std::ffi::CString;
use std::io;

/// First buffer for a user or group lookup when the system suggests none.
const LOOKUP_BUF: usize = 16 * 1024;
/// A lookup needing more than this is treated as failed: no sane user or
/// group entry is this large.
const LOOKUP_BUF_MAX: usize = 1024 * 1024;

/// Whether the agent can switch a child to another user: it runs as root.
pub fn can_switch_user() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() == 0 }
}

/// The uid and primary gid of user `name` in the system's user database
/// (`getpwnam_r`: /etc/passwd or whatever NSS is configured). `Ok(None)`:
/// there is no such user.
///
/// # Errors
///
/// The database could not be read (the OS error). The caller reports it on
/// the config key that named the user and keeps its config.
pub fn lookup_user(name: &str) -> io::Result<Option<(libc::uid_t, libc::gid_t)>> {
    let Ok(cname) = CString::new(name) else {
        return Ok(None);
    };
    // SAFETY: an all-zero passwd (integers and null pointers) is valid.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let found = lookup(libc::_SC_GETPW_R_SIZE_MAX, |buf, found| {
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call and `buf` is as long
        // as the length given; the entry's strings point into `buf`, which
        // is not read after this closure.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut entry,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        *found = !result.is_null();
        rc
    })?;
    Ok(found.then_some((entry.pw_uid, entry.pw_gid)))
}

/// The gid of group `name` in the system's group database (`getgrnam_r`).
/// `Ok(None)`: there is no such group.
///
/// # Errors
///
/// As [`lookup_user`].
pub fn lookup_group(name: &str) -> io::Result<Option<libc::gid_t>> {
    let Ok(cname) = CString::new(name) else {
        return Ok(None);
    };
    // SAFETY: an all-zero group (integers and null pointers) is valid.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let found = lookup(libc::_SC_GETGR_R_SIZE_MAX, |buf, found| {
        let mut result: *mut libc::group = std::ptr::null_mut();
        // SAFETY: as in lookup_user.
        let rc = unsafe {
            libc::getgrnam_r(
                cname.as_ptr(),
                &mut entry,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        *found = !result.is_null();
        rc
    })?;
    Ok(found.then_some(entry.gr_gid))
}

/// Runs a `get*nam_r` call with a buffer that grows while the call says
/// ERANGE. `call` returns the call's result code and sets whether an entry
/// was found.
fn lookup(
    size_hint: libc::c_int,
    mut call: impl FnMut(&mut [libc::c_char], &mut bool) -> libc::c_int,
) -> io::Result<bool> {
    // SAFETY: sysconf takes an integer; -1 means no suggestion.
    let hint = unsafe { libc::sysconf(size_hint) };
    let mut len = usize::try_from(hint)
        .ok()
        .filter(|&n| n > 0)
        .unwrap_or(LOOKUP_BUF)
        .min(LOOKUP_BUF_MAX);
    loop {
        let mut buf = vec![0; len];
        let mut found = false;
        match call(&mut buf, &mut found) {
            0 => return Ok(found),
            // Some C libraries say "not found" with an error code (see
            // getpwnam_r(3), NOTES).
            libc::ENOENT | libc::ESRCH => return Ok(false),
            libc::ERANGE if len < LOOKUP_BUF_MAX => len = (len * 2).min(LOOKUP_BUF_MAX),
            rc => return Err(io::Error::from_raw_os_error(rc)),
        }
    }
}
