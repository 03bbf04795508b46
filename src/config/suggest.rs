//! Did-you-mean: the known name closest to a misspelt one (field case F16),
//! and what replaced a key the config no longer takes.
//! Its one rule: **suggest only what is near** (a small edit distance), so a
//! word that is not a typo gets no suggestion; a removed key is never
//! silently ignored, it is refused with what replaced it.

/// Keys the config once took, with what replaced them: refused, never
/// ignored (a key that silently stopped meaning anything would leave a board
/// running on a setting its operator thinks is in force).
const RETIRED: &[(&str, &str)] = &[(
    "commands.operator_scopes",
    "removed: a scope is a name any sender can claim, so it no longer gives a command the \
     operator's reserved room; the operator is now a key: make one with `edgespool keygen --out \
     FILE`, list the public key it prints in commands.operator_public_keys, sign the operator's \
     commands with it (docs/commands.md, \"Signed commands\"), and delete this line",
)];

/// What replaced `key` (a full key path), if the config once took it.
pub(super) fn retired(key: &str) -> Option<&'static str> {
    RETIRED.iter().find(|(k, _)| *k == key).map(|(_, m)| *m)
}

/// The closest of `known` to `got` within a small edit distance (2, or a
/// quarter of the known name's length), if any.
pub(super) fn did_you_mean<S: AsRef<str>>(got: &str, known: &[S]) -> Option<String> {
    known
        .iter()
        .map(|k| (edit_distance(got, k.as_ref()), k.as_ref()))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.to_owned())
}

/// The message for a key not among `known`: "unknown key{what}", a
/// did-you-mean when one is near, and the known keys, e.g. ``unknown key;
/// did you mean `acked_retention_secs`? (known keys: path, ...)``.
pub(super) fn unknown_key<S: AsRef<str>>(got: &str, what: &str, known: &[S]) -> String {
    let list: Vec<&str> = known.iter().map(AsRef::as_ref).collect();
    let list = list.join(", ");
    match did_you_mean(got, known) {
        Some(s) => format!("unknown key{what}; did you mean `{s}`? (known keys: {list})"),
        None => format!("unknown key{what} (known keys: {list})"),
    }
}

/// Levenshtein distance in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
