//! System sensors read from /proc, /sys and statvfs(2).
//!
//! Every part is optional: gateways differ wildly in what their kernel
//! exposes, so a missing or odd file costs only its own fields.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{excerpt, parse_finite, read_limited, SourceError, SourceState};
use crate::event::reading::{FieldValue, Fields};

/// /proc files are generated on read and small, but /proc/net/dev grows with
/// the number of interfaces; this only guards against a runaway read.
const PROC_READ_LIMIT: usize = 1 << 20;
/// sysfs attributes are at most one page.
const SYSFS_READ_LIMIT: usize = 4096;

/// Counters of the aggregate "cpu" line of /proc/stat, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CpuTimes {
    /// idle + iowait.
    pub(crate) idle: u64,
    /// user + nice + system + idle + iowait + irq + softirq + steal (guest
    /// time is already counted in user and nice).
    pub(crate) total: u64,
}

/// The two /proc/meminfo lines we report, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemInfo {
    pub(crate) total_bytes: Option<u64>,
    /// Absent before Linux 3.14.
    pub(crate) available_bytes: Option<u64>,
}

/// One interface line of /proc/net/dev.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NetDev {
    pub(crate) name: String,
    pub(crate) rx_bytes: u64,
    pub(crate) tx_bytes: u64,
}

pub(super) fn sample(state: &mut SourceState, spool_dir: &Path) -> Result<Fields, SourceError> {
    sample_at(Path::new("/"), state, spool_dir)
}

/// `root` stands in for `/` so tests can run against a fake tree.
pub(super) fn sample_at(
    root: &Path,
    state: &mut SourceState,
    spool_dir: &Path,
) -> Result<Fields, SourceError> {
    let proc_dir = root.join("proc");
    let mut out = Fields::new();
    let mut first_err: Option<SourceError> = None;

    if let Some([l1, l5, l15]) = read_parsed(
        &proc_dir.join("loadavg"),
        "expected three load averages",
        parse_loadavg,
        &mut first_err,
    ) {
        push_num(&mut out, "load1", l1);
        push_num(&mut out, "load5", l5);
        push_num(&mut out, "load15", l15);
    }

    if let Some(mem) = read_parsed(
        &proc_dir.join("meminfo"),
        "expected MemTotal or MemAvailable lines",
        parse_meminfo,
        &mut first_err,
    ) {
        if let Some(v) = mem.total_bytes {
            push_num(&mut out, "mem_total_bytes", v as f64);
        }
        if let Some(v) = mem.available_bytes {
            push_num(&mut out, "mem_available_bytes", v as f64);
        }
    }

    if let Some(now) = read_parsed(
        &proc_dir.join("stat"),
        "expected a \"cpu\" line with at least four counters",
        parse_proc_stat_cpu,
        &mut first_err,
    ) {
        if let Some(pct) = state.prev_cpu.and_then(|prev| cpu_util_pct(prev, now)) {
            push_num(&mut out, "cpu_util_pct", pct);
        }
        state.prev_cpu = Some(now);
    }

    if let Some(up) = read_parsed(
        &proc_dir.join("uptime"),
        "expected seconds since boot",
        parse_uptime,
        &mut first_err,
    ) {
        push_num(&mut out, "uptime_secs", up);
    }

    spool_fs_fields(spool_dir, &mut out, &mut first_err);

    if let Some(devs) = read_parsed(
        &proc_dir.join("net/dev"),
        "expected interface lines",
        |t| Some(parse_net_dev(t)),
        &mut first_err,
    ) {
        net_dev_fields(devs, &mut out);
    }

    thermal_fields(root, &mut out);
    hwmon_fields(root, &mut out);

    if out.is_empty() {
        return Err(first_err.unwrap_or_else(|| SourceError::Parse {
            what: format!("system sensors under {}", root.display()),
            detail: "no sensor yielded a value".to_owned(),
        }));
    }
    Ok(out)
}

/// Parses /proc/loadavg: the 1, 5 and 15 minute load averages.
pub(crate) fn parse_loadavg(text: &str) -> Option<[f64; 3]> {
    let mut it = text.split_whitespace().map(parse_finite);
    Some([it.next()??, it.next()??, it.next()??])
}

/// Parses /proc/meminfo; `None` if neither line is there.
pub(crate) fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let slot = match key.trim() {
            "MemTotal" => &mut total,
            "MemAvailable" => &mut available,
            _ => continue,
        };
        *slot = parse_meminfo_value(rest);
    }
    if total.is_none() && available.is_none() {
        return None;
    }
    Some(MemInfo {
        total_bytes: total,
        available_bytes: available,
    })
}

fn parse_meminfo_value(rest: &str) -> Option<u64> {
    let mut it = rest.split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match (it.next(), it.next()) {
        (None, None) => Some(n),
        (Some("kB"), None) => n.checked_mul(1024),
        _ => None,
    }
}

/// Parses the aggregate "cpu" line (the first one) of /proc/stat.
pub(crate) fn parse_proc_stat_cpu(text: &str) -> Option<CpuTimes> {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some("cpu"))?;
    // Only user..steal: guest and guest_nice are already inside user and nice.
    let vals = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()?;
    if vals.len() < 4 {
        return None;
    }
    let iowait = vals.get(4).copied().unwrap_or(0);
    let idle = vals.get(3)?.checked_add(iowait)?;
    let total = vals.iter().try_fold(0u64, |acc, v| acc.checked_add(*v))?;
    Some(CpuTimes { idle, total })
}

/// Busy share of CPU time between two readings, 0..=100. `None` when no time
/// passed or a counter went backwards (CPU hotplug, the kernel's non-monotonic
/// iowait), since any number would then be made up.
pub(crate) fn cpu_util_pct(prev: CpuTimes, now: CpuTimes) -> Option<f64> {
    let total = now.total.checked_sub(prev.total)?;
    let idle = now.idle.checked_sub(prev.idle)?;
    if total == 0 {
        return None;
    }
    let busy = total.saturating_sub(idle);
    Some((busy as f64 / total as f64 * 100.0).clamp(0.0, 100.0))
}

/// Parses /proc/uptime: seconds since boot (the first number).
pub(crate) fn parse_uptime(text: &str) -> Option<f64> {
    parse_finite(text.split_whitespace().next()?)
}

/// Parses /proc/net/dev into per-interface byte counters, `lo` included.
/// Malformed lines are skipped, so garbage gives an empty list.
pub(crate) fn parse_net_dev(text: &str) -> Vec<NetDev> {
    text.lines()
        .filter_map(|line| {
            // Old kernels glue the first counter to the colon ("eth0:1234").
            let (name, rest) = line.split_once(':')?;
            let name = name.trim();
            if name.is_empty() || name.contains(char::is_whitespace) || name.contains('|') {
                return None;
            }
            let mut nums = rest.split_whitespace();
            let rx_bytes = nums.next()?.parse().ok()?;
            let tx_bytes = nums.nth(7)?.parse().ok()?;
            Some(NetDev {
                name: name.to_owned(),
                rx_bytes,
                tx_bytes,
            })
        })
        .collect()
}

/// Lowercases and maps everything outside `[a-z0-9_]` to `_`, so kernel
/// names ("br-lan", "cpu-thermal") make valid field names.
pub(crate) fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Free and total bytes of the spool's filesystem; a failed statvfs(2) is
/// noted in `first_err`.
fn spool_fs_fields(spool_dir: &Path, out: &mut Fields, first_err: &mut Option<SourceError>) {
    match fs_space(spool_dir) {
        Ok((free, total)) => {
            push_num(out, "spool_fs_free_bytes", free as f64);
            push_num(out, "spool_fs_total_bytes", total as f64);
        }
        Err(source) => note(
            first_err,
            SourceError::Io {
                path: spool_dir.to_path_buf(),
                source,
            },
        ),
    }
}

/// Bytes received and sent by each interface but `lo`, named after it.
fn net_dev_fields(devs: Vec<NetDev>, out: &mut Fields) {
    // Two names can sanitize to the same field; the first one wins so
    // that field names stay unique within a sample.
    let mut seen = HashSet::new();
    for dev in devs.into_iter().filter(|d| d.name != "lo") {
        let iface = sanitize(&dev.name);
        if !seen.insert(iface.clone()) {
            log::debug!(
                "network interface {:?} clashes with another as {iface:?}; skipped",
                dev.name
            );
            continue;
        }
        push_num(out, &format!("net_{iface}_rx_bytes"), dev.rx_bytes as f64);
        push_num(out, &format!("net_{iface}_tx_bytes"), dev.tx_bytes as f64);
    }
}

fn thermal_fields(root: &Path, out: &mut Fields) {
    for (idx, zone) in indexed_entries(&root.join("sys/class/thermal"), "thermal_zone", "") {
        if let Some(c) = read_millidegrees(&zone.join("temp")) {
            push_num(out, &format!("thermal_{idx}_temp_c"), c);
        }
    }
}

fn hwmon_fields(root: &Path, out: &mut Fields) {
    for (idx, dir) in indexed_entries(&root.join("sys/class/hwmon"), "hwmon", "") {
        // Before Linux 3.x many drivers kept their attributes on the parent
        // device rather than on the hwmon node itself.
        let device = dir.join("device");
        let mut temps = indexed_entries(&dir, "temp", "_input");
        if temps.is_empty() {
            temps = indexed_entries(&device, "temp", "_input");
        }
        if temps.is_empty() {
            continue;
        }
        let name = read_hwmon_name(&dir)
            .or_else(|| read_hwmon_name(&device))
            .unwrap_or_else(|| "unknown".to_owned());
        for (n, input) in temps {
            if let Some(c) = read_millidegrees(&input) {
                push_num(out, &format!("hwmon_{idx}_{name}_temp{n}_c"), c);
            }
        }
    }
}

fn read_hwmon_name(dir: &Path) -> Option<String> {
    let text = read_text(&dir.join("name"), SYSFS_READ_LIMIT).ok()?;
    let name = sanitize(text.trim());
    (!name.is_empty()).then_some(name)
}

/// Entries of `dir` named `<prefix><N><suffix>`, as (N, path) sorted by N so field order is stable and
/// zone 10 comes after zone 2. An unreadable `dir` is just empty.
fn indexed_entries(dir: &Path, prefix: &str, suffix: &str) -> Vec<(u32, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(u32, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let file_name = e.file_name();
            let idx = file_name
                .to_str()?
                .strip_prefix(prefix)?
                .strip_suffix(suffix)?;
            Some((parse_index(idx)?, e.path()))
        })
        .collect();
    found.sort();
    found
}

fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// A sysfs temperature in millidegrees Celsius, as degrees. Sensors that
/// are absent or not ready answer EIO/ENODATA or garbage; those are skipped.
fn read_millidegrees(path: &Path) -> Option<f64> {
    let text = match read_text(path, SYSFS_READ_LIMIT) {
        Ok(t) => t,
        Err(e) => {
            log::debug!("skipping temperature: {e}");
            return None;
        }
    };
    let milli = parse_finite(text.trim());
    if milli.is_none() {
        log::debug!(
            "skipping temperature {}: expected millidegrees, got {:?}",
            path.display(),
            excerpt(text.trim(), 40)
        );
    }
    milli.map(|m| m / 1000.0)
}

fn read_text(path: &Path, limit: usize) -> Result<String, SourceError> {
    let io_err = |source| SourceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_err)?;
    let (bytes, _) = read_limited(file, limit).map_err(io_err)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Reads and parses one /proc file, remembering the first failure so that a
/// sample that yields nothing can say why.
fn read_parsed<T>(
    path: &Path,
    expected: &str,
    parse: impl Fn(&str) -> Option<T>,
    first_err: &mut Option<SourceError>,
) -> Option<T> {
    let text = match read_text(path, PROC_READ_LIMIT) {
        Ok(t) => t,
        Err(e) => {
            log::debug!("system source: {e}");
            note(first_err, e);
            return None;
        }
    };
    let parsed = parse(&text);
    if parsed.is_none() {
        let e = SourceError::Parse {
            what: path.display().to_string(),
            detail: format!("{expected}, got {:?}", excerpt(text.trim(), 80)),
        };
        log::debug!("system source: {e}");
        note(first_err, e);
    }
    parsed
}

fn note(first_err: &mut Option<SourceError>, e: SourceError) {
    if first_err.is_none() {
        *first_err = Some(e);
    }
}

fn push_num(out: &mut Fields, name: &str, v: f64) {
    out.push((name.to_owned(), FieldValue::Num(v)));
}

/// (free for unprivileged users, total) bytes of the filesystem holding `path`.
fn fs_space(path: &Path) -> io::Result<(u64, u64)> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c_path` is NUL-terminated and outlives the call; `st` is
    // writable storage of exactly the type statvfs(3) fills in.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled the struct (and it was zeroed
    // before, so every field holds a valid integer either way).
    let st = unsafe { st.assume_init() };
    // Field widths differ between 32- and 64-bit targets; widen all to u64.
    #[allow(clippy::unnecessary_cast)]
    let (frsize, bsize, bavail, blocks) = (
        st.f_frsize as u64,
        st.f_bsize as u64,
        st.f_bavail as u64,
        st.f_blocks as u64,
    );
    // Some old kernels and filesystems leave f_frsize at 0.
    let unit = if frsize != 0 { frsize } else { bsize };
    Ok((bavail.saturating_mul(unit), blocks.saturating_mul(unit)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOADAVG: &str = "0.52 0.58 0.59 2/345 12345\n";

    const MEMINFO: &str = "\
MemTotal:        1012348 kB
MemFree:          123456 kB
MemAvailable:     654321 kB
Buffers:           12345 kB
HugePages_Total:       0
";

    const STAT_1: &str = "\
cpu  100 0 50 800 50 0 0 0 0 0
cpu0 50 0 25 400 25 0 0 0 0 0
cpu1 50 0 25 400 25 0 0 0 0 0
intr 12345 0 0
ctxt 999
btime 1700000000
";

    // 100 more ticks: 30 busy (user 20, system 10), 70 idle (idle 60, iowait 10).
    const STAT_2: &str = "\
cpu  120 0 60 860 60 0 0 0 0 0
cpu0 60 0 30 430 30 0 0 0 0 0
cpu1 60 0 30 430 30 0 0 0 0 0
";

    const NET_DEV: &str = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:  123456     100    0    0    0     0          0         0   123456     100    0    0    0     0       0          0
  eth0: 9876543   54321    0    0    0     0          0        12  1234567   4321    0    0    0     0       0          0
br-lan:    1000      10    0    0    0     0          0         0     2000      20    0    0    0     0       0          0
";

    #[test]
    fn loadavg_parses_and_rejects_garbage() {
        assert_eq!(parse_loadavg(LOADAVG), Some([0.52, 0.58, 0.59]));
        assert_eq!(parse_loadavg("1 2 3"), Some([1.0, 2.0, 3.0]));
        assert_eq!(parse_loadavg(""), None);
        assert_eq!(parse_loadavg("0.5 0.6"), None);
        assert_eq!(parse_loadavg("0.5 x 0.7 1/2 3"), None);
        assert_eq!(parse_loadavg("nan 1 2"), None);
        assert_eq!(parse_loadavg("\u{0}\u{ff}é"), None);
    }

    #[test]
    fn meminfo_parses_kb_to_bytes() {
        assert_eq!(
            parse_meminfo(MEMINFO),
            Some(MemInfo {
                total_bytes: Some(1012348 * 1024),
                available_bytes: Some(654321 * 1024),
            })
        );
    }

    #[test]
    fn meminfo_without_available_on_old_kernels() {
        let m = parse_meminfo("MemTotal: 2048 kB\nMemFree: 1024 kB\n").unwrap();
        assert_eq!(m.total_bytes, Some(2048 * 1024));
        assert_eq!(m.available_bytes, None);
    }

    #[test]
    fn meminfo_malformed() {
        assert_eq!(parse_meminfo(""), None);
        assert_eq!(parse_meminfo("garbage\n:::\n"), None);
        // Lines present but unreadable count as nothing found.
        assert_eq!(
            parse_meminfo("MemTotal: lots kB\nMemAvailable: 10 MB\n"),
            None
        );
        // Overflowing kB must not panic.
        assert_eq!(parse_meminfo("MemTotal: 18446744073709551615 kB\n"), None);
        let m = parse_meminfo("MemTotal: 18446744073709551615 kB\nMemAvailable: 1 kB\n");
        assert_eq!(
            m,
            Some(MemInfo {
                total_bytes: None,
                available_bytes: Some(1024)
            })
        );
    }

    #[test]
    fn proc_stat_cpu_line() {
        assert_eq!(
            parse_proc_stat_cpu(STAT_1),
            Some(CpuTimes {
                idle: 850,
                total: 1000
            })
        );
        // Guest columns must not be counted twice.
        assert_eq!(
            parse_proc_stat_cpu("cpu 10 0 0 90 0 0 0 0 10 0\n"),
            Some(CpuTimes {
                idle: 90,
                total: 100
            })
        );
        // Old kernels have only four columns.
        assert_eq!(
            parse_proc_stat_cpu("cpu 1 2 3 4\n"),
            Some(CpuTimes { idle: 4, total: 10 })
        );
    }

    #[test]
    fn proc_stat_malformed() {
        assert_eq!(parse_proc_stat_cpu(""), None);
        assert_eq!(parse_proc_stat_cpu("cpu0 1 2 3 4\n"), None);
        assert_eq!(parse_proc_stat_cpu("cpu 1 2 3\n"), None);
        assert_eq!(parse_proc_stat_cpu("cpu 1 two 3 4\n"), None);
        assert_eq!(parse_proc_stat_cpu("cpu -1 2 3 4\n"), None);
        assert_eq!(
            parse_proc_stat_cpu("cpu 18446744073709551615 1 1 1\n"),
            None
        );
    }

    #[test]
    fn cpu_util_from_delta() {
        let a = parse_proc_stat_cpu(STAT_1).unwrap();
        let b = parse_proc_stat_cpu(STAT_2).unwrap();
        let pct = cpu_util_pct(a, b).unwrap();
        assert!((pct - 30.0).abs() < 1e-9, "{pct}");
        assert_eq!(cpu_util_pct(a, a), None);
        assert_eq!(cpu_util_pct(b, a), None);
        let idle_back = CpuTimes {
            idle: a.idle - 1,
            total: a.total + 10,
        };
        assert_eq!(cpu_util_pct(a, idle_back), None);
    }

    #[test]
    fn uptime() {
        assert_eq!(parse_uptime("12345.67 54321.00\n"), Some(12345.67));
        assert_eq!(parse_uptime(""), None);
        assert_eq!(parse_uptime("abc 1"), None);
    }

    #[test]
    fn net_dev_lines() {
        let devs = parse_net_dev(NET_DEV);
        assert_eq!(
            devs,
            vec![
                NetDev {
                    name: "lo".into(),
                    rx_bytes: 123456,
                    tx_bytes: 123456
                },
                NetDev {
                    name: "eth0".into(),
                    rx_bytes: 9876543,
                    tx_bytes: 1234567
                },
                NetDev {
                    name: "br-lan".into(),
                    rx_bytes: 1000,
                    tx_bytes: 2000
                },
            ]
        );
    }

    #[test]
    fn net_dev_old_format_and_garbage() {
        let devs = parse_net_dev("  eth0:12 1 0 0 0 0 0 0 34 1 0 0 0 0 0 0\n");
        assert_eq!(
            devs,
            vec![NetDev {
                name: "eth0".into(),
                rx_bytes: 12,
                tx_bytes: 34
            }]
        );
        assert!(parse_net_dev("").is_empty());
        assert!(parse_net_dev("eth0: 1 2 3\n").is_empty());
        assert!(parse_net_dev(": 1 2 3 4 5 6 7 8 9 10\n").is_empty());
        assert!(parse_net_dev("eth0: x 0 0 0 0 0 0 0 1\n").is_empty());
        assert!(parse_net_dev("\u{0}:\u{ff}").is_empty());
    }

    #[test]
    fn sanitize_names() {
        assert_eq!(sanitize("eth0"), "eth0");
        assert_eq!(sanitize("br-lan"), "br_lan");
        assert_eq!(sanitize("wlP1p1s0.100"), "wlp1p1s0_100");
        assert_eq!(sanitize("cpu_thermal"), "cpu_thermal");
        assert_eq!(sanitize("é"), "_");
    }

    #[test]
    fn parse_index_digits_only() {
        assert_eq!(parse_index("0"), Some(0));
        assert_eq!(parse_index("12"), Some(12));
        assert_eq!(parse_index(""), None);
        assert_eq!(parse_index("+1"), None);
        assert_eq!(parse_index("1a"), None);
        assert_eq!(parse_index("99999999999"), None);
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    fn names(fields: &Fields) -> Vec<&str> {
        fields.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn num(fields: &Fields, name: &str) -> f64 {
        match fields.iter().find(|(n, _)| n == name) {
            Some((_, FieldValue::Num(v))) => *v,
            other => panic!("{name}: {other:?}"),
        }
    }

    fn full_tree(root: &Path) {
        write(root, "proc/loadavg", LOADAVG);
        write(root, "proc/meminfo", MEMINFO);
        write(root, "proc/stat", STAT_1);
        write(root, "proc/uptime", "100.5 150.25\n");
        write(root, "proc/net/dev", NET_DEV);
        write(root, "sys/class/thermal/thermal_zone0/temp", "45000\n");
        write(root, "sys/class/thermal/thermal_zone10/temp", "-5500\n");
        write(root, "sys/class/thermal/thermal_zone2/temp", "51234\n");
        // Not ready: skipped.
        write(root, "sys/class/thermal/thermal_zone3/temp", "\n");
        // Not a zone.
        write(root, "sys/class/thermal/cooling_device0/cur_state", "0\n");
        write(root, "sys/class/hwmon/hwmon0/name", "cpu-thermal\n");
        write(root, "sys/class/hwmon/hwmon0/temp1_input", "47000\n");
        write(root, "sys/class/hwmon/hwmon0/temp2_input", "48500\n");
        write(root, "sys/class/hwmon/hwmon0/temp2_label", "Core 1\n");
        write(root, "sys/class/hwmon/hwmon0/temp3_input", "garbage\n");
        write(root, "sys/class/hwmon/hwmon0/temp1_max", "90000\n");
        // Old layout: attributes on the parent device.
        write(root, "sys/class/hwmon/hwmon1/device/name", "lm75\n");
        write(root, "sys/class/hwmon/hwmon1/device/temp1_input", "30000\n");
        // No name file.
        write(root, "sys/class/hwmon/hwmon2/temp1_input", "20000\n");
        // No temperatures at all.
        write(root, "sys/class/hwmon/hwmon3/name", "fan\n");
        write(root, "sys/class/hwmon/hwmon3/fan1_input", "1200\n");
    }

    #[test]
    fn fake_tree_full() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        full_tree(&root);
        let mut state = SourceState::default();
        let fields = sample_at(&root, &mut state, dir.path()).unwrap();
        assert_eq!(
            names(&fields),
            vec![
                "load1",
                "load5",
                "load15",
                "mem_total_bytes",
                "mem_available_bytes",
                "uptime_secs",
                "spool_fs_free_bytes",
                "spool_fs_total_bytes",
                "net_eth0_rx_bytes",
                "net_eth0_tx_bytes",
                "net_br_lan_rx_bytes",
                "net_br_lan_tx_bytes",
                "thermal_0_temp_c",
                "thermal_2_temp_c",
                "thermal_10_temp_c",
                "hwmon_0_cpu_thermal_temp1_c",
                "hwmon_0_cpu_thermal_temp2_c",
                "hwmon_1_lm75_temp1_c",
                "hwmon_2_unknown_temp1_c",
            ]
        );
        assert_eq!(num(&fields, "load5"), 0.58);
        assert_eq!(num(&fields, "mem_available_bytes"), 654321.0 * 1024.0);
        assert_eq!(num(&fields, "uptime_secs"), 100.5);
        assert_eq!(num(&fields, "net_eth0_tx_bytes"), 1234567.0);
        assert_eq!(num(&fields, "thermal_2_temp_c"), 51.234);
        assert_eq!(num(&fields, "thermal_10_temp_c"), -5.5);
        assert_eq!(num(&fields, "hwmon_0_cpu_thermal_temp2_c"), 48.5);
        assert!(num(&fields, "spool_fs_total_bytes") >= num(&fields, "spool_fs_free_bytes"));
        assert!(num(&fields, "spool_fs_total_bytes") > 0.0);

        // Second sample: CPU utilisation from the delta, placed after memory.
        write(&root, "proc/stat", STAT_2);
        let fields = sample_at(&root, &mut state, dir.path()).unwrap();
        assert_eq!(&names(&fields)[5..7], &["cpu_util_pct", "uptime_secs"]);
        assert!((num(&fields, "cpu_util_pct") - 30.0).abs() < 1e-9);
    }

    #[test]
    fn fake_tree_partial() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        write(&root, "proc/uptime", "7.0 1.0\n");
        write(&root, "proc/loadavg", "garbage\n");
        let mut state = SourceState::default();
        let missing_spool = dir.path().join("no-such-spool");
        let fields = sample_at(&root, &mut state, &missing_spool).unwrap();
        assert_eq!(fields, vec![("uptime_secs".into(), FieldValue::Num(7.0))]);
    }

    #[test]
    fn duplicate_sanitized_interfaces_keep_first() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        write(
            &root,
            "proc/net/dev",
            "a-b: 1 0 0 0 0 0 0 0 2 0\na_b: 3 0 0 0 0 0 0 0 4 0\n",
        );
        let mut state = SourceState::default();
        let fields = sample_at(&root, &mut state, &dir.path().join("none")).unwrap();
        assert_eq!(
            fields,
            vec![
                ("net_a_b_rx_bytes".into(), FieldValue::Num(1.0)),
                ("net_a_b_tx_bytes".into(), FieldValue::Num(2.0)),
            ]
        );
    }

    #[test]
    fn nothing_readable_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("empty-root");
        let mut state = SourceState::default();
        let err = sample_at(&root, &mut state, &dir.path().join("none")).unwrap_err();
        match &err {
            SourceError::Io { path, .. } => assert!(path.ends_with("proc/loadavg"), "{err}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn everything_garbage_is_a_parse_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        for f in ["loadavg", "meminfo", "stat", "uptime", "net/dev"] {
            write(&root, &format!("proc/{f}"), "\u{0}garbage\u{ff}\n");
        }
        let mut state = SourceState::default();
        let err = sample_at(&root, &mut state, &dir.path().join("none")).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, SourceError::Parse { .. }), "{msg}");
        assert!(msg.contains("loadavg") && msg.contains("garbage"), "{msg}");
    }

    #[test]
    fn fs_space_of_nul_path_is_an_error() {
        use std::os::unix::ffi::OsStrExt;
        let p = Path::new(std::ffi::OsStr::from_bytes(b"/tmp/a\0b"));
        assert!(fs_space(p).is_err());
    }

    #[test]
    fn real_system_yields_fields() {
        let mut state = SourceState::default();
        let fields = sample(&mut state, Path::new("/")).unwrap();
        assert!(fields.iter().any(|(n, _)| n == "uptime_secs"), "{fields:?}");
        let fields = sample(&mut state, Path::new("/")).unwrap();
        let names = names(&fields);
        let unique: HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        for (n, v) in &fields {
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{n}"
            );
            if let FieldValue::Num(x) = v {
                assert!(x.is_finite(), "{n}");
            }
        }
    }
}
