//! Board config: TOML text → raw structs (unknown keys denied) → validated [`Config`].
//!
//! Owns every key, its default and its unit. Its one rule: **a bad config never
//! becomes a default config**. Every problem is reported as
//! `key.path: problem (got value)`, with the line when the file has one and a
//! did-you-mean for a misspelt key (field case F16); the caller keeps whatever
//! config it was running.
//!
//! `board-configs/example.toml` mirrors the defaults here, key by key.

pub mod file;
mod keys;
mod raw;
mod read;
mod suggest;
mod validate;

pub use keys::accepted_keys;
pub use validate::placeholders;

use crate::commands::CommandsConfig;
use crate::event::stream::{
    BatchSpec, Durability, StreamSettings, AGENT_STREAM, AGENT_STREAM_PRIORITY, RESULTS_STREAM,
};
use crate::ingest::IngestConfig;
use crate::metrics::MetricsConfig;
use crate::mqtt::MqttConfig;
use crate::source::SourceSpec;
use crate::spool::SpoolOptions;
use raw::RawConfig;
use read::{apply_override, deserialize, line_of, locate, single};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use validate::validate;

/// One problem in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Full key path, e.g. `mqtt.keep_alive_secs` or `sources[1].path`.
    pub key: String,
    /// 1-based line in the file, when known.
    pub line: Option<usize>,
    /// What is wrong, with the value and a did-you-mean where one fits.
    pub message: String,
}

/// A config that cannot be used. The caller keeps its current config (or, at
/// start with none, exits non-zero); it never falls back to defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where the text came from (file path, or `--set`).
    pub origin: String,
    /// Every problem found (validation reports all it can, parsing the first).
    pub problems: Vec<Problem>,
    /// The file does not exist (`problems` is then empty): a newcomer's
    /// typo in the path, told as such ([`ConfigError::told`]), never as a
    /// parse failure.
    pub missing_file: bool,
}

impl ConfigError {
    /// The error as a command tells it on stderr: `config file FILE does not
    /// exist`, or `config invalid: ` and each problem on its own line.
    pub fn told(&self) -> String {
        match self.missing_file {
            true => self.to_string(),
            false => format!("config invalid: {self}"),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.missing_file {
            return write!(f, "config file {} does not exist", self.origin);
        }
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            match p.line {
                Some(l) => write!(f, "{}:{}: {}: {}", self.origin, l, p.key, p.message)?,
                None => write!(f, "{}: {}: {}", self.origin, p.key, p.message)?,
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// The validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `device_id`: the board's identity in topics and envelopes, resolved
    /// (`@machine-id` and `@hostname` are replaced by the id they name).
    pub device_id: String,
    /// Where `device_id` came from: written as it is, or `@machine-id`,
    /// `@hostname` ([`crate::os::identity`]).
    pub device_id_source: crate::os::identity::DeviceIdSource,
    /// `[spool]`.
    pub spool: SpoolConfig,
    /// `[mqtt]`.
    pub mqtt: MqttConfig,
    /// `[agent]`.
    pub agent: AgentConfig,
    /// `[[sources]]`.
    pub sources: Vec<SourceSpec>,
    /// `[commands]`.
    pub commands: CommandsConfig,
    /// `[commands.config_push]`: what `apply-config` may do (see
    /// [`crate::push::policy`]); the agent's, not the command thread's.
    pub config_push: ConfigPush,
    /// `[metrics]`.
    pub metrics: MetricsConfig,
    /// `[ingest]`: the local socket other programs put readings through.
    pub ingest: IngestConfig,
    /// `[signed] serial`: the serial a signed whole config carries (1 or
    /// more). A board accepts a signed config only with a serial above every
    /// one it accepted before ([`crate::push::policy`]); in the local file it means
    /// nothing.
    pub signed_serial: Option<u64>,
}

impl Config {
    /// Every stream the config declares with its settings: each
    /// `[[sources]]` entry, then each `[[ingest.streams]]` entry.
    pub fn declared_streams(&self) -> impl Iterator<Item = (&str, &StreamSettings)> {
        let sources = self.sources.iter().map(|s| (s.name.as_str(), &s.settings));
        let ingest = self
            .ingest
            .streams
            .iter()
            .map(|s| (s.name.as_str(), &s.settings));
        sources.chain(ingest)
    }

    /// The durability class readings of `stream` are committed with: the
    /// `durability` of the `[[sources]]` entry of that name, else of the
    /// `[[ingest.streams]]` entry of that name, `Batched` for any other
    /// stream (those `ingest.stream_patterns` allow, agent streams).
    pub fn stream_durability(&self, stream: &str) -> Durability {
        self.declared_streams()
            .find(|(name, _)| *name == stream)
            .map(|(_, s)| s.durability)
            .unwrap_or_default()
    }

    /// The delivery priority of every stream the config names: each
    /// `[[sources]]` and `[[ingest.streams]]` entry (its `priority`, else
    /// [`crate::event::stream::default_priority`] of its durability), and the
    /// agent's `_commands` and `_agent` ([`AGENT_STREAM_PRIORITY`]). Any
    /// other stream (one a pattern allows) has priority 0.
    pub fn stream_priorities(&self) -> HashMap<String, u8> {
        let mut out: HashMap<String, u8> = self
            .declared_streams()
            .map(|(name, s)| (name.to_owned(), s.priority))
            .collect();
        out.insert(RESULTS_STREAM.to_owned(), AGENT_STREAM_PRIORITY);
        out.insert(AGENT_STREAM.to_owned(), AGENT_STREAM_PRIORITY);
        out
    }

    /// The batching of each stream that has it.
    pub fn stream_batching(&self) -> HashMap<String, BatchSpec> {
        self.declared_streams()
            .filter_map(|(name, s)| Some((name.to_owned(), s.batch?)))
            .collect()
    }

    /// The streams whose `live_first` is set.
    pub fn live_first_streams(&self) -> HashSet<String> {
        self.declared_streams()
            .filter(|(_, s)| s.live_first)
            .map(|(name, _)| name.to_owned())
            .collect()
    }
}

/// `commands.config_push.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PushMode {
    /// `apply-config` is refused.
    Off,
    /// Overlays of [`crate::push::policy::OVERLAY_KEYS`] only.
    #[default]
    Overlay,
    /// Overlays, and whole configs signed by a listed key.
    Signed,
}

/// `[commands.config_push]`, from the board's local config only.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConfigPush {
    /// `mode`: `"off"`, `"overlay"` (default) or `"signed"`.
    pub mode: PushMode,
    /// `confirm_secs`: after a push that changes the MQTT connection, a
    /// CONNACK (and the command SUBACK) must arrive within this, or the
    /// previous config comes back (5..=3600, default 60).
    pub confirm: Duration,
    /// `public_keys`: Ed25519 public keys (64 hex digits each) whose
    /// signatures make a whole pushed config acceptable in `signed` mode.
    pub public_keys: Vec<[u8; 32]>,
}

/// `[spool]`: where events wait for their acknowledgement.
#[derive(Debug, Clone, PartialEq)]
pub struct SpoolConfig {
    /// `path`: the SQLite file (its directory is created if missing).
    pub path: PathBuf,
    /// Pragmas.
    pub options: SpoolOptions,
    /// `commit_window_ms`: readings are grouped into one transaction per window.
    pub commit_window: Duration,
    /// `write_budget_mb_per_day`, in bytes a day (1 MB = 10^6 bytes): with
    /// it the agent widens its commit window (and so its checkpoint cadence)
    /// from the measured writes to stay within it, up to
    /// `max_commit_window`; `None` keeps `commit_window` ([`crate::flash::write_budget`]).
    pub write_budget_bytes_per_day: Option<u64>,
    /// `max_commit_window_ms`: the widest commit window (the largest loss
    /// window of `batched` streams) a write budget may choose; 1..=600000
    /// ms, default 10,000.
    pub max_commit_window: Duration,
    /// `acked_retention_secs`: ACKED rows appended longer ago than this are deleted.
    pub acked_retention: Duration,
    /// `purge_batch_rows`: rows deleted per retention transaction.
    pub purge_batch_rows: usize,
    /// `checkpoint_interval_secs`: PASSIVE checkpoint cadence.
    pub checkpoint_interval: Duration,
    /// `allow_network_fs`: accept a spool on NFS/CIFS/9p/FUSE (unsafe for WAL).
    pub allow_network_fs: bool,
    /// `max_bytes` / `min_free_bytes`: when to refuse new readings.
    pub capacity: crate::flash::maintenance::Capacity,
    /// `checkpoint_wal_bytes`: PASSIVE checkpoint once the WAL reaches this.
    pub checkpoint_wal_bytes: u64,
    /// `tune_from_probe`: measure the spool's device at start (or reuse the
    /// stored profile) and derive `commit_window_ms` and
    /// `checkpoint_wal_bytes` where the config leaves them unset, the storage
    /// retry backoff, and a `max_bytes` bound that fits the free space.
    pub tune_from_probe: bool,
    /// Which tunable keys the config set explicitly (those win over the probe).
    pub explicit: ExplicitKeys,
}

/// Tunable keys the config file set itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExplicitKeys {
    /// `spool.commit_window_ms` was set.
    pub commit_window: bool,
    /// `spool.checkpoint_wal_bytes` was set.
    pub checkpoint_wal_bytes: bool,
}

/// `[agent]`: process-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// `summary_interval_secs`: one summary log line per interval.
    pub summary_interval: Duration,
    /// `rate_window_secs`: the window of the outage budget's moving
    /// averages (ingest, delivery and flash write rates; [`crate::flash::outage`]).
    pub rate_window: Duration,
}

/// The line (1-based) where `key` (`sink.url`, `sink.postgres.ca`,
/// `sources[2].path`) is written in the TOML `text`, found by following its
/// table headers as the config's own messages do; else the line of a table
/// header `[key]`. `None` when the key is not written. For other TOML files
/// (the sink's settings) that want the same `FILE:LINE: key: problem`
/// messages.
pub fn line_of_key(text: &str, key: &str) -> Option<usize> {
    locate(text, key).or_else(|| {
        text.lines()
            .position(|l| {
                l.trim()
                    .strip_prefix('[')
                    .and_then(|r| r.split_once(']'))
                    .is_some_and(|(h, _)| h.trim() == key)
            })
            .map(|n| n + 1)
    })
}

/// Read and validate the config file at `path`, applying `overrides`
/// (`key.path=value`, value parsed as TOML, else taken as a string).
///
/// Errors: the file does not exist ([`ConfigError::missing_file`]), cannot be
/// read, is empty, is not TOML, has an unknown or mistyped key, or a value
/// out of range; every message names the key path.
pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ConfigError {
            origin: origin.clone(),
            problems: Vec::new(),
            missing_file: true,
        },
        _ => single(&origin, "(file)", None, &format!("cannot read: {e}")),
    })?;
    let text = String::from_utf8(text)
        .map_err(|e| single(&origin, "(file)", None, &format!("not UTF-8 text: {e}")))?;
    parse(&text, &origin, overrides)
}

/// Validate config `text` (from `origin`, used in messages) with `overrides`.
pub fn parse(text: &str, origin: &str, overrides: &[String]) -> Result<Config, ConfigError> {
    if text.trim().is_empty() {
        return Err(single(origin, "(file)", None, "config is empty"));
    }
    if text.contains('\0') {
        return Err(single(
            origin,
            "(file)",
            line_of(text, text.find('\0')),
            "contains NUL bytes (a damaged or partly written file?)",
        ));
    }
    if overrides.is_empty() {
        // The file alone: problems carry the file's line numbers.
        let raw: RawConfig = deserialize(text, origin, true)?;
        return validate(raw, origin).map_err(|mut e| {
            for p in &mut e.problems {
                p.line = p.line.or_else(|| locate(text, &p.key));
            }
            e
        });
    }
    // With overrides the merged document is what must be valid: an override
    // may supply a key the file lacks or fix one it has wrong.
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        single(
            origin,
            "(syntax)",
            line_of(text, e.span().map(|s| s.start)),
            e.message().trim(),
        )
    })?;
    for o in overrides {
        apply_override(&mut table, o).map_err(|m| single("--set", o, None, &m))?;
    }
    let merged =
        toml::to_string(&table).map_err(|e| single("--set", "(all)", None, &e.to_string()))?;
    let raw: RawConfig = deserialize(&merged, "--set", false)?;
    validate(raw, &format!("{origin} with --set"))
}

#[cfg(test)]
mod tests;
