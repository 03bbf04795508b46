//! One connection's rumqttc event loop, polled on a thread of its own
//! ([`Conn`]); a row's events are handled there
//! ([`super::rowacks`]), the others reach the MQTT thread through a bounded
//! channel, which the MQTT thread waits on with its own timeouts.
//!
//! Its one rule: **a poll is never cut short while the connection lives,
//! and the thread ends within [`FINISH_WITHIN`] once the connection is
//! ended.** rumqttc's `Connection::recv_timeout` runs one `EventLoop::poll`
//! under a tokio timeout and drops it when the time is up; a poll dropped
//! while it is writing loses or strands the packet after rumqttc's state has
//! counted it. Seen here: after a restart with 10,000 commands redelivered,
//! with the broker's Receive Maximum of 20 (mosquitto's default) reached,
//! the publishes already written sat unflushed and the connection went
//! silent until the next keep-alive (about 30 s with no PUBACK). The sink
//! had the same fault and the same cure (`crate::sink` polls on a thread
//! too).
//!
//! The other half: a poll that is never cut short returns only on an event,
//! and a stalled broker sends none. rumqttc's blocking `Connection` cannot
//! be interrupted (its runtime is private; dropping every client does not
//! close the request channel, the event loop holds a sender of its own;
//! our DISCONNECT can find the channel full, or the event loop not reading
//! it: flow control, a packet id collision, a write the peer does not
//! take). So the event loop runs here on a current-thread runtime of this
//! thread's own, each poll raced against the end of the [`Conn`]: once the
//! MQTT thread has ended the connection (dropped its `Conn`), the poll in
//! progress and the next ones get [`GRACE`] for our DISCONNECT to leave;
//! then the poll is dropped with the event loop, which closes the socket.
//! Cut short then, a half-written packet strands nothing: the connection's
//! rows were handed back for replay when it was ended. Before this, a
//! watchdog rebuild against a broker that went quiet left its poller
//! behind until the next keep-alive ping: 13 to 28 of them still running
//! after 50 rebuilds in `tests/it/rebuilds.rs`, 3 to 5 MiB of memory.
//!
//! The channel holds [`EVENTS_QUEUED`] events: an MQTT thread that falls
//! behind stops the poller between two polls, never inside one, and what
//! waits is bounded: 64 packets of at most the incoming limit each (64 x
//! 64 KiB = 4 MiB of commands at the default `commands.max_payload_bytes`).

use super::rowacks::{RowAcks, Take};
use super::wire::{Ev, Failure, RawConn};
use crate::os::threads::join_within;
use rumqttc::RecvTimeoutError;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Most events waiting for the MQTT thread.
pub const EVENTS_QUEUED: usize = 64;

/// How long a poller goes on once its connection was ended, so that the
/// DISCONNECT the MQTT thread queued can leave (a broker that gets none
/// publishes the will: the retained status would read `offline` at every
/// rebuild). On a live link it leaves within a round trip.
const GRACE: Duration = Duration::from_secs(1);

/// How long dropping a [`Conn`] waits for its poller: [`GRACE`], and the
/// handling of the one event it may be inside then. A poller still running
/// after that is a fault of this module; it is named in the log.
const FINISH_WITHIN: Duration = Duration::from_secs(2);

type Polled = Result<Ev, Failure>;

/// One connection's events, polled on their own thread, which ends within
/// [`FINISH_WITHIN`] of this being dropped.
pub struct Conn {
    events: Option<Receiver<Polled>>,
    /// Dropped first when this is: the poller's signal that the
    /// connection was ended.
    end: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Conn {
    /// Poll `raw` on a new thread until it fails (the failure is the last
    /// event; polling on would reconnect this client, and every connection
    /// gets a new client) or this `Conn` is dropped. `keep_alive` words a
    /// 3.1.1 ping timeout.
    ///
    /// A thread (or its runtime) that cannot be started gives one failure
    /// naming why.
    ///
    /// Each event goes through `rows` first, on the poller thread
    /// ([`RowAcks::take`]): a row's outgoing PUBLISH and PUBACK are handled
    /// there and never queued for the MQTT thread.
    pub fn start(raw: RawConn, keep_alive: Duration, rows: RowAcks) -> Conn {
        let (tx, events) = mpsc::sync_channel(EVENTS_QUEUED);
        let (end, ended) = oneshot::channel();
        let fail = tx.clone();
        let spawned = std::thread::Builder::new()
            .name("mqtt-poll".into())
            .spawn(move || poll(raw, keep_alive, &tx, rows, ended));
        let thread = match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                let _ = fail.try_send(Err(failure(format!(
                    "cannot start the MQTT poller thread: {e}"
                ))));
                None
            }
        };
        Conn {
            events: Some(events),
            end: Some(end),
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

impl Drop for Conn {
    fn drop(&mut self) {
        // The end first, then nobody listens: the poller gives our
        // DISCONNECT its grace and ends.
        drop(self.end.take());
        drop(self.events.take());
        if let Some(t) = self.thread.take() {
            join_within(t, Instant::now() + FINISH_WITHIN, "the MQTT poller thread");
        }
    }
}

/// A failure that is ours, not the broker's.
fn failure(reason: String) -> Failure {
    Failure {
        reason,
        refused: false,
        oversize: None,
        closed_by_peer: false,
        protocol_refused: false,
    }
}

/// Where a connection's end stands, as its poller sees it.
#[derive(Debug, Default)]
struct Ending {
    /// The MQTT thread ended the connection (dropped its [`Conn`]).
    ended: bool,
    /// Our DISCONNECT left.
    disconnected: bool,
    /// Set at the end: no poll goes on past it.
    deadline: Option<tokio::time::Instant>,
}

impl Ending {
    /// The connection was ended (or nobody listens any more).
    fn end(&mut self) {
        self.ended = true;
        self.deadline
            .get_or_insert_with(|| tokio::time::Instant::now() + GRACE);
    }

    /// Nothing is left to wait for: ended, and our DISCONNECT is out (or
    /// can no longer go out).
    fn done(&self) -> bool {
        self.ended && self.disconnected
    }
}

/// The poller thread: each poll raced against the end ([`next`]); each
/// event through `rows`, the others to the MQTT thread, until the first
/// failure, until `rows` finds the connection lost, or until the end.
fn poll(
    mut raw: RawConn,
    keep_alive: Duration,
    tx: &SyncSender<Polled>,
    mut rows: RowAcks,
    mut ended: oneshot::Receiver<()>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = tx.try_send(Err(failure(format!(
                "cannot start the MQTT poller's runtime: {e}"
            ))));
            return;
        }
    };
    let mut ending = Ending::default();
    while !ending.done() {
        let Some(polled) = rt.block_on(next(&mut raw, keep_alive, &mut ended, &mut ending)) else {
            break;
        };
        let ev = match polled {
            Ok(e) => match rows.take(e) {
                Take::Forward(e) => Ok(e),
                Take::Handled => continue,
                Take::Gone => break,
            },
            Err(f) => Err(f),
        };
        let failed = ev.is_err();
        if matches!(ev, Ok(Ev::DisconnectSent)) {
            ending.disconnected = true;
        }
        if failed {
            let _ = tx.send(ev);
            break;
        }
        if ending.ended {
            // Nobody listens; the poll went on for our DISCONNECT only.
            continue;
        }
        if tx.send(ev).is_err() {
            ending.end();
        }
    }
    // A DNS lookup under way (rumqttc resolves on tokio's blocking pool) is
    // not waited for: it ends by itself at the resolver's timeout.
    rt.shutdown_background();
}

/// The next poll of `raw`, raced against the end: `None` once the end's
/// deadline passed with the poll unfinished (it is dropped), or when the
/// event loop closed. The poll in progress when the end comes goes on; it
/// is never cut short before the end.
async fn next(
    raw: &mut RawConn,
    keep_alive: Duration,
    ended: &mut oneshot::Receiver<()>,
    ending: &mut Ending,
) -> Option<Polled> {
    let poll = raw.next(keep_alive);
    tokio::pin!(poll);
    if !ending.ended {
        tokio::select! {
            biased;
            p = &mut poll => return p,
            // Sent never: the sender dropped is the end.
            _ = &mut *ended => {
                ending.end();
                if ending.done() {
                    return None;
                }
            }
        }
    }
    let deadline = ending
        .deadline
        .unwrap_or_else(|| tokio::time::Instant::now() + GRACE);
    tokio::time::timeout_at(deadline, poll).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_end_gives_a_grace_once_and_is_done_only_with_the_disconnect_out() {
        let mut e = Ending::default();
        assert!(!e.done());
        e.disconnected = true;
        assert!(!e.done(), "our DISCONNECT alone does not end the poller");
        e.end();
        let first = e.deadline.expect("a deadline at the end");
        e.end();
        assert_eq!(e.deadline, Some(first), "the grace is given once");
        assert!(e.done());
    }
}
