//! TOML text → [`RawConfig`]: `--set` overrides, deserialization with the
//! key path, line and did-you-mean of a problem (field case F16).

use super::raw::{split_keyed, RawConfig};
use super::suggest::{retired, unknown_key};
use super::{ConfigError, Problem};

pub(super) fn single(origin: &str, key: &str, line: Option<usize>, msg: &str) -> ConfigError {
    ConfigError {
        origin: origin.to_owned(),
        problems: vec![Problem {
            key: key.to_owned(),
            line,
            message: msg.to_owned(),
        }],
        missing_file: false,
    }
}

pub(super) fn line_of(text: &str, offset: Option<usize>) -> Option<usize> {
    offset.map(|o| text[..o.min(text.len())].matches('\n').count() + 1)
}

pub(super) fn deserialize(
    text: &str,
    origin: &str,
    with_lines: bool,
) -> Result<RawConfig, ConfigError> {
    let de = toml::Deserializer::parse(text).map_err(|e| {
        let line = if with_lines {
            line_of(text, e.span().map(|s| s.start))
        } else {
            None
        };
        single(origin, "(syntax)", line, e.message().trim())
    })?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let (key, line, msg) = refusal(&e, text);
        single(origin, &key, line.filter(|_| with_lines), &msg)
    })
}

/// The key path, line and message of a deserialization error: serde's
/// "unknown field" and "missing field" reworded with the key in the path,
/// and a source's refusal ([`split_keyed`]) with its key joined to the
/// entry's path and the line where that key is written.
fn refusal(
    e: &serde_path_to_error::Error<toml::de::Error>,
    text: &str,
) -> (String, Option<usize>, String) {
    let inner = e.inner();
    let line = line_of(text, inner.span().map(|s| s.start));
    let msg = inner.message().trim();
    let key = path_string(e.path());
    if let Some((within, msg)) = split_keyed(msg) {
        // The line of the entry's own key (`columns` for `columns.x`): the
        // error's span is the whole entry's.
        let top = within.split(['.', '[']).next().unwrap_or(within);
        let line = locate(text, &format!("{key}.{top}")).or(line);
        let msg = plain_type_error(within, msg, None).unwrap_or_else(|| msg.to_owned());
        return (format!("{key}.{within}"), line, msg);
    }
    // serde_path_to_error already ends the path with the unknown key;
    // make sure it is there even if a future version stops at the table.
    if let Some((field, expected)) = unknown_field(msg) {
        let msg = unknown_key(&field, "", &expected);
        let key = match key {
            k if k.is_empty() => field,
            k if k.ends_with(&field) => k,
            k => format!("{k}.{field}"),
        };
        if let Some(replaced) = retired(&key) {
            return (key, line, replaced.to_owned());
        }
        return (key, line, msg);
    }
    match msg
        .strip_prefix("missing field `")
        .and_then(|r| r.split_once('`'))
    {
        Some((field, _)) if key.is_empty() => (field.to_owned(), line, MISSING.to_owned()),
        Some((field, _)) => (format!("{key}.{field}"), line, MISSING.to_owned()),
        None => {
            let written = inner.span().and_then(|s| text.get(s));
            let msg = plain_type_error(&key, msg, written).unwrap_or_else(|| msg.to_owned());
            (key, line, msg)
        }
    }
}

/// serde's type error (`invalid type: string "10k", expected u64`) in plain
/// words naming the expected form and the value given: `expected a whole
/// number of bytes, got "10k" (...)`. `key` gives the unit (`_bytes`,
/// `_secs`, `_ms` in its name); `written` is the value as the file spells it
/// (`1e3`, not serde's `1000.0`), when the error's span is that value alone.
/// `None` for any other message (kept as serde said it).
pub(super) fn plain_type_error(key: &str, msg: &str, written: Option<&str>) -> Option<String> {
    let rest = msg
        .strip_prefix("invalid type: ")
        .or_else(|| msg.strip_prefix("invalid value: "))?;
    let (unexpected, expected) = rest.rsplit_once(", expected ")?;
    let given = match written.map(str::trim) {
        Some(w) if !w.is_empty() && !w.contains(['\n', '=']) => w.to_owned(),
        _ => serde_unexpected(unexpected),
    };
    let form = expected_form(key, expected, given.starts_with('-'))?;
    let hint = match (
        given.strip_prefix('"').and_then(|g| g.strip_suffix('"')),
        &form,
    ) {
        (Some(inner), f) if f.starts_with("a whole number") || f.starts_with("a number") => {
            if inner.trim().parse::<f64>().is_ok() {
                format!(" (write it without the quotes: {})", inner.trim())
            } else if !unit_of(key).is_empty() {
                " (a plain number: the unit is in the key's name)".to_owned()
            } else {
                String::new()
            }
        }
        (Some(inner), f) if f == "true or false" && matches!(inner, "true" | "false") => {
            format!(" (write it without the quotes: {inner})")
        }
        _ => String::new(),
    };
    Some(format!("expected {form}, got {given}{hint}"))
}

/// serde's words for a value (`string "x"`, ``integer `3` ``, `sequence`)
/// as a reader writes it (`"x"`, `3`, `an array`).
fn serde_unexpected(u: &str) -> String {
    let ticked = |s: &str| s.trim_matches('`').to_owned();
    if let Some(s) = u.strip_prefix("string ") {
        return s.to_owned();
    }
    for prefix in ["integer ", "floating point ", "boolean ", "character "] {
        if let Some(v) = u.strip_prefix(prefix) {
            return ticked(v);
        }
    }
    match u {
        "sequence" => "an array".to_owned(),
        "map" => "a table".to_owned(),
        other => other.to_owned(),
    }
}

/// The unit a key's name carries (`spool.max_bytes`: ` of bytes`), or "".
fn unit_of(key: &str) -> &'static str {
    let leaf = key.rsplit(['.', ']']).next().unwrap_or(key);
    [
        ("_bytes", " of bytes"),
        ("_secs", " of seconds"),
        ("_ms", " of milliseconds"),
        ("_pages", " of pages"),
        ("_mb_per_day", " of megabytes a day"),
    ]
    .iter()
    .find(|(suffix, _)| leaf.ends_with(suffix))
    .map_or("", |(_, u)| *u)
}

/// The form serde `expected` (`u64`, `a string`, `struct RawSpool`) in
/// plain words, with the unit `key`'s name carries: `a whole number of
/// bytes`, `text in quotes`, `a table`. `None` for a form not known here.
fn expected_form(key: &str, expected: &str, negative: bool) -> Option<String> {
    let unit = unit_of(key);
    let whole = |range: &str| format!("a whole number{unit}{range}");
    Some(match expected {
        "u8" => whole(", 0 to 255"),
        "u16" => whole(", 0 to 65535"),
        "u32" => whole(", 0 to 4294967295"),
        "u64" | "usize" if negative => whole(", 0 or more"),
        "u64" | "usize" => whole(""),
        "i8" | "i16" | "i32" | "i64" | "isize" => whole(""),
        "f32" | "f64" => format!("a number{unit} (such as 1.5)"),
        "a string" => "text in quotes".to_owned(),
        "path string" => "a path in quotes".to_owned(),
        "a boolean" => "true or false".to_owned(),
        "a character" => "one character in quotes".to_owned(),
        "a sequence" => "an array ([...])".to_owned(),
        "a map" | "a table" => "a table".to_owned(),
        e if e.starts_with("struct ") => "a table".to_owned(),
        _ => return None,
    })
}

/// The message of a required key that is not written.
const MISSING: &str = "required key is missing";

/// The line (1-based) where `key` (`a.b`, `sources[2].c`, `device_id`) is
/// written in `text`, found by following table headers. `None` when the key
/// is not written (a missing key or a default).
pub(super) fn locate(text: &str, key: &str) -> Option<usize> {
    let (table, index, leaf) = match key.rsplit_once('.') {
        Some((t, leaf)) => match t.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok(), leaf),
            None => (t, None, leaf),
        },
        None => ("", None, key),
    };
    let mut current = String::new();
    let mut counts: std::collections::HashMap<String, usize> = Default::default();
    let mut current_index: Option<usize> = None;
    for (n, raw_line) in text.lines().enumerate() {
        let line = raw_line.trim();
        if let Some(h) = line
            .strip_prefix("[[")
            .and_then(|l| l.split_once("]]"))
            .map(|(h, _)| h.trim())
        {
            let c = counts.entry(h.to_owned()).or_insert(0);
            current = h.to_owned();
            current_index = Some(*c);
            *c += 1;
            continue;
        }
        if let Some(h) = line
            .strip_prefix('[')
            .and_then(|l| l.split_once(']'))
            .map(|(h, _)| h.trim())
        {
            current = h.to_owned();
            current_index = None;
            continue;
        }
        let in_table = current == table && (index.is_none() || index == current_index);
        if in_table {
            if let Some(rest) = line.strip_prefix(leaf) {
                if rest.trim_start().starts_with('=') {
                    return Some(n + 1);
                }
            }
        }
    }
    None
}

pub(super) fn path_string(p: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut s = String::new();
    for seg in p.iter() {
        match seg {
            Segment::Seq { index } => s.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    s
}

/// Split serde's standard "unknown field `x`, expected one of `a`, `b`" message.
pub(super) fn unknown_field(msg: &str) -> Option<(String, Vec<String>)> {
    let rest = msg.strip_prefix("unknown field `")?;
    let (field, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect();
    Some((field.to_owned(), expected))
}

/// Set `key.path=value` in `table`. Path segments are table keys or array
/// indexes (`sources.0.interval_ms`).
pub(super) fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (path, value) = spec
        .split_once('=')
        .ok_or_else(|| "expected key.path=value".to_owned())?;
    let path = path.trim();
    let value = value.trim();
    let parsed: toml::Value = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_owned()));
    let segs: Vec<&str> = path.split('.').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return Err(format!("bad key path {path:?}"));
    }
    let mut root = toml::Value::Table(std::mem::take(table));
    let res = set_path(&mut root, &segs, parsed, path);
    if let toml::Value::Table(t) = root {
        *table = t;
    }
    res
}

pub(super) fn set_path(
    cur: &mut toml::Value,
    segs: &[&str],
    value: toml::Value,
    path: &str,
) -> Result<(), String> {
    let Some((seg, rest)) = segs.split_first() else {
        *cur = value;
        return Ok(());
    };
    let next = match cur {
        toml::Value::Table(t) => t
            .entry((*seg).to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new())),
        toml::Value::Array(a) => {
            let idx: usize = seg
                .parse()
                .map_err(|_| format!("{path}: `{seg}` is not an array index"))?;
            let len = a.len();
            a.get_mut(idx)
                .ok_or_else(|| format!("{path}: index {idx} out of range (array has {len})"))?
        }
        _ => return Err(format!("{path}: `{seg}` is not inside a table or array")),
    };
    set_path(next, rest, value, path)
}
