//! `kind = "mqtt"` source validation: the local-broker bridge.

use super::bounds::check_range;
use super::parse_url;
use crate::config::raw::{d_url, RawBridgeSource};
use crate::source::bridge::{self, BridgeSpec, PayloadFormat, PayloadSettings};
use rumqttc::QoS;

/// `kind = "mqtt"`: the local-broker bridge ([`crate::source::bridge`]) of
/// source `name`. `url` mqtt://host[:port] (no TLS: the broker is local),
/// `topics` valid filters (MQTT 3.1.1 §4.7), `qos` 1 (0 and 2 refused, each
/// saying why), `client_id` 1..=128 bytes, `password_file` only with
/// `username`, `payload` json|number|auto, `max_payload_bytes` 16..=16 MiB.
/// `k` makes the key path of a member.
pub(super) fn validate_bridge(
    (rs, name): (&RawBridgeSource, &str),
    device_id: &str,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<BridgeSpec> {
    let addr = bridge_addr(rs.url.clone().unwrap_or_else(d_url), k, bad);
    if rs.topics.is_empty() {
        bad(
            &k("topics"),
            "required for kind \"mqtt\": at least one topic filter, e.g. [\"plant/#\"]".into(),
        );
    }
    for (j, t) in rs.topics.iter().enumerate() {
        if let Err(e) = bridge::check_filter(t) {
            bad(&format!("{}[{j}]", k("topics")), format!("{e} (got {t:?})"));
        }
    }
    let qos = bridge_qos(rs.qos.unwrap_or(1), k, bad);
    let client_id = rs
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edgespool-bridge-{device_id}-{name}"));
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
    let payload = payload_settings(rs, k, bad);
    let (host, port) = addr?;
    Some(BridgeSpec {
        host,
        port,
        topics: rs.topics.clone(),
        qos,
        client_id,
        credentials,
        payload,
        // Set against [mqtt] by the sources' validation.
        loop_guard: None,
    })
}

/// The bridge's broker from `url`: mqtt://host[:port], never mqtts://.
fn bridge_addr(
    url: String,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<(String, u16)> {
    match parse_url(&url) {
        Ok((_, _, true)) => {
            bad(&k("url"), format!("must be mqtt://host[:port]: the bridge reads a broker on this board or its LAN, without TLS (got {url:?})"));
            None
        }
        Ok((host, port, false)) => Some((host, port)),
        Err(e) => {
            bad(&k("url"), format!("{e} (got {url:?})"));
            None
        }
    }
}

/// `qos`: 1 only; 0 and 2 refused, each saying why (1 assumed after a problem).
fn bridge_qos(qos: u8, k: &impl Fn(&str) -> String, bad: &mut impl FnMut(&str, String)) -> QoS {
    match qos {
        1 => {}
        0 => bad(&k("qos"), "0 cannot be made durable: a QoS 0 message is neither queued for the bridge while it is down nor acknowledged after its commit; use 1".into()),
        // Reproduced against mosquitto 2.0.11: a session left waiting
        // for our PUBCOMP makes rumqttc end every new connection with
        // "unsolicited ack" (it keeps no QoS 2 state across connections).
        2 => bad(&k("qos"), "2 is not offered: rumqttc keeps no QoS 2 state across connections, so a PUBREL the broker resends after a reconnect ends every new connection; use 1 (with id_field for one event per message)".into()),
        q => bad(&k("qos"), format!("must be 1 (got {q})")),
    }
    QoS::AtLeastOnce
}

/// How messages become readings: `payload` json|number|auto, an `id_field`
/// that is a member name other than the topic's, `max_payload_bytes`
/// 16..=16 MiB.
fn payload_settings(
    rs: &RawBridgeSource,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> PayloadSettings {
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
    check_range(
        &k("max_payload_bytes"),
        max_payload_bytes,
        16..=16 * 1024 * 1024,
        bad,
    );
    PayloadSettings {
        format,
        max_payload_bytes,
        id_field: rs.id_field.clone(),
    }
}
