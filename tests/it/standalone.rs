//! The repository stands alone: a clone with nothing beside it builds,
//! checks its shipped configs and passes its tests. Nothing in the commands
//! of the README and docs/, the tests, the shipped configs, the benches, the
//! scripts or CI names a path that leaves the clone (a `../` that climbs out
//! of it).
//!
//! Each `../` path is resolved from where it is used: a script's and Rust's
//! own file paths (`#[path]`, `include_str!`) and a Markdown link's target
//! (`[text](target)`) from the file's folder, every other path (configs, README
//! commands, what tests and benches open) from the repository root, where
//! they run. A line
//! that names such a path on purpose, as an attacker's input the code must
//! refuse, says so with the words `hostile input` on the same line.

use std::path::{Component, Path, PathBuf};

/// Folders and files read, from the repository root.
const SCANNED: &[&str] = &[
    "README.md",
    "docs",
    "board-configs",
    "tests",
    "benches",
    "cross",
    ".ci",
    "fuzz/run.sh",
    "fuzz/fuzz_targets",
    "packaging",
    "src",
    "Cargo.toml",
    ".cargo",
];

/// Text files worth reading (fixtures of other kinds are data).
const EXTENSIONS: &[&str] = &["rs", "md", "toml", "sh", "service", "js", "json", "txt", ""];

#[test]
fn no_path_in_the_repository_leaves_the_clone() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for entry in SCANNED {
        collect(&root.join(entry), &mut files);
    }
    assert!(
        files.len() > 50,
        "only {} files found under {}",
        files.len(),
        root.display()
    );
    let mut escapes = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let dir = file.parent().unwrap_or(root);
        let script = file.extension().is_some_and(|e| e == "sh");
        let markdown = file.extension().is_some_and(|e| e == "md");
        for (n, line) in text.lines().enumerate() {
            if line.contains("hostile input") {
                continue;
            }
            // Scripts and Rust's own file paths (`#[path]`, `include_str!`)
            // resolve from the file's folder; every other path (a config's,
            // a README command's, one a test or a bench opens) from the
            // repository root, where they run.
            let from_file = script
                || ["#[path", "include_str!(", "include_bytes!("]
                    .iter()
                    .any(|k| line.contains(k));
            for path in parent_paths(line) {
                // A Markdown link's target is relative to the page.
                let link = markdown && line.contains(&format!("]({path}"));
                let base = if from_file || link { dir } else { root };
                if outside(root, base, &path) {
                    let rel = file.strip_prefix(root).unwrap_or(file);
                    escapes.push(format!("{}:{}: {path}", rel.display(), n + 1));
                }
            }
        }
    }
    assert!(
        escapes.is_empty(),
        "paths that leave the repository (a clone with nothing beside it has none of them):\n{}",
        escapes.join("\n")
    );
}

#[test]
fn the_replay_trace_ships_with_its_provenance() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let trace = std::fs::read(root.join("data/AirQualityUCI.csv")).expect("data/AirQualityUCI.csv");
    // The SOURCE file gives the trace's size, line count and licence.
    assert_eq!(
        trace.len(),
        785_065,
        "the trace is not byte-for-byte the UCI file"
    );
    assert_eq!(trace.iter().filter(|b| **b == b'\n').count(), 9472);
    let source = std::fs::read_to_string(root.join("data/AirQualityUCI.SOURCE.txt"))
        .expect("data/AirQualityUCI.SOURCE.txt");
    assert!(source.contains("CC BY 4.0"), "the licence is not named");
    assert!(source.contains("De Vito"), "the citation is missing");
}

/// Every `../`-path in `line`: a run of path characters starting with `../`.
fn parent_paths(line: &str) -> Vec<String> {
    let bytes = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = line[i..].find("../") {
        let start = i + at;
        // `.../x` (an ellipsis) is prose, not a path.
        if start > 0 && bytes[start - 1] == b'.' {
            i = start + 3;
            continue;
        }
        let end = line[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || "._-/".contains(c)))
            .map_or(line.len(), |e| start + e);
        // A bare `../` names nothing (prose, or this file's own reader).
        if end > start + 3 {
            out.push(line[start..end].to_owned());
        }
        i = end.max(start + 3);
    }
    out
}

/// Whether `path`, taken from `from`, lands outside `root`.
fn outside(root: &Path, from: &Path, path: &str) -> bool {
    let mut depth: Vec<Component<'_>> = Vec::new();
    let rel = from.strip_prefix(root).unwrap_or(Path::new(""));
    for c in rel.components().chain(Path::new(path).components()) {
        match c {
            // A `..` climbs one level (the guard pops it); none left: out.
            Component::ParentDir if depth.pop().is_none() => return true,
            Component::Normal(_) => depth.push(c),
            _ => {}
        }
    }
    false
}

fn collect(p: &Path, out: &mut Vec<PathBuf>) {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if matches!(
        name,
        "target" | "node_modules" | "corpus" | "artifacts" | ".git"
    ) {
        return;
    }
    if p.is_dir() {
        let Ok(entries) = std::fs::read_dir(p) else {
            return;
        };
        let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        for e in entries {
            collect(&e, out);
        }
    } else if p.is_file() {
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or_default();
        if EXTENSIONS.contains(&ext) {
            out.push(p.to_path_buf());
        }
    }
}

#[test]
fn the_path_reader_finds_what_climbs_out() {
    // Spelled in pieces, so this file itself names no path that climbs out.
    let up = concat!("..", "/");
    let root = Path::new("/r");
    assert_eq!(
        parent_paths(&format!(r#"path = "{up}shared/data/x.csv""#)),
        vec![format!("{up}shared/data/x.csv")]
    );
    assert!(parent_paths(&format!("topic `.{up}events/<stream>`")).is_empty());
    assert!(outside(root, Path::new("/r"), &format!("{up}shared/x")));
    assert!(outside(
        root,
        Path::new("/r/src/config"),
        &format!("{up}{up}{up}x")
    ));
    assert!(!outside(
        root,
        Path::new("/r/src/config"),
        &format!("{up}{up}board-configs/e.toml")
    ));
    assert!(!outside(
        root,
        Path::new("/r/cross"),
        &format!("{up}tests/fixtures/aedes")
    ));
}
