//! `[mqtt]` validation: URL, TLS files, credentials, limits, protocol.

use super::parse_url;
use crate::config::raw::RawMqtt;
use crate::event::envelope::Format;
use crate::mqtt::ackmap::MAX_WINDOW;
use crate::mqtt::{MqttConfig, Protocol, RetireOn, TlsFiles};
use std::time::Duration;

/// Smallest `mqtt.max_packet_bytes`: mosquitto refuses a `max_packet_size`
/// under 20; 128 leaves room for a topic and a small reading.
const MIN_PACKET_BYTES: usize = 128;

/// `[mqtt]`: `url` mqtt[s]://host[:port]; TLS files with mqtts:// only;
/// `password_file` only with `username`; `client_id` (default
/// `edgespool-<device_id>`) 1..=128 bytes; `topic_prefix` (default
/// `edgespool/<device_id>`) without wildcards and without an `events` or
/// `batches` level ([`crate::sink::identity::reserved`]); limits and timing in range;
/// `protocol` 5 or 3.1.1; `payload_format` json or postcard.
pub(super) fn validate_mqtt(
    m: &RawMqtt,
    device_id: &str,
    bad: &mut impl FnMut(&str, String),
) -> MqttConfig {
    let (host, port, use_tls) = match parse_url(&m.url) {
        Ok(hp) => hp,
        Err(e) => {
            bad("mqtt.url", format!("{e} (got {:?})", m.url));
            (String::new(), 0, false)
        }
    };
    let tls = validate_tls(m, use_tls, bad);
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
    } else if topic_prefix.split('/').any(crate::sink::identity::reserved) {
        // The sink reads the device from the level before `events` or
        // `batches`: a prefix holding one would name no device there.
        bad("mqtt.topic_prefix", format!("may not have a level named \"events\" or \"batches\": the fleet's sink reads the device id from the level before them (got {topic_prefix:?})"));
    }
    check_limits(m, bad);
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
    check_timing(m, bad);
    let retire_on = match m.retire_on.as_str() {
        "puback" => RetireOn::Puback,
        "receipt" => RetireOn::Receipt,
        other => {
            bad(
                "mqtt.retire_on",
                format!("must be \"puback\" or \"receipt\" (got {other:?})"),
            );
            RetireOn::Puback
        }
    };
    if !(10..=86_400).contains(&m.receipt_timeout_secs) {
        bad(
            "mqtt.receipt_timeout_secs",
            format!("must be 10..=86400 (got {})", m.receipt_timeout_secs),
        );
    }
    if !(100..=100_000).contains(&m.receipt_window) {
        bad(
            "mqtt.receipt_window",
            format!("must be 100..=100000 (got {})", m.receipt_window),
        );
    }
    MqttConfig {
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
        min_share_pct: m.min_share_pct,
        retire_on,
        receipt_timeout: Duration::from_secs(m.receipt_timeout_secs),
        receipt_window: m.receipt_window,
    }
}

/// The TLS files: with mqtts:// a CA, and client cert and key both or
/// neither; with mqtt:// none of them.
fn validate_tls(
    m: &RawMqtt,
    use_tls: bool,
    bad: &mut impl FnMut(&str, String),
) -> Option<TlsFiles> {
    if use_tls {
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
    }
}

/// Keep-alive, in-flight window, payload and packet size.
fn check_limits(m: &RawMqtt, bad: &mut impl FnMut(&str, String)) {
    if !(5..=3600).contains(&m.keep_alive_secs) {
        bad(
            "mqtt.keep_alive_secs",
            format!("must be 5..=3600 (got {})", m.keep_alive_secs),
        );
    }
    if m.min_share_pct > 50 {
        bad(
            "mqtt.min_share_pct",
            format!("must be 0..=50 (got {})", m.min_share_pct),
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
}

/// Connect and acknowledgement timeouts, reconnect backoff, disconnects
/// before failing.
fn check_timing(m: &RawMqtt, bad: &mut impl FnMut(&str, String)) {
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
}
