//! Whether a bridge's local broker is the agent's own main broker (`[mqtt]`
//! `url`), so that topics taking the agent's events would loop them back in
//! (issue 21 measured 10 readings becoming 918 events in 10 s).
//!
//! Its one rule: **two URLs name one broker when they reach one socket
//! address**, not when their text matches: `127.1`, `2130706433`,
//! `0x7f.0.0.1`, `[::ffff:127.0.0.1]`, `localhost` and `127.0.0.1` are one
//! host. Two checks: [`same_broker`] at config time reads every numeric
//! spelling and the loopback names without asking a resolver (a config
//! check must not wait on DNS); [`resolved_overlap`] at the bridge's start
//! resolves both names as a connect would and compares the addresses.
//! Every loopback address (`127.0.0.0/8`, `::1`, and the unspecified
//! `0.0.0.0` and `::`, which connect to this host) counts as this host.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};

/// What a bridge carries when its topics would take the agent's own events
/// back if its broker were the main one (built by the config, checked at
/// the bridge's start by [`resolved_overlap`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopGuard {
    /// Host of `mqtt.url`.
    pub main_host: String,
    /// Port of `mqtt.url`.
    pub main_port: u16,
    /// The first of the bridge's `topics` that takes the agent's events.
    pub topic: String,
    /// The agent's event topic it takes.
    pub own: String,
}

/// `host` as an address, without a resolver: a bracketed or bare IPv6
/// address (an IPv4-mapped one as its IPv4 address), an IPv4 address in any
/// form `inet_aton(3)` takes (1 to 4 parts, each decimal, octal with a
/// leading `0` or hexadecimal with `0x`: `127.1`, `2130706433`,
/// `0177.0.0.1`), or a loopback name (`localhost`, `*.localhost`,
/// `ip6-localhost`, `ip6-loopback`, `localhost.localdomain`, with or without
/// a trailing dot) as 127.0.0.1. `None`: a name only a resolver can answer.
pub fn numeric_host(host: &str) -> Option<IpAddr> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    let name = h.trim_end_matches('.').to_ascii_lowercase();
    let loopback_name = name == "localhost"
        || name.ends_with(".localhost")
        || name == "ip6-localhost"
        || name == "ip6-loopback"
        || name == "localhost.localdomain";
    if loopback_name {
        return Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    inet_aton(h).map(IpAddr::V4)
}

/// The IPv4 forms of `inet_aton(3)`: `a.b.c.d`, `a.b.c` (c: 16 bits),
/// `a.b` (b: 24 bits), `a` (32 bits); each part decimal, `0`-octal or
/// `0x`-hex.
fn inet_aton(s: &str) -> Option<Ipv4Addr> {
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let parts: Vec<u64> = s.split('.').map(part).collect::<Option<_>>()?;
    let (last, head) = parts.split_last()?;
    if head.len() > 3 || head.iter().any(|p| *p > 255) {
        return None;
    }
    let room = 8 * (4 - head.len() as u32);
    if room < 64 && *last >= 1u64 << room {
        return None;
    }
    let mut v: u64 = 0;
    for (i, p) in head.iter().enumerate() {
        v |= p << (24 - 8 * i as u32);
    }
    let v = u32::try_from(v | last).ok()?;
    Some(Ipv4Addr::from(v))
}

/// One part of an `inet_aton` address.
fn part(p: &str) -> Option<u64> {
    if let Some(hex) = p.strip_prefix("0x").or_else(|| p.strip_prefix("0X")) {
        return if hex.is_empty() {
            Some(0)
        } else {
            u64::from_str_radix(hex, 16).ok()
        };
    }
    if p.len() > 1 && p.starts_with('0') {
        return u64::from_str_radix(&p[1..], 8).ok();
    }
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse().ok()
}

/// Whether `ip` is this host (loopback, or unspecified: a connect to
/// `0.0.0.0` or `::` reaches this host's listeners).
fn this_host(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    ip.is_loopback() || ip.is_unspecified()
}

/// Two addresses of one host: equal, or both this host.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    let (a, b) = (a.to_canonical(), b.to_canonical());
    a == b || (this_host(a) && this_host(b))
}

/// Whether `a` and `b` (host, port) name one broker as far as can be told
/// without a resolver: the same port, and the same host by text (ignoring
/// case and a trailing dot) or by address ([`numeric_host`]).
pub fn same_broker((a_host, a_port): (&str, u16), (b_host, b_port): (&str, u16)) -> bool {
    if a_port != b_port {
        return false;
    }
    let text = |h: &str| h.trim_end_matches('.').to_ascii_lowercase();
    if text(a_host) == text(b_host) {
        return true;
    }
    match (numeric_host(a_host), numeric_host(b_host)) {
        (Some(a), Some(b)) => same_ip(a, b),
        _ => false,
    }
}

/// The socket addresses `host:port` resolves to, as a connect would try them.
///
/// Errors: the resolver's, as a sentence.
fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    if let Some(ip) = numeric_host(host) {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let h = host.trim_start_matches('[').trim_end_matches(']');
    (h, port)
        .to_socket_addrs()
        .map(Iterator::collect)
        .map_err(|e| format!("cannot resolve {host}: {e}"))
}

/// Resolve the bridge's broker (`bridge`) and the main broker (`main`) and
/// return the pair of addresses they share (same port, same host as
/// [`same_broker`] judges addresses), if any.
///
/// Errors: either name does not resolve (the caller tries again at its
/// next connect).
pub fn resolved_overlap(
    bridge: (&str, u16),
    main: (&str, u16),
) -> Result<Option<(SocketAddr, SocketAddr)>, String> {
    let ours = resolve(bridge.0, bridge.1)?;
    let theirs = resolve(main.0, main.1)?;
    Ok(ours.iter().find_map(|a| {
        theirs
            .iter()
            .find(|b| a.port() == b.port() && same_ip(a.ip(), b.ip()))
            .map(|b| (*a, *b))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_loopback_is_this_host() {
        let main = ("127.0.0.1", 1883);
        for h in [
            "127.0.0.1",
            "127.1",
            "127.0.1",
            "2130706433",
            "0x7f000001",
            "0x7f.1",
            "0177.0.0.1",
            "[::ffff:127.0.0.1]",
            "::ffff:127.0.0.1",
            "[::1]",
            "localhost",
            "LOCALHOST.",
            "broker.localhost",
            "ip6-localhost",
            "127.0.0.2",
            "0.0.0.0",
            "0",
            "[::]",
        ] {
            assert!(same_broker((h, 1883), main), "{h}");
        }
        assert!(!same_broker(("127.1", 1884), main));
        assert!(!same_broker(("192.168.1.5", 1883), main));
        assert!(!same_broker(("broker.example", 1883), main));
        assert!(same_broker(
            ("Broker.Example.", 1883),
            ("broker.example", 1883)
        ));
        assert!(same_broker(("3232235777", 8883), ("192.168.1.1", 8883)));
    }

    #[test]
    fn inet_aton_forms_and_their_limits() {
        let v4 = |s| inet_aton(s).map(|a| a.to_string());
        assert_eq!(v4("1.2.3.4").as_deref(), Some("1.2.3.4"));
        assert_eq!(v4("1.2.772").as_deref(), Some("1.2.3.4"));
        assert_eq!(v4("1.131844").as_deref(), Some("1.2.3.4"));
        assert_eq!(v4("16909060").as_deref(), Some("1.2.3.4"));
        assert_eq!(v4("0x1.0x2.03.4").as_deref(), Some("1.2.3.4"));
        for bad in [
            "",
            "1.2.3.4.5",
            "256.1.1.1",
            "1.2.65536",
            "4294967296",
            "1.2.3.a",
            "08",
            "1..2",
            "a.b",
        ] {
            assert_eq!(inet_aton(bad), None, "{bad}");
        }
        assert_eq!(numeric_host("broker.example"), None);
    }

    #[test]
    fn resolution_finds_the_shared_address() {
        let hit = resolved_overlap(("localhost", 1883), ("127.0.0.1", 1883)).unwrap();
        assert!(hit.is_some());
        assert_eq!(
            resolved_overlap(("127.0.0.1", 1884), ("127.0.0.1", 1883)).unwrap(),
            None
        );
    }
}
