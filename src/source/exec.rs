//! A program run with fixed arguments, its stdout parsed as a number or a
//! flat JSON object.
//!
//! Running it is [`crate::os::process`]'s job: no shell, so configured arguments
//! can't inject commands; its own kill scope, so at the timeout or once it
//! is done every helper it started dies with it (one that called `setsid`
//! too); both pipes drained within limits; confined like a command handler:
//! only `PATH`, `LANG` and the source's `env`, no descriptor above 2, and
//! the source's `user`/`group` when given. This file adds what an exec
//! source means by success: a zero exit whose stdout, complete and within
//! `max_output_bytes`, parses as a reading.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::{excerpt, parse_finite, SourceError};
use crate::event::reading::{FieldValue, Fields};
use crate::os::process::{Confinement, Credentials, RunError, Running};

/// Raw stderr kept; more than shown so trimming leaves enough.
const STDERR_KEEP: usize = 512;
/// Stderr shown in an `Exit` error.
const STDERR_SHOWN: usize = 200;
/// Bad stdout shown in a `Parse` error.
const STDOUT_SHOWN: usize = 80;

/// How an exec source's program is confined: [`crate::os::process::child_env`]
/// of its `env`, its user if given, started in `/` (as handlers are, and as
/// the packaged service starts the agent: never in a directory the agent
/// happened to be started from); the agent's limits.
pub(super) fn confinement(
    env: &BTreeMap<String, String>,
    credentials: Option<Credentials>,
) -> Confinement {
    Confinement {
        env: crate::os::process::child_env(env),
        credentials,
        cwd: Some(std::path::PathBuf::from("/")),
        ..Confinement::base()
    }
}

/// Runs `program` with `args` as `confinement` says and parses its stdout
/// as a reading (see the module doc).
pub(super) fn run(
    program: &Path,
    args: &[String],
    timeout: Duration,
    field: &str,
    max_output_bytes: usize,
    confinement: &Confinement,
) -> Result<Fields, SourceError> {
    let spawn_err = |source| SourceError::Spawn {
        program: program.to_path_buf(),
        source,
    };
    let timed_out = || SourceError::Timeout {
        program: program.to_path_buf(),
        after: timeout,
    };

    // Failing to wait for it counts as failing to run it.
    let not_run = |e| match e {
        RunError::Timeout { .. } => timed_out(),
        RunError::Spawn { source, .. } | RunError::Io { source, .. } => spawn_err(source),
    };

    let mut running = Running::start(
        program,
        args,
        timeout,
        (max_output_bytes, STDERR_KEEP),
        confinement,
    )
    .map_err(not_run)?;
    let status = running.wait().map_err(not_run)?;

    // A failed program's stdout is ignored; its stderr explains the failure,
    // and is left out if it cannot be had by the deadline.
    if !status.success() {
        let stderr = match running.stderr() {
            Ok(c) => one_line(&c.bytes, STDERR_SHOWN),
            Err(_) => String::new(),
        };
        return Err(SourceError::Exit {
            program: program.to_path_buf(),
            status: status.to_string(),
            stderr,
        });
    }

    // The output is complete only once every writer has closed stdout, which
    // a helper the program left behind may never do.
    let captured = match running.stdout() {
        Ok(c) => c,
        Err(RunError::Timeout { .. }) => return Err(timed_out()),
        Err(RunError::Io { source, .. }) => {
            return Err(SourceError::Io {
                path: program.to_path_buf(),
                source,
            })
        }
        Err(RunError::Spawn { source, .. }) => return Err(spawn_err(source)),
    };

    // Output cut short is never parsed: "12345678" cut to "1234" would be a
    // plausible, wrong reading.
    if captured.truncated {
        return Err(SourceError::Parse {
            what: format!("output of {}", program.display()),
            detail: format!(
                "more than max_output_bytes ({max_output_bytes}) on stdout; reading rejected"
            ),
        });
    }
    let text = String::from_utf8_lossy(&captured.bytes);
    match parse_stdout(&text, field) {
        Ok((fields, skipped)) => {
            if skipped > 0 {
                log::debug!(
                    "{}: skipped {skipped} JSON field(s) that are not a number, string or bool",
                    program.display()
                );
            }
            Ok(fields)
        }
        Err(detail) => Err(SourceError::Parse {
            what: format!("output of {}", program.display()),
            detail,
        }),
    }
}

/// Parses trimmed stdout: a bare number becomes `field`, a JSON object
/// becomes one field per usable key. Returns the fields and how many keys
/// were skipped, or a one-line error detail.
fn parse_stdout(text: &str, field: &str) -> Result<(Fields, usize), String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("no output, expected a number or a flat JSON object".to_owned());
    }
    if let Some(v) = parse_finite(t) {
        return Ok((vec![(field.to_owned(), FieldValue::Num(v))], 0));
    }
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(t) else {
        return Err(format!(
            "expected a number or a flat JSON object, got {:?}",
            excerpt(t, STDOUT_SHOWN)
        ));
    };
    let mut fields = Fields::new();
    let mut skipped = 0;
    for (key, value) in map {
        let value = match value {
            serde_json::Value::Number(n) => {
                n.as_f64().filter(|v| v.is_finite()).map(FieldValue::Num)
            }
            serde_json::Value::String(s) => Some(FieldValue::Text(s)),
            serde_json::Value::Bool(b) => Some(FieldValue::Bool(b)),
            serde_json::Value::Null
            | serde_json::Value::Array(_)
            | serde_json::Value::Object(_) => None,
        };
        // A nameless field could not be told apart from another downstream.
        match value {
            Some(v) if !key.is_empty() => fields.push((key, v)),
            _ => skipped += 1,
        }
    }
    if fields.is_empty() {
        return Err(format!(
            "JSON object has no number, string or bool field ({skipped} skipped)"
        ));
    }
    Ok((fields, skipped))
}

/// Stderr as one short line for a log message.
fn one_line(bytes: &[u8], max_bytes: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let flat: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    excerpt(&flat, max_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::thread;
    use std::time::Instant;

    /// [`super::run`], confined as [`Confinement::base`] says.
    fn run(
        program: &Path,
        args: &[String],
        timeout: Duration,
        field: &str,
        max: usize,
    ) -> Result<Fields, SourceError> {
        super::run(program, args, timeout, field, max, &Confinement::base())
    }

    fn sh(script: &str, timeout: Duration, max: usize) -> Result<Fields, SourceError> {
        run(
            Path::new("/bin/sh"),
            &["-c".to_owned(), script.to_owned()],
            timeout,
            "value",
            max,
        )
    }

    fn sorted(mut f: Fields) -> Fields {
        f.sort_by(|a, b| a.0.cmp(&b.0));
        f
    }

    #[test]
    fn echo_number() {
        let f = run(
            Path::new("/bin/echo"),
            &["  -12.5 ".to_owned()],
            Duration::from_secs(5),
            "temp_c",
            64,
        )
        .unwrap();
        assert_eq!(f, vec![("temp_c".to_owned(), FieldValue::Num(-12.5))]);
    }

    #[test]
    fn args_are_not_shell_expanded() {
        let err = run(
            Path::new("/bin/echo"),
            &["$(echo 1)".to_owned()],
            Duration::from_secs(5),
            "v",
            64,
        )
        .unwrap_err();
        assert!(err.to_string().contains("$(echo 1)"), "{err}");
    }

    #[test]
    fn flat_json_object() {
        let f = sh(
            r#"printf '{"b": 1.5, "a": "ok", "c": true, "d": null, "e": [1], "f": {"g": 1}, "h": -2}\n'"#,
            Duration::from_secs(5),
            4096,
        )
        .unwrap();
        assert_eq!(
            sorted(f),
            vec![
                ("a".to_owned(), FieldValue::Text("ok".into())),
                ("b".to_owned(), FieldValue::Num(1.5)),
                ("c".to_owned(), FieldValue::Bool(true)),
                ("h".to_owned(), FieldValue::Num(-2.0)),
            ]
        );
    }

    #[test]
    fn parse_stdout_cases() {
        assert_eq!(
            parse_stdout("42\n", "x"),
            Ok((vec![("x".to_owned(), FieldValue::Num(42.0))], 0))
        );
        let (f, skipped) = parse_stdout(r#"{"a":1,"b":null,"":2}"#, "x").unwrap();
        assert_eq!(f, vec![("a".to_owned(), FieldValue::Num(1.0))]);
        assert_eq!(skipped, 2);
        for bad in [
            "",
            "  \n",
            "nan",
            "inf",
            "true",
            "\"str\"",
            "[1,2]",
            "{",
            "{}",
            r#"{"a":null,"b":[1],"c":{}}"#,
            "12 13",
            "\u{0}\u{ff}",
        ] {
            assert!(parse_stdout(bad, "x").is_err(), "{bad:?}");
        }
        let long = "z".repeat(10_000);
        let detail = parse_stdout(&long, "x").unwrap_err();
        assert!(detail.len() < 200, "{detail}");
    }

    #[test]
    fn nested_only_json_is_parse_error() {
        let err = sh(
            r#"printf '{"a": {"b": 1}, "c": null}'"#,
            Duration::from_secs(5),
            4096,
        )
        .unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("2 skipped"), "{err}");
    }

    #[test]
    fn garbage_output_is_parse_error() {
        let err = sh("echo hello", Duration::from_secs(5), 4096).unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("/bin/sh") && msg.contains("\"hello\""),
            "{msg}"
        );
    }

    #[test]
    fn output_over_limit_is_rejected_not_parsed_from_a_prefix() {
        // "1234" would be a plausible, wrong reading.
        let err = sh("echo 12345678", Duration::from_secs(5), 4).unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
        assert!(err.to_string().contains("max_output_bytes (4)"), "{err}");
        let err = sh(r#"printf '{"a": 1, "b": 2}'"#, Duration::from_secs(5), 8).unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
    }

    #[test]
    fn huge_output_is_drained_not_deadlocked() {
        // Far more than a pipe buffer on both streams; a reader that stopped
        // at the limit would leave the child blocked until the timeout.
        let err = sh(
            "head -c 1000000 /dev/zero | tr '\\0' x; head -c 1000000 /dev/zero >&2",
            Duration::from_secs(20),
            16,
        )
        .unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
    }

    #[test]
    fn false_is_exit_error() {
        let err = run(
            Path::new("/bin/false"),
            &[],
            Duration::from_secs(5),
            "v",
            64,
        )
        .unwrap_err();
        match &err {
            SourceError::Exit {
                program, status, ..
            } => {
                assert_eq!(program, Path::new("/bin/false"));
                assert!(status.contains('1'), "{status}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn exit_error_carries_short_stderr() {
        let err = sh(
            "echo 5; echo 'sensor\nmissing' >&2; head -c 5000 /dev/zero | tr '\\0' e >&2; exit 3",
            Duration::from_secs(5),
            64,
        )
        .unwrap_err();
        match &err {
            SourceError::Exit { status, stderr, .. } => {
                assert!(status.contains('3'), "{status}");
                assert!(stderr.starts_with("sensor missing eee"), "{stderr}");
                assert!(stderr.len() <= STDERR_SHOWN + '…'.len_utf8(), "{stderr}");
            }
            other => panic!("{other:?}"),
        }
        assert!(!err.to_string().contains('\n'));
    }

    #[test]
    fn killed_by_signal_is_exit_error() {
        let err = sh("kill -9 $$", Duration::from_secs(5), 64).unwrap_err();
        match &err {
            SourceError::Exit { status, .. } => assert!(status.contains('9'), "{status}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_program_is_spawn_error() {
        if crate::os::process::under_qemu() {
            return; // see process::under_qemu
        }
        let err = run(
            Path::new("/nonexistent/probe"),
            &[],
            Duration::from_secs(5),
            "v",
            64,
        )
        .unwrap_err();
        match &err {
            SourceError::Spawn { program, .. } => {
                assert_eq!(program, &PathBuf::from("/nonexistent/probe"))
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("/nonexistent/probe"));
    }

    #[test]
    fn timeout_kills_and_reaps() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!("echo $$ > '{}'; exec sleep 5", pid_file.display());
        let started = Instant::now();
        let err = sh(&script, Duration::from_millis(200), 64).unwrap_err();
        let took = started.elapsed();
        match &err {
            SourceError::Timeout { after, .. } => assert_eq!(*after, Duration::from_millis(200)),
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_secs(3), "{took:?}");
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        // A zombie would still have its /proc entry; a reaped child has none.
        assert!(
            !Path::new(&format!("/proc/{}", pid.trim())).exists(),
            "child {pid} not reaped"
        );
    }

    #[test]
    fn helper_holding_stdout_times_out_and_dies() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        // The shell exits at once but its background sleep keeps stdout open.
        let script = format!("sleep 5 & echo $! > '{}'; echo 1", pid_file.display());
        let started = Instant::now();
        let err = sh(&script, Duration::from_millis(300), 64).unwrap_err();
        assert!(matches!(err, SourceError::Timeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(3));
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let proc_dir = format!("/proc/{}", pid.trim());
        // The helper was not our child, so init reaps it; give it a moment.
        let give_up = Instant::now() + Duration::from_secs(2);
        while Path::new(&proc_dir).exists() && Instant::now() < give_up {
            thread::sleep(Duration::from_millis(20));
        }
        assert!(!Path::new(&proc_dir).exists(), "helper {pid} still running");
    }

    #[test]
    fn huge_timeout_does_not_overflow() {
        let f = run(
            Path::new("/bin/echo"),
            &["1".to_owned()],
            Duration::MAX,
            "v",
            64,
        )
        .unwrap();
        assert_eq!(f, vec![("v".to_owned(), FieldValue::Num(1.0))]);
    }

    #[test]
    fn zero_max_output_is_parse_error() {
        let err = run(
            Path::new("/bin/echo"),
            &["1".to_owned()],
            Duration::from_secs(5),
            "v",
            0,
        )
        .unwrap_err();
        assert!(matches!(err, SourceError::Parse { .. }), "{err}");
    }

    #[test]
    fn one_line_flattens() {
        assert_eq!(one_line(b"  a\nb\tc\r\n", 100), "a b c");
        assert_eq!(one_line(b"abcdef", 3), "abc…");
        assert_eq!(one_line(b"\xff", 10), "\u{fffd}");
    }

    #[test]
    fn the_program_gets_path_lang_and_its_env_only() {
        let mut env = BTreeMap::new();
        env.insert("SENSOR_BUS".to_owned(), "i2c-1".to_owned());
        // What sh adds itself (PWD) is left out.
        let script = r#"printf '{"names": "%s", "bus": "%s"}' "$(env | cut -d= -f1 | grep -vx PWD | sort | tr '\n' ' ')" "$SENSOR_BUS""#;
        let f = super::run(
            Path::new("/bin/sh"),
            &["-c".to_owned(), script.to_owned()],
            Duration::from_secs(5),
            "v",
            4096,
            &confinement(&env, None),
        )
        .unwrap();
        assert_eq!(
            sorted(f),
            vec![
                ("bus".to_owned(), FieldValue::Text("i2c-1".into())),
                (
                    "names".to_owned(),
                    FieldValue::Text("LANG PATH SENSOR_BUS ".into())
                ),
            ]
        );
    }

    #[test]
    fn the_program_runs_as_its_user() {
        if !crate::os::process::can_switch_user() {
            eprintln!("skipped: switching users needs root");
            return;
        }
        let (uid, gid) = crate::os::process::lookup_user("nobody")
            .unwrap()
            .expect("user nobody");
        let script =
            r#"printf '{"uid": %s, "gid": %s, "groups": "%s"}' "$(id -u)" "$(id -g)" "$(id -G)""#;
        let f = super::run(
            Path::new("/bin/sh"),
            &["-c".to_owned(), script.to_owned()],
            Duration::from_secs(5),
            "v",
            4096,
            &confinement(&BTreeMap::new(), Some(Credentials { uid, gid })),
        )
        .unwrap();
        assert_eq!(
            sorted(f),
            vec![
                ("gid".to_owned(), FieldValue::Num(f64::from(gid))),
                ("groups".to_owned(), FieldValue::Text(gid.to_string())),
                ("uid".to_owned(), FieldValue::Num(f64::from(uid))),
            ]
        );
    }
}
