//! Metrics: the textfile and the `/metrics` listener of a running agent, the
//! listener's answers to requests it must refuse, and the summary line.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::{append_config, Board};
use crate::support::broker::Broker;
use crate::support::{free_port, wait_for};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

/// Send `request` raw and read the whole answer (the listener closes).
fn ask(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics listener");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    // A refused oversized request may be answered before all of it is sent.
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of the first sample line starting with `prefix` (name and
/// labels, as rendered).
pub(crate) fn sample(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
}

/// Every non-comment line is `name{labels} value` and every sample's family
/// has HELP and TYPE lines (a light check; the unit tests parse strictly).
fn assert_exposition(text: &str) {
    let mut typed = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap_or_default().to_owned());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (head, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        assert!(
            value == "+Inf" || value.parse::<f64>().is_ok(),
            "value in {line}"
        );
        let name = head.split('{').next().unwrap_or_default();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "no TYPE for {line}");
    }
}

/// If promtool is installed (Debian package `prometheus`), let it judge too.
fn promtool_check(text: &str) {
    let Ok(mut child) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    else {
        return;
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn get_metrics(addr: SocketAddr) -> String {
    let answer = ask(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("text/plain; version=0.0.4"), "{answer}");
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// The agent with `metrics.textfile` and `metrics.listen`: `/metrics` shows
/// it connected and rows acknowledged rising; garbage, an oversized head
/// and a POST get error statuses and the listener keeps serving; the
/// textfile is valid and rewritten at the stop; the summary line carries
/// backlog, oldest age, connected and drops.
#[test]
fn metrics_are_served_and_written_and_bad_requests_are_refused() {
    let broker = Broker::start();
    let prefix = crate::prefix("metrics");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 100);
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let prom = dir.path().join("edgespool.prom");
    append_config(
        &cfg,
        &format!(
            "[metrics]\ntextfile = \"{}\"\nlisten = \"{addr}\"\n",
            prom.display()
        ),
    );
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    let acked = |body: &str| sample(body, "edgespool_spool_rows_by_state{state=\"ACKED\"}");
    let mut first = 0.0;
    assert!(
        wait_for(Duration::from_secs(30), || {
            let Ok(t) = std::fs::read_to_string(&prom) else {
                return false;
            };
            first = acked(&t).unwrap_or(0.0);
            first > 0.0
        }),
        "the textfile never showed acknowledged rows\n{}",
        agent.log_tail(30)
    );
    let body = get_metrics(addr);
    assert_exposition(&body);
    promtool_check(&body);
    // The process, as client libraries show it, on the listener only: the
    // textfile is node_exporter's, which has process_* of its own.
    for family in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            sample(&body, &format!("{family} ")).is_some_and(|v| v > 0.0),
            "{family}: {body}"
        );
    }
    let file = std::fs::read_to_string(&prom).expect("textfile");
    assert!(!file.contains("process_"), "{file}");
    assert!(
        wait_for(Duration::from_secs(10), || sample(
            &get_metrics(addr),
            "edgespool_health{state=\"ok\"}"
        ) == Some(1.0)),
        "{}",
        get_metrics(addr)
    );
    assert_eq!(
        sample(&body, "edgespool_mqtt_connected "),
        Some(1.0),
        "{body}"
    );
    assert!(sample(&body, "edgespool_puback_latency_seconds_count").unwrap_or(0.0) > 0.0);
    assert!(
        wait_for(Duration::from_secs(20), || acked(&get_metrics(addr))
            .is_some_and(|n| n > first)),
        "rows acknowledged did not rise past {first}"
    );
    for (request, status) in [
        (&b"\x16\x03\x01\x02\x00garbage\r\n\r\n"[..], "400"),
        (
            b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
            "405",
        ),
        (b"GET /admin HTTP/1.1\r\n\r\n", "404"),
    ] {
        let answer = ask(addr, request);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{request:?}: {answer}"
        );
    }
    let oversized = format!(
        "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    assert!(ask(addr, oversized.as_bytes()).starts_with("HTTP/1.1 431 "));
    // A client that connects and says nothing is timed out, not waited for.
    let silent = TcpStream::connect(addr).expect("connect");
    assert_exposition(&get_metrics(addr));
    drop(silent);
    assert!(
        agent.wait_log(Duration::from_secs(10), "backlog="),
        "{}",
        agent.log_tail(20)
    );
    let log = agent.log_text();
    let summary = log
        .lines()
        .rfind(|l| l.contains("summary:"))
        .expect("a summary line");
    for key in [
        "backlog=",
        "oldest_unacked_secs=",
        "connected=1",
        "dropped=0",
    ] {
        assert!(summary.contains(key), "{key} missing: {summary}");
    }
    let status = agent.terminate(Duration::from_secs(15));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        agent.log_tail(30)
    );
    let last = std::fs::read_to_string(&prom).expect("textfile after stop");
    assert_exposition(&last);
    assert_eq!(
        sample(&last, "edgespool_mqtt_connected "),
        Some(0.0),
        "{last}"
    );
    assert!(
        TcpStream::connect(addr).is_err(),
        "the listener outlived the agent"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".prom.tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let db: &Path = &dir.path().join("spool.db");
    let (_, status_text, _) = run_cli(&["status", "--spool", db.to_str().expect("utf-8")]);
    assert!(
        status_text.contains("latency (recorded ") && status_text.contains("): PUBACK p50 "),
        "{status_text}"
    );
}

/// A textfile in a directory that does not exist is a WARN naming the path;
/// the agent keeps delivering.
#[test]
fn a_textfile_that_cannot_be_written_is_a_warning_and_delivery_goes_on() {
    let broker = Broker::start();
    let prefix = crate::prefix("metrics-nodir");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 100);
    let prom = dir.path().join("missing-dir/edgespool.prom");
    append_config(
        &cfg,
        &format!("[metrics]\ntextfile = \"{}\"\n", prom.display()),
    );
    let db = dir.path().join("spool.db");
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || {
            agent.log_text().contains(&format!(
                "metrics.textfile {}: cannot write",
                prom.display()
            )) && crate::support::spool::count_in_state(&db, "ACKED") > 0
        }),
        "{}",
        agent.log_tail(30)
    );
    std::thread::sleep(Duration::from_secs(3));
    let warnings = agent.log_text().matches("cannot write").count();
    assert_eq!(
        warnings,
        1,
        "repeats are rate-limited\n{}",
        agent.log_tail(30)
    );
    assert!(agent.is_running());
    agent.terminate(Duration::from_secs(15));
}

/// Finding 13: 20 trickling connections delayed a scrape to 65.6 s (one
/// connection at a time, each allowed 3 s). With 100 clients trickling a
/// byte at a time (reconnecting whenever they are dropped), a real
/// `GET /metrics` is still answered within a second, every time.
#[test]
fn a_scrape_is_answered_within_a_second_while_100_slow_clients_hold_connections() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    let broker = Broker::start();
    let prefix = crate::prefix("metrics-slow");
    let Board { dir, cfg, .. } = Board::new(&broker.url(), &prefix, 100);
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    append_config(&cfg, &format!("[metrics]\nlisten = \"{addr}\"\n"));
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || TcpStream::connect(addr).is_ok()),
        "the listener never came up\n{}",
        agent.log_tail(30)
    );
    assert_exposition(&get_metrics(addr));

    // 100 slow clients: each sends the start of a request, then one byte
    // of an endless header every 50 ms; one dropped is replaced at once.
    const SLOW: usize = 100;
    let stop = Arc::new(AtomicBool::new(false));
    let trickler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let prelude = b"GET /metrics HTTP/1.1\r\nX-Slow: ";
            let mut clients: Vec<(Option<TcpStream>, usize)> =
                (0..SLOW).map(|_| (None, 0)).collect();
            let mut reconnects = 0usize;
            while !stop.load(Ordering::Relaxed) {
                for (stream, sent) in clients.iter_mut() {
                    if stream.is_none() {
                        *stream = TcpStream::connect(addr).ok();
                        *sent = 0;
                        reconnects += 1;
                    }
                    let Some(s) = stream.as_mut() else { continue };
                    let byte = prelude.get(*sent).copied().unwrap_or(b'a');
                    if s.write_all(&[byte]).is_err() {
                        *stream = None;
                    } else {
                        *sent += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            reconnects
        })
    };
    // Let them all connect and start trickling.
    std::thread::sleep(Duration::from_secs(2));

    let mut times = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let mut s = TcpStream::connect(addr).expect("connect for the scrape");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let took = started.elapsed();
        let answer = String::from_utf8_lossy(&out).into_owned();
        println!(
            "scrape with {SLOW} slow clients: {took:?}, {} bytes",
            out.len()
        );
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        times.push(took);
        std::thread::sleep(Duration::from_millis(700));
    }
    stop.store(true, Ordering::Relaxed);
    let reconnects = trickler.join().expect("trickler");
    println!("scrape times: {times:?}; slow connections opened: {reconnects}");
    let worst = times.iter().max().copied().unwrap_or_default();
    assert!(
        worst < Duration::from_secs(1),
        "a scrape took {worst:?} with {SLOW} slow clients"
    );
    assert!(agent.is_running(), "{}", agent.log_tail(30));
    agent.terminate(Duration::from_secs(15));
}
