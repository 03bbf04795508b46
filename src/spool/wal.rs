//! The spool's WAL as this process sees it: frames written since the last
//! checkpoint copied them back, commits made, and the brake that
//! checkpoints from the committing connection when the WAL runs long.
//!
//! One rule: these counts belong to one spool file, and every connection
//! this process opens on it shares them ([`Spool::open_sibling`]); nothing
//! here is process-wide. They come from SQLite's WAL hook
//! (<https://www.sqlite.org/c3ref/wal_hook.html>), called after each commit
//! with the number of frames in the WAL; registering it turns SQLite's own
//! auto-checkpoint off for the connection (the agent owns checkpoints).

use super::Spool;
use rusqlite::{ffi, Connection};
use std::os::raw::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// The brake's default: a PASSIVE checkpoint from the committing connection
/// once this many frames (about 32 MiB) wait in the WAL; the agent sets its
/// own from its checkpoint threshold ([`WalWatch::set_brake_frames`]).
const DEFAULT_BRAKE_FRAMES: i64 = 8192;

/// What the WAL hook saw on every connection of one spool file.
#[derive(Debug)]
pub struct WalWatch {
    /// Frames in the WAL after the newest commit.
    frames: AtomicI64,
    /// Frames the last checkpoint copied back into the database.
    backfilled: AtomicI64,
    /// Past this many frames not yet copied back, the committing connection
    /// runs a PASSIVE checkpoint itself; 0 turns the brake off.
    brake_frames: AtomicI64,
    /// Commits on every connection sharing this watch.
    commits: AtomicU64,
}

impl Default for WalWatch {
    fn default() -> Self {
        WalWatch {
            frames: AtomicI64::new(0),
            backfilled: AtomicI64::new(0),
            brake_frames: AtomicI64::new(DEFAULT_BRAKE_FRAMES),
            commits: AtomicU64::new(0),
        }
    }
}

impl WalWatch {
    /// Frames written to the WAL since the last checkpoint copied them back
    /// (not the `-wal` file's length, which `journal_size_limit` keeps at its
    /// limit after a reset).
    pub fn frames_since_checkpoint(&self) -> u64 {
        let frames = self.frames.load(Ordering::Relaxed);
        let done = self.backfilled.load(Ordering::Relaxed);
        (frames - done).max(0) as u64
    }

    /// Commits made on every connection sharing this watch since they opened.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Set the frame count past which a committing connection checkpoints
    /// (PASSIVE) on its own; 0 turns the brake off.
    pub fn set_brake_frames(&self, frames: i64) {
        self.brake_frames.store(frames.max(0), Ordering::Relaxed);
    }

    /// A commit left `frames` frames in the WAL; true when the brake is due.
    fn note_commit(&self, frames: i64) -> bool {
        if self.frames.swap(frames, Ordering::Relaxed) > frames {
            // Fewer frames than before: the WAL restarted from its beginning.
            self.backfilled.store(0, Ordering::Relaxed);
        }
        self.commits.fetch_add(1, Ordering::Relaxed);
        let brake = self.brake_frames.load(Ordering::Relaxed);
        brake > 0 && frames - self.backfilled.load(Ordering::Relaxed) >= brake
    }

    /// A checkpoint reported `log_frames` in the WAL and `checkpointed` of
    /// them copied back (negative values: no WAL, nothing learnt).
    pub(super) fn note_checkpoint(&self, log_frames: i64, checkpointed: i64) {
        if log_frames >= 0 && checkpointed >= 0 {
            self.frames.store(log_frames, Ordering::Relaxed);
            self.backfilled.store(checkpointed, Ordering::Relaxed);
        }
    }
}

/// Report `conn`'s commits to `watch` from now on (replacing any earlier
/// watch). The caller keeps `watch` alive for as long as the hook is set:
/// [`Spool`] holds it and clears the hook in its `Drop`.
pub(super) fn watch(conn: &Connection, watch: &Arc<WalWatch>) {
    // SAFETY: `handle` is this open connection's; the context pointer is an
    // `Arc<WalWatch>` the owning `Spool` keeps alive until `unwatch` clears
    // the hook (its `Drop`, before the connection closes) or a later
    // `watch` replaces it (`Spool::share_wal`, before the old Arc drops).
    unsafe {
        ffi::sqlite3_wal_hook(
            conn.handle(),
            Some(hook),
            Arc::as_ptr(watch).cast_mut().cast::<c_void>(),
        );
    }
}

/// Clear `conn`'s WAL hook.
pub(super) fn unwatch(conn: &Connection) {
    // SAFETY: `handle` is this open connection's; no context is kept.
    unsafe {
        ffi::sqlite3_wal_hook(conn.handle(), None, std::ptr::null_mut());
    }
}

/// SQLite's WAL hook: counts the commit and runs the brake's PASSIVE
/// checkpoint when due (busy is not an error: the agent's own pass retries).
unsafe extern "C" fn hook(
    ctx: *mut c_void,
    db: *mut ffi::sqlite3,
    name: *const c_char,
    frames: c_int,
) -> c_int {
    // SAFETY: `ctx` is the `Arc<WalWatch>` pointer `watch` registered, alive
    // while the hook is set (see `watch`).
    let w = unsafe { &*ctx.cast_const().cast::<WalWatch>() };
    if w.note_commit(i64::from(frames)) {
        let (mut log, mut done) = (0, 0);
        // SAFETY: `db` and `name` are the ones SQLite passed to this hook.
        let rc = unsafe {
            ffi::sqlite3_wal_checkpoint_v2(
                db,
                name,
                ffi::SQLITE_CHECKPOINT_PASSIVE,
                &mut log,
                &mut done,
            )
        };
        if rc == ffi::SQLITE_OK {
            w.note_checkpoint(i64::from(log), i64::from(done));
        }
    }
    ffi::SQLITE_OK
}

impl Spool {
    /// The WAL counts of this spool file, shared by every connection this
    /// process opened on it with [`Spool::open_sibling`].
    pub fn wal(&self) -> &Arc<WalWatch> {
        &self.wal
    }

    /// Count this connection's commits in `other`'s WAL watch from now on.
    pub fn share_wal(&mut self, other: &Spool) {
        let shared = other.wal.clone();
        watch(&self.conn, &shared);
        self.wal = shared;
    }
}
