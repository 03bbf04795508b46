//! Closing every descriptor a forked child inherited, from 3 up.
//!
//! The agent may have been started with descriptors that are not
//! close-on-exec (a socket a supervisor handed it, a file a shell left
//! open); the agent's own are close-on-exec, but a forked child that never
//! execs (the run's supervisor, see [`super::spawn`]) keeps them all the
//! same. Whatever the agent holds, a child keeps only 0, 1, 2 and the one
//! descriptor it names.
//!
//! Its one rule: **only async-signal-safe system calls, no allocation**:
//! this runs in the child of a multi-threaded process, between fork and
//! exec. Three ways, first that works: `close_range(2)` (Linux 5.9), the
//! list in `/proc/self/fd` read with `getdents64(2)` into a buffer on the
//! stack (what glibc's `closefrom` falls back to), and last every number up
//! to the open-file limit.

use std::os::fd::RawFd;

/// The highest descriptor number the last way tries when the open-file
/// limit is unlimited.
const MAX_FD_SWEEP: libc::c_uint = 1 << 20;

/// Closes every descriptor from 3 up except `keep` (3 or above), ignoring
/// errors: one that cannot be closed is already closed.
///
/// # Safety
///
/// Closes descriptors behind the back of whatever owns them: call it only
/// in a forked child, where nothing else runs and nothing owns them.
pub(super) unsafe fn close_inherited(keep: RawFd) {
    // SAFETY: the caller's contract; each way makes plain system calls.
    unsafe {
        if close_ranges(keep) || close_listed(keep) {
            return;
        }
        close_every(keep);
    }
}

/// `close_range(2)` on 3..keep-1 and keep+1..; false if the kernel has no
/// such call (before Linux 5.9), so nothing was closed.
unsafe fn close_ranges(keep: RawFd) -> bool {
    let Ok(keep) = libc::c_uint::try_from(keep) else {
        return false;
    };
    let close_range = |first: libc::c_uint, last: libc::c_uint| {
        let flags: libc::c_uint = 0;
        // SAFETY: close_range takes plain integers; flags 0 closes.
        unsafe { libc::syscall(libc::SYS_close_range, first, last, flags) == 0 }
    };
    if keep > 3 && !close_range(3, keep - 1) {
        return false;
    }
    keep < libc::c_uint::MAX && close_range(keep + 1, libc::c_uint::MAX)
}

/// Closes what `/proc/self/fd` lists; false if it cannot be read (no
/// `/proc`), in which case some may be left.
unsafe fn close_listed(keep: RawFd) -> bool {
    // SAFETY: a literal, NUL-terminated path.
    let dir = unsafe {
        libc::open(
            c"/proc/self/fd".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return false;
    }
    // u64 for the alignment of the records getdents64 writes.
    let mut buf = [0u64; 256];
    let listed = loop {
        // SAFETY: getdents64 writes at most the given length into `buf`.
        let n = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                dir,
                buf.as_mut_ptr(),
                std::mem::size_of_val(&buf),
            )
        };
        let Ok(n) = usize::try_from(n) else {
            break false;
        };
        if n == 0 {
            break true;
        }
        // SAFETY: the first `n` bytes of `buf` were written by the kernel.
        let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n) };
        let mut closed = false;
        for fd in Records(bytes) {
            if fd >= 3 && fd != keep && fd != dir {
                // SAFETY: the caller's contract.
                unsafe { libc::close(fd) };
                closed = true;
            }
        }
        // Closing may have moved what the directory lists; read it again
        // from the start so that no descriptor is missed.
        // SAFETY: lseek on our own descriptor.
        if closed && unsafe { libc::lseek(dir, 0, libc::SEEK_SET) } < 0 {
            break false;
        }
    };
    // SAFETY: our own descriptor.
    unsafe { libc::close(dir) };
    listed
}

/// Closes every number from 3 to the open-file limit (at most
/// [`MAX_FD_SWEEP`]). A descriptor above a lowered limit is missed.
unsafe fn close_every(keep: RawFd) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we pass.
    let top = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        libc::c_uint::try_from(limit.rlim_cur)
            .unwrap_or(MAX_FD_SWEEP)
            .min(MAX_FD_SWEEP)
    } else {
        MAX_FD_SWEEP
    };
    for fd in 3..top {
        let Ok(fd) = RawFd::try_from(fd) else {
            return;
        };
        if fd != keep {
            // SAFETY: the caller's contract.
            unsafe { libc::close(fd) };
        }
    }
}

/// The descriptor numbers in a buffer of `linux_dirent64` records
/// (`d_ino` u64, `d_off` i64, `d_reclen` u16, `d_type` u8, `d_name`);
/// `.`, `..` and anything that is not a number are skipped.
struct Records<'a>(&'a [u8]);

impl Iterator for Records<'_> {
    type Item = RawFd;

    fn next(&mut self) -> Option<RawFd> {
        const RECLEN: usize = 16;
        const NAME: usize = 19;
        loop {
            let len = match self.0.get(RECLEN..RECLEN + 2) {
                Some(&[a, b]) => usize::from(u16::from_ne_bytes([a, b])),
                _ => return None,
            };
            let record = self.0.get(..len).filter(|_| len > NAME)?;
            self.0 = self.0.get(len..).unwrap_or_default();
            let mut fd: RawFd = 0;
            let mut digits = 0;
            for &b in record.get(NAME..).unwrap_or_default() {
                if b == 0 {
                    break;
                }
                if !b.is_ascii_digit() {
                    digits = 0;
                    break;
                }
                fd = fd.saturating_mul(10).saturating_add(RawFd::from(b - b'0'));
                digits += 1;
            }
            if digits > 0 {
                return Some(fd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str) -> Vec<u8> {
        let len = (19 + name.len() + 1).next_multiple_of(8);
        let mut r = vec![0u8; len];
        r[16..18].copy_from_slice(&u16::try_from(len).unwrap().to_ne_bytes());
        r[19..19 + name.len()].copy_from_slice(name.as_bytes());
        r
    }

    #[test]
    fn records_yield_the_numbers_and_skip_the_rest() {
        let mut buf = Vec::new();
        for name in [".", "..", "0", "17", "x1", "123456"] {
            buf.extend(record(name));
        }
        assert_eq!(Records(&buf).collect::<Vec<_>>(), [0, 17, 123456]);
        // A cut or empty buffer ends the walk instead of reading past it.
        assert_eq!(Records(&buf[..buf.len() - 3]).count(), 2);
        assert_eq!(Records(&[]).count(), 0);
        let mut zero = record("5");
        zero[16..18].copy_from_slice(&0u16.to_ne_bytes());
        assert_eq!(Records(&zero).count(), 0);
    }
}
