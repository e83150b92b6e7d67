//! ssh_config(5) PATTERNS, as OpenSSH's match.c implements them: `*` and `?`
//! wildcards, comma-separated pattern lists with `!` negation.

/// Whether `s` matches `pattern` (`*`: any run of characters, `?`: any one
/// character). Case-sensitive, like OpenSSH's `match_pattern`.
pub(super) fn matches(s: &str, pattern: &str) -> bool {
    wild(s.as_bytes(), pattern.as_bytes())
}

fn wild(s: &[u8], p: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', _)) => {
            let rest = trim_stars(p);
            if rest.is_empty() {
                return true;
            }
            (0..=s.len()).any(|i| wild(&s[i..], rest))
        }
        Some((&c, rest)) => match s.split_first() {
            Some((&d, s_rest)) if c == b'?' || c == d => wild(s_rest, rest),
            _ => false,
        },
    }
}

fn trim_stars(p: &[u8]) -> &[u8] {
    let n = p.iter().take_while(|&&c| c == b'*').count();
    &p[n..]
}

/// How a pattern list judged a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListMatch {
    /// A negated pattern matched: this always wins.
    Negated,
    Positive,
    None,
}

/// OpenSSH's `match_pattern_list`: `list` is comma-separated, each pattern
/// optionally negated with `!`. With `lowercase`, the patterns are
/// lowercased first (the string is matched as given).
pub(super) fn match_list(s: &str, list: &str, lowercase: bool) -> ListMatch {
    let mut positive = false;
    for sub in list.split(',') {
        let (negated, pattern) = match sub.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, sub),
        };
        // OpenSSH gives up on a sub-pattern of 1023 bytes or more.
        if pattern.len() >= 1023 {
            return ListMatch::None;
        }
        let pattern = if lowercase {
            pattern.to_ascii_lowercase()
        } else {
            pattern.to_string()
        };
        if matches(s, &pattern) {
            if negated {
                return ListMatch::Negated;
            }
            positive = true;
        }
    }
    if positive {
        ListMatch::Positive
    } else {
        ListMatch::None
    }
}

/// A host name against a pattern list, case-insensitively (`match_hostname`).
pub(super) fn host_in_list(host: &str, list: &str) -> bool {
    match_list(&host.to_ascii_lowercase(), list, true) == ListMatch::Positive
}

/// A user name against a pattern list, case-sensitively.
pub(super) fn user_in_list(user: &str, list: &str) -> bool {
    match_list(user, list, false) == ListMatch::Positive
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards() {
        assert!(matches("lab-1", "lab-*"));
        assert!(matches("lab-", "lab-*"));
        assert!(!matches("lab", "lab-*"));
        assert!(matches("a.co.uk", "*.co.uk"));
        assert!(matches("192.168.0.7", "192.168.0.?"));
        assert!(!matches("192.168.0.17", "192.168.0.?"));
        assert!(matches("anything", "*"));
        assert!(matches("", "*"));
        assert!(matches("abc", "a**c"));
        assert!(matches("abcbc", "*bc"));
        assert!(!matches("Lab-1", "lab-*"), "case-sensitive");
        assert!(matches("x", "?"));
        assert!(!matches("", "?"));
    }

    #[test]
    fn lists_and_negation() {
        assert_eq!(match_list("host3", "!host1,!host2", true), ListMatch::None);
        assert_eq!(
            match_list("host3", "!host1,!host2,*", true),
            ListMatch::Positive
        );
        assert_eq!(match_list("host1", "*,!host1", true), ListMatch::Negated);
        assert!(host_in_list("LAB-1", "lab-*"));
        assert!(host_in_list("lab-1", "LAB-*"));
        assert!(!host_in_list("lab-1", "lab-*,!lab-1"));
        assert!(user_in_list("bob", "alice,b*"));
        assert!(!user_in_list("Bob", "bob"));
        let long = "a".repeat(1023);
        assert_eq!(match_list(&long, &long, false), ListMatch::None);
    }
}
