//! The retained status on `<topic_prefix>/status` (with `mqtt.status_topic`):
//! the `online` message published after each CONNACK, and the `offline` one
//! that the will and a clean stop leave behind.
//!
//! Its one rule: the status never costs the connection that carries the
//! rows. It goes through the ack map as a stand-in row ([`STATUS_ROW`]), so
//! packet ids stay matched to rows, and it is not sent at all when it would
//! be over the packet limit in force.

use super::packet::{packet_limit, publish_extra, publish_packet_size};
use super::settings::MqttConfig;
use super::shared::Shared;
use crate::event::envelope::wall_clock_ms;
use rumqttc::QoS;

/// The retained `offline` status: the will's payload, and what a clean stop
/// publishes before it closes the connection.
pub(super) fn offline_payload() -> Vec<u8> {
    br#"{"state":"offline"}"#.to_vec()
}

/// Publish the retained `online` status right after CONNACK, through the ack
/// map (a stand-in row) so packet ids stay matched to rows.
pub(super) fn announce_online(s: &mut Shared, cfg: &MqttConfig) {
    let Some((topic, info)) = s.status.clone() else {
        return;
    };
    let Some(client) = s.client.clone() else {
        return;
    };
    let mut v = serde_json::json!({
        "state": "online",
        "version": env!("CARGO_PKG_VERSION"),
        "since_ms": wall_clock_ms().0,
        "client_id": cfg.client_id,
    });
    if let (Some(o), serde_json::Value::Object(i)) = (v.as_object_mut(), info) {
        o.extend(i);
    }
    let payload = v.to_string().into_bytes();
    let size = publish_packet_size(
        topic.len(),
        payload.len() + publish_extra(cfg.protocol, false),
    );
    let limit = packet_limit(cfg.max_packet_bytes, s.granted);
    if size > limit {
        // A broker closes the connection on a packet over its limit: the
        // status must never cost the connection that carries the rows.
        if !s.status_too_large_logged {
            s.status_too_large_logged = true;
            log::warn!(
                "the retained online status on {topic} is a {size}-byte PUBLISH, over the packet limit of {limit} bytes (mqtt.max_packet_bytes or the broker's maximum packet size): not sent (raise the limit or set mqtt.status_topic = false)"
            );
        }
        return;
    }
    if s.ack.submitted(STATUS_ROW).is_err() {
        return;
    }
    if client
        .try_publish(&topic, QoS::AtLeastOnce, true, payload)
        .is_err()
    {
        s.ack.submit_failed();
    }
}

/// `<topic_prefix>/status`.
pub(super) fn status_topic(cfg: &MqttConfig) -> String {
    format!("{}/status", cfg.topic_prefix)
}

/// The ack map's stand-in row for the retained `online` status publish: a
/// PUBACK for it retires nothing.
pub(super) const STATUS_ROW: i64 = -1;
