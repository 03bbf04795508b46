//! The config file on disk: atomic writes and the last-known-good copy.
//!
//! Its one rule: **the config file is replaced only whole** (temporary file,
//! fsync, rename, fsync of the directory), and a config that validated is
//! kept as `<config>.last-good`, so an empty, truncated or invalid file after
//! a power cut or a bad push never stops the board (F15). The copy lives
//! beside the config, or in the service's state directory when systemd
//! gives one (`$STATE_DIRECTORY`): under `ProtectSystem=strict` the agent
//! cannot write to `/etc`.
//!
//! The copy is a config the agent would run, programs and all: it is
//! believed only when the agent wrote it (a regular file owned by root or
//! the agent's uid that no group or other user may write,
//! [`crate::os::fsguard::files::read_trusted`]); any other file there is named
//! in a WARN and never run.

use crate::config::{self, Config, ConfigError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Where the last-known-good copy of `config` is kept: `<config>.last-good`
/// beside it, or `<state dir>/<config file name>.last-good` when systemd
/// names a state directory (`$STATE_DIRECTORY`, set by `StateDirectory=`;
/// the first one if several), since the packaged unit's
/// `ProtectSystem=strict` leaves `/etc` read-only.
pub fn last_good_path(config: &Path) -> PathBuf {
    last_good_path_in(config, std::env::var_os("STATE_DIRECTORY").as_deref())
}

fn last_good_path_in(config: &Path, state_dir: Option<&std::ffi::OsStr>) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let state_dir = state_dir
        .and_then(|v| v.as_bytes().split(|&b| b == b':').next())
        .map(|d| Path::new(std::ffi::OsStr::from_bytes(d)))
        .filter(|d| d.is_absolute());
    let mut s = match (state_dir, config.file_name()) {
        (Some(dir), Some(name)) => dir.join(name).into_os_string(),
        _ => config.as_os_str().to_owned(),
    };
    s.push(".last-good");
    PathBuf::from(s)
}

/// Hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::event::hex::encode(&Sha256::digest(bytes))
}

/// Replace `path` with `bytes` atomically: write `<path>.tmp-<pid>`, fsync it,
/// rename over `path`, fsync the directory. On any error the old file is
/// untouched and the temporary file removed. The temporary file is created
/// exclusively and never through a symlink (`O_EXCL | O_NOFOLLOW`) and is
/// the agent's own: never the old file's owner. Mode 0640; an old file of
/// the agent's own keeps its group and, at most, its group-read bit
/// ([`crate::os::fsguard::files::replace`]).
///
/// Errors: the directory is not writable, the disk is full, a symlink sits
/// at the temporary name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    crate::os::fsguard::files::replace(path, bytes, 0o640)
}

/// The text of the last-known-good copy of `config`, if the agent wrote it.
///
/// Errors: a sentence naming the copy and why it is not used (missing, not
/// the agent's own file, not UTF-8).
pub fn last_good_text(config: &Path) -> Result<String, String> {
    let lg = last_good_path(config);
    let shown = lg.display();
    match crate::os::fsguard::files::read_trusted(&lg) {
        Ok(Some(bytes)) => String::from_utf8(bytes)
            .map_err(|e| format!("last-known-good copy {shown} is not UTF-8 text: {e}")),
        Ok(None) => Err(format!("there is no last-known-good copy {shown}")),
        Err(d) => Err(format!("last-known-good copy {shown} is ignored: {d}")),
    }
}

/// The state directory of the packaged unit (`StateDirectory=edgespool` in
/// packaging/edgespool.service): where the agent keeps the copy under
/// systemd. A command run from a shell has no `$STATE_DIRECTORY`, so
/// [`last_good_for_reading`] looks there too.
pub const PACKAGED_STATE_DIR: &str = "/var/lib/edgespool";

/// The last-known-good copy of `config` for a command that only reads the
/// spool it names (`status`): the first copy found at [`last_good_path`],
/// beside the config, or in [`PACKAGED_STATE_DIR`], as (its path, its
/// config). Unlike the agent, which runs the copy and so believes it only
/// when its owner is root or the agent's own uid, this reader also takes a
/// copy another uid owns (the packaged agent runs as `edgespool`, the
/// operator as root), still refusing a symlink, a copy others may write or
/// one that does not validate.
///
/// Errors: a sentence for each place looked at: missing, or why the copy
/// there is not used.
pub fn last_good_for_reading(config: &Path) -> Result<(PathBuf, Config), String> {
    let mut places = vec![last_good_path(config), last_good_path_in(config, None)];
    if let Some(name) = config.file_name() {
        let mut packaged = Path::new(PACKAGED_STATE_DIR).join(name).into_os_string();
        packaged.push(".last-good");
        places.push(PathBuf::from(packaged));
    }
    places.dedup();
    let mut why = Vec::new();
    for lg in places {
        let text = match read_believable(&lg) {
            Ok(Some(text)) => text,
            Ok(None) => {
                why.push(format!("there is no last-known-good copy {}", lg.display()));
                continue;
            }
            Err(e) => {
                why.push(format!(
                    "last-known-good copy {} is ignored: {e}",
                    lg.display()
                ));
                continue;
            }
        };
        match config::parse(&text, &lg.display().to_string(), &[]) {
            Ok(c) => return Ok((lg, c)),
            Err(e) => why.push(format!(
                "last-known-good copy {} is not a valid config either ({})",
                lg.display(),
                e.to_string().lines().next().unwrap_or_default()
            )),
        }
    }
    Err(why.join("; "))
}

/// The text at `path` for [`last_good_for_reading`]: as
/// [`crate::os::fsguard::files::read_trusted`] believes it, or owned by
/// another uid (then read `O_NOFOLLOW` and judged by its mode alone).
fn read_believable(path: &Path) -> Result<Option<String>, String> {
    use crate::os::fsguard::files::{read_trusted, Distrust};
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let bytes = match read_trusted(path) {
        Ok(b) => b,
        Err(Distrust::Owner { .. }) => {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(path)
                .map_err(|e| e.to_string())?;
            let m = f.metadata().map_err(|e| e.to_string())?;
            if !m.is_file() || m.mode() & 0o022 != 0 {
                return Err(format!(
                    "it is not a regular file only its owner may write (mode {:o})",
                    m.mode() & 0o7777
                ));
            }
            let mut b = Vec::new();
            f.take(crate::os::fsguard::files::MAX_STATE_BYTES)
                .read_to_end(&mut b)
                .map_err(|e| e.to_string())?;
            Some(b)
        }
        Err(d) => return Err(d.to_string()),
    };
    bytes
        .map(|b| String::from_utf8(b).map_err(|e| format!("it is not UTF-8 text: {e}")))
        .transpose()
}

/// Keep `text` as the last-known-good copy (only when it differs). A file
/// there that the agent did not write is named in a WARN and replaced.
pub fn save_last_good(config: &Path, text: &[u8]) {
    let lg = last_good_path(config);
    match crate::os::fsguard::files::read_trusted(&lg) {
        Ok(Some(old)) if old == text => return,
        Ok(Some(old)) => {
            if let Some(why) = damage(&old) {
                log::warn!(
                    "last-known-good copy {} is damaged ({why}); replacing it with the config that validated",
                    lg.display()
                );
            }
        }
        Ok(None) => {}
        Err(d) => log::warn!(
            "last-known-good copy {} is not trusted ({d}); replacing it with the config that validated",
            lg.display()
        ),
    }
    match write_atomic(&lg, text) {
        Ok(()) => {}
        // An unprivileged agent beside a root-owned /etc/edgespool, or a
        // read-only /etc: the operator keeps that copy; nothing to warn
        // about at every start.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            log::debug!(
                "no last-known-good copy of {} ({} is not writable)",
                config.display(),
                lg.display()
            )
        }
        Err(e) => log::warn!("cannot keep last-known-good config {}: {e}", lg.display()),
    }
}

/// Why `bytes` cannot be a config at all (empty, NUL-filled, not UTF-8,
/// not TOML), if so; a copy that is TOML but no longer validates is not
/// called damaged here.
fn damage(bytes: &[u8]) -> Option<String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Some("it is empty".to_owned());
    }
    if bytes.iter().all(|&b| b == 0) {
        return Some(format!("it is NUL-filled ({} bytes of zeros)", bytes.len()));
    }
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => return Some(format!("it is not UTF-8 text: {e}")),
    };
    text.parse::<toml::Table>()
        .err()
        .map(|e| format!("it is not TOML: {}", e.message()))
}

/// What [`load_at_start`] ran with.
#[derive(Debug)]
pub struct Loaded {
    /// The config in force.
    pub config: Config,
    /// Set when the file was invalid and the last-known-good copy is running:
    /// the full message for the log and the status stream.
    pub fallback: Option<String>,
}

/// Load the config at start. If the file is unusable (empty, truncated, NUL-
/// filled, invalid), fall back to `<config>.last-good`, loudly, if the agent
/// wrote that copy (a copy it did not write is named in a WARN and never
/// run). A good file becomes the new last-known-good copy.
///
/// Errors: the file is unusable and there is no usable last-known-good copy.
pub fn load_at_start(path: &Path, sets: &[String]) -> Result<Loaded, ConfigError> {
    match config::load(path, sets) {
        Ok(config) => {
            if let Ok(text) = std::fs::read(path) {
                save_last_good(path, &text);
            }
            Ok(Loaded {
                config,
                fallback: None,
            })
        }
        Err(e) => {
            let lg = last_good_path(path);
            let text = match last_good_text(path) {
                Ok(t) => t,
                Err(why) => {
                    if lg.symlink_metadata().is_ok() {
                        log::warn!("{why}");
                    }
                    return Err(e);
                }
            };
            let config = config::parse(&text, &lg.display().to_string(), sets).map_err(|lg_e| {
                log::warn!(
                    "last-known-good copy {} is ignored: it is not a valid config either ({})",
                    lg.display(),
                    lg_e.to_string().lines().next().unwrap_or_default()
                );
                e.clone()
            })?;
            Ok(Loaded {
                config,
                fallback: Some(format!(
                    "{}; running last-known-good {} (sha256 {})",
                    e.told(),
                    lg.display(),
                    sha256_hex(text.as_bytes())
                )),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "device_id = \"d\"\n[spool]\npath = \"/tmp/x/spool.db\"\n";

    #[test]
    fn an_invalid_file_falls_back_to_the_last_good_copy_loudly() {
        // field case F15 (b)
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("board.toml");
        std::fs::write(&p, GOOD).unwrap();
        let l = load_at_start(&p, &[]).unwrap();
        assert!(l.fallback.is_none());
        assert_eq!(std::fs::read_to_string(last_good_path(&p)).unwrap(), GOOD);
        for bad in ["", "device_id = \"d\"\n[spool", "\0\0\0\0"] {
            std::fs::write(&p, bad).unwrap();
            let l = load_at_start(&p, &[]).unwrap();
            let msg = l.fallback.unwrap();
            assert!(msg.starts_with("config invalid: "), "{msg}");
            assert!(msg.contains("running last-known-good"), "{msg}");
            assert!(msg.contains(&sha256_hex(GOOD.as_bytes())), "{msg}");
            assert_eq!(l.config.device_id, "d");
        }
    }

    #[test]
    fn the_last_good_copy_goes_to_the_state_directory_systemd_names() {
        // ProtectSystem=strict: /etc is read-only, StateDirectory= is not.
        let cfg = Path::new("/etc/edgespool/edgespool.toml");
        let at = |v: Option<&str>| last_good_path_in(cfg, v.map(std::ffi::OsStr::new));
        assert_eq!(
            at(None),
            Path::new("/etc/edgespool/edgespool.toml.last-good")
        );
        assert_eq!(
            at(Some("/var/lib/edgespool")),
            Path::new("/var/lib/edgespool/edgespool.toml.last-good")
        );
        assert_eq!(
            at(Some("/var/lib/edgespool:/var/lib/other")),
            Path::new("/var/lib/edgespool/edgespool.toml.last-good")
        );
        // Not absolute, or empty: beside the config.
        assert_eq!(at(Some("")), at(None));
        assert_eq!(at(Some("relative")), at(None));
    }

    #[test]
    fn a_damaged_last_good_copy_is_named_by_what_is_wrong_with_it() {
        assert_eq!(damage(b"").as_deref(), Some("it is empty"));
        assert_eq!(
            damage(&[0u8; 16]).as_deref(),
            Some("it is NUL-filled (16 bytes of zeros)")
        );
        assert!(damage(b"\xff\xfe").is_some_and(|m| m.starts_with("it is not UTF-8")));
        assert!(
            damage(b"device_id = \"d\"\n[spool").is_some_and(|m| m.starts_with("it is not TOML"))
        );
        assert_eq!(damage(GOOD.as_bytes()), None);
        // TOML that no longer validates is not damage: replaced quietly.
        assert_eq!(damage(b"device_id = 3\n"), None);
    }

    #[test]
    fn without_a_last_good_copy_an_invalid_file_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("board.toml");
        std::fs::write(&p, "").unwrap();
        assert!(load_at_start(&p, &[]).is_err());
    }

    #[test]
    fn atomic_write_replaces_whole_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("board.toml");
        std::fs::write(&p, "old").unwrap();
        write_atomic(&p, b"new contents").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new contents");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn an_atomic_write_keeps_the_mode_and_never_follows_a_planted_symlink() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("push.toml");
        std::fs::write(&p, "old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_atomic(&p, b"new").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Someone plants the temporary name as a symlink to a victim file.
        let victim = d.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let tmp = d
            .path()
            .join(format!("push.toml.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        assert!(write_atomic(&p, b"newer").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "new");
    }

    #[test]
    fn a_last_good_copy_the_agent_did_not_write_is_never_run() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("board.toml");
        let lg = last_good_path(&p);
        std::fs::write(&p, "").unwrap();
        // Writable by others: anyone could have put programs in it.
        std::fs::write(&lg, GOOD).unwrap();
        std::fs::set_permissions(&lg, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(load_at_start(&p, &[]).is_err());
        // A symlink to a good config elsewhere.
        let elsewhere = d.path().join("elsewhere.toml");
        std::fs::write(&elsewhere, GOOD).unwrap();
        std::fs::remove_file(&lg).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &lg).unwrap();
        assert!(load_at_start(&p, &[]).is_err());
        let e = last_good_text(&p).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        // A good config replaces the link with the agent's own copy.
        std::fs::write(&p, GOOD).unwrap();
        load_at_start(&p, &[]).unwrap();
        assert!(std::fs::symlink_metadata(&lg).unwrap().is_file());
        assert_eq!(last_good_text(&p).unwrap(), GOOD);
        std::fs::write(&p, "").unwrap();
        assert!(load_at_start(&p, &[]).unwrap().fallback.is_some());
    }

    #[test]
    fn a_reader_finds_the_copy_another_uid_wrote_but_never_one_others_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("board.toml");
        std::fs::write(&p, "device_id = 3\n").unwrap();
        let e = last_good_for_reading(&p).unwrap_err();
        assert!(e.contains("there is no last-known-good copy"), "{e}");
        let lg = last_good_path(&p);
        std::fs::write(&lg, GOOD).unwrap();
        std::fs::set_permissions(&lg, std::fs::Permissions::from_mode(0o640)).unwrap();
        let (at, c) = last_good_for_reading(&p).unwrap();
        assert_eq!(
            (at, c.spool.path),
            (lg.clone(), PathBuf::from("/tmp/x/spool.db"))
        );
        // The packaged agent (uid edgespool) wrote it; root reads it.
        if crate::os::fsguard::files::euid() == 0 {
            std::os::unix::fs::chown(&lg, Some(54_321), None).unwrap();
            assert!(last_good_text(&p).is_err(), "the agent would not run it");
            assert!(last_good_for_reading(&p).is_ok());
        }
        std::fs::set_permissions(&lg, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = last_good_for_reading(&p).unwrap_err();
        assert!(e.contains("writ"), "{e}");
    }

    #[test]
    fn a_failed_atomic_write_leaves_the_old_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("missing-dir").join("board.toml");
        assert!(write_atomic(&p, b"x").is_err());
    }
}
