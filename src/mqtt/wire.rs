//! MQTT 3.1.1 and MQTT 5 behind one face: rumqttc has a client, an event
//! loop and packet types for each version (`rumqttc` and `rumqttc::v5`);
//! the connection thread ([`super::MqttThread`]) is written once, against
//! [`Client`], [`Conn`] and [`Ev`].
//!
//! This module's one job is that translation: building the options of the
//! configured version (`mqtt.protocol`), and turning each version's events
//! and errors into the few facts the connection thread acts on. What MQTT 5
//! adds and the agent uses: PUBACK reason codes (MQTT 5.0 §3.4.2.1), the
//! broker's Receive Maximum and Maximum Packet Size in CONNACK (§3.2.2.3.3,
//! §3.2.2.3.6), the session expiry interval (§3.1.2.11.2) and the `event_id`
//! user property on every event PUBLISH (§3.3.2.3.7).

use crate::event::envelope::EventId;
use crate::mqtt::{MqttConfig, Protocol};
use rumqttc::v5::mqttbytes::v5 as p5;
use rumqttc::QoS;
use std::time::Duration;

/// Name of the user property carrying a row's event id (MQTT 5 only).
pub const EVENT_ID_PROPERTY: &str = "event_id";

/// Bytes the `event_id` user property adds to an MQTT 5 PUBLISH of a row:
/// the property length (1 byte, the properties being under 128 bytes), the
/// identifier 0x26 (1) and two UTF-8 strings with their 2-byte lengths,
/// `"event_id"` (8) and a hyphenated UUID (36) (MQTT 5.0 §3.3.2.3.7, §1.5.7).
pub const V5_EVENT_PROPERTIES: usize = 1 + 1 + 2 + EVENT_ID_PROPERTY.len() + 2 + 36;

/// Receive Maximum the agent announces in CONNECT under MQTT 5: QoS 1
/// PUBLISHes (commands, receipts) the broker may send before one is
/// acknowledged (§3.1.2.11.3). 65535 is the protocol's own default for an
/// absent property, said explicitly because mosquitto applies its
/// `max_inflight_messages` (20) to a client that does not say it. With a
/// window of 20 the broker holds everything behind the first 20
/// unacknowledged commands (and drops what overflows its queue), so an
/// operator command would wait behind every junk command queued before it;
/// with this one the broker sends ahead and the command thread's tiers
/// decide what is taken first (`commands::admission`). Memory stays
/// bounded by the command inbox: what does not fit is left unacknowledged
/// at the broker and redelivered after a reconnect.
pub const RECEIVE_MAXIMUM: u16 = u16::MAX;

/// A client of either version (cheap to clone: a channel sender). Only
/// its non-blocking `try_` calls are used, so rumqttc's async client serves
/// our synchronous code as it is: its blocking `Client` is the same sender
/// with a runtime beside it that the poller has no way to interrupt
/// ([`super::poller`] drives the event loop on a runtime of its own).
#[derive(Clone)]
pub enum Client {
    /// MQTT 3.1.1.
    V4(rumqttc::AsyncClient),
    /// MQTT 5.
    V5(rumqttc::v5::AsyncClient),
}

/// The event loop of either version: it owns the socket, so dropping it
/// closes the connection.
pub enum RawConn {
    /// MQTT 3.1.1 (both boxed: one per connection, and large).
    V4(Box<rumqttc::EventLoop>),
    /// MQTT 5.
    V5(Box<rumqttc::v5::EventLoop>),
}

impl RawConn {
    /// One poll of the event loop: the next event in our terms, or the
    /// failure that ended the connection (`keep_alive` words a 3.1.1 ping
    /// timeout, [`failure_v4`]). `None` when every sender of the request
    /// channel is gone (never while the event loop holds its own, as
    /// rumqttc 0.25.1's does). Must run inside a tokio runtime; dropping
    /// the future mid-poll can strand a packet half-written
    /// ([`super::poller`]).
    pub async fn next(&mut self, keep_alive: Duration) -> Option<Result<Ev, Failure>> {
        match self {
            RawConn::V4(el) => match el.poll().await {
                Ok(e) => Some(Ok(ev4(e))),
                Err(rumqttc::ConnectionError::RequestsDone) => None,
                Err(e) => Some(Err(failure_v4(&e, keep_alive))),
            },
            RawConn::V5(el) => match el.poll().await {
                Ok(e) => Some(Ok(ev5(e))),
                Err(rumqttc::v5::ConnectionError::RequestsDone) => None,
                Err(e) => Some(Err(failure_v5(&e))),
            },
        }
    }
}

/// What the broker's CONNACK grants this connection (MQTT 5 properties;
/// all `None` under 3.1.1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Granted {
    /// Receive Maximum: QoS 1 and 2 publishes the broker takes unacknowledged
    /// at once (§3.2.2.3.3).
    pub receive_max: Option<u16>,
    /// Maximum Packet Size: the largest whole packet it accepts (§3.2.2.3.6).
    pub max_packet: Option<u32>,
    /// Server Keep Alive: the keep-alive it imposes, seconds (§3.2.2.3.14).
    pub keep_alive: Option<u16>,
}

/// Why the broker refused one publish: a PUBACK reason code of 0x80 or
/// more (MQTT 5.0 §3.4.2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PubAckRefusal {
    /// The reason code.
    pub code: u8,
    /// Its name in the spec, snake_case (`not_authorized`).
    pub name: &'static str,
}

impl PubAckRefusal {
    /// Whether sending the same publish again later can succeed: quota
    /// exceeded (0x97) and packet identifier in use (0x91) are about the
    /// moment, not the message; every other refusal is about the message
    /// (its topic, its rights, its format) and would repeat.
    pub fn transient(&self) -> bool {
        matches!(self.code, 0x91 | 0x97)
    }
}

impl std::fmt::Display for PubAckRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the broker refused the publish: {} (PUBACK reason code 0x{:02x})",
            self.name.replace('_', " "),
            self.code
        )
    }
}

/// One event from the broker or the event loop, in the terms the connection
/// thread uses.
#[derive(Debug)]
pub enum Ev {
    /// CONNACK accepted.
    ConnAck {
        /// `session_present` (3.1.1 §3.2.2.2, 5.0 §3.2.2.1.1).
        session_present: bool,
        /// What the broker granted (MQTT 5).
        granted: Granted,
    },
    /// A PUBLISH left with this packet id.
    OutgoingPublish(u16),
    /// A PUBACK; `refused` when its reason code is 0x80 or more (MQTT 5).
    PubAck {
        /// Packet id.
        pkid: u16,
        /// The refusal, if it is one.
        refused: Option<PubAckRefusal>,
    },
    /// An incoming PUBLISH (in rumqttc's 3.1.1 type whatever the version:
    /// the command path reads topic, payload, QoS and packet id only).
    Publish(rumqttc::Publish),
    /// A SUBACK; `refused` names the reason when the subscription failed.
    SubAck {
        /// The failure, if it is one.
        refused: Option<String>,
    },
    /// Our DISCONNECT left (we send one only to end the connection).
    DisconnectSent,
    /// Anything else (pings, the outgoing side of acks), for trace logs.
    Other(String),
    /// Not the broker's: the row bookkeeping on the poller thread
    /// ([`super::rowacks`]) found an inconsistency; the connection ends
    /// for this reason.
    End(String),
}

/// Why a connection ended or an attempt failed.
#[derive(Debug)]
pub struct Failure {
    /// In words an operator can act on.
    pub reason: String,
    /// The broker answered the CONNECT and said no: retrying with the same
    /// config gets the same answer (logged at ERROR).
    pub refused: bool,
    /// The broker sent a packet over the incoming limit, of this many bytes.
    pub oversize: Option<usize>,
    /// The peer closed the connection (no DISCONNECT, no answer).
    pub closed_by_peer: bool,
    /// The CONNACK refused the protocol version (MQTT 5 reason code 0x84
    /// "unsupported protocol version", or a 3.1.1 broker's return code 1).
    pub protocol_refused: bool,
}

impl Client {
    /// Queue a PUBLISH without blocking (no properties: the retained
    /// status).
    ///
    /// Errors: the request channel is full or closed (the publish never
    /// reached the event loop).
    pub fn try_publish(
        &self,
        topic: &str,
        qos: QoS,
        retain: bool,
        payload: Vec<u8>,
    ) -> Result<(), String> {
        match self {
            Client::V4(c) => c
                .try_publish(topic, qos, retain, payload)
                .map_err(|e| e.to_string()),
            Client::V5(c) => c
                .try_publish(topic, qos5(qos), retain, payload)
                .map_err(|e| e.to_string()),
        }
    }

    /// Queue a row's QoS 1 PUBLISH without blocking, taking its payload
    /// instead of copying it. Under MQTT 5 `event_id`, when given, goes out
    /// as the `event_id` user property in its hyphenated text: the one place
    /// a row's id becomes text on its way out (the payload carries its own,
    /// written at append).
    ///
    /// Errors: the request channel is full or closed (the publish never
    /// reached the event loop); the payload comes back, so the row can wait
    /// for room unchanged (`None`: rumqttc refused it without it, which
    /// 0.25.1 never does).
    pub fn try_publish_row(
        &self,
        topic: &str,
        payload: Vec<u8>,
        event_id: Option<EventId>,
    ) -> Result<(), Option<Vec<u8>>> {
        match self {
            Client::V4(c) => match c.try_publish(topic, QoS::AtLeastOnce, false, payload) {
                Ok(()) => Ok(()),
                Err(rumqttc::ClientError::TryRequest(rumqttc::Request::Publish(p)))
                | Err(rumqttc::ClientError::Request(rumqttc::Request::Publish(p))) => {
                    Err(Some(Vec::from(p.payload)))
                }
                Err(_) => Err(None),
            },
            Client::V5(c) => {
                let qos = qos5(QoS::AtLeastOnce);
                let sent = match event_id {
                    None => c.try_publish(topic, qos, false, payload),
                    Some(id) => {
                        let props = p5::PublishProperties {
                            user_properties: vec![(EVENT_ID_PROPERTY.to_owned(), id.hyphenated())],
                            ..Default::default()
                        };
                        c.try_publish_with_properties(topic, qos, false, payload, props)
                    }
                };
                match sent {
                    Ok(()) => Ok(()),
                    Err(rumqttc::v5::ClientError::TryRequest(rumqttc::v5::Request::Publish(p)))
                    | Err(rumqttc::v5::ClientError::Request(rumqttc::v5::Request::Publish(p))) => {
                        Err(Some(Vec::from(p.payload)))
                    }
                    Err(_) => Err(None),
                }
            }
        }
    }

    /// Queue a SUBSCRIBE without blocking. Errors: the channel is full or closed.
    pub fn try_subscribe(&self, topic: &str, qos: QoS) -> Result<(), String> {
        match self {
            Client::V4(c) => c.try_subscribe(topic, qos).map_err(|e| e.to_string()),
            Client::V5(c) => c.try_subscribe(topic, qos5(qos)).map_err(|e| e.to_string()),
        }
    }

    /// Queue an UNSUBSCRIBE without blocking. Errors: the channel is full
    /// or closed.
    pub fn try_unsubscribe(&self, topic: &str) -> Result<(), String> {
        match self {
            Client::V4(c) => c.try_unsubscribe(topic).map_err(|e| e.to_string()),
            Client::V5(c) => c.try_unsubscribe(topic).map_err(|e| e.to_string()),
        }
    }

    /// Queue a DISCONNECT (the one request that makes the event loop return
    /// from its poll); a full or closed channel is ignored.
    pub fn try_disconnect(&self) {
        let _ = match self {
            Client::V4(c) => c.try_disconnect().map_err(|e| e.to_string()),
            Client::V5(c) => c.try_disconnect().map_err(|e| e.to_string()),
        };
    }

    /// Acknowledge an incoming PUBLISH (manual acks: PUBACK for QoS 1,
    /// PUBREC for QoS 2). Errors: the channel is full or closed.
    pub fn try_ack(&self, publish: &rumqttc::Publish) -> Result<(), String> {
        match self {
            Client::V4(c) => c.try_ack(publish).map_err(|e| e.to_string()),
            Client::V5(c) => {
                // rumqttc builds the ack from the packet id and QoS only.
                let mut p =
                    p5::Publish::new(publish.topic.as_str(), qos5(publish.qos), Vec::new(), None);
                p.pkid = publish.pkid;
                c.try_ack(&p).map_err(|e| e.to_string())
            }
        }
    }
}

fn qos5(q: QoS) -> rumqttc::v5::mqttbytes::QoS {
    match q {
        QoS::AtMostOnce => rumqttc::v5::mqttbytes::QoS::AtMostOnce,
        QoS::AtLeastOnce => rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        QoS::ExactlyOnce => rumqttc::v5::mqttbytes::QoS::ExactlyOnce,
    }
}

fn qos4(q: rumqttc::v5::mqttbytes::QoS) -> QoS {
    match q {
        rumqttc::v5::mqttbytes::QoS::AtMostOnce => QoS::AtMostOnce,
        rumqttc::v5::mqttbytes::QoS::AtLeastOnce => QoS::AtLeastOnce,
        rumqttc::v5::mqttbytes::QoS::ExactlyOnce => QoS::ExactlyOnce,
    }
}

/// How a connection is set up beyond the config (no `Debug`: it holds the
/// password).
#[derive(Clone)]
pub struct Setup {
    /// Largest incoming packet taken (remaining length, bytes).
    pub max_incoming: usize,
    /// Start a clean session this once (overrides `mqtt.clean_session`).
    pub clean: bool,
    /// The will: `(topic, payload)`, retained, QoS 1.
    pub will: Option<(String, Vec<u8>)>,
    /// The username and password read from their files.
    pub credentials: Option<(String, String)>,
    /// The TLS transport, when `mqtts://`.
    pub transport: Option<rumqttc::Transport>,
}

/// A client and its event loop for `cfg.protocol`.
pub fn connect(cfg: &MqttConfig, setup: Setup) -> (Client, RawConn) {
    let cap = cfg.inflight_window + 8;
    // Above our window, so rumqttc's own flow control never holds a publish
    // we counted as in flight for long (packet ids cycle 1..=inflight).
    let inflight = (cfg.inflight_window as u16).saturating_mul(2).max(8);
    let clean = setup.clean || cfg.clean_session;
    let mut net = rumqttc::NetworkOptions::new();
    net.set_connection_timeout(cfg.connect_timeout.as_secs().max(1));
    // Publishes leave in small bursts as the window frees up; with Nagle
    // on, a burst's tail waits for the peer's delayed ACK (~40 ms).
    net.set_tcp_nodelay(true);
    match cfg.protocol {
        Protocol::V311 => {
            let mut o =
                rumqttc::MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
            if let Some(t) = setup.transport {
                o.set_transport(t);
            }
            if let Some((u, p)) = setup.credentials {
                o.set_credentials(u, p);
            }
            o.set_keep_alive(cfg.keep_alive);
            o.set_clean_session(clean);
            o.set_inflight(inflight);
            let topic_room = cfg.topic_prefix.len() + 256;
            o.set_max_packet_size(setup.max_incoming, cfg.max_payload_bytes + topic_room);
            o.set_request_channel_capacity(cap);
            // Commands are acknowledged only after their receipt commits.
            o.set_manual_acks(true);
            if let Some((topic, payload)) = setup.will {
                o.set_last_will(rumqttc::LastWill::new(
                    topic,
                    payload,
                    QoS::AtLeastOnce,
                    true,
                ));
            }
            let (client, mut el) = rumqttc::AsyncClient::new(o, cap);
            el.set_network_options(net);
            (Client::V4(client), RawConn::V4(Box::new(el)))
        }
        Protocol::V5 => {
            let mut o =
                rumqttc::v5::MqttOptions::new(cfg.client_id.clone(), cfg.host.clone(), cfg.port);
            if let Some(t) = setup.transport {
                o.set_transport(t);
            }
            if let Some((u, p)) = setup.credentials {
                o.set_credentials(u, p);
            }
            o.set_keep_alive(cfg.keep_alive);
            o.set_clean_start(clean);
            // A persistent session must outlive the connection (a session
            // expiry of 0, the default, ends it at the disconnect).
            o.set_session_expiry_interval((!clean).then_some(cfg.session_expiry_secs));
            o.set_outgoing_inflight_upper_limit(inflight);
            o.set_receive_maximum(Some(RECEIVE_MAXIMUM));
            // Tells the broker our limit (CONNECT Maximum Packet Size) and
            // makes rumqttc refuse a larger incoming packet.
            o.set_max_packet_size(Some(u32::try_from(setup.max_incoming).unwrap_or(u32::MAX)));
            o.set_request_channel_capacity(cap);
            o.set_manual_acks(true);
            if let Some((topic, payload)) = setup.will {
                o.set_last_will(p5::LastWill::new(
                    topic,
                    payload,
                    rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                    true,
                    None,
                ));
            }
            o.set_network_options(net);
            let (client, el) = rumqttc::v5::AsyncClient::new(o, cap);
            (Client::V5(client), RawConn::V5(Box::new(el)))
        }
    }
}

fn ev4(e: rumqttc::Event) -> Ev {
    use rumqttc::{Event, Incoming, Outgoing};
    match e {
        Event::Incoming(Incoming::ConnAck(a)) => Ev::ConnAck {
            session_present: a.session_present,
            granted: Granted::default(),
        },
        Event::Outgoing(Outgoing::Publish(pkid)) => Ev::OutgoingPublish(pkid),
        Event::Outgoing(Outgoing::Disconnect) => Ev::DisconnectSent,
        Event::Incoming(Incoming::PubAck(a)) => Ev::PubAck {
            pkid: a.pkid,
            refused: None,
        },
        Event::Incoming(Incoming::Publish(p)) => Ev::Publish(p),
        Event::Incoming(Incoming::SubAck(a)) => Ev::SubAck {
            refused: a
                .return_codes
                .iter()
                .any(|c| matches!(c, rumqttc::SubscribeReasonCode::Failure))
                .then(|| "SUBACK 0x80".to_owned()),
        },
        other => Ev::Other(format!("{other:?}")),
    }
}

fn ev5(e: rumqttc::v5::Event) -> Ev {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::Event;
    match e {
        Event::Incoming(Packet::ConnAck(a)) => Ev::ConnAck {
            session_present: a.session_present,
            granted: a.properties.map_or_else(Granted::default, |p| Granted {
                receive_max: p.receive_max,
                max_packet: p.max_packet_size,
                keep_alive: p.server_keep_alive,
            }),
        },
        Event::Outgoing(rumqttc::Outgoing::Publish(pkid)) => Ev::OutgoingPublish(pkid),
        Event::Outgoing(rumqttc::Outgoing::Disconnect) => Ev::DisconnectSent,
        Event::Incoming(Packet::PubAck(a)) => Ev::PubAck {
            pkid: a.pkid,
            refused: puback_refusal(a.reason),
        },
        Event::Incoming(Packet::Publish(p)) => {
            // A topic that is not UTF-8 matches no command topic; it is
            // acknowledged as not ours.
            let topic = String::from_utf8_lossy(&p.topic).into_owned();
            let mut q = rumqttc::Publish::from_bytes(topic, qos4(p.qos), p.payload);
            q.pkid = p.pkid;
            q.dup = p.dup;
            q.retain = p.retain;
            Ev::Publish(q)
        }
        Event::Incoming(Packet::SubAck(a)) => Ev::SubAck {
            refused: a
                .return_codes
                .iter()
                .find(|c| !matches!(c, p5::SubscribeReasonCode::Success(_)))
                .map(|c| format!("SUBACK {}", suback_reason(c))),
        },
        other => Ev::Other(format!("{other:?}")),
    }
}

/// A PUBACK reason code of 0x80 or more (MQTT 5.0 §3.4.2.1, table 3-4).
fn puback_refusal(r: p5::PubAckReason) -> Option<PubAckRefusal> {
    use p5::PubAckReason as R;
    let (code, name) = match r {
        R::Success | R::NoMatchingSubscribers => return None,
        R::UnspecifiedError => (0x80, "unspecified_error"),
        R::ImplementationSpecificError => (0x83, "implementation_specific_error"),
        R::NotAuthorized => (0x87, "not_authorized"),
        R::TopicNameInvalid => (0x90, "topic_name_invalid"),
        R::PacketIdentifierInUse => (0x91, "packet_identifier_in_use"),
        R::QuotaExceeded => (0x97, "quota_exceeded"),
        R::PayloadFormatInvalid => (0x99, "payload_format_invalid"),
    };
    Some(PubAckRefusal { code, name })
}

/// A SUBACK failure in words (MQTT 5.0 §3.9.3).
fn suback_reason(c: &p5::SubscribeReasonCode) -> &'static str {
    use p5::SubscribeReasonCode as S;
    match c {
        S::Success(_) => "granted",
        S::Failure | S::Unspecified => "0x80 unspecified error",
        S::ImplementationSpecific => "0x83 implementation specific error",
        S::NotAuthorized => "0x87 not authorized",
        S::TopicFilterInvalid => "0x8F topic filter invalid",
        S::PkidInUse => "0x91 packet identifier in use",
        S::QuotaExceeded => "0x97 quota exceeded",
        S::SharedSubscriptionsNotSupported => "0x9E shared subscriptions not supported",
        S::SubscriptionIdNotSupported => "0xA1 subscription identifiers not supported",
        S::WildcardSubscriptionsNotSupported => "0xA2 wildcard subscriptions not supported",
    }
}

/// An MQTT 5 connection error in words an operator can act on.
fn failure_v5(e: &rumqttc::v5::ConnectionError) -> Failure {
    use rumqttc::v5::{ConnectionError as E, StateError as S};
    let mut f = Failure {
        reason: String::new(),
        refused: false,
        oversize: None,
        closed_by_peer: false,
        protocol_refused: false,
    };
    f.reason = match e {
        E::Tls(t) => format!("TLS failed: {t} (check mqtt.ca_file, the client certificate and key, their validity dates and the board's clock)"),
        E::ConnectionRefused(code) | E::MqttState(S::ConnFail { reason: code }) => {
            f.refused = true;
            f.protocol_refused = matches!(
                code,
                p5::ConnectReturnCode::RefusedProtocolVersion
                    | p5::ConnectReturnCode::UnsupportedProtocolVersion
            );
            refusal_v5(*code)
        }
        E::Timeout(_) => "connect timed out (broker unreachable?)".to_owned(),
        E::MqttState(S::Deserialization(
            rumqttc::v5::mqttbytes::Error::PayloadSizeLimitExceeded { pkt_size, .. },
        )) => {
            f.oversize = Some(*pkt_size);
            format!("the broker sent a {pkt_size}-byte packet, over the incoming limit")
        }
        E::MqttState(S::ServerDisconnect {
            reason_code,
            reason_string,
        }) => format!(
            "the broker disconnected: {reason_code:?}{}",
            reason_string
                .as_deref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default()
        ),
        E::MqttState(S::ConnectionAborted) => {
            f.closed_by_peer = true;
            "the broker closed the connection".to_owned()
        }
        E::Io(io) | E::MqttState(S::Io(io))
            if matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            f.closed_by_peer = true;
            format!("the broker closed the connection ({io})")
        }
        E::MqttState(S::OutgoingPacketTooLarge { pkt_size, max }) => format!(
            "a {pkt_size}-byte packet is over the broker's maximum packet size of {max} bytes"
        ),
        other => format!("connection error: {other}"),
    };
    f
}

/// A CONNACK refusal under MQTT 5 (§3.2.2.2, reason codes 0x80 and up;
/// rumqttc also maps a 3.1.1 broker's return codes 1 to 5 onto this type).
fn refusal_v5(code: p5::ConnectReturnCode) -> String {
    use p5::ConnectReturnCode as C;
    let protocol = "the broker does not speak MQTT 5 (CONNACK: unsupported protocol version): set mqtt.protocol = \"3.1.1\", or upgrade the broker";
    match code {
        C::RefusedProtocolVersion | C::UnsupportedProtocolVersion => protocol.to_owned(),
        C::BadUserNamePassword => "the broker refused the login: bad user name or password (CONNACK reason code 0x86): check mqtt.username and mqtt.password_file".to_owned(),
        C::NotAuthorized => "the broker refused the login: not authorized (CONNACK reason code 0x87): check mqtt.username, mqtt.password_file and the broker's access rules for this client".to_owned(),
        C::BadClientId | C::ClientIdentifierNotValid => "the broker refused the client identifier (CONNACK): check mqtt.client_id".to_owned(),
        C::Banned => "the broker refused the connection: this client is banned (CONNACK reason code 0x8A)".to_owned(),
        C::PacketTooLarge => "the broker refused the CONNECT as too large (CONNACK reason code 0x95): check the will and credentials".to_owned(),
        C::ServerUnavailable | C::ServiceUnavailable | C::ServerBusy | C::ConnectionRateExceeded | C::QuotaExceeded => {
            format!("the broker refused the connection for now: {code:?} (CONNACK)")
        }
        C::UseAnotherServer | C::ServerMoved => format!("the broker sent this client elsewhere: {code:?} (CONNACK); check mqtt.url"),
        other => format!("the broker refused the connection: {other:?} (CONNACK)"),
    }
}

/// A connection error in words an operator can act on. `keep_alive` is
/// the one this client asked for, named when a broker refuses with a code
/// 3.1.1 does not define.
fn classify(e: &rumqttc::ConnectionError, keep_alive: Duration) -> String {
    use rumqttc::ConnectionError as E;
    match e {
        E::Tls(t) => format!("TLS failed: {t} (check mqtt.ca_file, the client certificate and key, their validity dates and the board's clock)"),
        E::ConnectionRefused(code) => refusal(*code),
        E::NetworkTimeout => "connect timed out (broker unreachable?)".to_owned(),
        E::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
        )) => format!("the broker sent a {n}-byte packet, over the incoming limit"),
        E::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::InvalidConnectReturnCode(code),
        )) => undefined_refusal(*code, keep_alive),
        other => format!("connection error: {other}"),
    }
}

/// A CONNACK refusal (MQTT 3.1.1 §3.2.2.3, return codes 1 to 5) in words
/// an operator can act on. Not transient: the same config gets the same
/// answer, so it is logged at ERROR.
fn refusal(code: rumqttc::ConnectReturnCode) -> String {
    use rumqttc::ConnectReturnCode as C;
    match code {
        C::BadUserNamePassword => "the broker refused the login: bad user name or password (CONNACK return code 4): check mqtt.username and mqtt.password_file".to_owned(),
        C::NotAuthorized => "the broker refused the login: not authorized (CONNACK return code 5): check mqtt.username, mqtt.password_file and the broker's access rules for this client".to_owned(),
        C::BadClientId => "the broker refused the client identifier (CONNACK return code 2): check mqtt.client_id".to_owned(),
        C::RefusedProtocolVersion => "the broker refused protocol level 4, MQTT 3.1.1 (CONNACK return code 1)".to_owned(),
        C::ServiceUnavailable => "the broker refused the connection: server unavailable (CONNACK return code 3)".to_owned(),
        C::Success => "broker refused the connection with return code 0".to_owned(),
    }
}

/// A CONNACK return code MQTT 3.1.1 does not define (§3.2.2.3 ends at 5).
/// aedes answers 6 to a keep-alive above its `keepaliveLimit` (the MQTT 5
/// meaning would be a refusal too), so the keep-alive is named.
fn undefined_refusal(code: u8, keep_alive: Duration) -> String {
    format!(
        "the broker refused the connection with CONNACK return code {code}, which MQTT 3.1.1 does not define: \
         some brokers (aedes) send 6 for a keep-alive above their limit; this client asks for a keep-alive of {} s \
         (mqtt.keep_alive_secs): lower it, or check the broker's log for the cause",
        keep_alive.as_secs()
    )
}

/// Whether the broker answered the CONNECT and said no (a CONNACK refusal,
/// or a return code outside 3.1.1): the same config gets the same answer.
fn is_refusal(e: &rumqttc::ConnectionError) -> bool {
    matches!(
        e,
        rumqttc::ConnectionError::ConnectionRefused(_)
            | rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
                rumqttc::mqttbytes::Error::InvalidConnectReturnCode(_),
            ))
    )
}

/// A 3.1.1 connection error as a [`Failure`].
fn failure_v4(e: &rumqttc::ConnectionError, keep_alive: Duration) -> Failure {
    let oversize = match e {
        rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
        )) => Some(*n),
        _ => None,
    };
    Failure {
        reason: classify(e, keep_alive),
        refused: is_refusal(e),
        oversize,
        closed_by_peer: false,
        protocol_refused: matches!(
            e,
            rumqttc::ConnectionError::ConnectionRefused(
                rumqttc::ConnectReturnCode::RefusedProtocolVersion
            )
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_codes_keep_their_numbers_and_only_the_moment_s_are_retried() {
        let r = puback_refusal(p5::PubAckReason::NotAuthorized).expect("refusal");
        assert_eq!((r.code, r.name), (0x87, "not_authorized"));
        assert!(!r.transient());
        assert_eq!(
            r.to_string(),
            "the broker refused the publish: not authorized (PUBACK reason code 0x87)"
        );
        assert!(puback_refusal(p5::PubAckReason::QuotaExceeded)
            .expect("refusal")
            .transient());
        assert_eq!(puback_refusal(p5::PubAckReason::Success), None);
        assert_eq!(
            puback_refusal(p5::PubAckReason::NoMatchingSubscribers),
            None
        );
    }

    #[test]
    fn the_event_id_property_costs_what_rumqttc_writes() {
        // The same PUBLISH with and without the property, encoded by
        // rumqttc's own MQTT 5 writer.
        let id = "0194b3c2-8f00-7abc-8def-0123456789ab";
        let size = |props: Option<p5::PublishProperties>| {
            let mut p = p5::Publish::new(
                "p/events/s",
                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                vec![7u8; 300],
                props,
            );
            p.pkid = 1;
            let mut buf = bytes::BytesMut::new();
            p.write(&mut buf).expect("encode");
            buf.len()
        };
        let bare = size(None);
        let with = size(Some(p5::PublishProperties {
            user_properties: vec![(EVENT_ID_PROPERTY.to_owned(), id.to_owned())],
            ..Default::default()
        }));
        // Without properties, rumqttc still writes a property length of 0.
        assert_eq!(with - bare + 1, V5_EVENT_PROPERTIES);
    }
}
