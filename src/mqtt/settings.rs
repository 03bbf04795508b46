//! `[mqtt]` settings: the broker, the session and delivery's limits. Built
//! by the config ([`crate::config`]) and handed to the MQTT thread and the
//! delivery thread as they are.
//!
//! Its one rule: every limit here is the local config's; what a broker
//! announces on one connection is judged per connection, never stored here.

use crate::event::envelope::Format;
use std::path::PathBuf;
use std::time::Duration;

/// `[mqtt]`: the broker and delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct MqttConfig {
    /// `mqtts://` in `url`: TLS (rustls, ring provider).
    pub tls: Option<TlsFiles>,
    /// `username` and `password_file`.
    pub credentials: Option<(String, Option<PathBuf>)>,
    /// Host from `url`.
    pub host: String,
    /// Port from `url`.
    pub port: u16,
    /// `client_id`.
    pub client_id: String,
    /// `topic_prefix`: events go to `<topic_prefix>/events/<stream>`.
    pub topic_prefix: String,
    /// `keep_alive_secs`.
    pub keep_alive: Duration,
    /// `clean_session`.
    pub clean_session: bool,
    /// `inflight_window`: publishes awaiting PUBACK at once.
    pub inflight_window: usize,
    /// `max_payload_bytes`: larger events are marked FAILED, never sent.
    pub max_payload_bytes: usize,
    /// `max_packet_bytes`: the broker's limit on a whole packet (mosquitto's
    /// `max_packet_size`): an event whose QoS 1 PUBLISH (fixed header,
    /// Remaining Length, topic, packet id and payload; MQTT 3.1.1 §2.2,
    /// §3.3) is larger is marked FAILED, never sent. Default
    /// [`crate::mqtt::PROTOCOL_MAX_PACKET`], the protocol's own limit.
    pub max_packet_bytes: usize,
    /// `payload_format`.
    pub payload_format: Format,
    /// `connect_timeout_secs`.
    pub connect_timeout: Duration,
    /// `reconnect_min_ms`: first reconnect backoff.
    pub reconnect_min: Duration,
    /// `reconnect_max_ms`: backoff cap.
    pub reconnect_max: Duration,
    /// `ack_timeout_secs`: connected with rows in flight and no PUBACK for this
    /// long → the client is rebuilt and rows replayed (watchdog).
    pub ack_timeout: Duration,
    /// `fail_after_disconnects`: a row alone in flight when the connection
    /// drops this many times in a row is set aside (a publish the broker
    /// answers by disconnecting, e.g. over its packet size limit), so the
    /// rows behind it flow; it is sent again alone later and never FAILED
    /// for it ([`crate::delivery`]'s book). 1..=100, default 3; the key keeps
    /// its name so existing configs still read.
    pub fail_after_disconnects: u32,
    /// `protocol`: `"5"` (default; the integer `5` too) or `"3.1.1"`. Only MQTT 5 tells a
    /// publisher that the broker refused a publish (a PUBACK reason code of
    /// 0x80 or more, MQTT 5.0 §3.4.2.1); under 3.1.1 a broker that denies a
    /// publish still acknowledges it (§3.4: a PUBACK has no reason code).
    pub protocol: Protocol,
    /// `session_expiry_secs`: how long the broker keeps this client's
    /// session (its command subscription and queued commands) after a
    /// disconnect, MQTT 5 only (§3.1.2.11.2); 0..=4294967295, default
    /// 604800 (7 days). Ignored with `clean_session = true` or 3.1.1, where
    /// a persistent session lasts until the broker drops it.
    pub session_expiry_secs: u32,
    /// `min_share_pct`: the starvation bound of delivery priority
    /// ([`crate::delivery::lanes`]): while streams of a higher priority have rows
    /// waiting, lower priorities still get this share of the publishes
    /// offered, in percent (0..=50, default 10; 0 is strict priority).
    pub min_share_pct: u8,
    /// `status_topic`: a retained `<topic_prefix>/status` message, `online`
    /// at each connect and `offline` as the will (sent by the broker when the
    /// connection ends without a DISCONNECT: a kill, a power cut, a lost
    /// link, and a clean stop too). Default true.
    pub status_topic: bool,
    /// `retire_on`: `"puback"` (default) or `"receipt"` ([`RetireOn`]).
    pub retire_on: RetireOn,
    /// `receipt_timeout_secs`: a row PUBACKed and not covered by a receipt
    /// within this is published again with the same event id and bytes
    /// (10..=86400, default 300). Receipt mode only.
    pub receipt_timeout: Duration,
    /// `receipt_window`: rows PUBACKed and waiting for their receipt, at
    /// most (100..=100000, default 10000); while it is full no new row is
    /// sent. Receipt mode only.
    pub receipt_window: usize,
    /// `receipt_public_keys`: the public keys (64 hex digits each, at most
    /// 16; `edgespool keygen`) whose signed receipts retire rows; receipt
    /// mode needs at least one ([`crate::event::receipts::Receipt::check`]).
    pub receipt_public_keys: Vec<crate::event::signature::PublicKey>,
    /// `holdings_interval_secs`: how often the board announces what it
    /// holds on `<topic_prefix>/holdings` (retained), besides at every
    /// connection and when its backlog has drained (10..=86400, default
    /// 600; 0: never, and backfill requests go unheard). Only with
    /// `receipt_public_keys`: a request is answered only under a signature
    /// by one of them ([`MqttConfig::backfill`]).
    pub holdings_interval: Duration,
    /// `backfill_rows_per_sec`: rows sent again on the fleet's request, at
    /// most, per second, and only while no live row waits (0..=100000,
    /// default 200; 0: requests are refused, counted).
    pub backfill_rows_per_sec: u32,
}

impl MqttConfig {
    /// Whether the board announces its holdings and hears backfill
    /// requests: a key to check them by, and announcements on.
    pub fn backfill(&self) -> bool {
        !self.receipt_public_keys.is_empty() && !self.holdings_interval.is_zero()
    }

    /// `<topic_prefix>/holdings`: the board's holdings (retained) and its
    /// answers to requests.
    pub fn holdings_topic(&self) -> String {
        format!("{}/holdings", self.topic_prefix)
    }

    /// `<topic_prefix>/backfill`: the fleet's requests.
    pub fn backfill_topic(&self) -> String {
        format!("{}/backfill", self.topic_prefix)
    }
}

/// `mqtt.retire_on`: what proves a row delivered, so that it may leave the
/// unacknowledged set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RetireOn {
    /// The broker's PUBACK (the default): the broker has the message, and
    /// nothing more is known (brokers drop acknowledged QoS 1 messages:
    /// queue caps, a local relay restarted, lossy persistence).
    #[default]
    Puback,
    /// A receipt from the fleet's sink naming the row's event id (its
    /// database stored it), after the PUBACK ([`crate::event::receipts`]).
    Receipt,
}

/// `mqtt.protocol`: the MQTT version spoken to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// MQTT 3.1.1 (protocol level 4).
    V311,
    /// MQTT 5.0 (protocol level 5): PUBACK reason codes, the broker's
    /// receive maximum and maximum packet size, user properties.
    #[default]
    V5,
}

/// TLS material for `mqtts://`, read at every connect (rotated files apply
/// at the next reconnect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// `ca_file`: PEM CA certificate(s) the broker's certificate must chain to.
    pub ca_file: PathBuf,
    /// `client_cert_file` and `client_key_file`: PEM client certificate and
    /// key for mutual TLS (AWS IoT Core and similar).
    pub client: Option<(PathBuf, PathBuf)>,
}

/// Settings for unit tests: a broker on 127.0.0.1:1 (nothing listens),
/// MQTT 5, a window of 16, everything else at plain defaults.
#[cfg(test)]
pub(crate) fn test_config() -> MqttConfig {
    MqttConfig {
        tls: None,
        credentials: None,
        host: "127.0.0.1".into(),
        port: 1,
        client_id: "t".into(),
        topic_prefix: "t".into(),
        keep_alive: Duration::from_secs(30),
        clean_session: false,
        inflight_window: 16,
        max_payload_bytes: 1024,
        max_packet_bytes: 1 << 20, // more than any packet these tests build
        payload_format: crate::event::envelope::Format::Json,
        connect_timeout: Duration::from_secs(10),
        reconnect_min: Duration::from_millis(500),
        reconnect_max: Duration::from_secs(30),
        ack_timeout: Duration::from_secs(60),
        fail_after_disconnects: 3,
        protocol: Protocol::V5,
        session_expiry_secs: 0,
        min_share_pct: 10,
        status_topic: false,
        retire_on: crate::mqtt::RetireOn::Puback,
        receipt_timeout: Duration::from_secs(300),
        receipt_window: 10_000,
        receipt_public_keys: Vec::new(),
        holdings_interval: Duration::from_secs(600),
        backfill_rows_per_sec: 200,
    }
}
