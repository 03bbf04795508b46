//! The shipped Grafana dashboard (`packaging/grafana/edgespool.json`) and
//! Prometheus alert rules (`packaging/prometheus/edgespool-alerts.yml`),
//! held against the real thing: Debian's `prometheus` on a free loopback
//! port, with a temp storage directory, scraping a real agent's
//! `metrics.listen` while it delivers to a real mosquitto.
//!
//! Every panel's and variable's expression, and every quantity a rule
//! judges, must return a series: they are read out of the files, so a new
//! panel or rule is covered without touching this test. Dashboard variables
//! (`$instance`, `$stream`) become a regex that matches anything, Grafana's
//! `$__rate_interval` a window of 15 s. The rules are loaded from a copy of
//! the shipped file in which every `for:` is `1s` (nothing else changed), and
//! Prometheus scrapes and evaluates every second, so the whole test takes
//! seconds, not the minutes the shipped `for:` durations ask for; stopping
//! the broker must then make `EdgespoolOffline` fire.
//!
//! The agent runs in receipt mode with a real `edgespool sink` storing into
//! SQLite and sending receipts, so the receipts panels and rules are held
//! against real series too. The rules' meaning is pinned by the promtool
//! unit tests shipped beside them (`edgespool-alerts.test.yml`), run here;
//! and every family the agent renders, the dashboard reads or a rule
//! judges is in the metrics table of docs/operations.md.
//!
//! Skipped, with a message, only when `prometheus` or `promtool` is not
//! installed (`cross/setup-debian.sh` installs Debian's `prometheus`).

use crate::support::agent::AgentProc;
use crate::support::board::edit_config;
use crate::support::broker::Broker;
use crate::support::sink::{SinkProc, BROKER_EXTRA};
use crate::support::{free_port, tail, unique_suffix, wait_for};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Families the dashboard reads that the outage-budget work adds to the
/// agent (ingest rate, hold and drain time). Until the agent renders them
/// (no `# TYPE` line in its metrics), expressions naming them are skipped
/// with a message; once it does, they are checked like every other.
const OUTAGE_BUDGET_FAMILIES: &[&str] = &[
    "edgespool_outage_hold_seconds",
    "edgespool_backlog_drain_seconds",
    "edgespool_ingest_readings_per_second",
    "edgespool_flash_projected_bytes_per_day",
];

/// What Grafana's interval variables become in the test.
const TEST_RATE_INTERVAL: &str = "15s";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// True when `program --version` runs.
fn installed(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// One HTTP/1.0 GET on 127.0.0.1:`port`: (status code, body).
fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_owned()))
}

/// Percent-encoding of a query parameter (everything but unreserved bytes).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A real Prometheus on a free loopback port, with its own config, rules
/// and storage in a temp dir; killed on drop.
struct Prometheus {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrape `target` (job `edgespool`) and evaluate `rules` every second.
    fn start(target: &str, rules: &str) -> Prometheus {
        let dir = tempfile::tempdir().expect("tempdir for prometheus");
        let rules_path = dir.path().join("rules.yml");
        std::fs::write(&rules_path, rules).expect("write the rules copy");
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: edgespool\n    static_configs:\n      - targets: [\"{target}\"]\n",
                rules_path.display()
            ),
        )
        .expect("write prometheus.yml");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, port, dir };
        let ready = wait_for(Duration::from_secs(30), || {
            http_get(p.port, "/-/ready").is_ok_and(|(code, _)| code == 200)
        });
        assert!(ready, "prometheus never got ready\n{}", p.log_tail());
        p
    }

    fn log_tail(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default();
        tail(&text, 30)
    }

    /// `GET /api/v1/<path>`'s `data` (panics on an error status).
    fn api(&self, path: &str) -> Value {
        let (code, body) = http_get(self.port, &format!("/api/v1/{path}"))
            .unwrap_or_else(|e| panic!("GET /api/v1/{path}: {e}"));
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET /api/v1/{path}: {code} {e}: {body}"));
        assert_eq!(v["status"], "success", "GET /api/v1/{path}: {code} {body}");
        v["data"].clone()
    }

    /// The series `expr` returns now (instant query).
    fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api(&format!("query?query={}", encode(expr)));
        match &data["result"] {
            Value::Array(a) => a.clone(),
            // A scalar or string result is one value.
            Value::Null => Vec::new(),
            other => vec![other.clone()],
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every `expr` of every panel target, nested rows included.
fn panel_exprs(v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            if let (Some(Value::Array(targets)), title) = (m.get("targets"), m.get("title")) {
                for t in targets {
                    if let Some(e) = t["expr"].as_str() {
                        let title = title.and_then(Value::as_str).unwrap_or("?");
                        out.push((format!("panel {title:?}"), e.to_owned()));
                    }
                }
            }
            for (k, child) in m {
                if k != "targets" {
                    panel_exprs(child, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|c| panel_exprs(c, out)),
        _ => {}
    }
}

/// `expr` with the dashboard's variables and Grafana's interval variables
/// replaced; panics on a `$` left over (an unknown variable).
fn substitute(expr: &str, vars: &[String]) -> String {
    let mut e = expr.to_owned();
    for g in ["$__rate_interval", "$__interval", "$__range"] {
        e = e.replace(g, TEST_RATE_INTERVAL);
    }
    for name in vars {
        e = e
            .replace(&format!("${{{name}:regex}}"), ".+")
            .replace(&format!("${{{name}}}"), ".+")
            .replace(&format!("[[{name}]]"), ".+")
            .replace(&format!("${name}"), ".+");
    }
    assert!(
        !e.contains('$'),
        "{expr:?} names a variable the dashboard does not define: {e}"
    );
    e
}

/// The dashboard's expressions, variables substituted: panel targets, and
/// each query variable's `label_values(SELECTOR, LABEL)` as SELECTOR.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = repo_file("packaging/grafana/edgespool.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let vars: Vec<&Value> = dash["templating"]["list"]
        .as_array()
        .map(|l| l.iter().collect())
        .unwrap_or_default();
    let names: Vec<String> = vars
        .iter()
        .filter_map(|v| v["name"].as_str().map(str::to_owned))
        .collect();
    let mut raw = Vec::new();
    panel_exprs(&dash["panels"], &mut raw);
    assert!(
        raw.len() >= 10,
        "only {} panel expressions found",
        raw.len()
    );
    for v in vars.iter().filter(|v| v["type"] == "query") {
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .expect("a query variable's query");
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.rsplit_once(','))
            .map(|(sel, _label)| sel.trim().to_owned())
            .unwrap_or_else(|| panic!("variable {}: not label_values(...): {q}", v["name"]));
        raw.push((format!("variable {}", v["name"]), inner));
    }
    raw.into_iter()
        .map(|(w, e)| {
            let s = substitute(&e, &names);
            (w, s)
        })
        .collect()
}

/// The operands a rule's expression judges: split at `and`/`or`/`unless`
/// and at comparison operators outside brackets and quotes, keeping the
/// left side of each comparison (`A > 1000 and deriv(B[30m]) > 0` gives
/// `A` and `deriv(B[30m])`).
fn judged_quantities(expr: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let (mut depth, mut quote, mut start) = (0i32, false, 0usize);
    let b = expr.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if quote {
            quote = c != b'"' || b[i - 1] == b'\\';
        } else if c == b'"' {
            quote = true;
        } else if matches!(c, b'(' | b'[' | b'{') {
            depth += 1;
        } else if matches!(c, b')' | b']' | b'}') {
            depth -= 1;
        } else if depth == 0 {
            let rest = &expr[i..];
            if let Some(op) = [" and ", " or ", " unless "]
                .iter()
                .find(|op| rest.starts_with(**op))
            {
                parts.push(expr[start..i].to_owned());
                i += op.len();
                start = i;
                continue;
            }
        }
        i += 1;
    }
    parts.push(expr[start..].to_owned());
    parts
        .iter()
        .map(|p| left_of_comparison(p).trim().to_owned())
        .collect()
}

/// `p` up to its first comparison operator outside brackets and quotes.
fn left_of_comparison(p: &str) -> &str {
    let (mut depth, mut quote) = (0i32, false);
    let b = p.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        if quote {
            quote = c != b'"' || b[i - 1] == b'\\';
        } else if c == b'"' {
            quote = true;
        } else if matches!(c, b'(' | b'[' | b'{') {
            depth += 1;
        } else if matches!(c, b')' | b']' | b'}') {
            depth -= 1;
        } else if depth == 0
            && (matches!(c, b'>' | b'<') || p[i..].starts_with("==") || p[i..].starts_with("!="))
        {
            return &p[..i];
        }
    }
    p
}

/// The shipped rules with every `for:` at 1 s, and how many were changed.
fn rules_for_the_test(shipped: &str) -> (String, usize) {
    let mut changed = 0;
    let text: Vec<String> = shipped
        .lines()
        .map(|l| match l.find("for: ") {
            Some(at) if l.trim_start().starts_with("for: ") => {
                changed += 1;
                format!("{}for: 1s", &l[..at])
            }
            _ => l.to_owned(),
        })
        .collect();
    (text.join("\n") + "\n", changed)
}

/// `promtool check ARGS` with `stdin`; panics with its output on failure.
fn promtool(args: &[&str], stdin: Option<&str>) {
    promtool_run("check", args, stdin);
}

/// `promtool VERB ARGS` with `stdin`; panics with its output on failure.
fn promtool_run(verb: &str, args: &[&str], stdin: Option<&str>) {
    let mut child = Command::new("promtool")
        .arg(verb)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    if let (Some(mut w), Some(text)) = (child.stdin.take(), stdin) {
        w.write_all(text.as_bytes()).expect("promtool stdin");
    }
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool {verb} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The agent's `/metrics` body.
fn agent_metrics(port: u16) -> String {
    let (code, body) = http_get(port, "/metrics").expect("GET the agent's /metrics");
    assert_eq!(code, 200, "{body}");
    body
}

/// The outage-budget family `expr` needs that the agent does not render.
fn awaited_family<'a>(expr: &str, metrics: &str) -> Option<&'a str> {
    OUTAGE_BUDGET_FAMILIES
        .iter()
        .copied()
        .find(|f| expr.contains(f) && !metrics.contains(&format!("# TYPE {f} ")))
}

/// The state of alert `name` in `/api/v1/alerts` (`None`: not active).
fn alert_state(p: &Prometheus, name: &str) -> Option<String> {
    p.api("alerts")["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["labels"]["alertname"] == name)
        .and_then(|a| a["state"].as_str().map(str::to_owned))
}

#[test]
fn the_dashboard_and_alert_rules_hold_against_a_real_prometheus_scraping_a_real_agent() {
    for program in ["prometheus", "promtool"] {
        if !installed(program) {
            eprintln!(
                "SKIPPED: `{program}` is not installed (Debian package `prometheus`; cross/setup-debian.sh installs it)"
            );
            return;
        }
    }
    let shipped = std::fs::read_to_string(repo_file("packaging/prometheus/edgespool-alerts.yml"))
        .expect("read the shipped rules");
    let (test_rules, shortened) = rules_for_the_test(&shipped);
    let alerts_in_file = shipped
        .lines()
        .filter(|l| {
            l.trim_start().starts_with("- alert:") || l.trim_start().starts_with("- record:")
        })
        .count();
    assert_eq!(shortened, alerts_in_file, "one `for:` line per rule");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("rules-test.yml"), &test_rules).expect("write");
    promtool(
        &[
            "rules",
            &repo_file("packaging/prometheus/edgespool-alerts.yml")
                .display()
                .to_string(),
        ],
        None,
    );
    promtool(
        &[
            "rules",
            &dir.path().join("rules-test.yml").display().to_string(),
        ],
        None,
    );

    // What the rules mean: the unit tests shipped beside them.
    promtool_run(
        "test",
        &[
            "rules",
            &repo_file("packaging/prometheus/edgespool-alerts.test.yml")
                .display()
                .to_string(),
        ],
        None,
    );

    let mut broker = Broker::start_with_config(BROKER_EXTRA);
    // The sink takes the device from the prefix's last level.
    let base = crate::prefix("dashboards");
    let prefix = format!("{base}/it-board");
    let cfg = crate::write_config(dir.path(), &broker.url(), &prefix, 200);
    let metrics_port = free_port();
    edit_config(&cfg, |t| {
        t.replace("summary_interval_secs = 2", "summary_interval_secs = 1")
            .replacen(
                "[mqtt]\n",
                &format!(
                    "[mqtt]\n{}receipt_timeout_secs = 10\n",
                    crate::support::keys::receipt_mode_toml()
                ),
                1,
            )
            + &format!("[metrics]\nlisten = \"127.0.0.1:{metrics_port}\"\n")
    });
    let sink_db = dir.path().join("sink.db");
    let sink = SinkProc::spawn_sqlite(
        broker.port(),
        &format!("{base}/+/events/#"),
        &sink_db,
        &format!("dash-sink-{}", unique_suffix()),
        dir.path(),
    );
    sink.wait_subscribed();
    let agent = AgentProc::spawn(&cfg, &[], dir.path());
    let up = wait_for(Duration::from_secs(30), || {
        http_get(metrics_port, "/metrics").is_ok_and(|(c, b)| {
            c == 200
                && b.contains("edgespool_mqtt_connected 1")
                && b.contains("edgespool_health{state=\"ok\"} 1")
                && b.lines().any(|l| {
                    l.strip_prefix("edgespool_receipts_total ")
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(|n| n > 0.0)
                })
        })
    });
    assert!(
        up,
        "the agent never showed itself connected, ok and receipted\n{}\n--- sink ---\n{}",
        agent.log_tail(30),
        tail(&sink.log_text(), 10)
    );
    let scraped = agent_metrics(metrics_port);
    promtool(&["metrics"], Some(&scraped));
    table_lists_every_family(&scraped);

    let prom = Prometheus::start(&format!("127.0.0.1:{metrics_port}"), &test_rules);
    let rules: Vec<Value> = prom.api("rules")["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(
        rules.len(),
        alerts_in_file,
        "Prometheus loaded every rule of the file"
    );

    let metrics = agent_metrics(metrics_port);
    let mut checks = dashboard_exprs();
    for r in &rules {
        let name = r["name"].as_str().expect("rule name");
        let query = r["query"].as_str().expect("rule query");
        for q in judged_quantities(query) {
            checks.push((format!("rule {name}"), q));
        }
    }
    let dash = std::fs::read_to_string(repo_file("packaging/grafana/edgespool.json"))
        .expect("read the dashboard");
    assert!(
        !dash.contains("__inputs") && !dash.contains("DS_PROMETHEUS"),
        "the dashboard declares a data source input it never uses"
    );
    for family in [
        "edgespool_health",
        "edgespool_rows_awaiting_receipt",
        "edgespool_oldest_awaiting_receipt_age_seconds",
        "edgespool_receipts_total",
        "edgespool_receipts_refused_total",
        "edgespool_spool_failed_rows",
        "process_resident_memory_bytes",
    ] {
        assert!(
            checks
                .iter()
                .any(|(w, e)| w.starts_with("panel") && e.contains(family)),
            "no panel reads {family}"
        );
    }
    let mut skipped = Vec::new();
    checks.retain(|(what, e)| match awaited_family(e, &metrics) {
        Some(f) => {
            skipped.push(format!("{what}: {e} (needs {f})"));
            false
        }
        None => true,
    });
    for s in &skipped {
        eprintln!("not checked yet: the agent does not render this family: {s}");
    }
    let mut empty: Vec<String> = Vec::new();
    let all_series = wait_for(Duration::from_secs(40), || {
        empty = checks
            .iter()
            .filter(|(_, e)| prom.query(e).is_empty())
            .map(|(w, e)| format!("{w}: {e}"))
            .collect();
        empty.is_empty()
    });
    assert!(
        all_series,
        "expressions that return no series:\n{}\n{}",
        empty.join("\n"),
        prom.log_tail()
    );
    println!(
        "{} expressions of the dashboard and the rules returned series ({} awaiting the outage-budget metrics)",
        checks.len(),
        skipped.len()
    );
    // Every rule evaluates without error, and the broker is up: not offline.
    let evaluated = wait_for(Duration::from_secs(20), || {
        prom.api("rules")["groups"][0]["rules"]
            .as_array()
            .is_some_and(|rs| rs.iter().all(|r| r["health"] == "ok"))
    });
    assert!(evaluated, "rules unhealthy: {}", prom.api("rules"));
    assert_eq!(
        alert_state(&prom, "EdgespoolOffline"),
        None,
        "offline while connected"
    );

    broker.kill();
    let fired = wait_for(Duration::from_secs(30), || {
        alert_state(&prom, "EdgespoolOffline").as_deref() == Some("firing")
    });
    assert!(
        fired,
        "EdgespoolOffline did not fire after the broker stopped: {:?}\n{}",
        prom.api("alerts"),
        agent.log_tail(20)
    );
    let series = prom.query("ALERTS{alertname=\"EdgespoolOffline\",alertstate=\"firing\"}");
    assert_eq!(series.len(), 1, "{series:?}");
}

/// Every family of the agent's scrape (`# TYPE` lines), and every
/// `edgespool_` and `process_` name the dashboard or the rules read, is in
/// the metrics table of docs/operations.md (issue 36: the table missed two
/// families the dashboard used).
fn table_lists_every_family(scraped: &str) {
    let docs = std::fs::read_to_string(repo_file("docs/operations.md")).expect("read the docs");
    let listed = metrics_table(&docs);
    let mut wanted: Vec<String> = scraped
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect();
    for file in [
        "packaging/grafana/edgespool.json",
        "packaging/prometheus/edgespool-alerts.yml",
    ] {
        let text = std::fs::read_to_string(repo_file(file)).expect("read");
        wanted.extend(metric_names(&text));
    }
    wanted.sort();
    wanted.dedup();
    let histogram_part = |n: &str| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| n.strip_suffix(s).is_some_and(|f| listed.contains(f)))
    };
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|n| !listed.contains(n.as_str()) && !histogram_part(n))
        .collect();
    assert!(
        missing.is_empty(),
        "families missing from the metrics table of docs/operations.md: {missing:?}"
    );
}

/// The metric names in the metrics table (the first cell of each row of
/// the table under "### Metrics (Prometheus)"), labels left off and
/// `a_{b,c}_d` expanded.
fn metrics_table(docs: &str) -> std::collections::BTreeSet<String> {
    let section = docs
        .split("### Metrics (Prometheus)")
        .nth(1)
        .expect("the metrics section");
    let mut names = std::collections::BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let cell = row.split(" | ").next().unwrap_or_default();
        for quoted in cell.split('`').skip(1).step_by(2) {
            names.extend(expand(quoted));
        }
    }
    names
}

/// `name{labels}` -> `name`; `a_{b,c}_d` -> `a_b_d`, `a_c_d`.
fn expand(quoted: &str) -> Vec<String> {
    let Some((head, rest)) = quoted.split_once('{') else {
        return vec![quoted.to_owned()];
    };
    let (inner, tail) = rest.split_once('}').unwrap_or((rest, ""));
    if tail.is_empty() {
        return vec![head.to_owned()];
    }
    inner
        .split(',')
        .flat_map(|alt| expand(&format!("{head}{alt}{tail}")))
        .collect()
}

/// Every `edgespool_...` and `process_...` name in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let at_start = i == 0 || !word(b[i - 1]);
        let rest = &text[i..];
        if at_start && (rest.starts_with("edgespool_") || rest.starts_with("process_")) {
            let end = rest.bytes().position(|c| !word(c)).unwrap_or(rest.len());
            // `process_*` in prose names no family.
            if !rest[..end].ends_with('_') {
                out.push(rest[..end].to_owned());
            }
            i += end;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn rule_expressions_are_split_into_what_they_judge() {
    assert_eq!(
        judged_quantities(
            "edgespool_spool_backlog_rows > 1000 and deriv(edgespool_spool_backlog_rows[30m]) > 0"
        ),
        [
            "edgespool_spool_backlog_rows",
            "deriv(edgespool_spool_backlog_rows[30m])"
        ]
    );
    assert_eq!(
        judged_quantities("increase(x{reason=~\"a|b\",s!=\"c>d\"}[15m]) > 0"),
        ["increase(x{reason=~\"a|b\",s!=\"c>d\"}[15m])"]
    );
    assert_eq!(judged_quantities("up{job=\"e\"} == 0"), ["up{job=\"e\"}"]);
    assert_eq!(
        substitute(
            "a{i=~\"$instance\",s=~\"${stream}\"}[$__rate_interval]",
            &["instance".into(), "stream".into()]
        ),
        "a{i=~\".+\",s=~\".+\"}[15s]"
    );
    assert_eq!(
        expand("edgespool_commands_{received,duplicates}_total"),
        [
            "edgespool_commands_received_total",
            "edgespool_commands_duplicates_total"
        ]
    );
    assert_eq!(expand("edgespool_health{state}"), ["edgespool_health"]);
    assert_eq!(
        metric_names("sum(rate(edgespool_a_total{x=\"edgespool_not\"}[5m])) and on (i) process_open_fds, process_*"),
        ["edgespool_a_total", "edgespool_not", "process_open_fds"]
    );
    let (copy, n) = rules_for_the_test("  - alert: A\n    expr: x\n    for: 10m\n");
    assert_eq!(
        (copy.as_str(), n),
        ("  - alert: A\n    expr: x\n    for: 1s\n", 1)
    );
}
