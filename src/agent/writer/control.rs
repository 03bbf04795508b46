//! Config control: reload, pushes (checked, applied live, confirmed or
//! reverted) and the other control requests of the command thread, which
//! it sends straight into the writer's channel.
//!
//! Its one rule: **a push never writes the board's local config file and
//! never widens what it allows** ([`crate::push::policy`]); what is kept for the
//! next start is the last push a connection confirmed ([`crate::push`]).

use super::super::startup::{apply_tuning, spool_dir, upkeep_settings};
use super::super::ConfigSource;
use super::Writer;
use crate::config::Config;
use crate::event::stream::Durability;
use crate::intake::Control;
use crate::source::sampler::SamplerUpdate;
use std::time::Instant;

/// The config in force and where it came from ([`self`]). Its `[spool]`
/// section's live keys (the commit window, retention, checkpoints,
/// capacity, the write budget) are held by the upkeep
/// ([`crate::flash::upkeep::Upkeep::settings`]), which a reload
/// reconfigures; here they stay as at start, and nothing reads them.
pub(super) struct Conf {
    pub(super) cfg: Config,
    pub(super) source: ConfigSource,
    /// The confirmed config push in force (kept in the state directory).
    push: Option<crate::push::Stored>,
    /// A push applied live, waiting for a connection to confirm it.
    pub(super) pending_push: Option<crate::push::Pending>,
    /// sha256 of the local config file (and the confirmed push on top), for
    /// the retained status message.
    pub(super) config_sha: String,
    /// What the storage probe derived, re-applied over every reloaded config.
    tuning: Option<crate::flash::probe::Derived>,
}

impl Conf {
    pub(super) fn new(
        cfg: Config,
        source: ConfigSource,
        push: Option<crate::push::Stored>,
        tuning: Option<crate::flash::probe::Derived>,
    ) -> Conf {
        let config_sha = config_identity(&source.path, push.as_ref());
        Conf {
            cfg,
            source,
            push,
            pending_push: None,
            config_sha,
            tuning,
        }
    }

    /// sha256 of the local config file's bytes, followed by the confirmed
    /// push's text when there is one.
    fn identity(&self) -> String {
        config_identity(&self.source.path, self.push.as_ref())
    }
}

impl Writer {
    /// Answer one control request of the command thread.
    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::SetInterval {
                source,
                interval,
                reply,
            } => {
                let _ = reply.send(self.set_interval(source, interval));
            }
            Control::Flush { reply } => {
                let _ = reply.send(self.flush());
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

    /// `set-interval`: one source's sampling interval, live (not kept for
    /// the next start).
    fn set_interval(
        &mut self,
        source: String,
        interval: std::time::Duration,
    ) -> Result<serde_json::Value, String> {
        match self.conf.cfg.sources.iter_mut().find(|s| s.name == source) {
            Some(s) if matches!(s.kind, crate::source::SourceKind::Mqtt(_)) => Err(format!(
                "args.source: {source:?} is an mqtt source: its readings arrive as local programs publish, it has no interval"
            )),
            Some(s) => {
                let prev = s.interval;
                s.interval = interval;
                let _ = self
                    .peers
                    .sampler
                    .send(SamplerUpdate::Interval(source.clone(), interval));
                Ok(
                    serde_json::json!({"source": source, "interval_ms": interval.as_millis() as u64,
                    "previous_interval_ms": prev.as_millis() as u64, "persisted": false}),
                )
            }
            None => {
                let known: Vec<&str> = self.conf.cfg.sources.iter().map(|s| s.name.as_str()).collect();
                Err(format!(
                    "args.source: no source {source:?} (known: {})",
                    known.join(", ")
                ))
            }
        }
    }

    /// `flush`: commit the batched buffer now, whatever the window and the
    /// retry's backoff.
    fn flush(&mut self) -> Result<serde_json::Value, String> {
        let n = self.buffer.len(Durability::Batched);
        self.store.retry_now();
        self.commit(Durability::Batched);
        if self.buffer.is_empty(Durability::Batched) {
            Ok(serde_json::json!({"committed": n}))
        } else {
            Err(format!(
                "{} readings could not be committed now (spool busy or full)",
                self.buffer.len(Durability::Batched)
            ))
        }
    }

    /// Re-read the local config file (with the confirmed push on top); on
    /// any problem the running config stays.
    pub(super) fn reload(&mut self) -> Result<serde_json::Value, String> {
        let (local, text) = self.load_local()?;
        crate::config::file::save_last_good(&self.conf.source.path, text.as_bytes());
        let path = self.conf.source.path.display().to_string();
        let new = match self.conf.push.clone() {
            None => local,
            Some(stored) => {
                match crate::push::policy::check(&local, &stored.text, stored.signature.as_deref())
                    .and_then(|p| {
                        crate::push::compose(&local, &text, &path, &self.conf.source.sets, &p)
                    }) {
                    Ok(c) => c,
                    Err(e) => {
                        log::warn!("the confirmed config push no longer applies ({e}); running the local config alone");
                        self.conf.push = None;
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
        let path = &self.conf.source.path;
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "cannot read the local config {}: {e}; keeping the running config",
                path.display()
            )
        })?;
        let cfg = crate::config::parse(&text, &path.display().to_string(), &self.conf.source.sets)
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
        if self.conf.pending_push.is_some() {
            return Err(
                "another config push is waiting for its connection to be confirmed; try again after it"
                    .to_owned(),
            );
        }
        let (local, local_text) = self.load_local()?;
        let push = crate::push::policy::check(&local, text, signature.as_deref())?;
        let serial = self.admit_push(&local, &push)?;
        let origin = self.conf.source.path.display().to_string();
        let sets = &self.conf.source.sets;
        let (new, ignored) = crate::push::compose_noting(&local, &local_text, &origin, sets, &push)
            .map_err(|e| format!("{e}; keeping the running config"))?;
        let ignored = ignored_local_only(&ignored);
        if let Some(serial) = serial {
            // Recorded before it applies: this serial is spent even if the
            // push is reverted, so it can never be replayed.
            self.store
                .conn(Durability::Batched)
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
        if !crate::push::policy::touches_connection(&self.conf.cfg, &new) {
            // Kept first: a push that cannot be kept is not applied either.
            let dir = spool_dir(&self.conf.cfg);
            crate::push::save(&dir, Some(&stored)).map_err(|e| {
                format!(
                    "cannot write the config push in {}: {e}; keeping the running config",
                    dir.display()
                )
            })?;
            self.keep_serial(&stored);
            self.conf.push = Some(stored);
            let mut v = self.apply_live(new);
            v["sha256"] = sha.into();
            v["ignored"] = ignored;
            v["confirmation"] = "kept (the MQTT connection is unchanged)".into();
            return Ok(v);
        }
        let confirm = local.config_push.confirm;
        self.conf.pending_push = Some(crate::push::Pending::new(
            stored,
            self.conf.push.clone(),
            self.peers.link.connection_counts(),
            confirm,
        ));
        let mut v = self.apply_live(new);
        v["sha256"] = sha.into();
        v["ignored"] = ignored;
        v["confirmation"] = format!(
            "waiting up to {} s for a CONNACK{}; otherwise the previous config returns",
            confirm.as_secs(),
            if self.conf.cfg.commands.enabled {
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
        let Some(p) = &self.conf.pending_push else {
            return;
        };
        let verdict = p.judge(
            self.peers.link.connection_counts(),
            self.conf.cfg.commands.enabled,
            Instant::now(),
        );
        let reason = match verdict {
            crate::push::Verdict::Waiting => return,
            crate::push::Verdict::Confirmed => {
                let dir = spool_dir(&self.conf.cfg);
                match crate::push::save(&dir, Some(&p.push)) {
                    Ok(()) => {
                        log::info!(
                            "config push confirmed by a new connection; kept in {}",
                            dir.display()
                        );
                        let kept = self.conf.pending_push.take().map(|p| p.push);
                        if let Some(k) = &kept {
                            self.keep_serial(k);
                        }
                        self.conf.push = kept;
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
        let Some(p) = self.conf.pending_push.take() else {
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
                let pushed = crate::config::parse(text, "signed push", &self.conf.source.sets)
                    .map_err(|e| format!("config invalid: {e}; keeping the running config"))?;
                let highest = self
                    .store
                    .spool()
                    .state(crate::push::policy::SERIAL_STATE_KEY)
                    .map_err(|e| format!("cannot read the last signed serial: {e}"))?
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
                    .max(stored_signed_serial(local).unwrap_or(0));
                crate::push::policy::check_signed(local, &pushed, highest).map(Some)
            }
            crate::push::policy::Push::Overlay(_) => match &self.conf.push {
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
        let serial = crate::config::parse(&kept.text, "signed push", &self.conf.source.sets)
            .ok()
            .and_then(|c| c.signed_serial);
        if let Some(serial) = serial {
            let now = crate::event::envelope::wall_clock_ms().0;
            if let Err(e) = self.store.conn(Durability::Batched).set_state(
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
                let origin = self.conf.source.path.display().to_string();
                crate::push::policy::check(&local, &s.text, s.signature.as_deref()).and_then(|p| {
                    crate::push::compose(&local, &text, &origin, &self.conf.source.sets, &p)
                })
            }
        });
        match back {
            Ok(cfg) => {
                self.conf.push = previous;
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
    fn apply_live(&mut self, new: Config) -> serde_json::Value {
        let v = self.apply_live_inner(new);
        self.conf.config_sha = self.conf.identity();
        v
    }

    fn apply_live_inner(&mut self, new: Config) -> serde_json::Value {
        let mut new = new;
        if let (true, Some(d)) = (new.spool.tune_from_probe, self.conf.tuning) {
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
            self.conf.cfg.stream_priorities(),
            self.conf.cfg.live_first_streams(),
            self.conf.cfg.mqtt.min_share_pct,
            self.conf.cfg.stream_batching(),
        ) {
            restart.push("delivery (priority, live_first, batching, mqtt.min_share_pct)");
        }
        if new.sources != self.conf.cfg.sources {
            let _ = self
                .peers
                .sampler
                .send(SamplerUpdate::Sources(new.sources.clone()));
            self.conf.cfg.sources = new.sources.clone();
            applied.push("sources");
        }
        self.apply_spool(&new, &mut applied, &mut restart);
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

    /// `[spool]`: the commit window, retention, checkpoints, capacity and
    /// the write budget apply live (the upkeep holds them); the path and
    /// pragmas at the next start.
    fn apply_spool(
        &mut self,
        new: &Config,
        applied: &mut Vec<&'static str>,
        restart: &mut Vec<&'static str>,
    ) {
        let conn = self.store.conn(Durability::Batched);
        applied.extend(self.upkeep.reconfigure(upkeep_settings(new), conn));
        let (ns, cs) = (&new.spool, &self.conf.cfg.spool);
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
        let cur = &mut self.conf.cfg;
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
    /// shapes publishes (topic prefix, window, sizes, format) and what
    /// retires rows (`retire_on`, the receipt settings and keys: the
    /// delivery thread holds them from its start) at the next start.
    fn apply_mqtt(
        &mut self,
        new: &Config,
        applied: &mut Vec<&'static str>,
        restart: &mut Vec<&'static str>,
    ) {
        let (nm, cm) = (&new.mqtt, &self.conf.cfg.mqtt);
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
        if (
            nm.retire_on,
            nm.receipt_timeout,
            nm.receipt_window,
            &nm.receipt_public_keys,
        ) != (
            cm.retire_on,
            cm.receipt_timeout,
            cm.receipt_window,
            &cm.receipt_public_keys,
        ) {
            restart.push("mqtt.retire_on/receipt_timeout_secs/receipt_window/receipt_public_keys");
        }
        let mut live = nm.clone();
        live.topic_prefix = cm.topic_prefix.clone();
        live.inflight_window = cm.inflight_window;
        live.max_payload_bytes = cm.max_payload_bytes;
        live.max_packet_bytes = cm.max_packet_bytes;
        live.payload_format = cm.payload_format;
        live.retire_on = cm.retire_on;
        live.receipt_timeout = cm.receipt_timeout;
        live.receipt_window = cm.receipt_window;
        live.receipt_public_keys = cm.receipt_public_keys.clone();
        if live != *cm {
            self.peers.link.reconfigure(live.clone());
            self.conf.cfg.mqtt = live;
            applied.push("mqtt (reconnecting once)");
        }
    }
}

/// sha256 of the local config file at `path`, then `push`'s text.
pub(in crate::agent) fn config_identity(
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

/// The keys of [`crate::push::policy::LOCAL_ONLY`] a signed push set and
/// that were ignored, with why, as the answer names them (`{}` for none),
/// logged at WARN: a push that silently left a key at the local value
/// reads as applied when it was not.
fn ignored_local_only(keys: &[&str]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for k in keys {
        let why = crate::push::policy::local_only_why(k);
        out.insert(
            (*k).to_owned(),
            format!("local only: {why}; the local value is kept").into(),
        );
    }
    if !keys.is_empty() {
        log::warn!(
            "config push: the signed config sets {} local-only keys to other values than the \
             board's own file; ignored, the local values kept: {}",
            keys.len(),
            keys.iter()
                .map(|k| format!("{k} ({})", crate::push::policy::local_only_why(k)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    serde_json::Value::Object(out)
}
