//! The serde layer of the config: `Raw*` structs read from TOML (unknown
//! keys denied; a source's by its kind, in `source.rs`) and the `d_*`
//! functions giving each key its default.
//! `board-configs/example.toml` mirrors these defaults, key by key.

mod source;

pub(super) use source::{
    all_keys as source_keys, split_keyed, RawBridgeSource, RawExecSource, RawFileSource,
    RawReplaySource, RawSource, RawSourceKind,
};

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) device_id: String,
    pub(super) spool: RawSpool,
    #[serde(default)]
    pub(super) mqtt: RawMqtt,
    #[serde(default)]
    pub(super) agent: RawAgent,
    #[serde(default)]
    pub(super) sources: Vec<RawSource>,
    #[serde(default)]
    pub(super) commands: RawCommands,
    #[serde(default)]
    pub(super) metrics: RawMetrics,
    #[serde(default)]
    pub(super) ingest: RawIngest,
    pub(super) signed: Option<RawSigned>,
}

/// `[signed]`: what a signed whole config says of itself.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSigned {
    pub(super) serial: u64,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIngest {
    pub(super) socket: Option<PathBuf>,
    pub(super) socket_group: Option<String>,
    pub(super) socket_mode: Option<String>,
    pub(super) tcp: Option<String>,
    #[serde(default)]
    pub(super) tcp_public: bool,
    pub(super) max_line_bytes: Option<usize>,
    pub(super) max_connections: Option<usize>,
    pub(super) max_connections_per_peer: Option<usize>,
    pub(super) max_rate_per_sec: Option<u32>,
    pub(super) max_fields: Option<usize>,
    pub(super) max_buffered_bytes: Option<usize>,
    pub(super) max_connection_bytes: Option<usize>,
    pub(super) max_bytes_per_sec_per_peer: Option<u64>,
    pub(super) max_burst_bytes_per_peer: Option<u64>,
    pub(super) max_spool_share_per_peer_percent: Option<u32>,
    pub(super) max_spool_share_input_percent: Option<u32>,
    #[serde(default)]
    pub(super) streams: Vec<RawStreamDecl>,
    #[serde(default)]
    pub(super) stream_patterns: Vec<String>,
}

/// A declared stream: its `name` and the keys every stream declaration has,
/// as an `[[ingest.streams]]` entry and each `[[sources]]` entry (besides
/// its kind's keys, [`source`]) write them; validated once for both.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStreamDecl {
    pub(super) name: String,
    pub(super) durability: Option<String>,
    pub(super) priority: Option<u8>,
    pub(super) live_first: Option<bool>,
    pub(super) batch_max_events: Option<usize>,
    pub(super) batch_max_ms: Option<u64>,
    pub(super) compression: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) textfile: Option<PathBuf>,
    pub(super) listen: Option<String>,
    #[serde(default)]
    pub(super) listen_public: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCommands {
    #[serde(default = "d_true")]
    pub(super) enabled: bool,
    #[serde(default = "d_cmd_payload")]
    pub(super) max_payload_bytes: usize,
    #[serde(default = "d_cmd_retention")]
    pub(super) record_retention_secs: u64,
    #[serde(default = "d_cmd_records")]
    pub(super) max_records: usize,
    #[serde(default = "d_cmd_queued")]
    pub(super) max_queued: usize,
    #[serde(default = "d_cmd_rate")]
    pub(super) max_per_minute_per_scope: u32,
    #[serde(default = "d_cmd_global_rate")]
    pub(super) max_per_minute: u32,
    #[serde(default = "d_cmd_answer_rate")]
    pub(super) max_answers_per_minute: u32,
    #[serde(default)]
    pub(super) operator_public_keys: Vec<String>,
    #[serde(default)]
    pub(super) allow_unsigned: bool,
    #[serde(default = "d_cmd_ttl")]
    pub(super) default_ttl_secs: u64,
    #[serde(default)]
    pub(super) handlers: Vec<RawHandler>,
    #[serde(default)]
    pub(super) config_push: RawConfigPush,
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
            max_per_minute: d_cmd_global_rate(),
            max_answers_per_minute: d_cmd_answer_rate(),
            operator_public_keys: Vec::new(),
            allow_unsigned: false,
            default_ttl_secs: d_cmd_ttl(),
            handlers: Vec::new(),
            config_push: RawConfigPush::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfigPush {
    #[serde(default = "d_push_mode")]
    pub(super) mode: String,
    #[serde(default = "d_push_confirm")]
    pub(super) confirm_secs: u64,
    #[serde(default)]
    pub(super) public_keys: Vec<String>,
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

pub(super) fn d_push_mode() -> String {
    "overlay".into()
}
pub(super) fn d_push_confirm() -> u64 {
    60
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHandler {
    pub(super) name: String,
    pub(super) program: PathBuf,
    #[serde(default)]
    pub(super) args: Vec<String>,
    #[serde(default = "d_handler_timeout")]
    pub(super) timeout_ms: u64,
    #[serde(default = "d_handler_output")]
    pub(super) max_output_bytes: usize,
    #[serde(default)]
    pub(super) retry_safe: bool,
    #[serde(default)]
    pub(super) params: BTreeMap<String, RawParam>,
    #[serde(default)]
    pub(super) env: BTreeMap<String, String>,
    pub(super) cwd: Option<PathBuf>,
    /// Default: [`default_cpu_secs`] of the timeout.
    pub(super) cpu_secs: Option<u64>,
    #[serde(default = "d_handler_memory")]
    pub(super) max_memory_bytes: u64,
    #[serde(default = "d_handler_files")]
    pub(super) max_open_files: u64,
    pub(super) user: Option<String>,
    pub(super) group: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawParam {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) min: Option<f64>,
    pub(super) max: Option<f64>,
    pub(super) values: Option<Vec<String>>,
    pub(super) max_len: Option<usize>,
    #[serde(default = "d_true")]
    pub(super) required: bool,
}

pub(super) fn d_protocol() -> String {
    "5".to_owned()
}
/// `mqtt.protocol` as written: a string (`"5"`, `"3.1.1"`) or an integer
/// (`protocol = 5`, and `--set mqtt.protocol=5`, which overrides parse as
/// TOML), kept as its text; validation judges the value.
fn de_protocol<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOrInt {
        Text(String),
        Int(i64),
    }
    match TextOrInt::deserialize(d)
        .map_err(|_| serde::de::Error::custom("mqtt.protocol must be \"5\", 5 or \"3.1.1\""))?
    {
        TextOrInt::Text(s) => Ok(s),
        TextOrInt::Int(n) => Ok(n.to_string()),
    }
}
pub(super) fn d_session_expiry() -> u32 {
    604_800
}
pub(super) fn d_min_share() -> u8 {
    10
}
pub(super) fn d_retire_on() -> String {
    "puback".into()
}
pub(super) fn d_receipt_timeout() -> u64 {
    300
}
pub(super) fn d_receipt_window() -> usize {
    10_000
}
pub(super) fn d_holdings_interval() -> u64 {
    600
}
pub(super) fn d_backfill_rows() -> u32 {
    200
}
pub(super) fn d_true() -> bool {
    true
}
pub(super) fn d_cmd_payload() -> usize {
    64 * 1024
}
pub(super) fn d_cmd_retention() -> u64 {
    7 * 86_400
}
pub(super) fn d_cmd_records() -> usize {
    10_000
}
pub(super) fn d_cmd_queued() -> usize {
    100
}
pub(super) fn d_cmd_rate() -> u32 {
    60
}
pub(super) fn d_cmd_global_rate() -> u32 {
    600
}
fn d_cmd_answer_rate() -> u32 {
    600
}
pub(super) fn d_cmd_ttl() -> u64 {
    3600
}
pub(super) fn d_handler_timeout() -> u64 {
    30_000
}
pub(super) fn d_handler_output() -> usize {
    4096
}
/// Default `max_memory_bytes` of a handler: 256 MiB of address space.
pub(super) fn d_handler_memory() -> u64 {
    256 * 1024 * 1024
}
/// Default `max_open_files` of a handler.
pub(super) fn d_handler_files() -> u64 {
    64
}
/// Default `cwd` of a handler.
pub(super) const HANDLER_CWD: &str = "/";

/// Default `cpu_secs` of a handler with a `timeout_ms` timeout: the timeout
/// in seconds, rounded up, plus one. A program busy for its whole run is
/// then stopped by its timeout, which says so in the result, rather than by
/// the CPU limit.
pub(super) fn default_cpu_secs(timeout_ms: u64) -> u64 {
    timeout_ms.div_ceil(1000).saturating_add(1)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpool {
    pub(super) path: PathBuf,
    #[serde(default = "d_sync")]
    pub(super) synchronous: String,
    #[serde(default = "d_busy")]
    pub(super) busy_timeout_ms: u64,
    #[serde(default = "d_jsl")]
    pub(super) journal_size_limit_bytes: i64,
    #[serde(default = "d_autockpt")]
    pub(super) wal_autocheckpoint_pages: i64,
    pub(super) commit_window_ms: Option<u64>,
    pub(super) write_budget_mb_per_day: Option<u64>,
    #[serde(default = "d_max_commit")]
    pub(super) max_commit_window_ms: u64,
    #[serde(default = "d_retention")]
    pub(super) acked_retention_secs: u64,
    #[serde(default = "d_purge")]
    pub(super) purge_batch_rows: usize,
    #[serde(default = "d_ckpt")]
    pub(super) checkpoint_interval_secs: u64,
    #[serde(default)]
    pub(super) allow_network_fs: bool,
    #[serde(default = "d_max_bytes")]
    pub(super) max_bytes: u64,
    #[serde(default = "d_min_free")]
    pub(super) min_free_bytes: u64,
    pub(super) checkpoint_wal_bytes: Option<u64>,
    #[serde(default = "d_true")]
    pub(super) tune_from_probe: bool,
}

pub(super) fn d_max_bytes() -> u64 {
    1024 * 1024 * 1024
}
pub(super) fn d_min_free() -> u64 {
    64 * 1024 * 1024
}
pub(super) fn d_ckpt_wal() -> u64 {
    1024 * 1024
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMqtt {
    #[serde(default = "d_url")]
    pub(super) url: String,
    pub(super) client_id: Option<String>,
    pub(super) topic_prefix: Option<String>,
    #[serde(default = "d_keepalive")]
    pub(super) keep_alive_secs: u64,
    #[serde(default)]
    pub(super) clean_session: bool,
    #[serde(default = "d_window")]
    pub(super) inflight_window: usize,
    #[serde(default = "d_maxpayload")]
    pub(super) max_payload_bytes: usize,
    #[serde(default = "d_maxpacket")]
    pub(super) max_packet_bytes: usize,
    #[serde(default = "d_format")]
    pub(super) payload_format: String,
    #[serde(default = "d_connect")]
    pub(super) connect_timeout_secs: u64,
    #[serde(default = "d_rmin")]
    pub(super) reconnect_min_ms: u64,
    #[serde(default = "d_rmax")]
    pub(super) reconnect_max_ms: u64,
    #[serde(default = "d_acktimeout")]
    pub(super) ack_timeout_secs: u64,
    #[serde(default = "d_fail_after")]
    pub(super) fail_after_disconnects: u32,
    #[serde(default = "d_true")]
    pub(super) status_topic: bool,
    /// `"5"`, `"3.1.1"` or the integer `5` (see [`de_protocol`]).
    #[serde(default = "d_protocol", deserialize_with = "de_protocol")]
    pub(super) protocol: String,
    #[serde(default = "d_session_expiry")]
    pub(super) session_expiry_secs: u32,
    #[serde(default = "d_min_share")]
    pub(super) min_share_pct: u8,
    #[serde(default = "d_retire_on")]
    pub(super) retire_on: String,
    #[serde(default = "d_receipt_timeout")]
    pub(super) receipt_timeout_secs: u64,
    #[serde(default = "d_receipt_window")]
    pub(super) receipt_window: usize,
    #[serde(default)]
    pub(super) receipt_public_keys: Vec<String>,
    #[serde(default = "d_holdings_interval")]
    pub(super) holdings_interval_secs: u64,
    #[serde(default = "d_backfill_rows")]
    pub(super) backfill_rows_per_sec: u32,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) client_cert_file: Option<PathBuf>,
    pub(super) client_key_file: Option<PathBuf>,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<PathBuf>,
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
            min_share_pct: d_min_share(),
            retire_on: d_retire_on(),
            receipt_timeout_secs: d_receipt_timeout(),
            receipt_window: d_receipt_window(),
            receipt_public_keys: Vec::new(),
            holdings_interval_secs: d_holdings_interval(),
            backfill_rows_per_sec: d_backfill_rows(),
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
pub(super) struct RawAgent {
    #[serde(default = "d_summary")]
    pub(super) summary_interval_secs: u64,
    #[serde(default = "d_rate_window")]
    pub(super) rate_window_secs: u64,
}

impl Default for RawAgent {
    fn default() -> Self {
        RawAgent {
            summary_interval_secs: d_summary(),
            rate_window_secs: d_rate_window(),
        }
    }
}

pub(super) fn d_sync() -> String {
    "normal".into()
}
pub(super) fn d_busy() -> u64 {
    5000
}
pub(super) fn d_jsl() -> i64 {
    4 * 1024 * 1024
}
pub(super) fn d_autockpt() -> i64 {
    // The agent owns checkpoints (maintenance::checkpoint_due).
    0
}
pub(super) fn d_commit() -> u64 {
    200
}
pub(super) fn d_max_commit() -> u64 {
    10_000
}
pub(super) fn d_retention() -> u64 {
    86_400
}
pub(super) fn d_purge() -> usize {
    5000
}
pub(super) fn d_ckpt() -> u64 {
    30
}
pub(super) fn d_url() -> String {
    "mqtt://127.0.0.1:1883".into()
}
pub(super) fn d_keepalive() -> u64 {
    30
}
pub(super) fn d_window() -> usize {
    32
}
pub(super) fn d_fail_after() -> u32 {
    3
}
pub(super) fn d_maxpayload() -> usize {
    64 * 1024
}
pub(super) fn d_maxpacket() -> usize {
    crate::mqtt::PROTOCOL_MAX_PACKET
}
pub(super) fn d_format() -> String {
    "json".into()
}
pub(super) fn d_connect() -> u64 {
    10
}
pub(super) fn d_rmin() -> u64 {
    500
}
pub(super) fn d_rmax() -> u64 {
    30_000
}
pub(super) fn d_acktimeout() -> u64 {
    30
}
/// `agent.rate_window_secs`: the outage budget's moving averages
/// ([`crate::flash::outage`]) cover the last 5 minutes.
pub(super) fn d_rate_window() -> u64 {
    300
}

pub(super) fn d_summary() -> u64 {
    60
}
pub(super) fn d_interval() -> u64 {
    10_000
}
