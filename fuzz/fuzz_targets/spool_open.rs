//! Opening a spool file whose bytes the fuzzer mutates, through
//! `integrity::open_spool_at`, the whole decision `agent::open_spool` makes at
//! start: open it, move it aside as damaged and start a fresh spool, or
//! refuse a file that is not SQLite at all.
//!
//! Input: the database file's bytes, written into a temporary directory of
//! its own for each input (no `-wal`: the seeds are checkpointed files made
//! by the agent's own `Spool`, see `seeds/spool_open/` and
//! `src/bin/make_spool_seed.rs`).
//!
//! Bounds asserted: the outcome is one of
//! - opened (the file, or a fresh one after moving the damaged file aside),
//!   and the first reads the agent makes return or fail, never panic;
//! - refused as "not a SQLite database", with nothing moved;
//! - refused as written by a newer build (`user_version` above this build's
//!   schema: the agent never downgrades data, so it stops and says so);
//! - refused with its error when SQLite's own check (`quick_check`) passes
//!   but the schema is not this spool's: a file SQLite vouches for is never
//!   moved aside;
//! and the whole run stays within libFuzzer's `-timeout` (no hang).
#![no_main]

use edgespool::spool::integrity::{open_spool_at, OpenError};
use edgespool::spool::priority::Lane;
use edgespool::spool::{SpoolError, SpoolOptions};
use libfuzzer_sys::fuzz_target;

/// A fresh directory per input, memory-backed when the machine has one
/// (SQLite's WAL needs shared memory and locks; /dev/shm gives both).
fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .expect("temporary directory")
}

fuzz_target!(|data: &[u8]| {
    let dir = scratch_dir();
    let path = dir.path().join("spool.db");
    std::fs::write(&path, data).expect("write the spool file");
    let result = open_spool_at(&path, &SpoolOptions::default());
    let moved = std::fs::read_dir(dir.path())
        .expect("list the directory")
        .filter_map(Result::ok)
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("spool.db.corrupt-")
        });
    match result {
        Ok(spool) => {
            // What the agent reads first; errors (damage further in) are for
            // the background integrity check, a panic is a bug.
            let _ = spool.sendable(0, 64);
            let _ = spool.sendable_lane(Lane::Priority, 0, 64);
            let _ = spool.sendable_lane(Lane::Normal, 0, 64);
            let _ = spool.backlog_by_stream(0);
            let _ = spool.stats(0);
            let _ = spool.oldest_unacked_ms();
            let _ = spool.backlog_estimate();
            if moved {
                let s = spool.stats(0).expect("a fresh spool reads");
                assert!(s.by_stream_state.is_empty(), "a fresh spool has rows");
            }
        }
        Err(OpenError::Refused(msg)) if msg.contains("is not a SQLite database") => {
            assert!(!moved, "moved aside and then refused");
            assert!(!data.starts_with(b"SQLite format 3\0"));
        }
        Err(OpenError::Spool(SpoolError::NewerSchema { found, .. })) => {
            assert!(found > edgespool::spool::SCHEMA_VERSION);
            assert!(!moved);
        }
        Err(OpenError::Spool(SpoolError::Other { source, .. }))
            if !moved && edgespool::spool::integrity::confirm_damage(&path).is_none() =>
        {
            // A file SQLite's own check passes, with a schema that is not
            // this spool's (the fuzzer edits the CREATE text): refused with
            // its error, never moved aside (see integrity::confirm_damage).
            let _ = source;
        }
        Err(e) => panic!("neither opened, moved aside nor refused: {e} (moved: {moved})"),
    }
});
