//! A pushed config (`apply-config`'s `args.config`, optionally with
//! `args.signature`) through `policy::check` and `push::compose`, the two
//! calls the agent makes (agent/control.rs), against a fixed local config
//! whose push mode is `overlay`.
//!
//! Input: an optional first line `#sig <hex>` (the signature), then the text.
//!
//! Bounds asserted (docs/invariants.md, "Trust boundaries": nothing from the network
//! widens the local config):
//! - with a signature, a board in `overlay` mode refuses;
//! - a refusal is bounded (at most 16 keys named, each cut to 80 chars);
//! - a push that composes leaves everything outside `policy::OVERLAY_KEYS`
//!   as the local file has it: device id, broker, TLS, credentials, topic
//!   prefix, the spool path and capacity, sources (but their intervals),
//!   handlers, the push policy, metrics.
#![no_main]

use edgespool::config::{self, Config};
use edgespool::push;
use edgespool::push::policy;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const LOCAL: &str = r#"
device_id = "fuzz-board"
[spool]
path = "/var/lib/edgespool/spool.db"
max_bytes = 100000000
[mqtt]
url = "mqtt://127.0.0.1:1883"
topic_prefix = "edgespool/fuzz-board"
[agent]
summary_interval_secs = 60
[[sources]]
name = "system"
kind = "system"
interval_ms = 2000
[[sources]]
name = "temp"
kind = "file"
path = "/sys/class/thermal/thermal_zone0/temp"
interval_ms = 1000
[commands.config_push]
mode = "overlay"
"#;

fn local() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(|| config::parse(LOCAL, "local.toml", &[]).expect("the local config is valid"))
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let (signature, text) = match input.strip_prefix("#sig ") {
        Some(rest) => match rest.split_once('\n') {
            Some((sig, text)) => (Some(sig), text),
            None => (Some(rest), ""),
        },
        None => (None, input),
    };
    let base = local();
    let push = match policy::check(base, text, signature) {
        Ok(p) => p,
        Err(refused) => {
            // 16 keys of at most 80 characters plus the fixed text.
            assert!(refused.len() <= 4096, "refusal of {} bytes", refused.len());
            return;
        }
    };
    assert!(
        signature.is_none(),
        "a signed push accepted in overlay mode"
    );
    let Ok(cfg) = push::compose(base, LOCAL, "local.toml", &[], &push) else {
        return;
    };
    assert_eq!(cfg.device_id, base.device_id);
    assert_eq!(cfg.mqtt.host, base.mqtt.host);
    assert_eq!(cfg.mqtt.port, base.mqtt.port);
    assert_eq!(cfg.mqtt.tls, base.mqtt.tls);
    assert_eq!(cfg.mqtt.credentials, base.mqtt.credentials);
    assert_eq!(cfg.mqtt.client_id, base.mqtt.client_id);
    assert_eq!(cfg.mqtt.topic_prefix, base.mqtt.topic_prefix);
    assert_eq!(cfg.mqtt.inflight_window, base.mqtt.inflight_window);
    assert_eq!(cfg.mqtt.max_payload_bytes, base.mqtt.max_payload_bytes);
    assert_eq!(cfg.spool.path, base.spool.path);
    assert_eq!(cfg.spool.options, base.spool.options);
    assert_eq!(cfg.spool.capacity, base.spool.capacity);
    assert_eq!(cfg.spool.allow_network_fs, base.spool.allow_network_fs);
    assert_eq!(cfg.commands.handlers, base.commands.handlers);
    assert_eq!(cfg.config_push, base.config_push);
    assert_eq!(cfg.commands.enabled, base.commands.enabled);
    assert_eq!(cfg.metrics, base.metrics);
    assert_eq!(cfg.sources.len(), base.sources.len());
    for (got, want) in cfg.sources.iter().zip(&base.sources) {
        assert_eq!(got.name, want.name);
        assert_eq!(format!("{:?}", got.kind), format!("{:?}", want.kind));
        assert_eq!(got.settings, want.settings);
    }
});
