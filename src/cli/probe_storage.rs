//! `edgespool probe-storage`: measures the spool's filesystem, stores the
//! profile beside the spool and prints it with the knobs derived from it.
//! The work is in [`crate::flash::probe`].

use std::path::{Path, PathBuf};

use super::spec::PROBE_STORAGE;
use super::{args, failed, help, load_config, Failure, Outcome};
use crate::flash::probe::Profile;

pub fn main(p: &mut lexopt::Parser) -> Outcome {
    let Some(a) = args::read(p, &PROBE_STORAGE)? else {
        return help::print(&PROBE_STORAGE);
    };
    // `--dir` wins over `--config`: no config is read when both are given.
    let dir = match (a.dir, a.config) {
        (Some(d), _) => d,
        (None, Some(c)) => spool_dir(&load_config(&c, &[])?),
        (None, None) => {
            return Err(Failure::usage_of(
                &PROBE_STORAGE,
                "--config FILE or --dir DIR is required",
            ))
        }
    };
    std::fs::create_dir_all(&dir)
        .map_err(|e| failed(format_args!("cannot create {}: {e}", dir.display())))?;
    let profile = crate::flash::probe::probe_and_store(&dir, 64, 16 * 1024 * 1024)
        .map_err(|e| failed(format_args!("probe of {} failed: {e}", dir.display())))?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&profile).unwrap_or_default()
        );
    } else {
        print_profile(&dir, &profile);
    }
    Ok(())
}

/// The directory the config's spool file lives in (`.` for a bare name).
fn spool_dir(cfg: &crate::config::Config) -> PathBuf {
    cfg.spool
        .path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn print_profile(dir: &Path, p: &Profile) {
    let (m, d) = (&p.measurements, &p.derived);
    println!(
        "storage probe of {} ({} fsyncs of 4 KiB, 16 MiB sequential):",
        dir.display(),
        m.samples
    );
    println!(
        "  fsync latency: p50 {} us, p99 {} us, max {} us",
        m.fsync_p50_us, m.fsync_p99_us, m.fsync_max_us
    );
    println!(
        "  sequential write: {:.1} MB/s; free space {} bytes",
        m.write_bytes_per_sec as f64 / 1e6,
        m.fs_free_bytes
    );
    println!("derived (used by `run` unless the config sets the key):");
    println!("  spool.commit_window_ms     {}", d.commit_window_ms);
    println!("  spool.checkpoint_wal_bytes {}", d.checkpoint_wal_bytes);
    println!(
        "  storage retry backoff      {}..{} ms",
        d.retry_min_ms, d.retry_max_ms
    );
    println!("  spool size bound           {} bytes", d.max_spool_bytes);
    println!(
        "stored in {}",
        crate::flash::probe::profile_path(dir).display()
    );
}
