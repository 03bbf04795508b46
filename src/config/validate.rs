//! [`RawConfig`] → [`Config`]: every range, rule and cross-key check, each
//! problem reported as `key.path: problem (got value)`.

use super::raw::*;
use super::read::did_you_mean;
use super::{
    pattern_matches, AgentConfig, CommandsConfig, Config, ConfigError, ConfigPush, ExecHandler,
    ExplicitKeys, IngestConfig, IngestStream, MetricsConfig, MqttConfig, ParamKind, ParamSpec,
    Problem, Protocol, SpoolConfig, TlsFiles, DEFAULT_STREAM_PRIORITY,
};
use crate::ack::MAX_WINDOW;
use crate::envelope::Format;
use crate::process::{Credentials, Limits};
use crate::source::{SourceKind, SourceSpec};
use crate::spool::{SpoolOptions, Synchronous};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub(super) fn validate(raw: RawConfig, origin: &str) -> Result<Config, ConfigError> {
    let mut probs: Vec<Problem> = Vec::new();
    let mut bad = |key: &str, msg: String| {
        probs.push(Problem {
            key: key.to_owned(),
            line: None,
            message: msg,
        })
    };

    let device_id = raw.device_id.trim().to_owned();
    if device_id.is_empty() || device_id.len() > 64 || !device_id.chars().all(topic_safe) {
        bad(
            "device_id",
            format!(
                "must be non-empty letters, digits, '-', '_' or '.' (got {:?})",
                raw.device_id
            ),
        );
    }

    let s = &raw.spool;
    if s.path.as_os_str().is_empty() || s.path.as_os_str().as_encoded_bytes().contains(&0) {
        bad(
            "spool.path",
            format!(
                "must be a non-empty path without NUL bytes (got {:?})",
                s.path
            ),
        );
    }
    if s.acked_retention_secs > TEN_YEARS_SECS {
        bad(
            "spool.acked_retention_secs",
            format!(
                "must be at most {TEN_YEARS_SECS} (ten years) (got {})",
                s.acked_retention_secs
            ),
        );
    }
    let synchronous = match s.synchronous.to_ascii_lowercase().as_str() {
        "normal" => Synchronous::Normal,
        "full" => Synchronous::Full,
        other => {
            bad(
                "spool.synchronous",
                format!("must be \"normal\" or \"full\" (got {other:?}); OFF is never allowed"),
            );
            Synchronous::Normal
        }
    };
    if s.busy_timeout_ms < 5000 {
        bad(
            "spool.busy_timeout_ms",
            format!("must be at least 5000 (got {})", s.busy_timeout_ms),
        );
    }
    if s.journal_size_limit_bytes < 0 {
        bad(
            "spool.journal_size_limit_bytes",
            format!("must be >= 0 (got {})", s.journal_size_limit_bytes),
        );
    }
    if s.wal_autocheckpoint_pages < 0 {
        bad(
            "spool.wal_autocheckpoint_pages",
            format!("must be >= 0 (got {})", s.wal_autocheckpoint_pages),
        );
    }
    let commit_window_ms = s.commit_window_ms.unwrap_or_else(d_commit);
    if !(1..=60_000).contains(&commit_window_ms) {
        bad(
            "spool.commit_window_ms",
            format!("must be 1..=60000 (got {commit_window_ms})"),
        );
    }
    if !(1..=100_000).contains(&s.purge_batch_rows) {
        bad(
            "spool.purge_batch_rows",
            format!("must be 1..=100000 (got {})", s.purge_batch_rows),
        );
    }
    if s.max_bytes != 0 && s.max_bytes < 1024 * 1024 {
        bad(
            "spool.max_bytes",
            format!(
                "must be 0 (no limit) or at least 1048576 (got {})",
                s.max_bytes
            ),
        );
    }
    let checkpoint_wal_bytes = s.checkpoint_wal_bytes.unwrap_or_else(d_ckpt_wal);
    if !(64 * 1024..=1024 * 1024 * 1024).contains(&checkpoint_wal_bytes) {
        bad(
            "spool.checkpoint_wal_bytes",
            format!("must be 65536..=1073741824 (got {checkpoint_wal_bytes})"),
        );
    }
    if !(1..=86_400).contains(&s.checkpoint_interval_secs) {
        bad(
            "spool.checkpoint_interval_secs",
            format!("must be 1..=86400 (got {})", s.checkpoint_interval_secs),
        );
    }

    let m = &raw.mqtt;
    let (host, port, use_tls) = match parse_url(&m.url) {
        Ok(hp) => hp,
        Err(e) => {
            bad("mqtt.url", format!("{e} (got {:?})", m.url));
            (String::new(), 0, false)
        }
    };
    let tls = if use_tls {
        match (&m.ca_file, &m.client_cert_file, &m.client_key_file) {
            (None, _, _) => {
                bad(
                    "mqtt.ca_file",
                    "required with mqtts:// (PEM CA certificate of the broker)".into(),
                );
                None
            }
            (Some(ca), Some(c), Some(k)) => Some(TlsFiles {
                ca_file: ca.clone(),
                client: Some((c.clone(), k.clone())),
            }),
            (Some(ca), None, None) => Some(TlsFiles {
                ca_file: ca.clone(),
                client: None,
            }),
            (Some(_), c, _) => {
                let missing = if c.is_none() {
                    "mqtt.client_cert_file"
                } else {
                    "mqtt.client_key_file"
                };
                bad(
                    missing,
                    "client_cert_file and client_key_file go together".into(),
                );
                None
            }
        }
    } else {
        for (key, set) in [
            ("ca_file", m.ca_file.is_some()),
            ("client_cert_file", m.client_cert_file.is_some()),
            ("client_key_file", m.client_key_file.is_some()),
        ] {
            if set {
                bad(
                    &format!("mqtt.{key}"),
                    "only used with an mqtts:// url".into(),
                );
            }
        }
        None
    };
    let credentials = match (&m.username, &m.password_file) {
        (Some(u), p) => Some((u.clone(), p.clone())),
        (None, Some(_)) => {
            bad("mqtt.password_file", "needs mqtt.username".into());
            None
        }
        (None, None) => None,
    };
    let client_id = m
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edgespool-{device_id}"));
    if client_id.is_empty() || client_id.len() > 128 {
        bad(
            "mqtt.client_id",
            format!("must be 1..=128 bytes (got {client_id:?})"),
        );
    }
    let topic_prefix = m
        .topic_prefix
        .clone()
        .unwrap_or_else(|| format!("edgespool/{device_id}"));
    if topic_prefix.is_empty()
        || topic_prefix.contains(['#', '+', '\0'])
        || topic_prefix.starts_with('/')
        || topic_prefix.ends_with('/')
    {
        bad("mqtt.topic_prefix", format!("must be a non-empty topic without wildcards or leading/trailing '/' (got {topic_prefix:?})"));
    }
    if !(5..=3600).contains(&m.keep_alive_secs) {
        bad(
            "mqtt.keep_alive_secs",
            format!("must be 5..=3600 (got {})", m.keep_alive_secs),
        );
    }
    if !(1..MAX_WINDOW).contains(&m.inflight_window) {
        bad(
            "mqtt.inflight_window",
            format!("must be 1..={} (got {})", MAX_WINDOW - 1, m.inflight_window),
        );
    }
    if !(1024..=256 * 1024 * 1024).contains(&m.max_payload_bytes) {
        bad(
            "mqtt.max_payload_bytes",
            format!("must be 1024..=268435456 (got {})", m.max_payload_bytes),
        );
    }
    if !(MIN_PACKET_BYTES..=crate::mqtt::PROTOCOL_MAX_PACKET).contains(&m.max_packet_bytes) {
        bad(
            "mqtt.max_packet_bytes",
            format!(
                "must be {MIN_PACKET_BYTES}..={} (got {})",
                crate::mqtt::PROTOCOL_MAX_PACKET,
                m.max_packet_bytes
            ),
        );
    }
    let protocol = match m.protocol.as_str() {
        "5" | "5.0" => Protocol::V5,
        "3.1.1" => Protocol::V311,
        other => {
            bad(
                "mqtt.protocol",
                format!("must be \"5\" or \"3.1.1\" (got {other:?})"),
            );
            Protocol::V5
        }
    };
    let payload_format = match m.payload_format.as_str() {
        "json" => Format::Json,
        "postcard" => Format::Postcard,
        other => {
            bad(
                "mqtt.payload_format",
                format!("must be \"json\" or \"postcard\" (got {other:?})"),
            );
            Format::Json
        }
    };
    if !(1..=300).contains(&m.connect_timeout_secs) {
        bad(
            "mqtt.connect_timeout_secs",
            format!("must be 1..=300 (got {})", m.connect_timeout_secs),
        );
    }
    if m.reconnect_min_ms == 0 || m.reconnect_min_ms > m.reconnect_max_ms {
        bad(
            "mqtt.reconnect_min_ms",
            format!(
                "must be >= 1 and <= mqtt.reconnect_max_ms (got {} and {})",
                m.reconnect_min_ms, m.reconnect_max_ms
            ),
        );
    }
    if m.reconnect_max_ms > 3_600_000 {
        bad(
            "mqtt.reconnect_max_ms",
            format!("must be <= 3600000 (got {})", m.reconnect_max_ms),
        );
    }
    if !(1..=100).contains(&m.fail_after_disconnects) {
        bad(
            "mqtt.fail_after_disconnects",
            format!("must be 1..=100 (got {})", m.fail_after_disconnects),
        );
    }
    if !(1..=3600).contains(&m.ack_timeout_secs) {
        bad(
            "mqtt.ack_timeout_secs",
            format!("must be 1..=3600 (got {})", m.ack_timeout_secs),
        );
    }
    if !(1..=86_400).contains(&raw.agent.summary_interval_secs) {
        bad(
            "agent.summary_interval_secs",
            format!(
                "must be 1..=86400 (got {})",
                raw.agent.summary_interval_secs
            ),
        );
    }

    let mut sources = Vec::new();
    let mut names = std::collections::HashSet::new();
    let mut bridge_ids = std::collections::HashSet::new();
    for (i, rs) in raw.sources.iter().enumerate() {
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
        // Which kinds each optional key belongs to; a key set for another
        // kind is an error naming it, never silently ignored (F16).
        const FILE: &[&str] = &["file"];
        const EXEC: &[&str] = &["exec"];
        const REPLAY: &[&str] = &["replay"];
        const MQTT: &[&str] = &["mqtt"];
        let all_but_mqtt: &[&str] = &["system", "file", "exec", "replay"];
        let owners: [(&str, bool, &[&str]); 29] = [
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
        let kind = match rs.kind.as_str() {
            "replay" => {
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
                        "not used with follow = true: a followed file's rows are played as they are written".into(),
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
                } else if let Err(e) = crate::source::replay::TsFormat::compile(&format, &timezone)
                {
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
                        "required for kind \"replay\": the column(s) holding each row's time"
                            .into(),
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
            "system" => Some(SourceKind::System),
            "mqtt" => validate_bridge(rs, &device_id, &k, &mut bad).map(SourceKind::Mqtt),
            "file" => {
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
            "exec" => {
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
                match &rs.program {
                    Some(p) if p.is_absolute() => Some(SourceKind::Exec {
                        program: p.clone(),
                        args: rs.args.clone().unwrap_or_default(),
                        timeout: Duration::from_millis(timeout),
                        field: rs.field.clone().unwrap_or_else(|| "value".into()),
                        max_output_bytes: max_out,
                    }),
                    Some(p) => {
                        bad(&k("program"), format!("must be an absolute path; no shell or PATH lookup is used (got {p:?})"));
                        None
                    }
                    None => {
                        bad(&k("program"), "required for kind \"exec\"".into());
                        None
                    }
                }
            }
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
        };
        let durability = match rs.durability.as_deref() {
            None | Some("batched") => crate::source::Durability::Batched,
            Some("full") => crate::source::Durability::Full,
            Some(other) => {
                bad(
                    &k("durability"),
                    format!("must be \"batched\" or \"full\" (got {other:?})"),
                );
                crate::source::Durability::Batched
            }
        };
        if let Some(SourceKind::Mqtt(b)) = &kind {
            let same_broker = b.host == host && b.port == port;
            if !bridge_ids.insert(b.client_id.clone()) || (same_broker && b.client_id == client_id)
            {
                // Two sessions under one client id take each other's place at every connect.
                bad(
                    &k("client_id"),
                    format!(
                        "{:?} is already the client id of another connection to that broker",
                        b.client_id
                    ),
                );
            }
            let own = format!("{topic_prefix}/events/{}", rs.name);
            if let Some(t) = b
                .topics
                .iter()
                .find(|t| same_broker && crate::source::bridge::filter_matches(t, &own))
            {
                bad(
                    &k("topics"),
                    format!(
                        "{t:?} takes this source's own events ({own}) back from mqtt.url: a loop"
                    ),
                );
            }
        }
        if let Some(kind) = kind {
            sources.push(SourceSpec {
                name: rs.name.clone(),
                interval: Duration::from_millis(interval_ms),
                kind,
                durability,
            });
        }
    }

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
        spool: SpoolConfig {
            path: s.path.clone(),
            options: SpoolOptions {
                synchronous,
                busy_timeout: Duration::from_millis(s.busy_timeout_ms),
                journal_size_limit_bytes: s.journal_size_limit_bytes,
                wal_autocheckpoint_pages: s.wal_autocheckpoint_pages,
            },
            commit_window: Duration::from_millis(commit_window_ms),
            acked_retention: Duration::from_secs(s.acked_retention_secs),
            purge_batch_rows: s.purge_batch_rows,
            checkpoint_interval: Duration::from_secs(s.checkpoint_interval_secs),
            allow_network_fs: s.allow_network_fs,
            capacity: crate::maintenance::Capacity {
                max_bytes: s.max_bytes,
                min_free_bytes: s.min_free_bytes,
            },
            checkpoint_wal_bytes,
            tune_from_probe: s.tune_from_probe,
            explicit: ExplicitKeys {
                commit_window: s.commit_window_ms.is_some(),
                checkpoint_wal_bytes: s.checkpoint_wal_bytes.is_some(),
            },
        },
        mqtt: MqttConfig {
            tls,
            credentials,
            host,
            port,
            client_id,
            topic_prefix,
            keep_alive: Duration::from_secs(m.keep_alive_secs),
            clean_session: m.clean_session,
            inflight_window: m.inflight_window,
            max_payload_bytes: m.max_payload_bytes,
            max_packet_bytes: m.max_packet_bytes,
            payload_format,
            connect_timeout: Duration::from_secs(m.connect_timeout_secs),
            reconnect_min: Duration::from_millis(m.reconnect_min_ms),
            reconnect_max: Duration::from_millis(m.reconnect_max_ms),
            ack_timeout: Duration::from_secs(m.ack_timeout_secs),
            fail_after_disconnects: m.fail_after_disconnects,
            status_topic: m.status_topic,
            protocol,
            session_expiry_secs: m.session_expiry_secs,
        },
        agent: AgentConfig {
            summary_interval: Duration::from_secs(raw.agent.summary_interval_secs),
        },
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

/// `kind = "mqtt"`: the local-broker bridge ([`crate::source::bridge`]).
/// `url` mqtt://host[:port] (no TLS: the broker is local), `topics` valid
/// filters (MQTT 3.1.1 §4.7), `qos` 1 (0 and 2 refused, each saying why), `client_id` 1..=128 bytes,
/// `password_file` only with `username`, `payload` json|number|auto,
/// `max_payload_bytes` 16..=16 MiB. `k` makes the key path of a member.
pub(super) fn validate_bridge(
    rs: &RawSource,
    device_id: &str,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<crate::source::bridge::BridgeSpec> {
    use crate::source::bridge::{self, BridgeSpec, PayloadFormat, PayloadSettings};
    let url = rs.url.clone().unwrap_or_else(d_url);
    let addr = match parse_url(&url) {
        Ok((_, _, true)) => {
            bad(&k("url"), format!("must be mqtt://host[:port]: the bridge reads a broker on this board or its LAN, without TLS (got {url:?})"));
            None
        }
        Ok((host, port, false)) => Some((host, port)),
        Err(e) => {
            bad(&k("url"), format!("{e} (got {url:?})"));
            None
        }
    };
    let topics = rs.topics.clone().unwrap_or_default();
    if topics.is_empty() {
        bad(
            &k("topics"),
            "required for kind \"mqtt\": at least one topic filter, e.g. [\"plant/#\"]".into(),
        );
    }
    for (j, t) in topics.iter().enumerate() {
        if let Err(e) = bridge::check_filter(t) {
            bad(&format!("{}[{j}]", k("topics")), format!("{e} (got {t:?})"));
        }
    }
    let qos = match rs.qos.unwrap_or(1) {
        1 => rumqttc::QoS::AtLeastOnce,
        0 => {
            bad(&k("qos"), "0 cannot be made durable: a QoS 0 message is neither queued for the bridge while it is down nor acknowledged after its commit; use 1".into());
            rumqttc::QoS::AtLeastOnce
        }
        2 => {
            // Reproduced against mosquitto 2.0.11: a session left waiting
            // for our PUBCOMP makes rumqttc end every new connection with
            // "unsolicited ack" (it keeps no QoS 2 state across connections).
            bad(&k("qos"), "2 is not offered: rumqttc keeps no QoS 2 state across connections, so a PUBREL the broker resends after a reconnect ends every new connection; use 1 (with id_field for one event per message)".into());
            rumqttc::QoS::AtLeastOnce
        }
        q => {
            bad(&k("qos"), format!("must be 1 (got {q})"));
            rumqttc::QoS::AtLeastOnce
        }
    };
    let client_id = rs
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edgespool-bridge-{device_id}-{}", rs.name));
    if client_id.is_empty() || client_id.len() > 128 {
        bad(
            &k("client_id"),
            format!("must be 1..=128 bytes (got {client_id:?})"),
        );
    }
    let credentials = match (&rs.username, &rs.password_file) {
        (Some(u), p) => Some((u.clone(), p.clone())),
        (None, Some(_)) => {
            bad(&k("password_file"), format!("needs {}", k("username")));
            None
        }
        (None, None) => None,
    };
    let format = match rs.payload.as_deref() {
        None | Some("auto") => PayloadFormat::Auto,
        Some("json") => PayloadFormat::Json,
        Some("number") => PayloadFormat::Number,
        Some(other) => {
            bad(
                &k("payload"),
                format!("must be \"json\", \"number\" or \"auto\" (got {other:?})"),
            );
            PayloadFormat::Auto
        }
    };
    if let Some(id) = &rs.id_field {
        if id.is_empty() || id.len() > 256 {
            bad(
                &k("id_field"),
                format!("must be a member name of 1..=256 bytes (got {id:?})"),
            );
        } else if id == bridge::TOPIC_FIELD {
            bad(
                &k("id_field"),
                format!(
                    "{:?} is the field the bridge writes the topic into",
                    bridge::TOPIC_FIELD
                ),
            );
        }
    }
    let max_payload_bytes = rs.max_payload_bytes.unwrap_or(bridge::DEFAULT_MAX_PAYLOAD);
    if !(16..=16 * 1024 * 1024).contains(&max_payload_bytes) {
        bad(
            &k("max_payload_bytes"),
            format!("must be 16..=16777216 (got {max_payload_bytes})"),
        );
    }
    let (host, port) = addr?;
    Some(BridgeSpec {
        host,
        port,
        topics,
        qos,
        client_id,
        credentials,
        payload: PayloadSettings {
            format,
            max_payload_bytes,
            id_field: rs.id_field.clone(),
        },
    })
}

/// `[metrics]`: an absolute textfile path; a literal `IP:port` to listen on,
/// loopback unless `listen_public` (the listener is attack surface).
pub(super) fn validate_metrics(
    raw: &RawMetrics,
    bad: &mut impl FnMut(&str, String),
) -> MetricsConfig {
    if let Some(p) = &raw.textfile {
        let nul = p.as_os_str().as_encoded_bytes().contains(&0);
        if !p.is_absolute() || nul || p.file_name().is_none() {
            bad(
                "metrics.textfile",
                format!("must be an absolute file path without NUL bytes (got {p:?})"),
            );
        }
    }
    let listen = raw.listen.as_deref().and_then(|l| {
        match l.parse::<std::net::SocketAddr>() {
            Ok(a) if a.port() == 0 => {
                bad("metrics.listen", format!("needs a port, 1..=65535 (got {l:?})"));
                None
            }
            Ok(a) if !a.ip().is_loopback() && !raw.listen_public => {
                bad(
                    "metrics.listen",
                    format!("{l:?} is not a loopback address: metrics would be served to other hosts; use 127.0.0.1:<port>, or set metrics.listen_public = true to mean it"),
                );
                None
            }
            Ok(a) => Some(a),
            Err(_) => {
                bad(
                    "metrics.listen",
                    format!("must be IP:port, e.g. \"127.0.0.1:9469\" or \"[::1]:9469\"; host names are not resolved (got {l:?})"),
                );
                None
            }
        }
    });
    if raw.listen_public && raw.listen.is_none() {
        bad(
            "metrics.listen_public",
            "only used with metrics.listen".to_owned(),
        );
    }
    MetricsConfig {
        textfile: raw.textfile.clone(),
        listen,
        listen_public: raw.listen_public,
    }
}

/// `[ingest]`: listeners (a socket path, a loopback `IP:port` unless
/// `tcp_public`), bounds in range, and the streams clients may write: valid
/// names, not a source's stream, no duplicates; patterns `prefix*`.
pub(super) fn validate_ingest(
    raw: &RawIngest,
    sources: &[SourceSpec],
    bad: &mut impl FnMut(&str, String),
) -> IngestConfig {
    let d = IngestConfig::default();
    if let Some(p) = &raw.socket {
        let nul = p.as_os_str().as_encoded_bytes().contains(&0);
        // sun_path holds 108 bytes with its NUL (unix(7)).
        if !p.is_absolute() || nul || p.file_name().is_none() || p.as_os_str().len() > 107 {
            bad(
                "ingest.socket",
                format!("must be an absolute file path of at most 107 bytes without NUL bytes (got {p:?})"),
            );
        }
    }
    if let Some(g) = &raw.socket_group {
        let name_ok = !g.is_empty()
            && g.len() <= 32
            && g.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !name_ok {
            bad(
                "ingest.socket_group",
                format!("must be a group name or a numeric gid (got {g:?})"),
            );
        }
        if raw.socket.is_none() {
            bad("ingest.socket_group", "only used with ingest.socket".into());
        }
    }
    let socket_mode = match raw.socket_mode.as_deref() {
        None => d.socket_mode,
        Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
            Ok(v) if v <= 0o777 && v & 0o600 == 0o600 && v & 0o002 == 0 => v,
            _ => {
                bad(
                    "ingest.socket_mode",
                    format!("must be octal permission bits with the owner's read and write and without others' write, e.g. \"0660\" (got {m:?})"),
                );
                d.socket_mode
            }
        },
    };
    let tcp = raw.tcp.as_deref().and_then(|l| match l.parse::<std::net::SocketAddr>() {
        Ok(a) if a.port() == 0 => {
            bad("ingest.tcp", format!("needs a port, 1..=65535 (got {l:?})"));
            None
        }
        Ok(a) if !a.ip().is_loopback() && !raw.tcp_public => {
            bad(
                "ingest.tcp",
                format!("{l:?} is not a loopback address: any host could write readings; use 127.0.0.1:<port>, or set ingest.tcp_public = true to mean it"),
            );
            None
        }
        Ok(a) => Some(a),
        Err(_) => {
            bad(
                "ingest.tcp",
                format!("must be IP:port, e.g. \"127.0.0.1:7788\"; host names are not resolved (got {l:?})"),
            );
            None
        }
    });
    if raw.tcp_public && raw.tcp.is_none() {
        bad("ingest.tcp_public", "only used with ingest.tcp".into());
    }
    let mut range = |key: &str, got: Option<usize>, lo: usize, hi: usize, def: usize| match got {
        Some(v) if !(lo..=hi).contains(&v) => {
            bad(key, format!("must be {lo}..={hi} (got {v})"));
            def
        }
        Some(v) => v,
        None => def,
    };
    let max_line_bytes = range(
        "ingest.max_line_bytes",
        raw.max_line_bytes,
        256,
        1 << 20,
        d.max_line_bytes,
    );
    let max_connections = range(
        "ingest.max_connections",
        raw.max_connections,
        1,
        1024,
        d.max_connections,
    );
    let max_fields = range("ingest.max_fields", raw.max_fields, 1, 1024, d.max_fields);
    let max_rate_per_sec = range(
        "ingest.max_rate_per_sec",
        raw.max_rate_per_sec.map(|v| v as usize),
        1,
        1_000_000,
        d.max_rate_per_sec as usize,
    ) as u32;
    let streams = validate_ingest_streams(raw, sources, bad);
    IngestConfig {
        socket: raw.socket.clone(),
        socket_group: raw.socket_group.clone(),
        socket_mode,
        tcp,
        tcp_public: raw.tcp_public,
        max_line_bytes,
        max_connections,
        max_rate_per_sec,
        max_fields,
        streams,
        stream_patterns: raw.stream_patterns.clone(),
    }
}

/// `[[ingest.streams]]` and `ingest.stream_patterns`: valid names, not a
/// source's stream, no duplicates; patterns `prefix*`; and a listener to go
/// with them (and streams to go with a listener).
pub(super) fn validate_ingest_streams(
    raw: &RawIngest,
    sources: &[SourceSpec],
    bad: &mut impl FnMut(&str, String),
) -> Vec<IngestStream> {
    let enabled = raw.socket.is_some() || raw.tcp.is_some();
    let mut streams = Vec::new();
    let mut names = std::collections::HashSet::new();
    let is_source = |n: &str| sources.iter().any(|s| s.name == n);
    for (i, rs) in raw.streams.iter().enumerate() {
        let k = |f: &str| format!("ingest.streams[{i}].{f}");
        if !stream_name_ok(&rs.name) {
            bad(&k("name"), format!("must be 1..=64 letters, digits, '-', '_' or '.', not starting with '_' (got {:?})", rs.name));
            continue;
        }
        if is_source(&rs.name) {
            bad(
                &k("name"),
                format!(
                    "{:?} is a source's stream; give clients a stream of their own",
                    rs.name
                ),
            );
        } else if !names.insert(rs.name.clone()) {
            bad(&k("name"), format!("duplicate ingest stream {:?}", rs.name));
        }
        let durability = match rs.durability.as_deref() {
            None | Some("batched") => crate::source::Durability::Batched,
            Some("full") => crate::source::Durability::Full,
            Some(other) => {
                bad(
                    &k("durability"),
                    format!("must be \"batched\" or \"full\" (got {other:?})"),
                );
                crate::source::Durability::Batched
            }
        };
        streams.push(IngestStream {
            name: rs.name.clone(),
            durability,
            priority: rs.priority.unwrap_or(DEFAULT_STREAM_PRIORITY),
        });
    }
    for (i, p) in raw.stream_patterns.iter().enumerate() {
        let key = format!("ingest.stream_patterns[{i}]");
        let prefix_ok = p
            .strip_suffix('*')
            .is_some_and(|pre| !pre.is_empty() && stream_name_ok(pre));
        if !prefix_ok {
            bad(
                &key,
                format!(
                    "must be a stream-name prefix followed by '*', e.g. \"plant.*\" (got {p:?})"
                ),
            );
        } else if let Some(s) = sources.iter().find(|s| pattern_matches(p, &s.name)) {
            bad(
                &key,
                format!(
                    "{p:?} matches source {:?}; give clients streams of their own",
                    s.name
                ),
            );
        }
    }
    if !enabled && (!raw.streams.is_empty() || !raw.stream_patterns.is_empty()) {
        bad(
            "ingest",
            "streams are declared but no listener: set ingest.socket or ingest.tcp".into(),
        );
    }
    if enabled && raw.streams.is_empty() && raw.stream_patterns.is_empty() {
        bad("ingest.streams", "a listener is set but no stream is declared: add [[ingest.streams]] or ingest.stream_patterns".into());
    }
    streams
}

pub(super) fn validate_push(raw: &RawConfigPush, bad: &mut impl FnMut(&str, String)) -> ConfigPush {
    use crate::policy::PushMode;
    let mode = match raw.mode.as_str() {
        "off" => PushMode::Off,
        "overlay" => PushMode::Overlay,
        "signed" => PushMode::Signed,
        other => {
            bad(
                "commands.config_push.mode",
                format!("must be \"off\", \"overlay\" or \"signed\" (got {other:?})"),
            );
            PushMode::Off
        }
    };
    if !(5..=3600).contains(&raw.confirm_secs) {
        bad(
            "commands.config_push.confirm_secs",
            format!("must be 5..=3600 (got {})", raw.confirm_secs),
        );
    }
    let mut keys = Vec::new();
    for (i, k) in raw.public_keys.iter().enumerate() {
        match crate::policy::decode_hex(k.trim()).and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            Some(key) => keys.push(key),
            None => bad(
                &format!("commands.config_push.public_keys.{i}"),
                format!("must be an Ed25519 public key, 64 hex digits (got {k:?})"),
            ),
        }
    }
    if mode == PushMode::Signed && raw.public_keys.is_empty() {
        bad(
            "commands.config_push.public_keys",
            "mode \"signed\" needs at least one public key".to_owned(),
        );
    }
    ConfigPush {
        mode,
        confirm: Duration::from_secs(raw.confirm_secs),
        public_keys: keys,
    }
}

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
pub(super) fn env_name_ok(name: &str) -> bool {
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
pub(super) fn resolve_credentials(
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

/// Upper bound for retention periods: past this, `Instant`/ms arithmetic
/// could overflow (a "keep forever" value must not wrap to "delete now").
pub(super) const TEN_YEARS_SECS: u64 = 10 * 365 * 86_400;

pub(super) fn topic_safe(c: char) -> bool {
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
pub(super) fn parse_url(url: &str) -> Result<(String, u16, bool), String> {
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

/// Most variables a handler's `env` may set.
const MAX_ENV_VARS: usize = 64;
/// Longest name in a handler's `env`, bytes.
const MAX_ENV_NAME_BYTES: usize = 128;
/// Longest value in a handler's `env`, bytes.
const MAX_ENV_VALUE_BYTES: usize = 4096;

/// Smallest `mqtt.max_packet_bytes`: mosquitto refuses a `max_packet_size`
/// under 20; 128 leaves room for a topic and a small reading.
const MIN_PACKET_BYTES: usize = 128;
