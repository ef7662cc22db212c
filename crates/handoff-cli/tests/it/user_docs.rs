//! The user pages (README.md and docs/**/*.md but the design page, the benchmarks page and the
//! changelog) speak to someone running handoff today: they cite no issue number, no brief, no
//! development session and no dated run (history is in CHANGELOG.md, reasoning in
//! docs/design.md, figures on docs/benchmarks.md), and the first use of a word with a special
//! meaning here (front, head, run, parked, hole, lane, mark, watermark) links to its entry in
//! docs/glossary.md.

use std::path::{Path, PathBuf};

use regex::Regex;

/// Pages that are not user pages: the design page, the benchmarks page and the changelog.
const NOT_USER_PAGES: &[&str] = &["docs/design.md", "docs/benchmarks.md", "CHANGELOG.md"];

/// Pages generated from the binaries' help (`handoff reference`): the words there are the
/// flags' help, checked for citations but not for glossary links.
const GENERATED: &[&str] = &["docs/configuration.md"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every user page, as `(path relative to the workspace, text)`.
fn user_pages() -> Vec<(String, String)> {
    let root = workspace();
    let mut paths = vec![PathBuf::from("README.md")];
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(root.join(&dir)).unwrap() {
            let entry = entry.unwrap();
            let relative = dir.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                dirs.push(relative);
            } else if relative.extension().is_some_and(|e| e == "md") {
                paths.push(relative);
            }
        }
    }
    let mut pages: Vec<(String, String)> = paths
        .into_iter()
        .map(|p| p.to_string_lossy().replace('\\', "/"))
        .filter(|p| !NOT_USER_PAGES.contains(&p.as_str()))
        .map(|p| {
            let text = std::fs::read_to_string(root.join(&p)).unwrap();
            (p, text)
        })
        .collect();
    pages.sort();
    pages
}

/// `text` with fenced code blocks and inline code spans blanked out (same length, so positions
/// and line numbers hold): sample output and commands may show ids, dates and `#2`.
fn prose(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.extend(line.chars().map(|c| if c == '\n' { c } else { ' ' }));
            continue;
        }
        if fenced {
            out.extend(line.chars().map(|c| if c == '\n' { c } else { ' ' }));
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                out.push(' ');
            } else if in_code && c != '\n' {
                out.push(' ');
            } else {
                out.push(c);
            }
        }
    }
    out
}

/// `(what, pattern)`: the citations a user page must not make.
fn citation_patterns() -> Vec<(&'static str, Regex)> {
    [
        ("an issue number", r"(?i)\bissues?[ -]#?\d+"),
        ("an issue or PR reference", r"(?:^|[\s(])#\d+\b"),
        ("the brief", r"(?i)\bthe brief\b"),
        ("a goal of the development", r"(?i)\bpeer goal\b"),
        (
            "a development session",
            r"(?i)\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)|this|previous|last|earlier|same) session\b|session's code",
        ),
        (
            "a comparison with an earlier commit",
            r"(?i)\bprevious commit\b|\bbefore this change\b|\bon main before\b|\bprevious release in the same\b",
        ),
        // A date in prose is a run's date; dates in code (timestamps of examples) are blanked.
        ("a dated run", r"\b20\d\d-\d\d-\d\d\b"),
    ]
    .into_iter()
    .map(|(what, pattern)| (what, Regex::new(pattern).unwrap()))
    .collect()
}

fn line_of(text: &str, at: usize) -> usize {
    text[..at].matches('\n').count() + 1
}

#[test]
fn user_pages_cite_no_issue_brief_or_past_run() {
    let patterns = citation_patterns();
    let mut found = Vec::new();
    let pages = user_pages();
    assert!(pages.len() > 15, "only {} user pages found", pages.len());
    for (path, text) in &pages {
        let prose = prose(text);
        for (what, pattern) in &patterns {
            for m in pattern.find_iter(&prose) {
                let line = line_of(&prose, m.start());
                found.push(format!(
                    "{path}:{line}: {what}: {:?}",
                    text.lines().nth(line - 1).unwrap_or_default()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "user pages cite what a user cannot follow (move history to CHANGELOG.md, reasoning to \
         docs/design.md, figures to docs/benchmarks.md):\n{}",
        found.join("\n")
    );
}

/// `(glossary anchor, the word's forms in prose)`. Patterns match the word's meaning here, not
/// its everyday senses ("in front of", "black hole", "run the tests").
fn glossary_terms() -> Vec<(&'static str, Regex)> {
    [
        ("front", r"\b(?:the|its|a|claim's|whose) fronts?\b"),
        ("head", r"\bheads?\b"),
        ("run", r"\b(?:unbroken|its|the) run (?:of|behind)\b"),
        ("parked", r"\bpark(?:ed|s|ing)?\b"),
        ("hole", r"(?i)\b(?:a|its|the|their|no|of) holes?\b"),
        ("lane", r"\blanes?\b"),
        ("mark", r"\b(?:the|a|its|their|each|every|relay's) marks?\b"),
        ("watermark", r"\bwatermarks?\b"),
    ]
    .into_iter()
    .map(|(anchor, pattern)| (anchor, Regex::new(pattern).unwrap()))
    .collect()
}

#[test]
fn glossary_words_link_to_the_glossary_where_first_used() {
    let terms = glossary_terms();
    let mut missing = Vec::new();
    for (path, text) in user_pages() {
        if path == "docs/glossary.md" || GENERATED.contains(&path.as_str()) {
            continue;
        }
        let prose = prose(&text);
        let lines: Vec<&str> = prose.lines().collect();
        for (anchor, pattern) in &terms {
            // Headings name things; the first use counted is in the text.
            let first = lines
                .iter()
                .enumerate()
                .filter(|(_, line)| !line.trim_start().starts_with('#'))
                .find_map(|(i, line)| pattern.find(line).map(|m| (i, m.start())));
            let Some((line, _)) = first else { continue };
            // The link is on that line or the next (a link wrapped after its text), or earlier.
            let link = format!("glossary.md#{anchor})");
            let upto: String = lines[..(line + 2).min(lines.len())].join("\n");
            if !upto.contains(&link) {
                missing.push(format!(
                    "{path}:{}: first `{anchor}` without a link to glossary.md#{anchor}: {:?}",
                    line + 1,
                    text.lines().nth(line).unwrap_or_default()
                ));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// The patterns catch what they are for: a test that cannot fail proves nothing.
#[test]
fn the_citation_patterns_catch_citations() {
    let patterns = citation_patterns();
    let catches = |text: &str| {
        let prose = prose(text);
        patterns.iter().any(|(_, p)| p.is_match(&prose))
    };
    for cited in [
        "As issue 21 asked, the claim parks.",
        "fixed in #12.",
        "what the brief requires",
        "measured in the seventh session",
        "Report of 2026-12-04",
        "on main before this change, 233 orders failed",
    ] {
        assert!(catches(cited), "not caught: {cited}");
    }
    for fine in [
        "```\nhead #2 OrderPaid\n```",
        "`--since 2026-12-04T10:00:00Z`",
        "the relay's session in `outbox_relays`",
    ] {
        assert!(!catches(fine), "caught: {fine}");
    }
    let terms = glossary_terms();
    let parked = &terms.iter().find(|(a, _)| *a == "parked").unwrap().1;
    assert!(parked.is_match("a claim parks the rows"));
    let hole = &terms.iter().find(|(a, _)| *a == "hole").unwrap().1;
    assert!(hole.is_match("behind a hole"));
    assert!(!hole.is_match("a proxy black hole"));
}

/// The defaults docs/relay.md's flag table states are the binary's: docs/configuration.md is
/// what `handoff reference` renders from the flags (tests/it/configuration.rs), so a row whose
/// default differs from the reference's names a default the relay does not have.
#[test]
fn the_relay_page_states_the_relays_defaults() {
    let root = workspace();
    let reference = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let start = reference.find("## `handoff relay`").unwrap();
    let end = start + reference[start..].find("\n## ").unwrap();
    let flag = Regex::new(r"^\| `(--[a-z0-9-]+)").unwrap();
    // A row of docs/relay.md's flag table: the flag alone in its first cell.
    let page_flag = Regex::new(r"^\| `(--[a-z0-9-]+)` \|").unwrap();
    // The default column of the reference's tables, by flag: the relay's (flag | variable |
    // TOML key | default | help) and that of the flags every command takes (flag | variable |
    // default | help).
    let every = reference.find("## Every command").unwrap();
    let every_end = every + reference[every..].find("\n## `").unwrap();
    let column = |table: &str, index: usize| -> Vec<(String, String)> {
        table
            .lines()
            .filter_map(|line| {
                let name = flag.captures(line)?.get(1)?.as_str().to_owned();
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                Some((name, cells.get(index)?.trim_matches('`').to_owned()))
            })
            .collect()
    };
    let defaults: std::collections::HashMap<String, String> = column(&reference[start..end], 4)
        .into_iter()
        .chain(column(&reference[every..every_end], 3))
        .collect();
    let page = std::fs::read_to_string(root.join("docs/relay.md")).unwrap();
    let mut compared = 0;
    let mut wrong = Vec::new();
    for line in page.lines() {
        let Some(name) = page_flag.captures(line).map(|c| c[1].to_owned()) else {
            continue;
        };
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let cell = cells.get(3).copied().unwrap_or_default().replace('`', "");
        // The first word: "33554432 (32 MiB)" states 33554432 (and 32 MiB).
        let stated = cell.split(' ').next().unwrap_or_default();
        let Some(actual) = defaults.get(&name) else {
            wrong.push(format!(
                "{name}: on docs/relay.md but not a `handoff relay` flag"
            ));
            continue;
        };
        // Defaults the reference renders in words (generated ids, the search_path, no value).
        if actual.is_empty() || !actual.chars().next().unwrap().is_ascii_alphanumeric() {
            continue;
        }
        let actual_first = actual.split(' ').next().unwrap_or_default();
        if ["generated", "search_path", "off"].contains(&actual_first) {
            continue;
        }
        compared += 1;
        if stated != actual_first && !cell.contains(actual.as_str()) {
            wrong.push(format!(
                "{name}: docs/relay.md says {stated:?}, the binary {actual:?}"
            ));
        }
    }
    assert!(compared >= 15, "only {compared} defaults compared");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The user pages use each flag's and variable's current name (`handoff_telemetry::env`): an
/// older spelling shows only where a page says that it still works (an alias, a fallback).
/// `DATABASE_URL` and `NATS_URL` are the common names many tools read, kept on purpose.
#[test]
fn user_pages_use_the_current_flag_and_variable_names() {
    use handoff_telemetry::env::{FALLBACKS, FLAG_ALIASES};
    let kept = ["DATABASE_URL", "NATS_URL"];
    let older: Vec<(&str, &str)> = FLAG_ALIASES
        .iter()
        .chain(FALLBACKS)
        .filter(|(_, old)| !kept.contains(old))
        .copied()
        .collect();
    let says_older = Regex::new(r"(?i)\b(alias|also|older|still)\b").unwrap();
    let mut found = Vec::new();
    for (path, text) in user_pages() {
        for (number, line) in text.lines().enumerate() {
            if says_older.is_match(line) {
                continue;
            }
            // "(or `AMQP_TLS_CA`)": a fallback named as such.
            let named_as_fallback = |old: &str| line.contains(&format!("or `{old}`"));
            let words: Vec<&str> = line
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
                .collect();
            // The console's `--consumer NAME=URL` is another concept than the consumers'
            // `--consumer-name` (flag_names.rs, OTHER_CONCEPTS).
            let console_consumer = |old: &str| {
                old == "--consumer"
                    && (line.contains("NAME=URL") || line.contains("/api/v1/consumers"))
            };
            for (name, old) in &older {
                if words.contains(old) && !named_as_fallback(old) && !console_consumer(old) {
                    found.push(format!("{path}:{}: {old} (now {name}): {line}", number + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}
