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
/// push, the board's identity, nor move what the agent writes or binds.
///
/// Errors: the result does not validate (the message names the key).
pub fn compose(
    local: &Config,
    local_text: &str,
    origin: &str,
    sets: &[String],
    push: &Push,
) -> Result<Config, String> {
    let mut cfg = match push {
        Push::Overlay(over) => {
            let all: Vec<String> = sets.iter().chain(over.iter()).cloned().collect();
            crate::config::parse(local_text, origin, &all)
        }
        Push::Signed(text) => crate::config::parse(text, "signed push", sets),
    }
    .map_err(|e| format!("config invalid: {e}"))?;
    keep_local_only(&mut cfg, local);
    Ok(cfg)
}

/// Put the local values of [`crate::push::policy::LOCAL_ONLY`] back into `cfg`.
fn keep_local_only(cfg: &mut Config, local: &Config) {
    cfg.config_push = local.config_push.clone();
    // Who the operator is: a push (from the command topic) may not say.
    cfg.commands.operator_scopes = local.commands.operator_scopes.clone();
    cfg.device_id = local.device_id.clone();
    cfg.device_id_source = local.device_id_source.clone();
    cfg.mqtt.client_id = local.mqtt.client_id.clone();
    cfg.mqtt.topic_prefix = local.mqtt.topic_prefix.clone();
    cfg.spool.path = local.spool.path.clone();
    cfg.spool.allow_network_fs = local.spool.allow_network_fs;
    cfg.metrics.textfile = local.metrics.textfile.clone();
    cfg.metrics.listen = local.metrics.listen;
    cfg.metrics.listen_public = local.metrics.listen_public;
    let (i, l) = (&mut cfg.ingest, &local.ingest);
    i.socket = l.socket.clone();
    i.socket_group = l.socket_group.clone();
    i.socket_mode = l.socket_mode;
    i.tcp = l.tcp;
    i.tcp_public = l.tcp_public;
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

    #[test]
    fn a_signed_config_keeps_the_local_operator_scopes() {
        let base = "device_id = \"gw1\"\n[spool]\npath = \"/tmp/es-push-test/spool.db\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:1883\"\n[[sources]]\nname = \"system\"\nkind = \"system\"\ninterval_ms = 1000\n";
        let local_text = format!("{base}[commands]\nenabled = true\noperator_scopes = [\"ops\"]\n");
        let local = crate::config::parse(&local_text, "local", &[]).expect("local config");
        assert_eq!(local.commands.operator_scopes, vec!["ops".to_owned()]);
        // A signed push that names none (or others) does not change them.
        for pushed in [
            format!("{base}[commands]\nenabled = true\n"),
            format!("{base}[commands]\nenabled = true\noperator_scopes = [\"attacker\"]\n"),
        ] {
            let cfg = compose(&local, &local_text, "local", &[], &Push::Signed(pushed))
                .expect("composed");
            assert_eq!(cfg.commands.operator_scopes, vec!["ops".to_owned()]);
        }
    }
}
