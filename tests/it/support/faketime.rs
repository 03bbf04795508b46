//! A board's wall clock stepped under the real agent, the one way every
//! test sets it up: Debian's libfaketime (package `faketime`, its
//! multi-threaded flavour) preloaded, the offset in a file the agent
//! re-reads at every call, and the monotonic clocks left running, as NTP
//! leaves them (it steps `CLOCK_REALTIME` only). What the kernel says of
//! time sync is a file of the test's too (`EDGESPOOL_CLOCK_SYNC_FILE`),
//! written by the test in its own words.
//!
//! Its one rule: **every agent on a stepped clock gets the same
//! environment** ([`FakeClock::env`]), so a test that passes on one clock
//! set-up passes for the same reason on the others.

use std::path::{Path, PathBuf};

/// Debian's libfaketime, multi-threaded flavour: under `/usr/lib/<triplet>/`
/// or `/usr/lib/faketime/`.
///
/// Panics when it is not installed, naming the package.
pub fn libfaketime() -> PathBuf {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("faketime/libfaketimeMT.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketimeMT.so.1")])
        .find(|p| p.exists());
    found.expect(
        "libfaketimeMT.so.1 not found: install Debian's faketime package (cross/setup-debian.sh)",
    )
}

/// Step the wall clock of an agent reading `file`: `offset` as libfaketime
/// reads it ("+0", "+30d", "-1700000000": seconds, or with a unit, from the
/// real time).
///
/// Panics when the file cannot be written.
pub fn step_clock(file: &Path, offset: &str) {
    std::fs::write(file, format!("{offset}\n")).expect("write faketime file");
}

/// Whether libfaketime can reach the agent: not when an emulator runs it
/// (`EDGESPOOL_AGENT_RUNNER`, the armv7/aarch64 runs), which loads its own
/// libraries. Prints the line a skipped test shows when it cannot.
pub fn reaches_the_agent() -> bool {
    let emulated = std::env::var("EDGESPOOL_AGENT_RUNNER").is_ok_and(|r| !r.trim().is_empty());
    if emulated {
        println!("skipped: libfaketime cannot reach an agent run under an emulator");
    }
    !emulated
}

/// A wall clock for the agent: libfaketime, the file its offset is in, and
/// the file the kernel's time-sync answer is in, if the test gives one.
pub struct FakeClock {
    /// [`libfaketime`], as `LD_PRELOAD` takes it.
    lib: String,
    /// The offset file, as `FAKETIME_TIMESTAMP_FILE` takes it.
    file: PathBuf,
    shown: String,
    /// The time-sync file, as [`edgespool::os::clock::SYNC_FILE_ENV`] takes it.
    sync: Option<String>,
}

impl FakeClock {
    /// A clock whose offset is in `file`, set to `offset` now (as
    /// [`step_clock`] takes it).
    ///
    /// Panics when libfaketime is not installed or the file cannot be
    /// written.
    pub fn new(file: PathBuf, offset: &str) -> FakeClock {
        let lib = libfaketime().display().to_string();
        step_clock(&file, offset);
        FakeClock {
            lib,
            shown: file.display().to_string(),
            file,
            sync: None,
        }
    }

    /// This clock, with what the kernel says of time sync read from `sync`
    /// (the test writes it: `synchronized` or `unsynchronized`).
    pub fn with_sync_file(mut self, sync: &Path) -> FakeClock {
        self.sync = Some(sync.display().to_string());
        self
    }

    /// Step it to `offset` (as [`step_clock`] takes it); a running agent
    /// reads the new time at its next call.
    pub fn step(&self, offset: &str) {
        step_clock(&self.file, offset);
    }

    /// The file the offset is in.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The environment an agent runs on this clock with, for
    /// `AgentProc::spawn_with_env`.
    pub fn env(&self) -> Vec<(&str, &str)> {
        let mut env = vec![
            ("LD_PRELOAD", self.lib.as_str()),
            ("FAKETIME_TIMESTAMP_FILE", self.shown.as_str()),
            // Read the file at every call, not once a few seconds.
            ("FAKETIME_NO_CACHE", "1"),
            // NTP steps CLOCK_REALTIME only; the monotonic clocks run on.
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ];
        if let Some(sync) = &self.sync {
            env.push((edgespool::os::clock::SYNC_FILE_ENV, sync.as_str()));
        }
        env
    }
}
