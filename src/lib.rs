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
//! retired only when the PUBACK of the publish that carried it arrives.
//! Delivery is at least once; consumers deduplicate on the event id.
//!
//! Modules, in the order a reading travels, floor by floor from the
//! ground up (a module imports only what lies below it; the test
//! `tests/it/structure.rs` holds the floors):
//!
//! Shared vocabulary and leaves (import nothing above them):
//! - [`reading`]: a reading's fields and, for a replayed row, its position;
//! - [`stream`]: stream names, the agent's own streams, [`stream::StreamSettings`];
//! - [`backoff`], [`threads`], [`hex`]: capped backoff, bounded joins, hex text;
//! - [`identity`]: a `device_id` derived from `/etc/machine-id` or the host name;
//! - [`process`]: running a program with a timeout and bounded output, no shell;
//! - [`fsguard`], [`notify`]: lock file, local-filesystem check, directories and files
//!   others could write (refused, created `O_EXCL | O_NOFOLLOW`); systemd notifications;
//! - [`ack`]: packet id ↔ row bookkeeping, pure;
//! - [`receipts`]: the fleet's receipts and the rows waiting for one, pure;
//! - [`batching`]: several events of one stream in one PUBLISH;
//! - [`health`]: ok or degraded, with named reasons (pure);
//! - [`outage`]: ingest and delivery rates, hold and drain time (pure).
//!
//! The wire format and the stores:
//! - [`envelope`]: event ids and the wire format, encoded once at append;
//! - [`spool`]: the SQLite spool, one file per job, every statement of the agent's store;
//! - [`sink`]: the reference consumer (`edgespool sink`) and its stores.
//!
//! What sits on the spool:
//! - [`intake`]: what the ingest thread receives from every producer, and the
//!   memory budgets the socket and the bridges take room in for each reading;
//! - [`lanes`]: which waiting row is offered next (priority, live-first);
//! - [`integrity`]: opening a spool or moving a damaged one aside; when the whole-file check runs;
//! - [`maintenance`]: checkpoint policy, capacity, write budget (pure decisions);
//! - [`write_budget`]: the commit window a write budget chooses, and the
//!   handle every committing thread reads it from;
//! - [`metrics`]: Prometheus text, the textfile and the `/metrics` listener.
//!
//! The parts, each owning its settings:
//! - [`source`]: one file per kind of reading source (system, file, exec, replay, bridge);
//! - [`sampler`]: one thread per source, on its own deadline;
//! - [`ingest`]: the local socket other programs put readings through;
//! - [`mqtt`]: the rumqttc connection thread, backoff and watchdog;
//! - [`publisher`]: the delivery thread, spool → in-flight window, ack → retire;
//! - [`commands`]: commands over MQTT, at most once (receipts, handlers, results).
//!
//! Above the parts:
//! - [`config`]: board config, raw TOML → validated [`config::Config`] of every part's settings;
//! - [`policy`]: what a config push may change (overlay keys, signatures);
//! - [`trial`]: `edgespool test`, one reading per source shown, nothing written;
//! - [`configfile`]: atomic config writes and the last-known-good copy;
//! - [`push`]: config pushes kept in the state directory, confirm or revert;
//! - [`probe`]: storage probe and the knobs derived from it;
//! - [`status`]: the `status` report;
//! - [`agent`]: the threads wired together, the run loop, upkeep and clean stop.

pub mod ack;
pub mod agent;
pub mod backoff;
pub mod batching;
pub mod commands;
pub mod config;
pub mod configfile;
pub mod envelope;
pub mod fsguard;
pub mod health;
pub mod hex;
pub mod identity;
pub mod ingest;
pub mod intake;
pub mod integrity;
pub mod lanes;
pub mod maintenance;
pub mod metrics;
pub mod mqtt;
pub mod notify;
pub mod outage;
pub mod policy;
pub mod probe;
pub mod process;
pub mod publisher;
pub mod push;
pub mod reading;
pub mod receipts;
pub mod sampler;
pub mod sink;
pub mod source;
pub mod spool;
pub mod status;
pub mod stream;
pub mod threads;
pub mod trial;
pub mod write_budget;

/// The model check of [`ack`] and [`spool`] delivery bookkeeping (tests only).
#[cfg(test)]
mod delivery_model;
