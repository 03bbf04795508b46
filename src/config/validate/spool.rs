//! `[spool]` validation.

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
    if s.acked_retention_secs > TEN_YEARS_SECS {
        bad(
            "spool.acked_retention_secs",
            format!(
                "must be at most {TEN_YEARS_SECS} (ten years) (got {})",
                s.acked_retention_secs
            ),
        );
    }
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
    if s.busy_timeout_ms < 5000 {
        bad(
            "spool.busy_timeout_ms",
            format!("must be at least 5000 (got {})", s.busy_timeout_ms),
        );
    }
    if !(0..=JOURNAL_SIZE_LIMIT_MAX).contains(&s.journal_size_limit_bytes) {
        bad(
            "spool.journal_size_limit_bytes",
            format!(
                "must be 0..={JOURNAL_SIZE_LIMIT_MAX} (1 GiB) (got {})",
                s.journal_size_limit_bytes
            ),
        );
    }
    if s.wal_autocheckpoint_pages < 0 {
        bad(
            "spool.wal_autocheckpoint_pages",
            format!("must be >= 0 (got {})", s.wal_autocheckpoint_pages),
        );
    }
    let commit_window_ms = validate_windows(s, bad);
    if !(1..=100_000).contains(&s.purge_batch_rows) {
        bad(
            "spool.purge_batch_rows",
            format!("must be 1..=100000 (got {})", s.purge_batch_rows),
        );
    }
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
    if !(64 * 1024..=1024 * 1024 * 1024).contains(&checkpoint_wal_bytes) {
        bad(
            "spool.checkpoint_wal_bytes",
            format!("must be 65536..=1073741824 (got {checkpoint_wal_bytes})"),
        );
    }
    if !(1..=86_400).contains(&s.checkpoint_interval_secs) {
        bad(
            "spool.checkpoint_interval_secs",
            format!("must be 1..=86400 (got {})", s.checkpoint_interval_secs),
        );
    }
    SpoolConfig {
        path: s.path.clone(),
        options: SpoolOptions {
            synchronous,
            busy_timeout: Duration::from_millis(s.busy_timeout_ms),
            journal_size_limit_bytes: s.journal_size_limit_bytes,
            wal_autocheckpoint_pages: s.wal_autocheckpoint_pages,
        },
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

/// The commit windows and the write budget: `spool.commit_window_ms` and
/// `spool.max_commit_window_ms` in 1..=60000 ms, the budget in
/// 1..=1000000 MB a day, and a budget's ceiling at least the window it
/// widens from. Returns the commit window in ms (the default if unset).
fn validate_windows(s: &RawSpool, bad: &mut impl FnMut(&str, String)) -> u64 {
    let commit_window_ms = s.commit_window_ms.unwrap_or_else(d_commit);
    if !(1..=60_000).contains(&commit_window_ms) {
        bad(
            "spool.commit_window_ms",
            format!("must be 1..=60000 (got {commit_window_ms})"),
        );
    }
    if !(1..=60_000).contains(&s.max_commit_window_ms) {
        bad(
            "spool.max_commit_window_ms",
            format!("must be 1..=60000 (got {})", s.max_commit_window_ms),
        );
    }
    if let Some(mb) = s.write_budget_mb_per_day {
        if !(1..=1_000_000).contains(&mb) {
            bad(
                "spool.write_budget_mb_per_day",
                format!("must be 1..=1000000 MB a day (got {mb})"),
            );
        }
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
