//! Who a delivery is from: the device and stream its topic names.
//!
//! Pure: no I/O. Its one rule: **a delivery's identity is the topic the
//! broker let its publisher use, read at one fixed position, never what
//! the payload claims**. With a broker ACL per device prefix (mosquitto
//! `pattern write edgespool/%u/#`, one user per device named by its device
//! id) the topic is the one thing a publisher cannot choose; an envelope
//! whose `device_id` or `stream` differs from its topic's is set aside
//! ([`Unreadable::Forged`]), never stored as an event, and dedup is scoped
//! per device.
//!
//! A topic is `<topic_prefix>/events/<stream>`, or batched
//! `<topic_prefix>/batches/<stream>[/lz4|/zstd]`; a device's default prefix
//! is `edgespool/<device_id>`, and the device is the prefix's last level.
//! Where that level is comes from the sink's filter ([`Shape`]): in
//! `edgespool/+/events/#` the level before `events`, the second. A
//! delivery on a topic of any other shape is set aside before it is read
//! (field case F8: a subscription to `edgespool/#` let device `evil`
//! publish `edgespool/evil/gw1/events/load` under its own prefix, and a
//! sink reading the device from the end of the topic stored it as gw1's),
//! and a filter that fixes no such level is refused. [`of_topic`] reads a
//! topic from its end, and is asked only about topics [`Shape::read`]
//! admitted, where it finds the same identity or none (then the delivery
//! is set aside). A prefix with a level named `events` or `batches` names
//! nobody (the agent refuses such a `mqtt.topic_prefix`).

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

/// The last level of the topic boards announce their holdings on
/// (`<topic_prefix>/holdings`, [`super::notes`]).
pub const HOLDINGS_LEVEL: &str = "holdings";

/// The topics a sink reads, fixed by its filter: `<prefix>/events/<stream>`
/// and `<prefix>/batches/<stream>[/<encoding>]`, `<prefix>/holdings`,
/// where `<prefix>` has exactly the filter's levels before its `events` (or
/// `batches`) level and the device is the last of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// The filter's levels before `events`/`batches`: each `+` or a name;
    /// the last is the device's.
    prefix: Vec<String>,
    /// The filter's last level when it names one stream (not `+` or `#`).
    stream: Option<String>,
}

impl Shape {
    /// The shape a sink subscribed with `filter` reads (a `$share/GROUP/`
    /// in front is the broker's, MQTT 5 §4.8.2, not the topic's).
    ///
    /// Errors: a filter whose second-to-last level is not `events` or
    /// `batches` (`edgespool/#`, `#`, `edgespool/+/events/+/#`) names no
    /// level for the device: it matches topics in which another device's
    /// id sits wherever the publisher likes; one with nothing before that
    /// level, a `#` before its end, an empty device level, or an `events`
    /// or `batches` level before the device's. The text names the filter
    /// and the shape the sink reads.
    ///
    /// A `$share/GROUP/` whose group is no ShareName ([`share_name`]) is
    /// refused the same way, naming the filter and the rule.
    pub fn of_filter(filter: &str) -> Result<Shape, String> {
        let (group, bare) = unshared(filter);
        if let Some(group) = group {
            share_name(group).map_err(|why| format!("filter {filter:?} {why}"))?;
        }
        let lv: Vec<&str> = bare.split('/').collect();
        let n = lv.len();
        let refuse = |why: &str| {
            Err(format!(
                "filter {filter:?} {why}: the sink reads events on \
                 <prefix>/<device>/events/<stream> (batched: <prefix>/<device>/batches/<stream>\
                 [/lz4|/zstd]), the device the level before events, so its filter must end in \
                 /events/# (or /events/+, /events/<stream>) after the device's level, e.g. \
                 \"edgespool/+/events/#\" (docs/fleet.md)"
            ))
        };
        if n < 3 || !reserved(lv[n - 2]) {
            return refuse("names no level for the device");
        }
        let prefix = &lv[..n - 2];
        if lv[..n - 1].iter().any(|l| l.contains('#'))
            || lv[n - 1].contains('#') && lv[n - 1] != "#"
        {
            return refuse("is not a valid filter ('#' only as the last level)");
        }
        if prefix.last().is_some_and(|d| d.is_empty()) {
            return refuse("has an empty device level");
        }
        if prefix.iter().any(|l| reserved(l)) {
            return refuse("has an events or batches level before the device's");
        }
        let stream = match lv[n - 1] {
            "#" | "+" => None,
            s => Some(s.to_owned()),
        };
        Ok(Shape {
            prefix: prefix.iter().map(|l| (*l).to_owned()).collect(),
            stream,
        })
    }

    /// The shape a sink reads that subscribes `filter` in the shared
    /// subscription `group` (`$share/GROUP/FILTER`, the group given on its
    /// own: `SinkOptions::shared_group`), or `filter` itself without one.
    ///
    /// Errors: as [`Shape::of_filter`] for `filter`; a group that is no
    /// ShareName ([`share_name`]) or a `filter` that is itself shared
    /// (`$share/` twice: the broker would read the second `$share/...` as
    /// the topic filter, which no topic matches). The text names the filter
    /// as it would be subscribed and the rule.
    pub fn of_subscription(filter: &str, group: Option<&str>) -> Result<Shape, String> {
        let Some(group) = group else {
            return Shape::of_filter(filter);
        };
        let shared = format!("$share/{group}/{filter}");
        share_name(group).map_err(|why| format!("filter {shared:?} {why}"))?;
        if filter.starts_with("$share/") {
            return Err(format!(
                "filter {shared:?} is shared twice: give its group once, on its own or as \
                 $share/<group>/ in the filter, not both"
            ));
        }
        Shape::of_filter(filter)
    }

    /// The level the device is read at, counted from 1: 2 in
    /// `edgespool/+/events/#`, 3 in `fleet/+/+/events/#` (the level before
    /// `events`). A broker's ACL must bind each device's client id (or
    /// user name) to exactly this level (docs/fleet.md).
    pub fn device_level(&self) -> usize {
        self.prefix.len()
    }

    /// Whether `topic`'s first levels are this shape's prefix: as many,
    /// each the filter's name or anything under its `+`, none of them
    /// `events` or `batches`, the device's not empty.
    fn prefix_fits(&self, lv: &[&str]) -> bool {
        let k = self.prefix.len();
        lv.len() > k
            && !lv[k - 1].is_empty()
            && self
                .prefix
                .iter()
                .zip(lv)
                .all(|(f, t)| (f == "+" || f == t) && !reserved(t))
    }

    /// The device and stream of `topic`, read at this shape's positions.
    ///
    /// Errors: a topic of another shape (other levels before `events`, more
    /// or fewer after it, an empty stream, a prefix level named `events`
    /// or `batches`); the text names the topic and the shape.
    pub fn read<'a>(&self, topic: &'a str) -> Result<TopicIdentity<'a>, String> {
        let lv: Vec<&str> = topic.split('/').collect();
        let k = self.prefix.len();
        let tail = &lv[k.min(lv.len())..];
        let fits = self.prefix_fits(&lv)
            && match tail {
                ["events", s] | ["batches", s] | ["batches", s, _] => {
                    !s.is_empty() && self.stream.as_deref().is_none_or(|w| w == *s)
                }
                _ => false,
            };
        if !fits {
            return Err(format!(
                "topic {topic:?} is not of the shape this sink reads ({})",
                self
            ));
        }
        let len = lv[..k].iter().map(|l| l.len()).sum::<usize>() + k - 1;
        Ok(TopicIdentity {
            prefix: &topic[..len],
            device: lv[k - 1],
            stream: lv[k + 1],
        })
    }

    /// Whether `topic` is `<prefix>/holdings` of this shape (a board's
    /// holdings or answer).
    pub fn holdings(&self, topic: &str) -> bool {
        let lv: Vec<&str> = topic.split('/').collect();
        self.prefix_fits(&lv)
            && lv.len() == self.prefix.len() + 1
            && lv[self.prefix.len()] == HOLDINGS_LEVEL
    }

    /// Who published on `topic`, for the side tables' bounds per device:
    /// the level at this shape's device position (a topic this shape sets
    /// aside is its publisher's, whatever it names further on), `""` for a
    /// topic too short to have one.
    pub fn publisher<'a>(&self, topic: &'a str) -> &'a str {
        topic.split('/').nth(self.prefix.len() - 1).unwrap_or("")
    }
}

/// A filter's shared-subscription group and the filter after it
/// (`$share/GROUP/FILTER`, MQTT 5 §4.8.2), or `None` and the whole filter
/// for one without `$share/`. The group is not checked ([`share_name`]);
/// `$share/g` alone is group `g` and an empty filter.
pub fn unshared(filter: &str) -> (Option<&str>, &str) {
    match filter.strip_prefix("$share/") {
        Some(rest) => {
            let (group, bare) = rest.split_once('/').unwrap_or((rest, ""));
            (Some(group), bare)
        }
        None => (None, filter),
    }
}

/// Whether `group` may name a shared subscription's group
/// (`$share/GROUP/FILTER`): MQTT 5 §4.8.2 wants a ShareName of at least one
/// character, with no `/`, `+` or `#` (a broker may refuse the SUBSCRIBE,
/// or read another group and filter out of it).
///
/// Errors: the rule `group` breaks, worded to follow the filter's name
/// ("has an empty shared-subscription group: ...").
pub fn share_name(group: &str) -> Result<(), String> {
    let why = if group.is_empty() {
        "an empty"
    } else if group.contains(['/', '+', '#']) {
        "a '/', '+' or '#' in its"
    } else {
        return Ok(());
    };
    Err(format!(
        "has {why} shared-subscription group: MQTT 5 §4.8.2 wants the ShareName of \
         $share/<group>/<filter> to be at least one character, with no '/', '+' or '#' \
         (docs/fleet.md)"
    ))
}

/// The shape as docs and messages write it:
/// `edgespool/<device>/events/<stream>` (a `+` before the device's level
/// stays `+`, a stream the filter names is written out).
impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = self.prefix.len();
        for (i, l) in self.prefix.iter().enumerate() {
            match (i + 1 == k, l.as_str()) {
                (true, "+") => f.write_str("<device>/")?,
                _ => write!(f, "{l}/")?,
            }
        }
        match &self.stream {
            Some(s) => write!(f, "events/{s}"),
            None => f.write_str("events/<stream>"),
        }
    }
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

    fn shape(filter: &str) -> Shape {
        Shape::of_filter(filter).unwrap_or_else(|e| panic!("{filter}: {e}"))
    }

    fn at(s: &Shape, topic: &str) -> Option<(String, String, String)> {
        s.read(topic).ok().map(|t| {
            (
                t.prefix.to_owned(),
                t.device.to_owned(),
                t.stream.to_owned(),
            )
        })
    }

    fn owned(p: &str, d: &str, s: &str) -> Option<(String, String, String)> {
        Some((p.to_owned(), d.to_owned(), s.to_owned()))
    }

    #[test]
    fn the_filter_fixes_the_level_the_device_is_read_at() {
        let page = shape("edgespool/+/events/#");
        assert_eq!(page.to_string(), "edgespool/<device>/events/<stream>");
        let gw1 = owned("edgespool/gw1", "gw1", "load");
        for t in [
            "edgespool/gw1/events/load",
            "edgespool/gw1/batches/load",
            "edgespool/gw1/batches/load/lz4",
            "edgespool/gw1/batches/load/zstd",
            // An unknown encoding is the unbatcher's to refuse (unreadable).
            "edgespool/gw1/batches/load/gzip",
        ] {
            assert_eq!(at(&page, t), gw1, "{t}");
        }
        assert_eq!(shape("$share/ingest/edgespool/+/events/#"), page);
        let site = shape("site/+/+/events/+");
        assert_eq!(site.to_string(), "site/+/<device>/events/<stream>");
        assert_eq!(
            at(&site, "site/a/gw1/events/load"),
            owned("site/a/gw1", "gw1", "load")
        );
        let one = shape("es/d1/events/system");
        assert_eq!(one.to_string(), "es/d1/events/system");
        assert_eq!(
            at(&one, "es/d1/batches/system/lz4"),
            owned("es/d1", "d1", "system")
        );
        assert_eq!(at(&one, "es/d1/events/other"), None);
        assert_eq!(
            at(&shape("+/events/#"), "gw1/events/load"),
            owned("gw1", "gw1", "load")
        );
        assert_eq!(page.device_level(), 2);
        assert_eq!(site.device_level(), 3);
        assert_eq!(shape("+/events/#").device_level(), 1);
    }

    #[test]
    fn a_shared_subscription_needs_a_group_of_one_level_without_wildcards() {
        let page = shape("edgespool/+/events/#");
        for f in [
            "$share//edgespool/+/events/#",
            "$share/+/edgespool/+/events/#",
            "$share/#/edgespool/+/events/#",
            "$share/in+gest/edgespool/+/events/#",
            "$share/ingest#/edgespool/+/events/#",
            "$share/",
            "$share//",
        ] {
            let why = Shape::of_filter(f).expect_err(f);
            assert!(
                why.contains(&format!("{f:?}")) && why.contains("§4.8.2"),
                "{why}"
            );
        }
        // The group given on its own (`--share`): one that is no ShareName,
        // and a filter shared already, are named as they would be subscribed.
        for g in ["", "a/b", "a+", "#", "/"] {
            let why = Shape::of_subscription("edgespool/+/events/#", Some(g)).expect_err(g);
            let shared = format!("$share/{g}/edgespool/+/events/#");
            assert!(
                why.contains(&format!("{shared:?}")) && why.contains("§4.8.2"),
                "{why}"
            );
        }
        let why = Shape::of_subscription("$share/g/edgespool/+/events/#", Some("h"))
            .expect_err("shared twice");
        assert!(
            why.contains("\"$share/h/$share/g/edgespool/+/events/#\"") && why.contains("twice"),
            "{why}"
        );
        let why = Shape::of_subscription("edgespool/#", Some("ingest")).expect_err("no level");
        assert!(why.contains("names no level for the device"), "{why}");
        for (filter, group) in [
            ("edgespool/+/events/#", Some("ingest")),
            ("edgespool/+/events/#", None),
            ("$share/ingest/edgespool/+/events/#", None),
            ("$share/fleet-1.a_b/edgespool/+/events/#", None),
        ] {
            assert_eq!(
                Shape::of_subscription(filter, group).as_ref(),
                Ok(&page),
                "{filter} {group:?}"
            );
        }
    }

    // field case F8
    #[test]
    fn a_topic_of_another_shape_is_set_aside_as_its_publishers() {
        let page = shape("edgespool/+/events/#");
        for t in [
            "edgespool/evil/gw1/events/load",
            "edgespool/evil/x/gw1/events/load",
            "edgespool/evil/gw1/batches/load",
            "edgespool/evil/events/gw1/events/load",
            "edgespool/evil/events/load/gw1",
            "edgespool/evil/batches/load/lz4/x",
            "edgespool/evil/events/",
            "edgespool/evil/status",
            "edgespool/evil/receipts",
            "edgespool/evil/gw1/holdings",
            "edgespool/evil",
        ] {
            let why = page.read(t).expect_err(t);
            assert!(
                why.contains(&format!("{t:?}"))
                    && why.contains("edgespool/<device>/events/<stream>"),
                "{why}"
            );
            assert_eq!(page.publisher(t), "evil", "{t}");
            assert!(!page.holdings(t), "{t}");
        }
        for t in [
            "other/gw1/events/load",
            "edgespool//events/load",
            "edgespool/events/events/load",
            "edgespool/batches/batches/load",
            "events/load",
            "",
        ] {
            assert!(page.read(t).is_err(), "{t}");
        }
        assert!(page.holdings("edgespool/gw1/holdings"));
        assert!(!page.holdings("edgespool/events/holdings"));
        assert!(!page.holdings("other/gw1/holdings"));
    }

    // field case F8
    #[test]
    fn a_filter_that_fixes_no_device_level_is_refused() {
        for f in [
            "edgespool/#",
            "#",
            "+",
            "edgespool/+/+/#",
            "edgespool/+/events/+/#",
            "events/#",
            "edgespool/events/+/events/#",
            "edgespool//events/#",
            "edgespool/+/events/lo#d",
            "$share/g",
            "$share/g/edgespool/#",
            "",
        ] {
            let why = Shape::of_filter(f).expect_err(f);
            assert!(
                why.contains(&format!("{f:?}")) && why.contains("<device>/events/<stream>"),
                "{why}"
            );
        }
    }
}
