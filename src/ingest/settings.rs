//! `[ingest]` settings: the local socket and TCP listener, their bounds,
//! and the streams clients may write. Built by the config
//! ([`crate::config`]).
//!
//! Its one rule: a client writes only a stream the local config declares
//! or a pattern allows, with that stream's settings, never its own.

use crate::event::stream::{pattern_matches, stream_name_ok, StreamSettings};
use crate::intake::share::{self, ShareSettings};
use std::path::PathBuf;

/// Default `ingest.max_buffered_bytes`: 8 MiB. A Pi Zero 2 has 512 MB; the
/// agent runs in about 10 to 20 MB; 8 MiB of readings (about 500 lines of
/// the longest kind, 16 KiB, or 10,000 small ones) keeps a flood of the
/// socket within a few tens of MB of RSS and one commit window of it
/// within a second of an SD card's writes.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 8 * 1024 * 1024;
/// Default `ingest.max_connection_bytes`: 1 MiB, an eighth of the whole,
/// room for about 60 pipelined lines of 16 KiB or over 1,000 small ones.
pub const DEFAULT_MAX_CONNECTION_BYTES: usize = 1024 * 1024;

/// `[ingest]`: the local socket ingest ([`crate::ingest`]). Off unless
/// `socket` or `tcp` is set. Changes take effect at the next restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestConfig {
    /// `socket`: absolute path of a Unix stream socket (e.g.
    /// `/run/edgespool/ingest.sock`). Unset: none.
    pub socket: Option<PathBuf>,
    /// `socket_group`: group given the socket (a name, looked up at start,
    /// or a numeric gid). Unset: the agent's own group.
    pub socket_group: Option<String>,
    /// `socket_mode`: permission bits of the socket, an octal string
    /// (default `"0660"`: owner and group may connect). Must keep the
    /// owner's read and write bits; others may never write.
    pub socket_mode: u32,
    /// `tcp`: `IP:port` of a TCP listener (e.g. `127.0.0.1:7788`); a
    /// non-loopback address needs `tcp_public`. Unset: none.
    pub tcp: Option<std::net::SocketAddr>,
    /// `tcp_public`: allow `tcp` on an address other hosts can reach
    /// (default false). Nothing authenticates a TCP client.
    pub tcp_public: bool,
    /// `max_line_bytes`: longest request line, bytes, newline excluded
    /// (256..=1048576, default 16384). A longer line is answered with an
    /// error naming this limit and the connection is closed.
    pub max_line_bytes: usize,
    /// `max_connections`: connections served at once per listener (the
    /// socket and the TCP port each; 1..=1024, default 16); one more is
    /// told so in one error line and closed. A connection that completes
    /// no request line for 60 s is told so and closed
    /// ([`crate::ingest::conn::LINE_TIMEOUT`]).
    pub max_connections: usize,
    /// `max_connections_per_peer`: connections one peer (a socket
    /// client's uid, a TCP client's address: [`crate::intake::share::PeerId`])
    /// may hold at once on a listener (1..=1024, default 8, half the default
    /// `max_connections`; at most
    /// `max_connections` in effect), so one local user cannot take every
    /// slot and lock the others out. One more is told so in one error line
    /// naming this key and closed. On loopback TCP every local user is the
    /// one peer 127.0.0.1: tell users apart on the socket.
    pub max_connections_per_peer: usize,
    /// `max_rate_per_sec`: requests per second per connection (token
    /// bucket, burst of one second's worth; 1..=1000000, default 5000).
    /// Past it the agent stops reading that connection until tokens are
    /// back (backpressure, nothing refused).
    pub max_rate_per_sec: u32,
    /// `max_fields`: fields per request (1..=1024, default 64).
    pub max_fields: usize,
    /// `max_buffered_bytes`: bytes of readings from the socket, the TCP
    /// port and the bridges held in memory at once, from their parse until
    /// their reply (262144..=268435456, default 8 MiB). Each listener and
    /// the bridges may take half of it; past its share a connection waits
    /// (the agent stops reading it: backpressure, counted
    /// `ingest_backpressure`), a bridge leaves the message with its broker.
    /// The board's own sources have room of their own beside it, so they
    /// are never refused because this input filled memory
    /// ([`crate::intake::budget`]).
    pub max_buffered_bytes: usize,
    /// `max_connection_bytes`: the same, per connection (65536..=
    /// `max_buffered_bytes`, default 1 MiB): one connection past it waits
    /// for its own replies. A reading larger than this alone is taken when
    /// the connection holds nothing else.
    pub max_connection_bytes: usize,
    /// `max_bytes_per_sec_per_peer`: bytes a second one peer may send
    /// (a socket client's uid, a TCP client's IP address; every local user
    /// on the loopback TCP port is one peer), as estimated stored bytes
    /// ([`crate::intake::share::row_bytes`]); a token bucket of
    /// `max_burst_bytes_per_peer` (1024..=1073741824, default 1 MiB/s).
    /// Past it a request is answered with an error naming this key
    /// (counted `readings_refused_peer_rate`).
    pub max_bytes_per_sec_per_peer: u64,
    /// `max_burst_bytes_per_peer`: the bucket's size, bytes
    /// (`max_line_bytes`..=1073741824, default 4 MiB).
    pub max_burst_bytes_per_peer: u64,
    /// `max_spool_share_per_peer_percent`: the share of the spool's
    /// capacity one peer's undelivered readings may hold (1..=
    /// `max_spool_share_input_percent`, default 25); past it its requests
    /// are refused by name (`readings_refused_peer_share`). Each mqtt
    /// bridge is a peer of its own.
    pub max_spool_share_per_peer_percent: u32,
    /// `max_spool_share_input_percent`: the share every peer and bridge
    /// together may hold (1..=90, default 50); the rest is kept for the
    /// board's own sources (`readings_refused_input_share` past it).
    pub max_spool_share_input_percent: u32,
    /// `[[ingest.streams]]`: the streams clients may write, by name.
    pub streams: Vec<IngestStream>,
    /// `stream_patterns`: further streams allowed by prefix (`"plant.*"`
    /// allows every valid name starting with `plant.`); such streams are
    /// `durability = "batched"`, priority 0, and
    /// at most [`crate::ingest::MAX_PATTERN_STREAMS`] of them are let in
    /// per listener (the socket and the TCP port each) per run of the agent.
    pub stream_patterns: Vec<String>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            socket: None,
            socket_group: None,
            socket_mode: 0o660,
            tcp: None,
            tcp_public: false,
            max_line_bytes: 16 * 1024,
            max_connections: 16,
            max_connections_per_peer: 8,
            max_rate_per_sec: 5000,
            max_fields: 64,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            max_connection_bytes: DEFAULT_MAX_CONNECTION_BYTES,
            max_bytes_per_sec_per_peer: share::DEFAULT_BYTES_PER_SEC,
            max_burst_bytes_per_peer: share::DEFAULT_BURST_BYTES,
            max_spool_share_per_peer_percent: share::DEFAULT_PEER_PERCENT,
            max_spool_share_input_percent: share::DEFAULT_INPUT_PERCENT,
            streams: Vec::new(),
            stream_patterns: Vec::new(),
        }
    }
}

impl IngestConfig {
    /// The peers' bounds ([`crate::intake::share`]).
    pub fn share_settings(&self) -> ShareSettings {
        ShareSettings {
            bytes_per_sec: self.max_bytes_per_sec_per_peer,
            burst_bytes: self.max_burst_bytes_per_peer,
            peer_percent: self.max_spool_share_per_peer_percent,
            input_percent: self.max_spool_share_input_percent,
        }
    }

    /// Whether any listener is configured.
    pub fn enabled(&self) -> bool {
        self.socket.is_some() || self.tcp.is_some()
    }

    /// The declared stream `name`, or one a pattern allows (batched,
    /// default priority); `None`: clients may not write it.
    pub fn stream(&self, name: &str) -> Option<IngestStream> {
        if let Some(s) = self.streams.iter().find(|s| s.name == name) {
            return Some(s.clone());
        }
        let allowed = stream_name_ok(name)
            && self
                .stream_patterns
                .iter()
                .any(|p| pattern_matches(p, name));
        allowed.then(|| IngestStream {
            name: name.to_owned(),
            settings: StreamSettings::plain(),
        })
    }
}

/// One `[[ingest.streams]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestStream {
    /// `name`: the stream (the name rule of sources, see [`stream_name_ok`]).
    pub name: String,
    /// What the stream sets: durability, delivery priority, live-first,
    /// batching (a stream a pattern allows gets [`StreamSettings::plain`]).
    pub settings: StreamSettings,
}
