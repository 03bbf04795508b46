//! rumqttc's event loop, polled to completion on a thread of its own, its
//! events handed to the sink through a bounded channel.
//!
//! Why: `Connection::recv_timeout` runs one `EventLoop::poll` under a tokio
//! timeout and drops it when the time is up. A poll dropped while it is
//! writing (the codec waits for the socket once 8 KiB are buffered) loses
//! the packet it was writing after rumqttc's state already counted it: a
//! PINGREQ that never leaves ends the connection at the next keep-alive
//! ("Last pingreq isn't acked"), a receipt that never leaves holds an
//! in-flight slot for the whole connection. The sink's waits are as short
//! as its batch window (1 ms), so under load this happened every few
//! seconds. Here the poll is never cut short; the sink waits on the channel
//! instead.
//!
//! The channel holds [`EVENTS_QUEUED`] events: a sink busy committing
//! stops the poller, and the broker's in-flight window (not our memory)
//! holds the rest.

use crate::os::threads::join_within;
use rumqttc::{Connection, ConnectionError, Event};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most events waiting for the sink.
pub const EVENTS_QUEUED: usize = 1024;

/// One event of the connection, or why it ended.
pub type Polled = Result<Event, ConnectionError>;

/// The poller of one connection.
pub struct Poller {
    events: Receiver<Polled>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Poll `conn` on a new thread until it fails (the error is the last
    /// event), its client is dropped, or the poller is dropped.
    ///
    /// Errors: the thread could not be started (named in the message).
    pub fn start(mut conn: Connection) -> Result<Poller, String> {
        let (tx, events) = mpsc::sync_channel(EVENTS_QUEUED);
        let thread = std::thread::Builder::new()
            .name("sink-mqtt".into())
            .spawn(move || {
                // `iter` ends when every client of the connection is gone.
                for ev in conn.iter() {
                    let failed = ev.is_err();
                    // Stop at the first failure: polling on would reconnect
                    // this client, and a new connection is a new client.
                    if tx.send(ev).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| format!("starting the MQTT poller thread: {e}"))?;
        Ok(Poller {
            events,
            thread: Some(thread),
        })
    }

    /// The next event within `wait`, in rumqttc's `recv_timeout` shape:
    /// `Err(Disconnected)` once the poller has ended.
    pub fn recv_timeout(&self, wait: Duration) -> Result<Polled, rumqttc::RecvTimeoutError> {
        match self.events.recv_timeout(wait) {
            Ok(ev) => Ok(ev),
            Err(RecvTimeoutError::Timeout) => Err(rumqttc::RecvTimeoutError::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(rumqttc::RecvTimeoutError::Disconnected),
        }
    }

    /// End the poller once its connection is done with: the caller has
    /// queued a DISCONNECT on the client (rumqttc's event loop keeps a
    /// sender of its own, so dropping the client does not end a poll).
    /// The poller stops at the next event it would hand over (the
    /// DISCONNECT going out, or the broker closing); waits at most 2 s,
    /// then leaves the thread behind, named in the log.
    pub fn finish(self) {
        let Poller { events, thread } = self;
        drop(events);
        if let Some(t) = thread {
            join_within(
                t,
                Instant::now() + Duration::from_secs(2),
                "sink MQTT poller",
            );
        }
    }
}
