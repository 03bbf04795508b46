//! [`RawConfig`] → [`Config`]: every range, rule and cross-key check, each
//! problem reported as `key.path: problem (got value)`. One file per section
//! under `validate/`; this one wires them together in the order problems are
//! reported and holds the rules several sections share.

mod bounds;
mod bridge;
mod commands;
mod handlers;
mod ingest;
mod metrics;
mod mqtt;
mod sources;
mod spool;
mod stream;

pub use handlers::placeholders;
#[cfg(test)]
pub(super) use handlers::resolve_credentials;

use super::raw::{RawAgent, RawConfig};
use super::{AgentConfig, CommandsConfig, Config, ConfigError, Problem};
use crate::event::stream::topic_safe;
use crate::os::identity::{self, DeviceIdSource};
use bounds::check_range;
use std::time::Duration;

/// Validate every section of `raw` (from `origin`, used in the error).
///
/// Errors: every problem found, in this order (tests and operators rely on
/// it): `device_id`, `[spool]`, `[mqtt]`, `[agent]`, `[[sources]]` (each
/// checked against `[mqtt]` too), `[commands]` bounds, `[commands.config_push]`,
/// `[metrics]`, `[ingest]` (checked against the sources), and last
/// `[[commands.handlers]]`.
pub(super) fn validate(raw: RawConfig, origin: &str) -> Result<Config, ConfigError> {
    let mut probs: Vec<Problem> = Vec::new();
    let mut bad = |key: &str, msg: String| {
        probs.push(Problem {
            key: key.to_owned(),
            line: None,
            message: msg,
        })
    };

    let (device_id, device_id_source) = validate_device_id(&raw.device_id, &mut bad);
    let spool = spool::validate_spool(&raw.spool, &mut bad);
    let mqtt = mqtt::validate_mqtt(&raw.mqtt, &device_id, &mut bad);
    let agent = validate_agent(&raw.agent, &mut bad);
    let sources = sources::validate_sources(&raw.sources, &device_id, &mqtt, &mut bad);
    // `[commands]` is checked in two parts, its handlers last (after
    // `[metrics]` and `[ingest]`): the order problems have always come in.
    let rc = &raw.commands;
    commands::check_command_bounds(rc, &mut bad);
    let operator_public_keys = commands::operator_keys(&rc.operator_public_keys, &mut bad);
    let config_push = commands::validate_push(&rc.config_push, &mut bad);
    let metrics = metrics::validate_metrics(&raw.metrics, &mut bad);
    let ingest = ingest::validate_ingest(&raw.ingest, &sources, &mut bad);
    let handlers = handlers::validate_handlers(&rc.handlers, &mut bad);
    let signed_serial = raw.signed.as_ref().map(|s| s.serial);
    if signed_serial == Some(0) {
        bad("signed.serial", "must be 1 or more (got 0)".to_owned());
    }

    if !probs.is_empty() {
        return Err(ConfigError {
            origin: origin.to_owned(),
            problems: probs,
            missing_file: false,
        });
    }
    Ok(Config {
        device_id,
        device_id_source,
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
            max_per_minute: rc.max_per_minute,
            max_answers_per_minute: rc.max_answers_per_minute,
            operator_public_keys,
            allow_unsigned: rc.allow_unsigned,
            default_ttl: Duration::from_secs(rc.default_ttl_secs),
            handlers,
        },
        config_push,
        signed_serial,
        metrics,
        ingest,
    })
}

/// `device_id`: trimmed, 1..=64 letters, digits, '-', '_' or '.' (it is a
/// topic level), or `@machine-id` / `@hostname`, replaced by the id they
/// name ([`crate::os::identity`]). Returns the id and where it came from.
fn validate_device_id(raw: &str, bad: &mut impl FnMut(&str, String)) -> (String, DeviceIdSource) {
    let trimmed = raw.trim();
    let (resolved, source) = match trimmed {
        "@machine-id" => {
            let path = identity::machine_id_path();
            (
                identity::from_machine_id(&path),
                DeviceIdSource::MachineId(path),
            )
        }
        "@hostname" => (identity::from_hostname(), DeviceIdSource::Hostname),
        t if t.starts_with('@') => (
            Err(format!(
                "names no known source: \"@machine-id\" or \"@hostname\", or a name of its own (got {raw:?})"
            )),
            DeviceIdSource::Config,
        ),
        t => (Ok(t.to_owned()), DeviceIdSource::Config),
    };
    let device_id = match resolved {
        Ok(id) => id,
        Err(e) => {
            bad("device_id", format!("{trimmed}: {e}"));
            // A stand-in, so the defaults built from it (client id, topic
            // prefix) add no problems of their own.
            return ("unresolved".to_owned(), source);
        }
    };
    if device_id.is_empty() || device_id.len() > 64 || !device_id.chars().all(topic_safe) {
        bad(
            "device_id",
            format!(
                "must be non-empty letters, digits, '-', '_' or '.' (got {:?})",
                raw
            ),
        );
    }
    (device_id, source)
}

/// `[agent]`: `summary_interval_secs` 1..=86400, `rate_window_secs`
/// 2..=86400 (a rate needs two samples a second apart).
fn validate_agent(raw: &RawAgent, bad: &mut impl FnMut(&str, String)) -> AgentConfig {
    check_range(
        "agent.summary_interval_secs",
        raw.summary_interval_secs,
        1..=86_400,
        bad,
    );
    check_range(
        "agent.rate_window_secs",
        raw.rate_window_secs,
        2..=86_400,
        bad,
    );
    AgentConfig {
        summary_interval: Duration::from_secs(raw.summary_interval_secs),
        rate_window: Duration::from_secs(raw.rate_window_secs),
    }
}

/// Upper bound for retention periods: past this, `Instant`/ms arithmetic
/// could overflow (a "keep forever" value must not wrap to "delete now").
const TEN_YEARS_SECS: u64 = 10 * 365 * 86_400;

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
