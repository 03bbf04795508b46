//! Operator-declared command handlers (`[[commands.handlers]]`): a configured
//! program run with typed, validated arguments.
//!
//! This file owns turning a command's JSON `args` into an argv
//! ([`bind_args`]) and running the program through [`crate::process`]
//! ([`run`]). It does not decide whether a command may run (deduplication,
//! TTL) or record its result; the command worker does.
//!
//! Its one rule: **a value from a command reaches the program only as (part
//! of) one argument, after it has been checked against its declared type;
//! never through a shell.** Strings are limited to `[A-Za-z0-9_.:@-]` and may
//! not start with `-` or `.`, so a value can become neither an option nor a
//! path escape, whatever the program does with it.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::config::{ExecHandler, ParamKind, ParamSpec};
use crate::process::{self, RunError};

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
///   `[A-Za-z0-9_.:@-]`, not starting with `-` or `.`.
/// - `{name}` placeholders in each of `h.args` are replaced by the values
///   (text around a placeholder is kept, as in `--unit={unit}`); an argument
///   naming an optional parameter that is absent is dropped as a whole.
///
/// # Errors
///
/// A one-line message naming the parameter, the problem and the value
/// received (cut to 64 characters), e.g.
/// `args.unit: "a;b" has characters outside [A-Za-z0-9_.:@-]`.
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

    let mut values: Vec<(&str, String)> = Vec::with_capacity(h.params.len());
    for p in &h.params {
        match args.get(&p.name) {
            Some(v) => {
                let bound =
                    bind_value(p, v).map_err(|problem| format!("args.{}: {problem}", p.name))?;
                values.push((p.name.as_str(), bound));
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

/// Run handler `h` with `args`: [`bind_args`], then
/// [`process::run_bounded`] with the handler's timeout and output limit.
///
/// The result is a JSON object: `{"exit_code": <i32 or null>, "signal":
/// <i32 or null>, "stdout": "<lossy utf-8>", "stdout_truncated": bool,
/// "stderr": "<lossy utf-8>", "stderr_truncated": bool, "duration_ms": <u64>,
/// "argv": [program, args...]}`. After a timeout, `stdout`/`stderr` hold what
/// was captured before the kill and are flagged truncated when they reached
/// the limit. Blocks for at most about `h.timeout` (plus up to ~2 s more only
/// if a killed program refuses to die).
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
    match process::run_bounded(&h.program, &argv, h.timeout, h.max_output_bytes) {
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
            result.insert("error".to_owned(), Value::String(e.to_string()));
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
            if s.starts_with(['-', '.']) {
                return Err(format!("{} may not start with '-' or '.'", shown_str(s)));
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
fn substitute(
    h: &ExecHandler,
    template: &str,
    values: &[(&str, String)],
) -> Result<Option<String>, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start + 1..].find('}') else {
            break;
        };
        let name = &rest[start + 1..start + 1 + len];
        out.push_str(&rest[..start]);
        if let Some((_, value)) = values.iter().find(|(n, _)| *n == name) {
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
    use serde_json::json;
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
        accepts(&h, json!(-5), "-5");
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

        let wide = one(ParamKind::Int {
            min: i64::MIN,
            max: i64::MAX,
        });
        accepts(&wide, json!(i64::MIN), &i64::MIN.to_string());
        accepts(&wide, json!(i64::MAX), &i64::MAX.to_string());
        accepts(&wide, json!(-(2f64.powi(63))), &i64::MIN.to_string());
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
        accepts(&tiny, json!(-0.75), "-0.75");
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
        assert!(rejects(&h, json!("-x")).contains("may not start with '-' or '.'"));
        rejects(&h, json!(".x"));
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
            json!("../../etc/passwd"),
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
        if crate::process::under_qemu() {
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
}
