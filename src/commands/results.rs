//! Ending a command: its state and result committed with its record and
//! appended to the spool as a result event ([`super::store::finish`]), and
//! the delivery thread told there are new rows.
//!
//! Its one rule: **a result the spool refuses (disk full, busy) is kept in
//! memory and committed again later, never dropped**: until it commits, the
//! record stays unfinished, so a duplicate is answered `in_progress` (not
//! run again) and a crash meanwhile is seen at the next start like any
//! other.

use super::exec_handler::HandlerOutcome;
use super::quiet::ErrorLog;
use super::store::{self, cstate, EventCtx, Reply, ResultEvent};
use crate::event::envelope::{EventIdGen, Format};
use crate::mqtt::DeliveryMsg;
use crate::spool::Spool;
use serde_json::json;
use std::sync::mpsc::Sender;
use std::time::Duration;

/// A finished command's result, to be committed.
pub(super) struct Finished {
    pub(super) scope: String,
    pub(super) command_id: String,
    pub(super) name: String,
    /// One of [`cstate`]'s final states.
    pub(super) state: &'static str,
    /// Result or error, JSON text.
    pub(super) result: String,
    /// How long the handler ran, ms (`None`: it did not run).
    pub(super) duration_ms: Option<i64>,
    /// Whether the handler may be re-run after an interruption, when known.
    pub(super) retry_safe: Option<bool>,
}

impl Finished {
    /// The result of a handler that ran for `duration`.
    pub(super) fn ran(
        scope: String,
        command_id: String,
        name: String,
        outcome: HandlerOutcome,
        duration: Duration,
        retry_safe: bool,
    ) -> Finished {
        let (state, result) = settle(outcome);
        Finished {
            scope,
            command_id,
            name,
            state,
            result,
            duration_ms: Some(duration.as_millis() as i64),
            retry_safe: Some(retry_safe),
        }
    }

    /// A command ended in `state` without running: `why` is its error.
    pub(super) fn not_run(
        scope: String,
        command_id: String,
        name: String,
        state: &'static str,
        why: &str,
    ) -> Finished {
        Finished {
            scope,
            command_id,
            name,
            state,
            result: json!({"error": why}).to_string(),
            duration_ms: None,
            retry_safe: None,
        }
    }
}

/// The final state and the result (JSON text) of a handler's `outcome`.
pub(super) fn settle(outcome: HandlerOutcome) -> (&'static str, String) {
    match outcome {
        HandlerOutcome::Completed(v) => (cstate::COMPLETED, v.to_string()),
        HandlerOutcome::Failed(v) => (cstate::FAILED, v.to_string()),
        HandlerOutcome::Rejected(e) => (cstate::REJECTED, json!({"error": e}).to_string()),
    }
}

/// Results on their way into the spool.
pub(super) struct Results {
    device_id: String,
    format: Format,
    to_delivery: Sender<DeliveryMsg>,
    /// Finished commands whose result could not be committed yet.
    unsaved: Vec<Finished>,
}

impl Results {
    /// Results appended as events of `device_id` in `format`; the delivery
    /// thread is woken through `to_delivery`.
    pub(super) fn new(device_id: String, format: Format, to_delivery: Sender<DeliveryMsg>) -> Self {
        Results {
            device_id,
            format,
            to_delivery,
            unsaved: Vec::new(),
        }
    }

    /// Whether some result waits to be committed again.
    pub(super) fn any_unsaved(&self) -> bool {
        !self.unsaved.is_empty()
    }

    /// Commit `f`, or keep it for [`Results::retry`] if the spool refuses.
    pub(super) fn finish(
        &mut self,
        spool: &mut Spool,
        ids: &mut EventIdGen,
        errors: &mut ErrorLog,
        f: Finished,
    ) {
        let ev = ResultEvent {
            scope: &f.scope,
            command_id: Some(&f.command_id),
            name: Some(&f.name),
            state: f.state,
            result: &f.result,
            duration_ms: f.duration_ms,
            reply: Reply::Result,
            retry_safe: f.retry_safe,
        };
        let mut ctx = EventCtx {
            ids,
            device_id: &self.device_id,
            format: self.format,
        };
        match store::finish(spool, &ev, &mut ctx) {
            Ok(_) => {
                log::info!(
                    "command {}/{} ({}) {}",
                    f.scope,
                    f.command_id,
                    f.name,
                    f.state
                );
                let _ = self.to_delivery.send(DeliveryMsg::NewRows);
            }
            Err(e) => {
                errors.log("storing a command result (kept in memory, retried)", &e);
                self.unsaved.push(f);
            }
        }
    }

    /// Try every kept result again, in the order they finished.
    pub(super) fn retry(&mut self, spool: &mut Spool, ids: &mut EventIdGen, errors: &mut ErrorLog) {
        for f in std::mem::take(&mut self.unsaved) {
            self.finish(spool, ids, errors, f);
        }
    }
}
