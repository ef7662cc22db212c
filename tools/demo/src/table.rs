//! Aligned text tables, as the demo prints them.

/// How a column's cells are aligned.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// Prints `header` and `rows` indented by three spaces, each column as wide as its widest cell.
/// The last column is never padded, so lines carry no trailing spaces.
pub fn print(header: &[&str], align: &[Align], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::from("   ");
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            let last = i + 1 == widths.len();
            match align.get(i).copied().unwrap_or(Align::Left) {
                Align::Right => {
                    text.extend(std::iter::repeat_n(' ', pad));
                    text.push_str(cell);
                }
                Align::Left => {
                    text.push_str(cell);
                    if !last {
                        text.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
        }
        println!("{text}");
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}
