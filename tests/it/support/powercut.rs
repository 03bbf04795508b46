//! A power-cut simulator for the agent's spool: what an fsync covered
//! survives, what was written after the last one is lost.
//!
//! The agent runs with a small `LD_PRELOAD` library (C, built here with
//! the system's `cc`) that wraps `fsync(2)` and `fdatasync(2)`: before
//! each call it reads the file's size (`fstat`), and once the call has
//! succeeded it appends `<size> <path>` to a log. Everything written to a
//! file before a sync began is on the disk once it returns, so the size
//! read then is a lower bound of what that sync made durable. A reply the
//! agent sends after its commit's sync returned therefore finds that
//! sync's line in the log already.
//!
//! With `POWERCUT_SYNC_DELAY_US` set, each successful sync also sleeps that
//! long ([`PowerCut::slow_sync_env`]): a slow card's flush latency on a
//! fast disk, for the benchmarks.
//!
//! The cut ([`PowerCut::cut`]): SIGKILL (the page cache, which still
//! holds every write, survives a kill), then the spool's `-wal` is cut
//! back to the size of its last logged sync (removed if it never synced)
//! and the `-shm` (shared memory, gone with the power) is removed. The
//! database file itself is left as it is: the boards that use this turn
//! the agent's checkpoints off for the run (the only writes to the
//! database file, each synced before the WAL restarts), so every commit
//! of the run lives in the WAL. A WAL only grows while no checkpoint runs,
//! so "the bytes past the last synced size" is what a power cut may take
//! (a cut may also keep them; the simulator takes the worse case). Right
//! after the start's checkpoint the WAL restarts and its first new frames
//! overwrite old ones in place: there the file size overstates what a sync
//! covered, which makes the cut milder, never a false loss. SQLite's recovery at the next open stops at the first frame
//! that is cut short or whose checksum fails, as after a real cut.

use super::agent::AgentProc;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wrapper library's source: fsync and fdatasync, logged after success.
const SHIM_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void note(int fd, long long size) {
    const char *log = getenv("POWERCUT_SYNC_LOG");
    char link[64], path[4096], line[4200];
    if (!log) return;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return;
    path[n] = 0;
    int len = snprintf(line, sizeof line, "%lld %s\n", size, path);
    int lfd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (lfd < 0) return;
    /* One write to an O_APPEND file: lines of concurrent syncs never mix. */
    if (write(lfd, line, len) < 0) {}
    close(lfd);
}

/* POWERCUT_SYNC_DELAY_US: each successful sync also takes this long (a
   slow card's flush), with the thread blocked as on a real device. */
static void slow_down(void) {
    const char *us = getenv("POWERCUT_SYNC_DELAY_US");
    if (us) usleep((useconds_t)strtoul(us, NULL, 10));
}

static long long size_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    long long size = size_of(fd);
    int rc = real(fd);
    if (rc == 0) slow_down();
    if (rc == 0 && size >= 0) note(fd, size);
    return rc;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    long long size = size_of(fd);
    int rc = real(fd);
    if (rc == 0) slow_down();
    if (rc == 0 && size >= 0) note(fd, size);
    return rc;
}
"#;

/// The simulator for one spool: the library, its log, the spool path.
pub struct PowerCut {
    lib: PathBuf,
    log: PathBuf,
    db: PathBuf,
}

/// What a cut did to the WAL.
#[derive(Debug)]
pub struct Cut {
    /// The WAL's length at the kill (page cache included).
    pub wal_before: u64,
    /// Its length after the cut: the size at its last sync.
    pub wal_after: u64,
    /// Syncs of the WAL logged during the run.
    pub wal_syncs: usize,
}

impl PowerCut {
    /// Build the wrapper library in `dir` (panics naming the compiler's
    /// error if `cc` cannot build it) for the spool at `db`.
    pub fn new(dir: &Path, db: &Path) -> PowerCut {
        let src = dir.join("powercut.c");
        let lib = dir.join("libpowercut.so");
        std::fs::write(&src, SHIM_C).expect("write powercut.c");
        let mut cc = Command::new("cc");
        cc.args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .arg("-ldl");
        super::run_ok(
            &mut cc,
            "cc powercut.c (the power-cut simulator needs a C compiler)",
        );
        PowerCut {
            lib,
            log: dir.join("syncs.log"),
            db: db.to_path_buf(),
        }
    }

    /// The environment that only slows every sync of the agent by
    /// `delay_us` microseconds (no log, no cut): slow flash's sync latency
    /// on a fast disk, for benchmarks.
    pub fn slow_sync_env(&self, delay_us: u64) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", self.lib.display().to_string()),
            ("POWERCUT_SYNC_DELAY_US", delay_us.to_string()),
        ]
    }

    /// The environment that puts the agent under the simulator.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", self.lib.display().to_string()),
            ("POWERCUT_SYNC_LOG", self.log.display().to_string()),
        ]
    }

    fn wal(&self) -> PathBuf {
        PathBuf::from(format!("{}-wal", self.db.display()))
    }

    /// The logged syncs of the spool's WAL, in order: the size each covered.
    pub fn wal_syncs(&self) -> Vec<u64> {
        let wal = self.wal();
        let wal = std::fs::canonicalize(&wal).unwrap_or(wal);
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, p)| Path::new(p) == wal)
            .filter_map(|(n, _)| n.parse().ok())
            .collect()
    }

    /// The cut: SIGKILL `agent`, then the WAL back to its last synced
    /// size and the `-shm` removed (see the module doc).
    pub fn cut(&self, agent: &mut AgentProc) -> Cut {
        agent.kill9();
        let wal = self.wal();
        let wal_before = std::fs::metadata(&wal).map_or(0, |m| m.len());
        let syncs = self.wal_syncs();
        let keep = syncs.last().copied().unwrap_or(0).min(wal_before);
        if keep == 0 {
            let _ = std::fs::remove_file(&wal);
        } else {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&wal)
                .expect("open the -wal to cut it");
            f.set_len(keep).expect("cut the -wal");
        }
        let shm = PathBuf::from(format!("{}-shm", self.db.display()));
        match std::fs::remove_file(&shm) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("remove {}: {e}", shm.display()),
        }
        Cut {
            wal_before,
            wal_after: keep,
            wal_syncs: syncs.len(),
        }
    }
}
