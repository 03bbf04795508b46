//! Operator-declared command handlers (`[[commands.handlers]]`): a configured
//! program run with typed, validated arguments.
//!
//! This file owns turning a command's JSON `args` into an argv
//! ([`bind_args`]) and running the program through [`crate::os::process`]
//! ([`run`]). It does not decide whether a command may run (deduplication,
//! TTL) or record its result; the command worker does.
//!
//! Its one rule: **a value from a command reaches the program only as (part
//! of) one argument, after it has been checked against its declared type;
//! never through a shell, and never as an option the operator did not
//! write.** Strings are limited to `[A-Za-z0-9_.:@-]` and may not start with
//! `-` or `.`; a negative number may not begin an argument. So a value can
//! become neither an option nor a path escape, whatever the program does
//! with it. (Enum values are written by the operator and passed as they are.)
//!
//! The program runs confined ([`process::run_confined`]): only the
//! environment of [`child_env`], no descriptor above 2, the handler's
//! working directory (`/` by default), CPU, address-space and open-file
//! limits, and the handler's `user`/`group` when the agent runs as root.
//! Nothing of the agent's own environment (credentials, tokens, proxy
//! settings) reaches it. It runs in a kill scope of its own: at the
//! timeout, or once it has exited and its output is read, every process it
//! started is killed, one that left its process group with `setsid` too.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::commands::{ExecHandler, ParamKind, ParamSpec};
use crate::os::process::{self, Confinement, RunError};

/// `PATH` of a handler's program unless its `env` sets one: the system
/// directories only, never the agent's own `PATH` ([`process::CHILD_PATH`]).
pub const HANDLER_PATH: &str = process::CHILD_PATH;
/// `LANG` of a handler's program unless its `env` sets one
/// ([`process::CHILD_LANG`]): UTF-8 without translated messages.
pub const HANDLER_LANG: &str = process::CHILD_LANG;

/// Characters of an offending value shown in an error.
const SHOWN_CHARS: usize = 64;
/// 2^63: `i64::MAX + 1`, exactly representable as an f64.
const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;

/// What running a handler produced.
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerOutcome {
    /// Exit status 0. `result` is the JSON object described at [`run`].
    Completed(Value),
    /// Ran but failed (non-zero exit, signal, timeout, spawn failure).
    /// `result` is the JSON object described at [`run`] plus
    /// `"error": "<one line>"`.
    Failed(Value),
    /// Not run: bad arguments. The message from [`bind_args`].
    Rejected(String),
}

/// Validate the command's `args` (a JSON object) against `h.params` and
/// build the argv (without the program).
///
/// - Every key in `args` must be a declared parameter, and every required
///   parameter must be present.
/// - `int`: a JSON integer, or a number with no fraction, within
///   `min..=max`; `float`: a finite JSON number within `min..=max`, passed
///   in plain decimal notation; `bool`: a JSON bool, passed as
///   `true`/`false`; `enum`: a JSON string equal to one of the values;
///   `string`: a JSON string of 1..=`max_len` bytes, only
///   `[A-Za-z0-9_.:@-]`, not starting with `-` (an option) or `.` (a path).
/// - `{name}` placeholders in each of `h.args` are replaced by the values
///   (text around a placeholder is kept, as in `--unit={unit}`); an argument
///   naming an optional parameter that is absent is dropped as a whole.
/// - A negative `int` or `float` may not begin an argument (`{n}` alone
///   would pass `-5`, which a program reads as an option): it is refused
///   there, and passed only after other text, as in `--offset={n}`.
///
/// # Errors
///
/// A one-line message naming the parameter, the problem and the value
/// received (cut to 64 characters), e.g.
/// `args.unit: "a;b" has characters outside [A-Za-z0-9_.:@-]`. The caller
/// rejects the command without running anything.
pub fn bind_args(h: &ExecHandler, args: &Map<String, Value>) -> Result<Vec<String>, String> {
    if let Some(unknown) = args
        .keys()
        .find(|k| !h.params.iter().any(|p| &p.name == *k))
    {
        let declared: Vec<&str> = h.params.iter().map(|p| p.name.as_str()).collect();
        let takes = if declared.is_empty() {
            "no parameters".to_owned()
        } else {
            declared.join(", ")
        };
        return Err(format!(
            "args.{}: unknown parameter (handler {:?} takes {takes})",
            shown_key(unknown),
            h.name
        ));
    }

    let mut values: Vec<(&ParamSpec, String)> = Vec::with_capacity(h.params.len());
    for p in &h.params {
        match args.get(&p.name) {
            Some(v) => {
                let bound =
                    bind_value(p, v).map_err(|problem| format!("args.{}: {problem}", p.name))?;
                values.push((p, bound));
            }
            None if p.required => {
                return Err(format!("args.{}: required parameter missing", p.name));
            }
            None => {}
        }
    }

    let mut argv = Vec::with_capacity(h.args.len());
    for template in &h.args {
        if let Some(arg) = substitute(h, template, &values)? {
            argv.push(arg);
        }
    }
    Ok(argv)
}

/// The whole environment of handler `h`'s program: `PATH` =
/// [`HANDLER_PATH`], `LANG` = [`HANDLER_LANG`], and the handler's `env`
/// (which may replace either), sorted by name ([`process::child_env`]).
/// Nothing is inherited.
pub fn child_env(h: &ExecHandler) -> Vec<(String, String)> {
    process::child_env(&h.env)
}

/// How handler `h`'s program is confined.
fn confinement(h: &ExecHandler) -> Confinement {
    Confinement {
        env: child_env(h),
        cwd: Some(h.cwd.clone()),
        limits: Some(h.limits),
        credentials: h.credentials,
    }
}

/// Run handler `h` with `args`: [`bind_args`], then
/// [`process::run_confined`] with the handler's timeout, output limit and
/// confinement ([`child_env`], `cwd`, limits, user).
///
/// The result is a JSON object: `{"exit_code": <i32 or null>, "signal":
/// <i32 or null>, "stdout": "<lossy utf-8>", "stdout_truncated": bool,
/// "stderr": "<lossy utf-8>", "stderr_truncated": bool, "duration_ms": <u64>,
/// "argv": [program, args...]}`. After a timeout, `stdout`/`stderr` hold what
/// was captured before the kill and are flagged truncated when they reached
/// the limit. A program stopped by its CPU limit is `Failed` with `signal`
/// SIGXCPU (24 on Linux). A program that could not be started, or whose
/// confinement could not be set up, is `Failed` with the OS error. Blocks
/// for at most about `h.timeout` (plus up to ~2 s more only if a killed
/// program refuses to die).
pub fn run(h: &ExecHandler, args: &Map<String, Value>) -> HandlerOutcome {
    let argv = match bind_args(h, args) {
        Ok(argv) => argv,
        Err(message) => return HandlerOutcome::Rejected(message),
    };
    let shown_argv: Vec<Value> = std::iter::once(h.program.to_string_lossy().into_owned())
        .chain(argv.iter().cloned())
        .map(Value::String)
        .collect();

    let started = Instant::now();
    match process::run_confined(
        &h.program,
        &argv,
        h.timeout,
        h.max_output_bytes,
        &confinement(h),
    ) {
        Ok(out) => {
            let mut result = result_object(
                Some(out.status),
                (&out.stdout, out.stdout_truncated),
                (&out.stderr, out.stderr_truncated),
                out.duration,
                shown_argv,
            );
            if out.status.success() {
                HandlerOutcome::Completed(Value::Object(result))
            } else {
                let error = format!("{} {}", h.program.display(), describe(out.status));
                result.insert("error".to_owned(), Value::String(error));
                HandlerOutcome::Failed(Value::Object(result))
            }
        }
        Err(e) => {
            let empty = Vec::new();
            let (stdout, stderr) = match &e {
                RunError::Timeout { stdout, stderr, .. } => (stdout, stderr),
                RunError::Spawn { .. } | RunError::Io { .. } => (&empty, &empty),
            };
            // A timeout error carries no truncation flags; output that
            // reached the limit most likely went on.
            let at_limit = |b: &Vec<u8>| !b.is_empty() && b.len() >= h.max_output_bytes;
            let mut result = result_object(
                None,
                (stdout, at_limit(stdout)),
                (stderr, at_limit(stderr)),
                started.elapsed(),
                shown_argv,
            );
            let error = match &e {
                // The OS error alone could be the program's or the set-up's.
                RunError::Spawn { .. } => format!("{e} ({})", setup_shown(h)),
                RunError::Timeout { .. } | RunError::Io { .. } => e.to_string(),
            };
            result.insert("error".to_owned(), Value::String(error));
            HandlerOutcome::Failed(Value::Object(result))
        }
    }
}

fn result_object(
    status: Option<ExitStatus>,
    stdout: (&[u8], bool),
    stderr: (&[u8], bool),
    duration: Duration,
    argv: Vec<Value>,
) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert(
        "exit_code".to_owned(),
        status
            .and_then(|s| s.code())
            .map_or(Value::Null, Value::from),
    );
    m.insert(
        "signal".to_owned(),
        status
            .and_then(|s| s.signal())
            .map_or(Value::Null, Value::from),
    );
    m.insert(
        "stdout".to_owned(),
        Value::String(String::from_utf8_lossy(stdout.0).into_owned()),
    );
    m.insert("stdout_truncated".to_owned(), Value::Bool(stdout.1));
    m.insert(
        "stderr".to_owned(),
        Value::String(String::from_utf8_lossy(stderr.0).into_owned()),
    );
    m.insert("stderr_truncated".to_owned(), Value::Bool(stderr.1));
    m.insert(
        "duration_ms".to_owned(),
        Value::from(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)),
    );
    m.insert("argv".to_owned(), Value::Array(argv));
    m
}

/// Where and as whom the program was to start, for a spawn error.
fn setup_shown(h: &ExecHandler) -> String {
    match h.credentials {
        Some(c) => format!("in {:?} as uid {} gid {}", h.cwd, c.uid, c.gid),
        None => format!("in {:?}", h.cwd),
    }
}

/// How a program that ran ended, for the `error` line.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("ended with {status}"),
    }
}

/// One parameter's value as an argument, or the problem (without the
/// `args.<name>: ` prefix).
fn bind_value(p: &ParamSpec, v: &Value) -> Result<String, String> {
    match &p.kind {
        ParamKind::Int { min, max } => {
            let Value::Number(n) = v else {
                return Err(format!("expected an integer, got {}", shown_json(v)));
            };
            let out_of_range = || format!("{} is out of range {min}..={max}", shown_json(v));
            let i = if let Some(i) = n.as_i64() {
                i
            } else if n.is_u64() {
                // Above i64::MAX, so above any max.
                return Err(out_of_range());
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if !f.is_finite() || f.fract() != 0.0 {
                    return Err(format!("expected an integer, got {}", shown_json(v)));
                }
                // i64 spans -2^63..2^63, both ends exact as f64.
                if !(-TWO_POW_63..TWO_POW_63).contains(&f) {
                    return Err(out_of_range());
                }
                // In range and integral, so exact.
                f as i64
            };
            if i < *min || i > *max {
                return Err(out_of_range());
            }
            Ok(i.to_string())
        }
        ParamKind::Float { min, max } => {
            let f = match v {
                Value::Number(n) => n.as_f64(),
                _ => None,
            };
            let Some(f) = f.filter(|f| f.is_finite()) else {
                return Err(format!("expected a finite number, got {}", shown_json(v)));
            };
            if !(*min..=*max).contains(&f) {
                return Err(format!("{} is out of range {min}..={max}", shown_json(v)));
            }
            // -0.0 would be passed as "-0".
            let f = if f == 0.0 { 0.0 } else { f };
            // Plain decimal notation (no exponent), which any number parser reads.
            Ok(f.to_string())
        }
        ParamKind::Bool => match v {
            Value::Bool(b) => Ok(b.to_string()),
            _ => Err(format!("expected true or false, got {}", shown_json(v))),
        },
        ParamKind::Enum { values } => {
            let Value::String(s) = v else {
                return Err(format!("expected a string, got {}", shown_json(v)));
            };
            if values.iter().any(|allowed| allowed == s) {
                Ok(s.clone())
            } else {
                Err(format!(
                    "{} is not one of {}",
                    shown_str(s),
                    shown_str(&values.join(", "))
                ))
            }
        }
        ParamKind::Str { max_len } => {
            let Value::String(s) = v else {
                return Err(format!("expected a string, got {}", shown_json(v)));
            };
            if s.is_empty() {
                return Err("\"\" is empty".to_owned());
            }
            if s.len() > *max_len {
                return Err(format!(
                    "{} is {} bytes, more than max_len {max_len}",
                    shown_str(s),
                    s.len()
                ));
            }
            if !s.chars().all(safe_char) {
                return Err(format!(
                    "{} has characters outside [A-Za-z0-9_.:@-]",
                    shown_str(s)
                ));
            }
            if s.starts_with('-') {
                return Err(format!(
                    "{} may not start with '-': the program would read it as an option",
                    shown_str(s)
                ));
            }
            if s.starts_with('.') {
                return Err(format!(
                    "{} may not start with '.': it could name a path (\".\", \"..\", a hidden file)",
                    shown_str(s)
                ));
            }
            Ok(s.clone())
        }
    }
}

fn safe_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '@' | '-')
}

/// Replaces the `{name}` placeholders of one handler argument, scanning as
/// [`crate::config::placeholders`] does. `None`: the argument names an
/// absent optional parameter and is dropped. Values are inserted in one
/// pass, so braces inside a value are never taken for a placeholder.
///
/// A number that would begin the argument may not start with `-` (strings
/// are refused earlier; enum values are the operator's own).
fn substitute(
    h: &ExecHandler,
    template: &str,
    values: &[(&ParamSpec, String)],
) -> Result<Option<String>, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start + 1..].find('}') else {
            break;
        };
        let name = &rest[start + 1..start + 1 + len];
        out.push_str(&rest[..start]);
        if let Some((p, value)) = values.iter().find(|(p, _)| p.name == name) {
            let number = matches!(p.kind, ParamKind::Int { .. } | ParamKind::Float { .. });
            if number && out.is_empty() && value.starts_with('-') {
                return Err(format!(
                    "args.{name}: {value} would begin argument {} and be read as an option; \
                     a negative number is passed only after other text in its argument, \
                     as in \"--{name}={{{name}}}\"",
                    shown_str(template)
                ));
            }
            out.push_str(value);
        } else if h.params.iter().any(|p| p.name == name) {
            return Ok(None);
        } else {
            // The config refuses such a handler; never run one anyway.
            return Err(format!(
                "handler {:?}: argument {} names no declared parameter {{{name}}}",
                h.name,
                shown_str(template)
            ));
        }
        rest = &rest[start + 1 + len + 1..];
    }
    out.push_str(rest);
    Ok(Some(out))
}

/// A string value for an error message: quoted, escaped, cut to
/// [`SHOWN_CHARS`] characters.
fn shown_str(s: &str) -> String {
    match s.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{:?}…", &s[..cut]),
        None => format!("{s:?}"),
    }
}

/// Any JSON value for an error message, cut to [`SHOWN_CHARS`] characters.
fn shown_json(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// A key from the command: bare if it looks like a parameter name, else
/// quoted and cut.
fn shown_key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.len() <= SHOWN_CHARS
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if plain {
        k.to_owned()
    } else {
        shown_str(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::process::Limits;
    use serde_json::json;
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    fn handler(program: &str, args: &[&str], params: Vec<ParamSpec>) -> ExecHandler {
        ExecHandler {
            name: "test".to_owned(),
            program: PathBuf::from(program),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            timeout: Duration::from_secs(5),
            max_output_bytes: 4096,
            retry_safe: false,
            params,
            env: BTreeMap::new(),
            cwd: PathBuf::from("/"),
            limits: Limits {
                cpu_secs: 6,
                max_memory_bytes: 256 * 1024 * 1024,
                max_open_files: 64,
            },
            credentials: None,
        }
    }

    fn param(name: &str, kind: ParamKind, required: bool) -> ParamSpec {
        ParamSpec {
            name: name.to_owned(),
            kind,
            required,
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        }
    }

    /// A handler with one required parameter `x` of `kind` used as `{x}`.
    fn one(kind: ParamKind) -> ExecHandler {
        handler("/bin/echo", &["{x}"], vec![param("x", kind, true)])
    }

    /// As [`one`], used inside an argument as `--x={x}`.
    fn option_value(kind: ParamKind) -> ExecHandler {
        handler("/bin/echo", &["--x={x}"], vec![param("x", kind, true)])
    }

    fn accepts(h: &ExecHandler, v: Value, expected: &str) {
        let argv = bind_args(h, &obj(json!({ "x": v.clone() })))
            .unwrap_or_else(|e| panic!("{v} rejected: {e}"));
        assert_eq!(argv, vec![expected.to_owned()], "{v}");
    }

    fn rejects(h: &ExecHandler, v: Value) -> String {
        let err =
            bind_args(h, &obj(json!({ "x": v.clone() }))).expect_err(&format!("{v} accepted"));
        assert!(err.starts_with("args.x: "), "{err}");
        assert!(!err.contains('\n'), "{err}");
        err
    }

    fn result(outcome: &HandlerOutcome) -> &Map<String, Value> {
        match outcome {
            HandlerOutcome::Completed(Value::Object(m))
            | HandlerOutcome::Failed(Value::Object(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn int_bounds() {
        let h = one(ParamKind::Int { min: -5, max: 10 });
        accepts(
            &option_value(ParamKind::Int { min: -5, max: 10 }),
            json!(-5),
            "--x=-5",
        );
        accepts(&h, json!(10), "10");
        accepts(&h, json!(0), "0");
        accepts(&h, json!(3.0), "3");
        assert!(rejects(&h, json!(-6)).contains("-6 is out of range -5..=10"));
        assert!(rejects(&h, json!(11)).contains("11 is out of range"));
        assert!(rejects(&h, json!(2.5)).contains("expected an integer, got 2.5"));
        assert!(rejects(&h, json!(u64::MAX)).contains("out of range"));
        assert!(rejects(&h, json!(1e20)).contains("out of range"));
        assert!(rejects(&h, json!("3")).contains("expected an integer, got \"3\""));
        rejects(&h, json!(true));
        rejects(&h, json!(null));
        rejects(&h, json!([1]));

        let wide = option_value(ParamKind::Int {
            min: i64::MIN,
            max: i64::MAX,
        });
        accepts(&wide, json!(i64::MIN), &format!("--x={}", i64::MIN));
        accepts(&wide, json!(i64::MAX), &format!("--x={}", i64::MAX));
        accepts(&wide, json!(-(2f64.powi(63))), &format!("--x={}", i64::MIN));
        rejects(&wide, json!(2f64.powi(63)));
    }

    #[test]
    fn float_bounds() {
        let h = one(ParamKind::Float { min: 0.5, max: 2.5 });
        accepts(&h, json!(0.5), "0.5");
        accepts(&h, json!(2.5), "2.5");
        accepts(&h, json!(1), "1");
        accepts(&h, json!(1.25), "1.25");
        assert!(rejects(&h, json!(0.49)).contains("0.49 is out of range 0.5..=2.5"));
        rejects(&h, json!(2.51));
        assert!(rejects(&h, json!("1.0")).contains("expected a finite number"));
        rejects(&h, json!(null));
        rejects(&h, json!(false));

        let tiny = one(ParamKind::Float {
            min: -1.0,
            max: 1.0,
        });
        // No exponent: "1e-7" is not read by every number parser.
        accepts(&tiny, json!(1e-7), "0.0000001");
        accepts(&tiny, json!(-0.0), "0");
        let tiny = option_value(ParamKind::Float {
            min: -1.0,
            max: 1.0,
        });
        accepts(&tiny, json!(-0.75), "--x=-0.75");
    }

    #[test]
    fn a_negative_number_may_not_begin_an_argument() {
        for kind in [
            ParamKind::Int { min: -10, max: 10 },
            ParamKind::Float {
                min: -10.0,
                max: 10.0,
            },
        ] {
            let h = one(kind.clone());
            let err = rejects(&h, json!(-3));
            assert!(err.starts_with("args.x: -3 would begin argument"), "{err}");
            assert!(err.contains("read as an option"), "{err}");
            assert!(err.len() < 200, "{err}");
            accepts(&h, json!(3), "3");
            accepts(&h, json!(0), "0");
            accepts(&option_value(kind), json!(-3), "--x=-3");
        }
        // An empty enum value before it does not hide where the argument starts.
        let h = handler(
            "/bin/echo",
            &["{e}{n}"],
            vec![
                param(
                    "e",
                    ParamKind::Enum {
                        values: vec![String::new()],
                    },
                    true,
                ),
                param("n", ParamKind::Int { min: -9, max: 9 }, true),
            ],
        );
        let err = bind_args(&h, &obj(json!({"e": "", "n": -1}))).unwrap_err();
        assert!(err.starts_with("args.n: -1 would begin"), "{err}");
        // Enum values are the operator's own: an option among them is passed.
        let h = one(ParamKind::Enum {
            values: vec!["--dry-run".to_owned()],
        });
        accepts(&h, json!("--dry-run"), "--dry-run");
    }

    #[test]
    fn bool_values() {
        let h = one(ParamKind::Bool);
        accepts(&h, json!(true), "true");
        accepts(&h, json!(false), "false");
        assert!(rejects(&h, json!("true")).contains("expected true or false"));
        rejects(&h, json!(1));
        rejects(&h, json!(null));
    }

    #[test]
    fn enum_values() {
        let h = one(ParamKind::Enum {
            values: vec!["start".to_owned(), "stop".to_owned()],
        });
        accepts(&h, json!("start"), "start");
        accepts(&h, json!("stop"), "stop");
        let err = rejects(&h, json!("restart"));
        assert!(err.contains("\"restart\" is not one of"), "{err}");
        assert!(err.contains("start, stop"), "{err}");
        rejects(&h, json!("Stop"));
        rejects(&h, json!(""));
        rejects(&h, json!(1));
        rejects(&h, json!(["start"]));
    }

    #[test]
    fn string_bounds_and_charset() {
        let h = one(ParamKind::Str { max_len: 8 });
        for ok in [
            "a", "abcdefgh", "eth0.100", "u@host:1", "A_b-c.d", "a..b", "0",
        ] {
            accepts(&h, json!(ok), ok);
        }
        assert!(rejects(&h, json!("")).contains("is empty"));
        let err = rejects(&h, json!("abcdefghi"));
        assert!(err.contains("is 9 bytes, more than max_len 8"), "{err}");
        // Bytes, not characters.
        rejects(&h, json!("éééé5"));
        assert!(rejects(&h, json!("-x")).contains("may not start with '-'"));
        assert!(rejects(&h, json!(".x")).contains("may not start with '.'"));
        rejects(&h, json!("a b"));
        rejects(&h, json!("é"));
        rejects(&h, json!("a\nb"));
        rejects(&h, json!("a\0b"));
    }

    #[test]
    fn unknown_parameter_is_rejected() {
        let h = handler(
            "/bin/echo",
            &["{a}"],
            vec![param("a", ParamKind::Bool, false)],
        );
        let err = bind_args(&h, &obj(json!({"a": true, "bogus": 1}))).unwrap_err();
        assert!(err.starts_with("args.bogus: unknown parameter"), "{err}");
        assert!(err.contains("takes a"), "{err}");

        let none = handler("/bin/echo", &["hi"], vec![]);
        let err = bind_args(&none, &obj(json!({"x": 1}))).unwrap_err();
        assert!(err.contains("no parameters"), "{err}");
        assert_eq!(bind_args(&none, &Map::new()).unwrap(), vec!["hi"]);

        // An odd key is shown quoted and cut, on one line.
        let key = format!("a\n{}", "k".repeat(500));
        let err = bind_args(&none, &obj(json!({ key: 1 }))).unwrap_err();
        assert!(err.starts_with("args.\"a\\n"), "{err}");
        assert!(!err.contains('\n') && err.len() < 200, "{err}");
    }

    #[test]
    fn missing_required_is_rejected() {
        let h = handler(
            "/bin/echo",
            &["{unit}", "{n}"],
            vec![
                param("unit", ParamKind::Str { max_len: 64 }, true),
                param("n", ParamKind::Int { min: 0, max: 9 }, false),
            ],
        );
        let err = bind_args(&h, &obj(json!({"n": 1}))).unwrap_err();
        assert_eq!(err, "args.unit: required parameter missing");
    }

    #[test]
    fn placeholders_are_substituted_and_absent_optional_dropped() {
        let h = handler(
            "/bin/echo",
            &[
                "status",
                "--unit={unit}",
                "--lines={lines}",
                "{a}-{b}",
                "{unterminated",
                "--follow={follow}",
            ],
            vec![
                param("unit", ParamKind::Str { max_len: 64 }, true),
                param("lines", ParamKind::Int { min: 1, max: 100 }, false),
                param("a", ParamKind::Int { min: 0, max: 9 }, true),
                param("b", ParamKind::Bool, false),
                param("follow", ParamKind::Bool, false),
            ],
        );
        let argv = bind_args(&h, &obj(json!({"unit": "ssh.service", "a": 4}))).unwrap();
        assert_eq!(argv, vec!["status", "--unit=ssh.service", "{unterminated"]);
        let argv = bind_args(
            &h,
            &obj(json!({"unit": "x", "a": 4, "b": false, "lines": 20, "follow": true})),
        )
        .unwrap();
        assert_eq!(
            argv,
            vec![
                "status",
                "--unit=x",
                "--lines=20",
                "4-false",
                "{unterminated",
                "--follow=true"
            ]
        );
    }

    #[test]
    fn values_are_substituted_once() {
        // An operator-declared enum value that looks like a placeholder stays
        // as it is.
        let h = handler(
            "/bin/echo",
            &["{e}{s}"],
            vec![
                param(
                    "e",
                    ParamKind::Enum {
                        values: vec!["{s}".to_owned()],
                    },
                    true,
                ),
                param("s", ParamKind::Str { max_len: 8 }, true),
            ],
        );
        let argv = bind_args(&h, &obj(json!({"e": "{s}", "s": "v"}))).unwrap();
        assert_eq!(argv, vec!["{s}v"]);
    }

    #[test]
    fn undeclared_placeholder_is_an_error() {
        // The config refuses this; bind_args must not pass it on either.
        let h = handler("/bin/echo", &["{nope}"], vec![]);
        let err = bind_args(&h, &Map::new()).unwrap_err();
        assert!(err.contains("{nope}"), "{err}");
    }

    #[test]
    fn injection_attempts_are_rejected() {
        let h = handler(
            "/bin/echo",
            &["{s}"],
            vec![param("s", ParamKind::Str { max_len: 64 }, true)],
        );
        let big = "a".repeat(10 * 1024);
        let attempts = [
            json!("a; touch /tmp/pwned"),
            json!("$(id)"),
            json!("`id`"),
            json!("a|b"),
            json!("a && b"),
            json!("--help"),
            json!("-rf"),
            json!("../../etc/passwd"), // hostile input
            json!("/etc/passwd"),
            json!(".hidden"),
            json!(".."),
            json!("a/b"),
            json!("a>b"),
            json!("*"),
            json!("~root"),
            json!("'a'"),
            json!("a\"b"),
            json!("a\\b"),
            json!("{s}"),
            json!(big),
            json!(42),
            json!(true),
            json!(null),
            json!(["a"]),
            json!({"a": "b"}),
        ];
        for bad in attempts {
            let err = bind_args(&h, &obj(json!({ "s": bad.clone() })))
                .expect_err(&format!("{bad} accepted"));
            assert!(err.starts_with("args.s: "), "{bad}: {err}");
            assert!(err.len() < 200, "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
        let err = bind_args(&h, &obj(json!({ "s": "a;b" }))).unwrap_err();
        assert_eq!(
            err,
            "args.s: \"a;b\" has characters outside [A-Za-z0-9_.:@-]"
        );
        let err = bind_args(&h, &obj(json!({ "s": 42 }))).unwrap_err();
        assert_eq!(err, "args.s: expected a string, got 42");
        let err = bind_args(&h, &obj(json!({ "s": big }))).unwrap_err();
        assert!(err.contains("10240 bytes"), "{err}");
        assert!(err.contains(&format!("\"{}\"…", "a".repeat(64))), "{err}");

        // A rejected command never runs.
        let outcome = run(&h, &obj(json!({ "s": "$(id)" })));
        assert!(
            matches!(&outcome, HandlerOutcome::Rejected(m) if m.starts_with("args.s: ")),
            "{outcome:?}"
        );
    }

    #[test]
    fn valid_values_reach_the_program_verbatim() {
        let h = handler(
            "/bin/echo",
            &["{s}", "{e}"],
            vec![
                param("s", ParamKind::Str { max_len: 64 }, true),
                param(
                    "e",
                    ParamKind::Enum {
                        values: vec!["$(id);`id` | *".to_owned()],
                    },
                    true,
                ),
            ],
        );
        let outcome = run(
            &h,
            &obj(json!({"s": "user@host:a_b-c.d..e", "e": "$(id);`id` | *"})),
        );
        let HandlerOutcome::Completed(Value::Object(r)) = &outcome else {
            panic!("{outcome:?}");
        };
        // With a shell, `$(id)` would be expanded and `;` would split.
        assert_eq!(r["stdout"], "user@host:a_b-c.d..e $(id);`id` | *\n");
        assert_eq!(
            r["argv"],
            json!(["/bin/echo", "user@host:a_b-c.d..e", "$(id);`id` | *"])
        );
        assert_eq!(r["exit_code"], 0);
        assert_eq!(r["signal"], Value::Null);
        assert_eq!(r["stderr"], "");
        assert_eq!(r["stdout_truncated"], false);
        assert_eq!(r["stderr_truncated"], false);
        assert!(r["duration_ms"].is_u64());
        assert!(!r.contains_key("error"));
        assert_eq!(r.len(), 8);
    }

    #[test]
    fn non_zero_exit_is_failed_with_stderr() {
        let h = handler(
            "/bin/sh",
            &["-c", "echo partial; echo 'disk missing' >&2; exit 3"],
            vec![],
        );
        let outcome = run(&h, &Map::new());
        let HandlerOutcome::Failed(Value::Object(r)) = &outcome else {
            panic!("{outcome:?}");
        };
        assert_eq!(r["exit_code"], 3);
        assert_eq!(r["signal"], Value::Null);
        assert_eq!(r["stdout"], "partial\n");
        assert_eq!(r["stderr"], "disk missing\n");
        let error = r["error"].as_str().unwrap();
        assert_eq!(error, "/bin/sh exited with code 3");

        let outcome = run(&handler("/bin/false", &[], vec![]), &Map::new());
        assert!(matches!(outcome, HandlerOutcome::Failed(_)), "{outcome:?}");
        assert_eq!(result(&outcome)["exit_code"], 1);
    }

    #[test]
    fn killed_by_signal_is_failed() {
        let h = handler("/bin/sh", &["-c", "kill -9 $$"], vec![]);
        let outcome = run(&h, &Map::new());
        let r = result(&outcome);
        assert!(matches!(outcome, HandlerOutcome::Failed(_)), "{outcome:?}");
        assert_eq!(r["exit_code"], Value::Null);
        assert_eq!(r["signal"], 9);
        assert!(r["error"].as_str().unwrap().contains("signal 9"), "{r:?}");
    }

    #[test]
    fn timeout_is_failed_promptly() {
        let h = ExecHandler {
            timeout: Duration::from_millis(200),
            ..handler(
                "/bin/sleep",
                &["{secs}"],
                vec![param("secs", ParamKind::Int { min: 1, max: 60 }, true)],
            )
        };
        let started = Instant::now();
        let outcome = run(&h, &obj(json!({"secs": 10})));
        let took = started.elapsed();
        assert!(took < Duration::from_secs(3), "{took:?}");
        let HandlerOutcome::Failed(Value::Object(r)) = &outcome else {
            panic!("{outcome:?}");
        };
        let error = r["error"].as_str().unwrap();
        assert!(error.contains("timed out after 200ms"), "{error}");
        assert!(error.contains("/bin/sleep"), "{error}");
        assert_eq!(r["exit_code"], Value::Null);
        assert_eq!(r["argv"], json!(["/bin/sleep", "10"]));
        let ms = r["duration_ms"].as_u64().unwrap();
        assert!((200..3000).contains(&ms), "{ms}");
    }

    #[test]
    fn output_over_the_limit_is_truncated() {
        let h = ExecHandler {
            max_output_bytes: 16,
            ..handler(
                "/bin/sh",
                &[
                    "-c",
                    "head -c 100000 /dev/zero | tr '\\0' o; head -c 100000 /dev/zero | tr '\\0' e >&2",
                ],
                vec![],
            )
        };
        let outcome = run(&h, &Map::new());
        let HandlerOutcome::Completed(Value::Object(r)) = &outcome else {
            panic!("{outcome:?}");
        };
        assert_eq!(r["stdout"], "o".repeat(16));
        assert_eq!(r["stderr"], "e".repeat(16));
        assert_eq!(r["stdout_truncated"], true);
        assert_eq!(r["stderr_truncated"], true);
    }

    #[test]
    fn missing_program_is_failed() {
        if crate::os::process::under_qemu() {
            return; // see process::under_qemu
        }
        let outcome = run(&handler("/nonexistent/tool", &["x"], vec![]), &Map::new());
        let HandlerOutcome::Failed(Value::Object(r)) = &outcome else {
            panic!("{outcome:?}");
        };
        let error = r["error"].as_str().unwrap();
        assert!(error.contains("/nonexistent/tool"), "{error}");
        assert_eq!(r["exit_code"], Value::Null);
        assert_eq!(r["argv"], json!(["/nonexistent/tool", "x"]));
        assert!(!Path::new("/nonexistent/tool").exists());
    }
    fn stdout(outcome: &HandlerOutcome) -> &str {
        result(outcome)["stdout"].as_str().unwrap_or_default()
    }

    #[test]
    fn child_env_is_the_allowlist_plus_the_handler_env() {
        let mut h = handler("/usr/bin/env", &[], vec![]);
        assert_eq!(
            child_env(&h),
            vec![
                ("LANG".to_owned(), HANDLER_LANG.to_owned()),
                ("PATH".to_owned(), HANDLER_PATH.to_owned()),
            ]
        );
        h.env.insert("UNIT_LOG".to_owned(), "info".to_owned());
        h.env.insert("PATH".to_owned(), "/opt/tool/bin".to_owned());
        assert_eq!(
            child_env(&h),
            vec![
                ("LANG".to_owned(), HANDLER_LANG.to_owned()),
                ("PATH".to_owned(), "/opt/tool/bin".to_owned()),
                ("UNIT_LOG".to_owned(), "info".to_owned()),
            ]
        );
    }

    #[test]
    fn the_program_sees_none_of_the_agents_environment() {
        // The agent has its own variables (RUST_LOG, credentials in a unit
        // file's Environment=, ...); this test process has at least PATH.
        let parent: Vec<String> = std::env::vars().map(|(k, _)| k).collect();
        assert!(parent.iter().any(|k| k == "PATH"), "{parent:?}");
        let mut h = handler("/usr/bin/env", &[], vec![]);
        h.env.insert("GREETING".to_owned(), "hello {x}".to_owned());
        let outcome = run(&h, &Map::new());
        assert!(
            matches!(outcome, HandlerOutcome::Completed(_)),
            "{outcome:?}"
        );
        assert_eq!(
            stdout(&outcome),
            format!("GREETING=hello {{x}}\nLANG={HANDLER_LANG}\nPATH={HANDLER_PATH}\n")
        );
    }

    #[test]
    fn the_program_runs_in_root_or_in_its_configured_directory() {
        let h = handler("/bin/pwd", &[], vec![]);
        assert_eq!(stdout(&run(&h, &Map::new())), "/\n");

        let dir = tempfile::tempdir().unwrap();
        let h = ExecHandler {
            cwd: dir.path().to_path_buf(),
            ..handler("/bin/pwd", &[], vec![])
        };
        assert_eq!(
            stdout(&run(&h, &Map::new())),
            format!("{}\n", dir.path().display())
        );

        // A directory removed after validation: not run, and the error says where.
        let gone = dir.path().join("gone");
        let h = ExecHandler {
            cwd: gone.clone(),
            ..handler("/bin/pwd", &[], vec![])
        };
        let outcome = run(&h, &Map::new());
        assert!(matches!(outcome, HandlerOutcome::Failed(_)), "{outcome:?}");
        let error = result(&outcome)["error"].as_str().unwrap_or_default();
        assert!(error.contains(&gone.display().to_string()), "{error}");
    }

    #[test]
    fn limits_are_set_soft_and_hard_in_the_child() {
        let h = ExecHandler {
            limits: Limits {
                cpu_secs: 7,
                max_memory_bytes: 64 * 1024 * 1024,
                max_open_files: 20,
            },
            ..handler(
                "/bin/sh",
                &[
                    "-c",
                    "ulimit -n; ulimit -Hn; ulimit -t; ulimit -Ht; ulimit -v",
                ],
                vec![],
            )
        };
        let outcome = run(&h, &Map::new());
        let lines: Vec<&str> = stdout(&outcome).lines().collect();
        // The CPU hard limit is one second above the soft one: SIGXCPU first,
        // SIGKILL a second later for a program that ignores it.
        assert_eq!(lines[..4], ["20", "20", "7", "8"], "{outcome:?}");
        // qemu-user keeps address-space limits to itself.
        if !crate::os::process::under_qemu() {
            assert_eq!(lines[4], (64 * 1024).to_string(), "{outcome:?}");
        }
    }

    #[test]
    fn a_program_cannot_open_more_files_than_its_limit() {
        // paste holds every file open at once. Descriptors 0-2 are taken;
        // with a limit of 8, five more fit and a sixth does not.
        let nulls = |n: usize| vec!["/dev/null"; n].join(" ");
        let script = format!(
            "paste {} && echo five-ok; paste {} && echo six-ok",
            nulls(5),
            nulls(6)
        );
        let h = ExecHandler {
            limits: Limits {
                max_open_files: 8,
                ..handler("/bin/sh", &[], vec![]).limits
            },
            ..handler("/bin/sh", &["-c", &script], vec![])
        };
        let outcome = run(&h, &Map::new());
        let r = result(&outcome);
        assert_eq!(r["stdout"], "five-ok\n", "{r:?}");
        assert!(
            r["stderr"]
                .as_str()
                .unwrap_or_default()
                .contains("Too many open files"),
            "{r:?}"
        );
    }

    #[test]
    fn a_busy_loop_is_stopped_by_the_cpu_limit() {
        let h = ExecHandler {
            // Far beyond the CPU limit, so only the limit can end it.
            timeout: Duration::from_secs(60),
            limits: Limits {
                cpu_secs: 1,
                ..handler("/bin/sh", &[], vec![]).limits
            },
            ..handler("/bin/sh", &["-c", "while :; do :; done"], vec![])
        };
        let started = Instant::now();
        let outcome = run(&h, &Map::new());
        assert!(started.elapsed() < Duration::from_secs(30), "{outcome:?}");
        let r = result(&outcome);
        assert!(matches!(outcome, HandlerOutcome::Failed(_)), "{outcome:?}");
        assert_eq!(r["signal"], libc::SIGXCPU, "{r:?}");
        assert_eq!(r["exit_code"], Value::Null);
    }

    #[test]
    fn a_dash_value_is_refused_and_nothing_runs() {
        let dir = tempfile::tempdir().unwrap();
        // If it ran, it would leave a file named after its argument in `dir`.
        let h = ExecHandler {
            cwd: dir.path().to_path_buf(),
            ..handler(
                "/bin/sh",
                &["-c", "echo ran > \"ran$1\"", "sh", "{s}", "{n}"],
                vec![
                    param("s", ParamKind::Str { max_len: 16 }, false),
                    param("n", ParamKind::Int { min: -9, max: 9 }, false),
                ],
            )
        };
        for (args, name) in [(json!({"s": "-rf"}), "s"), (json!({"n": -1}), "n")] {
            let outcome = run(&h, &obj(args.clone()));
            let HandlerOutcome::Rejected(message) = &outcome else {
                panic!("{args}: {outcome:?}");
            };
            assert!(message.starts_with(&format!("args.{name}: ")), "{message}");
            assert!(message.contains("option"), "{message}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        let outcome = run(&h, &obj(json!({"s": "x", "n": 1})));
        assert!(
            matches!(outcome, HandlerOutcome::Completed(_)),
            "{outcome:?}"
        );
        assert!(dir.path().join("ranx").exists());
    }
}
