use super::validate::resolve_credentials;
use super::*;
use crate::os::process::{Credentials, Limits};
use crate::source::SourceKind;
use std::io;

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
fn a_journal_size_limit_outside_0_to_1_gib_is_named_with_the_range() {
    let with = |v: &str| {
        GOOD.replace(
            "[spool]\n",
            &format!("[spool]\njournal_size_limit_bytes = {v}\n"),
        )
    };
    let key = "spool.journal_size_limit_bytes";
    // 10 GB: an extra zero, accepted without a word before.
    let m = problem(&with("10737418240"), key);
    assert_eq!(m, "must be 0..=1073741824 (1 GiB) (got 10737418240)");
    let m = problem(&with("-1"), key);
    assert_eq!(m, "must be 0..=1073741824 (1 GiB) (got -1)");
    for ok in ["0", "1073741824"] {
        let c = parse(&with(ok), "t.toml", &[]).unwrap();
        assert_eq!(c.spool.options.journal_size_limit_bytes.to_string(), ok);
    }
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
fn a_wrong_type_is_said_in_plain_words_with_the_expected_form_and_the_value_given() {
    let with = |key: &str, value: &str| {
        let text = format!("device_id = \"d\"\n[spool]\npath = \"/x/s.db\"\n{key} = {value}\n");
        err(&text).to_string()
    };
    for (key, value, said) in [
        ("max_bytes", "\"10k\"", "t.toml:4: spool.max_bytes: expected a whole number of bytes, got \"10k\" (a plain number: the unit is in the key's name)"),
        ("max_bytes", "-5", "t.toml:4: spool.max_bytes: expected a whole number of bytes, 0 or more, got -5"),
        ("commit_window_ms", "1.5", "t.toml:4: spool.commit_window_ms: expected a whole number of milliseconds, got 1.5"),
        ("checkpoint_interval_secs", "\"30\"", "t.toml:4: spool.checkpoint_interval_secs: expected a whole number of seconds, got \"30\" (write it without the quotes: 30)"),
        ("acked_retention_secs", "1e3", "t.toml:4: spool.acked_retention_secs: expected a whole number of seconds, got 1e3"),
        ("allow_network_fs", "\"yes\"", "t.toml:4: spool.allow_network_fs: expected true or false, got \"yes\""),
    ] {
        let e = with(key, value);
        assert_eq!(e, said);
        assert!(!e.contains("invalid type") && !e.contains("u64"), "{e}");
    }
    let e = err("device_id = \"d\"\n[spool]\npath = 5\n").to_string();
    assert_eq!(e, "t.toml:3: spool.path: expected a path in quotes, got 5");
    let e = err("device_id = 3\n[spool]\npath = \"/x\"\n").to_string();
    assert_eq!(e, "t.toml:1: device_id: expected text in quotes, got 3");
    let e = err("device_id = \"d\"\nspool = 5\n").to_string();
    assert_eq!(e, "t.toml:2: spool: expected a table, got 5");
    let e = err("device_id = \"d\"\n[spool]\npath = \"/x\"\n[ingest]\nstream_patterns = \"ops\"\n")
        .to_string();
    assert_eq!(
        e,
        "t.toml:5: ingest.stream_patterns: expected an array ([...]), got \"ops\""
    );
}

#[test]
fn a_missing_file_is_said_as_such_not_as_a_parse_failure() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("board.toml");
    let e = load(&p, &[]).unwrap_err();
    assert!(e.missing_file && e.problems.is_empty(), "{e:?}");
    assert_eq!(
        e.told(),
        format!("config file {} does not exist", p.display())
    );
    std::fs::write(&p, "device_id = 3\n").unwrap();
    let e = load(&p, &[]).unwrap_err();
    assert!(!e.missing_file);
    assert!(e.told().starts_with("config invalid: "), "{}", e.told());
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
fn protocol_takes_5_as_integer_or_string_and_3_1_1_by_set() {
    use crate::mqtt::Protocol;
    // `--set` values parse as TOML: `5` is an integer, `3.1.1` is not
    // TOML and stays a string.
    for (set, want) in [
        ("mqtt.protocol=5", Protocol::V5),
        ("mqtt.protocol=\"5\"", Protocol::V5),
        ("mqtt.protocol=3.1.1", Protocol::V311),
        ("mqtt.protocol=\"3.1.1\"", Protocol::V311),
    ] {
        let c = parse(GOOD, "t.toml", &[set.into()]).unwrap_or_else(|e| panic!("{set}: {e:?}"));
        assert_eq!(c.mqtt.protocol, want, "{set}");
    }
    let e = parse(GOOD, "t.toml", &["mqtt.protocol=3".into()]).unwrap_err();
    assert_eq!(e.problems[0].key, "mqtt.protocol");
    let text = GOOD.replacen("[mqtt]\n", "[mqtt]\nprotocol = 5\n", 1);
    assert_eq!(
        parse(&text, "t.toml", &[]).unwrap().mqtt.protocol,
        Protocol::V5
    );
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
fn the_rate_window_defaults_to_five_minutes_and_needs_two_seconds() {
    let c = parse(GOOD, "t.toml", &[]).unwrap();
    assert_eq!(c.agent.rate_window, Duration::from_secs(300));
    let e = err(&GOOD.replace("[mqtt]", "[agent]\nrate_window_secs = 1\n[mqtt]"));
    assert_eq!(e.problems[0].key, "agent.rate_window_secs");
    assert!(e.problems[0].message.contains("got 1"), "{e}");
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
        include_str!("../../board-configs/example.toml"),
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
        &format!("{GOOD}[metrics]\ntextfile = \"/run/edgespool.prom\"\nlisten = \"[::1]:9469\"\n"),
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
        (pump.settings.durability, pump.settings.priority),
        (crate::event::stream::Durability::Full, 9)
    );
    assert_eq!(
        c.stream_durability("pump"),
        crate::event::stream::Durability::Full
    );
    assert_eq!(
        c.stream_durability("plant.a"),
        crate::event::stream::Durability::Batched
    );
    assert!(c.ingest.stream("plant.a").is_some());
    assert!(c.ingest.stream("plant.").is_none());
    assert!(c.ingest.stream("valve").is_none());
}

#[test]
fn the_peers_bounds_have_defaults_and_are_read_in_their_units() {
    let c = parse(GOOD, "t.toml", &[]).unwrap();
    let d = c.ingest.share_settings();
    assert_eq!(
        (
            d.bytes_per_sec,
            d.burst_bytes,
            d.peer_percent,
            d.input_percent
        ),
        (1 << 20, 4 << 20, 25, 50)
    );
    let text = format!(
        "{GOOD}[ingest]\nsocket = \"/run/e/i.sock\"\nmax_bytes_per_sec_per_peer = 65536\nmax_burst_bytes_per_peer = 131072\nmax_spool_share_per_peer_percent = 10\nmax_spool_share_input_percent = 30\n[[ingest.streams]]\nname = \"pump\"\n"
    );
    let s = parse(&text, "t.toml", &[]).unwrap().ingest.share_settings();
    assert_eq!(
        (
            s.bytes_per_sec,
            s.burst_bytes,
            s.peer_percent,
            s.input_percent
        ),
        (65536, 131072, 10, 30)
    );
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
        (
            format!("{on}max_bytes_per_sec_per_peer = 10\n{stream}"),
            "ingest.max_bytes_per_sec_per_peer",
            "1024..=1073741824 (got 10)",
        ),
        (
            // The burst must take the longest line.
            format!("{on}max_line_bytes = 65536\nmax_burst_bytes_per_peer = 4096\n{stream}"),
            "ingest.max_burst_bytes_per_peer",
            "65536..=1073741824 (got 4096)",
        ),
        (
            format!("{on}max_spool_share_input_percent = 95\n{stream}"),
            "ingest.max_spool_share_input_percent",
            "1..=90 (got 95)",
        ),
        (
            // One peer's share is at most all input's.
            format!("{on}max_spool_share_input_percent = 20\nmax_spool_share_per_peer_percent = 30\n{stream}"),
            "ingest.max_spool_share_per_peer_percent",
            "1..=20 (got 30)",
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

/// `commands.operator_public_keys`, `commands.allow_unsigned` and
/// `commands.max_per_minute`: local-only keys with their defaults (none;
/// false; 600), as the example writes them, and checked naming the key
/// (the entry, for a bad key).
#[test]
fn operator_keys_allow_unsigned_and_the_global_rate_are_read_checked_and_default() {
    let with = |body: &str| format!("{GOOD}[commands]\n{body}\n");
    let c = parse(GOOD, "t.toml", &[]).unwrap();
    assert!(c.commands.operator_public_keys.is_empty());
    assert!(!c.commands.allow_unsigned);
    assert_eq!(c.commands.max_per_minute, 600);
    let example = parse(
        include_str!("../../board-configs/example.toml"),
        "example.toml",
        &[],
    )
    .unwrap();
    assert_eq!(
        example.commands.operator_public_keys,
        c.commands.operator_public_keys
    );
    assert_eq!(example.commands.allow_unsigned, c.commands.allow_unsigned);
    assert_eq!(example.commands.max_per_minute, c.commands.max_per_minute);
    assert_eq!(c.commands.max_answers_per_minute, 600);
    assert_eq!(
        example.commands.max_answers_per_minute,
        c.commands.max_answers_per_minute
    );
    let (k1, k2) = ("ab".repeat(32), "CD".repeat(32));
    let c = parse(
        &with(&format!(
            "operator_public_keys = [\"{k1}\", \"{k2}\"]\nallow_unsigned = true\nmax_per_minute = 1"
        )),
        "t.toml",
        &[],
    )
    .unwrap();
    let hex: Vec<String> = c
        .commands
        .operator_public_keys
        .iter()
        .map(|k| k.hex())
        .collect();
    assert_eq!(hex, [k1.clone(), k2.to_lowercase()]);
    assert!(c.commands.allow_unsigned);
    assert_eq!(c.commands.max_per_minute, 1);
    let many: Vec<String> = (0..17).map(|i| format!("\"{:064x}\"", i + 1)).collect();
    let many = format!("operator_public_keys = [{}]", many.join(", "));
    let twice = format!(
        "operator_public_keys = [\"{k1}\", \"{}\"]",
        k1.to_uppercase()
    );
    for (body, key) in [
        ("max_per_minute = 0", "commands.max_per_minute"),
        ("max_per_minute = 600001", "commands.max_per_minute"),
        (
            "max_answers_per_minute = 0",
            "commands.max_answers_per_minute",
        ),
        (
            "operator_public_keys = [\"ops\"]",
            "commands.operator_public_keys.0",
        ),
        (twice.as_str(), "commands.operator_public_keys.1"),
        (many.as_str(), "commands.operator_public_keys"),
    ] {
        let e = err(&with(body));
        assert_eq!(e.problems[0].key, key, "{body}");
    }
}

/// Field case F16: a key the config no longer takes is refused, naming
/// the key, its line and what replaced it, never silently ignored nor
/// kept as a privilege: `commands.operator_scopes` gave the operator's
/// room to whoever named the scope.
#[test]
fn the_removed_operator_scopes_is_refused_with_what_replaced_it() {
    let text = format!("{GOOD}[commands]\nenabled = true\noperator_scopes = [\"ops\"]\n");
    let e = err(&text);
    let p = &e.problems[0];
    assert_eq!(p.key, "commands.operator_scopes");
    assert_eq!(p.line, Some(text.lines().count()));
    for needed in ["operator_public_keys", "edgespool keygen", "removed"] {
        assert!(p.message.contains(needed), "{}", p.message);
    }
    // An override says the same, without a line.
    let e = parse(
        GOOD,
        "t.toml",
        &["commands.operator_scopes=[\"ops\"]".into()],
    )
    .expect_err("refused");
    assert_eq!(e.problems[0].key, "commands.operator_scopes");
    assert!(e.problems[0].message.contains("operator_public_keys"));
}

/// No caution by default (unsigned commands with a side effect are
/// refused); one only when `allow_unsigned` opens the channel and no
/// operator key is listed.
#[test]
fn the_command_caution_appears_only_when_unsigned_commands_run_and_no_key_is_listed() {
    let with = |body: &str| format!("{GOOD}[commands]\n{body}\n");
    assert_eq!(parse(GOOD, "t", &[]).unwrap().commands.caution(), None);
    let open = parse(&with("allow_unsigned = true"), "t", &[]).unwrap();
    let caution = open.commands.caution().unwrap_or_default();
    for needed in [
        "allow_unsigned",
        "operator_public_keys",
        "edgespool keygen",
        "no_room",
    ] {
        assert!(caution.contains(needed), "{caution}");
    }
    let key = "ab".repeat(32);
    for quiet in [
        format!("allow_unsigned = true\noperator_public_keys = [\"{key}\"]"),
        "allow_unsigned = true\nenabled = false".to_owned(),
        format!("operator_public_keys = [\"{key}\"]"),
    ] {
        assert_eq!(
            parse(&with(&quiet), "t", &[]).unwrap().commands.caution(),
            None,
            "{quiet}"
        );
    }
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
    // Refused while the file is read (raw::source), so the first one only.
    let keys: Vec<&str> = e.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, vec!["sources[0].scale"]);
    assert!(e.problems[0]
        .message
        .starts_with("not used by kind \"system\": a key of kind \"file\""));
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
    // The same broker under two loopback names is one broker.
    let local = GOOD.replace("mqtt://broker.local:1884", "mqtt://127.0.0.1:1883");
    let looped = local.replace(
        "kind = \"system\"\ninterval_ms = 1000",
        "kind = \"mqtt\"\nurl = \"mqtt://localhost:1883\"\ntopics = [\"edgespool/pi4-lab/events/system\"]",
    );
    assert!(problem(&looped, "sources[0].topics").contains("a loop"));
    // Two bridges taking each other's events are a loop too.
    let pair = format!(
        "{local}[[sources]]\nname = \"m\"\nkind = \"mqtt\"\nclient_id = \"b-m\"\ntopics = [\"edgespool/pi4-lab/events/system\"]\n"
    );
    assert!(problem(&pair, "sources[1].topics").contains("a loop"));
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
    if crate::os::process::can_switch_user() {
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

#[test]
fn priorities_default_by_durability_and_the_agent_streams_come_first() {
    let text = format!(
        "{GOOD}[[sources]]\nname = \"alarm\"\nkind = \"system\"\ndurability = \"full\"\n[[sources]]\nname = \"dash\"\nkind = \"system\"\npriority = 7\nlive_first = true\n"
    );
    let c = parse(&text, "t.toml", &[]).unwrap();
    let p = c.stream_priorities();
    assert_eq!(
        (
            p["system"],
            p["alarm"],
            p["dash"],
            p["_commands"],
            p["_agent"]
        ),
        (0, 100, 7, 200, 200)
    );
    assert_eq!(c.live_first_streams(), ["dash".to_owned()].into());
    assert_eq!(c.mqtt.min_share_pct, 10);
    let e = parse(GOOD, "t.toml", &["mqtt.min_share_pct=60".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mqtt.min_share_pct: must be 0..=50 (got 60)"),
        "{e}"
    );
}

#[test]
fn batching_keys_are_checked_by_name() {
    let src =
        |extra: &str| format!("{GOOD}[[sources]]\nname = \"tele\"\nkind = \"system\"\n{extra}");
    let c = parse(
        &src("batch_max_events = 50\nbatch_max_ms = 30000\ncompression = \"lz4\"\n"),
        "t.toml",
        &[],
    )
    .unwrap();
    let b = c.stream_batching()["tele"];
    assert_eq!(
        (b.max_events, b.max_wait.as_millis(), b.compression),
        (50, 30000, crate::event::stream::Compression::Lz4)
    );
    assert!(!c.stream_batching().contains_key("system"));
    for (extra, want) in [
        (
            "batch_max_events = 0\n",
            "sources[1].batch_max_events: must be 1..=1000 (got 0)",
        ),
        (
            "batch_max_events = 1001\n",
            "sources[1].batch_max_events: must be 1..=1000 (got 1001)",
        ),
        (
            "batch_max_events = 5\nbatch_max_ms = 600001\n",
            "sources[1].batch_max_ms: must be 0..=600000",
        ),
        (
            "batch_max_events = 5\ncompression = \"gzip\"\n",
            "sources[1].compression: must be \"none\", \"lz4\" or \"zstd\" (got \"gzip\")",
        ),
        (
            "compression = \"lz4\"\n",
            "sources[1].compression: compresses batches: set batch_max_events above 1 too",
        ),
        (
            "batch_max_ms = 10\n",
            "sources[1].batch_max_ms: applies to batches",
        ),
    ] {
        let e = err(&src(extra)).to_string();
        assert!(e.contains(want), "{extra}: {e}");
    }
}

// The handler the config resolved (user name to ids) runs as that user.
#[test]
fn a_handler_with_user_nobody_runs_as_nobody_with_only_its_group() {
    if !crate::os::process::can_switch_user() {
        eprintln!("skipped: switching users needs root");
        return;
    }
    let Some((uid, gid)) = crate::os::process::lookup_user("nobody").unwrap() else {
        panic!("this system has no user nobody");
    };
    let text = r#"
device_id = "t"
[spool]
path = "/tmp/unused.db"
[[commands.handlers]]
name = "who"
program = "/bin/sh"
args = ["-c", "id -u; id -g; id -G; pwd"]
user = "nobody"
"#;
    let config = crate::config::parse(text, "t.toml", &[]).unwrap();
    let h = &config.commands.handlers[0];
    assert_eq!(
        h.credentials,
        Some(crate::os::process::Credentials { uid, gid })
    );
    let outcome = crate::commands::exec_handler::run(h, &serde_json::Map::new());
    let crate::commands::exec_handler::HandlerOutcome::Completed(result) = &outcome else {
        panic!("{outcome:?}");
    };
    // No supplementary group of the agent (root's) is left.
    assert_eq!(
        result["stdout"].as_str().unwrap_or_default(),
        format!("{uid}\n{gid}\n{gid}\n/\n")
    );
}

fn with_exec_source(extra: &str) -> String {
    format!(
        "{GOOD}[[sources]]\nname = \"probe\"\nkind = \"exec\"\nprogram = \"/bin/true\"\n{extra}\n"
    )
}

#[test]
fn an_exec_source_takes_env_user_and_group_checked_as_a_handlers() {
    let c = parse(&with_exec_source(""), "t.toml", &[]).unwrap();
    match &c.sources[1].kind {
        SourceKind::Exec {
            env, credentials, ..
        } => assert!(env.is_empty() && credentials.is_none()),
        other => panic!("{other:?}"),
    }
    let c = parse(
        &with_exec_source("env = { SENSOR_BUS = \"i2c-1\", PATH = \"/opt/bin\" }"),
        "t.toml",
        &[],
    )
    .unwrap();
    match &c.sources[1].kind {
        SourceKind::Exec { env, .. } => assert_eq!(
            env.iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
            [("PATH", "/opt/bin"), ("SENSOR_BUS", "i2c-1")]
        ),
        other => panic!("{other:?}"),
    }
    let m = problem(
        &with_exec_source("env = { lower = \"x\" }"),
        "sources[1].env",
    );
    assert!(m.contains("(got \"lower\")"), "{m}");
    let m = problem(&with_exec_source("group = \"nogroup\""), "sources[1].group");
    assert!(m.starts_with("needs `user` as well"), "{m}");
    let m = problem(
        &with_exec_source("user = \"no-such-user-edgespool\""),
        "sources[1].user",
    );
    assert!(m.contains("\"no-such-user-edgespool\""), "{m}");
    // They belong to exec sources only.
    for key in ["env = { A = \"1\" }", "user = \"root\"", "group = \"root\""] {
        let text =
            format!("{GOOD}[[sources]]\nname = \"f\"\nkind = \"file\"\npath = \"/x\"\n{key}\n");
        let name = key.split(' ').next().unwrap_or_default();
        let m = problem(&text, &format!("sources[1].{name}"));
        assert!(
            m.starts_with("not used by kind \"file\": a key of kind \"exec\""),
            "{key}: {m}"
        );
    }
}

// The source the config resolved (user name to ids) runs as that user,
// with only PATH, LANG and its env.
#[test]
fn an_exec_source_with_user_nobody_runs_as_nobody() {
    if !crate::os::process::can_switch_user() {
        eprintln!("skipped: switching users needs root");
        return;
    }
    let Some((uid, gid)) = crate::os::process::lookup_user("nobody").unwrap() else {
        panic!("this system has no user nobody");
    };
    let text = format!(
        r#"{GOOD}[[sources]]
name = "probe"
kind = "exec"
program = "/bin/sh"
args = ["-c", "printf '{{\"uid\": %s, \"groups\": \"%s\", \"greeting\": \"%s\"}}' \"$(id -u)\" \"$(id -G)\" \"$GREETING\""]
user = "nobody"
env = {{ GREETING = "hi" }}
"#
    );
    let config = crate::config::parse(&text, "t.toml", &[]).unwrap();
    let spec = &config.sources[1];
    match &spec.kind {
        SourceKind::Exec { credentials, .. } => {
            assert_eq!(*credentials, Some(Credentials { uid, gid }))
        }
        other => panic!("{other:?}"),
    }
    let mut state = crate::source::SourceState::default();
    let mut fields = crate::source::sample(spec, &mut state, std::path::Path::new("/")).unwrap();
    fields.sort_by(|a, b| a.0.cmp(&b.0));
    use crate::event::reading::FieldValue;
    assert_eq!(
        fields,
        [
            ("greeting".to_owned(), FieldValue::Text("hi".into())),
            ("groups".to_owned(), FieldValue::Text(gid.to_string())),
            ("uid".to_owned(), FieldValue::Num(f64::from(uid))),
        ]
    );
}

#[test]
fn a_topic_prefix_with_an_events_or_batches_level_is_refused() {
    for prefix in ["site/events/gw1", "batches/gw1", "edgespool/gw1/events"] {
        let text = GOOD.replace(
            "url = \"mqtt://broker.local:1884\"",
            &format!("url = \"mqtt://broker.local:1884\"\ntopic_prefix = \"{prefix}\""),
        );
        let e = err(&text).to_string();
        assert!(
            e.contains("mqtt.topic_prefix: may not have a level named \"events\""),
            "{prefix}: {e}"
        );
    }
    let e = err(&GOOD.replace("pi4-lab", "events")).to_string();
    assert!(e.contains("mqtt.topic_prefix"), "{e}");
}

#[test]
fn the_write_budget_keys_are_range_checked_by_name() {
    let set = |sets: &[&str]| {
        parse(
            GOOD,
            "t.toml",
            &sets.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
        )
    };
    let c = set(&[]).unwrap();
    assert_eq!(c.spool.write_budget_bytes_per_day, None);
    assert_eq!(c.spool.max_commit_window, Duration::from_secs(10));
    let c = set(&[
        "spool.write_budget_mb_per_day=100",
        "spool.max_commit_window_ms=20000",
    ])
    .unwrap();
    assert_eq!(c.spool.write_budget_bytes_per_day, Some(100_000_000));
    assert_eq!(c.spool.max_commit_window, Duration::from_secs(20));
    let e = set(&["spool.write_budget_mb_per_day=0"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("spool.write_budget_mb_per_day: must be 1..=1000000 MB a day (got 0)"),
        "{e}"
    );
    // An operator may accept a loss window of up to ten minutes (issue 35).
    let c = set(&[
        "spool.write_budget_mb_per_day=100",
        "spool.max_commit_window_ms=600000",
    ])
    .unwrap();
    assert_eq!(c.spool.max_commit_window, Duration::from_secs(600));
    let e = set(&["spool.max_commit_window_ms=600001"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("spool.max_commit_window_ms: must be 1..=600000 ms (10 minutes) (got 600001)"),
        "{e}"
    );
    // A budget widens the window from commit_window_ms: the ceiling must be above it.
    let e = set(&[
        "spool.write_budget_mb_per_day=100",
        "spool.commit_window_ms=20000",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("spool.max_commit_window_ms: must be at least spool.commit_window_ms (20000)"),
        "{e}"
    );
    // Without a budget the ceiling is not used.
    assert!(set(&["spool.commit_window_ms=20000"]).is_ok());
}

#[test]
fn receipt_mode_needs_a_trusted_key_and_keys_are_64_hex_digits() {
    // Issue 33: a receipt retires rows only under a listed key's signature;
    // receipt mode with none could retire nothing and is refused.
    let e = err(&GOOD.replace("[mqtt]", "[mqtt]\nretire_on = \"receipt\""));
    assert_eq!(e.problems.len(), 1, "{e}");
    assert_eq!(e.problems[0].key, "mqtt.retire_on");
    assert!(
        e.problems[0].message.contains("mqtt.receipt_public_keys")
            && e.problems[0].message.contains("edgespool keygen"),
        "{e}"
    );
    let key = "ab".repeat(32);
    let e = err(&GOOD.replace(
        "[mqtt]",
        &format!("[mqtt]\nretire_on = \"receipt\"\nreceipt_public_keys = [\"{key}\", \"abcd\"]"),
    ));
    let keys: Vec<&str> = e.problems.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, vec!["mqtt.receipt_public_keys[1]"], "{e}");
    let c = parse(
        &GOOD.replace(
            "[mqtt]",
            &format!("[mqtt]\nretire_on = \"receipt\"\nreceipt_public_keys = [\"{key}\"]"),
        ),
        "t.toml",
        &[],
    )
    .expect("a trusted key");
    assert_eq!(c.mqtt.receipt_public_keys.len(), 1);
    assert_eq!(c.mqtt.receipt_public_keys[0].hex(), key);
}
