//! Sources of readings: the system sensors, a number read from a file, and
//! the output of a program.
//!
//! This module owns taking one sample of one configured source and turning it
//! into named fields. It does not schedule samples, store them or decide what
//! to do with failures; the caller does.
//!
//! One rule holds throughout: a failed reading is an error value
//! ([`SourceError`]), never a panic, and never stops the agent. Missing
//! sensors, unreadable files, garbage text, hung or failing programs all come
//! back as `Err`, which the caller counts, logs rate-limited, and then carries
//! on with the next sample.

pub mod bridge;
mod exec;
mod file;
pub mod replay;
pub mod sampler;
mod system;
pub mod tail;

use crate::event::reading::Fields;
use crate::event::stream::StreamSettings;
use crate::os::process::Credentials;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What kind of source, with its validated settings (built by the config module).
#[derive(Debug, Clone, PartialEq)]
pub enum SourceKind {
    /// A recorded CSV trace played back as readings ([`replay::Replay`]);
    /// stateful, so the agent drives it with `Replay::due`, not [`sample`].
    Replay(replay::ReplaySpec),
    /// /proc and /sys system sensors: load, memory, CPU utilisation, uptime,
    /// free space of the spool's filesystem, per-interface network byte
    /// counters and temperatures. Each part is optional; see [`sample`].
    System,
    /// A number read from a file (sysfs/IIO attribute, 1-Wire slave file):
    /// value = raw * scale + offset, stored under `field`.
    ///
    /// The file must hold a single number (at most 4 KiB, surrounding
    /// whitespace ignored).
    File {
        /// File to read on every sample.
        path: PathBuf,
        /// Multiplier applied to the raw number (e.g. 0.001 for millidegrees).
        scale: f64,
        /// Added after scaling.
        offset: f64,
        /// Field name the result is stored under.
        field: String,
    },
    /// A program run with fixed arguments (no shell), killed after `timeout`;
    /// stdout parsed as a number (stored under `field`) or as a flat JSON
    /// object (each key a field; numbers, strings, bools; nested
    /// objects/arrays/null are skipped and counted as an error only if NO
    /// field is usable). Output longer than `max_output_bytes` is rejected as a
    /// whole (a parse error), never parsed from its first bytes.
    Exec {
        /// Program to run: an absolute path (the config refuses anything else).
        program: PathBuf,
        /// Arguments, passed as they are (no shell, no expansion).
        args: Vec<String>,
        /// Wall-clock limit from start until its stdout is closed.
        timeout: Duration,
        /// Field name a bare-number output is stored under.
        field: String,
        /// Bytes of stdout kept; the rest is read and discarded.
        max_output_bytes: usize,
        /// `env`: variables the program gets besides `PATH` and `LANG` (a
        /// name given here replaces that default); nothing else of the
        /// agent's environment reaches it ([`crate::os::process::child_env`]).
        env: BTreeMap<String, String>,
        /// `user` and `group`, resolved to ids when the config was
        /// validated; `None`: the program runs as the agent's user.
        credentials: Option<Credentials>,
    },
    /// A durable bridge from a local MQTT broker ([`bridge`]): messages on
    /// its topics become readings, each acknowledged to the local broker
    /// only after its commit. Driven by [`bridge::run`], not [`sample`].
    Mqtt(bridge::BridgeSpec),
}

/// One configured source.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceSpec {
    /// Name of the source, unique in the configuration.
    pub name: String,
    /// Time between two samples of this source.
    pub interval: Duration,
    /// What to read and how.
    pub kind: SourceKind,
    /// What the stream of its readings sets: durability, delivery
    /// priority, live-first, batching.
    pub settings: StreamSettings,
}

/// Why a sample failed.
///
/// Every variant is handled the same way by the caller: count it, log it
/// rate-limited, and carry on; the next sample is taken at the next interval.
/// Each variant's doc says what it usually means for the operator.
#[derive(Debug)]
pub enum SourceError {
    /// A file could not be opened or read (missing sensor, permissions, a
    /// sysfs attribute answering EIO), or a program's stdout could not be
    /// read. Often transient: a sensor that comes back clears it.
    Io {
        /// The file, or the program whose output failed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Text was read but is not what was expected: usually a misconfigured
    /// path or a program printing the wrong thing; it persists until the
    /// configuration or the program is fixed.
    Parse {
        /// What was being parsed, usually a path or program, e.g. `/sys/.../temp`.
        what: String,
        /// What was wrong, with the offending text truncated, e.g.
        /// `expected a number, got "abc"`.
        detail: String,
    },
    /// The program did not finish (exit and close its stdout) in time. It and
    /// its process group were killed and it was reaped. If it persists, the
    /// timeout is too short or the program hangs.
    Timeout {
        /// The program that was run.
        program: PathBuf,
        /// The configured timeout.
        after: Duration,
    },
    /// The program exited unsuccessfully (non-zero status or a signal); its
    /// stdout was ignored.
    Exit {
        /// The program that was run.
        program: PathBuf,
        /// How it ended, e.g. `exit status: 1` or `signal: 9 (SIGKILL)`.
        status: String,
        /// Start of its stderr on one line, about 200 bytes at most.
        stderr: String,
    },
    /// The program could not be started (not found, not executable) or
    /// waited for. Usually a configuration error that persists until fixed.
    Spawn {
        /// The program that was to be run.
        program: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceError::Io { path, source } => {
                write!(f, "cannot read {}: {source}", path.display())
            }
            SourceError::Parse { what, detail } => write!(f, "cannot parse {what}: {detail}"),
            SourceError::Timeout { program, after } => write!(
                f,
                "{} did not finish within {after:?} and was killed",
                program.display()
            ),
            SourceError::Exit {
                program,
                status,
                stderr,
            } => {
                write!(f, "{} failed ({status})", program.display())?;
                if stderr.is_empty() {
                    Ok(())
                } else {
                    write!(f, ": {stderr}")
                }
            }
            SourceError::Spawn { program, source } => {
                write!(f, "cannot run {}: {source}", program.display())
            }
        }
    }
}

// The cause is already part of the one-line Display message, so `source()` is
// left empty to keep error reporters from printing it twice.
impl std::error::Error for SourceError {}

/// Mutable per-source state kept between samples (e.g. the previous
/// /proc/stat CPU counters for utilisation).
///
/// Start with `SourceState::default()` and pass the same value to every
/// [`sample`] of one source; never share one between sources.
#[derive(Debug, Default)]
pub struct SourceState {
    prev_cpu: Option<system::CpuTimes>,
}

/// Take one sample of `spec`. `spool_dir` is the directory holding the spool
/// (the system source reports its filesystem's free space). Never panics on
/// bad input.
///
/// - [`SourceKind::System`]: every part that can be read is returned; a board
///   lacking a file yields no such field. `cpu_util_pct` appears from the
///   second sample on.
/// - [`SourceKind::File`]: one field, `field`.
/// - [`SourceKind::Exec`]: `field` for a bare number, or the JSON object's
///   usable keys. Blocks for at most about `timeout` (plus up to ~2 s more
///   only if a killed program refuses to die).
///
/// # Errors
///
/// - System: only if no field at all could be produced; the error is the
///   first failure met (`Io` or `Parse`).
/// - File: `Io` if it can't be opened or read; `Parse` if it is empty,
///   longer than 4 KiB, not a finite number, or the scaled value overflows.
/// - Exec: `Spawn`, `Timeout`, `Exit`; `Parse` for unusable stdout; `Io` if
///   stdout could not be read.
pub fn sample(
    spec: &SourceSpec,
    state: &mut SourceState,
    spool_dir: &Path,
) -> Result<Fields, SourceError> {
    match &spec.kind {
        SourceKind::System => system::sample(state, spool_dir),
        SourceKind::File {
            path,
            scale,
            offset,
            field,
        } => file::read(path, *scale, *offset, field),
        SourceKind::Exec {
            program,
            args,
            timeout,
            field,
            max_output_bytes,
            env,
            credentials,
        } => {
            let confinement = exec::confinement(env, *credentials);
            exec::run(
                program,
                args,
                *timeout,
                field,
                *max_output_bytes,
                &confinement,
            )
        }
        SourceKind::Replay(r) => Err(SourceError::Parse {
            what: r.path.display().to_string(),
            detail: "a replay source is played with replay::Replay, not sampled".into(),
        }),
        SourceKind::Mqtt(b) => Err(SourceError::Parse {
            what: b.url(),
            detail: "an mqtt source takes what local programs publish; it is not sampled".into(),
        }),
    }
}

/// Problems `check-config` finds in the files the sources read, each as
/// `(key, message)` with the key as in the config (`sources[2].path`):
/// for now, a replay file that cannot be opened, read or parsed, or whose
/// header lacks a configured column ([`replay::check`]). Other kinds are
/// only tried by [`sample_once`] (`edgespool test`), as a sensor may
/// appear after boot.
pub fn check_files(sources: &[SourceSpec]) -> Vec<(String, String)> {
    sources
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match &s.kind {
            SourceKind::Replay(r) => replay::check(r)
                .err()
                .map(|(key, msg)| (format!("sources[{i}].{key}"), msg)),
            _ => None,
        })
        .collect()
}

/// One reading of `spec` taken now, as `edgespool test` shows it:
/// [`sample`] for system, file and exec sources (a system source's
/// `cpu_util_pct` needs two samples and is absent); for a replay, its
/// first usable row (read from the start, nothing stored).
///
/// # Errors
///
/// As [`sample`]; for a replay, as [`replay::Replay::open`] and
/// [`replay::Replay::due`], or `Parse` if the file gives no usable row
/// within its first 100,000 lines. `Ok(None)`: a followed replay
/// (`follow = true`) whose file holds no row yet (only its header, or
/// nothing): the agent waits for rows there, so that is no failure.
pub fn sample_once(spec: &SourceSpec, spool_dir: &Path) -> Result<Option<Fields>, SourceError> {
    let SourceKind::Replay(r) = &spec.kind else {
        return sample(spec, &mut SourceState::default(), spool_dir).map(Some);
    };
    let mut first = r.clone();
    first.speed = 0.0;
    first.repeat = false;
    // One row from the start: a followed file is read as it stands.
    first.follow = false;
    first.max_rows_per_call = 1;
    let mut replay = replay::Replay::open(first)?;
    for _ in 0..10 {
        if let Some(fields) = replay.due(std::time::Instant::now())?.pop() {
            return Ok(Some(fields));
        }
        if replay.stats().finished {
            break;
        }
    }
    if r.follow && replay.stats().rows_read == 0 {
        return Ok(None);
    }
    Err(SourceError::Parse {
        what: r.path.display().to_string(),
        detail: format!(
            "no usable row in its first {} lines",
            replay.stats().rows_read
        ),
    })
}

/// Parses a trimmed decimal number; NaN and infinities are rejected because
/// no sensor means them and they would poison downstream aggregates.
fn parse_finite(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Cuts `text` to at most `max_bytes` (on a char boundary) so error messages
/// stay short however much garbage a sensor returns.
fn excerpt(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_owned();
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Reads at most `limit` bytes; the flag says whether more were there.
/// Reading one byte past the limit tells "exactly full" from "too long".
fn read_limited<R: Read>(reader: R, limit: usize) -> io::Result<(Vec<u8>, bool)> {
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    let mut buf = Vec::new();
    reader.take(cap).read_to_end(&mut buf)?;
    let truncated = buf.len() > limit;
    buf.truncate(limit);
    Ok((buf, truncated))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::reading::FieldValue;

    #[test]
    fn parse_finite_accepts_plain_numbers_only() {
        assert_eq!(parse_finite("42"), Some(42.0));
        assert_eq!(parse_finite("-3.5"), Some(-3.5));
        assert_eq!(parse_finite("+7"), Some(7.0));
        assert_eq!(parse_finite("0.25"), Some(0.25));
        for bad in [
            "", " ", "abc", "NaN", "nan", "inf", "-inf", "infinity", "1,5", "0x10",
        ] {
            assert_eq!(parse_finite(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn excerpt_cuts_on_char_boundary() {
        assert_eq!(excerpt("short", 10), "short");
        assert_eq!(excerpt("abcdef", 3), "abc…");
        // "é" is two bytes; cutting inside it must back off, not panic.
        assert_eq!(excerpt("aéb", 2), "a…");
        assert_eq!(excerpt("ééé", 0), "…");
    }

    #[test]
    fn read_limited_reports_truncation() {
        let (b, t) = read_limited(&b"12345"[..], 5).unwrap();
        assert_eq!((b.as_slice(), t), (&b"12345"[..], false));
        let (b, t) = read_limited(&b"123456"[..], 5).unwrap();
        assert_eq!((b.as_slice(), t), (&b"12345"[..], true));
        let (b, t) = read_limited(&b""[..], 0).unwrap();
        assert!(b.is_empty() && !t);
    }

    #[test]
    fn display_names_path_or_program() {
        let e = SourceError::Io {
            path: "/sys/x/temp".into(),
            source: io::Error::from(io::ErrorKind::NotFound),
        };
        let s = e.to_string();
        assert!(s.starts_with("cannot read /sys/x/temp: "), "{s}");

        let e = SourceError::Parse {
            what: "/sys/x/temp".into(),
            detail: "expected a number, got \"abc\"".into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot parse /sys/x/temp: expected a number, got \"abc\""
        );

        let e = SourceError::Timeout {
            program: "/usr/bin/probe".into(),
            after: Duration::from_millis(200),
        };
        assert_eq!(
            e.to_string(),
            "/usr/bin/probe did not finish within 200ms and was killed"
        );

        let e = SourceError::Exit {
            program: "/usr/bin/probe".into(),
            status: "exit status: 3".into(),
            stderr: "no sensor".into(),
        };
        assert_eq!(
            e.to_string(),
            "/usr/bin/probe failed (exit status: 3): no sensor"
        );
        let e = SourceError::Exit {
            program: "/usr/bin/probe".into(),
            status: "exit status: 3".into(),
            stderr: String::new(),
        };
        assert_eq!(e.to_string(), "/usr/bin/probe failed (exit status: 3)");

        let e = SourceError::Spawn {
            program: "/nope".into(),
            source: io::Error::from(io::ErrorKind::NotFound),
        };
        assert!(e.to_string().starts_with("cannot run /nope: "));
    }

    #[test]
    fn sample_dispatches_file_kind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in_voltage0_raw");
        std::fs::write(&path, "1000\n").unwrap();
        let spec = SourceSpec {
            name: "adc".into(),
            interval: Duration::from_secs(1),
            settings: StreamSettings::plain(),
            kind: SourceKind::File {
                path,
                scale: 0.5,
                offset: 1.0,
                field: "voltage_mv".into(),
            },
        };
        let mut state = SourceState::default();
        let fields = sample(&spec, &mut state, dir.path()).unwrap();
        assert_eq!(
            fields,
            vec![("voltage_mv".to_owned(), FieldValue::Num(501.0))]
        );
    }

    #[test]
    fn sample_dispatches_exec_kind() {
        let spec = SourceSpec {
            name: "echo".into(),
            interval: Duration::from_secs(1),
            settings: StreamSettings::plain(),
            kind: SourceKind::Exec {
                program: "/bin/echo".into(),
                args: vec!["17.5".into()],
                timeout: Duration::from_secs(5),
                field: "level_pct".into(),
                max_output_bytes: 1024,
                env: BTreeMap::new(),
                credentials: None,
            },
        };
        let mut state = SourceState::default();
        let fields = sample(&spec, &mut state, Path::new("/")).unwrap();
        assert_eq!(
            fields,
            vec![("level_pct".to_owned(), FieldValue::Num(17.5))]
        );
    }

    #[test]
    fn sample_dispatches_system_kind() {
        let spec = SourceSpec {
            name: "sys".into(),
            interval: Duration::from_secs(1),
            settings: StreamSettings::plain(),
            kind: SourceKind::System,
        };
        let mut state = SourceState::default();
        let dir = tempfile::tempdir().unwrap();
        let fields = sample(&spec, &mut state, dir.path()).unwrap();
        assert!(fields.iter().any(|(n, _)| n == "spool_fs_free_bytes"));
    }

    #[test]
    fn field_value_round_trips_through_json() {
        let v = vec![
            FieldValue::Num(1.5),
            FieldValue::Text("ok".into()),
            FieldValue::Bool(true),
        ];
        let s = serde_json::to_string(&v).unwrap();
        let back: Vec<FieldValue> = serde_json::from_str(&s).unwrap();
        assert_eq!(back, v);
    }
}
