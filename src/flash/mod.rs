//! Slow flash: checkpoint and retention policy, the capacity checks, the
//! write budget's commit window, the outage budget, and the storage probe
//! that measures the device these decisions are tuned to.
//!
//! Its one rule: **space never buys the deletion of an unacknowledged
//! row**; what the policy decides is derived from what was measured on the
//! spool's own device (DESIGN.md, "Slow flash").

pub mod maintenance;
pub mod outage;
pub mod probe;
pub mod write_budget;
