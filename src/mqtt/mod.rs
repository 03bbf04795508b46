//! The MQTT connection thread: owns the rumqttc event loop (polled on a
//! thread of its own, which turns PUBACKs into retirements through
//! [`crate::mqtt::ackmap::AckMap`]), and rebuilds the client after every disconnect.
//!
//! Its one rule: **this thread never touches SQLite and never waits on it**;
//! it reports to the delivery thread over a channel, so a slow SD-card fsync
//! cannot starve keepalives.
//!
//! Why the client is rebuilt after every disconnect: rumqttc 0.25.1 keeps
//! unacknowledged publishes in memory and, on a CONNACK without
//! `session_present`, drops them silently (field case F08); on a resumed
//! session it re-sends them with their old packet ids. Neither is a proof of
//! anything we could map back to rows safely, so the spool owns redelivery: on
//! any disconnect, inconsistency or watchdog expiry, every row in flight is
//! handed back as replay-eligible ([`DeliveryMsg::Lost`]) and a fresh client is
//! built after a capped, jittered backoff.
//!
//! The rooms, by job (each file's own doc gives its one rule):
//! `handoff` what crosses to the delivery and command threads; `shared` the
//! state both sides lock and the pump that fills the window; `link` the
//! delivery and command threads' handle ([`Link`]); `thread` one connection
//! after another ([`MqttThread`]); `drive` polling one connection and the
//! watchdog; `acks` CONNACK and SUBACK; `subjudge` whether the command SUBSCRIBE goes out; `rowacks` each row's outgoing PUBLISH and PUBACK, on the poller thread; `status` the retained
//! status; `facts` the connection's story for health; `poller` the event loop polled on its own thread, never cut short;
//! `packet` packet-size arithmetic; `setup` the files a connection reads; [`wire`] the two
//! protocol versions behind one face; [`settings`] the settings.

pub mod ackmap;
mod acks;
mod drive;
mod facts;
mod handoff;
mod link;
mod packet;
mod poller;
mod rowacks;
pub mod settings;
mod setup;
mod shared;
mod status;
mod subjudge;
mod thread;
pub mod wire;

pub use facts::LinkFacts;
pub use handoff::RECEIPTS_QUEUED_MAX;
pub use handoff::{CommandSink, CommandSub, DeliveryMsg, NotNow, Ready};
pub use link::Link;
pub use packet::{incoming_limit, publish_extra, publish_packet_size, PROTOCOL_MAX_PACKET};
pub use settings::{MqttConfig, Protocol, RetireOn, TlsFiles};
pub use shared::Shared;
pub use thread::{new, MqttThread};
