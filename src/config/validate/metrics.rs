//! `[metrics]` validation.

use crate::config::raw::RawMetrics;
use crate::metrics::MetricsConfig;

/// `[metrics]`: an absolute textfile path; a literal `IP:port` to listen on,
/// loopback unless `listen_public` (the listener is attack surface).
pub(super) fn validate_metrics(
    raw: &RawMetrics,
    bad: &mut impl FnMut(&str, String),
) -> MetricsConfig {
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
