//! The spool file under the running agent: still the one opened (same
//! device and inode), its `-shm` still the one mapped, and the background
//! integrity check's verdict.
//!
//! One rule: a spool replaced or found damaged stops the agent **without
//! claiming durability** (the supervisor restarts a clean process, which
//! moves a damaged file aside); a `-shm` swapped under it is a warning,
//! once per change.

use super::Upkeep;
use crate::flash::maintenance::file_identity;
use std::path::Path;

/// Why the writer must stop (exit non-zero; the supervisor restarts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fatal {
    /// The background integrity check found the spool damaged: the marker
    /// is written, so running again moves the file aside and starts fresh.
    Damaged(String),
    /// The spool file was removed or replaced under the running agent:
    /// stop, and let the supervisor start a clean process.
    Replaced(String),
}

impl Fatal {
    /// The message logged and recorded as the run's end.
    pub fn message(&self) -> &str {
        match self {
            Fatal::Damaged(m) | Fatal::Replaced(m) => m,
        }
    }
}

/// What the upkeep keeps about the file.
#[derive(Debug)]
pub(super) struct Watch {
    /// (device, inode) of the spool file at open.
    identity: Option<(u64, u64)>,
    /// (device, inode) of the spool's `-shm` file (the WAL index) at open.
    shm: Option<(u64, u64)>,
    /// What the `-shm` path was (missing, or another inode) when that was
    /// last warned about: one WARN per change, not one per pass.
    shm_warned: Option<Option<(u64, u64)>>,
    /// The background integrity check, if one runs.
    pub(super) verdict: Option<crate::spool::integrity::Verdict>,
}

impl Watch {
    pub(super) fn new(path: &Path) -> Watch {
        Watch {
            identity: file_identity(path),
            shm: file_identity(&crate::spool::shm_path(path)),
            shm_warned: None,
            verdict: None,
        }
    }

    /// A damage the integrity check found, or the file replaced: logged
    /// here, returned for the writer to stop on.
    pub(super) fn fatal(&self, path: &Path) -> Option<Fatal> {
        let found = self
            .verdict
            .as_ref()
            .and_then(|v| v.lock().unwrap_or_else(|p| p.into_inner()).clone());
        if let Some(damage) = found {
            let msg = format!(
                "spool {} is damaged ({damage}); stopping to move it aside and start a fresh spool",
                path.display()
            );
            log::error!("{msg}");
            return Some(Fatal::Damaged(msg));
        }
        let id = self.identity?;
        if file_identity(path) != Some(id) {
            let msg = format!(
                "spool {} was removed or replaced under the running agent; stopping without claiming durability (the supervisor restarts a clean process)",
                path.display()
            );
            log::error!("{msg}");
            return Some(Fatal::Replaced(msg));
        }
        None
    }

    /// The `-shm` file still the one opened (same device and inode). Every
    /// connection of this agent maps the WAL index it opened, unlinked or
    /// not, so removing the file breaks nothing here at once; but the next
    /// process to open the spool (`status`, a backup, a second agent) builds
    /// a fresh index that knows nothing of this one's WAL frames, and reads
    /// stale pages or, writing, damages the spool. A WARN names the file and
    /// that, once per change of what is at the path.
    pub(super) fn check_shm(&mut self, path: &Path) {
        let Some(opened) = self.shm else {
            return;
        };
        let shm = crate::spool::shm_path(path);
        let now = file_identity(&shm);
        if now == Some(opened) || self.shm_warned == Some(now) {
            return;
        }
        let what = if now.is_none() {
            "was removed"
        } else {
            "was replaced by another file"
        };
        log::warn!(
            "spool -shm file {} {what} under the running agent: this agent keeps the WAL index it mapped, but any other process that opens the spool now (status, a backup) builds a new one without this agent's WAL frames and can read stale data or, writing, damage the spool; stop the agent cleanly and start it again to rebuild the -shm safely",
            shm.display()
        );
        self.shm_warned = Some(now);
    }
}

impl Upkeep {
    /// The spool file this upkeep keeps.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
