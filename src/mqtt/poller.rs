//! One connection's rumqttc event loop, polled to completion on a thread of
//! its own ([`Conn`]); a row's events are handled there
//! ([`super::rowacks`]), the others reach the MQTT thread through a bounded
//! channel, which the MQTT thread waits on with its own timeouts.
//!
//! Its one rule: **a poll is never cut short.** rumqttc's
//! `Connection::recv_timeout` runs one `EventLoop::poll` under a tokio
//! timeout and drops it when the time is up; a poll dropped while it is
//! writing loses or strands the packet after rumqttc's state has counted it.
//! Seen here: after a restart with 10,000 commands redelivered, with the
//! broker's Receive Maximum of 20 (mosquitto's default) reached, the
//! publishes already written sat unflushed and the connection went silent
//! until the next keep-alive (about 30 s with no PUBACK). The sink had the
//! same fault and the same cure (`crate::sink` polls on a thread too).
//!
//! The channel holds [`EVENTS_QUEUED`] events: an MQTT thread that falls
//! behind stops the poller between two polls, never inside one, and what
//! waits is bounded: 64 packets of at most the incoming limit each (64 x
//! 64 KiB = 4 MiB of commands at the default `commands.max_payload_bytes`).

use super::rowacks::{RowAcks, Take};
use super::wire::{ev4, ev5, failure_v4, failure_v5, Ev, Failure, RawConn};
use crate::os::threads::join_within;
use rumqttc::RecvTimeoutError;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most events waiting for the MQTT thread.
pub const EVENTS_QUEUED: usize = 64;

/// How long dropping a [`Conn`] waits for its poller to end (it ends at the
/// next event once nobody listens: the DISCONNECT going out, or the broker
/// closing), before it is left behind, named in the log.
const FINISH_WITHIN: Duration = Duration::from_secs(2);

type Polled = Result<Ev, Failure>;

/// One connection's events, polled on their own thread.
pub struct Conn {
    events: Option<Receiver<Polled>>,
    thread: Option<JoinHandle<()>>,
}

impl Conn {
    /// Poll `raw` on a new thread until it fails (the failure is the last
    /// event; polling on would reconnect this client, and every connection
    /// gets a new client) or this `Conn` is dropped. `keep_alive` words a
    /// 3.1.1 ping timeout ([`failure_v4`]).
    ///
    /// A thread that cannot be started gives one failure naming why.
    ///
    /// Each event goes through `rows` first, on the poller thread
    /// ([`RowAcks::take`]): a row's outgoing PUBLISH and PUBACK are handled
    /// there and never queued for the MQTT thread.
    pub fn start(raw: RawConn, keep_alive: Duration, rows: RowAcks) -> Conn {
        let (tx, events) = mpsc::sync_channel(EVENTS_QUEUED);
        let fail = tx.clone();
        let spawned =
            std::thread::Builder::new()
                .name("mqtt-poll".into())
                .spawn(move || match raw {
                    RawConn::V4(mut c) => forward(
                        c.iter()
                            .map(|e| e.map(ev4).map_err(|e| failure_v4(&e, keep_alive))),
                        &tx,
                        rows,
                    ),
                    RawConn::V5(mut c) => forward(
                        c.iter().map(|e| e.map(ev5).map_err(|e| failure_v5(&e))),
                        &tx,
                        rows,
                    ),
                });
        let thread = match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                let _ = fail.try_send(Err(Failure {
                    reason: format!("cannot start the MQTT poller thread: {e}"),
                    refused: false,
                    oversize: None,
                    closed_by_peer: false,
                    protocol_refused: false,
                }));
                None
            }
        };
        Conn {
            events: Some(events),
            thread,
        }
    }

    /// The next event within `wait`: `Err(Timeout)` when none came,
    /// `Ok(Err(_))` when the connection failed, `Err(Disconnected)` once
    /// the poller has ended after that.
    pub fn recv_timeout(&mut self, wait: Duration) -> Result<Polled, RecvTimeoutError> {
        let Some(rx) = self.events.as_ref() else {
            return Err(RecvTimeoutError::Disconnected);
        };
        rx.recv_timeout(wait).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => RecvTimeoutError::Timeout,
            mpsc::RecvTimeoutError::Disconnected => RecvTimeoutError::Disconnected,
        })
    }
}

/// Hand each event over (those `rows` does not take) until the first
/// failure, until nobody listens, or until `rows` finds the connection lost.
fn forward(events: impl Iterator<Item = Polled>, tx: &SyncSender<Polled>, mut rows: RowAcks) {
    for ev in events {
        let ev = match ev {
            Ok(e) => match rows.take(e) {
                Take::Forward(e) => Ok(e),
                Take::Handled => continue,
                Take::Gone => return,
            },
            Err(f) => Err(f),
        };
        let failed = ev.is_err();
        if tx.send(ev).is_err() || failed {
            return;
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Nobody listens now: the poller ends at its next event.
        drop(self.events.take());
        if let Some(t) = self.thread.take() {
            join_within(t, Instant::now() + FINISH_WITHIN, "the MQTT poller thread");
        }
    }
}
