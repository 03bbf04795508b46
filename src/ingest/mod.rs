//! Local socket ingest: other programs on the gateway put readings into the
//! spool through a Unix socket (`ingest.socket`) or a loopback TCP port
//! (`ingest.tcp`), one JSON request per line, one reply line each.
//!
//! ```text
//!  client ──line──▶ conn reader ──parse_request──▶ IngestMsg::Reading(NewEvent{key, reply})
//!                                                    │ (ingest thread: commit window, or FULL at once,
//!                                                    │  grouped with the FULL readings queued meanwhile)
//!  client ◀──line── conn writer ◀── CommitOutcome ◀──┘ in request order
//! ```
//!
//! Its one rule: **`{"ok":true}` is written only after the reading's commit**
//! (the ingest thread's reply); a reading the agent could not commit before
//! it stopped is answered `agent stopping; not stored`, never ok. A client
//! that got no reply retries with the same `key`: the spool remembers the
//! key (device, stream, the key's scope, key) with the event id it was
//! published under, so a retry of a committed reading returns the same id
//! and stores nothing new. The scope is the
//! listener, and on the Unix socket the peer's uid ([`KeyScope`]): another
//! client can neither take my key's event id nor have my reading dropped
//! as a duplicate of its own; the same key with another reading is refused.
//!
//! Memory: every request handed over holds room in the input budget
//! ([`crate::intake::budget`]: per connection, per listener, in all) until
//! its reply; a connection without room is not read (backpressure). The
//! spool: every request is first admitted within its peer's byte rate and
//! share of the spool ([`crate::intake::share`]), or refused by name.
//!
//! Modules: [`request`] (one line → a validated request, pure; the fuzz
//! target's entry), [`listen`] (sockets, accept, the connection bound),
//! [`conn`] (one connection: bounded line reads, pipelining, replies in order).

pub mod conn;
pub mod listen;
pub mod request;
pub mod settings;

pub use listen::{start, SocketIngest};

/// Who a connection's keys belong to: the TCP port's clients share one
/// scope (nothing tells local users apart there), the Unix socket's have
/// one per peer uid (`SO_PEERCRED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyScope {
    /// A client of `ingest.tcp`.
    Tcp,
    /// A client of `ingest.socket` running as this uid (`None`: the kernel
    /// did not say; such clients share one scope).
    Unix(Option<u32>),
}

impl KeyScope {
    /// The scope as the event id hashes it: `tcp`, `unix:uid=<uid>`,
    /// `unix:uid=unknown`.
    pub fn as_text(&self) -> String {
        match self {
            KeyScope::Tcp => "tcp".to_owned(),
            KeyScope::Unix(Some(uid)) => format!("unix:uid={uid}"),
            KeyScope::Unix(None) => "unix:uid=unknown".to_owned(),
        }
    }
}
pub use request::{parse_request, Request, RequestError};
pub use settings::{IngestConfig, IngestStream};

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// Streams a stream pattern (`ingest.stream_patterns`) may create in one
/// run of the agent, per listener (the socket's clients and the TCP port's
/// each have their own: a TCP client, any local user, cannot use up the
/// socket's). Each stream costs a `streams` row, a per-stream line
/// in `status` and the metrics, and a per-stream query at every summary:
/// without a bound, one local client could create streams until the agent
/// spends its time on them (measured: 20,000 streams made each summary
/// hold the ingest thread for about 50 s).
pub const MAX_PATTERN_STREAMS: usize = 64;

/// The streams patterns have let in this run, shared by every connection
/// of one listener.
#[derive(Debug, Default)]
pub struct PatternStreams(Mutex<HashSet<String>>);

impl PatternStreams {
    /// Whether `stream` may be written: a declared stream always; a stream
    /// a pattern allows while fewer than [`MAX_PATTERN_STREAMS`] such
    /// streams were seen in this run, or if it is one of them.
    ///
    /// Errors: [`RequestError::TooManyStreams`].
    pub fn admit(
        &self,
        cfg: &crate::ingest::IngestConfig,
        stream: &str,
    ) -> Result<(), RequestError> {
        if cfg.streams.iter().any(|s| s.name == stream) {
            return Ok(());
        }
        let Ok(mut seen) = self.0.lock() else {
            return Ok(());
        };
        if seen.contains(stream) {
            return Ok(());
        }
        if seen.len() >= MAX_PATTERN_STREAMS {
            return Err(RequestError::TooManyStreams(stream.to_owned()));
        }
        seen.insert(stream.to_owned());
        Ok(())
    }
}

/// Counter increments of the listeners, drained by the ingest thread into
/// the spool's counters (`status`, metrics). Names: `ingest_requests`
/// (handed to the ingest thread), `ingest_refused` and
/// `ingest_refused.<reason>` (`bad_request`, `bad_stream`,
/// `unknown_stream`, `too_many_streams`, `bad_fields`, `bad_ts`, `bad_key`,
/// `line_too_long`, `idle`, `too_many_connections`, `peer_connections`,
/// `agent_stopping`,
/// and over a peer's bounds `peer_rate`, `peer_share`, `input_share`, each
/// also counted `readings_refused_<reason>`: [`crate::intake::share`]),
/// `ingest_connections`, and `ingest_backpressure` and
/// `ingest_backpressure.<level>` (`connection`, `listener`, `input`): times
/// a connection waited for room in memory before its next request.
#[derive(Debug, Default)]
pub struct Counters(Mutex<HashMap<String, i64>>);

impl Counters {
    /// Add `by` to counter `name`.
    pub fn add(&self, name: &str, by: i64) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(name.to_owned()).or_default() += by;
        }
    }

    /// Count one refusal for `reason` (the total and the reason).
    pub fn refused(&self, reason: &str) {
        self.add("ingest_refused", 1);
        self.add(&format!("ingest_refused.{reason}"), 1);
    }

    /// The increments since the last call, emptied.
    pub fn take(&self) -> Vec<(String, i64)> {
        match self.0.lock() {
            Ok(mut m) => m.drain().collect(),
            Err(_) => Vec::new(),
        }
    }
}
