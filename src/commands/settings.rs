//! `[commands]` settings: what the command thread accepts and keeps, and
//! the exec handlers the local config names. Built by the config
//! ([`crate::config`]) and handed to the command thread as they are.
//!
//! Its one rule: a handler is only ever what the board's own config says
//! (program, fixed arguments, typed parameters); nothing a command sends can
//! widen it.

use crate::event::signature::PublicKey;
use crate::os::process::{Credentials, Limits};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// `[commands]`: commands received over MQTT on `<topic_prefix>/commands`.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandsConfig {
    /// `enabled`: subscribe to the command topic.
    pub enabled: bool,
    /// `max_payload_bytes`: larger command messages are rejected, bytes
    /// (256..=1048576, default 65536). The MQTT incoming packet limit is this
    /// plus the command topic and the PUBLISH header.
    pub max_payload_bytes: usize,
    /// `record_retention_secs`: the redelivery window, seconds (3600..=ten
    /// years, default 604800 = 7 days). A command record is never deleted
    /// before it is this old, its age measured on the agent's monotonic
    /// clock (time the agent has run since the receipt, a lower bound of the
    /// real age across restarts and reboots), never on the wall clock.
    pub record_retention: Duration,
    /// `max_records`: command records kept, a count (1000..=1000000, default
    /// 10000); commands no operator key signed fill three quarters,
    /// `apply-config` seven eighths, the operator's signed commands all of
    /// it. At a share's end, the oldest droppable records go first
    /// (`rejected` ones, `ping` and `status`); records of commands that ran
    /// with a side effect are deleted only once outside the redelivery
    /// window. While none can go, another command is answered `no_room`
    /// (not recorded), an operator command or a push is held back (not
    /// acknowledged).
    pub max_records: usize,
    /// `max_queued`: commands waiting for their lane (exec handlers; agent
    /// requests), per lane, a count (1..=10000, default 100). When a lane is
    /// full, new command PUBLISHes for it are held back: not acknowledged
    /// (the broker keeps them), parked in memory within the command inbox's
    /// bytes, and taken once there is room; what does not fit is redelivered
    /// by the broker after the agent reconnects.
    pub max_queued: usize,
    /// `max_per_minute_per_scope`: new commands accepted per scope, per
    /// minute (a burst of this many, refilled at this rate; 1..=60000,
    /// default 60). Over it a command is answered `rejected` (rate limit),
    /// not recorded, and counted `commands_rate_limited`. Also the budget
    /// of every `apply-config` not signed by an operator key, together.
    pub max_per_minute_per_scope: u32,
    /// `max_per_minute`: new commands accepted to run per minute, all those
    /// no operator key signed together (`apply-config` aside;
    /// not `ping`, `status` or unknown names, whose records are droppable),
    /// on top of each scope's own limit (1..=600000, default 600): inventing
    /// scopes buys a sender nothing ([`super::admission`]).
    pub max_per_minute: u32,
    /// `max_answers_per_minute`: messages no operator key signed answered
    /// at receipt, per minute, all together (1..=600000, default 600):
    /// `ping`, `status`, unknown names, unsigned commands refused,
    /// malformed messages, duplicates and every `rate_limited` or
    /// `no_room` answer; unsigned `apply-config` has a budget of
    /// `max_per_minute_per_scope` of its own. Each answer is a spool
    /// commit, so this bounds what a sender on the command topic can make
    /// the board write. Over it a message is acknowledged and dropped
    /// unanswered (nothing recorded), counted `commands_unanswered`
    /// ([`super::admission`]).
    pub max_answers_per_minute: u32,
    /// `operator_public_keys`: Ed25519 public keys (64 hex digits each in
    /// the file; several, for rotation; default none). A command signed by
    /// one of them ([`super::signed`]) is the operator's: taken first, rate
    /// buckets of its own, a reserved quarter of the records, of each
    /// lane's queue and of the command inbox that no other sender can fill
    /// ([`super::admission`]). Local only: no push can change them.
    pub operator_public_keys: Vec<PublicKey>,
    /// `allow_unsigned`: run commands with a side effect that no operator
    /// key signed, in the room of other senders (default false: such a
    /// command is answered `rejected`, `unsigned: ...`, at receipt; `ping`,
    /// `status` and signed whole configs stay open). Local only.
    pub allow_unsigned: bool,
    /// `default_ttl_secs`: time to live given to an exec-handler command
    /// that names none, seconds (1..=`record_retention_secs`, default 3600).
    /// Built-ins need none.
    pub default_ttl: Duration,
    /// `[[commands.handlers]]`: exec handlers.
    pub handlers: Vec<ExecHandler>,
}

impl CommandsConfig {
    /// A caution for the operator when anyone who may publish on the
    /// command topic can run commands and nobody is the operator: commands
    /// on, `allow_unsigned = true` and no `operator_public_keys`. Then a
    /// stranger runs what any command may run and, filling the records
    /// with commands that ran (kept for the redelivery window), gets the
    /// operator's own commands answered `no_room` ([`super::admission`]).
    /// `None` otherwise: by default an unsigned command with a side effect
    /// is refused, so there is nothing to warn about. Logged at start,
    /// printed by `check-config`.
    pub fn caution(&self) -> Option<String> {
        if !self.enabled || !self.allow_unsigned || !self.operator_public_keys.is_empty() {
            return None;
        }
        let handlers = match self.handlers.len() {
            0 => String::new(),
            1 => " and the exec handler".to_owned(),
            n => format!(" and the {n} exec handlers"),
        };
        Some(format!(
            "commands.allow_unsigned = true and no commands.operator_public_keys: anyone who may publish on the command topic can run every command with a side effect (set-interval, flush, checkpoint, requeue-failed, reload-config, apply-config overlays{handlers}) and, by filling commands.max_records ({}) with commands that ran, get the operator's own commands answered no_room for up to commands.record_retention_secs ({}); make a key with `edgespool keygen --out FILE`, list the public key it prints in commands.operator_public_keys and sign the operator's commands (docs/commands.md), or remove allow_unsigned",
            self.max_records,
            self.record_retention.as_secs()
        ))
    }
}

/// One `[[commands.handlers]]` entry: a program with fixed arguments, run
/// without a shell; `{param}` in an argument is replaced by a validated value.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecHandler {
    /// Command name operators send.
    pub name: String,
    /// Absolute path of the program.
    pub program: PathBuf,
    /// Arguments, with `{param}` placeholders.
    pub args: Vec<String>,
    /// Killed after this.
    pub timeout: Duration,
    /// Captured stdout/stderr are truncated to this many bytes each.
    pub max_output_bytes: usize,
    /// May be re-run after a crash interrupted it (F14 variant F).
    pub retry_safe: bool,
    /// Declared parameters.
    pub params: Vec<ParamSpec>,
    /// `env`: variables the program gets besides `PATH` and `LANG` (a name
    /// given here replaces that default). Values are taken literally from
    /// the local config; nothing from a command reaches them.
    pub env: BTreeMap<String, String>,
    /// `cwd`: working directory, absolute (default `/`).
    pub cwd: PathBuf,
    /// `cpu_secs` (seconds), `max_memory_bytes` (bytes of address space),
    /// `max_open_files` (descriptors): set in the child before it runs.
    pub limits: Limits,
    /// `user` and `group`, resolved to ids when the config was validated;
    /// `None`: the program runs as the agent's user.
    pub credentials: Option<Credentials>,
}

/// A declared handler parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Name, as used in `{name}` and in the command's `args`.
    pub name: String,
    /// Type and bounds.
    pub kind: ParamKind,
    /// Must be present.
    pub required: bool,
}

/// Parameter types. Strings are limited to `[A-Za-z0-9_.:@-]`, may not start
/// with `-` or `.`, so no value can become an option or a path escape.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamKind {
    /// An integer in `min..=max`.
    Int {
        /// Lower bound.
        min: i64,
        /// Upper bound.
        max: i64,
    },
    /// A number in `min..=max`.
    Float {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// A safe string of at most `max_len` bytes.
    Str {
        /// Length limit.
        max_len: usize,
    },
    /// One of `values`.
    Enum {
        /// Allowed values.
        values: Vec<String>,
    },
    /// `true` or `false`.
    Bool,
}
