//! edgespool: a store-and-forward agent for ARM Linux gateways.
//!
//! ```text
//!  sources ──append (1 txn)──▶ spool (SQLite, WAL) ──fill window──▶ delivery ──▶ mqtt thread ──▶ broker
//!  (/proc, /sys, files,            ▲        │                                        │
//!   programs)                      │        └── retire (ACKED) ◀── ack map ◀── PUBACK ┘
//!                                  └── retention (ACKED only, bounded batches), checkpoints
//! ```
//!
//! A reading becomes a row in the spool in one local transaction, is
//! published over MQTT QoS 1 with an event id that every retry reuses, and is
//! retired only on proof: the PUBACK of the publish that carried it, or in
//! receipt mode a receipt the fleet signed naming its id and bytes. The rules
//! every change keeps are in `docs/invariants.md`.
//! Delivery is at least once; consumers deduplicate on the event id.
//!
//! The crate is grouped by job, one folder a room, in the order a reading
//! travels, floor by floor from the ground up (a room imports only what lies
//! below it; the test `tests/it/structure.rs` holds the floors):
//!
//! - [`event`]: what a reading is and how it travels (reading, stream,
//!   envelope and event id, batches, receipts on the wire, hex). Imports
//!   nothing of the crate; the sink shares exactly this.
//! - [`os`]: thin Linux wrappers (bounded processes, filesystem guards,
//!   systemd notifications, bounded joins, backoff, the board's identity).
//! - [`spool`]: the SQLite spool, every SQL statement of the agent, and its
//!   integrity (opening, moving a damaged file aside, a lost `-wal`).
//! - [`sink`]: the fleet consumer (`edgespool sink`) and its stores; imports
//!   [`event`] and [`os`] only.
//! - [`flash`]: slow flash: checkpoint and retention policy, the write
//!   budget, the outage budget, the storage probe.
//! - [`intake`]: what the writer thread receives, and the memory budgets.
//! - [`metrics`]: Prometheus text, the textfile and the `/metrics` listener.
//! - [`source`], [`ingest`], [`mqtt`]: the parts that move readings, each
//!   owning its settings: sources and their sampler threads, the local
//!   ingest socket, the MQTT connection thread (with the packet id ↔ row
//!   bookkeeping).
//! - [`delivery`], [`commands`]: the parts on the link: the delivery thread
//!   (lanes, batches, receipt mode and its model check), and commands at
//!   most once.
//! - [`config`]: board config, raw TOML → validated [`config::Config`] of
//!   every part's settings; the file on disk and its last-known-good copy.
//! - [`push`]: config pushes, what they may change and their signatures.
//! - [`agent`]: the threads wired together, the writer, upkeep, health.
//! - [`cli`]: one file per subcommand, the `status` report and `test`'s trial.

pub mod event;
pub mod os;

#[cfg(feature = "sink")]
pub mod sink;
pub mod spool;

pub mod flash;
pub mod intake;
pub mod metrics;

pub mod commands;
pub mod delivery;
pub mod ingest;
pub mod mqtt;
pub mod source;

pub mod config;
pub mod push;

pub mod agent;
pub mod cli;
