//! `[mqtt]` validation: URL, TLS files, credentials, limits, protocol.

use super::bounds::{check_range, Bounds};
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
/// `batches` level ([`crate::event::stream::reserved_level`]); limits and timing in range;
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
    let (client_id, topic_prefix) = validate_names(m, device_id, bad);
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
    check_range(
        "mqtt.receipt_timeout_secs",
        m.receipt_timeout_secs,
        10..=86_400,
        bad,
    );
    check_range("mqtt.receipt_window", m.receipt_window, 100..=100_000, bad);
    let receipt_public_keys = receipt_keys(m, retire_on, bad);
    check_backfill(m, bad);
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
        receipt_public_keys,
        holdings_interval: Duration::from_secs(m.holdings_interval_secs),
        backfill_rows_per_sec: m.backfill_rows_per_sec,
    }
}

/// Most keys `mqtt.receipt_public_keys` may list (rotation needs two or
/// three; a fleet with a key per sink a few more).
const MAX_RECEIPT_KEYS: usize = 16;

/// `holdings_interval_secs` 0 (never) or 10..=86400; `backfill_rows_per_sec`
/// 0..=100000.
fn check_backfill(m: &RawMqtt, bad: &mut impl FnMut(&str, String)) {
    if m.holdings_interval_secs != 0 {
        check_range(
            "mqtt.holdings_interval_secs",
            m.holdings_interval_secs,
            10..=86_400,
            bad,
        );
    }
    check_range(
        "mqtt.backfill_rows_per_sec",
        m.backfill_rows_per_sec,
        0..=100_000,
        bad,
    );
}

/// `mqtt.receipt_public_keys`, each 64 hex digits; receipt mode needs one:
/// a receipt retires rows only under a signature by a listed key.
fn receipt_keys(
    m: &RawMqtt,
    retire_on: RetireOn,
    bad: &mut impl FnMut(&str, String),
) -> Vec<crate::event::signature::PublicKey> {
    let mut keys = Vec::new();
    for (i, k) in m.receipt_public_keys.iter().enumerate() {
        match crate::event::signature::PublicKey::from_hex(k) {
            Ok(key) => keys.push(key),
            Err(e) => bad(&format!("mqtt.receipt_public_keys[{i}]"), e.to_string()),
        }
    }
    if m.receipt_public_keys.len() > MAX_RECEIPT_KEYS {
        bad(
            "mqtt.receipt_public_keys",
            format!(
                "lists {} keys (at most {MAX_RECEIPT_KEYS})",
                m.receipt_public_keys.len()
            ),
        );
    }
    if retire_on == RetireOn::Receipt && m.receipt_public_keys.is_empty() {
        bad(
            "mqtt.retire_on",
            "\"receipt\" needs mqtt.receipt_public_keys: the public keys of the fleet's sinks (`edgespool keygen --out FILE` prints one; the sink signs with `--receipt-key FILE`); a receipt no listed key signed retires nothing".into(),
        );
    }
    keys
}

/// `client_id` (default `edgespool-<device_id>`) 1..=128 bytes;
/// `topic_prefix` (default `edgespool/<device_id>`) a topic without
/// wildcards, outer `/` or a level the sink reserves. Returns both.
fn validate_names(
    m: &RawMqtt,
    device_id: &str,
    bad: &mut impl FnMut(&str, String),
) -> (String, String) {
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
    } else if topic_prefix
        .split('/')
        .any(crate::event::stream::reserved_level)
    {
        // The sink reads the device from the level before `events` or
        // `batches`: a prefix holding one would name no device there.
        bad("mqtt.topic_prefix", format!("may not have a level named \"events\" or \"batches\": the fleet's sink reads the device id from the level before them (got {topic_prefix:?})"));
    }
    (client_id, topic_prefix)
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
    check_range("mqtt.keep_alive_secs", m.keep_alive_secs, 5..=3600, bad);
    check_range("mqtt.min_share_pct", m.min_share_pct, 0..=50, bad);
    check_range(
        "mqtt.inflight_window",
        m.inflight_window,
        1..=MAX_WINDOW - 1,
        bad,
    );
    check_range(
        "mqtt.max_payload_bytes",
        m.max_payload_bytes,
        1024..=256 * 1024 * 1024,
        bad,
    );
    check_range(
        "mqtt.max_packet_bytes",
        m.max_packet_bytes,
        MIN_PACKET_BYTES..=crate::mqtt::PROTOCOL_MAX_PACKET,
        bad,
    );
}

/// Connect and acknowledgement timeouts, reconnect backoff, disconnects
/// before failing.
fn check_timing(m: &RawMqtt, bad: &mut impl FnMut(&str, String)) {
    check_range(
        "mqtt.connect_timeout_secs",
        m.connect_timeout_secs,
        1..=300,
        bad,
    );
    if m.reconnect_min_ms == 0 || m.reconnect_min_ms > m.reconnect_max_ms {
        bad(
            "mqtt.reconnect_min_ms",
            format!(
                "must be >= 1 and <= mqtt.reconnect_max_ms (got {} and {})",
                m.reconnect_min_ms, m.reconnect_max_ms
            ),
        );
    }
    check_range(
        "mqtt.reconnect_max_ms",
        m.reconnect_max_ms,
        Bounds::le(3_600_000),
        bad,
    );
    check_range(
        "mqtt.fail_after_disconnects",
        m.fail_after_disconnects,
        1..=100,
        bad,
    );
    check_range("mqtt.ack_timeout_secs", m.ack_timeout_secs, 1..=3600, bad);
}
