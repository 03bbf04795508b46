//! `[ingest]` validation: listeners, bounds and the streams clients may write.

use super::bounds::check_range;
use super::stream::stream_settings;
use crate::config::raw::RawIngest;
use crate::event::stream::{pattern_matches, stream_name_ok};
use crate::ingest::{IngestConfig, IngestStream};
use crate::source::SourceSpec;

/// `[ingest]`: listeners (a socket path, a loopback `IP:port` unless
/// `tcp_public`), bounds in range (`max_connection_bytes` at most
/// `max_buffered_bytes`), and the streams clients may write: valid names,
/// not a source's stream, no duplicates; patterns `prefix*`.
pub(super) fn validate_ingest(
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
    let mut cfg = IngestConfig {
        socket: raw.socket.clone(),
        socket_group: raw.socket_group.clone(),
        socket_mode,
        tcp,
        tcp_public: raw.tcp_public,
        stream_patterns: raw.stream_patterns.clone(),
        ..IngestConfig::default()
    };
    validate_bounds(raw, &mut cfg, bad);
    cfg.streams = validate_ingest_streams(raw, sources, bad);
    cfg
}

/// The numeric bounds of `[ingest]`, each in its range, into `cfg` (a
/// value out of range is named and the default kept).
fn validate_bounds(raw: &RawIngest, cfg: &mut IngestConfig, bad: &mut impl FnMut(&str, String)) {
    let d = IngestConfig::default();
    // A value out of range is named and the default kept.
    let mut range = |key: &str, got: Option<usize>, lo: usize, hi: usize, def: usize| match got {
        Some(v) if check_range(key, v, lo..=hi, bad) => v,
        _ => def,
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
    let max_connections_per_peer = range(
        "ingest.max_connections_per_peer",
        raw.max_connections_per_peer,
        1,
        1024,
        d.max_connections_per_peer,
    );
    let max_fields = range("ingest.max_fields", raw.max_fields, 1, 1024, d.max_fields);
    let max_rate_per_sec = range(
        "ingest.max_rate_per_sec",
        raw.max_rate_per_sec.map(|v| v as usize),
        1,
        1_000_000,
        d.max_rate_per_sec as usize,
    ) as u32;
    let max_buffered_bytes = range(
        "ingest.max_buffered_bytes",
        raw.max_buffered_bytes,
        256 * 1024,
        256 * 1024 * 1024,
        d.max_buffered_bytes,
    );
    let max_connection_bytes = range(
        "ingest.max_connection_bytes",
        raw.max_connection_bytes,
        64 * 1024,
        max_buffered_bytes,
        d.max_connection_bytes.min(max_buffered_bytes),
    );
    cfg.max_line_bytes = max_line_bytes;
    cfg.max_connections = max_connections;
    cfg.max_connections_per_peer = max_connections_per_peer;
    cfg.max_rate_per_sec = max_rate_per_sec;
    cfg.max_fields = max_fields;
    cfg.max_buffered_bytes = max_buffered_bytes;
    cfg.max_connection_bytes = max_connection_bytes;
    validate_peer_bounds(raw, cfg, bad);
}

/// The peers' bounds ([`crate::intake::share`]): a byte rate whose burst
/// takes the longest line, and shares of the spool with the per-peer one
/// at most the input's (a value out of range is named and the default kept).
fn validate_peer_bounds(
    raw: &RawIngest,
    cfg: &mut IngestConfig,
    bad: &mut impl FnMut(&str, String),
) {
    let d = IngestConfig::default();
    const GIB: u64 = 1 << 30;
    let mut range = |key: &str, got: Option<u64>, lo: u64, hi: u64, def: u64| match got {
        Some(v) if check_range(key, v, lo..=hi, bad) => v,
        _ => def,
    };
    cfg.max_bytes_per_sec_per_peer = range(
        "ingest.max_bytes_per_sec_per_peer",
        raw.max_bytes_per_sec_per_peer,
        1024,
        GIB,
        d.max_bytes_per_sec_per_peer,
    );
    // A line as long as `max_line_bytes` must fit a full bucket.
    let line = cfg.max_line_bytes as u64;
    cfg.max_burst_bytes_per_peer = range(
        "ingest.max_burst_bytes_per_peer",
        raw.max_burst_bytes_per_peer,
        line,
        GIB,
        d.max_burst_bytes_per_peer.max(line),
    );
    cfg.max_spool_share_input_percent = range(
        "ingest.max_spool_share_input_percent",
        raw.max_spool_share_input_percent.map(u64::from),
        1,
        90,
        u64::from(d.max_spool_share_input_percent),
    ) as u32;
    let input = u64::from(cfg.max_spool_share_input_percent);
    cfg.max_spool_share_per_peer_percent = range(
        "ingest.max_spool_share_per_peer_percent",
        raw.max_spool_share_per_peer_percent.map(u64::from),
        1,
        input,
        u64::from(d.max_spool_share_per_peer_percent).min(input),
    ) as u32;
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
        streams.push(IngestStream {
            name: rs.name.clone(),
            settings: stream_settings(rs, &k, bad),
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
