//! What reaches the command thread on its channel: a wake-up from the
//! agent, a PUBLISH from the MQTT thread (through the [`super::inbox`]), a
//! finished job from one of its lanes.
//!
//! Its one rule: **a lane is busy from the moment its job is sent until its
//! [`CmdMsg::Done`] arrives**, so each lane runs one command at a time; a
//! `Done` therefore names the lane it ran on.

use super::admission::Tier;
use super::exec_handler::HandlerOutcome;
use std::time::Duration;

/// Messages to the command thread.
#[derive(Debug)]
pub enum CmdMsg {
    /// Look at the stop flag now (sent by the agent when it stops; the
    /// worker otherwise sleeps until a message or its next deadline).
    Wake,
    /// A PUBLISH on the command topic, received on connection `epoch`.
    Incoming {
        /// Connection epoch it arrived on (acks go only to that connection).
        epoch: u64,
        /// The message.
        publish: rumqttc::Publish,
        /// Its tier as the inbox judged it from `scope` and `name` alone
        /// ([`super::admission::peek`]): the order it is taken in.
        tier: Tier,
    },
    /// A lane's thread finished a job.
    Done {
        /// The lane it ran on.
        lane: Lane,
        /// Scope.
        scope: String,
        /// Command id.
        command_id: String,
        /// Name.
        name: String,
        /// Outcome.
        outcome: HandlerOutcome,
        /// How long it ran.
        duration: Duration,
        /// Handler may be re-run after an interruption.
        retry_safe: bool,
    },
}

/// A thread that runs long commands one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Exec handlers (programs from the board config).
    Exec,
    /// Built-ins that ask the agent's main thread.
    Agent,
}

impl Lane {
    /// Position of the lane's state in the worker's array: 0 or 1.
    pub(super) fn index(self) -> usize {
        match self {
            Lane::Exec => 0,
            Lane::Agent => 1,
        }
    }

    /// Name in log lines and refusals.
    pub(super) fn name(self) -> &'static str {
        match self {
            Lane::Exec => "exec-handler",
            Lane::Agent => "agent-request",
        }
    }
}
