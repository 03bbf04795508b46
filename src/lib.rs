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
//! Modules, in the order a reading travels:
//! - [`config`]: board config, raw TOML → validated [`config::Config`];
//! - [`configfile`]: atomic config writes and the last-known-good copy;
//! - [`push`]: config pushes kept in the state directory, confirm or revert;
//! - [`source`]: one file per kind of reading source;
//! - [`sampler`]: one thread per source, on its own deadline;
//! - [`ingest`]: the local socket other programs put readings through (JSON lines, replies after the commit);
//! - [`envelope`]: event ids and the wire format, encoded once at append;
//! - [`spool`]: the SQLite spool, its pragmas, schema and every statement;
//! - [`publisher`]: the delivery thread, spool → in-flight window, ack → retire;
//! - [`ack`]: packet id ↔ row bookkeeping, pure;
//! - [`mqtt`]: the rumqttc connection thread, backoff and watchdog;
//! - [`commands`]: commands over MQTT, at most once (receipts, handlers, results);
//! - [`process`]: running a program with a timeout and bounded output, no shell;
//! - [`fsguard`]: lock file and local-filesystem check;
//! - [`health`]: ok or degraded, with named reasons (pure);
//! - [`notify`]: systemd notifications (ready, status, watchdog while threads progress);
//! - [`integrity`]: when the whole-file check runs (never before delivery);
//! - [`maintenance`]: checkpoint policy, capacity, write budget (pure decisions);
//! - [`metrics`]: Prometheus text rendering, the textfile and the `/metrics` listener;
//! - [`policy`]: what a config push may change (overlay keys, signatures);
//! - [`probe`]: storage probe and the knobs derived from it;
//! - [`agent`]: the threads, the run loop, maintenance and clean stop;
//! - [`status`]: the `status` report;
//! - [`trial`]: `edgespool test`, one reading per source shown, nothing written;
//! - [`sink`]: the reference consumer (`edgespool sink`).

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
pub mod ingest;
pub mod intake;
pub mod integrity;
pub mod lanes;
pub mod maintenance;
pub mod metrics;
pub mod mqtt;
pub mod notify;
pub mod policy;
pub mod probe;
pub mod process;
pub mod publisher;
pub mod push;
pub mod reading;
pub mod sampler;
pub mod sink;
pub mod source;
pub mod spool;
pub mod status;
pub mod stream;
pub mod threads;
pub mod trial;

/// The model check of [`ack`] and [`spool`] delivery bookkeeping (tests only).
#[cfg(test)]
mod delivery_model;
