//! Commands the last run left unfinished, taken up at start (field case
//! F14).
//!
//! Its one rule: **a command cut off while `running` is re-run only if its
//! handler is retry-safe; otherwise it is reported `interrupted`, never
//! silently run a second time (I4)**. One still `received` never began and
//! is queued again, its deadline judged as at receipt.

use super::admission::Tier;
use super::lanes::{self, Pending};
use super::quiet::ErrorLog;
use super::results::{Finished, Results};
use super::signed::Signer;
use super::store::{cstate, Unfinished};
use super::ExecHandler;
use crate::event::envelope::{wall_clock_ms, EventIdGen, CLOCK_FLOOR_MS};
use crate::spool::Spool;
use serde_json::Value;

/// The error of a command reported interrupted.
const INTERRUPTED: &str = "interrupted: the agent stopped while the command ran; \
                           not re-run because the handler is not declared retry_safe";

/// What becomes of one unfinished command.
enum Step {
    /// `received`: queued again.
    Queue(Pending),
    /// `running`, retry-safe: set back to `received` in the spool, then queued.
    Rerun(Pending),
    /// `running`, not retry-safe: ended `interrupted`, not run.
    Interrupted(Finished),
}

/// Read the unfinished commands of the last run, end the interrupted ones
/// (through `results`) and set the retry-safe ones back to `received`, in
/// the order they were received. Returns the commands to queue, in order.
/// A spool error is logged; the commands it concerns are left as they are
/// (the next start sees them again).
pub(super) fn recover(
    spool: &mut Spool,
    ids: &mut EventIdGen,
    results: &mut Results,
    errors: &mut ErrorLog,
    handlers: &[ExecHandler],
) -> Vec<Pending> {
    let list = match spool.unfinished_commands() {
        Ok(l) => l,
        Err(e) => {
            errors.log("reading unfinished commands", &e);
            return Vec::new();
        }
    };
    let trusted = wall_clock_ms().1;
    let mut queue = Vec::new();
    for u in list {
        let safe = lanes::retry_safe(&u.name, handlers);
        match step(u, safe, trusted) {
            Step::Queue(p) => queue.push(p),
            Step::Rerun(p) => {
                log::warn!("command {}/{} was running when the agent stopped; re-running (handler is retry-safe)", p.scope, p.command_id);
                if let Err(e) = spool.requeue_command(&p.scope, &p.command_id) {
                    errors.log("requeue interrupted command", &e);
                    continue;
                }
                queue.push(p);
            }
            Step::Interrupted(f) => {
                log::warn!("command {}/{} was running when the agent stopped; reported interrupted, not re-run", f.scope, f.command_id);
                results.finish(spool, ids, errors, f);
            }
        }
    }
    queue
}

/// What becomes of `u`, its handler `retry_safe` or not, the wall clock
/// `trusted` or not. Pure.
fn step(u: Unfinished, retry_safe: bool, trusted: bool) -> Step {
    if u.state == cstate::RUNNING && !retry_safe {
        let mut f = Finished::not_run(
            u.scope,
            u.command_id,
            u.name,
            cstate::INTERRUPTED,
            INTERRUPTED,
        );
        f.retry_safe = Some(false);
        return Step::Interrupted(f);
    }
    let rerun = u.state == cstate::RUNNING;
    let request: Value = serde_json::from_str(&u.request).unwrap_or(Value::Null);
    let args = request
        .get("args")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    // Judged as at receipt: the stored deadline, else the TTL from the
    // receipt time if that was read on a trusted clock.
    let deadline_wall = u.deadline_ms.or_else(|| {
        u.ttl_ms
            .filter(|_| trusted && u.received_ms >= CLOCK_FLOOR_MS)
            .map(|t| u.received_ms + t)
    });
    // Whether it was signed is not recorded: in its lane's queue it waits
    // behind the operator's new commands.
    let tier = Tier::of(&u.name, Signer::Unsigned);
    let p = Pending {
        scope: u.scope,
        command_id: u.command_id,
        name: u.name,
        args,
        deadline_wall,
        // Not stored: on an untrusted clock its age is unknown anyway.
        deadline_issued: None,
        deadline_mono: None,
        age_unknown: u.ttl_ms.is_some() && deadline_wall.is_none(),
        tier,
    };
    if rerun {
        Step::Rerun(p)
    } else {
        Step::Queue(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unfinished(state: &str, ttl_ms: Option<i64>, received_ms: i64) -> Unfinished {
        Unfinished {
            scope: "ops".into(),
            command_id: "c-1".into(),
            name: "restart-thing".into(),
            request: r#"{"args":{"n":1},"name":"restart-thing"}"#.into(),
            state: state.into(),
            received_ms,
            deadline_ms: None,
            ttl_ms,
        }
    }

    #[test]
    fn a_command_cut_off_while_running_is_reported_interrupted_unless_retry_safe() {
        let Step::Interrupted(f) = step(unfinished(cstate::RUNNING, None, 0), false, true) else {
            panic!("not retry-safe: interrupted");
        };
        assert_eq!(f.state, cstate::INTERRUPTED);
        assert_eq!(f.retry_safe, Some(false));
        assert_eq!(f.duration_ms, None);
        assert!(f.result.contains("interrupted"), "{}", f.result);
        let Step::Rerun(p) = step(unfinished(cstate::RUNNING, None, 0), true, true) else {
            panic!("retry-safe: re-run");
        };
        assert_eq!(p.args.get("n"), Some(&Value::from(1)));
    }

    #[test]
    fn a_received_command_is_queued_with_its_deadline_judged_as_at_receipt() {
        let at = CLOCK_FLOOR_MS + 1000;
        let Step::Queue(p) = step(unfinished(cstate::RECEIVED, Some(500), at), false, true) else {
            panic!("received: queued");
        };
        assert_eq!(p.deadline_wall, Some(at + 500));
        assert!(!p.age_unknown);
        let Step::Queue(p) = step(unfinished(cstate::RECEIVED, Some(500), 1000), false, true)
        else {
            panic!("received: queued");
        };
        assert_eq!(p.deadline_wall, None, "received on an untrusted clock");
        assert!(p.age_unknown);
        let Step::Queue(p) = step(unfinished(cstate::RECEIVED, None, 1000), false, false) else {
            panic!("received: queued");
        };
        assert!(!p.age_unknown, "no ttl: no age to judge");
    }
}
