//! Who a delivery is from: the device and stream its topic names.
//!
//! Pure: no I/O. Its one rule: **a delivery's identity is the topic the
//! broker let its publisher use, never what the payload claims**. With a
//! broker ACL per device prefix (mosquitto `pattern write edgespool/%u/#`,
//! one user per device named by its device id) the topic is the one thing a
//! publisher cannot choose; an envelope whose `device_id` or `stream`
//! differs from its topic's is set aside ([`Unreadable::Forged`]), never
//! stored as an event, and dedup is scoped per device.
//!
//! A topic is `<topic_prefix>/events/<stream>`, or batched
//! `<topic_prefix>/batches/<stream>[/lz4|/zstd]`, read from its end in the
//! order of [`super::unbatch::topic_kind`]. The device is the last level of
//! the prefix (a device's default prefix is `edgespool/<device_id>`), the
//! stream the level after `events`/`batches`; receipts for the device go to
//! `<topic_prefix>/receipts`. A prefix with a level named `events` or
//! `batches` names nobody: under `pattern write edgespool/%u/#` device
//! `evil` may publish `edgespool/evil/events/gw1/events/load`, whose last
//! `events` would otherwise make it `gw1` (the agent refuses such a
//! `mqtt.topic_prefix`).

use super::message::{Event, Unreadable};

/// What a topic says about its publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicIdentity<'a> {
    /// The topic up to `/events/` or `/batches/`: the device's `topic_prefix`.
    pub prefix: &'a str,
    /// The prefix's last level.
    pub device: &'a str,
    /// The level after `events` or `batches`.
    pub stream: &'a str,
}

/// The device and stream `topic` names, or `None` for a topic of another
/// shape (no `events`/`batches` level, nothing before it, an empty level).
pub fn of_topic(topic: &str) -> Option<TopicIdentity<'_>> {
    let lv: Vec<&str> = topic.split('/').collect();
    let n = lv.len();
    // Index of the `events`/`batches` level; the stream follows it.
    let marker = if n >= 4 && lv[n - 3] == "batches" && matches!(lv[n - 1], "lz4" | "zstd") {
        n - 3
    } else if n >= 3 && matches!(lv[n - 2], "events" | "batches") {
        n - 2
    } else {
        return None;
    };
    let (device, stream) = (lv[marker - 1], lv[marker + 1]);
    if device.is_empty() || stream.is_empty() || lv[..marker].iter().any(|l| reserved(l)) {
        return None;
    }
    // The prefix's bytes: its levels and the separators between them.
    let len = lv[..marker].iter().map(|l| l.len()).sum::<usize>() + marker - 1;
    Some(TopicIdentity {
        prefix: &topic[..len],
        device,
        stream,
    })
}

/// Who published on `topic`, for the side tables' bounds per device: the
/// device [`of_topic`] names, else the level before the first
/// `events`/`batches` level (under `pattern write edgespool/%u/#` the
/// publisher's own: `edgespool/evil/events/gw1/events/load` is evil's),
/// else `""` (a topic of no known shape; all such share one bound).
pub fn publisher(topic: &str) -> &str {
    if let Some(t) = of_topic(topic) {
        return t.device;
    }
    let lv: Vec<&str> = topic.split('/').collect();
    match lv.iter().position(|l| reserved(l)) {
        Some(i) if i > 0 => lv[i - 1],
        _ => "",
    }
}

/// Whether a topic level is one the sink reads the identity by
/// (`events`, `batches`): no prefix may contain one.
pub fn reserved(level: &str) -> bool {
    crate::event::stream::reserved_level(level)
}

/// Whether `e`, delivered on `topic`, is the event of the device and
/// stream the topic names.
///
/// Errors: [`Unreadable::Forged`], naming the topic's identity and the
/// envelope's claim (or that the topic names none).
pub fn check(topic: &str, e: &Event) -> Result<(), Unreadable> {
    check_claims(topic, Some(&e.device_id), Some(&e.stream))
}

/// As [`check`], for a reader that found only some of the envelope's
/// fields: a claim that is absent is not checked (the topic's identity is
/// the one stored either way), a claim that is present must match.
///
/// Errors: as [`check`].
pub fn check_claims(
    topic: &str,
    device: Option<&str>,
    stream: Option<&str>,
) -> Result<(), Unreadable> {
    let Some(t) = of_topic(topic) else {
        return Err(Unreadable::Forged(format!(
            "topic {topic:?} names no device and stream (<prefix>/<device>/events/<stream>)"
        )));
    };
    let differs = |claim: Option<&str>, real: &str| claim.is_some_and(|c| c != real);
    if differs(device, t.device) || differs(stream, t.stream) {
        return Err(Unreadable::Forged(format!(
            "the envelope says device {:?} stream {:?}; its topic is device {:?} stream {:?}",
            device.unwrap_or(t.device),
            stream.unwrap_or(t.stream),
            t.device,
            t.stream
        )));
    }
    Ok(())
}

/// Where receipts for deliveries on `topic` go: `<topic_prefix>/receipts`.
pub fn receipts_topic(topic: &str) -> Option<String> {
    of_topic(topic).map(|t| format!("{}/receipts", t.prefix))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(topic: &str) -> Option<(&str, &str, &str)> {
        of_topic(topic).map(|t| (t.prefix, t.device, t.stream))
    }

    #[test]
    fn the_device_is_the_level_before_events_or_batches() {
        assert_eq!(
            id("edgespool/gw1/events/load"),
            Some(("edgespool/gw1", "gw1", "load"))
        );
        assert_eq!(
            id("site/a/gw1/batches/load"),
            Some(("site/a/gw1", "gw1", "load"))
        );
        assert_eq!(
            id("edgespool/gw1/batches/load/lz4"),
            Some(("edgespool/gw1", "gw1", "load"))
        );
        assert_eq!(
            id("edgespool/gw1/batches/load/zstd"),
            Some(("edgespool/gw1", "gw1", "load"))
        );
        assert_eq!(id("gw1/events/load"), Some(("gw1", "gw1", "load")));
        // As topic_kind reads them: the compressed form first, then events.
        assert_eq!(id("a/batches/batches/lz4"), Some(("a", "a", "batches")));
        assert_eq!(
            receipts_topic("edgespool/gw1/batches/load/lz4").as_deref(),
            Some("edgespool/gw1/receipts")
        );
    }

    #[test]
    fn a_topic_of_another_shape_names_nobody() {
        for t in [
            "events/load",
            "batches/load/lz4",
            "edgespool/gw1/status",
            "edgespool/gw1/events",
            "/events/load",
            "edgespool/gw1/events/",
            // A prefix with an `events` or `batches` level: device `evil`
            // may publish under edgespool/evil/#, and is not gw1.
            "edgespool/evil/events/gw1/events/load",
            "edgespool/evil/batches/gw1/events/load",
            "edgespool/evil/events/gw1/batches/load/lz4",
            "site/batches/events/tele",
            "load",
            "",
        ] {
            assert_eq!(id(t), None, "{t}");
            assert!(matches!(
                check_claims(t, None, None),
                Err(Unreadable::Forged(_))
            ));
        }
    }

    #[test]
    fn the_publisher_is_the_level_before_the_first_events_or_batches() {
        assert_eq!(publisher("edgespool/gw1/events/load"), "gw1");
        assert_eq!(publisher("edgespool/gw1/batches/load/lz4"), "gw1");
        assert_eq!(publisher("edgespool/evil/events/gw1/events/load"), "evil");
        assert_eq!(publisher("edgespool/evil/events/a/b"), "evil");
        assert_eq!(publisher("edgespool/evil/batches/x/y/z"), "evil");
        for t in ["events/load", "edgespool/gw1/status", "", "/events/x"] {
            assert_eq!(publisher(t), "", "{t}");
        }
    }

    #[test]
    fn a_claim_that_differs_from_the_topic_is_forged() {
        let t = "edgespool/evil/events/load";
        assert!(check_claims(t, Some("evil"), Some("load")).is_ok());
        assert!(check_claims(t, None, None).is_ok());
        let e = check_claims(t, Some("gw1"), Some("load")).unwrap_err();
        assert!(e.to_string().contains("\"gw1\""), "{e}");
        assert!(matches!(
            check_claims(t, Some("evil"), Some("other")),
            Err(Unreadable::Forged(_))
        ));
    }
}
