//! `[spool]` validation.

use super::bounds::{check_range, Bounds};
use super::TEN_YEARS_SECS;
use crate::config::raw::{d_ckpt_wal, d_commit, RawSpool};
use crate::config::{ExplicitKeys, SpoolConfig};
use crate::spool::{SpoolOptions, Synchronous};
use std::time::Duration;

/// Largest `spool.journal_size_limit_bytes`: 1 GiB, the top of
/// `spool.checkpoint_wal_bytes` too. A `-wal` file kept at more than that
/// after every checkpoint is disk a board never gets back, and a value
/// past it is a typo (an extra zero), not a choice.
pub(super) const JOURNAL_SIZE_LIMIT_MAX: i64 = 1024 * 1024 * 1024;

/// `[spool]`: a path without NUL bytes, SQLite settings in their safe ranges
/// (`synchronous` NORMAL or FULL, never OFF), retention and capacity bounds.
pub(super) fn validate_spool(s: &RawSpool, bad: &mut impl FnMut(&str, String)) -> SpoolConfig {
    if s.path.as_os_str().is_empty() || s.path.as_os_str().as_encoded_bytes().contains(&0) {
        bad(
            "spool.path",
            format!(
                "must be a non-empty path without NUL bytes (got {:?})",
                s.path
            ),
        );
    }
    check_range(
        "spool.acked_retention_secs",
        s.acked_retention_secs,
        Bounds::at_most(TEN_YEARS_SECS).note(" (ten years)"),
        bad,
    );
    let options = validate_pragmas(s, bad);
    let commit_window_ms = validate_windows(s, bad);
    check_range(
        "spool.purge_batch_rows",
        s.purge_batch_rows,
        1..=100_000,
        bad,
    );
    if s.max_bytes != 0 && s.max_bytes < 1024 * 1024 {
        bad(
            "spool.max_bytes",
            format!(
                "must be 0 (no limit) or at least 1048576 (got {})",
                s.max_bytes
            ),
        );
    }
    let checkpoint_wal_bytes = s.checkpoint_wal_bytes.unwrap_or_else(d_ckpt_wal);
    check_range(
        "spool.checkpoint_wal_bytes",
        checkpoint_wal_bytes,
        64 * 1024..=1024 * 1024 * 1024,
        bad,
    );
    check_range(
        "spool.checkpoint_interval_secs",
        s.checkpoint_interval_secs,
        1..=86_400,
        bad,
    );
    SpoolConfig {
        path: s.path.clone(),
        options,
        commit_window: Duration::from_millis(commit_window_ms),
        write_budget_bytes_per_day: s
            .write_budget_mb_per_day
            .map(|mb| mb.saturating_mul(1_000_000)),
        max_commit_window: Duration::from_millis(s.max_commit_window_ms),
        acked_retention: Duration::from_secs(s.acked_retention_secs),
        purge_batch_rows: s.purge_batch_rows,
        checkpoint_interval: Duration::from_secs(s.checkpoint_interval_secs),
        allow_network_fs: s.allow_network_fs,
        capacity: crate::flash::maintenance::Capacity {
            max_bytes: s.max_bytes,
            min_free_bytes: s.min_free_bytes,
        },
        checkpoint_wal_bytes,
        tune_from_probe: s.tune_from_probe,
        explicit: ExplicitKeys {
            commit_window: s.commit_window_ms.is_some(),
            checkpoint_wal_bytes: s.checkpoint_wal_bytes.is_some(),
        },
    }
}

/// The SQLite settings: `synchronous` NORMAL or FULL (never OFF),
/// `busy_timeout_ms` at least 5000, `journal_size_limit_bytes` 0..=1 GiB,
/// `wal_autocheckpoint_pages` >= 0.
fn validate_pragmas(s: &RawSpool, bad: &mut impl FnMut(&str, String)) -> SpoolOptions {
    let synchronous = match s.synchronous.to_ascii_lowercase().as_str() {
        "normal" => Synchronous::Normal,
        "full" => Synchronous::Full,
        other => {
            bad(
                "spool.synchronous",
                format!("must be \"normal\" or \"full\" (got {other:?}); OFF is never allowed"),
            );
            Synchronous::Normal
        }
    };
    check_range(
        "spool.busy_timeout_ms",
        s.busy_timeout_ms,
        Bounds::at_least(5000),
        bad,
    );
    check_range(
        "spool.journal_size_limit_bytes",
        s.journal_size_limit_bytes,
        Bounds::from(0..=JOURNAL_SIZE_LIMIT_MAX).note(" (1 GiB)"),
        bad,
    );
    check_range(
        "spool.wal_autocheckpoint_pages",
        s.wal_autocheckpoint_pages,
        Bounds::ge(0),
        bad,
    );
    SpoolOptions {
        synchronous,
        busy_timeout: Duration::from_millis(s.busy_timeout_ms),
        journal_size_limit_bytes: s.journal_size_limit_bytes,
        wal_autocheckpoint_pages: s.wal_autocheckpoint_pages,
    }
}

/// The commit windows and the write budget: `spool.commit_window_ms` in
/// 1..=60000 ms, `spool.max_commit_window_ms` (the loss window a budget may
/// widen to) in 1..=600000 ms, the budget in 1..=1000000 MB a day, and a
/// budget's ceiling at least the window it widens from. Returns the commit
/// window in ms (the default if unset).
fn validate_windows(s: &RawSpool, bad: &mut impl FnMut(&str, String)) -> u64 {
    let commit_window_ms = s.commit_window_ms.unwrap_or_else(d_commit);
    check_range("spool.commit_window_ms", commit_window_ms, 1..=60_000, bad);
    check_range(
        "spool.max_commit_window_ms",
        s.max_commit_window_ms,
        Bounds::from(1..=600_000).note(" ms (10 minutes)"),
        bad,
    );
    if let Some(mb) = s.write_budget_mb_per_day {
        check_range(
            "spool.write_budget_mb_per_day",
            mb,
            Bounds::from(1..=1_000_000).note(" MB a day"),
            bad,
        );
        if s.commit_window_ms
            .is_some_and(|w| w > s.max_commit_window_ms)
        {
            bad(
                "spool.max_commit_window_ms",
                format!(
                    "must be at least spool.commit_window_ms ({}) when spool.write_budget_mb_per_day is set (got {}): a budget widens the window from commit_window_ms up to max_commit_window_ms",
                    commit_window_ms, s.max_commit_window_ms
                ),
            );
        }
    }
    commit_window_ms
}
