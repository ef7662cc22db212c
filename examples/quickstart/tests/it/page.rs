//! docs/quickstart.md quotes the example's code: every ```rust block of the page must appear,
//! character for character, in `src/lib.rs`, and every feature it names must exist.

use std::path::Path;

fn read(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The contents of the page's fenced blocks in `language`.
fn blocks(page: &str, language: &str) -> Vec<String> {
    let open = format!("```{language}");
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match &mut current {
            None if line.trim_end() == open => current = Some(String::new()),
            Some(block) if line.trim_end() == "```" => {
                found.push(std::mem::take(block));
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    found
}

#[test]
fn every_rust_block_of_the_page_is_in_the_example() {
    let page = read("../../docs/quickstart.md");
    let source = read("src/lib.rs");
    let quoted = blocks(&page, "rust");
    assert!(quoted.len() >= 4, "the page quotes the example's code");
    for block in quoted {
        assert!(
            source.contains(&block),
            "docs/quickstart.md quotes code that is not in examples/quickstart/src/lib.rs \
             (copy it again from the source):\n{block}"
        );
    }
}

#[test]
fn the_page_names_the_facade_features_that_exist() {
    let page = read("../../docs/quickstart.md");
    let facade = read("../../crates/handoff/Cargo.toml");
    let ours = read("Cargo.toml");
    let line = blocks(&page, "toml")
        .into_iter()
        .flat_map(|b| b.lines().map(str::to_owned).collect::<Vec<_>>())
        .find(|l| l.starts_with("handoff = "))
        .expect("the page's Cargo.toml lines add `handoff`");
    let features = line
        .split_once("features = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("the `handoff` line names features");
    for feature in features.split(',').map(|f| f.trim().trim_matches('"')) {
        assert!(
            facade.contains(&format!("\n{feature} = [")),
            "feature `{feature}` is not one of the facade's"
        );
        assert!(
            ours.contains(&format!("\"{feature}\"")),
            "the example does not use feature `{feature}` the page tells users to enable"
        );
    }
}

/// The relay's three forms on the page (flags, a TOML file, variables) name the same settings,
/// each as docs/relay.md's flag table does.
#[test]
fn the_relay_forms_agree_with_the_relay_page() {
    let page = read("../../docs/quickstart.md");
    let relay_page = read("../../docs/relay.md");
    let command = blocks(&page, "sh")
        .into_iter()
        .find(|b| b.starts_with("handoff relay --"))
        .expect("the page runs `handoff relay` with flags");
    let flags: Vec<&str> = command
        .split_whitespace()
        .filter(|word| word.starts_with("--"))
        .collect();
    assert!(flags.len() >= 4, "{command}");
    let file = blocks(&page, "toml")
        .into_iter()
        .find(|b| b.starts_with("database_url = "))
        .expect("the page's relay.toml");
    let variables = blocks(&page, "sh")
        .into_iter()
        .find(|b| b.starts_with("HANDOFF_DATABASE_URL=") && b.contains("handoff relay"))
        .expect("the page runs the relay from variables");
    for flag in flags {
        let row = format!("| `{flag}` | `");
        let variable = relay_page
            .lines()
            .find_map(|line| line.strip_prefix(row.as_str()))
            .and_then(|rest| rest.split_once('`'))
            .map(|(variable, _)| variable)
            .unwrap_or_else(|| panic!("docs/relay.md has no row for {flag}"));
        assert!(
            variables.contains(&format!("{variable}=")),
            "the variables' form lacks {variable} ({flag})"
        );
        let key = flag.trim_start_matches('-').replace('-', "_");
        assert!(
            file.lines().any(|l| l.starts_with(&format!("{key} = "))),
            "the file's form lacks `{key}` ({flag})"
        );
    }
}
