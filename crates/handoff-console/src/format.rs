//! How the console (and `handoff status`) write ages for a person.

use chrono::{DateTime, Utc};

/// A number of seconds as a short age: `42s`, `3m 4s`, `5h 12m`, `2d 3h`.
pub fn age(seconds: f64) -> String {
    // Whole seconds are enough for a person; the JSON keeps the fraction.
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
