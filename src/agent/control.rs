//! Config control: reload, pushes (checked, applied live, confirmed or
//! reverted) and the other control requests of the command thread.
//!
//! Its one rule: **a push never writes the board's local config file and
//! never widens what it allows** ([`crate::push::policy`]); what is kept for the
//! next start is the last push a connection confirmed ([`crate::push`]).

use super::{apply_tuning, spool_dir, Ingest, SamplerUpdate};
use crate::config::Config;
use crate::intake::Control;
use std::time::Instant;

impl Ingest {
    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::SetInterval {
                source,
                interval,
                reply,
            } => {
                let r = match self.cfg.sources.iter_mut().find(|s| s.name == source) {
                    Some(s) if matches!(s.kind, crate::source::SourceKind::Mqtt(_)) => Err(format!(
                        "args.source: {source:?} is an mqtt source: its readings arrive as local programs publish, it has no interval"
                    )),
                    Some(s) => {
                        let prev = s.interval;
                        s.interval = interval;
                        let _ = self
                            .sampler
                            .send(SamplerUpdate::Interval(source.clone(), interval));
                        Ok(
                            serde_json::json!({"source": source, "interval_ms": interval.as_millis() as u64,
                            "previous_interval_ms": prev.as_millis() as u64, "persisted": false}),
                        )
                    }
                    None => {
                        let known: Vec<&str> =
                            self.cfg.sources.iter().map(|s| s.name.as_str()).collect();
                        Err(format!(
                            "args.source: no source {source:?} (known: {})",
                            known.join(", ")
                        ))
                    }
                };
                let _ = reply.send(r);
            }
            Control::Flush { reply } => {
                let n = self.buffer.len();
                self.retry_at = None;
                self.commit();
                let r = if self.buffer.is_empty() {
                    Ok(serde_json::json!({"committed": n}))
                } else {
                    Err(format!(
                        "{} readings could not be committed now (spool busy or full)",
                        self.buffer.len()
                    ))
                };
                let _ = reply.send(r);
            }
            Control::Reload { reply } => {
                let _ = reply.send(self.reload());
            }
            Control::ApplyConfig {
                text,
                signature,
                reply,
            } => {
                let _ = reply.send(self.apply_push(&text, signature));
            }
        }
    }

    /// Re-read the local config file (with the confirmed push on top); on
    /// any problem the running config stays.
    pub(super) fn reload(&mut self) -> Result<serde_json::Value, String> {
        let (local, text) = self.load_local()?;
        crate::config::file::save_last_good(&self.source.path, text.as_bytes());
        let path = self.source.path.display().to_string();
        let new = match self.push.clone() {
            None => local,
            Some(stored) => {
                match crate::push::policy::check(&local, &stored.text, stored.signature.as_deref())
                    .and_then(|p| crate::push::compose(&local, &text, &path, &self.source.sets, &p))
                {
                    Ok(c) => c,
                    Err(e) => {
                        log::warn!("the confirmed config push no longer applies ({e}); running the local config alone");
                        self.push = None;
                        local
                    }
                }
            }
        };
        Ok(self.apply_live(new))
    }

    /// The board's local config file, validated with the command-line
    /// overrides, and its text.
    fn load_local(&self) -> Result<(Config, String), String> {
        let path = &self.source.path;
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "cannot read the local config {}: {e}; keeping the running config",
                path.display()
            )
        })?;
        let cfg = crate::config::parse(&text, &path.display().to_string(), &self.source.sets)
            .map_err(|e| format!("local config invalid: {e}; keeping the running config"))?;
        Ok((cfg, text))
    }

    /// A config push (`apply-config`): checked against the local file's
    /// `[commands.config_push]` ([`crate::push::policy`]), composed on the local
    /// config, applied live. A push that leaves the MQTT connection alone is
    /// kept at once; one that changes it is kept only once a CONNACK (and the
    /// command SUBACK) proves it, else the previous config comes back
    /// ([`crate::push`]). The local file is never written.
    fn apply_push(
        &mut self,
        text: &str,
        signature: Option<String>,
    ) -> Result<serde_json::Value, String> {
        if self.pending_push.is_some() {
            return Err(
                "another config push is waiting for its connection to be confirmed; try again after it"
                    .to_owned(),
            );
        }
        let (local, local_text) = self.load_local()?;
        let push = crate::push::policy::check(&local, text, signature.as_deref())?;
        let serial = self.admit_push(&local, &push)?;
        let origin = self.source.path.display().to_string();
        let new = crate::push::compose(&local, &local_text, &origin, &self.source.sets, &push)
            .map_err(|e| format!("{e}; keeping the running config"))?;
        if let Some(serial) = serial {
            // Recorded before it applies: this serial is spent even if the
            // push is reverted, so it can never be replayed.
            self.spool
                .set_state(
                    crate::push::policy::SERIAL_STATE_KEY,
                    &serial.to_string(),
                    crate::event::envelope::wall_clock_ms().0,
                )
                .map_err(|e| {
                    format!(
                        "cannot record the signed config's serial: {e}; keeping the running config"
                    )
                })?;
        }
        let stored = crate::push::Stored {
            text: text.to_owned(),
            signature,
        };
        let sha = crate::config::file::sha256_hex(text.as_bytes());
        if !crate::push::policy::touches_connection(&self.cfg, &new) {
            // Kept first: a push that cannot be kept is not applied either.
            let dir = spool_dir(&self.cfg);
            crate::push::save(&dir, Some(&stored)).map_err(|e| {
                format!(
                    "cannot write the config push in {}: {e}; keeping the running config",
                    dir.display()
                )
            })?;
            self.keep_serial(&stored);
            self.push = Some(stored);
            let mut v = self.apply_live(new);
            v["sha256"] = sha.into();
            v["confirmation"] = "kept (the MQTT connection is unchanged)".into();
            return Ok(v);
        }
        let confirm = local.config_push.confirm;
        self.pending_push = Some(crate::push::Pending::new(
            stored,
            self.push.clone(),
            self.link.connection_counts(),
            confirm,
        ));
        let mut v = self.apply_live(new);
        v["sha256"] = sha.into();
        v["confirmation"] = format!(
            "waiting up to {} s for a CONNACK{}; otherwise the previous config returns",
            confirm.as_secs(),
            if self.cfg.commands.enabled {
                " and the command SUBACK"
            } else {
                ""
            }
        )
        .into();
        Ok(v)
    }

    /// Keep a pending push once its connection is proven, or bring the
    /// previous config back once its time is up.
    pub(super) fn judge_pending_push(&mut self) {
        let Some(p) = &self.pending_push else {
            return;
        };
        let verdict = p.judge(
            self.link.connection_counts(),
            self.cfg.commands.enabled,
            Instant::now(),
        );
        let reason = match verdict {
            crate::push::Verdict::Waiting => return,
            crate::push::Verdict::Confirmed => {
                let dir = spool_dir(&self.cfg);
                match crate::push::save(&dir, Some(&p.push)) {
                    Ok(()) => {
                        log::info!(
                            "config push confirmed by a new connection; kept in {}",
                            dir.display()
                        );
                        let kept = self.pending_push.take().map(|p| p.push);
                        if let Some(k) = &kept {
                            self.keep_serial(k);
                        }
                        self.push = kept;
                        self.agent_event(
                            "config_push_confirmed",
                            "a new connection proved the pushed config",
                        );
                        return;
                    }
                    Err(e) => format!(
                        "the pushed config could not be kept in {}: {e}",
                        dir.display()
                    ),
                }
            }
            crate::push::Verdict::Revert => {
                "no CONNACK and command SUBACK within commands.config_push.confirm_secs".to_owned()
            }
        };
        let Some(p) = self.pending_push.take() else {
            return;
        };
        self.revert_push(p.previous, &reason);
    }

    /// Whether this push may apply now: a signed config must be for this
    /// board with a serial above every one accepted before (returned); an
    /// overlay may not replace a signed config in force.
    fn admit_push(
        &self,
        local: &Config,
        push: &crate::push::policy::Push,
    ) -> Result<Option<u64>, String> {
        match push {
            crate::push::policy::Push::Signed(text) => {
                let pushed = crate::config::parse(text, "signed push", &self.source.sets)
                    .map_err(|e| format!("config invalid: {e}; keeping the running config"))?;
                let highest = self
                    .spool
                    .state(crate::push::policy::SERIAL_STATE_KEY)
                    .map_err(|e| format!("cannot read the last signed serial: {e}"))?
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    .max(stored_signed_serial(local).unwrap_or(0));
                crate::push::policy::check_signed(local, &pushed, highest).map(Some)
            }
            crate::push::policy::Push::Overlay(_) => match &self.push {
                Some(s) if s.signature.is_some() => Err(
                    "a signed config is in force on this board: an overlay would discard it; push a signed config instead"
                        .to_owned(),
                ),
                _ => Ok(None),
            },
        }
    }

    /// Record the serial of `kept` (a signed push kept for the next start).
    fn keep_serial(&mut self, kept: &crate::push::Stored) {
        if kept.signature.is_none() {
            return;
        }
        let serial = crate::config::parse(&kept.text, "signed push", &self.source.sets)
            .ok()
            .and_then(|c| c.signed_serial);
        if let Some(serial) = serial {
            let now = crate::event::envelope::wall_clock_ms().0;
            if let Err(e) = self.spool.set_state(
                crate::push::policy::KEPT_SERIAL_STATE_KEY,
                &serial.to_string(),
                now,
            ) {
                log::error!("cannot record the kept signed config's serial ({e}); the next start runs the local config alone");
            }
        }
    }

    fn revert_push(&mut self, previous: Option<crate::push::Stored>, reason: &str) {
        let back = self.load_local().and_then(|(local, text)| match &previous {
            None => Ok(local),
            Some(s) => {
                let origin = self.source.path.display().to_string();
                crate::push::policy::check(&local, &s.text, s.signature.as_deref()).and_then(|p| {
                    crate::push::compose(&local, &text, &origin, &self.source.sets, &p)
                })
            }
        });
        match back {
            Ok(cfg) => {
                self.push = previous;
                self.apply_live(cfg);
                let msg = format!("config push reverted: {reason}; back to the previous config");
                log::error!("{msg}");
                self.agent_event("config_push_reverted", &msg);
            }
            Err(e) => log::error!("config push: {reason}, and the previous config cannot be rebuilt ({e}); keeping the pushed one"),
        }
    }

    /// Apply what can change live; list what needs a restart. Never touches
    /// the spool file (field case F15 d).
    /// sha256 of the local config file's bytes, followed by the confirmed
    /// push's text when there is one.
    pub(super) fn config_identity(&self) -> String {
        config_identity(&self.source.path, self.push.as_ref())
    }

    pub(super) fn apply_live(&mut self, new: Config) -> serde_json::Value {
        let v = self.apply_live_inner(new);
        self.config_sha = self.config_identity();
        v
    }

    fn apply_live_inner(&mut self, new: Config) -> serde_json::Value {
        let mut new = new;
        if let (true, Some(d)) = (new.spool.tune_from_probe, self.tuning) {
            apply_tuning(&mut new, &d);
        }
        let mut applied: Vec<&str> = Vec::new();
        let mut restart: Vec<&str> = Vec::new();
        // The delivery order is set at start (the spool's stream priorities,
        // the delivery thread's lanes).
        if (
            new.stream_priorities(),
            new.live_first_streams(),
            new.mqtt.min_share_pct,
            new.stream_batching(),
        ) != (
            self.cfg.stream_priorities(),
            self.cfg.live_first_streams(),
            self.cfg.mqtt.min_share_pct,
            self.cfg.stream_batching(),
        ) {
            restart.push("delivery (priority, live_first, batching, mqtt.min_share_pct)");
        }
        if new.sources != self.cfg.sources {
            let _ = self
                .sampler
                .send(SamplerUpdate::Sources(new.sources.clone()));
            self.cfg.sources = new.sources.clone();
            applied.push("sources");
        }
        self.apply_spool(&new, &mut applied, &mut restart);
        self.apply_budget(&new, &mut applied);
        self.apply_rest(&new, &mut applied, &mut restart);
        self.apply_mqtt(&new, &mut applied, &mut restart);
        if !restart.is_empty() {
            log::warn!(
                "config: changes to {} take effect at the next restart",
                restart.join(", ")
            );
        }
        log::info!(
            "config applied: {}",
            if applied.is_empty() {
                "no live changes".to_owned()
            } else {
                applied.join(", ")
            }
        );
        serde_json::json!({"applied": applied, "restart_required": restart})
    }

    /// The commit window and the write budget, live: the window starts
    /// again from the configured one when either changes.
    fn apply_budget(&mut self, new: &Config, applied: &mut Vec<&'static str>) {
        let settings = super::budget_settings(new);
        if settings != self.budget.settings() {
            if settings.bytes_per_day != self.budget.settings().bytes_per_day
                || settings.max_window != self.budget.settings().max_window
            {
                applied.push("spool (write budget)");
            }
            self.budget.reconfigure(settings);
            self.window.set(self.budget.window());
        }
        self.cfg.spool.write_budget_bytes_per_day = new.spool.write_budget_bytes_per_day;
        self.cfg.spool.max_commit_window = new.spool.max_commit_window;
    }

    /// `[spool]`: the commit window, retention, checkpoints and capacity
    /// apply live; the path and pragmas at the next start.
    fn apply_spool(
        &mut self,
        new: &Config,
        applied: &mut Vec<&'static str>,
        restart: &mut Vec<&'static str>,
    ) {
        let (ns, cs) = (&new.spool, &mut self.cfg.spool);
        if (
            ns.commit_window,
            ns.acked_retention,
            ns.purge_batch_rows,
            ns.checkpoint_interval,
        ) != (
            cs.commit_window,
            cs.acked_retention,
            cs.purge_batch_rows,
            cs.checkpoint_interval,
        ) {
            cs.commit_window = ns.commit_window;
            cs.acked_retention = ns.acked_retention;
            cs.purge_batch_rows = ns.purge_batch_rows;
            cs.checkpoint_interval = ns.checkpoint_interval;
            applied.push("spool (commit window, retention, checkpoints)");
        }
        if (ns.capacity, ns.checkpoint_wal_bytes) != (cs.capacity, cs.checkpoint_wal_bytes) {
            cs.capacity = ns.capacity;
            cs.checkpoint_wal_bytes = ns.checkpoint_wal_bytes;
            self.upkeep.capacity_checked = None;
            self.spool.wal().set_brake_frames(
                (3 * cs.checkpoint_wal_bytes / 2 / super::WAL_FRAME_BYTES) as i64,
            );
            applied.push("spool (capacity, checkpoint threshold)");
        }
        if ns.path != cs.path
            || ns.options != cs.options
            || ns.allow_network_fs != cs.allow_network_fs
        {
            restart.push("spool.path/pragmas");
        }
    }

    /// `[agent]` and `metrics.textfile` apply live; the metrics listener,
    /// the device id, `[ingest]` and `[commands]` (its config push policy
    /// included) at the next start.
    fn apply_rest(
        &mut self,
        new: &Config,
        applied: &mut Vec<&'static str>,
        restart: &mut Vec<&'static str>,
    ) {
        let cur = &mut self.cfg;
        if new.agent != cur.agent {
            cur.agent = new.agent.clone();
            applied.push("agent");
        }
        if new.metrics.textfile != cur.metrics.textfile {
            cur.metrics.textfile = new.metrics.textfile.clone();
            applied.push("metrics.textfile");
        }
        if (new.metrics.listen, new.metrics.listen_public)
            != (cur.metrics.listen, cur.metrics.listen_public)
        {
            restart.push("metrics.listen");
        }
        if new.device_id != cur.device_id {
            restart.push("device_id");
        }
        if new.ingest != cur.ingest {
            restart.push("ingest");
        }
        if new.commands != cur.commands || new.config_push != cur.config_push {
            restart.push("commands");
        }
    }

    /// `[mqtt]`: the connection settings apply live (one reconnect); what
    /// shapes publishes (topic prefix, window, sizes, format) at the next
    /// start.
    fn apply_mqtt(
        &mut self,
        new: &Config,
        applied: &mut Vec<&'static str>,
        restart: &mut Vec<&'static str>,
    ) {
        let (nm, cm) = (&new.mqtt, &self.cfg.mqtt);
        if (
            &nm.topic_prefix,
            nm.inflight_window,
            nm.max_payload_bytes,
            nm.max_packet_bytes,
            nm.payload_format,
        ) != (
            &cm.topic_prefix,
            cm.inflight_window,
            cm.max_payload_bytes,
            cm.max_packet_bytes,
            cm.payload_format,
        ) {
            restart.push(
                "mqtt.topic_prefix/inflight_window/max_payload_bytes/max_packet_bytes/payload_format",
            );
        }
        let mut live = nm.clone();
        live.topic_prefix = cm.topic_prefix.clone();
        live.inflight_window = cm.inflight_window;
        live.max_payload_bytes = cm.max_payload_bytes;
        live.max_packet_bytes = cm.max_packet_bytes;
        live.payload_format = cm.payload_format;
        if live != *cm {
            self.link.reconfigure(live.clone());
            self.cfg.mqtt = live;
            applied.push("mqtt (reconnecting once)");
        }
    }
}

/// sha256 of the local config file at `path`, then `push`'s text.
pub(super) fn config_identity(
    path: &std::path::Path,
    push: Option<&crate::push::Stored>,
) -> String {
    let mut bytes = std::fs::read(path).unwrap_or_default();
    if let Some(p) = push {
        bytes.extend_from_slice(p.text.as_bytes());
    }
    crate::config::file::sha256_hex(&bytes)
}

/// The serial of the signed config kept in the state directory, if there is
/// one whose signature the local key accepts: a floor for the next push
/// beside the spool's record, so a spool moved aside (damaged, or reset by
/// hand) does not let an older signed config back in.
fn stored_signed_serial(local: &Config) -> Option<u64> {
    let stored = crate::push::load(&spool_dir(local))?;
    let signature = stored.signature.as_deref()?;
    match crate::push::policy::check(local, &stored.text, Some(signature)).ok()? {
        crate::push::policy::Push::Signed(text) => {
            crate::config::parse(&text, "stored push", &[])
                .ok()?
                .signed_serial
        }
        crate::push::policy::Push::Overlay(_) => None,
    }
}
