//! Packet-size arithmetic: the whole PUBLISH a broker's packet limit counts
//! ([`publish_packet_size`], [`publish_extra`], [`PROTOCOL_MAX_PACKET`]),
//! the limit in force once CONNACK has spoken, and the incoming limits
//! (the command subscription's, and the one-off drain connection's).
//!
//! Its one rule: a size is counted as the protocol encodes it, byte for byte
//! what rumqttc writes (the tests below hold that at every length boundary),
//! and a size past what the protocol can carry counts as larger than any
//! limit: it saturates, never wraps.

use super::settings::Protocol;
use super::wire::{Granted, V5_EVENT_PROPERTIES};

/// The largest MQTT 3.1.1 control packet: a 1-byte fixed header, a 4-byte
/// Remaining Length and the largest Remaining Length, 268,435,455 bytes
/// (MQTT 3.1.1 §2.2.3). The default of `mqtt.max_packet_bytes`: no limit
/// beyond the protocol's.
pub const PROTOCOL_MAX_PACKET: usize = 1 + 4 + 268_435_455;

/// Bytes of the Remaining Length field for `remaining` (MQTT 3.1.1 §2.2.3:
/// 7 bits per byte, 1 to 4 bytes). `None` past 268,435,455, which no packet
/// can carry.
fn remaining_length_bytes(remaining: usize) -> Option<usize> {
    match remaining {
        0..=127 => Some(1),
        128..=16_383 => Some(2),
        16_384..=2_097_151 => Some(3),
        2_097_152..=268_435_455 => Some(4),
        _ => None,
    }
}

/// Size on the wire of the QoS 1 PUBLISH carrying `payload_len` bytes on a
/// topic of `topic_len` bytes (UTF-8): the whole packet a broker's packet
/// limit counts (mosquitto's `max_packet_size`), not only the payload.
///
/// Fixed header byte (MQTT 3.1.1 §2.2) + Remaining Length (§2.2.3) +
/// topic length prefix (2) + topic (§3.3.2.1) + packet identifier (2, QoS 1,
/// §3.3.2.2) + payload (§3.3.3). Past what Remaining Length can encode the
/// result is `usize::MAX` (over any limit).
pub fn publish_packet_size(topic_len: usize, payload_len: usize) -> usize {
    let remaining = 2usize
        .saturating_add(topic_len)
        .saturating_add(2)
        .saturating_add(payload_len);
    match remaining_length_bytes(remaining) {
        Some(n) => 1 + n + remaining,
        None => usize::MAX,
    }
}

/// Bytes a PUBLISH under `protocol` carries beyond the 3.1.1 packet
/// [`publish_packet_size`] counts: nothing under 3.1.1; under MQTT 5 the
/// property length (§3.3.2.3.1) and, for a row, its `event_id` user
/// property ([`V5_EVENT_PROPERTIES`]).
pub fn publish_extra(protocol: Protocol, row: bool) -> usize {
    match (protocol, row) {
        (Protocol::V311, _) => 0,
        (Protocol::V5, true) => V5_EVENT_PROPERTIES,
        (Protocol::V5, false) => 1,
    }
}

/// The whole-packet limit in force: `mqtt.max_packet_bytes`, or the
/// broker's Maximum Packet Size from CONNACK (MQTT 5) if smaller.
pub(super) fn packet_limit(configured: usize, granted: Granted) -> usize {
    granted
        .max_packet
        .map_or(configured, |m| configured.min(m as usize))
}

/// Incoming packet limit when commands are off (nothing is subscribed; a
/// session left from an earlier config may still deliver).
pub(super) const INCOMING_WITHOUT_COMMANDS: usize = 64 * 1024;

/// The incoming packet limit for commands of at most `max_payload` bytes on
/// `topic`: rumqttc compares it with a packet's remaining length, which for
/// a QoS 1 PUBLISH is 2 (topic length) + the topic + 2 (packet id) + the
/// payload (MQTT 3.1.1 §3.3.2).
pub fn incoming_limit(topic: &str, max_payload: usize) -> usize {
    max_payload + topic.len() + 4
}

/// The limit of a one-off connection taken after a packet over the normal
/// limit: the 1 MiB this agent always accepted, and more than the normal one.
pub(super) fn drain_limit(normal: usize) -> usize {
    (1024 * 1024).max(normal * 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::QoS;

    /// What rumqttc itself writes for a QoS 1 PUBLISH with a packet id (as
    /// every publish of ours has when it is encoded).
    fn rumqttc_publish(topic_len: usize, payload_len: usize) -> (usize, usize, usize) {
        let mut p = rumqttc::Publish::new(
            "t".repeat(topic_len),
            QoS::AtLeastOnce,
            vec![b'x'; payload_len],
        );
        p.pkid = 7;
        let mut buf = bytes::BytesMut::new();
        let written = p.write(&mut buf).expect("rumqttc encodes it");
        (p.size(), written, buf.len())
    }

    #[test]
    fn publish_packet_size_matches_what_rumqttc_writes_at_every_length_boundary() {
        // Remaining Length grows a byte at 128, 16,384 and 2,097,152
        // (MQTT 3.1.1 §2.2.3); remaining = 2 + topic + 2 + payload.
        let topic = 20;
        let mut payloads = vec![0, 1, 100, 1000, 65_536];
        for edge in [128usize, 16_384, 2_097_152] {
            let p = edge - 4 - topic;
            payloads.extend([p - 1, p, p + 1]);
        }
        for payload in payloads {
            let (size, written, buf) = rumqttc_publish(topic, payload);
            let ours = publish_packet_size(topic, payload);
            assert_eq!(ours, size, "payload {payload}: rumqttc size()");
            assert_eq!(ours, written, "payload {payload}: rumqttc write()");
            assert_eq!(ours, buf, "payload {payload}: bytes in the buffer");
        }
        for topic in [1, 60, 200, 1000] {
            let (size, _, buf) = rumqttc_publish(topic, 3000);
            assert_eq!(publish_packet_size(topic, 3000), size);
            assert_eq!(publish_packet_size(topic, 3000), buf);
        }
    }

    #[test]
    fn rumqttc_refuses_a_publish_one_byte_over_its_outgoing_limit_as_we_count_it() {
        let mut p = rumqttc::Publish::new("a/events/s", QoS::AtLeastOnce, vec![0u8; 500]);
        p.pkid = 1;
        let size = publish_packet_size(10, 500);
        let packet = rumqttc::Packet::Publish(p);
        let mut buf = bytes::BytesMut::new();
        assert!(packet.write(&mut buf, size).is_ok());
        assert!(matches!(
            packet.write(&mut buf, size - 1),
            Err(rumqttc::mqttbytes::Error::OutgoingPacketTooLarge { pkt_size, max })
                if pkt_size == size && max == size - 1
        ));
    }

    #[test]
    fn a_publish_past_the_protocol_limit_counts_as_larger_than_any_limit() {
        let max_remaining = 268_435_455;
        assert_eq!(
            publish_packet_size(10, max_remaining - 14),
            PROTOCOL_MAX_PACKET
        );
        assert_eq!(publish_packet_size(10, max_remaining - 13), usize::MAX);
        assert_eq!(publish_packet_size(usize::MAX, 1), usize::MAX);
    }
}
