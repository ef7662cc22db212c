//! A line diff of two texts, for the repair form's review step: the old payload against the new,
//! both pretty-printed, so an operator sees what a save changes before it is made.
//!
//! Plain and bounded: the common head and tail are cut first (a repair usually changes a few
//! lines of a long payload), and the rest is matched by longest common subsequence only while
//! its table stays small; past that, the middle is shown as removed then added, which is still
//! a correct diff, only a less tidy one.

/// One line of a diff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Line<'a> {
    /// In both texts.
    Same(&'a str),
    /// Only in the old text.
    Removed(&'a str),
    /// Only in the new text.
    Added(&'a str),
}

/// What the review shows of a diff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shown<'a> {
    /// A line, as [`Line`].
    Line(Line<'a>),
    /// This many unchanged lines left out.
    Skipped(usize),
}

/// Most cells of the subsequence table (4 bytes each): 16 MiB at worst per request.
const MAX_TABLE_CELLS: usize = 4 * 1024 * 1024;

/// Unchanged lines kept around each change in [`shown`].
pub(crate) const CONTEXT: usize = 3;

/// The lines of `old` and `new`, in order, each marked same, removed or added.
pub(crate) fn lines<'a>(old: &'a str, new: &'a str) -> Vec<Line<'a>> {
    let old: Vec<&str> = old.lines().collect();
    let new: Vec<&str> = new.lines().collect();
    let head = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
    let tail = old[head..]
        .iter()
        .rev()
        .zip(new[head..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let (old_mid, new_mid) = (&old[head..old.len() - tail], &new[head..new.len() - tail]);
    let mut out: Vec<Line<'a>> = old[..head].iter().map(|l| Line::Same(l)).collect();
    out.extend(middle(old_mid, new_mid));
    out.extend(old[old.len() - tail..].iter().map(|l| Line::Same(l)));
    out
}

/// The changed middle: by longest common subsequence when its table is small enough.
fn middle<'a>(old: &[&'a str], new: &[&'a str]) -> Vec<Line<'a>> {
    let (n, m) = (old.len(), new.len());
    if (n + 1).saturating_mul(m + 1) > MAX_TABLE_CELLS {
        let mut out: Vec<Line<'a>> = old.iter().map(|l| Line::Removed(l)).collect();
        out.extend(new.iter().map(|l| Line::Added(l)));
        return out;
    }
    // table[i][j]: the longest common subsequence of old[i..] and new[j..].
    let width = m + 1;
    let mut table = vec![0u32; (n + 1) * width];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            table[i * width + j] = if old[i] == new[j] {
                table[(i + 1) * width + j + 1] + 1
            } else {
                table[(i + 1) * width + j].max(table[i * width + j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(n + m);
    while i < n && j < m {
        if old[i] == new[j] {
            out.push(Line::Same(old[i]));
            i += 1;
            j += 1;
        } else if table[(i + 1) * width + j] >= table[i * width + j + 1] {
            out.push(Line::Removed(old[i]));
            i += 1;
        } else {
            out.push(Line::Added(new[j]));
            j += 1;
        }
    }
    out.extend(old[i..].iter().map(|l| Line::Removed(l)));
    out.extend(new[j..].iter().map(|l| Line::Added(l)));
    out
}

/// `diff` with runs of unchanged lines further than [`CONTEXT`] from any change left out.
pub(crate) fn shown<'a>(diff: &[Line<'a>]) -> Vec<Shown<'a>> {
    let changed: Vec<usize> = diff
        .iter()
        .enumerate()
        .filter(|(_, l)| !matches!(l, Line::Same(_)))
        .map(|(i, _)| i)
        .collect();
    let near = |i: usize| {
        // The nearest change at or after i, and the one before it.
        let at = changed.partition_point(|&c| c < i);
        changed.get(at).is_some_and(|&c| c - i <= CONTEXT)
            || (at > 0 && i - changed[at - 1] <= CONTEXT)
    };
    let mut out = Vec::new();
    let mut skipped = 0;
    for (i, line) in diff.iter().enumerate() {
        if matches!(line, Line::Same(_)) && !near(i) {
            skipped += 1;
            continue;
        }
        if skipped > 0 {
            out.push(Shown::Skipped(skipped));
            skipped = 0;
        }
        out.push(Shown::Line(*line));
    }
    if skipped > 0 {
        out.push(Shown::Skipped(skipped));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_line_between_equal_ones_is_removed_then_added() {
        let diff = lines("a\nb\nc\n", "a\nB\nc\n");
        assert_eq!(
            diff,
            vec![
                Line::Same("a"),
                Line::Removed("b"),
                Line::Added("B"),
                Line::Same("c")
            ]
        );
    }

    #[test]
    fn inserted_and_deleted_lines_keep_the_rest_in_common() {
        let diff = lines("x\na\nb\nc\ny", "x\nb\nc\nd\ny");
        assert_eq!(
            diff,
            vec![
                Line::Same("x"),
                Line::Removed("a"),
                Line::Same("b"),
                Line::Same("c"),
                Line::Added("d"),
                Line::Same("y")
            ]
        );
    }

    #[test]
    fn equal_texts_have_no_change() {
        let diff = lines("a\nb", "a\nb");
        assert!(diff.iter().all(|l| matches!(l, Line::Same(_))));
        assert_eq!(shown(&diff), vec![Shown::Skipped(2)]);
    }

    #[test]
    fn far_unchanged_lines_are_left_out() {
        let old: String = (0..20).map(|i| format!("{i}\n")).collect();
        let new = old.replace("10\n", "ten\n");
        let shown = shown(&lines(&old, &new));
        assert_eq!(shown.first(), Some(&Shown::Skipped(7)));
        assert_eq!(shown.last(), Some(&Shown::Skipped(6)));
        assert!(shown.contains(&Shown::Line(Line::Removed("10"))));
        assert!(shown.contains(&Shown::Line(Line::Added("ten"))));
        assert_eq!(shown.len(), 2 + 2 * CONTEXT + 2);
    }

    #[test]
    fn a_middle_too_large_to_match_is_removed_then_added() {
        let old: String = (0..3000).map(|i| format!("o{i}\n")).collect();
        let new: String = (0..3000).map(|i| format!("n{i}\n")).collect();
        let diff = lines(&old, &new);
        assert_eq!(diff.len(), 6000);
        assert!(diff[..3000].iter().all(|l| matches!(l, Line::Removed(_))));
        assert!(diff[3000..].iter().all(|l| matches!(l, Line::Added(_))));
    }
}
