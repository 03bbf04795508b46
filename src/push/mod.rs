//! Config pushes on disk, and confirm-or-revert.
//!
//! Its one rule: **the board's local config file is never written by a push,
//! and the push kept for the next start is the last one that was confirmed**.
//! A push that changes the MQTT connection is confirmed only by a CONNACK
//! (and the command SUBACK, when commands are on) within
//! `commands.config_push.confirm_secs`; otherwise the previous config comes
//! back. A push that leaves the connection alone is confirmed at once.
//!
//! Files, in the state directory (the spool's directory, never `/etc`):
//! `config-push.toml` (the confirmed push: an overlay, or a signed whole
//! config) and `config-push.sig` (its signature, for a signed one). Both are
//! replaced atomically ([`crate::config::file::write_atomic`]) and believed
//! at the next start only when the agent wrote them (owner, mode:
//! [`crate::os::fsguard::files::read_trusted`]); otherwise the push is named in
//! a WARN and the local config runs alone.

pub mod policy;

use crate::config::Config;
use crate::push::policy::Push;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A push as kept on disk: its text and, for a signed whole config, the
/// signature (hex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The overlay or whole config text, as pushed.
    pub text: String,
    /// Hex Ed25519 signature of `text` (signed whole configs only).
    pub signature: Option<String>,
}

fn text_path(dir: &Path) -> PathBuf {
    dir.join("config-push.toml")
}

fn sig_path(dir: &Path) -> PathBuf {
    dir.join("config-push.sig")
}

/// The confirmed push kept in `dir`, if any and if the agent wrote it. A
/// push file there that it did not write (a symlink, another owner, a mode
/// others may write) or that is not UTF-8 is named in a WARN with the
/// reason, and the push is ignored as a whole.
pub fn load(dir: &Path) -> Option<Stored> {
    let read = |p: PathBuf| -> Result<Option<String>, ()> {
        let why = match crate::os::fsguard::files::read_trusted(&p) {
            Ok(None) => return Ok(None),
            Ok(Some(bytes)) => match String::from_utf8(bytes) {
                Ok(t) => return Ok(Some(t)),
                Err(e) => format!("it is not UTF-8 text: {e}"),
            },
            Err(d) => d.to_string(),
        };
        log::warn!(
            "the stored config push {} is ignored: {why}; running the local config alone",
            p.display()
        );
        Err(())
    };
    let text = read(text_path(dir)).ok()??;
    let signature = read(sig_path(dir)).ok()?.map(|s| s.trim().to_owned());
    Some(Stored { text, signature })
}

/// Keep `push` as the confirmed push in `dir` (or remove it for `None`).
///
/// Errors: a file could not be written or removed (the old files stay).
pub fn save(dir: &Path, push: Option<&Stored>) -> std::io::Result<()> {
    let remove = |p: PathBuf| match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    };
    match push {
        None => {
            remove(text_path(dir))?;
            remove(sig_path(dir))
        }
        Some(s) => {
            // Signature first: a cut between the two leaves a pair that does
            // not verify, which the next start ignores, loudly.
            match &s.signature {
                Some(sig) => crate::config::file::write_atomic(&sig_path(dir), sig.as_bytes())?,
                None => remove(sig_path(dir))?,
            }
            crate::config::file::write_atomic(&text_path(dir), s.text.as_bytes())
        }
    }
}

/// The config a push makes of the local config: `local_text` (from
/// `origin`) with `sets` (command-line overrides) and the push on top.
/// A signed whole config keeps the local file's values of every key in
/// [`crate::push::policy::LOCAL_ONLY`]: the key that signs may not change who may
/// push, who the operator is, the board's identity, nor move what the agent
/// writes or binds.
///
/// Errors: the result does not validate (the message names the key).
pub fn compose(
    local: &Config,
    local_text: &str,
    origin: &str,
    sets: &[String],
    push: &Push,
) -> Result<Config, String> {
    compose_noting(local, local_text, origin, sets, push).map(|(cfg, _)| cfg)
}

/// [`compose`], and the keys of [`crate::push::policy::LOCAL_ONLY`] the push
/// set to another value than the local file's, which were ignored (the
/// local values kept), in that list's order: what an answer names.
///
/// Errors: as [`compose`].
pub fn compose_noting(
    local: &Config,
    local_text: &str,
    origin: &str,
    sets: &[String],
    push: &Push,
) -> Result<(Config, Vec<&'static str>), String> {
    let mut cfg = match push {
        Push::Overlay(over) => {
            let all: Vec<String> = sets.iter().chain(over.iter()).cloned().collect();
            crate::config::parse(local_text, origin, &all)
        }
        Push::Signed(text) => crate::config::parse(text, "signed push", sets),
    }
    .map_err(|e| format!("config invalid: {e}"))?;
    let ignored = keep_local_only(&mut cfg, local);
    Ok((cfg, ignored))
}

/// Put the local values of [`crate::push::policy::LOCAL_ONLY`] back into
/// `cfg`; returns the keys whose value that changed.
fn keep_local_only(cfg: &mut Config, local: &Config) -> Vec<&'static str> {
    fn keep<T: PartialEq + Clone>(
        key: &'static str,
        pushed: &mut T,
        local: &T,
        ignored: &mut Vec<&'static str>,
    ) {
        if pushed != local {
            pushed.clone_from(local);
            ignored.push(key);
        }
    }
    let mut ig = Vec::new();
    let (c, l) = (&mut *cfg, local);
    keep(
        "commands.config_push",
        &mut c.config_push,
        &l.config_push,
        &mut ig,
    );
    let (cc, lc) = (&mut c.commands, &l.commands);
    let keys = &lc.operator_public_keys;
    keep(
        "commands.operator_public_keys",
        &mut cc.operator_public_keys,
        keys,
        &mut ig,
    );
    keep(
        "commands.allow_unsigned",
        &mut cc.allow_unsigned,
        &lc.allow_unsigned,
        &mut ig,
    );
    keep("device_id", &mut c.device_id, &l.device_id, &mut ig);
    c.device_id_source.clone_from(&l.device_id_source);
    keep(
        "mqtt.client_id",
        &mut c.mqtt.client_id,
        &l.mqtt.client_id,
        &mut ig,
    );
    keep(
        "mqtt.topic_prefix",
        &mut c.mqtt.topic_prefix,
        &l.mqtt.topic_prefix,
        &mut ig,
    );
    keep(
        "mqtt.retire_on",
        &mut c.mqtt.retire_on,
        &l.mqtt.retire_on,
        &mut ig,
    );
    keep(
        "mqtt.receipt_public_keys",
        &mut c.mqtt.receipt_public_keys,
        &l.mqtt.receipt_public_keys,
        &mut ig,
    );
    keep("spool.path", &mut c.spool.path, &l.spool.path, &mut ig);
    let net_fs = &l.spool.allow_network_fs;
    keep(
        "spool.allow_network_fs",
        &mut c.spool.allow_network_fs,
        net_fs,
        &mut ig,
    );
    let (m, lm) = (&mut c.metrics, &l.metrics);
    keep("metrics.textfile", &mut m.textfile, &lm.textfile, &mut ig);
    keep("metrics.listen", &mut m.listen, &lm.listen, &mut ig);
    keep(
        "metrics.listen_public",
        &mut m.listen_public,
        &lm.listen_public,
        &mut ig,
    );
    let (i, li) = (&mut c.ingest, &l.ingest);
    keep("ingest.socket", &mut i.socket, &li.socket, &mut ig);
    keep(
        "ingest.socket_group",
        &mut i.socket_group,
        &li.socket_group,
        &mut ig,
    );
    keep(
        "ingest.socket_mode",
        &mut i.socket_mode,
        &li.socket_mode,
        &mut ig,
    );
    keep("ingest.tcp", &mut i.tcp, &li.tcp, &mut ig);
    keep(
        "ingest.tcp_public",
        &mut i.tcp_public,
        &li.tcp_public,
        &mut ig,
    );
    ig
}

/// A push applied live and waiting for its connection to be confirmed.
#[derive(Debug)]
pub struct Pending {
    /// The push to keep once confirmed.
    pub push: Stored,
    /// The confirmed push it replaces (`None`: the local file alone).
    pub previous: Option<Stored>,
    /// CONNACKs and command SUBACKs seen when it was applied.
    pub connacks: u64,
    /// See `connacks`.
    pub subacks: u64,
    /// Revert after this.
    pub deadline: Instant,
}

/// What a pending push's connection shows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// CONNACK (and SUBACK when commands are on) since the apply.
    Confirmed,
    /// Still waiting, within the deadline.
    Waiting,
    /// The deadline passed without them.
    Revert,
}

impl Pending {
    /// Start waiting `confirm` for a new connection to prove the push.
    pub fn new(
        push: Stored,
        previous: Option<Stored>,
        counts: (u64, u64),
        confirm: Duration,
    ) -> Pending {
        Pending {
            push,
            previous,
            connacks: counts.0,
            subacks: counts.1,
            deadline: Instant::now() + confirm,
        }
    }

    /// Judge the connection counters `now` (`(connacks, subacks)`);
    /// `need_suback` when the command subscription is part of the proof.
    pub fn judge(&self, counts: (u64, u64), need_suback: bool, now: Instant) -> Verdict {
        let connected = counts.0 > self.connacks;
        let subscribed = !need_suback || counts.1 > self.subacks;
        if connected && subscribed {
            Verdict::Confirmed
        } else if now >= self.deadline {
            Verdict::Revert
        } else {
            Verdict::Waiting
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(t: &str) -> Stored {
        Stored {
            text: t.into(),
            signature: None,
        }
    }

    #[test]
    fn a_push_is_confirmed_only_by_a_new_connack_and_suback_before_the_deadline() {
        let p = Pending::new(stored("x"), None, (3, 2), Duration::from_secs(60));
        let now = Instant::now();
        assert_eq!(p.judge((3, 2), true, now), Verdict::Waiting);
        assert_eq!(p.judge((4, 2), true, now), Verdict::Waiting);
        assert_eq!(p.judge((4, 3), true, now), Verdict::Confirmed);
        assert_eq!(p.judge((4, 2), false, now), Verdict::Confirmed);
        let late = now + Duration::from_secs(61);
        assert_eq!(p.judge((3, 2), true, late), Verdict::Revert);
    }

    #[test]
    fn a_push_file_others_may_write_or_planted_as_a_symlink_is_ignored() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        save(d.path(), Some(&stored("[spool]\npurge_batch_rows = 7\n"))).unwrap();
        assert!(load(d.path()).is_some());
        let p = d.path().join("config-push.toml");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o646)).unwrap();
        assert_eq!(load(d.path()), None);
        std::fs::remove_file(&p).unwrap();
        let elsewhere = d.path().join("theirs.toml");
        std::fs::write(&elsewhere, "[spool]\n").unwrap();
        std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
        assert_eq!(load(d.path()), None);
        // A good text with a signature file the agent did not write.
        save(d.path(), Some(&stored("x"))).unwrap();
        std::os::unix::fs::symlink(&elsewhere, d.path().join("config-push.sig")).unwrap();
        assert_eq!(load(d.path()), None);
    }

    #[test]
    fn the_confirmed_push_is_kept_whole_and_can_be_removed() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()), None);
        let s = Stored {
            text: "[spool]\npurge_batch_rows = 7\n".into(),
            signature: Some("ab".into()),
        };
        save(d.path(), Some(&s)).unwrap();
        assert_eq!(load(d.path()), Some(s));
        save(d.path(), Some(&stored("o"))).unwrap();
        assert_eq!(load(d.path()), Some(stored("o")), "old signature removed");
        save(d.path(), None).unwrap();
        assert_eq!(load(d.path()), None);
    }

    const BASE: &str = "device_id = \"gw1\"\n[spool]\npath = \"/tmp/es-push-test/spool.db\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:1883\"\n[[sources]]\nname = \"system\"\nkind = \"system\"\ninterval_ms = 1000\n";
    const KEY: &str = "19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1";

    #[test]
    fn a_signed_config_keeps_the_local_operator_keys_and_names_what_it_ignored() {
        let local_text =
            format!("{BASE}[commands]\nenabled = true\noperator_public_keys = [\"{KEY}\"]\n");
        let local = crate::config::parse(&local_text, "local", &[]).expect("local config");
        assert_eq!(local.commands.operator_public_keys.len(), 1);
        // A signed push that names none, or others, or opens the channel,
        // does not change them, and says so.
        let attacker = "ab".repeat(32);
        for (pushed, named) in [
            (format!("{BASE}[commands]\nenabled = true\n"), &["commands.operator_public_keys"][..]),
            (
                format!("{BASE}[commands]\nenabled = true\nallow_unsigned = true\noperator_public_keys = [\"{attacker}\"]\n"),
                &["commands.operator_public_keys", "commands.allow_unsigned"][..],
            ),
            (local_text.clone(), &[][..]),
        ] {
            let (cfg, ignored) =
                compose_noting(&local, &local_text, "local", &[], &Push::Signed(pushed))
                    .expect("composed");
            assert_eq!(cfg.commands.operator_public_keys, local.commands.operator_public_keys);
            assert!(!cfg.commands.allow_unsigned);
            assert_eq!(ignored, named);
        }
    }

    #[test]
    fn every_local_only_key_a_signed_config_changes_is_named() {
        let local = crate::config::parse(BASE, "local", &[]).expect("local config");
        let pushed = format!(
            "{}\n[metrics]\ntextfile = \"/tmp/x.prom\"\nlisten = \"127.0.0.1:9999\"\nlisten_public = true\n\
             [ingest]\nsocket = \"/tmp/x.sock\"\nsocket_group = \"nogroup\"\nsocket_mode = \"0600\"\n\
             tcp = \"127.0.0.1:9998\"\ntcp_public = true\nstream_patterns = [\"app.*\"]\n\
             [commands]\nallow_unsigned = true\noperator_public_keys = [\"{KEY}\"]\n\
             [commands.config_push]\nmode = \"off\"\n",
            BASE.replace("gw1", "gw2")
                .replace("/tmp/es-push-test/spool.db", "/tmp/elsewhere/spool.db")
                .replace("[spool]\n", "[spool]\nallow_network_fs = true\n")
                .replace(
                    "[mqtt]\n",
                    &format!(
                        "[mqtt]\nclient_id = \"x\"\ntopic_prefix = \"y/z\"\nretire_on = \"receipt\"\n\
                         receipt_public_keys = [\"{KEY}\"]\n"
                    ),
                )
        );
        let (cfg, ignored) = compose_noting(&local, BASE, "local", &[], &Push::Signed(pushed))
            .unwrap_or_else(|e| panic!("{e}"));
        let all: Vec<&str> = crate::push::policy::LOCAL_ONLY
            .iter()
            .map(|(k, _)| *k)
            .collect();
        assert_eq!(ignored, all, "every local-only key, in the list's order");
        assert_eq!(cfg.spool.path, local.spool.path);
        assert_eq!(cfg.device_id, "gw1");
    }
}
