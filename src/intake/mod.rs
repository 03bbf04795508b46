//! What the ingest (writer) thread receives: readings from every producer
//! (the sampler, the ingest socket, the local-broker bridge), control
//! requests the command thread sends straight into the same channel
//! ([`ControlSender`]), counts of refused input, and wake-ups.
//!
//! It sits below every producer, so none of them imports the agent. One
//! rule: a reading sent here is not stored until the ingest thread's commit
//! says so (its [`crate::spool::Reply`] carries the outcome).
//!
//! [`budget`]: the room in memory the socket and the bridges take for each
//! reading they hand over, so no client can fill the agent's memory.
//! [`share`]: the room in the spool each local peer (and all of them
//! together) may take, and a peer's byte rate, so no client can take the
//! board's own sources' room.

pub mod budget;
pub mod share;

use crate::spool::NewEvent;
use serde_json::Value;
use std::sync::mpsc::Sender;
use std::time::Duration;

/// What wakes the ingest thread.
#[derive(Debug)]
pub enum IngestMsg {
    /// A reading from a source.
    Reading(NewEvent),
    /// A request from the command thread.
    Control(Control),
    /// A signal arrived: look at the stop and reload flags.
    Wake,
    /// Delivery records wait in the delivery thread's ledger
    /// (`crate::delivery::ledger`): they ride the next commit; with `now`
    /// (a full batch) that commit is made at once.
    Records {
        /// Commit now instead of at the close of the window.
        now: bool,
    },
    /// Add `by` to the persistent counter `name` (shown by `status`), for
    /// bad data a producer refused before it became a reading (e.g.
    /// `bridge_payload_refused`). Stored with the next commit window.
    Count {
        /// Counter name, e.g. `bridge_payload_refused.<source>`.
        name: String,
        /// Increment.
        by: i64,
    },
}

/// A request to the agent's main thread; the reply is a result object or an
/// error message (which makes the command `rejected`).
#[derive(Debug)]
pub enum Control {
    /// Change one source's sampling interval.
    SetInterval {
        /// Source (stream) name.
        source: String,
        /// New interval.
        interval: Duration,
        /// Reply.
        reply: Sender<Result<Value, String>>,
    },
    /// Commit the ingest buffer now.
    Flush {
        /// Reply.
        reply: Sender<Result<Value, String>>,
    },
    /// Check a pushed config against the local policy and apply it.
    ApplyConfig {
        /// The TOML text: an overlay, or a whole config when signed.
        text: String,
        /// Hex Ed25519 signature of `text` (signed mode only).
        signature: Option<String>,
        /// Reply.
        reply: Sender<Result<Value, String>>,
    },
    /// Re-read the config file.
    Reload {
        /// Reply.
        reply: Sender<Result<Value, String>>,
    },
}

/// The command thread's handle on the writer: sends a [`Control`] request
/// straight into the writer's channel, with no thread in between. Cloning
/// shares the channel.
#[derive(Debug, Clone)]
pub struct ControlSender(Sender<IngestMsg>);

impl ControlSender {
    /// A handle sending into the writer's channel `tx`.
    pub fn new(tx: Sender<IngestMsg>) -> ControlSender {
        ControlSender(tx)
    }

    /// Send `c` to the writer. `Err` when the writer has stopped (its
    /// channel is closed): the caller answers that the agent is stopping.
    pub fn send(&self, c: Control) -> Result<(), WriterStopped> {
        self.0
            .send(IngestMsg::Control(c))
            .map_err(|_| WriterStopped)
    }
}

/// The writer has stopped: its channel is closed, a request goes unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterStopped;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_request_goes_straight_into_the_writers_channel() {
        let (tx, rx) = std::sync::mpsc::channel();
        let ctl = ControlSender::new(tx);
        let (reply, answer) = std::sync::mpsc::channel();
        assert_eq!(ctl.send(Control::Flush { reply }), Ok(()));
        match rx.try_recv() {
            Ok(IngestMsg::Control(Control::Flush { reply })) => {
                let _ = reply.send(Ok(Value::Null));
            }
            other => panic!("expected the flush request, got {other:?}"),
        }
        assert_eq!(answer.recv(), Ok(Ok(Value::Null)));
    }

    #[test]
    fn a_request_to_a_stopped_writer_says_so() {
        let (tx, rx) = std::sync::mpsc::channel();
        let ctl = ControlSender::new(tx);
        drop(rx);
        let (reply, _answer) = std::sync::mpsc::channel();
        assert_eq!(ctl.send(Control::Reload { reply }), Err(WriterStopped));
    }
}
