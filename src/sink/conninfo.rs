//! A PostgreSQL conninfo as it may be shown: every password in it replaced
//! by `***`, in both libpq forms (pure).
//!
//! Its one rule: **no text of a password reaches a message**. A conninfo
//! that fails to parse is reported through [`redact`] and the error of
//! parsing the redacted text, never the error of the original (whose words
//! can be pieces of a misquoted password).

/// `conninfo` with the value of every `password` replaced by `***`:
/// keyword/value pairs (a quoted value, `\` escapes, or a word), or a
/// `postgres://` / `postgresql://` URL (the user info's password, through
/// its last `@`, and any `password=` query parameter).
pub fn redact(conninfo: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        redact_url(conninfo)
    } else {
        redact_pairs(conninfo)
    }
}

/// Whether `conninfo` names a password (by [`redact`]'s reading).
pub fn has_password(conninfo: &str) -> bool {
    redact(conninfo) != conninfo
}

fn redact_url(url: &str) -> String {
    let scheme_end = url.find("://").map(|i| i + 3).unwrap_or(0);
    let mut out = String::with_capacity(url.len());
    let mut rest = &url[scheme_end..];
    out.push_str(&url[..scheme_end]);
    // The last `@` may sit inside a password that holds one: cut through it
    // (more is hidden than needed when a later `@` is in the query; safe).
    if let Some(at) = rest.rfind('@') {
        let creds = &rest[..at];
        match creds.find(':') {
            Some(colon) => {
                out.push_str(&creds[..colon]);
                out.push_str(":***");
            }
            None => out.push_str(creds),
        }
        out.push('@');
        rest = &rest[at + 1..];
    }
    match rest.split_once('?') {
        None => out.push_str(rest),
        Some((base, query)) => {
            out.push_str(base);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k == "password" => format!("{k}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
    }
    out
}

/// Keyword/value pairs as libpq reads them: `key = value`, the value
/// single-quoted (with `\` escapes) or up to the next blank (with `\`
/// escapes). A word that is not followed by `=` is kept and skipped.
fn redact_pairs(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut kept_from = 0;
    let mut i = 0;
    let blank = |i: usize| i < b.len() && b[i].is_ascii_whitespace();
    while i < b.len() {
        while blank(i) {
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        while blank(i) {
            i += 1;
        }
        if i >= b.len() || b[i] != b'=' {
            continue;
        }
        i += 1;
        while blank(i) {
            i += 1;
        }
        let value_start = i;
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = i.min(b.len());
        }
        if key == "password" {
            out.push_str(&s[kept_from..value_start]);
            out.push_str("***");
            kept_from = i;
        }
    }
    out.push_str(&s[kept_from..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_pair_is_hidden_in_every_spelling() {
        assert_eq!(
            redact("host=db password=s3cret user=u"),
            "host=db password=*** user=u"
        );
        assert_eq!(
            redact("password = 'a b\\' c' host=db"),
            "password = *** host=db"
        );
        assert_eq!(
            redact("host=db password='unterminated s3cret"),
            "host=db password=***"
        );
        assert_eq!(redact("password=s3\\ cret host=db"), "password=*** host=db");
        assert_eq!(redact("host=db"), "host=db");
        assert!(!has_password("host=db user=u"));
        assert!(has_password("host=db password=x"));
    }

    #[test]
    fn a_word_without_equals_does_not_stop_the_search() {
        let r = redact("host db password=s3cret");
        assert_eq!(r, "host db password=***");
        assert!(!r.contains("s3cret"));
    }

    #[test]
    fn a_quoted_value_naming_password_is_not_a_key() {
        assert_eq!(
            redact("application_name='password=x' host=db"),
            "application_name='password=x' host=db"
        );
    }

    #[test]
    fn a_url_hides_its_user_info_password_and_query_password() {
        assert_eq!(
            redact("postgresql://sink:s3cret@db:5432/fleet?sslmode=require"),
            "postgresql://sink:***@db:5432/fleet?sslmode=require"
        );
        assert_eq!(
            redact("postgres://sink:p@ss@db/fleet"),
            "postgres://sink:***@db/fleet"
        );
        assert_eq!(
            redact("postgres://db/fleet?password=s3cret&connect_timeout=3"),
            "postgres://db/fleet?password=***&connect_timeout=3"
        );
        assert_eq!(
            redact("postgres://sink@db/fleet"),
            "postgres://sink@db/fleet"
        );
    }
}
