//! Slow flash: checkpoint and retention policy, the capacity checks, the
//! write budget's commit window, the outage budget, the storage probe that
//! measures the device these decisions are tuned to, and the upkeep that
//! applies them to the spool and owns what they decided.
//!
//! Its one rule: **space never buys the deletion of an unacknowledged
//! row**; what the policy decides is derived from what was measured on the
//! spool's own device (docs/invariants.md, "Slow flash").

pub mod maintenance;
pub mod outage;
pub mod probe;
pub mod upkeep;
pub mod write_budget;
