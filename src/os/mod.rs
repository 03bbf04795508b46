//! Thin wrappers over Linux: child processes with bounds, filesystem
//! guards (lock file, local filesystem, hostile directories), systemd's
//! notification socket, bounded thread joins, capped backoff, the
//! board's identity and its clocks (boot id, `CLOCK_BOOTTIME`, time sync),
//! this process's I/O counters.
//!
//! Its one rule: **each wrapper says what the OS said.** An errno becomes a
//! named error kind with its source cited; no policy of the agent lives
//! here. Imports only [`crate::event`].

pub mod backoff;
pub mod clock;
pub mod fsguard;
pub mod identity;
pub mod notify;
pub mod proc_io;
pub mod process;
pub mod threads;
