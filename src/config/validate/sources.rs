//! `[[sources]]` validation: the keys common to every source, then one
//! function per kind (replay, file, exec, mqtt bridge; system has no keys).

use super::bridge::validate_bridge;
use super::handlers::{check_env, credentials};
use super::stream::stream_settings;
use crate::config::raw::{d_interval, RawSource};
use crate::config::read::did_you_mean;
use crate::event::stream::stream_name_ok;
use crate::mqtt::MqttConfig;
use crate::source::bridge::{BridgeSpec, LoopGuard};
use crate::source::{SourceKind, SourceSpec};
use std::collections::HashSet;
use std::time::Duration;

/// `[[sources]]`: names valid and unique, `interval_ms` 10..=86400000, no
/// key of another kind, the kind's own keys, `durability` batched|full; a
/// bridge is also checked against `[mqtt]` (`mqtt`, already validated).
/// A source with a problem is left out (the caller sees the problem).
pub(super) fn validate_sources(
    raw: &[RawSource],
    device_id: &str,
    mqtt: &MqttConfig,
    bad: &mut impl FnMut(&str, String),
) -> Vec<SourceSpec> {
    let mut sources = Vec::new();
    let mut names = HashSet::new();
    let mut bridge_ids = HashSet::new();
    for (i, rs) in raw.iter().enumerate() {
        let k = |f: &str| format!("sources[{i}].{f}");
        if !stream_name_ok(&rs.name) {
            bad(&k("name"), format!("must be 1..=64 letters, digits, '-', '_' or '.', not starting with '_' (got {:?})", rs.name));
        } else if !names.insert(rs.name.clone()) {
            bad(&k("name"), format!("duplicate source name {:?}", rs.name));
        }
        let interval_ms = rs.interval_ms.unwrap_or_else(d_interval);
        if !(10..=86_400_000).contains(&interval_ms) {
            bad(
                &k("interval_ms"),
                format!("must be 10..=86400000 (got {interval_ms})"),
            );
        }
        check_kind_keys(rs, &k, bad);
        let mut kind = validate_kind(rs, device_id, &k, bad);
        let settings = stream_settings(rs.stream(), &k, bad);
        if let Some(SourceKind::Mqtt(b)) = &mut kind {
            let streams: Vec<&str> = raw.iter().map(|r| r.name.as_str()).collect();
            check_bridge_against_main((b, &streams), mqtt, &mut bridge_ids, &k, bad);
        }
        if let Some(kind) = kind {
            sources.push(SourceSpec {
                name: rs.name.clone(),
                interval: Duration::from_millis(interval_ms),
                kind,
                settings,
            });
        }
    }
    sources
}

/// Every optional key set on a source must belong to its kind. `k` makes
/// the key path of a member.
fn check_kind_keys(
    rs: &RawSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) {
    // Which kinds each optional key belongs to; a key set for another
    // kind is an error naming it, never silently ignored (F16).
    const FILE: &[&str] = &["file"];
    const EXEC: &[&str] = &["exec"];
    const REPLAY: &[&str] = &["replay"];
    const MQTT: &[&str] = &["mqtt"];
    let all_but_mqtt: &[&str] = &["system", "file", "exec", "replay"];
    let owners: [(&str, bool, &[&str]); 32] = [
        ("interval_ms", rs.interval_ms.is_some(), all_but_mqtt),
        ("url", rs.url.is_some(), MQTT),
        ("topics", rs.topics.is_some(), MQTT),
        ("qos", rs.qos.is_some(), MQTT),
        ("client_id", rs.client_id.is_some(), MQTT),
        ("username", rs.username.is_some(), MQTT),
        ("password_file", rs.password_file.is_some(), MQTT),
        ("payload", rs.payload.is_some(), MQTT),
        ("id_field", rs.id_field.is_some(), MQTT),
        ("max_payload_bytes", rs.max_payload_bytes.is_some(), MQTT),
        ("path", rs.path.is_some(), &["file", "replay"]),
        ("scale", rs.scale.is_some(), FILE),
        ("offset", rs.offset.is_some(), FILE),
        ("field", rs.field.is_some(), &["file", "exec"]),
        ("program", rs.program.is_some(), EXEC),
        ("args", rs.args.is_some(), EXEC),
        ("timeout_ms", rs.timeout_ms.is_some(), EXEC),
        ("max_output_bytes", rs.max_output_bytes.is_some(), EXEC),
        ("env", rs.env.is_some(), EXEC),
        ("user", rs.user.is_some(), EXEC),
        ("group", rs.group.is_some(), EXEC),
        ("delimiter", rs.delimiter.is_some(), REPLAY),
        ("decimal_comma", rs.decimal_comma.is_some(), REPLAY),
        ("missing", rs.missing.is_some(), REPLAY),
        ("timestamp_columns", rs.timestamp_columns.is_some(), REPLAY),
        ("timestamp_format", rs.timestamp_format.is_some(), REPLAY),
        ("columns", rs.columns.is_some(), REPLAY),
        ("speed", rs.speed.is_some(), REPLAY),
        ("repeat", rs.repeat.is_some(), REPLAY),
        ("follow", rs.follow.is_some(), REPLAY),
        ("timezone", rs.timezone.is_some(), REPLAY),
        ("trace_id", rs.trace_id.is_some(), REPLAY),
    ];
    if ["system", "file", "exec", "replay", "mqtt"].contains(&rs.kind.as_str()) {
        for (f, present, kinds) in owners {
            if present && !kinds.contains(&rs.kind.as_str()) {
                bad(&k(f), format!("not used by kind {:?}", rs.kind));
            }
        }
    }
}

/// The kind-specific part of a source, or `None` after reporting a problem.
fn validate_kind(
    rs: &RawSource,
    device_id: &str,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    match rs.kind.as_str() {
        "replay" => validate_replay(rs, k, bad),
        "system" => Some(SourceKind::System),
        "mqtt" => validate_bridge(rs, device_id, k, bad).map(SourceKind::Mqtt),
        "file" => validate_file(rs, k, bad),
        "exec" => validate_exec(rs, k, bad),
        other => {
            let known = [
                "system".to_owned(),
                "file".to_owned(),
                "exec".to_owned(),
                "replay".to_owned(),
                "mqtt".to_owned(),
            ];
            let hint = did_you_mean(other, &known)
                .map(|s| format!("; did you mean {s:?}?"))
                .unwrap_or_default();
            bad(
                    &k("kind"),
                    format!("must be \"system\", \"file\", \"exec\", \"replay\" or \"mqtt\" (got {other:?}){hint}"),
                );
            None
        }
    }
}

/// `kind = "replay"`: `path` and `timestamp_columns` required; a one-character
/// `delimiter`; `follow` without `repeat` or `speed`; `speed` >= 0; a known
/// `timezone` and a `timestamp_format` that compiles; a printable `trace_id`.
fn validate_replay(
    rs: &RawSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    let delimiter = rs.delimiter.clone().unwrap_or_else(|| ",".into());
    let mut chars = delimiter.chars();
    let delim = match (chars.next(), chars.next()) {
        (Some(c), None) if c.is_ascii() && !matches!(c, '\n' | '\r' | '"') => c,
        _ => {
            bad(
                            &k("delimiter"),
                            format!("must be one ASCII character other than a quote or a line break (got {delimiter:?})"),
                        );
            ','
        }
    };
    let follow = rs.follow.unwrap_or(false);
    if follow && rs.repeat == Some(true) {
        bad(
                        &k("follow"),
                        "follow = true cannot be combined with repeat = true: a followed file has no end to start over from".into(),
                    );
    }
    if follow && rs.speed.is_some() {
        bad(
            &k("speed"),
            "not used with follow = true: a followed file's rows are played as they are written"
                .into(),
        );
    }
    let speed = rs.speed.unwrap_or(if follow { 0.0 } else { 1.0 });
    if !speed.is_finite() || speed < 0.0 {
        bad(&k("speed"), format!("must be >= 0 (trace seconds per second; 0 = as fast as interval_ms allows) (got {speed})"));
    }
    let format = rs.timestamp_format.clone().unwrap_or_default();
    let timezone = rs.timezone.clone().unwrap_or_else(|| "UTC".into());
    if let Err(e) = crate::source::replay::parse_timezone(&timezone) {
        bad(&k("timezone"), e);
    } else if let Err(e) = crate::source::replay::TsFormat::compile(&format, &timezone) {
        bad(&k("timestamp_format"), format!("{e} (got {format:?})"));
    }
    if let Some(id) = &rs.trace_id {
        if id.is_empty() || id.len() > 128 || id.chars().any(char::is_control) {
            bad(
                &k("trace_id"),
                format!("must be 1..=128 printable characters (got {id:?})"),
            );
        }
    }
    let ts_cols = rs.timestamp_columns.clone().unwrap_or_default();
    if ts_cols.is_empty() {
        bad(
            &k("timestamp_columns"),
            "required for kind \"replay\": the column(s) holding each row's time".into(),
        );
    }
    match &rs.path {
        Some(p) => Some(SourceKind::Replay(crate::source::replay::ReplaySpec {
            path: p.clone(),
            delimiter: delim,
            decimal_comma: rs.decimal_comma.unwrap_or(false),
            missing: rs.missing.clone().unwrap_or_default(),
            timestamp_columns: ts_cols,
            timestamp_format: format,
            timezone,
            trace_id: rs.trace_id.clone(),
            columns: rs.columns.clone().unwrap_or_default().into_iter().collect(),
            speed,
            max_rows_per_call: 1000,
            repeat: rs.repeat.unwrap_or(false),
            follow,
        })),
        None => {
            bad(&k("path"), "required for kind \"replay\"".into());
            None
        }
    }
}

/// `kind = "file"`: `path` required; finite `scale` and `offset`.
fn validate_file(
    rs: &RawSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    let scale = rs.scale.unwrap_or(1.0);
    let offset = rs.offset.unwrap_or(0.0);
    if !scale.is_finite() || !offset.is_finite() {
        bad(
            &k("scale"),
            format!("scale and offset must be finite (got {scale}, {offset})"),
        );
    }
    match &rs.path {
        Some(p) => Some(SourceKind::File {
            path: p.clone(),
            scale,
            offset,
            field: rs.field.clone().unwrap_or_else(|| "value".into()),
        }),
        None => {
            bad(&k("path"), "required for kind \"file\"".into());
            None
        }
    }
}

/// `kind = "exec"`: an absolute `program` (no shell, no PATH lookup);
/// `timeout_ms` 10..=600000; `max_output_bytes` 16..=16 MiB; `env`,
/// `user` and `group` as a handler's.
fn validate_exec(
    rs: &RawSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    let timeout = rs.timeout_ms.unwrap_or(5000);
    if !(10..=600_000).contains(&timeout) {
        bad(
            &k("timeout_ms"),
            format!("must be 10..=600000 (got {timeout})"),
        );
    }
    let max_out = rs.max_output_bytes.unwrap_or(64 * 1024);
    if !(16..=16 * 1024 * 1024).contains(&max_out) {
        bad(
            &k("max_output_bytes"),
            format!("must be 16..=16777216 (got {max_out})"),
        );
    }
    let env = rs.env.clone().unwrap_or_default();
    for problem in check_env(&env) {
        bad(&k("env"), problem);
    }
    let credentials = credentials(rs.user.as_deref(), rs.group.as_deref(), k, bad);
    match &rs.program {
        Some(p) if p.is_absolute() => Some(SourceKind::Exec {
            program: p.clone(),
            args: rs.args.clone().unwrap_or_default(),
            timeout: Duration::from_millis(timeout),
            field: rs.field.clone().unwrap_or_else(|| "value".into()),
            max_output_bytes: max_out,
            env,
            credentials,
        }),
        Some(p) => {
            bad(
                &k("program"),
                format!("must be an absolute path; no shell or PATH lookup is used (got {p:?})"),
            );
            None
        }
        None => {
            bad(&k("program"), "required for kind \"exec\"".into());
            None
        }
    }
}

/// A bridge against the main connection (`[mqtt]`) and the other bridges:
/// its client id must be its own (two sessions under one client id take
/// each other's place at every connect), and on the main broker its topics
/// must not take any of the agent's events back (a loop: its own, another
/// bridge's, which then takes these, or the agent's `_` streams). `streams`
/// are the configured source names.
///
/// One broker is judged by address, not text
/// ([`crate::source::bridge::loopguard::same_broker`]: `127.1`,
/// `2130706433`, `[::ffff:127.0.0.1]`, `localhost` are `127.0.0.1`). Names
/// only a resolver can answer are left to the bridge's start: a bridge
/// whose topics would loop gets a [`LoopGuard`] to resolve both then.
fn check_bridge_against_main(
    (b, streams): (&mut BridgeSpec, &[&str]),
    mqtt: &MqttConfig,
    bridge_ids: &mut HashSet<String>,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) {
    let topic_prefix = &mqtt.topic_prefix;
    let same_broker =
        crate::source::bridge::loopguard::same_broker((&b.host, b.port), (&mqtt.host, mqtt.port));
    if !bridge_ids.insert(b.client_id.clone()) || (same_broker && b.client_id == mqtt.client_id) {
        // Two sessions under one client id take each other's place at every connect.
        bad(
            &k("client_id"),
            format!(
                "{:?} is already the client id of another connection to that broker",
                b.client_id
            ),
        );
    }
    let ours = streams
        .iter()
        .copied()
        .chain(["_agent", "_commands"])
        .map(|s| format!("{topic_prefix}/events/{s}"));
    for own in ours {
        let Some(t) = b
            .topics
            .iter()
            .find(|t| crate::source::bridge::filter_matches(t, &own))
        else {
            continue;
        };
        if same_broker {
            bad(
                &k("topics"),
                format!(
                    "{t:?} takes the agent's own events ({own}) back from mqtt.url ({}:{} is mqtt://{}:{}): a loop",
                    b.host, b.port, mqtt.host, mqtt.port
                ),
            );
        } else {
            b.loop_guard = Some(LoopGuard {
                main_host: mqtt.host.clone(),
                main_port: mqtt.port,
                topic: t.clone(),
                own,
            });
        }
        return;
    }
}
