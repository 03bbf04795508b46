//! `[[sources]]` validation: the keys common to every source, then one
//! function per kind (replay, file, exec, mqtt bridge; system has no keys
//! of its own).

use super::bounds::check_range;
use super::bridge::validate_bridge;
use super::handlers::{check_env, credentials};
use super::stream::stream_settings;
use crate::config::raw::{
    d_interval, RawExecSource, RawFileSource, RawReplaySource, RawSource, RawSourceKind,
};
use crate::event::stream::stream_name_ok;
use crate::mqtt::MqttConfig;
use crate::source::bridge::{BridgeSpec, LoopGuard};
use crate::source::{SourceKind, SourceSpec};
use std::collections::HashSet;
use std::time::Duration;

/// `[[sources]]`: names valid and unique, `interval_ms` 10..=86400000, the
/// kind's own keys (a key of another kind was refused when the file was
/// read, [`crate::config::raw`]), the stream keys; a bridge is also checked
/// against `[mqtt]` (`mqtt`, already validated). A source with a problem is
/// left out (the caller sees the problem).
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
        let name = &rs.stream.name;
        if !stream_name_ok(name) {
            bad(&k("name"), format!("must be 1..=64 letters, digits, '-', '_' or '.', not starting with '_' (got {name:?})"));
        } else if !names.insert(name.clone()) {
            bad(&k("name"), format!("duplicate source name {name:?}"));
        }
        let interval_ms = rs.kind.interval_ms().unwrap_or_else(d_interval);
        check_range(&k("interval_ms"), interval_ms, 10..=86_400_000, bad);
        let mut kind = validate_kind(&rs.kind, name, device_id, &k, bad);
        let settings = stream_settings(&rs.stream, &k, bad);
        if let Some(SourceKind::Mqtt(b)) = &mut kind {
            let streams: Vec<&str> = raw.iter().map(|r| r.stream.name.as_str()).collect();
            check_bridge_against_main((b, &streams), mqtt, &mut bridge_ids, &k, bad);
        }
        if let Some(kind) = kind {
            sources.push(SourceSpec {
                name: name.clone(),
                interval: Duration::from_millis(interval_ms),
                kind,
                settings,
            });
        }
    }
    sources
}

/// The kind-specific part of source `name`, or `None` after reporting a
/// problem.
fn validate_kind(
    kind: &RawSourceKind,
    name: &str,
    device_id: &str,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    match kind {
        RawSourceKind::Replay(r) => validate_replay(r, k, bad),
        RawSourceKind::System(_) => Some(SourceKind::System),
        RawSourceKind::Mqtt(b) => {
            validate_bridge((b, name), device_id, k, bad).map(SourceKind::Mqtt)
        }
        RawSourceKind::File(f) => validate_file(f, k, bad),
        RawSourceKind::Exec(x) => validate_exec(x, k, bad),
    }
}

/// `kind = "replay"`: `path` and `timestamp_columns` required; a one-character
/// `delimiter`; `follow` without `repeat` or `speed`; `speed` >= 0; a known
/// `timezone` and a `timestamp_format` that compiles; a printable `trace_id`.
fn validate_replay(
    rs: &RawReplaySource,
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
    if rs.timestamp_columns.is_empty() {
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
            missing: rs.missing.clone(),
            timestamp_columns: rs.timestamp_columns.clone(),
            timestamp_format: format,
            timezone,
            trace_id: rs.trace_id.clone(),
            columns: rs.columns.clone().into_iter().collect(),
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
    rs: &RawFileSource,
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
    rs: &RawExecSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<SourceKind> {
    let timeout = rs.timeout_ms.unwrap_or(5000);
    check_range(&k("timeout_ms"), timeout, 10..=600_000, bad);
    let max_out = rs.max_output_bytes.unwrap_or(64 * 1024);
    check_range(&k("max_output_bytes"), max_out, 16..=16 * 1024 * 1024, bad);
    let env = rs.env.clone();
    for problem in check_env(&env) {
        bad(&k("env"), problem);
    }
    let credentials = credentials(rs.user.as_deref(), rs.group.as_deref(), k, bad);
    match &rs.program {
        Some(p) if p.is_absolute() => Some(SourceKind::Exec {
            program: p.clone(),
            args: rs.args.clone(),
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
