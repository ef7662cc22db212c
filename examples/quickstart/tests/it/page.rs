//! docs/quickstart.md quotes the example's code: every ```rust block of the page must appear,
//! character for character, in `src/lib.rs` or `src/main.rs`, every ```sql block that creates a
//! table is one of the example's migrations, the page's `[dependencies]` are the example's, and
//! every feature it names must exist.

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
    let sources = [read("src/lib.rs"), read("src/main.rs")];
    let quoted = blocks(&page, "rust");
    assert!(quoted.len() >= 4, "the page quotes the example's code");
    for block in quoted {
        assert!(
            sources.iter().any(|source| source.contains(&block)),
            "docs/quickstart.md quotes code that is not in examples/quickstart/src/lib.rs or \
             src/main.rs (copy it again from the source):\n{block}"
        );
    }
}

/// The page's `CREATE TABLE` blocks are the example's migration files, whole.
#[test]
fn every_table_of_the_page_is_a_migration_of_the_example() {
    let page = read("../../docs/quickstart.md");
    let migrations = ["migrations/service", "migrations/consumer"]
        .into_iter()
        .flat_map(|dir| {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
            std::fs::read_dir(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
                .map(|entry| std::fs::read_to_string(entry.unwrap().path()).unwrap())
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    let tables: Vec<String> = blocks(&page, "sql")
        .into_iter()
        .filter(|b| b.contains("CREATE TABLE"))
        .collect();
    assert_eq!(tables.len(), 2, "the page shows `orders` and `shipments`");
    for block in tables {
        assert!(
            migrations.contains(&block),
            "docs/quickstart.md shows a table that is not a migration of the example \
             (copy the file again):\n{block}"
        );
    }
}

/// `(name, line)` of each dependency of a `[section]` of a Cargo.toml: one line each.
fn dependencies(toml: &str, section: &str) -> Vec<(String, String)> {
    let header = format!("[{section}]");
    toml.lines()
        .skip_while(|line| line.trim() != header)
        .skip(1)
        .take_while(|line| !line.starts_with('['))
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with('#'))
        .map(|line| {
            let name = line.split(['=', '.', ' ']).next().unwrap_or_default();
            (name.to_owned(), line.to_owned())
        })
        .collect()
}

/// The quoted strings of ` key = "..."` or ` key = [...]` in a dependency's line.
fn strings_after<'a>(line: &'a str, key: &str) -> Vec<&'a str> {
    let Some((_, rest)) = line.split_once(&format!(" {key} = ")) else {
        return Vec::new();
    };
    let value = if let Some(list) = rest.strip_prefix('[') {
        list.split_once(']').map_or(list, |(list, _)| list)
    } else {
        rest.split_once([',', '}']).map_or(rest, |(one, _)| one)
    };
    value
        .split(',')
        .map(|s| s.trim().trim_matches('"'))
        .filter(|s| !s.is_empty())
        .collect()
}

/// The version requirement of a dependency's line: `name = "1"` or `name = { version = "1" }`.
fn requirement(line: &str) -> Option<&str> {
    let (_, value) = line.split_once('=')?;
    if value.contains('{') {
        strings_after(value, "version").first().copied()
    } else {
        Some(value.trim().trim_matches('"'))
    }
}

/// The page's `[dependencies]` name the example's, at the workspace's version requirements, and
/// enable no feature the example goes without.
#[test]
fn the_pages_dependencies_are_the_examples() {
    let page = read("../../docs/quickstart.md");
    let workspace = read("../../Cargo.toml");
    let ours = read("Cargo.toml");
    let block = blocks(&page, "toml")
        .into_iter()
        .find(|b| b.starts_with("[dependencies]"))
        .expect("the page's Cargo.toml `[dependencies]`");
    let on_page = dependencies(&block, "dependencies");
    let needed = dependencies(&ours, "dependencies");
    let mut names: Vec<&str> = on_page.iter().map(|(n, _)| n.as_str()).collect();
    let mut wanted: Vec<&str> = needed.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    wanted.sort_unstable();
    assert_eq!(
        names, wanted,
        "the page's [dependencies] against the example's"
    );
    let resolved = dependencies(&workspace, "workspace.dependencies");
    for (name, line) in &on_page {
        let (_, theirs) = resolved
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("`{name}` is not a workspace dependency"));
        assert_eq!(
            requirement(line),
            requirement(theirs),
            "`{name}`'s version requirement: {line}"
        );
        let (_, our_line) = needed.iter().find(|(n, _)| n == name).unwrap();
        let mut enabled = strings_after(theirs, "features");
        enabled.extend(strings_after(our_line, "features"));
        for feature in strings_after(line, "features") {
            assert!(
                enabled.contains(&feature) || enabled.contains(&"full"),
                "the page enables `{name}`'s feature `{feature}`, the example does not"
            );
        }
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
