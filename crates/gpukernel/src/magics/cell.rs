//! Splitting a cell into our magic lines and everything else, in order.
//!
//! A magic line starts at column 0 with `%name` where `name` is one of ours; a trailing `\`
//! continues it on the next line. `%%` cell magics and anyone else's `%magics` are left to the
//! Python kernel. `%name?` asks for the magic's help in the pager, as in IPython.

/// One magic invocation as written in the cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MagicLine {
    pub name: String,
    /// The text after the name, continuation lines joined with spaces.
    pub args: String,
    /// `%name?`: show help instead of running.
    pub help: bool,
    /// The source lines this magic spans, verbatim.
    pub source: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Magic(MagicLine),
    /// Consecutive lines that are not ours, verbatim with their newlines.
    Other(String),
}

/// The name of a line magic at the start of `line`, if the line is one (`%name ...`).
pub fn magic_name(line: &str) -> Option<&str> {
    let rest = line.strip_prefix('%')?;
    if rest.starts_with('%') {
        return None;
    }
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '?')
        .unwrap_or(rest.len());
    let name = &rest[..end];
    (!name.is_empty()).then_some(name)
}

/// Splits `code` into segments; `is_ours` says which magic names this kernel answers.
pub fn split(code: &str, is_ours: impl Fn(&str) -> bool) -> Vec<Segment> {
    let mut segments = Vec::new();
    let mut other = String::new();
    let mut lines = code.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        let Some(name) = magic_name(line).filter(|n| is_ours(n)) else {
            other.push_str(line);
            continue;
        };
        if !other.is_empty() {
            segments.push(Segment::Other(std::mem::take(&mut other)));
        }
        let name = name.to_string();
        let mut source = line.to_string();
        let mut logical = line.trim_end().to_string();
        while logical.ends_with('\\') {
            logical.pop();
            match lines.next() {
                Some(next) => {
                    source.push_str(next);
                    logical.push(' ');
                    logical.push_str(next.trim());
                }
                None => break,
            }
        }
        let after = logical[1 + name.len()..].trim_start();
        let (help, args) = match after.strip_prefix('?') {
            Some(rest) => (true, rest.trim().to_string()),
            None => (false, after.trim().to_string()),
        };
        segments.push(Segment::Magic(MagicLine {
            name,
            args,
            help,
            source,
        }));
    }
    if !other.is_empty() {
        segments.push(Segment::Other(other));
    }
    segments
}

/// True when the last non-empty line of one of our magics ends with a continuation `\`.
pub fn ends_in_continuation(code: &str) -> bool {
    code.trim_end_matches([' ', '\t', '\n']).ends_with('\\')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(name: &str) -> bool {
        matches!(name, "gpumem" | "gpuhelp")
    }

    #[test]
    fn keeps_order_and_leaves_other_code_verbatim() {
        let code = "x = 1\n%gpumem --json\nprint(x)\n%time y = 2\n%gpuhelp gpumem";
        let segments = split(code, ours);
        assert_eq!(segments.len(), 4);
        assert_eq!(segments[0], Segment::Other("x = 1\n".into()));
        match &segments[1] {
            Segment::Magic(m) => {
                assert_eq!((m.name.as_str(), m.args.as_str()), ("gpumem", "--json"));
                assert_eq!(m.source, "%gpumem --json\n");
            }
            other => panic!("expected a magic, got {other:?}"),
        }
        assert_eq!(
            segments[2],
            Segment::Other("print(x)\n%time y = 2\n".into())
        );
        assert!(
            matches!(&segments[3], Segment::Magic(m) if m.name == "gpuhelp" && m.args == "gpumem")
        );
    }

    #[test]
    fn cell_magics_indented_lines_and_strings_are_not_ours() {
        for code in [
            "%%gpumem\n",
            "  %gpumem\n",
            "s = '%gpumem'\n",
            "%gpumemory\n",
        ] {
            assert!(
                split(code, ours)
                    .iter()
                    .all(|s| matches!(s, Segment::Other(_))),
                "{code:?}"
            );
        }
    }

    #[test]
    fn continuation_and_help_suffix() {
        let segments = split("%gpumem \\\n  --json\n%gpumem?\n", ours);
        assert!(matches!(&segments[0], Segment::Magic(m) if m.args == "--json" && !m.help));
        assert!(matches!(&segments[1], Segment::Magic(m) if m.help && m.args.is_empty()));
        assert!(ends_in_continuation("%gpumem \\\n"));
        assert!(!ends_in_continuation("%gpumem\n"));
    }
}
