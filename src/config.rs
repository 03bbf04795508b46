//! Board config: TOML text → raw structs (unknown keys denied) → validated [`Config`].
//!
//! Owns every key, its default and its unit. Its one rule: **a bad config never
//! becomes a default config**. Every problem is reported as
//! `key.path: problem (got value)`, with the line when the file has one and a
//! did-you-mean for a misspelt key (field case F16); the caller keeps whatever
//! config it was running.
//!
//! `board-configs/example.toml` mirrors the defaults here, key by key.

mod raw;
mod read;
mod validate;

pub use validate::{placeholders, stream_name_ok};

use crate::envelope::Format;
use crate::process::{Credentials, Limits};
use crate::source::SourceSpec;
use crate::spool::SpoolOptions;
use raw::RawConfig;
use read::{apply_override, deserialize, line_of, locate, single};
use std::collections::BTreeMap;
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
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
    /// `device_id`: the board's identity in topics and envelopes.
    pub device_id: String,
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
    /// `[metrics]`.
    pub metrics: MetricsConfig,
    /// `[ingest]`: the local socket other programs put readings through.
    pub ingest: IngestConfig,
}

impl Config {
    /// The durability class readings of `stream` are committed with: the
    /// `durability` of the `[[sources]]` entry of that name, else of the
    /// `[[ingest.streams]]` entry of that name, `Batched` for any other
    /// stream (those `ingest.stream_patterns` allow, agent streams).
    pub fn stream_durability(&self, stream: &str) -> crate::source::Durability {
        self.sources
            .iter()
            .find(|s| s.name == stream)
            .map(|s| s.durability)
            .or_else(|| {
                self.ingest
                    .streams
                    .iter()
                    .find(|s| s.name == stream)
                    .map(|s| s.durability)
            })
            .unwrap_or_default()
    }

    /// The delivery priority of every stream the config names: each
    /// `[[sources]]` and `[[ingest.streams]]` entry (its `priority`, else
    /// [`default_priority`] of its durability), and the agent's `_commands`
    /// and `_agent` ([`AGENT_STREAM_PRIORITY`]). Any other stream (one a
    /// pattern allows) has priority 0.
    pub fn stream_priorities(&self) -> std::collections::HashMap<String, u8> {
        let mut out: std::collections::HashMap<String, u8> = self
            .sources
            .iter()
            .map(|s| (s.name.clone(), s.priority))
            .chain(
                self.ingest
                    .streams
                    .iter()
                    .map(|s| (s.name.clone(), s.priority)),
            )
            .collect();
        out.insert(
            crate::commands::RESULTS_STREAM.to_owned(),
            AGENT_STREAM_PRIORITY,
        );
        out.insert(crate::agent::AGENT_STREAM.to_owned(), AGENT_STREAM_PRIORITY);
        out
    }

    /// The batching of each stream that has it.
    pub fn stream_batching(&self) -> std::collections::HashMap<String, crate::batching::BatchSpec> {
        let sources = self
            .sources
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.batch?)));
        let ingest = self
            .ingest
            .streams
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.batch?)));
        sources.chain(ingest).collect()
    }

    /// The streams whose `live_first` is set.
    pub fn live_first_streams(&self) -> std::collections::HashSet<String> {
        let sources = self
            .sources
            .iter()
            .filter(|s| s.live_first)
            .map(|s| &s.name);
        let ingest = self.ingest.streams.iter().filter(|s| s.live_first);
        sources.chain(ingest.map(|s| &s.name)).cloned().collect()
    }
}

/// `[metrics]`: Prometheus metrics ([`crate::metrics`]). Off by default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetricsConfig {
    /// `textfile`: an absolute path (for node_exporter's textfile collector,
    /// e.g. `/var/lib/node_exporter/textfile_collector/edgespool.prom`),
    /// replaced whole at every `agent.summary_interval_secs` and at a clean
    /// stop. Unset: no file.
    pub textfile: Option<PathBuf>,
    /// `listen`: `IP:port` of an HTTP listener serving `GET /metrics`
    /// (e.g. `127.0.0.1:9469`). Unset: no listener. A non-loopback address
    /// needs `listen_public`.
    pub listen: Option<std::net::SocketAddr>,
    /// `listen_public`: allow `listen` on an address other hosts can reach
    /// (default false).
    pub listen_public: bool,
}

/// `[ingest]`: the local socket ingest ([`crate::ingest`]). Off unless
/// `socket` or `tcp` is set. Changes take effect at the next restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestConfig {
    /// `socket`: absolute path of a Unix stream socket (e.g.
    /// `/run/edgespool/ingest.sock`). Unset: none.
    pub socket: Option<PathBuf>,
    /// `socket_group`: group given the socket (a name, looked up at start,
    /// or a numeric gid). Unset: the agent's own group.
    pub socket_group: Option<String>,
    /// `socket_mode`: permission bits of the socket, an octal string
    /// (default `"0660"`: owner and group may connect). Must keep the
    /// owner's read and write bits; others may never write.
    pub socket_mode: u32,
    /// `tcp`: `IP:port` of a TCP listener (e.g. `127.0.0.1:7788`); a
    /// non-loopback address needs `tcp_public`. Unset: none.
    pub tcp: Option<std::net::SocketAddr>,
    /// `tcp_public`: allow `tcp` on an address other hosts can reach
    /// (default false). Nothing authenticates a TCP client.
    pub tcp_public: bool,
    /// `max_line_bytes`: longest request line, bytes, newline excluded
    /// (256..=1048576, default 16384). A longer line is answered with an
    /// error naming this limit and the connection is closed.
    pub max_line_bytes: usize,
    /// `max_connections`: connections served at once per listener (the
    /// socket and the TCP port each; 1..=1024, default 16); one more is
    /// told so in one error line and closed. A connection that completes
    /// no request line for 60 s is told so and closed
    /// ([`crate::ingest::conn::LINE_TIMEOUT`]).
    pub max_connections: usize,
    /// `max_rate_per_sec`: requests per second per connection (token
    /// bucket, burst of one second's worth; 1..=1000000, default 5000).
    /// Past it the agent stops reading that connection until tokens are
    /// back (backpressure, nothing refused).
    pub max_rate_per_sec: u32,
    /// `max_fields`: fields per request (1..=1024, default 64).
    pub max_fields: usize,
    /// `[[ingest.streams]]`: the streams clients may write, by name.
    pub streams: Vec<IngestStream>,
    /// `stream_patterns`: further streams allowed by prefix (`"plant.*"`
    /// allows every valid name starting with `plant.`); such streams are
    /// `durability = "batched"`, priority 0, and
    /// at most [`crate::ingest::MAX_PATTERN_STREAMS`] of them are let in
    /// per run of the agent.
    pub stream_patterns: Vec<String>,
}

/// Delivery priority of the agent's own streams, `_commands` (command
/// results) and `_agent` (the agent's events): they go ahead of every
/// stream a config does not raise above it.
pub const AGENT_STREAM_PRIORITY: u8 = 200;

/// Delivery priority of a stream that sets none: 100 for `durability =
/// "full"` (a reading worth an fsync is worth sending first), 0 otherwise.
pub fn default_priority(durability: crate::source::Durability) -> u8 {
    match durability {
        crate::source::Durability::Full => 100,
        crate::source::Durability::Batched => 0,
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            socket: None,
            socket_group: None,
            socket_mode: 0o660,
            tcp: None,
            tcp_public: false,
            max_line_bytes: 16 * 1024,
            max_connections: 16,
            max_rate_per_sec: 5000,
            max_fields: 64,
            streams: Vec::new(),
            stream_patterns: Vec::new(),
        }
    }
}

impl IngestConfig {
    /// Whether any listener is configured.
    pub fn enabled(&self) -> bool {
        self.socket.is_some() || self.tcp.is_some()
    }

    /// The declared stream `name`, or one a pattern allows (batched,
    /// default priority); `None`: clients may not write it.
    pub fn stream(&self, name: &str) -> Option<IngestStream> {
        if let Some(s) = self.streams.iter().find(|s| s.name == name) {
            return Some(s.clone());
        }
        let allowed = stream_name_ok(name)
            && self
                .stream_patterns
                .iter()
                .any(|p| pattern_matches(p, name));
        allowed.then(|| IngestStream {
            name: name.to_owned(),
            durability: crate::source::Durability::Batched,
            priority: 0,
            live_first: false,
            batch: None,
        })
    }
}

/// Whether stream `name` matches `pattern`: a name, or a prefix followed by
/// one final `*` (`plant.*`). No other glob syntax.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.len() > prefix.len() && name.starts_with(prefix),
        None => pattern == name,
    }
}

/// One `[[ingest.streams]]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestStream {
    /// `name`: the stream (the name rule of sources, see [`stream_name_ok`]).
    pub name: String,
    /// `durability`: `"batched"` (default) or `"full"` (committed at once on
    /// the `synchronous = FULL` connection).
    pub durability: crate::source::Durability,
    /// `priority`: delivery priority 0..=255, higher first (default
    /// [`default_priority`] of its durability; see [`crate::lanes`]).
    pub priority: u8,
    /// `live_first`: new readings of this stream go ahead of its own
    /// backlog (default false; see [`crate::lanes`]).
    pub live_first: bool,
    /// `batch_max_events` (above 1), `batch_max_ms`, `compression`:
    /// several events per PUBLISH ([`crate::batching`]); `None`: one each.
    pub batch: Option<crate::batching::BatchSpec>,
}

/// `[commands]`: commands received over MQTT on `<topic_prefix>/commands`.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandsConfig {
    /// `enabled`: subscribe to the command topic.
    pub enabled: bool,
    /// `max_payload_bytes`: larger command messages are rejected, bytes
    /// (256..=1048576, default 65536). The MQTT incoming packet limit is this
    /// plus the command topic and the PUBLISH header.
    pub max_payload_bytes: usize,
    /// `record_retention_secs`: the redelivery window, seconds (3600..=ten
    /// years, default 604800 = 7 days). A command record is never deleted
    /// before it is this old, its age measured on the agent's monotonic
    /// clock (time the agent has run since the receipt, a lower bound of the
    /// real age across restarts and reboots), never on the wall clock.
    pub record_retention: Duration,
    /// `max_records`: command records kept, a count (1000..=1000000, default
    /// 10000). Over it, the oldest `rejected` records go first; records of
    /// commands that ran are deleted only once outside the redelivery
    /// window, and while none can go new commands are held back (not
    /// acknowledged).
    pub max_records: usize,
    /// `max_queued`: commands waiting for their lane (exec handlers; agent
    /// requests), per lane, a count (1..=10000, default 100). When a lane is
    /// full, new command PUBLISHes for it are held back: not acknowledged
    /// (the broker keeps them), parked in memory within the command inbox's
    /// bytes, and taken once there is room; what does not fit is redelivered
    /// by the broker after the agent reconnects.
    pub max_queued: usize,
    /// `max_per_minute_per_scope`: new commands accepted per scope, per
    /// minute (a burst of this many, refilled at this rate; 1..=60000,
    /// default 60). Over it a command is answered `rejected` (rate limit),
    /// not recorded, and counted `commands_rate_limited`.
    pub max_per_minute_per_scope: u32,
    /// `default_ttl_secs`: time to live given to an exec-handler command
    /// that names none, seconds (1..=`record_retention_secs`, default 3600).
    /// Built-ins need none.
    pub default_ttl: Duration,
    /// `[[commands.handlers]]`: exec handlers.
    pub handlers: Vec<ExecHandler>,
    /// `[commands.config_push]`: what `apply-config` may do (see [`crate::policy`]).
    pub config_push: ConfigPush,
}

/// `[commands.config_push]`, from the board's local config only.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConfigPush {
    /// `mode`: `"off"`, `"overlay"` (default) or `"signed"`.
    pub mode: crate::policy::PushMode,
    /// `confirm_secs`: after a push that changes the MQTT connection, a
    /// CONNACK (and the command SUBACK) must arrive within this, or the
    /// previous config comes back (5..=3600, default 60).
    pub confirm: Duration,
    /// `public_keys`: Ed25519 public keys (64 hex digits each) whose
    /// signatures make a whole pushed config acceptable in `signed` mode.
    pub public_keys: Vec<[u8; 32]>,
}

/// One `[[commands.handlers]]` entry: a program with fixed arguments, run
/// without a shell; `{param}` in an argument is replaced by a validated value.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecHandler {
    /// Command name operators send.
    pub name: String,
    /// Absolute path of the program.
    pub program: PathBuf,
    /// Arguments, with `{param}` placeholders.
    pub args: Vec<String>,
    /// Killed after this.
    pub timeout: Duration,
    /// Captured stdout/stderr are truncated to this many bytes each.
    pub max_output_bytes: usize,
    /// May be re-run after a crash interrupted it (F14 variant F).
    pub retry_safe: bool,
    /// Declared parameters.
    pub params: Vec<ParamSpec>,
    /// `env`: variables the program gets besides `PATH` and `LANG` (a name
    /// given here replaces that default). Values are taken literally from
    /// the local config; nothing from a command reaches them.
    pub env: BTreeMap<String, String>,
    /// `cwd`: working directory, absolute (default `/`).
    pub cwd: PathBuf,
    /// `cpu_secs` (seconds), `max_memory_bytes` (bytes of address space),
    /// `max_open_files` (descriptors): set in the child before it runs.
    pub limits: Limits,
    /// `user` and `group`, resolved to ids when the config was validated;
    /// `None`: the program runs as the agent's user.
    pub credentials: Option<Credentials>,
}

/// A declared handler parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Name, as used in `{name}` and in the command's `args`.
    pub name: String,
    /// Type and bounds.
    pub kind: ParamKind,
    /// Must be present.
    pub required: bool,
}

/// Parameter types. Strings are limited to `[A-Za-z0-9_.:@-]`, may not start
/// with `-` or `.`, so no value can become an option or a path escape.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamKind {
    /// An integer in `min..=max`.
    Int {
        /// Lower bound.
        min: i64,
        /// Upper bound.
        max: i64,
    },
    /// A number in `min..=max`.
    Float {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// A safe string of at most `max_len` bytes.
    Str {
        /// Length limit.
        max_len: usize,
    },
    /// One of `values`.
    Enum {
        /// Allowed values.
        values: Vec<String>,
    },
    /// `true` or `false`.
    Bool,
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
    /// `acked_retention_secs`: ACKED rows appended longer ago than this are deleted.
    pub acked_retention: Duration,
    /// `purge_batch_rows`: rows deleted per retention transaction.
    pub purge_batch_rows: usize,
    /// `checkpoint_interval_secs`: PASSIVE checkpoint cadence.
    pub checkpoint_interval: Duration,
    /// `allow_network_fs`: accept a spool on NFS/CIFS/9p/FUSE (unsafe for WAL).
    pub allow_network_fs: bool,
    /// `max_bytes` / `min_free_bytes`: when to refuse new readings.
    pub capacity: crate::maintenance::Capacity,
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

/// `[mqtt]`: the broker and delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct MqttConfig {
    /// `mqtts://` in `url`: TLS (rustls, ring provider).
    pub tls: Option<TlsFiles>,
    /// `username` and `password_file`.
    pub credentials: Option<(String, Option<PathBuf>)>,
    /// Host from `url`.
    pub host: String,
    /// Port from `url`.
    pub port: u16,
    /// `client_id`.
    pub client_id: String,
    /// `topic_prefix`: events go to `<topic_prefix>/events/<stream>`.
    pub topic_prefix: String,
    /// `keep_alive_secs`.
    pub keep_alive: Duration,
    /// `clean_session`.
    pub clean_session: bool,
    /// `inflight_window`: publishes awaiting PUBACK at once.
    pub inflight_window: usize,
    /// `max_payload_bytes`: larger events are marked FAILED, never sent.
    pub max_payload_bytes: usize,
    /// `max_packet_bytes`: the broker's limit on a whole packet (mosquitto's
    /// `max_packet_size`): an event whose QoS 1 PUBLISH (fixed header,
    /// Remaining Length, topic, packet id and payload; MQTT 3.1.1 §2.2,
    /// §3.3) is larger is marked FAILED, never sent. Default
    /// [`crate::mqtt::PROTOCOL_MAX_PACKET`], the protocol's own limit.
    pub max_packet_bytes: usize,
    /// `payload_format`.
    pub payload_format: Format,
    /// `connect_timeout_secs`.
    pub connect_timeout: Duration,
    /// `reconnect_min_ms`: first reconnect backoff.
    pub reconnect_min: Duration,
    /// `reconnect_max_ms`: backoff cap.
    pub reconnect_max: Duration,
    /// `ack_timeout_secs`: connected with rows in flight and no PUBACK for this
    /// long → the client is rebuilt and rows replayed (watchdog).
    pub ack_timeout: Duration,
    /// `fail_after_disconnects`: a row that is the oldest in flight when the
    /// connection drops this many times in a row is marked FAILED (a publish
    /// the broker answers by disconnecting, e.g. over its packet size limit),
    /// so the rows behind it flow (1..=100, default 3).
    pub fail_after_disconnects: u32,
    /// `protocol`: `"5"` (default; the integer `5` too) or `"3.1.1"`. Only MQTT 5 tells a
    /// publisher that the broker refused a publish (a PUBACK reason code of
    /// 0x80 or more, MQTT 5.0 §3.4.2.1); under 3.1.1 a broker that denies a
    /// publish still acknowledges it (§3.4: a PUBACK has no reason code).
    pub protocol: Protocol,
    /// `session_expiry_secs`: how long the broker keeps this client's
    /// session (its command subscription and queued commands) after a
    /// disconnect, MQTT 5 only (§3.1.2.11.2); 0..=4294967295, default
    /// 604800 (7 days). Ignored with `clean_session = true` or 3.1.1, where
    /// a persistent session lasts until the broker drops it.
    pub session_expiry_secs: u32,
    /// `min_share_pct`: the starvation bound of delivery priority
    /// ([`crate::lanes`]): while streams of a higher priority have rows
    /// waiting, lower priorities still get this share of the publishes
    /// offered, in percent (0..=50, default 10; 0 is strict priority).
    pub min_share_pct: u8,
    /// `status_topic`: a retained `<topic_prefix>/status` message, `online`
    /// at each connect and `offline` as the will (sent by the broker when the
    /// connection ends without a DISCONNECT: a kill, a power cut, a lost
    /// link, and a clean stop too). Default true.
    pub status_topic: bool,
}

/// `mqtt.protocol`: the MQTT version spoken to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// MQTT 3.1.1 (protocol level 4).
    V311,
    /// MQTT 5.0 (protocol level 5): PUBACK reason codes, the broker's
    /// receive maximum and maximum packet size, user properties.
    #[default]
    V5,
}

/// TLS material for `mqtts://`, read at every connect (rotated files apply
/// at the next reconnect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// `ca_file`: PEM CA certificate(s) the broker's certificate must chain to.
    pub ca_file: PathBuf,
    /// `client_cert_file` and `client_key_file`: PEM client certificate and
    /// key for mutual TLS (AWS IoT Core and similar).
    pub client: Option<(PathBuf, PathBuf)>,
}

/// `[agent]`: process-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// `summary_interval_secs`: one summary log line per interval.
    pub summary_interval: Duration,
}

/// Read and validate the config file at `path`, applying `overrides`
/// (`key.path=value`, value parsed as TOML, else taken as a string).
///
/// Errors: the file cannot be read, is empty, is not TOML, has an unknown or
/// mistyped key, or a value out of range; every message names the key path.
pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read(path)
        .map_err(|e| single(&origin, "(file)", None, &format!("cannot read: {e}")))?;
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
