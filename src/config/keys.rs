//! Every key the board config accepts, as a full path (`spool.commit_window_ms`,
//! `sources[N].follow`, `commands.handlers[N].params.<name>.type`), read from
//! the same serde definitions the parser uses, so the list cannot drift from
//! what a config may say. Its one rule: **a key is listed only if serde would
//! take it**; the docs test holds docs/config.md against this list.
//!
//! How: [`RawConfig`] is deserialized from a walker that answers every struct
//! with all of the fields serde asks for (derive passes them to
//! `deserialize_struct`), an array with one element (`[N]`), a map with one
//! entry (`<name>`), and records the path of each value that is not a table.
//! An array or map of plain values (`args`, `env`, `columns`) is one key.
//! `[[sources]]` is the exception: an entry is read by its kind
//! ([`super::raw::source_keys`] lists the keys of every kind).

use super::raw::{source_keys, RawConfig};
use serde::de::value::{Error, StrDeserializer};
use serde::de::{DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::cell::RefCell;

/// The array of tables whose entries are read by kind.
const SOURCES: &str = "sources";

/// Every accepted key, sorted. `[N]` stands for an entry of an array of
/// tables, `<name>` for a key of the operator's choosing.
pub fn accepted_keys() -> Vec<String> {
    let out = RefCell::new(Vec::new());
    let walker = Walker {
        path: String::new(),
        leaf: String::new(),
        out: &out,
    };
    RawConfig::deserialize(walker).expect("the config's own definitions walk");
    let mut keys = out.into_inner();
    keys.extend(source_keys().iter().map(|k| format!("{SOURCES}[N].{k}")));
    keys.sort();
    keys.dedup();
    keys
}

/// One place in the config: `path` is where a table's fields go, `leaf`
/// the key recorded for a plain value here (an element of an array of plain
/// values records its array).
struct Walker<'a> {
    path: String,
    leaf: String,
    out: &'a RefCell<Vec<String>>,
}

impl<'a> Walker<'a> {
    fn field(&self, name: &str) -> Walker<'a> {
        let path = if self.path.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.path)
        };
        Walker {
            leaf: path.clone(),
            path,
            out: self.out,
        }
    }
    fn element(&self, suffix: &str) -> Walker<'a> {
        Walker {
            path: format!("{}{suffix}", self.path),
            leaf: self.leaf.clone(),
            out: self.out,
        }
    }
    fn record(&self) {
        self.out.borrow_mut().push(self.leaf.clone());
    }
}

macro_rules! plain {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.record();
            visitor.$visit($($value)?)
        })*
    };
}

impl<'de> Deserializer<'de> for Walker<'_> {
    type Error = Error;

    plain! {
        deserialize_bool => visit_bool(false),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char('x'),
        deserialize_str => visit_str("x"),
        deserialize_string => visit_str("x"),
        deserialize_bytes => visit_str("x"),
        deserialize_byte_buf => visit_str("x"),
        deserialize_identifier => visit_str("x"),
        // A value read as "whatever it is" (`mqtt.protocol`'s text or
        // integer) is a plain value.
        deserialize_any => visit_str("x"),
        deserialize_ignored_any => visit_unit(),
        deserialize_unit => visit_unit(),
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        // A source is read by its kind (raw::source), which no one walk can
        // take every kind of: its keys are listed from there instead.
        let walker = (self.path != SOURCES).then(|| self.element("[N]"));
        visitor.visit_seq(One { walker })
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let value = self.element(".<name>");
        visitor.visit_map(Fields {
            keys: vec![("<name>", value)],
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let keys = fields.iter().map(|f| (*f, self.field(f))).collect();
        visitor.visit_map(Fields { keys })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }
}

/// A sequence of one element.
struct One<'a> {
    walker: Option<Walker<'a>>,
}

impl<'de> SeqAccess<'de> for One<'_> {
    type Error = Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        self.walker.take().map(|w| seed.deserialize(w)).transpose()
    }
}

/// A table: each key with the walker of its value, in order.
struct Fields<'a> {
    keys: Vec<(&'static str, Walker<'a>)>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        match self.keys.first() {
            None => Ok(None),
            Some((name, _)) => {
                let key: StrDeserializer<'_, Error> = name.into_deserializer();
                seed.deserialize(key).map(Some)
            }
        }
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let (_, walker) = self.keys.remove(0);
        seed.deserialize(walker)
    }
}

#[cfg(test)]
mod tests {
    use super::accepted_keys;

    /// A config that sets `key` (to a value of no particular type) and only
    /// what its tables need around it.
    fn setting(key: &str) -> String {
        let mut root = toml::Table::new();
        let mut cur = &mut root;
        let segs: Vec<&str> = key.split('.').collect();
        for (i, seg) in segs.iter().enumerate() {
            let (name, array) = match seg.strip_suffix("[N]") {
                Some(n) => (n, true),
                None => (*seg, false),
            };
            let name = if name == "<name>" { "p" } else { name };
            if i + 1 == segs.len() {
                cur.insert(name.to_owned(), toml::Value::Integer(1));
                break;
            }
            let entry = if array {
                let a = cur.entry(name.to_owned()).or_insert_with(|| {
                    toml::Value::Array(vec![toml::Value::Table(toml::Table::new())])
                });
                a.as_array_mut()
                    .and_then(|a| a.first_mut())
                    .expect("one entry")
            } else {
                cur.entry(name.to_owned())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            };
            cur = entry.as_table_mut().expect("a table");
        }
        toml::to_string(&root).expect("TOML")
    }

    fn unknown_to_the_parser(key: &str) -> bool {
        match crate::config::parse(&setting(key), "test", &[]) {
            Ok(_) => false,
            Err(e) => e
                .problems
                .iter()
                .any(|p| p.message.starts_with("unknown key")),
        }
    }

    #[test]
    fn every_listed_key_is_one_the_parser_takes() {
        let keys = accepted_keys();
        assert!(keys.len() > 100, "only {} keys: {keys:?}", keys.len());
        for k in [
            "device_id",
            "spool.commit_window_ms",
            "mqtt.protocol",
            "sources[N].follow",
            "sources[N].args",
            "sources[N].columns",
            "ingest.streams[N].priority",
            "commands.handlers[N].params.<name>.type",
            "commands.handlers[N].env",
            "commands.config_push.public_keys",
            "signed.serial",
        ] {
            assert!(keys.iter().any(|x| x == k), "{k} is not listed: {keys:?}");
        }
        let refused: Vec<&String> = keys.iter().filter(|k| unknown_to_the_parser(k)).collect();
        assert!(
            refused.is_empty(),
            "listed, but refused as unknown: {refused:?}"
        );
    }

    #[test]
    fn a_key_the_parser_refuses_is_not_listed() {
        for k in [
            "spool.acked_retenton_secs",
            "sources[N].nonsense",
            "nonsense",
        ] {
            assert!(unknown_to_the_parser(k), "{k} was not refused");
            assert!(!accepted_keys().iter().any(|x| x == k));
        }
    }
}
