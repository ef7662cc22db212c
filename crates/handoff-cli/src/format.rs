//! How the operator commands print ages and sizes for a person.

use chrono::{DateTime, Utc};

/// A number of seconds as a short age: `42s`, `3m 4s`, `5h 12m`, `2d 3h`.
pub fn age(seconds: f64) -> String {
    // Whole seconds are enough for a person; the JSON output keeps the fraction.
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// How long ago `at` was: `3m 4s ago`.
pub fn since(at: DateTime<Utc>) -> String {
    let seconds = (Utc::now() - at).num_milliseconds() as f64 / 1000.0;
    format!("{} ago", age(seconds))
}

/// A byte count with a binary unit: `812 B`, `1.2 MiB`.
pub fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n.max(0) as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `text` with control characters (a terminal's escape sequences among them) shown as spaces:
/// reasons, payloads and receipts may hold what a message or a remote endpoint sent.
pub fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The audit trail of a quarantined row (outbox or consumer), one action with its before and
/// after states per entry; `reason` renders each action's reason.
pub fn print_actions(
    actions: &[handoff_postgres::QuarantineAction],
    reason: impl Fn(&str) -> String,
) {
    if actions.is_empty() {
        println!("actions      none");
        return;
    }
    println!("actions");
    for action in actions {
        println!(
            "  #{} {} by {} at {}{}",
            action.action_id,
            action.action,
            action.actor,
            action.acted_at.to_rfc3339(),
            action
                .reason
                .as_deref()
                .map_or(String::new(), |r| format!(": {}", reason(r))),
        );
        println!("     before {}", action.before);
        println!("     after  {}", action.after);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_sizes_read_well() {
        assert_eq!(age(0.4), "0s");
        assert_eq!(age(184.0), "3m 4s");
        assert_eq!(age(18_720.0), "5h 12m");
        assert_eq!(age(183_600.0), "2d 3h");
        assert_eq!(bytes(812), "812 B");
        assert_eq!(bytes(1_258_291), "1.2 MiB");
    }
}
