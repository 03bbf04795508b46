//! `[[commands.handlers]]` validation: the programs a command may run and
//! their confinement (environment, working directory, limits, user). The
//! `env` and `user`/`group` checks serve exec sources too
//! ([`check_env`], [`credentials`]).

use super::bounds::{check_range, Bounds};
use crate::commands::{ExecHandler, ParamKind, ParamSpec};
use crate::config::raw::{default_cpu_secs, RawHandler, HANDLER_CWD};
use crate::event::stream::topic_safe;
use crate::os::process::{Credentials, Limits};
use std::collections::{BTreeMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Most variables a handler's `env` may set.
const MAX_ENV_VARS: usize = 64;
/// Longest name in a handler's `env`, bytes.
const MAX_ENV_NAME_BYTES: usize = 128;
/// Longest value in a handler's `env`, bytes.
const MAX_ENV_VALUE_BYTES: usize = 4096;

/// `[[commands.handlers]]`: each handler checked by [`validate_handler`];
/// names unique and not a built-in command.
pub(super) fn validate_handlers(
    raw: &[RawHandler],
    bad: &mut impl FnMut(&str, String),
) -> Vec<ExecHandler> {
    let mut hnames = HashSet::new();
    let mut handlers = Vec::new();
    for (i, h) in raw.iter().enumerate() {
        handlers.push(validate_handler(i, h, &mut hnames, bad));
    }
    handlers
}

/// Handler `i`: a valid, unique, non-built-in `name` (added to `hnames`); an
/// absolute `program`; `timeout_ms` 10..=3600000; `max_output_bytes`
/// 16..=1 MiB; typed `params`; `args` placeholders naming declared params;
/// then its confinement: `env`, `cwd`, limits and user/group.
fn validate_handler(
    i: usize,
    h: &RawHandler,
    hnames: &mut HashSet<String>,
    bad: &mut impl FnMut(&str, String),
) -> ExecHandler {
    let builtin = crate::commands::BUILTINS;
    let k = |f: &str| format!("commands.handlers[{i}].{f}");
    if h.name.is_empty() || h.name.len() > 64 || !h.name.chars().all(topic_safe) {
        bad(
            &k("name"),
            format!(
                "must be letters, digits, '-', '_' or '.' (got {:?})",
                h.name
            ),
        );
    } else if builtin.contains(&h.name.as_str()) {
        bad(&k("name"), format!("{:?} is a built-in command", h.name));
    } else if !hnames.insert(h.name.clone()) {
        bad(&k("name"), format!("duplicate handler name {:?}", h.name));
    }
    if !h.program.is_absolute() {
        bad(
            &k("program"),
            format!(
                "must be an absolute path; no shell or PATH lookup is used (got {:?})",
                h.program
            ),
        );
    }
    check_range(&k("timeout_ms"), h.timeout_ms, 10..=3_600_000, bad);
    check_range(
        &k("max_output_bytes"),
        h.max_output_bytes,
        16..=1024 * 1024,
        bad,
    );
    let params = validate_params(i, h, bad);
    for a in &h.args {
        for placeholder in placeholders(a) {
            if !h.params.contains_key(&placeholder) {
                bad(
                    &k("args"),
                    format!("{{{placeholder}}} names no declared parameter"),
                );
            }
        }
    }
    for problem in check_env(&h.env) {
        bad(&k("env"), problem);
    }
    let cwd = h.cwd.clone().unwrap_or_else(|| PathBuf::from(HANDLER_CWD));
    if let Err(problem) = check_cwd(&cwd) {
        bad(&k("cwd"), problem);
    }
    let limits = handler_limits(h, &k, bad);
    let credentials = credentials(h.user.as_deref(), h.group.as_deref(), &k, bad);
    ExecHandler {
        name: h.name.clone(),
        program: h.program.clone(),
        args: h.args.clone(),
        timeout: Duration::from_millis(h.timeout_ms),
        max_output_bytes: h.max_output_bytes,
        retry_safe: h.retry_safe,
        params,
        env: h.env.clone(),
        cwd,
        limits,
        credentials,
    }
}

/// Handler `i`'s `params`: names of letters, digits and '_'; a type of int,
/// float, string, enum or bool with a sane range or value list.
fn validate_params(i: usize, h: &RawHandler, bad: &mut impl FnMut(&str, String)) -> Vec<ParamSpec> {
    let mut params = Vec::new();
    for (pname, p) in &h.params {
        let pk = format!("commands.handlers[{i}].params.{pname}");
        if pname.is_empty() || !pname.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            bad(&pk, "parameter names are letters, digits and '_'".into());
        }
        let kind = match p.kind.as_str() {
            "int" => {
                let (min, max) = (
                    p.min.unwrap_or(i64::MIN as f64),
                    p.max.unwrap_or(i64::MAX as f64),
                );
                if min > max {
                    bad(&format!("{pk}.min"), format!("min {min} > max {max}"));
                }
                ParamKind::Int {
                    min: min as i64,
                    max: max as i64,
                }
            }
            "float" => {
                let (min, max) = (p.min.unwrap_or(f64::MIN), p.max.unwrap_or(f64::MAX));
                if min > max || !min.is_finite() || !max.is_finite() {
                    bad(
                        &format!("{pk}.min"),
                        format!("need finite min <= max (got {min}, {max})"),
                    );
                }
                ParamKind::Float { min, max }
            }
            "string" => ParamKind::Str {
                max_len: p.max_len.unwrap_or(64).clamp(1, 1024),
            },
            "enum" => match &p.values {
                Some(v) if !v.is_empty() => ParamKind::Enum { values: v.clone() },
                _ => {
                    bad(
                        &format!("{pk}.values"),
                        "enum needs a non-empty values list".into(),
                    );
                    ParamKind::Enum { values: vec![] }
                }
            },
            "bool" => ParamKind::Bool,
            other => {
                bad(
                    &format!("{pk}.type"),
                    format!("must be int, float, string, enum or bool (got {other:?})"),
                );
                ParamKind::Bool
            }
        };
        params.push(ParamSpec {
            name: pname.clone(),
            kind,
            required: p.required,
        });
    }
    params
}

/// A handler's `cpu_secs` (default from the timeout), `max_memory_bytes` and
/// `max_open_files`, in range.
fn handler_limits(
    h: &RawHandler,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Limits {
    // The default follows the timeout, whose own range is checked above.
    let cpu_secs = h.cpu_secs.unwrap_or_else(|| default_cpu_secs(h.timeout_ms));
    if h.cpu_secs.is_some() {
        let seconds = Bounds::from(1..=86_400).note(" seconds");
        check_range(&k("cpu_secs"), cpu_secs, seconds, bad);
    }
    check_range(
        &k("max_memory_bytes"),
        h.max_memory_bytes,
        Bounds::from(MIN_HANDLER_MEMORY..=MAX_HANDLER_MEMORY).note(" bytes"),
        bad,
    );
    check_range(&k("max_open_files"), h.max_open_files, 8..=1_048_576, bad);
    Limits {
        cpu_secs,
        max_memory_bytes: h.max_memory_bytes,
        max_open_files: h.max_open_files,
    }
}

/// `user` and `group` (of a handler or an exec source) resolved on this
/// system (see [`resolve_credentials`]), problems reported on `k(field)`;
/// `None` after reporting one.
pub(super) fn credentials(
    user: Option<&str>,
    group: Option<&str>,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<Credentials> {
    match resolve_credentials(
        user,
        group,
        crate::os::process::can_switch_user(),
        crate::os::process::lookup_user,
        crate::os::process::lookup_group,
    ) {
        Ok(c) => c,
        Err(problems) => {
            for (field, problem) in problems {
                bad(&k(field), problem);
            }
            None
        }
    }
}

/// Smallest `max_memory_bytes` of a handler (16 MiB): below it even a small
/// dynamically linked program may fail to start.
const MIN_HANDLER_MEMORY: u64 = 16 * 1024 * 1024;
/// Largest `max_memory_bytes` of a handler (1 TiB).
const MAX_HANDLER_MEMORY: u64 = 1 << 40;

/// Problems with a handler's (or an exec source's) `env` table, each
/// naming the variable.
pub(super) fn check_env(env: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    if env.len() > MAX_ENV_VARS {
        problems.push(format!(
            "at most {MAX_ENV_VARS} variables (got {})",
            env.len()
        ));
    }
    for (name, value) in env {
        if !env_name_ok(name) {
            problems.push(format!(
                "variable names are [A-Z_][A-Z0-9_]*, at most {MAX_ENV_NAME_BYTES} bytes (got {name:?})"
            ));
        }
        if value.contains('\0') {
            problems.push(format!("{name}: the value contains a NUL character"));
        } else if value.len() > MAX_ENV_VALUE_BYTES {
            problems.push(format!(
                "{name}: the value is {} bytes, more than {MAX_ENV_VALUE_BYTES}",
                value.len()
            ));
        }
    }
    problems
}

/// `[A-Z_][A-Z0-9_]*`, not too long.
fn env_name_ok(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_uppercase() || c == '_');
    first_ok
        && name.len() <= MAX_ENV_NAME_BYTES
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// A handler's `cwd` must be an absolute path to an existing directory.
fn check_cwd(cwd: &Path) -> Result<(), String> {
    if !cwd.is_absolute() {
        return Err(format!("must be an absolute path (got {cwd:?})"));
    }
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("is not a directory (got {cwd:?})")),
        Err(e) => Err(format!("cannot be used as a directory: {e} (got {cwd:?})")),
    }
}

/// A handler's `user` and `group` as ids, or a problem per key (`"user"`,
/// `"group"`). `is_root`: the agent can switch users; the lookups are
/// [`crate::os::process::lookup_user`] and [`crate::os::process::lookup_group`] outside
/// tests.
///
/// `group` alone is refused (a program still running as root is not
/// confined by its group); without `group` the user's primary group is used.
pub(in crate::config) fn resolve_credentials(
    user: Option<&str>,
    group: Option<&str>,
    is_root: bool,
    lookup_user: impl Fn(&str) -> io::Result<Option<(libc::uid_t, libc::gid_t)>>,
    lookup_group: impl Fn(&str) -> io::Result<Option<libc::gid_t>>,
) -> Result<Option<Credentials>, Vec<(&'static str, String)>> {
    let Some(user) = user else {
        return match group {
            None => Ok(None),
            Some(g) => Err(vec![(
                "group",
                format!(
                    "needs `user` as well: a program still running as the agent's user keeps its privileges (got {g:?})"
                ),
            )]),
        };
    };
    if !is_root {
        return Err(vec![(
            "user",
            format!(
                "the agent does not run as root, so it cannot run a program as another user (got {user:?}); remove `user` and `group` to run it as the agent's own user"
            ),
        )]);
    }
    let mut problems = Vec::new();
    let ids = match lookup_user(user) {
        Ok(Some(ids)) => Some(ids),
        Ok(None) => {
            problems.push(("user", format!("no such user (got {user:?})")));
            None
        }
        Err(e) => {
            problems.push(("user", format!("cannot look up user {user:?}: {e}")));
            None
        }
    };
    let gid = match group.map(|g| (g, lookup_group(g))) {
        None => None,
        Some((_, Ok(Some(gid)))) => Some(gid),
        Some((g, Ok(None))) => {
            problems.push(("group", format!("no such group (got {g:?})")));
            None
        }
        Some((g, Err(e))) => {
            problems.push(("group", format!("cannot look up group {g:?}: {e}")));
            None
        }
    };
    match ids {
        Some((uid, primary_gid)) if problems.is_empty() => Ok(Some(Credentials {
            uid,
            gid: gid.unwrap_or(primary_gid),
        })),
        _ => Err(problems),
    }
}

/// The `{name}` placeholders in an argument.
pub fn placeholders(arg: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = arg;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start + 1..].find('}') else {
            break;
        };
        out.push(rest[start + 1..start + 1 + len].to_owned());
        rest = &rest[start + 1 + len + 1..];
    }
    out
}
