//! The serde layer of `[[sources]]`: an entry is read by its `kind` into the
//! struct of that kind, so a key the kind does not take is refused while the
//! file is read, naming the kind, the key and the kinds it belongs to.
//!
//! Its one rule: **a source takes `kind`, the stream keys
//! ([`RawStreamDecl`]) and the keys of its kind's struct, nothing else**, and
//! every list of keys (in messages, in [`crate::config::accepted_keys`]) is
//! read from those structs, never written out a second time.
//!
//! How: the entry is read whole, its keys in the file's order; `kind` picks
//! the struct ([`KINDS`]); the first key that is neither a stream key nor
//! one of that struct's is refused; then the struct and the stream keys are
//! deserialized from what was read. serde's internally tagged enums are not
//! used: they buffer the entry the same way but lose the key of a mistyped
//! value, and `deny_unknown_fields` does not reach through them. A refusal's
//! key travels inside serde's error text ([`split_keyed`]):
//! `crate::config::read` joins it to the entry's path (`sources[2]`) and
//! finds its line.

use super::RawStreamDecl;
use crate::config::suggest::{did_you_mean, unknown_key};
use serde::de::value::MapDeserializer;
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;

/// One `[[sources]]` entry: the stream it feeds and what its kind reads.
#[derive(Debug)]
pub(in crate::config) struct RawSource {
    /// `name` and the stream keys, as an `[[ingest.streams]]` entry has them.
    pub(in crate::config) stream: RawStreamDecl,
    /// The keys of its `kind`.
    pub(in crate::config) kind: RawSourceKind,
}

/// A source's `kind` with the keys only that kind reads.
#[derive(Debug)]
pub(in crate::config) enum RawSourceKind {
    /// `kind = "system"`.
    System(RawSystemSource),
    /// `kind = "file"`.
    File(RawFileSource),
    /// `kind = "exec"`.
    Exec(RawExecSource),
    /// `kind = "replay"`.
    Replay(RawReplaySource),
    /// `kind = "mqtt"`: the local-broker bridge.
    Mqtt(RawBridgeSource),
}

impl RawSourceKind {
    /// `interval_ms` as written: `None` when unset, and always for kind
    /// "mqtt" (its readings arrive when published; it has no such key).
    pub(in crate::config) fn interval_ms(&self) -> Option<u64> {
        match self {
            RawSourceKind::System(s) => s.interval_ms,
            RawSourceKind::File(s) => s.interval_ms,
            RawSourceKind::Exec(s) => s.interval_ms,
            RawSourceKind::Replay(s) => s.interval_ms,
            RawSourceKind::Mqtt(_) => None,
        }
    }
}

/// `kind = "system"`: load, memory, CPU, uptime, network and temperatures.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawSystemSource {
    /// Default [`super::d_interval`], as for every kind read on a clock.
    pub(in crate::config) interval_ms: Option<u64>,
}

/// `kind = "file"`: one number read from a file, scaled.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawFileSource {
    pub(in crate::config) interval_ms: Option<u64>,
    /// Required (validation says so, naming the kind).
    pub(in crate::config) path: Option<PathBuf>,
    pub(in crate::config) scale: Option<f64>,
    pub(in crate::config) offset: Option<f64>,
    pub(in crate::config) field: Option<String>,
}

/// `kind = "exec"`: a program run at each tick, confined as a handler is.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawExecSource {
    pub(in crate::config) interval_ms: Option<u64>,
    /// Required, absolute (validation says so).
    pub(in crate::config) program: Option<PathBuf>,
    #[serde(default)]
    pub(in crate::config) args: Vec<String>,
    pub(in crate::config) timeout_ms: Option<u64>,
    pub(in crate::config) max_output_bytes: Option<usize>,
    pub(in crate::config) field: Option<String>,
    /// Variables besides `PATH` and `LANG`, as a handler's.
    #[serde(default)]
    pub(in crate::config) env: BTreeMap<String, String>,
    /// Run as this user (as a handler's `user`).
    pub(in crate::config) user: Option<String>,
    /// With `user`, the program's one group.
    pub(in crate::config) group: Option<String>,
}

/// `kind = "replay"`: the rows of a recorded CSV trace, paced by their time.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawReplaySource {
    pub(in crate::config) interval_ms: Option<u64>,
    /// Required (validation says so, naming the kind).
    pub(in crate::config) path: Option<PathBuf>,
    pub(in crate::config) delimiter: Option<String>,
    pub(in crate::config) decimal_comma: Option<bool>,
    #[serde(default)]
    pub(in crate::config) missing: Vec<String>,
    /// Required, at least one (validation says so).
    #[serde(default)]
    pub(in crate::config) timestamp_columns: Vec<String>,
    pub(in crate::config) timestamp_format: Option<String>,
    #[serde(default)]
    pub(in crate::config) columns: BTreeMap<String, String>,
    pub(in crate::config) speed: Option<f64>,
    pub(in crate::config) repeat: Option<bool>,
    pub(in crate::config) follow: Option<bool>,
    pub(in crate::config) timezone: Option<String>,
    pub(in crate::config) trace_id: Option<String>,
}

/// `kind = "mqtt"`: the local-broker bridge ([`crate::source::bridge`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(in crate::config) struct RawBridgeSource {
    pub(in crate::config) url: Option<String>,
    /// Required, at least one filter (validation says so).
    #[serde(default)]
    pub(in crate::config) topics: Vec<String>,
    pub(in crate::config) qos: Option<u8>,
    pub(in crate::config) client_id: Option<String>,
    pub(in crate::config) username: Option<String>,
    pub(in crate::config) password_file: Option<PathBuf>,
    pub(in crate::config) payload: Option<String>,
    pub(in crate::config) id_field: Option<String>,
    pub(in crate::config) max_payload_bytes: Option<usize>,
}

/// An entry's keys and values as written, in the file's order.
type Entries = Vec<(String, toml::Value)>;

/// A kind: the `kind` value naming it, the keys its struct reads, and how
/// that struct is read from an entry's keys.
struct Kind {
    name: &'static str,
    keys: fn() -> &'static [&'static str],
    read: fn(Entries) -> Result<RawSourceKind, Refusal>,
}

/// Every kind, in the order messages list them.
const KINDS: [Kind; 5] = [
    Kind {
        name: "system",
        keys: keys_of::<RawSystemSource>,
        read: |e| part(e).map(RawSourceKind::System),
    },
    Kind {
        name: "file",
        keys: keys_of::<RawFileSource>,
        read: |e| part(e).map(RawSourceKind::File),
    },
    Kind {
        name: "exec",
        keys: keys_of::<RawExecSource>,
        read: |e| part(e).map(RawSourceKind::Exec),
    },
    Kind {
        name: "replay",
        keys: keys_of::<RawReplaySource>,
        read: |e| part(e).map(RawSourceKind::Replay),
    },
    Kind {
        name: "mqtt",
        keys: keys_of::<RawBridgeSource>,
        read: |e| part(e).map(RawSourceKind::Mqtt),
    },
];

impl<'de> Deserialize<'de> for RawSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(Entry)
    }
}

impl RawSource {
    /// The entry `entries` by its kind; a refusal names the first key at fault.
    fn read(mut entries: Entries) -> Result<Self, Refusal> {
        let Some(at) = entries.iter().position(|(k, _)| k == "kind") else {
            // With no kind to judge by, a key no kind takes is named first,
            // as serde names an unknown key before a missing one.
            if let Some((key, _)) = entries.iter().find(|(k, _)| !all_keys().contains(&&**k)) {
                return Err(Refusal::keyed(key, unknown_key(key, "", all_keys())));
            }
            return Err(Refusal::Plain("missing field `kind`".to_owned()));
        };
        let (_, tag) = entries.remove(at);
        let name = String::deserialize(tag).map_err(|e| Refusal::keyed("kind", e.message()))?;
        let Some(kind) = KINDS.iter().find(|k| k.name == name) else {
            return Err(Refusal::keyed("kind", unknown_kind(&name)));
        };
        let stream_keys = keys_of::<RawStreamDecl>();
        let (stream, own): (Entries, Entries) = entries
            .into_iter()
            .partition(|(k, _)| stream_keys.contains(&&**k));
        if let Some((key, _)) = own.iter().find(|(k, _)| !(kind.keys)().contains(&&**k)) {
            return Err(Refusal::keyed(key, not_of_kind(kind, key)));
        }
        Ok(RawSource {
            kind: (kind.read)(own)?,
            stream: part(stream)?,
        })
    }
}

/// Every key a source may have under some kind, in the order messages list
/// them: `name`, `kind`, the kinds' own keys, the other stream keys.
pub(in crate::config) fn all_keys() -> &'static [&'static str] {
    static ALL: OnceLock<Vec<&'static str>> = OnceLock::new();
    ALL.get_or_init(|| known_keys(&KINDS)).as_slice()
}

/// The keys a source of one of `kinds` may have, as [`all_keys`] orders them.
fn known_keys(kinds: &[Kind]) -> Vec<&'static str> {
    let stream = keys_of::<RawStreamDecl>();
    let mut out = vec!["name", "kind"];
    let own = kinds.iter().flat_map(|k| (k.keys)().iter());
    for key in own.chain(stream).copied() {
        if !out.contains(&key) {
            out.push(key);
        }
    }
    out
}

/// `kind` names no kind: the kinds it may be, and a did-you-mean.
fn unknown_kind(got: &str) -> String {
    let names: Vec<String> = KINDS.iter().map(|k| format!("{:?}", k.name)).collect();
    let (last, rest) = names.split_last().map_or(("", &[][..]), |(l, r)| (l, r));
    let hint = did_you_mean(got, &KINDS.map(|k| k.name))
        .map(|s| format!("; did you mean {s:?}?"))
        .unwrap_or_default();
    format!("must be {} or {last} (got {got:?}){hint}", rest.join(", "))
}

/// `key`, written on a source of `kind`, is not one of its keys: say which
/// kinds take it, or that none does (with a did-you-mean among `kind`'s).
fn not_of_kind(kind: &Kind, key: &str) -> String {
    let known = known_keys(std::slice::from_ref(kind));
    let owners: Vec<String> = KINDS
        .iter()
        .filter(|k| (k.keys)().contains(&key))
        .map(|k| format!("{:?}", k.name))
        .collect();
    let of_kind = format!(" for kind {:?}", kind.name);
    match owners.split_last() {
        None => unknown_key(key, &of_kind, &known),
        Some((last, rest)) => {
            let owners = match rest {
                [] => format!("kind {last}"),
                _ => format!("kinds {} and {last}", rest.join(", ")),
            };
            format!(
                "not used by kind {:?}: a key of {owners} (known keys: {})",
                kind.name,
                known.join(", ")
            )
        }
    }
}

/// Deserialize `T` from an entry's keys, naming the key of a problem.
fn part<T: DeserializeOwned>(entries: Entries) -> Result<T, Refusal> {
    let de = MapDeserializer::<_, toml::de::Error>::new(entries.into_iter());
    serde_path_to_error::deserialize(de).map_err(|e| {
        let message = e.inner().message().to_owned();
        if e.path().iter().next().is_none() {
            // A missing key: serde's own words, which `config::read` rewords.
            Refusal::Plain(message)
        } else {
            Refusal::keyed(&e.path().to_string(), message)
        }
    })
}

/// Why an entry was refused.
#[derive(Debug)]
enum Refusal {
    /// A problem of the key `key` (a path within the entry: `columns.x`).
    Keyed { key: String, message: String },
    /// A problem serde words with its key (`missing field `name``).
    Plain(String),
}

impl Refusal {
    fn keyed(key: &str, message: impl Into<String>) -> Refusal {
        Refusal::Keyed {
            key: key.to_owned(),
            message: message.into(),
        }
    }

    /// As serde's error: a keyed refusal as `MARK key MARK message`.
    fn into_error<E: de::Error>(self) -> E {
        match self {
            Refusal::Keyed { key, message } => {
                E::custom(format!("{KEY_MARK}{key}{KEY_MARK}{message}"))
            }
            Refusal::Plain(message) => E::custom(message),
        }
    }
}

/// Brackets the key of a refusal in serde's error text (a `de::Error` is
/// made from a message only): a control character, in no key we read.
const KEY_MARK: char = '\u{1f}';

/// A refusal's key within its entry and its message, if `message` is one.
pub(in crate::config) fn split_keyed(message: &str) -> Option<(&str, &str)> {
    message.strip_prefix(KEY_MARK)?.split_once(KEY_MARK)
}

/// Reads an entry's keys in the file's order, then the entry by its kind.
struct Entry;

impl<'de> Visitor<'de> for Entry {
    type Value = RawSource;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a table")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawSource, A::Error> {
        let mut entries = Vec::new();
        while let Some(entry) = map.next_entry()? {
            entries.push(entry);
        }
        // Refused here, inside the entry's own deserializer, a problem
        // takes the entry's span (its line when the key has none).
        RawSource::read(entries).map_err(Refusal::into_error)
    }
}

/// The keys `T`'s derived `Deserialize` reads: the list it hands
/// `deserialize_struct`, caught by a deserializer that stops there.
fn keys_of<T: DeserializeOwned>() -> &'static [&'static str] {
    match T::deserialize(Catch) {
        Err(Caught(keys)) => keys,
        Ok(_) => &[],
    }
}

/// A deserializer that answers a struct with its list of keys, as an error.
struct Catch;

/// What [`Catch`] caught (empty for anything but a struct).
#[derive(Debug)]
struct Caught(&'static [&'static str]);

impl fmt::Display for Caught {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "keys {:?}", self.0)
    }
}

impl std::error::Error for Caught {}

impl de::Error for Caught {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Caught(&[])
    }
}

impl<'de> Deserializer<'de> for Catch {
    type Error = Caught;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Caught> {
        Err(Caught(&[]))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        keys: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Caught> {
        Err(Caught(keys))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{parse, ConfigError};

    /// The config of one source: `kind` and its `lines`, after a system
    /// source (so the entry at fault is `sources[1]`, on line 10 onwards).
    fn with_source(kind: &str, lines: &str) -> String {
        format!(
            "device_id = \"t\"\n[spool]\npath = \"/tmp/x/spool.db\"\n\
             [[sources]]\nname = \"sys\"\nkind = \"system\"\n\
             [[sources]]\nname = \"s\"\nkind = \"{kind}\"\n{lines}\n"
        )
    }

    fn refused(text: &str) -> ConfigError {
        let e = parse(text, "t.toml", &[]).expect_err("refused");
        assert_eq!(e.problems.len(), 1, "{e}");
        e
    }

    #[test]
    fn a_key_of_no_kind_is_refused_per_kind_with_the_kind_the_line_and_a_suggestion() {
        for (kind, extra, key, says) in [
            (
                "system",
                "intervall_ms = 5",
                "intervall_ms",
                "did you mean `interval_ms`?",
            ),
            ("file", "scael = 2.0", "scael", "did you mean `scale`?"),
            (
                "exec",
                "programm = \"/bin/x\"",
                "programm",
                "did you mean `program`?",
            ),
            (
                "replay",
                "timestamp_colums = [\"t\"]",
                "timestamp_colums",
                "did you mean `timestamp_columns`?",
            ),
            (
                "mqtt",
                "topic = [\"a/#\"]",
                "topic",
                "did you mean `topics`?",
            ),
        ] {
            let e = refused(&with_source(kind, extra));
            let p = &e.problems[0];
            assert_eq!(p.key, format!("sources[1].{key}"), "{e}");
            assert_eq!(p.line, Some(10), "{e}");
            assert!(
                p.message
                    .starts_with(&format!("unknown key for kind \"{kind}\"; {says}")),
                "{e}"
            );
            assert!(p.message.contains("(known keys: name, kind, "), "{e}");
        }
    }

    #[test]
    fn a_key_of_another_kind_is_refused_per_kind_naming_the_kinds_it_belongs_to() {
        for (kind, extra, key, owners) in [
            (
                "system",
                "path = \"/x\"",
                "path",
                "kinds \"file\" and \"replay\"",
            ),
            ("file", "topics = [\"a/#\"]", "topics", "kind \"mqtt\""),
            ("exec", "scale = 2.0", "scale", "kind \"file\""),
            ("replay", "program = \"/bin/x\"", "program", "kind \"exec\""),
            (
                "mqtt",
                "interval_ms = 500",
                "interval_ms",
                "kinds \"system\", \"file\", \"exec\" and \"replay\"",
            ),
        ] {
            let e = refused(&with_source(kind, extra));
            let p = &e.problems[0];
            assert_eq!(p.key, format!("sources[1].{key}"), "{e}");
            assert_eq!(p.line, Some(10), "{e}");
            assert!(
                p.message.starts_with(&format!(
                    "not used by kind \"{kind}\": a key of {owners} (known keys: name, kind, "
                )),
                "{e}"
            );
        }
        let e = refused(&with_source(
            "mqtt",
            "topics = [\"a/#\"]\ninterval_ms = 500",
        ));
        assert_eq!(
            e.to_string(),
            "t.toml:11: sources[1].interval_ms: not used by kind \"mqtt\": a key of kinds \
             \"system\", \"file\", \"exec\" and \"replay\" (known keys: name, kind, url, topics, \
             qos, client_id, username, password_file, payload, id_field, max_payload_bytes, \
             durability, priority, live_first, batch_max_events, batch_max_ms, compression)"
        );
    }

    #[test]
    fn an_unknown_kind_is_named_with_a_suggestion_and_its_line() {
        let e = refused(&with_source("sytem", ""));
        assert_eq!(
            e.to_string(),
            "t.toml:9: sources[1].kind: must be \"system\", \"file\", \"exec\", \"replay\" \
             or \"mqtt\" (got \"sytem\"); did you mean \"system\"?"
        );
        let e = refused(&with_source("sytem", "").replace("kind = \"sytem\"", "kind = 5"));
        assert_eq!(
            e.to_string(),
            "t.toml:9: sources[1].kind: expected text in quotes, got 5"
        );
    }

    #[test]
    fn a_mistyped_value_is_named_with_its_key_and_line_wherever_kind_is_written() {
        let e = refused(&with_source("replay", "path = \"/x\"\nspeed = \"fast\""));
        assert_eq!(
            e.to_string(),
            "t.toml:11: sources[1].speed: expected a number (such as 1.5), got \"fast\""
        );
        // Before `kind`, and inside a map.
        let text = with_source("replay", "path = \"/x\"")
            .replace("name = \"s\"\n", "name = \"s\"\ncolumns = { t = 5 }\n");
        let e = refused(&text);
        assert_eq!(
            e.to_string(),
            "t.toml:9: sources[1].columns.t: expected text in quotes, got 5"
        );
        let e = refused(&with_source("exec", "program = \"/x\"\nargs = [\"a\", 2]"));
        assert_eq!(e.problems[0].key, "sources[1].args[1]", "{e}");
        assert_eq!(e.problems[0].line, Some(11), "{e}");
        let e = refused(&with_source("system", "priority = 300"));
        assert_eq!(
            e.to_string(),
            "t.toml:10: sources[1].priority: expected a whole number, 0 to 255, got 300"
        );
    }

    #[test]
    fn a_missing_kind_or_name_is_named_and_a_key_of_no_kind_comes_first() {
        let text = "device_id = \"t\"\n[spool]\npath = \"/x\"\n[[sources]]\nname = \"s\"\n";
        let e = refused(text);
        assert_eq!(e.problems[0].key, "sources[0].kind");
        assert_eq!(e.problems[0].message, "required key is missing");
        let e = refused(&format!("{text}intervall_ms = 1\n"));
        assert_eq!(e.problems[0].key, "sources[0].intervall_ms");
        assert!(
            e.problems[0]
                .message
                .starts_with("unknown key; did you mean `interval_ms`? (known keys: name, kind, interval_ms, path,"),
            "{e}"
        );
        // On the line of the entry's header, as serde's own refusal was.
        let e = refused(&with_source("system", "").replace("name = \"s\"\n", ""));
        assert_eq!(e.problems[0].key, "sources[1].name");
        assert_eq!(e.problems[0].message, "required key is missing");
        assert_eq!(e.problems[0].line, Some(7));
    }

    #[test]
    fn overrides_are_refused_by_kind_too_without_lines() {
        let e = parse(
            &with_source("file", "path = \"/x\""),
            "t.toml",
            &["sources.1.qos=1".into()],
        )
        .expect_err("refused");
        assert_eq!(e.problems.len(), 1, "{e}");
        assert_eq!(e.problems[0].key, "sources[1].qos");
        assert_eq!(e.problems[0].line, None);
        assert!(e.problems[0]
            .message
            .starts_with("not used by kind \"file\": a key of kind \"mqtt\""));
    }

    #[test]
    fn every_kind_lists_its_own_keys_and_every_key_belongs_to_some_kind() {
        let all = super::all_keys();
        assert_eq!(&all[..3], ["name", "kind", "interval_ms"]);
        for k in super::KINDS {
            let keys = (k.keys)();
            assert!(!keys.is_empty(), "{}", k.name);
            assert!(keys.iter().all(|key| all.contains(key)), "{}", k.name);
        }
        assert_eq!(all.len(), 40, "{all:?}");
    }
}
