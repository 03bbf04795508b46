//! A PostgreSQL conninfo as it may be shown: every password in it replaced
//! by `***`, in both libpq forms (pure).
//!
//! Its one rule: **no text of a password reaches a message**. A conninfo
//! that fails to parse is reported through [`redact`] and the error of
//! parsing the redacted text, never the error of the original (whose words
//! can be pieces of a misquoted password).

/// `conninfo` with the value of every `password` replaced by `***`:
/// keyword/value pairs (a quoted value, `\` escapes, or a word), or a
/// `postgres://` / `postgresql://` URL (the user info's password, and any
/// query parameter named `password`, in any case or percent-encoded; a URL
/// with an `@` outside its user info is hidden whole but for its scheme).
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
    let (scheme, rest) = url.split_at(scheme_end);
    // The user info is what precedes one `@` that comes before the path,
    // query and fragment. Any other `@` (two of them, or one after a `/`,
    // `?` or `#`) makes the split ambiguous (libpq and tokio-postgres cut
    // at different ones), so all but the scheme is hidden.
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let ats: Vec<usize> = rest.match_indices('@').map(|(i, _)| i).collect();
    let (mut out, tail) = match ats.as_slice() {
        [] => (scheme.to_owned(), rest),
        [at] if *at < authority_end => {
            let creds = &rest[..*at];
            let shown = match creds.find(':') {
                Some(colon) => format!("{}:***", &creds[..colon]),
                None => creds.to_owned(),
            };
            (format!("{scheme}{shown}@"), &rest[at + 1..])
        }
        _ => return format!("{scheme}***"),
    };
    match tail.split_once('?') {
        None => out.push_str(tail),
        Some((base, query)) => {
            out.push_str(base);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if names_password(k) => format!("{k}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
    }
    out
}

/// Whether a URL query key names the password: `password` in any case,
/// percent-encoded or not; a key whose `%` escapes do not decode counts
/// too (hiding more than needed is safe).
fn names_password(key: &str) -> bool {
    let b = key.as_bytes();
    let mut decoded = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = key
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = hex else { return true };
            decoded.push(byte);
            i += 3;
        } else {
            decoded.push(b[i]);
            i += 1;
        }
    }
    decoded.eq_ignore_ascii_case(b"password")
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
        // Two `@`: which one ends the user info is ambiguous, so all of it goes.
        assert_eq!(redact("postgres://sink:p@ss@db/fleet"), "postgres://***");
        assert_eq!(
            redact("postgres://db/fleet?password=s3cret&connect_timeout=3"),
            "postgres://db/fleet?password=***&connect_timeout=3"
        );
        assert_eq!(
            redact("postgres://sink@db/fleet"),
            "postgres://sink@db/fleet"
        );
    }

    #[test]
    fn an_at_sign_outside_the_user_info_or_an_encoded_key_hides_the_password() {
        for url in [
            "postgres://db/fleet?password=p@ss",
            "postgres://u@db:5432/fleet?password=p@ss",
            "postgres://u:p@ss@db/fleet",
            "postgres://db/fleet?PassWord=pss",
            "postgres://db/fleet?pass%77ord=pss",
            "postgres://db/fleet?pass%7word=pss",
        ] {
            let shown = redact(url);
            assert!(
                !shown.contains("ss@") && !shown.contains("=pss"),
                "{url} -> {shown}"
            );
            assert!(has_password(url), "{url}");
        }
        assert_eq!(
            redact("postgres://u:secret@db/fleet?sslmode=require&password=x"),
            "postgres://u:***@db/fleet?sslmode=require&password=***"
        );
        assert_eq!(redact("postgres://db/fleet"), "postgres://db/fleet");
    }
}
