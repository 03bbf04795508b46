//! What a reading is and how it travels: its fields, its stream, the
//! envelope (event id and wire format) it is published in, batches of
//! several events, the fleet's receipts on the wire, the board's
//! monotonic clock beside its wall clock (clock stamps and anchors), how
//! old a wall-clock stamp is when the clock may not have been set (age),
//! and what a board holds and sends again on request (backfill).
//!
//! Its one rule: **this room imports nothing else of the crate.** The sink
//! and the agent share exactly this vocabulary, so what a board sends and
//! what a fleet reads cannot drift apart.

pub mod age;
pub mod backfill;
pub mod batching;
pub mod clock;
pub mod envelope;
pub mod hex;
pub mod reading;
pub mod receipts;
pub mod signature;
pub mod stream;
