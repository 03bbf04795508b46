//! [`RawConfig`] → [`Config`]: every range, rule and cross-key check, each
//! problem reported as `key.path: problem (got value)`.

mod bridge;
mod commands;
mod handlers;
mod ingest;
mod metrics;
mod mqtt;
mod sources;
mod spool;

pub use handlers::placeholders;

use super::raw::*;
use super::AgentConfig;
use super::CommandsConfig;
use super::Config;
use super::ConfigError;
use super::ExecHandler;
use super::ParamKind;
use super::ParamSpec;
use super::Problem;
use crate::process::Limits;
use commands::validate_push;
use handlers::check_cwd;
use handlers::check_env;
pub(super) use handlers::resolve_credentials;
use handlers::MAX_HANDLER_MEMORY;
use handlers::MIN_HANDLER_MEMORY;
use ingest::validate_ingest;
use metrics::validate_metrics;
use std::path::PathBuf;
use std::time::Duration;

/// Validate every section of `raw` (from `origin`, used in the error).
pub(super) fn validate(raw: RawConfig, origin: &str) -> Result<Config, ConfigError> {
    let mut probs: Vec<Problem> = Vec::new();
    let mut bad = |key: &str, msg: String| {
        probs.push(Problem {
            key: key.to_owned(),
            line: None,
            message: msg,
        })
    };

    let device_id = validate_device_id(&raw.device_id, &mut bad);

    let spool = spool::validate_spool(&raw.spool, &mut bad);

    let mqtt = mqtt::validate_mqtt(&raw.mqtt, &device_id, &mut bad);
    let agent = validate_agent(&raw.agent, &mut bad);

    let sources = sources::validate_sources(&raw.sources, &device_id, &mqtt, &mut bad);

    let rc = &raw.commands;
    if !(256..=1024 * 1024).contains(&rc.max_payload_bytes) {
        bad(
            "commands.max_payload_bytes",
            format!("must be 256..=1048576 (got {})", rc.max_payload_bytes),
        );
    }
    if rc.record_retention_secs > TEN_YEARS_SECS {
        bad(
            "commands.record_retention_secs",
            format!(
                "must be at most {TEN_YEARS_SECS} (got {})",
                rc.record_retention_secs
            ),
        );
    }
    if rc.record_retention_secs < 3600 {
        bad(
            "commands.record_retention_secs",
            format!(
                "must be at least 3600, longer than any redelivery window (got {})",
                rc.record_retention_secs
            ),
        );
    }
    if !(1000..=1_000_000).contains(&rc.max_records) {
        bad(
            "commands.max_records",
            format!("must be 1000..=1000000 (got {})", rc.max_records),
        );
    }
    if !(1..=10_000).contains(&rc.max_queued) {
        bad(
            "commands.max_queued",
            format!("must be 1..=10000 (got {})", rc.max_queued),
        );
    }
    if !(1..=60_000).contains(&rc.max_per_minute_per_scope) {
        bad(
            "commands.max_per_minute_per_scope",
            format!("must be 1..=60000 (got {})", rc.max_per_minute_per_scope),
        );
    }
    if rc.default_ttl_secs == 0 || rc.default_ttl_secs > rc.record_retention_secs {
        // A command may still run only while its record is sure to exist:
        // past the redelivery window a redelivery could find no record.
        bad(
            "commands.default_ttl_secs",
            format!(
                "must be 1..=commands.record_retention_secs ({}) (got {})",
                rc.record_retention_secs, rc.default_ttl_secs
            ),
        );
    }
    let config_push = validate_push(&rc.config_push, &mut bad);
    let metrics = validate_metrics(&raw.metrics, &mut bad);
    let ingest = validate_ingest(&raw.ingest, &sources, &mut bad);
    let builtin = crate::commands::BUILTINS;
    let mut handlers = Vec::new();
    let mut hnames = std::collections::HashSet::new();
    for (i, h) in rc.handlers.iter().enumerate() {
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
        if !(10..=3_600_000).contains(&h.timeout_ms) {
            bad(
                &k("timeout_ms"),
                format!("must be 10..=3600000 (got {})", h.timeout_ms),
            );
        }
        if !(16..=1024 * 1024).contains(&h.max_output_bytes) {
            bad(
                &k("max_output_bytes"),
                format!("must be 16..=1048576 (got {})", h.max_output_bytes),
            );
        }
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
        // The default follows the timeout, whose own range is checked above.
        let cpu_secs = h.cpu_secs.unwrap_or_else(|| default_cpu_secs(h.timeout_ms));
        if h.cpu_secs.is_some() && !(1..=86_400).contains(&cpu_secs) {
            bad(
                &k("cpu_secs"),
                format!("must be 1..=86400 seconds (got {cpu_secs})"),
            );
        }
        if !(MIN_HANDLER_MEMORY..=MAX_HANDLER_MEMORY).contains(&h.max_memory_bytes) {
            bad(
                &k("max_memory_bytes"),
                format!(
                    "must be {MIN_HANDLER_MEMORY}..={MAX_HANDLER_MEMORY} bytes (got {})",
                    h.max_memory_bytes
                ),
            );
        }
        if !(8..=1_048_576).contains(&h.max_open_files) {
            bad(
                &k("max_open_files"),
                format!("must be 8..=1048576 (got {})", h.max_open_files),
            );
        }
        let credentials = match resolve_credentials(
            h.user.as_deref(),
            h.group.as_deref(),
            crate::process::can_switch_user(),
            crate::process::lookup_user,
            crate::process::lookup_group,
        ) {
            Ok(c) => c,
            Err(problems) => {
                for (field, problem) in problems {
                    bad(&k(field), problem);
                }
                None
            }
        };
        handlers.push(ExecHandler {
            name: h.name.clone(),
            program: h.program.clone(),
            args: h.args.clone(),
            timeout: Duration::from_millis(h.timeout_ms),
            max_output_bytes: h.max_output_bytes,
            retry_safe: h.retry_safe,
            params,
            env: h.env.clone(),
            cwd,
            limits: Limits {
                cpu_secs,
                max_memory_bytes: h.max_memory_bytes,
                max_open_files: h.max_open_files,
            },
            credentials,
        });
    }

    if !probs.is_empty() {
        return Err(ConfigError {
            origin: origin.to_owned(),
            problems: probs,
        });
    }
    Ok(Config {
        device_id,
        spool,
        mqtt,
        agent,
        sources,
        commands: CommandsConfig {
            enabled: rc.enabled,
            max_payload_bytes: rc.max_payload_bytes,
            record_retention: Duration::from_secs(rc.record_retention_secs),
            max_records: rc.max_records,
            max_queued: rc.max_queued,
            max_per_minute_per_scope: rc.max_per_minute_per_scope,
            default_ttl: Duration::from_secs(rc.default_ttl_secs),
            handlers,
            config_push,
        },
        metrics,
        ingest,
    })
}

/// `device_id`: trimmed, 1..=64 letters, digits, '-', '_' or '.' (it is a
/// topic level). Returns the trimmed id.
fn validate_device_id(raw: &str, bad: &mut impl FnMut(&str, String)) -> String {
    let device_id = raw.trim().to_owned();
    if device_id.is_empty() || device_id.len() > 64 || !device_id.chars().all(topic_safe) {
        bad(
            "device_id",
            format!(
                "must be non-empty letters, digits, '-', '_' or '.' (got {:?})",
                raw
            ),
        );
    }
    device_id
}

/// `[agent]`: `summary_interval_secs` 1..=86400.
fn validate_agent(raw: &RawAgent, bad: &mut impl FnMut(&str, String)) -> AgentConfig {
    if !(1..=86_400).contains(&raw.summary_interval_secs) {
        bad(
            "agent.summary_interval_secs",
            format!("must be 1..=86400 (got {})", raw.summary_interval_secs),
        );
    }
    AgentConfig {
        summary_interval: Duration::from_secs(raw.summary_interval_secs),
    }
}

/// Upper bound for retention periods: past this, `Instant`/ms arithmetic
/// could overflow (a "keep forever" value must not wrap to "delete now").
const TEN_YEARS_SECS: u64 = 10 * 365 * 86_400;

fn topic_safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// The name rule of a stream (a source's `name`, an ingest stream): 1..=64
/// letters, digits, '-', '_' or '.', not starting with '_' (names starting
/// with '_' are the agent's own: `_commands`, `_agent`). A stream name is a
/// topic level (`<topic_prefix>/<stream>`), so no '/', '+' or '#'.
pub fn stream_name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && !name.starts_with('_') && name.chars().all(topic_safe)
}

/// Parse `mqtt://host:port` (port defaults to 1883).
fn parse_url(url: &str) -> Result<(String, u16, bool), String> {
    let (rest, tls) = if let Some(r) = url.strip_prefix("mqtt://") {
        (r, false)
    } else if let Some(r) = url.strip_prefix("mqtts://") {
        (r, true)
    } else {
        return Err("must start with mqtt:// or mqtts://".into());
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') || rest.contains('@') {
        return Err("must be mqtt[s]://host[:port]".into());
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) => {
            let port: u16 = p
                .parse()
                .map_err(|_| format!("port {p:?} is not a number 1..=65535"))?;
            if port == 0 {
                return Err("port must be 1..=65535".into());
            }
            (h, port)
        }
        None => (rest, if tls { 8883 } else { 1883 }),
    };
    if host.is_empty() {
        return Err("host is empty".into());
    }
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if !bracketed
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    {
        return Err(format!("host {host:?} is not a host name or address"));
    }
    Ok((host.to_owned(), port, tls))
}
