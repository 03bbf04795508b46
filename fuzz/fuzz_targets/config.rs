//! Board config text with `--set` overrides, through `config::parse`, the
//! function `load` (start, `check-config`, reload) and every push end in.
//!
//! Input: UTF-8 config text, optionally followed by a line `#--set` and one
//! `key.path=value` override per line (the agent reads the file as bytes and
//! refuses non-UTF-8 before `parse`; so does this target).
//!
//! Bounds asserted:
//! - validation is deterministic (same text, same overrides: same result);
//! - a config that validates is unchanged by an override setting
//!   `device_id` to its own value as written (`@machine-id` and `@hostname`
//!   as themselves, so the recorded source of the id stays the same): that takes the `--set` path, which prints
//!   the merged TOML document and validates the printed text, so the
//!   printed form re-validates to the same `Config` (there is no printer of
//!   `Config` itself).
#![no_main]

use edgespool::config;
use edgespool::os::identity::DeviceIdSource;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let (text, sets) = match input.split_once("\n#--set\n") {
        Some((t, s)) => (t, s.lines().map(str::to_owned).collect::<Vec<_>>()),
        None => (input, Vec::new()),
    };
    let first = config::parse(text, "fuzz.toml", &sets);
    let again = config::parse(text, "fuzz.toml", &sets);
    assert_eq!(
        format!("{first:?}"),
        format!("{again:?}"),
        "validation is not deterministic"
    );
    if let Ok(cfg) = first {
        let mut with_self = sets.clone();
        // The id as the config wrote it: `@machine-id` and `@hostname`
        // resolve again, so the source recorded beside the id is unchanged.
        let written = match &cfg.device_id_source {
            DeviceIdSource::Config => cfg.device_id.clone(),
            DeviceIdSource::MachineId(_) => "@machine-id".to_owned(),
            DeviceIdSource::Hostname => "@hostname".to_owned(),
        };
        let quoted = toml::Value::String(written).to_string();
        with_self.push(format!("device_id={quoted}"));
        match config::parse(text, "fuzz.toml", &with_self) {
            Ok(printed) => assert_eq!(
                format!("{printed:?}"),
                format!("{cfg:?}"),
                "the printed document validates to another config"
            ),
            Err(e) => panic!("a valid config fails once printed: {e}"),
        }
    }
});
