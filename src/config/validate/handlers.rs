//! Command handler confinement checks: environment, working directory and
//! user/group.

use crate::process::Credentials;
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

/// Most variables a handler's `env` may set.
const MAX_ENV_VARS: usize = 64;
/// Longest name in a handler's `env`, bytes.
const MAX_ENV_NAME_BYTES: usize = 128;
/// Longest value in a handler's `env`, bytes.
const MAX_ENV_VALUE_BYTES: usize = 4096;

/// Smallest `max_memory_bytes` of a handler (16 MiB): below it even a small
/// dynamically linked program may fail to start.
pub(super) const MIN_HANDLER_MEMORY: u64 = 16 * 1024 * 1024;
/// Largest `max_memory_bytes` of a handler (1 TiB).
pub(super) const MAX_HANDLER_MEMORY: u64 = 1 << 40;

/// Problems with a handler's `env` table, each naming the variable.
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
pub(super) fn check_cwd(cwd: &Path) -> Result<(), String> {
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
/// [`crate::process::lookup_user`] and [`crate::process::lookup_group`] outside
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
