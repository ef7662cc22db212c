//! `docs/configuration.md`, rendered from the clap definitions: every flag of every `handoff`
//! command with its environment variable (and the older name read when that is not set), its
//! config-file key (`handoff relay`), its default and its help. `handoff reference` (hidden)
//! prints it; a test holds the committed file to it.

use std::fmt::Write;

use handoff_telemetry::env::fallback;

/// The page's opening: how flags, variables and the config file combine, and the value units.
const PREAMBLE: &str = "\
# Configuration reference

<!-- Generated from the flags' definitions by `handoff reference`; do not edit by hand.
     `HANDOFF_BLESS=1 cargo nextest run -p handoff-cli --all-features --test it configuration::`
     rewrites it, and that test fails while it differs from the binary. -->

Every setting of the `handoff` command, by command. Each flag also reads the environment
variable shown; where an older variable is named too (\"also `DATABASE_URL`\"), that one is read
when the `HANDOFF_` one is not set. `handoff relay` also reads a TOML config file (`--config`):
its keys are the flags' names with `_` for `-` (see `deploy/relay.example.toml`). A flag wins
over its variable, which wins over the file, which wins over the default.

Values: DURATION is a number and a unit, such as `500ms`, `30s`, `10m`, `1h` or `7d`; BYTES is
a number of bytes; N is a count; URL, FILE and ADDR (`host:port`) are what they say. An older
flag name that still works is listed as \"alias\"; it is not shown in `--help`.
";

/// The Markdown reference of `cli` (the `handoff` command).
pub fn markdown(cli: &clap::Command) -> String {
    let mut out = String::from(PREAMBLE);
    let global: Vec<&clap::Arg> = cli.get_arguments().filter(|a| shown(a)).collect();
    if !global.is_empty() {
        out.push_str("\n## Every command\n\n");
        table(&mut out, &global, false);
    }
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        section(&mut out, &format!("handoff {}", sub.get_name()), sub);
    }
    out
}

/// One command's section, then its subcommands'.
fn section(out: &mut String, path: &str, command: &clap::Command) {
    let args: Vec<&clap::Arg> = command.get_arguments().filter(|a| shown(a)).collect();
    if !args.is_empty() || !command.has_subcommands() {
        let _ = write!(out, "## `{path}`\n\n");
        if let Some(about) = command.get_about() {
            let _ = writeln!(out, "{}\n", one_line(&about.to_string()));
        }
        // The relay's flags are also its config file's keys.
        let keys = path == "handoff relay";
        let mut headings: Vec<Option<&str>> = Vec::new();
        for arg in &args {
            if !headings.contains(&arg.get_help_heading()) {
                headings.push(arg.get_help_heading());
            }
        }
        for heading in headings {
            let group: Vec<&clap::Arg> = args
                .iter()
                .copied()
                .filter(|a| a.get_help_heading() == heading)
                .collect();
            if let Some(heading) = heading {
                let _ = write!(out, "### {heading}\n\n");
            }
            table(out, &group, keys);
        }
    }
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        section(out, &format!("{path} {}", sub.get_name()), sub);
    }
}

/// A table of `args`, with their config-file keys when `keys`.
fn table(out: &mut String, args: &[&clap::Arg], keys: bool) {
    if keys {
        out.push_str("| Flag | Environment | Config key | Default | Description |\n");
        out.push_str("|---|---|---|---|---|\n");
    } else {
        out.push_str("| Flag | Environment | Default | Description |\n");
        out.push_str("|---|---|---|---|\n");
    }
    for arg in args {
        let help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(|h| one_line(&h.to_string()))
            .unwrap_or_default();
        let (help, default) = split_default(arg, &help);
        let mut cells = vec![flag(arg), env(arg)];
        if keys {
            cells.push(key(arg));
        }
        cells.push(default);
        cells.push(describe(arg, &help));
        let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out.push('\n');
}

/// Whether the reference lists `arg`: not clap's own `--help`/`--version`, nor a hidden one.
fn shown(arg: &clap::Arg) -> bool {
    !arg.is_hide_set() && !["help", "version"].contains(&arg.get_id().as_str())
}

/// `--name <VALUE>` (or `<NAME>` for a positional), and its older names.
fn flag(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| names.iter().map(|n| format!(" <{n}>")).collect::<String>())
        .unwrap_or_else(|| format!(" <{}>", arg.get_id().as_str().to_uppercase()));
    let takes_value = arg.get_action().takes_values();
    let value = if takes_value { value } else { String::new() };
    let mut text = match (arg.get_long(), arg.get_short()) {
        (Some(long), Some(short)) => format!("`-{short}`, `--{long}{value}`"),
        (Some(long), None) => format!("`--{long}{value}`"),
        (None, Some(short)) => format!("`-{short}{value}`"),
        (None, None) => format!("`{}`", value.trim()),
    };
    if let Some(aliases) = arg.get_all_aliases() {
        for alias in aliases {
            let _ = write!(text, " (alias `--{alias}`)");
        }
    }
    text
}

/// The variable, and the older one read when it is not set.
fn env(arg: &clap::Arg) -> String {
    let Some(name) = arg.get_env().and_then(|e| e.to_str()) else {
        return String::new();
    };
    match fallback(name) {
        Some(old) => format!("`{name}` (also `{old}`)"),
        None => format!("`{name}`"),
    }
}

/// The relay's config-file key of `arg`: its id, and its older keys.
fn key(arg: &clap::Arg) -> String {
    let id = arg.get_id().as_str();
    match id {
        "config" | "check_config" => String::new(),
        // `--kafka-option`'s settings are a table in the file.
        "kafka" => "`[kafka]` table".to_owned(),
        _ => {
            let mut text = format!("`{id}`");
            for alias in arg.get_all_aliases().unwrap_or_default() {
                let _ = write!(text, " (alias `{}`)", alias.replace('-', "_"));
            }
            text
        }
    }
}

/// The help without its `[default: ...]` note, and the default: clap's, or the note's.
fn split_default(arg: &clap::Arg, help: &str) -> (String, String) {
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if let Some(start) = help.find("[default: ") {
        if let Some(len) = help[start..].find(']') {
            let note = &help[start + "[default: ".len()..start + len];
            let rest = format!("{}{}", &help[..start], &help[start + len + 1..]);
            let rest = rest
                .replace(" .", ".")
                .replace(" ;", ";")
                .replace("  ", " ");
            let default = if defaults.is_empty() {
                note.to_owned()
            } else {
                defaults.join(", ")
            };
            return (rest.trim().to_owned(), quote(&default));
        }
    }
    if defaults.is_empty() {
        return (help.to_owned(), String::new());
    }
    (help.to_owned(), quote(&defaults.join(", ")))
}

/// A default as code, unless it is a sentence (`the connection's search_path`).
fn quote(default: &str) -> String {
    if default.is_empty() || default.contains(' ') {
        default.to_owned()
    } else {
        format!("`{default}`")
    }
}

/// The help, then the values a closed set of them takes.
fn describe(arg: &clap::Arg, help: &str) -> String {
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    let takes_value = arg.get_action().takes_values();
    if values.is_empty() || !takes_value || values == ["`true`", "`false`"] {
        help.to_owned()
    } else {
        format!("{help} Values: {}.", values.join(", "))
    }
}

/// `text` on one line: its lines joined by spaces.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_note_moves_to_its_column() {
        let arg = clap::Arg::new("lease").long("lease");
        let (help, default) = split_default(&arg, "Lease length [default: 30s].");
        assert_eq!(help, "Lease length.");
        assert_eq!(default, "`30s`");
    }
}
