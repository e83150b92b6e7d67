//! Splitting one config line into its keyword and arguments, byte for byte
//! as OpenSSH's readconf.c does: the keyword ends at whitespace, a quote or
//! one `=`; most arguments are split like a shell word list (`argv_split`),
//! but `Match` criteria use the older `strdelim` rules, and ProxyCommand and
//! ProxyJump take the rest of the line as it is.

const WHITESPACE: &[char] = &[' ', '\t', '\r', '\n'];

/// A line that cannot be split into words (readconf.c's own texts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LexError {
    /// The keyword, lowercased.
    #[error("no argument after keyword \"{0}\"")]
    NoArgument(String),
    #[error("invalid quotes")]
    InvalidQuotes,
}

/// A line's keyword (lowercased) and the text after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Split<'a> {
    pub keyword: String,
    /// Everything after the keyword, leading whitespace removed (a single
    /// `=` between keyword and value is already skipped).
    pub rest: &'a str,
}

/// The keyword of `line` and what follows, or `None` for a blank line or a
/// comment. `Err` when a keyword has no argument.
pub(super) fn split_line(line: &str) -> Result<Option<Split<'_>>, LexError> {
    // Trailing whitespace goes (a form feed only at the end of the line).
    let line = line.trim_end_matches(|c: char| WHITESPACE.contains(&c) || c == '\x0c');
    let mut cursor = Some(line);
    let Some(mut keyword) = strdelim(&mut cursor) else {
        return Ok(None);
    };
    if keyword.is_empty() {
        // The line started with whitespace: the keyword is the next word.
        match strdelim(&mut cursor) {
            Some(k) => keyword = k,
            None => return Ok(None),
        }
    }
    if keyword.is_empty() || keyword.starts_with('#') {
        return Ok(None);
    }
    let keyword = keyword.to_ascii_lowercase();
    let rest = cursor
        .map(|r| r.trim_start_matches(WHITESPACE))
        .unwrap_or("");
    if rest.is_empty() {
        return Err(LexError::NoArgument(keyword));
    }
    Ok(Some(Split { keyword, rest }))
}

/// OpenSSH's `strdelim`: the next word of `*s`, ended by whitespace, a
/// double quote or one `=`; a `"` starts a quoted part that runs to the next
/// `"`. `*s` becomes `None` at the end of the text. Returns `None` when
/// there is nothing left or a quote is not closed (OpenSSH treats both as
/// "no more words").
pub(super) fn strdelim(s: &mut Option<&str>) -> Option<String> {
    let text = (*s)?;
    let Some(at) = text.find(|c: char| WHITESPACE.contains(&c) || c == '"' || c == '=') else {
        *s = None;
        return Some(text.to_string());
    };
    let (word, from) = text.split_at(at);
    if let Some(after) = from.strip_prefix('"') {
        // The quote is removed; the word runs on to the closing quote.
        let Some(close) = after.find('"') else {
            *s = None;
            return None;
        };
        let token = format!("{word}{}", &after[..close]);
        *s = Some(after[close + 1..].trim_start_matches(WHITESPACE));
        return Some(token);
    }
    let equals = from.starts_with('=');
    let mut rest = from[1..].trim_start_matches(WHITESPACE);
    if !equals {
        if let Some(r) = rest.strip_prefix('=') {
            rest = r.trim_start_matches(WHITESPACE);
        }
    }
    *s = Some(rest);
    Some(word.to_string())
}

/// OpenSSH's `argv_split` with comments ending the list: words separated by
/// spaces or tabs, `'` and `"` quote, and `\` escapes a quote, a backslash
/// or (outside quotes) a space.
pub(super) fn argv_split(s: &str) -> Result<Vec<String>, LexError> {
    let chars: Vec<char> = s.chars().collect();
    let mut args = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == ' ' || chars[i] == '\t' {
            i += 1;
            continue;
        }
        if chars[i] == '#' {
            break;
        }
        let mut arg = String::new();
        let mut quote: Option<char> = None;
        while i < chars.len() {
            let c = chars[i];
            if c == '\\' {
                let next = chars.get(i + 1).copied();
                match next {
                    Some('\'') | Some('"') | Some('\\') => {
                        i += 1;
                        arg.push(chars[i]);
                    }
                    Some(' ') if quote.is_none() => {
                        i += 1;
                        arg.push(' ');
                    }
                    _ => arg.push(c),
                }
            } else if quote.is_none() && (c == ' ' || c == '\t') {
                break;
            } else if quote.is_none() && (c == '"' || c == '\'') {
                quote = Some(c);
            } else if quote == Some(c) {
                quote = None;
            } else {
                arg.push(c);
            }
            i += 1;
        }
        if quote.is_some() {
            return Err(LexError::InvalidQuotes);
        }
        args.push(arg);
    }
    Ok(args)
}

/// The text after a keyword as ProxyCommand and ProxyJump take it: leading
/// whitespace and `=` skipped, the rest kept as written.
pub(super) fn raw_value(rest: &str) -> &str {
    rest.trim_start_matches(|c: char| WHITESPACE.contains(&c) || c == '=')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(line: &str) -> Option<(String, String)> {
        split_line(line)
            .expect("valid line")
            .map(|s| (s.keyword, s.rest.to_string()))
    }

    #[test]
    fn keyword_and_rest() {
        assert_eq!(split("Host a b"), Some(("host".into(), "a b".into())));
        assert_eq!(
            split("  HostName = x.example  \n"),
            Some(("hostname".into(), "x.example".into()))
        );
        assert_eq!(split("Port=22"), Some(("port".into(), "22".into())));
        assert_eq!(split("\tUser\tbob\t"), Some(("user".into(), "bob".into())));
        assert_eq!(split("# a comment"), None);
        assert_eq!(split("   "), None);
        assert_eq!(split(""), None);
        assert_eq!(
            split_line("Port").expect_err("no value").to_string(),
            "no argument after keyword \"port\""
        );
        assert!(split_line("Port   ").is_err());
    }

    #[test]
    fn strdelim_words_quotes_and_equals() {
        let mut s = Some("host a,b exec \"test -f /x\" user=bob");
        let mut words = Vec::new();
        while let Some(w) = strdelim(&mut s) {
            if w.is_empty() {
                break;
            }
            words.push(w);
        }
        assert_eq!(words, ["host", "a,b", "exec", "test -f /x", "user", "bob"]);
        // An unclosed quote ends the words.
        let mut s = Some("exec \"true");
        assert_eq!(strdelim(&mut s).as_deref(), Some("exec"));
        assert_eq!(strdelim(&mut s), None);
    }

    #[test]
    fn argv_quotes_escapes_and_comments() {
        assert_eq!(
            argv_split(r#"a "b c" 'd e' f\ g h\"i # comment"#).expect("splits"),
            ["a", "b c", "d e", "f g", "h\"i"]
        );
        assert_eq!(argv_split("x#y").expect("splits"), ["x#y"]);
        assert_eq!(argv_split(r#""" x"#).expect("splits"), ["", "x"]);
        assert_eq!(
            argv_split("\"open").expect_err("unclosed").to_string(),
            "invalid quotes"
        );
        assert_eq!(argv_split(r"a\b").expect("splits"), [r"a\b"]);
    }

    #[test]
    fn raw_values() {
        assert_eq!(raw_value("= a,b"), "a,b");
        assert_eq!(raw_value("nc %h %p"), "nc %h %p");
    }
}
