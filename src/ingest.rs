//! Local socket ingest: other programs on the gateway put readings into the
//! spool through a Unix socket (`ingest.socket`) or a loopback TCP port
//! (`ingest.tcp`), one JSON request per line, one reply line each.
//!
//! ```text
//!  client ──line──▶ conn reader ──parse_request──▶ IngestMsg::Reading(NewEvent{key, reply})
//!                                                    │ (ingest thread: commit window, or FULL at once)
//!  client ◀──line── conn writer ◀── CommitOutcome ◀──┘ in request order
//! ```
//!
//! Its one rule: **`{"ok":true}` is written only after the reading's commit**
//! (the ingest thread's reply); a reading the agent could not commit before
//! it stopped is answered `agent stopping; not stored`, never ok. A client
//! that got no reply retries with the same `key`: the event id derives from
//! (device, stream, key), so a retry of a committed reading returns the same
//! id and stores nothing new.
//!
//! Modules: [`request`] (one line → a validated request, pure; the fuzz
//! target's entry), [`listen`] (sockets, accept, the connection bound),
//! [`conn`] (one connection: bounded line reads, pipelining, replies in order).

pub mod conn;
pub mod listen;
pub mod request;

pub use listen::{start, SocketIngest};
pub use request::{parse_request, Request, RequestError};

use std::collections::HashMap;
use std::sync::Mutex;

/// Counter increments of the listeners, drained by the ingest thread into
/// the spool's counters (`status`, metrics). Names: `ingest_requests`
/// (handed to the ingest thread), `ingest_refused` and
/// `ingest_refused.<reason>` (`bad_request`, `bad_stream`,
/// `unknown_stream`, `bad_fields`, `bad_ts`, `bad_key`, `line_too_long`,
/// `too_many_connections`, `agent_stopping`), `ingest_connections`.
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
