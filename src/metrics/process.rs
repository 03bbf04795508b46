//! The standard `process_*` metrics of the agent's own process, read from
//! `/proc/self` as Prometheus client libraries export them
//! (<https://prometheus.io/docs/instrumenting/writing_clientlibs/#process-metrics>:
//! `process_cpu_seconds_total`, `process_open_fds`, `process_max_fds`,
//! `process_virtual_memory_bytes`, `process_resident_memory_bytes`,
//! `process_start_time_seconds`), so the same queries and dashboards work on
//! edgespool as on any exporter.
//!
//! Its one rule: **a few small reads at the summary interval**: `stat`,
//! `limits`, the machine's boot time, and one directory listing of the open
//! descriptors; a figure that cannot be read is left out, never guessed.
//! They are served by `metrics.listen` only, never written to
//! `metrics.textfile`: node_exporter, which reads that file, exports
//! `process_*` of its own and fails a scrape that holds a family twice.

use std::path::Path;

/// What `/proc/self` says of the process now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessFigures {
    /// User and system CPU time, seconds (`utime + stime` of `stat`).
    pub cpu_seconds: f64,
    /// Resident set size, bytes (`rss` pages of `stat` times the page size).
    pub resident_bytes: u64,
    /// Virtual memory size, bytes (`vsize` of `stat`).
    pub virtual_bytes: u64,
    /// Start time, Unix seconds (`starttime` of `stat` after the boot time
    /// `btime` of `/proc/stat`).
    pub start_time_secs: f64,
    /// Open file descriptors (entries of `/proc/self/fd`); `None` when the
    /// directory cannot be listed.
    pub open_fds: Option<u64>,
    /// The soft limit on open files (`limits`); `None` when unlimited or
    /// unreadable.
    pub max_fds: Option<u64>,
}

/// `sysconf(name)` as a positive number.
fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf reads a constant of the system; -1 means unknown.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|v| *v > 0)
}

/// The figures now, or `None` when `/proc/self/stat` cannot be read (not
/// Linux, no `/proc`).
pub fn read() -> Option<ProcessFigures> {
    let proc = Path::new("/proc");
    let stat = std::fs::read_to_string(proc.join("self/stat")).ok()?;
    let boot = std::fs::read_to_string(proc.join("stat"))
        .ok()
        .and_then(|s| boot_time(&s));
    let ticks = sysconf(libc::_SC_CLK_TCK)?;
    let page = sysconf(libc::_SC_PAGESIZE)?;
    let mut f = from_stat(&stat, ticks, page, boot?)?;
    f.open_fds = std::fs::read_dir(proc.join("self/fd"))
        .ok()
        .map(|d| d.count() as u64);
    f.max_fds = std::fs::read_to_string(proc.join("self/limits"))
        .ok()
        .and_then(|s| max_open_files(&s));
    Some(f)
}

/// `btime` (Unix seconds of the boot) from `/proc/stat`'s text.
fn boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft "Max open files" limit from `/proc/self/limits`' text.
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The figures of `/proc/self/stat`'s text (proc(5)): fields after the
/// command name, which may hold spaces and parentheses, so the split is at
/// the last `)`. Field 3 (state) is index 0 there: utime 14, stime 15,
/// starttime 22 (clock ticks since boot), vsize 23 (bytes), rss 24 (pages).
fn from_stat(stat: &str, ticks: u64, page: u64, boot_secs: u64) -> Option<ProcessFigures> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    let tick_secs = |t: u64| t as f64 / ticks as f64;
    Some(ProcessFigures {
        cpu_seconds: tick_secs(field(14)? + field(15)?),
        resident_bytes: field(24)? * page,
        virtual_bytes: field(23)?,
        start_time_secs: boot_secs as f64 + tick_secs(field(22)?),
        open_fds: None,
        max_fds: None,
    })
}

/// The families in the text format, to append to a rendering
/// ([`super::render`]), with the client libraries' names and HELP.
pub fn render(p: &ProcessFigures) -> String {
    let mut o = super::Out(String::with_capacity(1024));
    families(&mut o, p);
    o.0
}

fn families(o: &mut super::Out, p: &ProcessFigures) {
    o.single(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        p.cpu_seconds,
    );
    if let Some(n) = p.open_fds {
        o.single(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            n as f64,
        );
    }
    if let Some(n) = p.max_fds {
        o.single(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            n as f64,
        );
    }
    o.single(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        p.virtual_bytes as f64,
    );
    o.single(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        p.resident_bytes as f64,
    );
    o.single(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
        p.start_time_secs,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_a_command_name_with_spaces_and_parentheses() {
        // proc(5) order; the comm holds ") (" to trip a split at the first ')'.
        let stat = "4242 (edge) (spool) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 7 0 12345 104857600 2560 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        let f = from_stat(stat, 100, 4096, 1_700_000_000).expect("parsed");
        assert_eq!(f.cpu_seconds, 3.0);
        assert_eq!(f.resident_bytes, 2560 * 4096);
        assert_eq!(f.virtual_bytes, 104_857_600);
        assert!((f.start_time_secs - 1_700_000_123.45).abs() < 1e-3, "{f:?}");
        assert_eq!(from_stat("4242 (x) S 1", 100, 4096, 0), None);
    }

    #[test]
    fn boot_time_and_the_open_files_limit_are_read_from_their_files() {
        assert_eq!(
            boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(max_open_files(limits), Some(1024));
        assert_eq!(
            max_open_files(
                "Max open files            unlimited            unlimited            files"
            ),
            None
        );
    }

    #[test]
    fn this_process_reads_back_plausible_figures() {
        let f = read().expect("/proc/self on Linux");
        // qemu-user's emulated /proc/self/stat gives rss and vsize as 0
        // (measured under qemu-aarch64 7.2); a board's kernel does not.
        if !crate::os::process::under_qemu() {
            assert!(
                f.resident_bytes > 0 && f.virtual_bytes >= f.resident_bytes,
                "{f:?}"
            );
        }
        assert!(f.open_fds.is_some_and(|n| n >= 3), "{f:?}");
        let now = crate::event::envelope::wall_clock_ms().0 as f64 / 1000.0;
        assert!(f.start_time_secs <= now + 1.0 && f.start_time_secs > now - 86_400.0 * 365.0);
    }
}
