//! Board config: TOML text → raw structs (unknown keys denied) → validated [`Config`].
//!
//! Owns every key, its default and its unit. Its one rule: **a bad config never
//! becomes a default config**. Every problem is reported as
//! `key.path: problem (got value)`, with the line when the file has one and a
//! did-you-mean for a misspelt key (field case F16); the caller keeps whatever
//! config it was running.
//!
//! `board-configs/example.toml` mirrors the defaults here, key by key.

use crate::ack::MAX_WINDOW;
use crate::envelope::Format;
use crate::process::{Credentials, Limits};
use crate::source::{SourceKind, SourceSpec};
use crate::spool::{SpoolOptions, Synchronous};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// `max_connections`: connections served at once over both listeners
    /// (1..=1024, default 16); one more is told so in one error line and
    /// closed.
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
    /// `durability = "batched"`, priority [`DEFAULT_STREAM_PRIORITY`].
    pub stream_patterns: Vec<String>,
}

/// Priority of an ingest stream that does not set one (and of a stream a
/// pattern allows).
pub const DEFAULT_STREAM_PRIORITY: u8 = 128;

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
            priority: DEFAULT_STREAM_PRIORITY,
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
    /// `priority`: 0..=255 (default 128), kept for delivery ordering; not
    /// used yet.
    pub priority: u8,
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
    /// `protocol`: `"5"` (default) or `"3.1.1"`. Only MQTT 5 tells a
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

// ---- raw layer: what serde reads ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    device_id: String,
    spool: RawSpool,
    #[serde(default)]
    mqtt: RawMqtt,
    #[serde(default)]
    agent: RawAgent,
    #[serde(default)]
    sources: Vec<RawSource>,
    #[serde(default)]
    commands: RawCommands,
    #[serde(default)]
    metrics: RawMetrics,
    #[serde(default)]
    ingest: RawIngest,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawIngest {
    socket: Option<PathBuf>,
    socket_group: Option<String>,
    socket_mode: Option<String>,
    tcp: Option<String>,
    #[serde(default)]
    tcp_public: bool,
    max_line_bytes: Option<usize>,
    max_connections: Option<usize>,
    max_rate_per_sec: Option<u32>,
    max_fields: Option<usize>,
    #[serde(default)]
    streams: Vec<RawIngestStream>,
    #[serde(default)]
    stream_patterns: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIngestStream {
    name: String,
    durability: Option<String>,
    priority: Option<u8>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    textfile: Option<PathBuf>,
    listen: Option<String>,
    #[serde(default)]
    listen_public: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCommands {
    #[serde(default = "d_true")]
    enabled: bool,
    #[serde(default = "d_cmd_payload")]
    max_payload_bytes: usize,
    #[serde(default = "d_cmd_retention")]
    record_retention_secs: u64,
    #[serde(default = "d_cmd_records")]
    max_records: usize,
    #[serde(default = "d_cmd_queued")]
    max_queued: usize,
    #[serde(default = "d_cmd_rate")]
    max_per_minute_per_scope: u32,
    #[serde(default = "d_cmd_ttl")]
    default_ttl_secs: u64,
    #[serde(default)]
    handlers: Vec<RawHandler>,
    #[serde(default)]
    config_push: RawConfigPush,
}

impl Default for RawCommands {
    fn default() -> Self {
        RawCommands {
            enabled: true,
            max_payload_bytes: d_cmd_payload(),
            record_retention_secs: d_cmd_retention(),
            max_records: d_cmd_records(),
            max_queued: d_cmd_queued(),
            max_per_minute_per_scope: d_cmd_rate(),
            default_ttl_secs: d_cmd_ttl(),
            handlers: Vec::new(),
            config_push: RawConfigPush::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfigPush {
    #[serde(default = "d_push_mode")]
    mode: String,
    #[serde(default = "d_push_confirm")]
    confirm_secs: u64,
    #[serde(default)]
    public_keys: Vec<String>,
}

impl Default for RawConfigPush {
    fn default() -> Self {
        RawConfigPush {
            mode: d_push_mode(),
            confirm_secs: d_push_confirm(),
            public_keys: Vec::new(),
        }
    }
}

fn d_push_mode() -> String {
    "overlay".into()
}
fn d_push_confirm() -> u64 {
    60
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHandler {
    name: String,
    program: PathBuf,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default = "d_handler_timeout")]
    timeout_ms: u64,
    #[serde(default = "d_handler_output")]
    max_output_bytes: usize,
    #[serde(default)]
    retry_safe: bool,
    #[serde(default)]
    params: BTreeMap<String, RawParam>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    cwd: Option<PathBuf>,
    /// Default: [`default_cpu_secs`] of the timeout.
    cpu_secs: Option<u64>,
    #[serde(default = "d_handler_memory")]
    max_memory_bytes: u64,
    #[serde(default = "d_handler_files")]
    max_open_files: u64,
    user: Option<String>,
    group: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    #[serde(rename = "type")]
    kind: String,
    min: Option<f64>,
    max: Option<f64>,
    values: Option<Vec<String>>,
    max_len: Option<usize>,
    #[serde(default = "d_true")]
    required: bool,
}

fn d_protocol() -> String {
    "5".to_owned()
}
fn d_session_expiry() -> u32 {
    604_800
}
fn d_true() -> bool {
    true
}
fn d_cmd_payload() -> usize {
    64 * 1024
}
fn d_cmd_retention() -> u64 {
    7 * 86_400
}
fn d_cmd_records() -> usize {
    10_000
}
fn d_cmd_queued() -> usize {
    100
}
fn d_cmd_rate() -> u32 {
    60
}
fn d_cmd_ttl() -> u64 {
    3600
}
fn d_handler_timeout() -> u64 {
    30_000
}
fn d_handler_output() -> usize {
    4096
}
/// Default `max_memory_bytes` of a handler: 256 MiB of address space.
fn d_handler_memory() -> u64 {
    256 * 1024 * 1024
}
/// Default `max_open_files` of a handler.
fn d_handler_files() -> u64 {
    64
}
/// Default `cwd` of a handler.
const HANDLER_CWD: &str = "/";

/// Default `cpu_secs` of a handler with a `timeout_ms` timeout: the timeout
/// in seconds, rounded up, plus one. A program busy for its whole run is
/// then stopped by its timeout, which says so in the result, rather than by
/// the CPU limit.
fn default_cpu_secs(timeout_ms: u64) -> u64 {
    timeout_ms.div_ceil(1000).saturating_add(1)
}

/// Most variables a handler's `env` may set.
const MAX_ENV_VARS: usize = 64;
/// Longest name in a handler's `env`, bytes.
const MAX_ENV_NAME_BYTES: usize = 128;
/// Longest value in a handler's `env`, bytes.
const MAX_ENV_VALUE_BYTES: usize = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpool {
    path: PathBuf,
    #[serde(default = "d_sync")]
    synchronous: String,
    #[serde(default = "d_busy")]
    busy_timeout_ms: u64,
    #[serde(default = "d_jsl")]
    journal_size_limit_bytes: i64,
    #[serde(default = "d_autockpt")]
    wal_autocheckpoint_pages: i64,
    commit_window_ms: Option<u64>,
    #[serde(default = "d_retention")]
    acked_retention_secs: u64,
    #[serde(default = "d_purge")]
    purge_batch_rows: usize,
    #[serde(default = "d_ckpt")]
    checkpoint_interval_secs: u64,
    #[serde(default)]
    allow_network_fs: bool,
    #[serde(default = "d_max_bytes")]
    max_bytes: u64,
    #[serde(default = "d_min_free")]
    min_free_bytes: u64,
    checkpoint_wal_bytes: Option<u64>,
    #[serde(default = "d_true")]
    tune_from_probe: bool,
}

fn d_max_bytes() -> u64 {
    1024 * 1024 * 1024
}
fn d_min_free() -> u64 {
    64 * 1024 * 1024
}
fn d_ckpt_wal() -> u64 {
    1024 * 1024
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMqtt {
    #[serde(default = "d_url")]
    url: String,
    client_id: Option<String>,
    topic_prefix: Option<String>,
    #[serde(default = "d_keepalive")]
    keep_alive_secs: u64,
    #[serde(default)]
    clean_session: bool,
    #[serde(default = "d_window")]
    inflight_window: usize,
    #[serde(default = "d_maxpayload")]
    max_payload_bytes: usize,
    #[serde(default = "d_maxpacket")]
    max_packet_bytes: usize,
    #[serde(default = "d_format")]
    payload_format: String,
    #[serde(default = "d_connect")]
    connect_timeout_secs: u64,
    #[serde(default = "d_rmin")]
    reconnect_min_ms: u64,
    #[serde(default = "d_rmax")]
    reconnect_max_ms: u64,
    #[serde(default = "d_acktimeout")]
    ack_timeout_secs: u64,
    #[serde(default = "d_fail_after")]
    fail_after_disconnects: u32,
    #[serde(default = "d_true")]
    status_topic: bool,
    #[serde(default = "d_protocol")]
    protocol: String,
    #[serde(default = "d_session_expiry")]
    session_expiry_secs: u32,
    ca_file: Option<PathBuf>,
    client_cert_file: Option<PathBuf>,
    client_key_file: Option<PathBuf>,
    username: Option<String>,
    password_file: Option<PathBuf>,
}

impl Default for RawMqtt {
    fn default() -> Self {
        RawMqtt {
            url: d_url(),
            client_id: None,
            topic_prefix: None,
            keep_alive_secs: d_keepalive(),
            clean_session: false,
            inflight_window: d_window(),
            max_payload_bytes: d_maxpayload(),
            max_packet_bytes: d_maxpacket(),
            payload_format: d_format(),
            connect_timeout_secs: d_connect(),
            reconnect_min_ms: d_rmin(),
            reconnect_max_ms: d_rmax(),
            ack_timeout_secs: d_acktimeout(),
            fail_after_disconnects: d_fail_after(),
            status_topic: true,
            protocol: d_protocol(),
            session_expiry_secs: d_session_expiry(),
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            username: None,
            password_file: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    #[serde(default = "d_summary")]
    summary_interval_secs: u64,
}

impl Default for RawAgent {
    fn default() -> Self {
        RawAgent {
            summary_interval_secs: d_summary(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    name: String,
    kind: String,
    /// Not used by kind "mqtt" (readings arrive when published); defaults
    /// to [`d_interval`] for the others.
    interval_ms: Option<u64>,
    path: Option<PathBuf>,
    scale: Option<f64>,
    offset: Option<f64>,
    field: Option<String>,
    program: Option<PathBuf>,
    args: Option<Vec<String>>,
    timeout_ms: Option<u64>,
    max_output_bytes: Option<usize>,
    delimiter: Option<String>,
    decimal_comma: Option<bool>,
    missing: Option<Vec<String>>,
    timestamp_columns: Option<Vec<String>>,
    timestamp_format: Option<String>,
    columns: Option<std::collections::BTreeMap<String, String>>,
    speed: Option<f64>,
    repeat: Option<bool>,
    follow: Option<bool>,
    timezone: Option<String>,
    trace_id: Option<String>,
    durability: Option<String>,
    // kind = "mqtt" (the local-broker bridge).
    url: Option<String>,
    topics: Option<Vec<String>>,
    qos: Option<u8>,
    client_id: Option<String>,
    username: Option<String>,
    password_file: Option<PathBuf>,
    payload: Option<String>,
    id_field: Option<String>,
    max_payload_bytes: Option<usize>,
}

fn d_sync() -> String {
    "normal".into()
}
fn d_busy() -> u64 {
    5000
}
fn d_jsl() -> i64 {
    4 * 1024 * 1024
}
fn d_autockpt() -> i64 {
    // The agent owns checkpoints (maintenance::checkpoint_due).
    0
}
fn d_commit() -> u64 {
    200
}
fn d_retention() -> u64 {
    86_400
}
fn d_purge() -> usize {
    5000
}
fn d_ckpt() -> u64 {
    30
}
fn d_url() -> String {
    "mqtt://127.0.0.1:1883".into()
}
fn d_keepalive() -> u64 {
    30
}
fn d_window() -> usize {
    32
}
fn d_fail_after() -> u32 {
    3
}
fn d_maxpayload() -> usize {
    64 * 1024
}
fn d_maxpacket() -> usize {
    crate::mqtt::PROTOCOL_MAX_PACKET
}
/// Smallest `mqtt.max_packet_bytes`: mosquitto refuses a `max_packet_size`
/// under 20; 128 leaves room for a topic and a small reading.
const MIN_PACKET_BYTES: usize = 128;
fn d_format() -> String {
    "json".into()
}
fn d_connect() -> u64 {
    10
}
fn d_rmin() -> u64 {
    500
}
fn d_rmax() -> u64 {
    30_000
}
fn d_acktimeout() -> u64 {
    30
}
fn d_summary() -> u64 {
    60
}
fn d_interval() -> u64 {
    10_000
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

fn single(origin: &str, key: &str, line: Option<usize>, msg: &str) -> ConfigError {
    ConfigError {
        origin: origin.to_owned(),
        problems: vec![Problem {
            key: key.to_owned(),
            line,
            message: msg.to_owned(),
        }],
    }
}

fn line_of(text: &str, offset: Option<usize>) -> Option<usize> {
    offset.map(|o| text[..o.min(text.len())].matches('\n').count() + 1)
}

fn deserialize(text: &str, origin: &str, with_lines: bool) -> Result<RawConfig, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| {
        let line = if with_lines {
            line_of(text, e.span().map(|s| s.start))
        } else {
            None
        };
        single(origin, "(syntax)", line, e.message().trim())
    })?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let inner = e.inner();
        let line = if with_lines {
            line_of(text, inner.span().map(|s| s.start))
        } else {
            None
        };
        let msg = inner.message().trim().to_owned();
        let mut key = path_string(e.path());
        // serde_path_to_error already ends the path with the unknown key;
        // make sure it is there even if a future version stops at the table.
        let msg = match unknown_field(&msg) {
            Some((field, expected)) => {
                if key.is_empty() {
                    key = field.clone();
                } else if !key.ends_with(&field) {
                    key = format!("{key}.{field}");
                }
                match did_you_mean(&field, &expected) {
                    Some(s) => format!(
                        "unknown key; did you mean `{s}`? (known keys: {})",
                        expected.join(", ")
                    ),
                    None => format!("unknown key (known keys: {})", expected.join(", ")),
                }
            }
            None => {
                if let Some(field) = msg
                    .strip_prefix("missing field `")
                    .and_then(|r| r.split_once('`'))
                    .map(|(f, _)| f.to_owned())
                {
                    key = if key.is_empty() {
                        field
                    } else {
                        format!("{key}.{field}")
                    };
                    "required key is missing".to_owned()
                } else {
                    msg
                }
            }
        };
        single(origin, &key, line, &msg)
    })
}

/// The line (1-based) where `key` (`a.b`, `sources[2].c`, `device_id`) is
/// written in `text`, found by following table headers. `None` when the key
/// is not written (a missing key or a default).
fn locate(text: &str, key: &str) -> Option<usize> {
    let (table, index, leaf) = match key.rsplit_once('.') {
        Some((t, leaf)) => match t.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok(), leaf),
            None => (t, None, leaf),
        },
        None => ("", None, key),
    };
    let mut current = String::new();
    let mut counts: std::collections::HashMap<String, usize> = Default::default();
    let mut current_index: Option<usize> = None;
    for (n, raw_line) in text.lines().enumerate() {
        let line = raw_line.trim();
        if let Some(h) = line
            .strip_prefix("[[")
            .and_then(|l| l.split_once("]]"))
            .map(|(h, _)| h.trim())
        {
            let c = counts.entry(h.to_owned()).or_insert(0);
            current = h.to_owned();
            current_index = Some(*c);
            *c += 1;
            continue;
        }
        if let Some(h) = line
            .strip_prefix('[')
            .and_then(|l| l.split_once(']'))
            .map(|(h, _)| h.trim())
        {
            current = h.to_owned();
            current_index = None;
            continue;
        }
        let in_table = current == table && (index.is_none() || index == current_index);
        if in_table {
            if let Some(rest) = line.strip_prefix(leaf) {
                if rest.trim_start().starts_with('=') {
                    return Some(n + 1);
                }
            }
        }
    }
    None
}

fn path_string(p: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut s = String::new();
    for seg in p.iter() {
        match seg {
            Segment::Seq { index } => s.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    s
}

/// Split serde's standard "unknown field `x`, expected one of `a`, `b`" message.
fn unknown_field(msg: &str) -> Option<(String, Vec<String>)> {
    let rest = msg.strip_prefix("unknown field `")?;
    let (field, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect();
    Some((field.to_owned(), expected))
}

/// The closest known key within a small edit distance, if any.
fn did_you_mean(got: &str, known: &[String]) -> Option<String> {
    known
        .iter()
        .map(|k| (edit_distance(got, k), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.clone())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Set `key.path=value` in `table`. Path segments are table keys or array
/// indexes (`sources.0.interval_ms`).
fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (path, value) = spec
        .split_once('=')
        .ok_or_else(|| "expected key.path=value".to_owned())?;
    let path = path.trim();
    let value = value.trim();
    let parsed: toml::Value = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_owned()));
    let segs: Vec<&str> = path.split('.').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return Err(format!("bad key path {path:?}"));
    }
    let mut root = toml::Value::Table(std::mem::take(table));
    let res = set_path(&mut root, &segs, parsed, path);
    if let toml::Value::Table(t) = root {
        *table = t;
    }
    res
}

fn set_path(
    cur: &mut toml::Value,
    segs: &[&str],
    value: toml::Value,
    path: &str,
) -> Result<(), String> {
    let Some((seg, rest)) = segs.split_first() else {
        *cur = value;
        return Ok(());
    };
    let next = match cur {
        toml::Value::Table(t) => t
            .entry((*seg).to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new())),
        toml::Value::Array(a) => {
            let idx: usize = seg
                .parse()
                .map_err(|_| format!("{path}: `{seg}` is not an array index"))?;
            let len = a.len();
            a.get_mut(idx)
                .ok_or_else(|| format!("{path}: index {idx} out of range (array has {len})"))?
        }
        _ => return Err(format!("{path}: `{seg}` is not inside a table or array")),
    };
    set_path(next, rest, value, path)
}

fn validate(raw: RawConfig, origin: &str) -> Result<Config, ConfigError> {
    let mut probs: Vec<Problem> = Vec::new();
    let mut bad = |key: &str, msg: String| {
        probs.push(Problem {
            key: key.to_owned(),
            line: None,
            message: msg,
        })
    };

    let device_id = raw.device_id.trim().to_owned();
    if device_id.is_empty() || device_id.len() > 64 || !device_id.chars().all(topic_safe) {
        bad(
            "device_id",
            format!(
                "must be non-empty letters, digits, '-', '_' or '.' (got {:?})",
                raw.device_id
            ),
        );
    }

    let s = &raw.spool;
    if s.path.as_os_str().is_empty() || s.path.as_os_str().as_encoded_bytes().contains(&0) {
        bad(
            "spool.path",
            format!(
                "must be a non-empty path without NUL bytes (got {:?})",
                s.path
            ),
        );
    }
    if s.acked_retention_secs > TEN_YEARS_SECS {
        bad(
            "spool.acked_retention_secs",
            format!(
                "must be at most {TEN_YEARS_SECS} (ten years) (got {})",
                s.acked_retention_secs
            ),
        );
    }
    let synchronous = match s.synchronous.to_ascii_lowercase().as_str() {
        "normal" => Synchronous::Normal,
        "full" => Synchronous::Full,
        other => {
            bad(
                "spool.synchronous",
                format!("must be \"normal\" or \"full\" (got {other:?}); OFF is never allowed"),
            );
            Synchronous::Normal
        }
    };
    if s.busy_timeout_ms < 5000 {
        bad(
            "spool.busy_timeout_ms",
            format!("must be at least 5000 (got {})", s.busy_timeout_ms),
        );
    }
    if s.journal_size_limit_bytes < 0 {
        bad(
            "spool.journal_size_limit_bytes",
            format!("must be >= 0 (got {})", s.journal_size_limit_bytes),
        );
    }
    if s.wal_autocheckpoint_pages < 0 {
        bad(
            "spool.wal_autocheckpoint_pages",
            format!("must be >= 0 (got {})", s.wal_autocheckpoint_pages),
        );
    }
    let commit_window_ms = s.commit_window_ms.unwrap_or_else(d_commit);
    if !(1..=60_000).contains(&commit_window_ms) {
        bad(
            "spool.commit_window_ms",
            format!("must be 1..=60000 (got {commit_window_ms})"),
        );
    }
    if !(1..=100_000).contains(&s.purge_batch_rows) {
        bad(
            "spool.purge_batch_rows",
            format!("must be 1..=100000 (got {})", s.purge_batch_rows),
        );
    }
    if s.max_bytes != 0 && s.max_bytes < 1024 * 1024 {
        bad(
            "spool.max_bytes",
            format!(
                "must be 0 (no limit) or at least 1048576 (got {})",
                s.max_bytes
            ),
        );
    }
    let checkpoint_wal_bytes = s.checkpoint_wal_bytes.unwrap_or_else(d_ckpt_wal);
    if !(64 * 1024..=1024 * 1024 * 1024).contains(&checkpoint_wal_bytes) {
        bad(
            "spool.checkpoint_wal_bytes",
            format!("must be 65536..=1073741824 (got {checkpoint_wal_bytes})"),
        );
    }
    if !(1..=86_400).contains(&s.checkpoint_interval_secs) {
        bad(
            "spool.checkpoint_interval_secs",
            format!("must be 1..=86400 (got {})", s.checkpoint_interval_secs),
        );
    }

    let m = &raw.mqtt;
    let (host, port, use_tls) = match parse_url(&m.url) {
        Ok(hp) => hp,
        Err(e) => {
            bad("mqtt.url", format!("{e} (got {:?})", m.url));
            (String::new(), 0, false)
        }
    };
    let tls = if use_tls {
        match (&m.ca_file, &m.client_cert_file, &m.client_key_file) {
            (None, _, _) => {
                bad(
                    "mqtt.ca_file",
                    "required with mqtts:// (PEM CA certificate of the broker)".into(),
                );
                None
            }
            (Some(ca), Some(c), Some(k)) => Some(TlsFiles {
                ca_file: ca.clone(),
                client: Some((c.clone(), k.clone())),
            }),
            (Some(ca), None, None) => Some(TlsFiles {
                ca_file: ca.clone(),
                client: None,
            }),
            (Some(_), c, _) => {
                let missing = if c.is_none() {
                    "mqtt.client_cert_file"
                } else {
                    "mqtt.client_key_file"
                };
                bad(
                    missing,
                    "client_cert_file and client_key_file go together".into(),
                );
                None
            }
        }
    } else {
        for (key, set) in [
            ("ca_file", m.ca_file.is_some()),
            ("client_cert_file", m.client_cert_file.is_some()),
            ("client_key_file", m.client_key_file.is_some()),
        ] {
            if set {
                bad(
                    &format!("mqtt.{key}"),
                    "only used with an mqtts:// url".into(),
                );
            }
        }
        None
    };
    let credentials = match (&m.username, &m.password_file) {
        (Some(u), p) => Some((u.clone(), p.clone())),
        (None, Some(_)) => {
            bad("mqtt.password_file", "needs mqtt.username".into());
            None
        }
        (None, None) => None,
    };
    let client_id = m
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edgespool-{device_id}"));
    if client_id.is_empty() || client_id.len() > 128 {
        bad(
            "mqtt.client_id",
            format!("must be 1..=128 bytes (got {client_id:?})"),
        );
    }
    let topic_prefix = m
        .topic_prefix
        .clone()
        .unwrap_or_else(|| format!("edgespool/{device_id}"));
    if topic_prefix.is_empty()
        || topic_prefix.contains(['#', '+', '\0'])
        || topic_prefix.starts_with('/')
        || topic_prefix.ends_with('/')
    {
        bad("mqtt.topic_prefix", format!("must be a non-empty topic without wildcards or leading/trailing '/' (got {topic_prefix:?})"));
    }
    if !(5..=3600).contains(&m.keep_alive_secs) {
        bad(
            "mqtt.keep_alive_secs",
            format!("must be 5..=3600 (got {})", m.keep_alive_secs),
        );
    }
    if !(1..MAX_WINDOW).contains(&m.inflight_window) {
        bad(
            "mqtt.inflight_window",
            format!("must be 1..={} (got {})", MAX_WINDOW - 1, m.inflight_window),
        );
    }
    if !(1024..=256 * 1024 * 1024).contains(&m.max_payload_bytes) {
        bad(
            "mqtt.max_payload_bytes",
            format!("must be 1024..=268435456 (got {})", m.max_payload_bytes),
        );
    }
    if !(MIN_PACKET_BYTES..=crate::mqtt::PROTOCOL_MAX_PACKET).contains(&m.max_packet_bytes) {
        bad(
            "mqtt.max_packet_bytes",
            format!(
                "must be {MIN_PACKET_BYTES}..={} (got {})",
                crate::mqtt::PROTOCOL_MAX_PACKET,
                m.max_packet_bytes
            ),
        );
    }
    let protocol = match m.protocol.as_str() {
        "5" | "5.0" => Protocol::V5,
        "3.1.1" => Protocol::V311,
        other => {
            bad(
                "mqtt.protocol",
                format!("must be \"5\" or \"3.1.1\" (got {other:?})"),
            );
            Protocol::V5
        }
    };
    let payload_format = match m.payload_format.as_str() {
        "json" => Format::Json,
        "postcard" => Format::Postcard,
        other => {
            bad(
                "mqtt.payload_format",
                format!("must be \"json\" or \"postcard\" (got {other:?})"),
            );
            Format::Json
        }
    };
    if !(1..=300).contains(&m.connect_timeout_secs) {
        bad(
            "mqtt.connect_timeout_secs",
            format!("must be 1..=300 (got {})", m.connect_timeout_secs),
        );
    }
    if m.reconnect_min_ms == 0 || m.reconnect_min_ms > m.reconnect_max_ms {
        bad(
            "mqtt.reconnect_min_ms",
            format!(
                "must be >= 1 and <= mqtt.reconnect_max_ms (got {} and {})",
                m.reconnect_min_ms, m.reconnect_max_ms
            ),
        );
    }
    if m.reconnect_max_ms > 3_600_000 {
        bad(
            "mqtt.reconnect_max_ms",
            format!("must be <= 3600000 (got {})", m.reconnect_max_ms),
        );
    }
    if !(1..=100).contains(&m.fail_after_disconnects) {
        bad(
            "mqtt.fail_after_disconnects",
            format!("must be 1..=100 (got {})", m.fail_after_disconnects),
        );
    }
    if !(1..=3600).contains(&m.ack_timeout_secs) {
        bad(
            "mqtt.ack_timeout_secs",
            format!("must be 1..=3600 (got {})", m.ack_timeout_secs),
        );
    }
    if !(1..=86_400).contains(&raw.agent.summary_interval_secs) {
        bad(
            "agent.summary_interval_secs",
            format!(
                "must be 1..=86400 (got {})",
                raw.agent.summary_interval_secs
            ),
        );
    }

    let mut sources = Vec::new();
    let mut names = std::collections::HashSet::new();
    let mut bridge_ids = std::collections::HashSet::new();
    for (i, rs) in raw.sources.iter().enumerate() {
        let k = |f: &str| format!("sources[{i}].{f}");
        if !stream_name_ok(&rs.name) {
            bad(&k("name"), format!("must be 1..=64 letters, digits, '-', '_' or '.', not starting with '_' (got {:?})", rs.name));
        } else if !names.insert(rs.name.clone()) {
            bad(&k("name"), format!("duplicate source name {:?}", rs.name));
        }
        let interval_ms = rs.interval_ms.unwrap_or_else(d_interval);
        if !(10..=86_400_000).contains(&interval_ms) {
            bad(
                &k("interval_ms"),
                format!("must be 10..=86400000 (got {interval_ms})"),
            );
        }
        // Which kinds each optional key belongs to; a key set for another
        // kind is an error naming it, never silently ignored (F16).
        const FILE: &[&str] = &["file"];
        const EXEC: &[&str] = &["exec"];
        const REPLAY: &[&str] = &["replay"];
        const MQTT: &[&str] = &["mqtt"];
        let all_but_mqtt: &[&str] = &["system", "file", "exec", "replay"];
        let owners: [(&str, bool, &[&str]); 29] = [
            ("interval_ms", rs.interval_ms.is_some(), all_but_mqtt),
            ("url", rs.url.is_some(), MQTT),
            ("topics", rs.topics.is_some(), MQTT),
            ("qos", rs.qos.is_some(), MQTT),
            ("client_id", rs.client_id.is_some(), MQTT),
            ("username", rs.username.is_some(), MQTT),
            ("password_file", rs.password_file.is_some(), MQTT),
            ("payload", rs.payload.is_some(), MQTT),
            ("id_field", rs.id_field.is_some(), MQTT),
            ("max_payload_bytes", rs.max_payload_bytes.is_some(), MQTT),
            ("path", rs.path.is_some(), &["file", "replay"]),
            ("scale", rs.scale.is_some(), FILE),
            ("offset", rs.offset.is_some(), FILE),
            ("field", rs.field.is_some(), &["file", "exec"]),
            ("program", rs.program.is_some(), EXEC),
            ("args", rs.args.is_some(), EXEC),
            ("timeout_ms", rs.timeout_ms.is_some(), EXEC),
            ("max_output_bytes", rs.max_output_bytes.is_some(), EXEC),
            ("delimiter", rs.delimiter.is_some(), REPLAY),
            ("decimal_comma", rs.decimal_comma.is_some(), REPLAY),
            ("missing", rs.missing.is_some(), REPLAY),
            ("timestamp_columns", rs.timestamp_columns.is_some(), REPLAY),
            ("timestamp_format", rs.timestamp_format.is_some(), REPLAY),
            ("columns", rs.columns.is_some(), REPLAY),
            ("speed", rs.speed.is_some(), REPLAY),
            ("repeat", rs.repeat.is_some(), REPLAY),
            ("follow", rs.follow.is_some(), REPLAY),
            ("timezone", rs.timezone.is_some(), REPLAY),
            ("trace_id", rs.trace_id.is_some(), REPLAY),
        ];
        if ["system", "file", "exec", "replay", "mqtt"].contains(&rs.kind.as_str()) {
            for (f, present, kinds) in owners {
                if present && !kinds.contains(&rs.kind.as_str()) {
                    bad(&k(f), format!("not used by kind {:?}", rs.kind));
                }
            }
        }
        let kind = match rs.kind.as_str() {
            "replay" => {
                let delimiter = rs.delimiter.clone().unwrap_or_else(|| ",".into());
                let mut chars = delimiter.chars();
                let delim = match (chars.next(), chars.next()) {
                    (Some(c), None) if c.is_ascii() && !matches!(c, '\n' | '\r' | '"') => c,
                    _ => {
                        bad(
                            &k("delimiter"),
                            format!("must be one ASCII character other than a quote or a line break (got {delimiter:?})"),
                        );
                        ','
                    }
                };
                let follow = rs.follow.unwrap_or(false);
                if follow && rs.repeat == Some(true) {
                    bad(
                        &k("follow"),
                        "follow = true cannot be combined with repeat = true: a followed file has no end to start over from".into(),
                    );
                }
                if follow && rs.speed.is_some() {
                    bad(
                        &k("speed"),
                        "not used with follow = true: a followed file's rows are played as they are written".into(),
                    );
                }
                let speed = rs.speed.unwrap_or(if follow { 0.0 } else { 1.0 });
                if !speed.is_finite() || speed < 0.0 {
                    bad(&k("speed"), format!("must be >= 0 (trace seconds per second; 0 = as fast as interval_ms allows) (got {speed})"));
                }
                let format = rs.timestamp_format.clone().unwrap_or_default();
                let timezone = rs.timezone.clone().unwrap_or_else(|| "UTC".into());
                if let Err(e) = crate::source::replay::parse_timezone(&timezone) {
                    bad(&k("timezone"), e);
                } else if let Err(e) = crate::source::replay::TsFormat::compile(&format, &timezone)
                {
                    bad(&k("timestamp_format"), format!("{e} (got {format:?})"));
                }
                if let Some(id) = &rs.trace_id {
                    if id.is_empty() || id.len() > 128 || id.chars().any(char::is_control) {
                        bad(
                            &k("trace_id"),
                            format!("must be 1..=128 printable characters (got {id:?})"),
                        );
                    }
                }
                let ts_cols = rs.timestamp_columns.clone().unwrap_or_default();
                if ts_cols.is_empty() {
                    bad(
                        &k("timestamp_columns"),
                        "required for kind \"replay\": the column(s) holding each row's time"
                            .into(),
                    );
                }
                match &rs.path {
                    Some(p) => Some(SourceKind::Replay(crate::source::replay::ReplaySpec {
                        path: p.clone(),
                        delimiter: delim,
                        decimal_comma: rs.decimal_comma.unwrap_or(false),
                        missing: rs.missing.clone().unwrap_or_default(),
                        timestamp_columns: ts_cols,
                        timestamp_format: format,
                        timezone,
                        trace_id: rs.trace_id.clone(),
                        columns: rs.columns.clone().unwrap_or_default().into_iter().collect(),
                        speed,
                        max_rows_per_call: 1000,
                        repeat: rs.repeat.unwrap_or(false),
                        follow,
                    })),
                    None => {
                        bad(&k("path"), "required for kind \"replay\"".into());
                        None
                    }
                }
            }
            "system" => Some(SourceKind::System),
            "mqtt" => validate_bridge(rs, &device_id, &k, &mut bad).map(SourceKind::Mqtt),
            "file" => {
                let scale = rs.scale.unwrap_or(1.0);
                let offset = rs.offset.unwrap_or(0.0);
                if !scale.is_finite() || !offset.is_finite() {
                    bad(
                        &k("scale"),
                        format!("scale and offset must be finite (got {scale}, {offset})"),
                    );
                }
                match &rs.path {
                    Some(p) => Some(SourceKind::File {
                        path: p.clone(),
                        scale,
                        offset,
                        field: rs.field.clone().unwrap_or_else(|| "value".into()),
                    }),
                    None => {
                        bad(&k("path"), "required for kind \"file\"".into());
                        None
                    }
                }
            }
            "exec" => {
                let timeout = rs.timeout_ms.unwrap_or(5000);
                if !(10..=600_000).contains(&timeout) {
                    bad(
                        &k("timeout_ms"),
                        format!("must be 10..=600000 (got {timeout})"),
                    );
                }
                let max_out = rs.max_output_bytes.unwrap_or(64 * 1024);
                if !(16..=16 * 1024 * 1024).contains(&max_out) {
                    bad(
                        &k("max_output_bytes"),
                        format!("must be 16..=16777216 (got {max_out})"),
                    );
                }
                match &rs.program {
                    Some(p) if p.is_absolute() => Some(SourceKind::Exec {
                        program: p.clone(),
                        args: rs.args.clone().unwrap_or_default(),
                        timeout: Duration::from_millis(timeout),
                        field: rs.field.clone().unwrap_or_else(|| "value".into()),
                        max_output_bytes: max_out,
                    }),
                    Some(p) => {
                        bad(&k("program"), format!("must be an absolute path; no shell or PATH lookup is used (got {p:?})"));
                        None
                    }
                    None => {
                        bad(&k("program"), "required for kind \"exec\"".into());
                        None
                    }
                }
            }
            other => {
                let known = [
                    "system".to_owned(),
                    "file".to_owned(),
                    "exec".to_owned(),
                    "replay".to_owned(),
                    "mqtt".to_owned(),
                ];
                let hint = did_you_mean(other, &known)
                    .map(|s| format!("; did you mean {s:?}?"))
                    .unwrap_or_default();
                bad(
                    &k("kind"),
                    format!("must be \"system\", \"file\", \"exec\", \"replay\" or \"mqtt\" (got {other:?}){hint}"),
                );
                None
            }
        };
        let durability = match rs.durability.as_deref() {
            None | Some("batched") => crate::source::Durability::Batched,
            Some("full") => crate::source::Durability::Full,
            Some(other) => {
                bad(
                    &k("durability"),
                    format!("must be \"batched\" or \"full\" (got {other:?})"),
                );
                crate::source::Durability::Batched
            }
        };
        if let Some(SourceKind::Mqtt(b)) = &kind {
            let same_broker = b.host == host && b.port == port;
            if !bridge_ids.insert(b.client_id.clone()) || (same_broker && b.client_id == client_id)
            {
                // Two sessions under one client id take each other's place at every connect.
                bad(
                    &k("client_id"),
                    format!(
                        "{:?} is already the client id of another connection to that broker",
                        b.client_id
                    ),
                );
            }
            let own = format!("{topic_prefix}/events/{}", rs.name);
            if let Some(t) = b
                .topics
                .iter()
                .find(|t| same_broker && crate::source::bridge::filter_matches(t, &own))
            {
                bad(
                    &k("topics"),
                    format!(
                        "{t:?} takes this source's own events ({own}) back from mqtt.url: a loop"
                    ),
                );
            }
        }
        if let Some(kind) = kind {
            sources.push(SourceSpec {
                name: rs.name.clone(),
                interval: Duration::from_millis(interval_ms),
                kind,
                durability,
            });
        }
    }

    let rc = &raw.commands;
    if !(256..=1024 * 1024).contains(&rc.max_payload_bytes) {
        bad(
            "commands.max_payload_bytes",
            format!("must be 256..=1048576 (got {})", rc.max_payload_bytes),
        );
    }
    if rc.record_retention_secs > TEN_YEARS_SECS {
        bad(
            "commands.record_retention_secs",
            format!(
                "must be at most {TEN_YEARS_SECS} (got {})",
                rc.record_retention_secs
            ),
        );
    }
    if rc.record_retention_secs < 3600 {
        bad(
            "commands.record_retention_secs",
            format!(
                "must be at least 3600, longer than any redelivery window (got {})",
                rc.record_retention_secs
            ),
        );
    }
    if !(1000..=1_000_000).contains(&rc.max_records) {
        bad(
            "commands.max_records",
            format!("must be 1000..=1000000 (got {})", rc.max_records),
        );
    }
    if !(1..=10_000).contains(&rc.max_queued) {
        bad(
            "commands.max_queued",
            format!("must be 1..=10000 (got {})", rc.max_queued),
        );
    }
    if !(1..=60_000).contains(&rc.max_per_minute_per_scope) {
        bad(
            "commands.max_per_minute_per_scope",
            format!("must be 1..=60000 (got {})", rc.max_per_minute_per_scope),
        );
    }
    if rc.default_ttl_secs == 0 || rc.default_ttl_secs > rc.record_retention_secs {
        // A command may still run only while its record is sure to exist:
        // past the redelivery window a redelivery could find no record.
        bad(
            "commands.default_ttl_secs",
            format!(
                "must be 1..=commands.record_retention_secs ({}) (got {})",
                rc.record_retention_secs, rc.default_ttl_secs
            ),
        );
    }
    let config_push = validate_push(&rc.config_push, &mut bad);
    let metrics = validate_metrics(&raw.metrics, &mut bad);
    let ingest = validate_ingest(&raw.ingest, &sources, &mut bad);
    let builtin = crate::commands::BUILTINS;
    let mut handlers = Vec::new();
    let mut hnames = std::collections::HashSet::new();
    for (i, h) in rc.handlers.iter().enumerate() {
        let k = |f: &str| format!("commands.handlers[{i}].{f}");
        if h.name.is_empty() || h.name.len() > 64 || !h.name.chars().all(topic_safe) {
            bad(
                &k("name"),
                format!(
                    "must be letters, digits, '-', '_' or '.' (got {:?})",
                    h.name
                ),
            );
        } else if builtin.contains(&h.name.as_str()) {
            bad(&k("name"), format!("{:?} is a built-in command", h.name));
        } else if !hnames.insert(h.name.clone()) {
            bad(&k("name"), format!("duplicate handler name {:?}", h.name));
        }
        if !h.program.is_absolute() {
            bad(
                &k("program"),
                format!(
                    "must be an absolute path; no shell or PATH lookup is used (got {:?})",
                    h.program
                ),
            );
        }
        if !(10..=3_600_000).contains(&h.timeout_ms) {
            bad(
                &k("timeout_ms"),
                format!("must be 10..=3600000 (got {})", h.timeout_ms),
            );
        }
        if !(16..=1024 * 1024).contains(&h.max_output_bytes) {
            bad(
                &k("max_output_bytes"),
                format!("must be 16..=1048576 (got {})", h.max_output_bytes),
            );
        }
        let mut params = Vec::new();
        for (pname, p) in &h.params {
            let pk = format!("commands.handlers[{i}].params.{pname}");
            if pname.is_empty() || !pname.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                bad(&pk, "parameter names are letters, digits and '_'".into());
            }
            let kind = match p.kind.as_str() {
                "int" => {
                    let (min, max) = (
                        p.min.unwrap_or(i64::MIN as f64),
                        p.max.unwrap_or(i64::MAX as f64),
                    );
                    if min > max {
                        bad(&format!("{pk}.min"), format!("min {min} > max {max}"));
                    }
                    ParamKind::Int {
                        min: min as i64,
                        max: max as i64,
                    }
                }
                "float" => {
                    let (min, max) = (p.min.unwrap_or(f64::MIN), p.max.unwrap_or(f64::MAX));
                    if min > max || !min.is_finite() || !max.is_finite() {
                        bad(
                            &format!("{pk}.min"),
                            format!("need finite min <= max (got {min}, {max})"),
                        );
                    }
                    ParamKind::Float { min, max }
                }
                "string" => ParamKind::Str {
                    max_len: p.max_len.unwrap_or(64).clamp(1, 1024),
                },
                "enum" => match &p.values {
                    Some(v) if !v.is_empty() => ParamKind::Enum { values: v.clone() },
                    _ => {
                        bad(
                            &format!("{pk}.values"),
                            "enum needs a non-empty values list".into(),
                        );
                        ParamKind::Enum { values: vec![] }
                    }
                },
                "bool" => ParamKind::Bool,
                other => {
                    bad(
                        &format!("{pk}.type"),
                        format!("must be int, float, string, enum or bool (got {other:?})"),
                    );
                    ParamKind::Bool
                }
            };
            params.push(ParamSpec {
                name: pname.clone(),
                kind,
                required: p.required,
            });
        }
        for a in &h.args {
            for placeholder in placeholders(a) {
                if !h.params.contains_key(&placeholder) {
                    bad(
                        &k("args"),
                        format!("{{{placeholder}}} names no declared parameter"),
                    );
                }
            }
        }
        for problem in check_env(&h.env) {
            bad(&k("env"), problem);
        }
        let cwd = h.cwd.clone().unwrap_or_else(|| PathBuf::from(HANDLER_CWD));
        if let Err(problem) = check_cwd(&cwd) {
            bad(&k("cwd"), problem);
        }
        // The default follows the timeout, whose own range is checked above.
        let cpu_secs = h.cpu_secs.unwrap_or_else(|| default_cpu_secs(h.timeout_ms));
        if h.cpu_secs.is_some() && !(1..=86_400).contains(&cpu_secs) {
            bad(
                &k("cpu_secs"),
                format!("must be 1..=86400 seconds (got {cpu_secs})"),
            );
        }
        if !(MIN_HANDLER_MEMORY..=MAX_HANDLER_MEMORY).contains(&h.max_memory_bytes) {
            bad(
                &k("max_memory_bytes"),
                format!(
                    "must be {MIN_HANDLER_MEMORY}..={MAX_HANDLER_MEMORY} bytes (got {})",
                    h.max_memory_bytes
                ),
            );
        }
        if !(8..=1_048_576).contains(&h.max_open_files) {
            bad(
                &k("max_open_files"),
                format!("must be 8..=1048576 (got {})", h.max_open_files),
            );
        }
        let credentials = match resolve_credentials(
            h.user.as_deref(),
            h.group.as_deref(),
            crate::process::can_switch_user(),
            crate::process::lookup_user,
            crate::process::lookup_group,
        ) {
            Ok(c) => c,
            Err(problems) => {
                for (field, problem) in problems {
                    bad(&k(field), problem);
                }
                None
            }
        };
        handlers.push(ExecHandler {
            name: h.name.clone(),
            program: h.program.clone(),
            args: h.args.clone(),
            timeout: Duration::from_millis(h.timeout_ms),
            max_output_bytes: h.max_output_bytes,
            retry_safe: h.retry_safe,
            params,
            env: h.env.clone(),
            cwd,
            limits: Limits {
                cpu_secs,
                max_memory_bytes: h.max_memory_bytes,
                max_open_files: h.max_open_files,
            },
            credentials,
        });
    }

    if !probs.is_empty() {
        return Err(ConfigError {
            origin: origin.to_owned(),
            problems: probs,
        });
    }
    Ok(Config {
        device_id,
        spool: SpoolConfig {
            path: s.path.clone(),
            options: SpoolOptions {
                synchronous,
                busy_timeout: Duration::from_millis(s.busy_timeout_ms),
                journal_size_limit_bytes: s.journal_size_limit_bytes,
                wal_autocheckpoint_pages: s.wal_autocheckpoint_pages,
            },
            commit_window: Duration::from_millis(commit_window_ms),
            acked_retention: Duration::from_secs(s.acked_retention_secs),
            purge_batch_rows: s.purge_batch_rows,
            checkpoint_interval: Duration::from_secs(s.checkpoint_interval_secs),
            allow_network_fs: s.allow_network_fs,
            capacity: crate::maintenance::Capacity {
                max_bytes: s.max_bytes,
                min_free_bytes: s.min_free_bytes,
            },
            checkpoint_wal_bytes,
            tune_from_probe: s.tune_from_probe,
            explicit: ExplicitKeys {
                commit_window: s.commit_window_ms.is_some(),
                checkpoint_wal_bytes: s.checkpoint_wal_bytes.is_some(),
            },
        },
        mqtt: MqttConfig {
            tls,
            credentials,
            host,
            port,
            client_id,
            topic_prefix,
            keep_alive: Duration::from_secs(m.keep_alive_secs),
            clean_session: m.clean_session,
            inflight_window: m.inflight_window,
            max_payload_bytes: m.max_payload_bytes,
            max_packet_bytes: m.max_packet_bytes,
            payload_format,
            connect_timeout: Duration::from_secs(m.connect_timeout_secs),
            reconnect_min: Duration::from_millis(m.reconnect_min_ms),
            reconnect_max: Duration::from_millis(m.reconnect_max_ms),
            ack_timeout: Duration::from_secs(m.ack_timeout_secs),
            fail_after_disconnects: m.fail_after_disconnects,
            status_topic: m.status_topic,
            protocol,
            session_expiry_secs: m.session_expiry_secs,
        },
        agent: AgentConfig {
            summary_interval: Duration::from_secs(raw.agent.summary_interval_secs),
        },
        sources,
        commands: CommandsConfig {
            enabled: rc.enabled,
            max_payload_bytes: rc.max_payload_bytes,
            record_retention: Duration::from_secs(rc.record_retention_secs),
            max_records: rc.max_records,
            max_queued: rc.max_queued,
            max_per_minute_per_scope: rc.max_per_minute_per_scope,
            default_ttl: Duration::from_secs(rc.default_ttl_secs),
            handlers,
            config_push,
        },
        metrics,
        ingest,
    })
}

/// `kind = "mqtt"`: the local-broker bridge ([`crate::source::bridge`]).
/// `url` mqtt://host[:port] (no TLS: the broker is local), `topics` valid
/// filters (MQTT 3.1.1 §4.7), `qos` 1 (0 and 2 refused, each saying why), `client_id` 1..=128 bytes,
/// `password_file` only with `username`, `payload` json|number|auto,
/// `max_payload_bytes` 16..=16 MiB. `k` makes the key path of a member.
fn validate_bridge(
    rs: &RawSource,
    device_id: &str,
    k: &impl Fn(&str) -> String,
    bad: &mut impl FnMut(&str, String),
) -> Option<crate::source::bridge::BridgeSpec> {
    use crate::source::bridge::{self, BridgeSpec, PayloadFormat, PayloadSettings};
    let url = rs.url.clone().unwrap_or_else(d_url);
    let addr = match parse_url(&url) {
        Ok((_, _, true)) => {
            bad(&k("url"), format!("must be mqtt://host[:port]: the bridge reads a broker on this board or its LAN, without TLS (got {url:?})"));
            None
        }
        Ok((host, port, false)) => Some((host, port)),
        Err(e) => {
            bad(&k("url"), format!("{e} (got {url:?})"));
            None
        }
    };
    let topics = rs.topics.clone().unwrap_or_default();
    if topics.is_empty() {
        bad(
            &k("topics"),
            "required for kind \"mqtt\": at least one topic filter, e.g. [\"plant/#\"]".into(),
        );
    }
    for (j, t) in topics.iter().enumerate() {
        if let Err(e) = bridge::check_filter(t) {
            bad(&format!("{}[{j}]", k("topics")), format!("{e} (got {t:?})"));
        }
    }
    let qos = match rs.qos.unwrap_or(1) {
        1 => rumqttc::QoS::AtLeastOnce,
        0 => {
            bad(&k("qos"), "0 cannot be made durable: a QoS 0 message is neither queued for the bridge while it is down nor acknowledged after its commit; use 1".into());
            rumqttc::QoS::AtLeastOnce
        }
        2 => {
            // Reproduced against mosquitto 2.0.11: a session left waiting
            // for our PUBCOMP makes rumqttc end every new connection with
            // "unsolicited ack" (it keeps no QoS 2 state across connections).
            bad(&k("qos"), "2 is not offered: rumqttc keeps no QoS 2 state across connections, so a PUBREL the broker resends after a reconnect ends every new connection; use 1 (with id_field for one event per message)".into());
            rumqttc::QoS::AtLeastOnce
        }
        q => {
            bad(&k("qos"), format!("must be 1 (got {q})"));
            rumqttc::QoS::AtLeastOnce
        }
    };
    let client_id = rs
        .client_id
        .clone()
        .unwrap_or_else(|| format!("edgespool-bridge-{device_id}-{}", rs.name));
    if client_id.is_empty() || client_id.len() > 128 {
        bad(
            &k("client_id"),
            format!("must be 1..=128 bytes (got {client_id:?})"),
        );
    }
    let credentials = match (&rs.username, &rs.password_file) {
        (Some(u), p) => Some((u.clone(), p.clone())),
        (None, Some(_)) => {
            bad(&k("password_file"), format!("needs {}", k("username")));
            None
        }
        (None, None) => None,
    };
    let format = match rs.payload.as_deref() {
        None | Some("auto") => PayloadFormat::Auto,
        Some("json") => PayloadFormat::Json,
        Some("number") => PayloadFormat::Number,
        Some(other) => {
            bad(
                &k("payload"),
                format!("must be \"json\", \"number\" or \"auto\" (got {other:?})"),
            );
            PayloadFormat::Auto
        }
    };
    if let Some(id) = &rs.id_field {
        if id.is_empty() || id.len() > 256 {
            bad(
                &k("id_field"),
                format!("must be a member name of 1..=256 bytes (got {id:?})"),
            );
        } else if id == bridge::TOPIC_FIELD {
            bad(
                &k("id_field"),
                format!(
                    "{:?} is the field the bridge writes the topic into",
                    bridge::TOPIC_FIELD
                ),
            );
        }
    }
    let max_payload_bytes = rs.max_payload_bytes.unwrap_or(bridge::DEFAULT_MAX_PAYLOAD);
    if !(16..=16 * 1024 * 1024).contains(&max_payload_bytes) {
        bad(
            &k("max_payload_bytes"),
            format!("must be 16..=16777216 (got {max_payload_bytes})"),
        );
    }
    let (host, port) = addr?;
    Some(BridgeSpec {
        host,
        port,
        topics,
        qos,
        client_id,
        credentials,
        payload: PayloadSettings {
            format,
            max_payload_bytes,
            id_field: rs.id_field.clone(),
        },
    })
}

/// `[metrics]`: an absolute textfile path; a literal `IP:port` to listen on,
/// loopback unless `listen_public` (the listener is attack surface).
fn validate_metrics(raw: &RawMetrics, bad: &mut impl FnMut(&str, String)) -> MetricsConfig {
    if let Some(p) = &raw.textfile {
        let nul = p.as_os_str().as_encoded_bytes().contains(&0);
        if !p.is_absolute() || nul || p.file_name().is_none() {
            bad(
                "metrics.textfile",
                format!("must be an absolute file path without NUL bytes (got {p:?})"),
            );
        }
    }
    let listen = raw.listen.as_deref().and_then(|l| {
        match l.parse::<std::net::SocketAddr>() {
            Ok(a) if a.port() == 0 => {
                bad("metrics.listen", format!("needs a port, 1..=65535 (got {l:?})"));
                None
            }
            Ok(a) if !a.ip().is_loopback() && !raw.listen_public => {
                bad(
                    "metrics.listen",
                    format!("{l:?} is not a loopback address: metrics would be served to other hosts; use 127.0.0.1:<port>, or set metrics.listen_public = true to mean it"),
                );
                None
            }
            Ok(a) => Some(a),
            Err(_) => {
                bad(
                    "metrics.listen",
                    format!("must be IP:port, e.g. \"127.0.0.1:9469\" or \"[::1]:9469\"; host names are not resolved (got {l:?})"),
                );
                None
            }
        }
    });
    if raw.listen_public && raw.listen.is_none() {
        bad(
            "metrics.listen_public",
            "only used with metrics.listen".to_owned(),
        );
    }
    MetricsConfig {
        textfile: raw.textfile.clone(),
        listen,
        listen_public: raw.listen_public,
    }
}

/// `[ingest]`: listeners (a socket path, a loopback `IP:port` unless
/// `tcp_public`), bounds in range, and the streams clients may write: valid
/// names, not a source's stream, no duplicates; patterns `prefix*`.
fn validate_ingest(
    raw: &RawIngest,
    sources: &[SourceSpec],
    bad: &mut impl FnMut(&str, String),
) -> IngestConfig {
    let d = IngestConfig::default();
    if let Some(p) = &raw.socket {
        let nul = p.as_os_str().as_encoded_bytes().contains(&0);
        // sun_path holds 108 bytes with its NUL (unix(7)).
        if !p.is_absolute() || nul || p.file_name().is_none() || p.as_os_str().len() > 107 {
            bad(
                "ingest.socket",
                format!("must be an absolute file path of at most 107 bytes without NUL bytes (got {p:?})"),
            );
        }
    }
    if let Some(g) = &raw.socket_group {
        let name_ok = !g.is_empty()
            && g.len() <= 32
            && g.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !name_ok {
            bad(
                "ingest.socket_group",
                format!("must be a group name or a numeric gid (got {g:?})"),
            );
        }
        if raw.socket.is_none() {
            bad("ingest.socket_group", "only used with ingest.socket".into());
        }
    }
    let socket_mode = match raw.socket_mode.as_deref() {
        None => d.socket_mode,
        Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
            Ok(v) if v <= 0o777 && v & 0o600 == 0o600 && v & 0o002 == 0 => v,
            _ => {
                bad(
                    "ingest.socket_mode",
                    format!("must be octal permission bits with the owner's read and write and without others' write, e.g. \"0660\" (got {m:?})"),
                );
                d.socket_mode
            }
        },
    };
    let tcp = raw.tcp.as_deref().and_then(|l| match l.parse::<std::net::SocketAddr>() {
        Ok(a) if a.port() == 0 => {
            bad("ingest.tcp", format!("needs a port, 1..=65535 (got {l:?})"));
            None
        }
        Ok(a) if !a.ip().is_loopback() && !raw.tcp_public => {
            bad(
                "ingest.tcp",
                format!("{l:?} is not a loopback address: any host could write readings; use 127.0.0.1:<port>, or set ingest.tcp_public = true to mean it"),
            );
            None
        }
        Ok(a) => Some(a),
        Err(_) => {
            bad(
                "ingest.tcp",
                format!("must be IP:port, e.g. \"127.0.0.1:7788\"; host names are not resolved (got {l:?})"),
            );
            None
        }
    });
    if raw.tcp_public && raw.tcp.is_none() {
        bad("ingest.tcp_public", "only used with ingest.tcp".into());
    }
    let mut range = |key: &str, got: Option<usize>, lo: usize, hi: usize, def: usize| match got {
        Some(v) if !(lo..=hi).contains(&v) => {
            bad(key, format!("must be {lo}..={hi} (got {v})"));
            def
        }
        Some(v) => v,
        None => def,
    };
    let max_line_bytes = range(
        "ingest.max_line_bytes",
        raw.max_line_bytes,
        256,
        1 << 20,
        d.max_line_bytes,
    );
    let max_connections = range(
        "ingest.max_connections",
        raw.max_connections,
        1,
        1024,
        d.max_connections,
    );
    let max_fields = range("ingest.max_fields", raw.max_fields, 1, 1024, d.max_fields);
    let max_rate_per_sec = range(
        "ingest.max_rate_per_sec",
        raw.max_rate_per_sec.map(|v| v as usize),
        1,
        1_000_000,
        d.max_rate_per_sec as usize,
    ) as u32;
    let streams = validate_ingest_streams(raw, sources, bad);
    IngestConfig {
        socket: raw.socket.clone(),
        socket_group: raw.socket_group.clone(),
        socket_mode,
        tcp,
        tcp_public: raw.tcp_public,
        max_line_bytes,
        max_connections,
        max_rate_per_sec,
        max_fields,
        streams,
        stream_patterns: raw.stream_patterns.clone(),
    }
}

/// `[[ingest.streams]]` and `ingest.stream_patterns`: valid names, not a
/// source's stream, no duplicates; patterns `prefix*`; and a listener to go
/// with them (and streams to go with a listener).
fn validate_ingest_streams(
    raw: &RawIngest,
    sources: &[SourceSpec],
    bad: &mut impl FnMut(&str, String),
) -> Vec<IngestStream> {
    let enabled = raw.socket.is_some() || raw.tcp.is_some();
    let mut streams = Vec::new();
    let mut names = std::collections::HashSet::new();
    let is_source = |n: &str| sources.iter().any(|s| s.name == n);
    for (i, rs) in raw.streams.iter().enumerate() {
        let k = |f: &str| format!("ingest.streams[{i}].{f}");
        if !stream_name_ok(&rs.name) {
            bad(&k("name"), format!("must be 1..=64 letters, digits, '-', '_' or '.', not starting with '_' (got {:?})", rs.name));
            continue;
        }
        if is_source(&rs.name) {
            bad(
                &k("name"),
                format!(
                    "{:?} is a source's stream; give clients a stream of their own",
                    rs.name
                ),
            );
        } else if !names.insert(rs.name.clone()) {
            bad(&k("name"), format!("duplicate ingest stream {:?}", rs.name));
        }
        let durability = match rs.durability.as_deref() {
            None | Some("batched") => crate::source::Durability::Batched,
            Some("full") => crate::source::Durability::Full,
            Some(other) => {
                bad(
                    &k("durability"),
                    format!("must be \"batched\" or \"full\" (got {other:?})"),
                );
                crate::source::Durability::Batched
            }
        };
        streams.push(IngestStream {
            name: rs.name.clone(),
            durability,
            priority: rs.priority.unwrap_or(DEFAULT_STREAM_PRIORITY),
        });
    }
    for (i, p) in raw.stream_patterns.iter().enumerate() {
        let key = format!("ingest.stream_patterns[{i}]");
        let prefix_ok = p
            .strip_suffix('*')
            .is_some_and(|pre| !pre.is_empty() && stream_name_ok(pre));
        if !prefix_ok {
            bad(
                &key,
                format!(
                    "must be a stream-name prefix followed by '*', e.g. \"plant.*\" (got {p:?})"
                ),
            );
        } else if let Some(s) = sources.iter().find(|s| pattern_matches(p, &s.name)) {
            bad(
                &key,
                format!(
                    "{p:?} matches source {:?}; give clients streams of their own",
                    s.name
                ),
            );
        }
    }
    if !enabled && (!raw.streams.is_empty() || !raw.stream_patterns.is_empty()) {
        bad(
            "ingest",
            "streams are declared but no listener: set ingest.socket or ingest.tcp".into(),
        );
    }
    if enabled && raw.streams.is_empty() && raw.stream_patterns.is_empty() {
        bad("ingest.streams", "a listener is set but no stream is declared: add [[ingest.streams]] or ingest.stream_patterns".into());
    }
    streams
}

fn validate_push(raw: &RawConfigPush, bad: &mut impl FnMut(&str, String)) -> ConfigPush {
    use crate::policy::PushMode;
    let mode = match raw.mode.as_str() {
        "off" => PushMode::Off,
        "overlay" => PushMode::Overlay,
        "signed" => PushMode::Signed,
        other => {
            bad(
                "commands.config_push.mode",
                format!("must be \"off\", \"overlay\" or \"signed\" (got {other:?})"),
            );
            PushMode::Off
        }
    };
    if !(5..=3600).contains(&raw.confirm_secs) {
        bad(
            "commands.config_push.confirm_secs",
            format!("must be 5..=3600 (got {})", raw.confirm_secs),
        );
    }
    let mut keys = Vec::new();
    for (i, k) in raw.public_keys.iter().enumerate() {
        match crate::policy::decode_hex(k.trim()).and_then(|b| <[u8; 32]>::try_from(b).ok()) {
            Some(key) => keys.push(key),
            None => bad(
                &format!("commands.config_push.public_keys.{i}"),
                format!("must be an Ed25519 public key, 64 hex digits (got {k:?})"),
            ),
        }
    }
    if mode == PushMode::Signed && raw.public_keys.is_empty() {
        bad(
            "commands.config_push.public_keys",
            "mode \"signed\" needs at least one public key".to_owned(),
        );
    }
    ConfigPush {
        mode,
        confirm: Duration::from_secs(raw.confirm_secs),
        public_keys: keys,
    }
}

/// Smallest `max_memory_bytes` of a handler (16 MiB): below it even a small
/// dynamically linked program may fail to start.
const MIN_HANDLER_MEMORY: u64 = 16 * 1024 * 1024;
/// Largest `max_memory_bytes` of a handler (1 TiB).
const MAX_HANDLER_MEMORY: u64 = 1 << 40;

/// Problems with a handler's `env` table, each naming the variable.
fn check_env(env: &BTreeMap<String, String>) -> Vec<String> {
    let mut problems = Vec::new();
    if env.len() > MAX_ENV_VARS {
        problems.push(format!(
            "at most {MAX_ENV_VARS} variables (got {})",
            env.len()
        ));
    }
    for (name, value) in env {
        if !env_name_ok(name) {
            problems.push(format!(
                "variable names are [A-Z_][A-Z0-9_]*, at most {MAX_ENV_NAME_BYTES} bytes (got {name:?})"
            ));
        }
        if value.contains('\0') {
            problems.push(format!("{name}: the value contains a NUL character"));
        } else if value.len() > MAX_ENV_VALUE_BYTES {
            problems.push(format!(
                "{name}: the value is {} bytes, more than {MAX_ENV_VALUE_BYTES}",
                value.len()
            ));
        }
    }
    problems
}

/// `[A-Z_][A-Z0-9_]*`, not too long.
fn env_name_ok(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_uppercase() || c == '_');
    first_ok
        && name.len() <= MAX_ENV_NAME_BYTES
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// A handler's `cwd` must be an absolute path to an existing directory.
fn check_cwd(cwd: &Path) -> Result<(), String> {
    if !cwd.is_absolute() {
        return Err(format!("must be an absolute path (got {cwd:?})"));
    }
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("is not a directory (got {cwd:?})")),
        Err(e) => Err(format!("cannot be used as a directory: {e} (got {cwd:?})")),
    }
}

/// A handler's `user` and `group` as ids, or a problem per key (`"user"`,
/// `"group"`). `is_root`: the agent can switch users; the lookups are
/// [`crate::process::lookup_user`] and [`crate::process::lookup_group`] outside
/// tests.
///
/// `group` alone is refused (a program still running as root is not
/// confined by its group); without `group` the user's primary group is used.
fn resolve_credentials(
    user: Option<&str>,
    group: Option<&str>,
    is_root: bool,
    lookup_user: impl Fn(&str) -> io::Result<Option<(libc::uid_t, libc::gid_t)>>,
    lookup_group: impl Fn(&str) -> io::Result<Option<libc::gid_t>>,
) -> Result<Option<Credentials>, Vec<(&'static str, String)>> {
    let Some(user) = user else {
        return match group {
            None => Ok(None),
            Some(g) => Err(vec![(
                "group",
                format!(
                    "needs `user` as well: a program still running as the agent's user keeps its privileges (got {g:?})"
                ),
            )]),
        };
    };
    if !is_root {
        return Err(vec![(
            "user",
            format!(
                "the agent does not run as root, so it cannot run a program as another user (got {user:?}); remove `user` and `group` to run it as the agent's own user"
            ),
        )]);
    }
    let mut problems = Vec::new();
    let ids = match lookup_user(user) {
        Ok(Some(ids)) => Some(ids),
        Ok(None) => {
            problems.push(("user", format!("no such user (got {user:?})")));
            None
        }
        Err(e) => {
            problems.push(("user", format!("cannot look up user {user:?}: {e}")));
            None
        }
    };
    let gid = match group.map(|g| (g, lookup_group(g))) {
        None => None,
        Some((_, Ok(Some(gid)))) => Some(gid),
        Some((g, Ok(None))) => {
            problems.push(("group", format!("no such group (got {g:?})")));
            None
        }
        Some((g, Err(e))) => {
            problems.push(("group", format!("cannot look up group {g:?}: {e}")));
            None
        }
    };
    match ids {
        Some((uid, primary_gid)) if problems.is_empty() => Ok(Some(Credentials {
            uid,
            gid: gid.unwrap_or(primary_gid),
        })),
        _ => Err(problems),
    }
}

/// The `{name}` placeholders in an argument.
pub fn placeholders(arg: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = arg;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start + 1..].find('}') else {
            break;
        };
        out.push(rest[start + 1..start + 1 + len].to_owned());
        rest = &rest[start + 1 + len + 1..];
    }
    out
}

/// Upper bound for retention periods: past this, `Instant`/ms arithmetic
/// could overflow (a "keep forever" value must not wrap to "delete now").
const TEN_YEARS_SECS: u64 = 10 * 365 * 86_400;

fn topic_safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// The name rule of a stream (a source's `name`, an ingest stream): 1..=64
/// letters, digits, '-', '_' or '.', not starting with '_' (names starting
/// with '_' are the agent's own: `_commands`, `_agent`). A stream name is a
/// topic level (`<topic_prefix>/<stream>`), so no '/', '+' or '#'.
pub fn stream_name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && !name.starts_with('_') && name.chars().all(topic_safe)
}

/// Parse `mqtt://host:port` (port defaults to 1883).
fn parse_url(url: &str) -> Result<(String, u16, bool), String> {
    let (rest, tls) = if let Some(r) = url.strip_prefix("mqtt://") {
        (r, false)
    } else if let Some(r) = url.strip_prefix("mqtts://") {
        (r, true)
    } else {
        return Err("must start with mqtt:// or mqtts://".into());
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') || rest.contains('@') {
        return Err("must be mqtt[s]://host[:port]".into());
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) => {
            let port: u16 = p
                .parse()
                .map_err(|_| format!("port {p:?} is not a number 1..=65535"))?;
            if port == 0 {
                return Err("port must be 1..=65535".into());
            }
            (h, port)
        }
        None => (rest, if tls { 8883 } else { 1883 }),
    };
    if host.is_empty() {
        return Err("host is empty".into());
    }
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if !bracketed
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    {
        return Err(format!("host {host:?} is not a host name or address"));
    }
    Ok((host.to_owned(), port, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
device_id = "pi4-lab"
[spool]
path = "/tmp/x/spool.db"
[mqtt]
url = "mqtt://broker.local:1884"
[[sources]]
name = "system"
kind = "system"
interval_ms = 1000
"#;

    fn err(text: &str) -> ConfigError {
        parse(text, "t.toml", &[]).unwrap_err()
    }

    #[test]
    fn follow_refuses_repeat_and_speed_by_name_and_plays_unpaced() {
        let src = |extra: &str| {
            format!(
                "{GOOD}[[sources]]\nname = \"log\"\nkind = \"replay\"\npath = \"/var/log/x.csv\"\ntimestamp_columns = [\"ts\"]\ntimestamp_format = \"%s\"\nfollow = true\n{extra}"
            )
        };
        let e = err(&src("repeat = true\n")).to_string();
        assert!(
            e.contains("sources[1].follow: follow = true cannot be combined with repeat = true"),
            "{e}"
        );
        let e = err(&src("speed = 2.0\n")).to_string();
        assert!(
            e.contains("sources[1].speed: not used with follow = true"),
            "{e}"
        );
        let c = parse(&src("repeat = false\n"), "t.toml", &[]).unwrap();
        match &c.sources[1].kind {
            SourceKind::Replay(r) => assert!(r.follow && !r.repeat && r.speed == 0.0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_minimal_config_gets_documented_defaults() {
        let c = parse(GOOD, "t.toml", &[]).unwrap();
        assert_eq!(c.mqtt.host, "broker.local");
        assert_eq!(c.mqtt.port, 1884);
        assert_eq!(c.mqtt.client_id, "edgespool-pi4-lab");
        assert_eq!(c.mqtt.topic_prefix, "edgespool/pi4-lab");
        assert_eq!(c.mqtt.inflight_window, 32);
        assert_eq!(c.spool.options.busy_timeout, Duration::from_secs(5));
        assert_eq!(c.sources.len(), 1);
    }

    #[test]
    fn misspelt_key_names_the_path_the_line_and_a_suggestion() {
        // field case F16 (a)
        let e = err(&GOOD.replace("interval_ms = 1000", "intervall_ms = 1000"));
        let p = &e.problems[0];
        assert_eq!(p.key, "sources[0].intervall_ms");
        assert_eq!(p.line, Some(10));
        assert!(
            p.message.contains("did you mean `interval_ms`"),
            "{}",
            p.message
        );
    }

    #[test]
    fn host_and_port_where_url_is_expected_are_rejected() {
        // field case F16 (b)
        let e = err(&GOOD.replace(
            "url = \"mqtt://broker.local:1884\"",
            "host = \"y\"\nport = 8883",
        ));
        assert_eq!(e.problems[0].key, "mqtt.host");
        assert_eq!(e.problems[0].line, Some(6));
    }

    #[test]
    fn wrong_type_names_the_key() {
        // field case F16 (c)
        let e = err(&GOOD.replace("interval_ms = 1000", "interval_ms = \"10k\""));
        assert_eq!(e.problems[0].key, "sources[0].interval_ms");
        assert_eq!(e.problems[0].line, Some(10));
    }

    #[test]
    fn dangerous_values_are_rejected_by_range() {
        // field case F16 (e)
        let e = err(&GOOD.replace("[mqtt]", "[mqtt]\ninflight_window = 0\nkeep_alive_secs = 0"));
        let keys: Vec<&str> = e.problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, vec!["mqtt.keep_alive_secs", "mqtt.inflight_window"]);
    }

    #[test]
    fn max_packet_bytes_defaults_to_the_protocol_limit_and_is_range_checked() {
        let c = parse(GOOD, "t", &[]).unwrap();
        assert_eq!(c.mqtt.max_packet_bytes, 268_435_460);
        let c = parse(
            &GOOD.replace("[mqtt]", "[mqtt]\nmax_packet_bytes = 2000"),
            "t",
            &[],
        )
        .unwrap();
        assert_eq!(c.mqtt.max_packet_bytes, 2000);
        for bad in ["127", "268435461"] {
            let e = err(&GOOD.replace("[mqtt]", &format!("[mqtt]\nmax_packet_bytes = {bad}")));
            assert_eq!(e.problems[0].key, "mqtt.max_packet_bytes");
            assert!(
                e.problems[0].message.contains(&format!("(got {bad})")),
                "{}",
                e.problems[0].message
            );
        }
    }

    #[test]
    fn empty_and_nul_filled_files_are_rejected_not_defaulted() {
        // field case F15 (b)
        assert_eq!(err("").problems[0].message, "config is empty");
        assert!(err("\0\0\0\0").problems[0].message.contains("NUL"));
        assert_eq!(
            err("device_id = \"x\"\n[spool\n").problems[0].key,
            "(syntax)"
        );
    }

    #[test]
    fn range_problems_carry_the_line_of_the_key() {
        let e = err(&GOOD.replace("interval_ms = 1000", "interval_ms = 1"));
        assert_eq!(e.problems[0].key, "sources[0].interval_ms");
        assert_eq!(e.problems[0].line, Some(10));
        let e = err(&GOOD.replace("[mqtt]", "[mqtt]\nkeep_alive_secs = 1"));
        assert_eq!(e.problems[0].line, Some(6));
    }

    #[test]
    fn a_missing_required_key_is_named() {
        let e = err("[spool]\npath = \"/x\"\n");
        assert_eq!(e.problems[0].key, "device_id");
        assert_eq!(e.problems[0].message, "required key is missing");
    }

    #[test]
    fn overrides_set_nested_keys_and_array_items() {
        let c = parse(
            GOOD,
            "t.toml",
            &[
                "mqtt.url=mqtt://127.0.0.1:9999".into(),
                "sources.0.interval_ms=50".into(),
                "spool.path=/tmp/other.db".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.mqtt.port, 9999);
        assert_eq!(c.sources[0].interval, Duration::from_millis(50));
        assert_eq!(c.spool.path, PathBuf::from("/tmp/other.db"));
    }

    #[test]
    fn a_bad_override_is_rejected_with_its_key() {
        let e = parse(GOOD, "t.toml", &["mqtt.inflight_windw=5".into()]).unwrap_err();
        assert_eq!(e.problems[0].key, "mqtt.inflight_windw");
        assert!(e.problems[0].message.contains("inflight_window"));
    }

    #[test]
    fn an_override_can_supply_a_key_the_file_lacks() {
        let text = GOOD.replace("device_id = \"pi4-lab\"\n", "");
        assert!(parse(&text, "t.toml", &[]).is_err());
        let c = parse(&text, "t.toml", &["device_id=gw1".into()]).unwrap();
        assert_eq!(c.device_id, "gw1");
    }

    #[test]
    fn huge_intervals_are_rejected_not_overflowed() {
        let e = err(&GOOD.replace(
            "[mqtt]",
            "[agent]\nsummary_interval_secs = 9223372036854775807\n[mqtt]",
        ));
        assert_eq!(e.problems[0].key, "agent.summary_interval_secs");
        let e = err(&GOOD.replace(
            "[mqtt]",
            "acked_retention_secs = 9223372036854775807\n[mqtt]",
        ));
        assert_eq!(e.problems[0].key, "spool.acked_retention_secs");
    }

    #[test]
    fn a_url_with_two_ports_is_rejected() {
        let e = err(&GOOD.replace("mqtt://broker.local:1884", "mqtt://host:1883:99"));
        assert_eq!(e.problems[0].key, "mqtt.url");
    }

    /// board-configs/example.toml writes every key with its default: it must
    /// agree with the defaults in this file.
    #[test]
    fn the_example_config_mirrors_the_defaults() {
        let example = parse(
            include_str!("../board-configs/example.toml"),
            "example.toml",
            &[],
        )
        .unwrap();
        let minimal = parse(
            "device_id = \"example-board-01\"\n[spool]\npath = \"/var/lib/edgespool/spool.db\"\n",
            "minimal",
            &[],
        )
        .unwrap();
        assert_eq!(example.spool, minimal.spool);
        assert_eq!(example.mqtt, minimal.mqtt);
        assert_eq!(example.agent, minimal.agent);
        assert_eq!(example.metrics, minimal.metrics);
        assert_eq!(minimal.metrics, MetricsConfig::default());
        assert_eq!(example.ingest, minimal.ingest);
        assert_eq!(minimal.ingest, IngestConfig::default());
        assert_eq!(example.commands.enabled, minimal.commands.enabled);
        assert_eq!(
            example.commands.max_payload_bytes,
            minimal.commands.max_payload_bytes
        );
        assert_eq!(
            example.commands.record_retention,
            minimal.commands.record_retention
        );
        // The example handler writes the confinement keys with their defaults.
        let handler = &example.commands.handlers[0];
        let bare = parse(
            &format!(
                "device_id = \"x\"\n[spool]\npath = \"/x.db\"\n[[commands.handlers]]\nname = \"h\"\nprogram = \"/bin/true\"\ntimeout_ms = {}\n",
                handler.timeout.as_millis()
            ),
            "bare",
            &[],
        )
        .unwrap();
        let default = &bare.commands.handlers[0];
        assert_eq!(handler.env, default.env);
        assert_eq!(handler.cwd, default.cwd);
        assert_eq!(handler.limits, default.limits);
        assert_eq!(handler.credentials, default.credentials);
        for (key, a, b) in [
            (
                "max_records",
                example.commands.max_records,
                minimal.commands.max_records,
            ),
            (
                "max_queued",
                example.commands.max_queued,
                minimal.commands.max_queued,
            ),
            (
                "max_per_minute_per_scope",
                example.commands.max_per_minute_per_scope as usize,
                minimal.commands.max_per_minute_per_scope as usize,
            ),
            (
                "default_ttl_secs",
                example.commands.default_ttl.as_secs() as usize,
                minimal.commands.default_ttl.as_secs() as usize,
            ),
        ] {
            assert_eq!(a, b, "commands.{key}");
        }
    }

    #[test]
    fn metrics_are_off_by_default_and_read_when_set() {
        let c = parse(GOOD, "t.toml", &[]).unwrap();
        assert_eq!(c.metrics, MetricsConfig::default());
        let c = parse(
            &format!(
                "{GOOD}[metrics]\ntextfile = \"/run/edgespool.prom\"\nlisten = \"[::1]:9469\"\n"
            ),
            "t.toml",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.metrics.textfile,
            Some(PathBuf::from("/run/edgespool.prom"))
        );
        assert_eq!(c.metrics.listen, Some("[::1]:9469".parse().unwrap()));
        let public = format!("{GOOD}[metrics]\nlisten = \"0.0.0.0:9469\"\nlisten_public = true\n");
        assert!(parse(&public, "t.toml", &[]).is_ok());
    }

    #[test]
    fn ingest_is_off_by_default_and_streams_are_read_with_their_durability() {
        let c = parse(GOOD, "t.toml", &[]).unwrap();
        assert_eq!(c.ingest, IngestConfig::default());
        assert!(!c.ingest.enabled());
        let text = format!(
            "{GOOD}[ingest]\nsocket = \"/run/edgespool/ingest.sock\"\nsocket_mode = \"0600\"\ntcp = \"127.0.0.1:7788\"\nstream_patterns = [\"plant.*\"]\n[[ingest.streams]]\nname = \"pump\"\ndurability = \"full\"\npriority = 9\n"
        );
        let c = parse(&text, "t.toml", &[]).unwrap();
        assert_eq!(c.ingest.socket_mode, 0o600);
        assert_eq!(c.ingest.max_line_bytes, 16 * 1024);
        let pump = c.ingest.stream("pump").unwrap();
        assert_eq!(
            (pump.durability, pump.priority),
            (crate::source::Durability::Full, 9)
        );
        assert_eq!(c.stream_durability("pump"), crate::source::Durability::Full);
        assert_eq!(
            c.stream_durability("plant.a"),
            crate::source::Durability::Batched
        );
        assert!(c.ingest.stream("plant.a").is_some());
        assert!(c.ingest.stream("plant.").is_none());
        assert!(c.ingest.stream("valve").is_none());
    }

    #[test]
    fn ingest_problems_name_their_key() {
        let on = "[ingest]\nsocket = \"/run/e/i.sock\"\n";
        let stream = "[[ingest.streams]]\nname = \"pump\"\n";
        for (body, key, says) in [
            (
                format!("{on}tcp = \"0.0.0.0:7788\"\n{stream}"),
                "ingest.tcp",
                "ingest.tcp_public = true",
            ),
            (
                format!("{on}socket_mode = \"0666\"\n{stream}"),
                "ingest.socket_mode",
                "others' write",
            ),
            (
                format!("{on}socket_mode = \"rw-rw----\"\n{stream}"),
                "ingest.socket_mode",
                "octal",
            ),
            (
                format!("{on}max_line_bytes = 10\n{stream}"),
                "ingest.max_line_bytes",
                "256..=1048576",
            ),
            (
                format!("{on}stream_patterns = [\"plant\"]\n{stream}"),
                "ingest.stream_patterns[0]",
                "followed by '*'",
            ),
            (
                format!("{on}stream_patterns = [\"sys*\"]\n{stream}"),
                "ingest.stream_patterns[0]",
                "matches source \"system\"",
            ),
            (
                format!("{on}[[ingest.streams]]\nname = \"_commands\"\n"),
                "ingest.streams[0].name",
                "not starting with '_'",
            ),
            (
                format!("{on}[[ingest.streams]]\nname = \"system\"\n"),
                "ingest.streams[0].name",
                "is a source's stream",
            ),
            (
                format!("{on}{stream}durability = \"fsync\"\n"),
                "ingest.streams[0].durability",
                "\"batched\" or \"full\"",
            ),
            (
                format!("{on}{stream}{stream}"),
                "ingest.streams[1].name",
                "duplicate",
            ),
            (on.to_owned(), "ingest.streams", "no stream is declared"),
            (format!("[ingest]\n{stream}"), "ingest", "no listener"),
            (
                format!("{on}sockett = 1\n"),
                "ingest.sockett",
                "did you mean `socket`",
            ),
        ] {
            let e = err(&format!("{GOOD}{body}"));
            let p = &e.problems[0];
            assert_eq!(p.key, key, "{body}");
            assert!(p.message.contains(says), "{body}: {}", p.message);
        }
    }

    #[test]
    fn a_metrics_listener_beyond_loopback_needs_listen_public() {
        let e = err(&format!("{GOOD}[metrics]\nlisten = \"0.0.0.0:9469\"\n"));
        let p = &e.problems[0];
        assert_eq!((p.key.as_str(), p.line), ("metrics.listen", Some(12)));
        assert!(
            p.message.contains("metrics.listen_public = true"),
            "{}",
            p.message
        );
        for (body, key, says) in [
            (
                "listen = \"localhost:9469\"",
                "metrics.listen",
                "host names are not resolved",
            ),
            ("listen = \"127.0.0.1:0\"", "metrics.listen", "needs a port"),
            ("listen = \"127.0.0.1\"", "metrics.listen", "IP:port"),
            (
                "textfile = \"edgespool.prom\"",
                "metrics.textfile",
                "absolute",
            ),
            (
                "listen_public = true",
                "metrics.listen_public",
                "only used with metrics.listen",
            ),
            (
                "listn = \"127.0.0.1:9469\"",
                "metrics.listn",
                "did you mean `listen`",
            ),
        ] {
            let e = err(&format!("{GOOD}[metrics]\n{body}\n"));
            let p = &e.problems[0];
            assert_eq!(p.key, key, "{body}");
            assert_eq!(p.line, Some(12), "{body}");
            assert!(p.message.contains(says), "{body}: {}", p.message);
        }
    }

    #[test]
    fn command_bounds_are_range_checked_and_name_their_key() {
        let with = |body: &str| format!("{GOOD}[commands]\n{body}\n");
        for (body, key) in [
            ("max_records = 999", "commands.max_records"),
            ("max_records = 1000001", "commands.max_records"),
            ("max_queued = 0", "commands.max_queued"),
            ("max_queued = 10001", "commands.max_queued"),
            (
                "max_per_minute_per_scope = 0",
                "commands.max_per_minute_per_scope",
            ),
            ("default_ttl_secs = 0", "commands.default_ttl_secs"),
            (
                "record_retention_secs = 3600\ndefault_ttl_secs = 3601",
                "commands.default_ttl_secs",
            ),
        ] {
            let e = err(&with(body));
            assert_eq!(e.problems[0].key, key, "{body}");
        }
        let c = parse(
            &with("max_records = 1000\nmax_queued = 1\nmax_per_minute_per_scope = 5\ndefault_ttl_secs = 60"),
            "t.toml",
            &[],
        )
        .unwrap();
        assert_eq!(c.commands.max_records, 1000);
        assert_eq!(c.commands.max_queued, 1);
        assert_eq!(c.commands.max_per_minute_per_scope, 5);
        assert_eq!(c.commands.default_ttl, Duration::from_secs(60));
    }

    #[test]
    fn tls_urls_need_a_ca_and_both_client_files_or_none() {
        let e = err(&GOOD.replace("mqtt://broker.local:1884", "mqtts://b"));
        assert_eq!(e.problems[0].key, "mqtt.ca_file");
        let e = err(&GOOD.replace(
            "url = \"mqtt://broker.local:1884\"",
            "url = \"mqtts://b\"\nca_file = \"/ca.pem\"\nclient_cert_file = \"/c.pem\"",
        ));
        assert_eq!(e.problems[0].key, "mqtt.client_key_file");
        let c = parse(
            &GOOD.replace(
                "url = \"mqtt://broker.local:1884\"",
                "url = \"mqtts://b\"\nca_file = \"/ca.pem\"",
            ),
            "t",
            &[],
        )
        .unwrap();
        assert_eq!(c.mqtt.port, 8883);
        assert_eq!(c.mqtt.tls.unwrap().client, None);
        let e = err(&GOOD.replace("[mqtt]", "[mqtt]\nca_file = \"/ca.pem\""));
        assert_eq!(e.problems[0].key, "mqtt.ca_file");
    }

    #[test]
    fn source_kind_typo_gets_a_suggestion() {
        let e = err(&GOOD.replace("kind = \"system\"", "kind = \"sytem\""));
        assert!(e.problems[0].message.contains("did you mean \"system\""));
    }

    #[test]
    fn a_key_of_another_kind_is_named() {
        let e = err(&GOOD.replace(
            "kind = \"system\"",
            "kind = \"system\"\nscale = 2.0\nspeed = 1.0",
        ));
        let keys: Vec<&str> = e.problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, vec!["sources[0].scale", "sources[0].speed"]);
        assert!(e.problems[0]
            .message
            .contains("not used by kind \"system\""));
    }

    /// GOOD with its source replaced by an mqtt one with `extra` lines.
    fn bridge(extra: &str) -> String {
        GOOD.replace(
            "kind = \"system\"\ninterval_ms = 1000",
            &format!("kind = \"mqtt\"\ntopics = [\"plant/#\"]\n{extra}"),
        )
    }

    #[test]
    fn an_mqtt_source_gets_documented_defaults_and_needs_no_interval() {
        let c = parse(&bridge(""), "t.toml", &[]).unwrap();
        let SourceKind::Mqtt(b) = &c.sources[0].kind else {
            panic!("not an mqtt source: {:?}", c.sources[0].kind)
        };
        assert_eq!((b.host.as_str(), b.port), ("127.0.0.1", 1883));
        assert_eq!(b.qos, rumqttc::QoS::AtLeastOnce);
        assert_eq!(b.client_id, "edgespool-bridge-pi4-lab-system");
        assert_eq!(b.payload.format, crate::source::bridge::PayloadFormat::Auto);
        assert_eq!(b.payload.max_payload_bytes, 64 * 1024);
        assert_eq!(b.payload.id_field, None);
        assert_eq!(b.credentials, None);
    }

    #[test]
    fn mqtt_source_problems_name_their_key() {
        for (extra, key, says) in [
            ("qos = 0", "sources[0].qos", "cannot be made durable"),
            ("qos = 3", "sources[0].qos", "must be 1"),
            ("qos = 2", "sources[0].qos", "PUBREL"),
            ("url = \"mqtts://h:8883\"", "sources[0].url", "without TLS"),
            ("url = \"tcp://h\"", "sources[0].url", "mqtt://"),
            ("payload = \"xml\"", "sources[0].payload", "\"auto\""),
            (
                "interval_ms = 500",
                "sources[0].interval_ms",
                "not used by kind \"mqtt\"",
            ),
            (
                "password_file = \"/p\"",
                "sources[0].password_file",
                "needs sources[0].username",
            ),
            (
                "id_field = \"source_topic\"",
                "sources[0].id_field",
                "topic",
            ),
            (
                "max_payload_bytes = 1",
                "sources[0].max_payload_bytes",
                "16..=",
            ),
            (
                "path = \"/x\"",
                "sources[0].path",
                "not used by kind \"mqtt\"",
            ),
        ] {
            let msg = problem(&bridge(extra), key);
            assert!(msg.contains(says), "{extra}: {msg}");
        }
        let e = err(&bridge("").replace("[\"plant/#\"]", "[\"ok/#\", \"a/#/b\"]"));
        assert_eq!(e.problems[0].key, "sources[0].topics[1]");
        let e = err(&bridge("").replace("[\"plant/#\"]", "[]"));
        assert_eq!(e.problems[0].key, "sources[0].topics");
    }

    #[test]
    fn a_bridge_may_not_share_the_main_client_id_nor_take_its_own_events() {
        let same = "url = \"mqtt://broker.local:1884\"";
        let msg = problem(
            &bridge(&format!("{same}\nclient_id = \"edgespool-pi4-lab\"")),
            "sources[0].client_id",
        );
        assert!(msg.contains("already the client id"), "{msg}");
        let msg = problem(
            &bridge(same).replace("[\"plant/#\"]", "[\"edgespool/#\"]"),
            "sources[0].topics",
        );
        assert!(msg.contains("a loop"), "{msg}");
        // Another broker: the same filter is no loop.
        assert!(parse(
            &bridge("").replace("[\"plant/#\"]", "[\"edgespool/#\"]"),
            "t",
            &[]
        )
        .is_ok());
    }

    #[test]
    fn exec_program_must_be_absolute() {
        let e = err(&GOOD.replace("kind = \"system\"", "kind = \"exec\"\nprogram = \"sh\""));
        assert_eq!(e.problems[0].key, "sources[0].program");
    }
    /// GOOD plus one handler with `extra` lines.
    fn with_handler(extra: &str) -> String {
        format!("{GOOD}[[commands.handlers]]\nname = \"h\"\nprogram = \"/bin/true\"\n{extra}\n")
    }

    fn problem(text: &str, key: &str) -> String {
        let e = err(text);
        match e.problems.iter().find(|p| p.key == key) {
            Some(p) => p.message.clone(),
            None => panic!("no problem on {key}: {e}"),
        }
    }

    #[test]
    fn a_handler_gets_documented_confinement_defaults() {
        let c = parse(&with_handler(""), "t.toml", &[]).unwrap();
        let h = &c.commands.handlers[0];
        assert!(h.env.is_empty());
        assert_eq!(h.cwd, PathBuf::from("/"));
        assert_eq!(
            h.limits,
            Limits {
                cpu_secs: 31,
                max_memory_bytes: 256 * 1024 * 1024,
                max_open_files: 64,
            }
        );
        assert_eq!(h.credentials, None);
        for (timeout_ms, cpu_secs) in [(10, 2), (1000, 2), (1001, 3), (3_600_000, 3601)] {
            let c = parse(
                &with_handler(&format!("timeout_ms = {timeout_ms}")),
                "t.toml",
                &[],
            )
            .unwrap();
            assert_eq!(c.commands.handlers[0].limits.cpu_secs, cpu_secs);
        }
    }

    #[test]
    fn handler_confinement_keys_are_read() {
        let dir = std::env::temp_dir();
        let c = parse(
            &with_handler(&format!(
                "env = {{ UNIT_LOG = \"info\", _X1 = \"\" }}\ncwd = {:?}\ncpu_secs = 5\nmax_memory_bytes = 33554432\nmax_open_files = 16",
                dir.display().to_string()
            )),
            "t.toml",
            &[],
        )
        .unwrap();
        let h = &c.commands.handlers[0];
        assert_eq!(h.env.get("UNIT_LOG").map(String::as_str), Some("info"));
        assert_eq!(h.env.get("_X1").map(String::as_str), Some(""));
        assert_eq!(h.cwd, dir);
        assert_eq!(
            h.limits,
            Limits {
                cpu_secs: 5,
                max_memory_bytes: 32 * 1024 * 1024,
                max_open_files: 16,
            }
        );
    }

    #[test]
    fn handler_env_names_and_values_are_checked() {
        let key = "commands.handlers[0].env";
        for name in ["lower", "1ABC", "A-B", "\"\"", "\"A B\""] {
            let m = problem(&with_handler(&format!("env = {{ {name} = \"x\" }}")), key);
            assert!(m.contains("[A-Z_][A-Z0-9_]*"), "{name}: {m}");
        }
        let m = problem(&with_handler("env = { A = \"x\\u0000y\" }"), key);
        assert_eq!(m, "A: the value contains a NUL character");
        let long = "v".repeat(4097);
        let m = problem(&with_handler(&format!("env = {{ A = \"{long}\" }}")), key);
        assert!(m.starts_with("A: the value is 4097 bytes"), "{m}");
        let many: Vec<String> = (0..65).map(|i| format!("V{i} = \"x\"")).collect();
        let m = problem(
            &with_handler(&format!("env = {{ {} }}", many.join(", "))),
            key,
        );
        assert!(m.contains("at most 64 variables (got 65)"), "{m}");
        // The line of the key is given.
        let e = err(&with_handler("env = { bad = \"x\" }"));
        assert_eq!(e.problems[0].line, Some(14), "{e}");
    }

    #[test]
    fn handler_cwd_must_be_an_absolute_existing_directory() {
        let key = "commands.handlers[0].cwd";
        let m = problem(&with_handler("cwd = \"tmp\""), key);
        assert_eq!(m, "must be an absolute path (got \"tmp\")");
        let m = problem(&with_handler("cwd = \"/nonexistent/edgespool\""), key);
        assert!(m.starts_with("cannot be used as a directory"), "{m}");
        assert!(m.contains("\"/nonexistent/edgespool\""), "{m}");
        let file = tempfile::NamedTempFile::new().unwrap();
        let shown = format!("{:?}", file.path().display().to_string());
        let m = problem(&with_handler(&format!("cwd = {shown}")), key);
        assert_eq!(m, format!("is not a directory (got {shown})"));
    }

    #[test]
    fn handler_limits_out_of_range_are_named_with_the_value() {
        let text = with_handler("cpu_secs = 0\nmax_memory_bytes = 1024\nmax_open_files = 2");
        let m = problem(&text, "commands.handlers[0].cpu_secs");
        assert_eq!(m, "must be 1..=86400 seconds (got 0)");
        let m = problem(&text, "commands.handlers[0].max_memory_bytes");
        assert!(m.ends_with("bytes (got 1024)"), "{m}");
        let m = problem(&text, "commands.handlers[0].max_open_files");
        assert_eq!(m, "must be 8..=1048576 (got 2)");
        // A timeout too long for the default CPU limit range is named on the timeout only.
        let e = err(&with_handler("timeout_ms = 99999999"));
        let keys: Vec<&str> = e.problems.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["commands.handlers[0].timeout_ms"], "{e}");
    }

    #[test]
    fn an_unknown_user_or_group_is_named_with_its_key_and_value() {
        let m = problem(
            &with_handler("user = \"no-such-user-edgespool\""),
            "commands.handlers[0].user",
        );
        assert!(m.contains("\"no-such-user-edgespool\""), "{m}");
        if crate::process::can_switch_user() {
            assert_eq!(m, "no such user (got \"no-such-user-edgespool\")");
            let m = problem(
                &with_handler("user = \"root\"\ngroup = \"no-such-group-edgespool\""),
                "commands.handlers[0].group",
            );
            assert_eq!(m, "no such group (got \"no-such-group-edgespool\")");
        }
    }

    type UserIds = io::Result<Option<(libc::uid_t, libc::gid_t)>>;

    fn users(name: &str) -> UserIds {
        match name {
            "svc" => Ok(Some((1001, 1001))),
            "broken" => Err(io::Error::from_raw_os_error(libc::EIO)),
            _ => Ok(None),
        }
    }

    fn groups(name: &str) -> io::Result<Option<libc::gid_t>> {
        Ok((name == "gpio").then_some(997))
    }

    #[test]
    fn a_user_needs_a_root_agent_and_a_known_name() {
        let resolve = |u, g, root| resolve_credentials(u, g, root, users, groups);
        assert_eq!(resolve(None, None, false), Ok(None));
        assert_eq!(resolve(None, None, true), Ok(None));
        assert_eq!(
            resolve(Some("svc"), None, true),
            Ok(Some(Credentials {
                uid: 1001,
                gid: 1001
            }))
        );
        // `group` replaces the user's primary group.
        assert_eq!(
            resolve(Some("svc"), Some("gpio"), true),
            Ok(Some(Credentials {
                uid: 1001,
                gid: 997
            }))
        );

        let problems = resolve(Some("svc"), None, false).unwrap_err();
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].0, "user");
        assert!(
            problems[0].1.contains("does not run as root"),
            "{problems:?}"
        );
        assert!(problems[0].1.contains("\"svc\""), "{problems:?}");

        let problems = resolve(None, Some("gpio"), true).unwrap_err();
        assert_eq!(problems[0].0, "group");
        assert!(problems[0].1.contains("needs `user`"), "{problems:?}");

        let problems = resolve(Some("nosuch"), Some("nogrp"), true).unwrap_err();
        assert_eq!(
            problems,
            vec![
                ("user", "no such user (got \"nosuch\")".to_owned()),
                ("group", "no such group (got \"nogrp\")".to_owned()),
            ]
        );
        let problems = resolve(Some("broken"), None, true).unwrap_err();
        assert!(
            problems[0]
                .1
                .starts_with("cannot look up user \"broken\": "),
            "{problems:?}"
        );
    }
}
