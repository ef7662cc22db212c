//! The overview's charts: a line over the samples, drawn as inline SVG (no script, no
//! chart library).

use maud::{html, Markup};

use crate::Sample;

const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 120.0;
const PAD: f64 = 24.0;

/// A line chart of `value` over `samples`, titled `title`.
pub(crate) fn line(title: &str, samples: &[Sample], value: fn(&Sample) -> f64) -> Markup {
    let max = samples.iter().map(value).fold(0.0_f64, f64::max).max(1.0);
    let (first, last) = match (samples.first(), samples.last()) {
        (Some(first), Some(last)) => (first.at, last.at),
        _ => return html! { p { (title) ": no samples yet (the console samples while it runs)" } },
    };
    let span = ((last - first).num_milliseconds() as f64).max(1.0);
    let points: Vec<String> = samples
        .iter()
        .map(|s| {
            let x = PAD + (s.at - first).num_milliseconds() as f64 / span * (WIDTH - 2.0 * PAD);
            let y = HEIGHT - PAD - value(s) / max * (HEIGHT - 2.0 * PAD);
            format!("{x:.1},{y:.1}")
        })
        .collect();
    html! {
        figure {
            figcaption { (title) }
            svg class="chart" width=(WIDTH) height=(HEIGHT) viewBox={"0 0 " (WIDTH) " " (HEIGHT)}
                role="img" aria-label=(title) {
                text x="2" y=(PAD - 8.0) { (format!("{max:.0}")) }
                text x="2" y=(HEIGHT - 6.0) { "0" }
                text x=(WIDTH - 120.0) y=(HEIGHT - 6.0) { (last.format("%H:%M:%S UTC").to_string()) }
                polyline points=(points.join(" ")) {}
            }
        }
    }
}
