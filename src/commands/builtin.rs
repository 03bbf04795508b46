//! Built-in command handlers.
//!
//! Its one rule: **a built-in either answers from the spool connection it is
//! given or asks the agent's main thread through [`Control`]**; none of them
//! touches the sampler, the config file or the MQTT client directly.
//!
//! | name | args | effect |
//! |---|---|---|
//! | `ping` | none | `{"pong":true}` |
//! | `status` | none | spool counts, WAL size, command counts |
//! | `set-interval` | `source`, `interval_ms` (100..=86400000, as a push may set: [`crate::push::policy::OVERLAY_BOUNDS`]) | changes one source's interval (not written to the config file) |
//! | `flush` | none | commits the ingest buffer now |
//! | `checkpoint` | `mode`: `passive` (default) or `truncate` | runs a WAL checkpoint, returns busy/log/checkpointed |
//! | `requeue-failed` | optional `stream` | FAILED rows back to PENDING |
//! | `apply-config` | `config` (TOML text), `sha256` (hex of it), optional `signature` | a push, as the local `[commands.config_push]` allows: an overlay of tuning keys, or a signed whole config; applied live, kept in the state directory once confirmed (see [`crate::push::policy`], [`crate::push`]) |
//! | `reload-config` | none | re-read the config file (as SIGHUP) |
//!
//! All built-ins are safe to re-run after an interruption.

use super::exec_handler::HandlerOutcome;
use crate::intake::{Control, ControlSender};
use crate::spool::{CheckpointMode, Spool};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;

/// The shortest interval a command may set (`sources.*.interval_ms` in
/// [`crate::push::policy::OVERLAY_BOUNDS`]; the local file may go down to 10 ms).
const MIN_PUSHED_INTERVAL_MS: f64 = 100.0;

/// Where a built-in runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// On the command thread, with its spool connection, as soon as it is
    /// received (quick; never behind an exec handler).
    Local,
    /// Through [`Control`], on the agent lane's thread, one at a time (may
    /// wait on the main thread; never behind an exec handler).
    Agent,
}

/// The kind of built-in `name` is, if it is one.
pub fn kind(name: &str) -> Option<Kind> {
    match name {
        "ping" | "status" | "checkpoint" | "requeue-failed" => Some(Kind::Local),
        "set-interval" | "flush" | "apply-config" | "reload-config" => Some(Kind::Agent),
        _ => None,
    }
}

fn no_args(args: &Map<String, Value>) -> Result<(), String> {
    match args.keys().next() {
        Some(k) => Err(format!("args.{k}: this command takes no arguments")),
        None => Ok(()),
    }
}

fn only(args: &Map<String, Value>, allowed: &[&str]) -> Result<(), String> {
    for k in args.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!(
                "args.{k}: unknown argument (known: {})",
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

/// Run a [`Kind::Local`] built-in on `spool`.
pub fn run_local(name: &str, args: &Map<String, Value>, spool: &mut Spool) -> HandlerOutcome {
    let res: Result<Value, String> = (|| match name {
        "ping" => {
            no_args(args)?;
            Ok(json!({"pong": true, "ts_ms": crate::event::envelope::wall_clock_ms().0}))
        }
        "status" => {
            no_args(args)?;
            let now = crate::event::envelope::wall_clock_ms().0;
            let stats = spool.stats(now).map_err(|e| e.to_string())?;
            let cmds = spool.command_stats().map_err(|e| e.to_string())?;
            Ok(json!({"spool": stats, "commands": cmds}))
        }
        "checkpoint" => {
            only(args, &["mode"])?;
            let mode = match args.get("mode").map(|v| v.as_str()) {
                None | Some(Some("passive")) => CheckpointMode::Passive,
                Some(Some("truncate")) => CheckpointMode::Truncate,
                Some(other) => {
                    return Err(format!(
                        "args.mode: must be \"passive\" or \"truncate\" (got {})",
                        other
                            .map(str::to_owned)
                            .unwrap_or_else(|| args["mode"].to_string())
                    ))
                }
            };
            let r = spool.checkpoint(mode).map_err(|e| e.to_string())?;
            Ok(
                json!({"mode": format!("{mode:?}").to_lowercase(), "busy": r.busy,
                      "log_frames": r.log_frames, "checkpointed_frames": r.checkpointed_frames}),
            )
        }
        "requeue-failed" => {
            only(args, &["stream"])?;
            let stream = match args.get("stream") {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(v) => return Err(format!("args.stream: must be a string (got {v})")),
            };
            let n = spool
                .requeue_failed(stream.as_deref())
                .map_err(|e| e.to_string())?;
            Ok(json!({"requeued": n}))
        }
        other => Err(format!("{other:?} is not a local built-in")),
    })();
    match res {
        Ok(v) => HandlerOutcome::Completed(v),
        Err(e) => HandlerOutcome::Rejected(e),
    }
}

/// Run a [`Kind::Agent`] built-in by asking the main thread; waits at most 30 s.
pub fn run_agent(name: &str, args: &Map<String, Value>, ctl: &ControlSender) -> HandlerOutcome {
    let (tx, rx) = std::sync::mpsc::channel();
    let msg: Result<Control, String> = (|| match name {
        "set-interval" => {
            only(args, &["source", "interval_ms"])?;
            let source = args
                .get("source")
                .and_then(Value::as_str)
                .ok_or("args.source: required, a source name")?
                .to_owned();
            let ms = args
                .get("interval_ms")
                .and_then(|v| v.as_f64())
                .filter(|f| f.fract() == 0.0 && (MIN_PUSHED_INTERVAL_MS..=86_400_000.0).contains(f))
                .ok_or("args.interval_ms: required, an integer 100..=86400000 (a command may not make a source sample faster than every 100 ms; the local config may)")?;
            Ok(Control::SetInterval {
                source,
                interval: Duration::from_millis(ms as u64),
                reply: tx,
            })
        }
        "flush" => {
            no_args(args)?;
            Ok(Control::Flush { reply: tx })
        }
        "reload-config" => {
            no_args(args)?;
            Ok(Control::Reload { reply: tx })
        }
        "apply-config" => {
            only(args, &["config", "sha256", "signature"])?;
            let text = args.get("config").and_then(Value::as_str).ok_or(
                "args.config: required, the TOML text (an overlay, or a whole signed config)",
            )?;
            let signature = match args.get("signature") {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err("args.signature: must be a hex string".into()),
            };
            let want = args
                .get("sha256")
                .and_then(Value::as_str)
                .ok_or("args.sha256: required, hex sha256 of args.config")?;
            let got = crate::event::hex::encode(&Sha256::digest(text.as_bytes()));
            if !want.eq_ignore_ascii_case(&got) {
                return Err(format!(
                    "args.sha256: does not match the config text (computed {got})"
                ));
            }
            Ok(Control::ApplyConfig {
                text: text.to_owned(),
                signature,
                reply: tx,
            })
        }
        other => Err(format!("{other:?} is not an agent built-in")),
    })();
    let msg = match msg {
        Ok(m) => m,
        Err(e) => return HandlerOutcome::Rejected(e),
    };
    if ctl.send(msg).is_err() {
        return HandlerOutcome::Failed(json!({"error": "agent is stopping"}));
    }
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(v)) => HandlerOutcome::Completed(v),
        Ok(Err(e)) => HandlerOutcome::Rejected(e),
        Err(_) => HandlerOutcome::Failed(json!({"error": "no answer from the agent within 30 s"})),
    }
}
