//! Storage probe: measure the spool's device, derive the knobs from it.
//!
//! Its one rule: **tuning comes from measurements of the device the spool is
//! on, by the same rules everywhere**; nothing is copied from a fast machine.
//! [`derive`] is a pure function of [`Measurements`]: a device ten times
//! slower gets a longer group-commit window, a smaller checkpoint threshold
//! and longer retry backoff from the same rules.
//!
//! The profile is stored as `<spool dir>/storage-profile.json` and measured
//! again when the device or filesystem under the spool changes. A profile
//! the agent did not write (a symlink, another owner, a mode others may
//! write) or a damaged one (empty, NUL-filled after a power cut) is named
//! in a WARN with the reason and measured again; the scratch file of a
//! measurement is a new file of the agent's (`O_EXCL | O_NOFOLLOW`).

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Test hook: milliseconds added to every measured fsync, to stand in for a
/// slow card (`EDGESPOOL_PROBE_FSYNC_DELAY_MS`).
pub const DELAY_ENV: &str = "EDGESPOOL_PROBE_FSYNC_DELAY_MS";

/// What the probe measured on the spool's directory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measurements {
    /// Median latency of a 4 KiB write + `fdatasync(2)`, microseconds.
    pub fsync_p50_us: u64,
    /// 99th percentile of the same, microseconds.
    pub fsync_p99_us: u64,
    /// Slowest of the same, microseconds.
    pub fsync_max_us: u64,
    /// Sequential write throughput including a final fsync, bytes per second.
    pub write_bytes_per_sec: u64,
    /// Free bytes on the filesystem when measured.
    pub fs_free_bytes: u64,
    /// Number of fsyncs timed.
    pub samples: usize,
}

/// Knobs derived from [`Measurements`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Derived {
    /// Group-commit window: one fsync per window costs at most ~10 % of it.
    pub commit_window_ms: u64,
    /// PASSIVE checkpoint threshold: about 250 ms of writing at the measured
    /// rate, between 256 KiB and 4 MiB (the default `journal_size_limit`, past
    /// twice which the agent brakes with TRUNCATE).
    pub checkpoint_wal_bytes: u64,
    /// First retry after a busy or failed storage write: two slow fsyncs.
    pub retry_min_ms: u64,
    /// Retry cap: about a hundred slow fsyncs.
    pub retry_max_ms: u64,
    /// Spool size bound that fits the free space: half of it.
    pub max_spool_bytes: u64,
}

/// Derive the knobs. Pure; every rule is stated on [`Derived`]'s fields.
pub fn derive(m: &Measurements) -> Derived {
    let p99_ms = m.fsync_p99_us.div_ceil(1000);
    Derived {
        commit_window_ms: (p99_ms * 10).clamp(50, 5000),
        checkpoint_wal_bytes: (m.write_bytes_per_sec / 4).clamp(256 * 1024, 4 * 1024 * 1024),
        retry_min_ms: (p99_ms * 2).clamp(10, 1000),
        retry_max_ms: (p99_ms * 100).clamp(1000, 60_000),
        max_spool_bytes: (m.fs_free_bytes / 2).max(16 * 1024 * 1024),
    }
}

/// A stored profile: which device it belongs to, what was measured, what was derived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// `st_dev` of the spool directory.
    pub device: u64,
    /// `statfs` filesystem type.
    pub fs_type: i64,
    /// Unix ms of the measurement.
    pub measured_at_ms: i64,
    /// Measurements.
    pub measurements: Measurements,
    /// Derived knobs.
    pub derived: Derived,
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Measure `dir`: `samples` timed 4 KiB write + fdatasync, then `bulk_bytes`
/// written sequentially and fsynced. Uses one temporary file, removed after.
///
/// Errors: the directory cannot be written.
pub fn measure(dir: &Path, samples: usize, bulk_bytes: usize) -> std::io::Result<Measurements> {
    let delay = std::env::var(DELAY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    let path = dir.join(format!(".edgespool-probe-{}", std::process::id()));
    let mut f = scratch_file(&path)?;
    let res = (|| {
        let block = vec![0x5au8; 4096];
        let mut lat = Vec::with_capacity(samples);
        for _ in 0..samples.max(1) {
            let t = Instant::now();
            f.write_all(&block)?;
            f.sync_data()?;
            if let Some(d) = delay {
                std::thread::sleep(d);
            }
            lat.push(t.elapsed().as_micros() as u64);
        }
        lat.sort_unstable();
        let chunk = vec![0xa5u8; 1024 * 1024];
        let t = Instant::now();
        let mut written = 0;
        while written < bulk_bytes {
            let n = chunk.len().min(bulk_bytes - written);
            f.write_all(&chunk[..n])?;
            written += n;
        }
        f.sync_all()?;
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        let secs = t.elapsed().as_secs_f64().max(1e-6);
        Ok(Measurements {
            fsync_p50_us: percentile(&lat, 0.50),
            fsync_p99_us: percentile(&lat, 0.99),
            fsync_max_us: lat.last().copied().unwrap_or(0),
            write_bytes_per_sec: (written as f64 / secs) as u64,
            fs_free_bytes: crate::flash::maintenance::fs_free_bytes(dir).unwrap_or(0),
            samples: lat.len(),
        })
    })();
    let _ = std::fs::remove_file(&path);
    res
}

/// Create the probe's scratch file `path` as a new file of the agent's
/// (mode 0600). A name already there (a stale file of an earlier process
/// with this pid, or one planted: a symlink to a file it would overwrite)
/// is named in a WARN, removed (the name, never what it points to) and the
/// file created once more.
///
/// Errors: the file cannot be created (twice).
fn scratch_file(path: &Path) -> std::io::Result<std::fs::File> {
    use crate::os::fsguard::files;
    match files::create_new(path, 0o600) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            log::warn!(
                "storage probe scratch file {} already exists ({}); removing that name and creating a new file of ours",
                path.display(),
                files::describe(path)
            );
            std::fs::remove_file(path)?;
            files::create_new(path, 0o600)
        }
        other => other,
    }
}

/// Remove probe files left by a probe that was killed (`.edgespool-probe-<pid>`,
/// up to the probe's bulk size each) whose process is gone.
pub fn remove_stale_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(".edgespool-probe-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => log::info!("removed a stale storage probe file {}", e.path().display()),
            Err(err) => log::warn!(
                "cannot remove stale probe file {}: {err}",
                e.path().display()
            ),
        }
    }
}

/// `<dir>/storage-profile.json`.
pub fn profile_path(dir: &Path) -> PathBuf {
    dir.join("storage-profile.json")
}

fn identity(dir: &Path) -> std::io::Result<(u64, i64)> {
    let dev = std::fs::metadata(dir)?.dev();
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: statfs fills the zeroed struct we own; c is a valid C string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    Ok((dev, st.f_type as i64))
}

/// Probe `dir` now and store the profile.
pub fn probe_and_store(dir: &Path, samples: usize, bulk_bytes: usize) -> std::io::Result<Profile> {
    let (device, fs_type) = identity(dir)?;
    let measurements = measure(dir, samples, bulk_bytes)?;
    let profile = Profile {
        device,
        fs_type,
        measured_at_ms: crate::event::envelope::wall_clock_ms().0,
        measurements,
        derived: derive(&measurements),
    };
    let json = serde_json::to_vec_pretty(&profile).map_err(std::io::Error::other)?;
    crate::os::fsguard::files::replace(&profile_path(dir), &json, 0o640)?;
    Ok(profile)
}

/// The stored profile of `dir` if the agent wrote it
/// ([`crate::os::fsguard::files::read_trusted`]) and it still belongs to the
/// same device and filesystem; otherwise probe again (a short probe) and
/// store it. A profile that is there and not used is named in a WARN with
/// the reason. `(profile, true)` when measured now.
///
/// Errors: the directory cannot be measured or the profile not stored.
pub fn load_or_probe(dir: &Path) -> std::io::Result<(Profile, bool)> {
    let (device, fs_type) = identity(dir)?;
    let path = profile_path(dir);
    let why = match crate::os::fsguard::files::read_trusted(&path) {
        Ok(None) => None,
        Err(d) => Some(d.to_string()),
        Ok(Some(bytes)) => match serde_json::from_slice::<Profile>(&bytes) {
            Err(e) => Some(damage(&bytes, &e)),
            // The test hook measures at every start, silently.
            Ok(_) if std::env::var_os(DELAY_ENV).is_some() => None,
            Ok(p) if p.device == device && p.fs_type == fs_type => return Ok((p, false)),
            Ok(p) => Some(format!(
                "it was measured on another device or filesystem (device {}, type {:#x}; now device {device}, type {fs_type:#x})",
                p.device, p.fs_type
            )),
        },
    };
    if let Some(why) = why {
        log::warn!(
            "storage profile {} is ignored: {why}; measuring the storage again",
            path.display()
        );
    }
    Ok((probe_and_store(dir, 32, 4 * 1024 * 1024)?, true))
}

/// Why a stored profile that does not parse is damaged, in the words of
/// what a power cut or a stray write leaves.
fn damage(bytes: &[u8], e: &serde_json::Error) -> String {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        "it is damaged: empty (a write cut short?)".to_owned()
    } else if bytes.iter().all(|&b| b == 0) {
        format!(
            "it is damaged: NUL-filled ({} bytes of zeros: blocks allocated, never written, before a power cut?)",
            bytes.len()
        )
    } else if e.is_data() {
        format!("it is damaged: JSON, but not a storage profile ({e})")
    } else {
        format!("it is damaged: not JSON ({e})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> Measurements {
        Measurements {
            fsync_p50_us: 800,
            fsync_p99_us: 2_000,
            fsync_max_us: 5_000,
            write_bytes_per_sec: 40_000_000,
            fs_free_bytes: 8_000_000_000,
            samples: 64,
        }
    }

    fn ten_times_slower(m: &Measurements) -> Measurements {
        Measurements {
            fsync_p50_us: m.fsync_p50_us * 10,
            fsync_p99_us: m.fsync_p99_us * 10,
            fsync_max_us: m.fsync_max_us * 10,
            write_bytes_per_sec: m.write_bytes_per_sec / 10,
            ..*m
        }
    }

    #[test]
    fn a_device_ten_times_slower_gets_different_sensible_numbers() {
        let a = derive(&fast());
        let b = derive(&ten_times_slower(&fast()));
        assert_eq!(a.commit_window_ms, 50); // 2 ms p99 -> 20 ms, floored at 50
        assert_eq!(b.commit_window_ms, 200); // 20 ms p99 -> 200 ms
        assert_eq!(a.checkpoint_wal_bytes, 4 * 1024 * 1024);
        assert_eq!(b.checkpoint_wal_bytes, 1_000_000);
        assert_eq!((a.retry_min_ms, a.retry_max_ms), (10, 1000));
        assert_eq!((b.retry_min_ms, b.retry_max_ms), (40, 2000));
        assert_eq!(a.max_spool_bytes, 4_000_000_000);
    }

    #[test]
    fn extreme_devices_stay_within_bounds() {
        let glacial = Measurements {
            fsync_p50_us: 3_000_000,
            fsync_p99_us: 9_000_000,
            fsync_max_us: 20_000_000,
            write_bytes_per_sec: 10_000,
            fs_free_bytes: 1_000_000,
            samples: 8,
        };
        let d = derive(&glacial);
        assert_eq!(d.commit_window_ms, 5000);
        assert_eq!(d.checkpoint_wal_bytes, 256 * 1024);
        assert_eq!((d.retry_min_ms, d.retry_max_ms), (1000, 60_000));
        assert_eq!(d.max_spool_bytes, 16 * 1024 * 1024);
        let instant = Measurements {
            fsync_p50_us: 0,
            fsync_p99_us: 0,
            fsync_max_us: 0,
            write_bytes_per_sec: u64::MAX,
            fs_free_bytes: u64::MAX,
            samples: 1,
        };
        let d = derive(&instant);
        assert_eq!(d.commit_window_ms, 50);
        assert_eq!(d.checkpoint_wal_bytes, 4 * 1024 * 1024);
    }

    #[test]
    fn probe_files_of_dead_processes_are_removed_and_live_ones_kept() {
        let d = tempfile::tempdir().unwrap();
        // pid_max is at most 2^22 on Linux: this pid cannot be running.
        let dead = d.path().join(".edgespool-probe-4194305");
        let mine = d
            .path()
            .join(format!(".edgespool-probe-{}", std::process::id()));
        let other = d.path().join("spool.db");
        for p in [&dead, &mine, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        remove_stale_files(d.path());
        assert!(!dead.exists());
        assert!(mine.exists());
        assert!(other.exists());
    }

    #[test]
    fn a_scratch_file_planted_as_a_symlink_is_replaced_and_its_target_untouched() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let scratch = d
            .path()
            .join(format!(".edgespool-probe-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &scratch).unwrap();
        let m = measure(d.path(), 2, 4096).unwrap();
        assert_eq!(m.samples, 2);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(
            std::fs::symlink_metadata(&scratch).is_err(),
            "removed after"
        );
    }

    #[test]
    fn a_profile_the_agent_did_not_write_or_a_damaged_one_is_measured_again() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (p, _) = load_or_probe(d.path()).unwrap();
        let path = profile_path(d.path());
        // Others may write it: not believed, rewritten as the agent's own.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let (q, fresh) = load_or_probe(d.path()).unwrap();
        assert!(fresh);
        assert_eq!(q.device, p.device);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o022, 0, "{mode:o}");
        std::fs::write(&path, [0u8; 64]).unwrap();
        assert!(load_or_probe(d.path()).unwrap().1);
        let why = |bytes: &[u8]| {
            let e = serde_json::from_slice::<Profile>(bytes).unwrap_err();
            damage(bytes, &e)
        };
        assert_eq!(why(b""), "it is damaged: empty (a write cut short?)");
        assert!(why(&[0u8; 64]).starts_with("it is damaged: NUL-filled (64 bytes of zeros"));
        assert!(why(b"{\"device\": 1, tr").starts_with("it is damaged: not JSON ("));
        assert!(
            why(b"{\"device\": 1}").starts_with("it is damaged: JSON, but not a storage profile (")
        );
        assert!(
            !load_or_probe(d.path()).unwrap().1,
            "the new one is believed"
        );
    }

    #[test]
    fn a_real_probe_measures_this_directory_and_stores_a_profile() {
        let d = tempfile::tempdir().unwrap();
        let (p, fresh) = load_or_probe(d.path()).unwrap();
        assert!(fresh);
        assert!(p.measurements.samples >= 1);
        assert!(p.measurements.write_bytes_per_sec > 0);
        assert!(p.measurements.fsync_p50_us <= p.measurements.fsync_p99_us);
        // Stored, and reused while the device is the same.
        let (q, fresh) = load_or_probe(d.path()).unwrap();
        assert!(!fresh);
        assert_eq!(p, q);
        let leftovers: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(".edgespool-probe")
            })
            .collect();
        assert!(leftovers.is_empty());
    }
}
