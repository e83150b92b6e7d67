//! `Include`: which files a pattern names, the way OpenSSH finds them: a
//! relative path is in `~/.ssh` (user configs) or `/etc/ssh` (the system
//! config; `%PROGRAMDATA%\ssh` on Windows), then glob(3) with `~`
//! expansion, matches in lexical order. On Windows, as OpenSSH for Windows,
//! `C:\...` and `\...` are absolute and `\` becomes `/` before globbing.

use std::path::{Path, PathBuf};

use crate::platform::{self, ConfigPermissionError};

/// `~` in an Include of the system config, which OpenSSH refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad include path {arg} (no ~ in the system config)")]
pub struct SystemTilde {
    pub arg: String,
}

/// The files `arg` of an Include line names, in the order they are read.
/// `home` is what glob's `~` means (`$HOME`, else the passwd home).
pub(super) fn files(
    arg: &str,
    user_config: bool,
    home: &Path,
) -> Result<Vec<PathBuf>, SystemTilde> {
    if arg.starts_with('~') && !user_config {
        return Err(SystemTilde {
            arg: arg.to_string(),
        });
    }
    let anchored = if platform::include_is_absolute(arg) || arg.starts_with('~') {
        arg.to_string()
    } else if user_config {
        format!("~/.ssh/{arg}")
    } else {
        format!("{}/{arg}", platform::system_ssh_dir())
    };
    let anchored = platform::include_pattern(anchored);
    let Some(pattern) = expand_tilde(&anchored, home) else {
        return Ok(Vec::new());
    };
    Ok(glob(&pattern))
}

/// glob(3)'s GLOB_TILDE: `~` is `home`, `~user` that user's home; an unknown
/// user matches nothing.
fn expand_tilde(pattern: &str, home: &Path) -> Option<String> {
    let Some(after) = pattern.strip_prefix('~') else {
        return Some(pattern.to_string());
    };
    let (user, rest) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, ""),
    };
    let dir = if user.is_empty() {
        home.to_path_buf()
    } else {
        platform::home_of(user)?
    };
    // A Windows home has backslashes: the glob below splits on `/` only.
    let dir = platform::include_pattern(dir.to_string_lossy().into_owned());
    Some(format!("{dir}{rest}"))
}

/// Paths matching `pattern` (`*`, `?`, `[...]`, `\` escapes; a leading `.`
/// in a name is only matched by a `.` in the pattern), sorted byte-wise. A
/// pattern without wildcards names its path if that exists.
pub(super) fn glob(pattern: &str) -> Vec<PathBuf> {
    let (start, rest) = platform::glob_root(pattern);
    let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
    let mut found = Vec::new();
    walk(&start, &parts, &mut found);
    found.sort_by(|a, b| {
        a.as_os_str()
            .as_encoded_bytes()
            .cmp(b.as_os_str().as_encoded_bytes())
    });
    found
}

fn walk(base: &Path, parts: &[&str], found: &mut Vec<PathBuf>) {
    let Some((part, rest)) = parts.split_first() else {
        if base.symlink_metadata().is_ok() {
            found.push(base.to_path_buf());
        }
        return;
    };
    if !has_magic(part) {
        walk(&base.join(unescape(part)), rest, found);
        return;
    }
    let dir = if base.as_os_str().is_empty() {
        Path::new(".")
    } else {
        base
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| fnmatch(part.as_bytes(), n.as_bytes()))
        .collect();
    names.sort();
    for name in names {
        let path = base.join(&name);
        if rest.is_empty() || path.is_dir() {
            walk(&path, rest, found);
        }
    }
}

fn has_magic(part: &str) -> bool {
    let mut escaped = false;
    for c in part.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '*' | '?' | '[' => return true,
            _ => {}
        }
    }
    false
}

fn unescape(part: &str) -> String {
    let mut out = String::with_capacity(part.len());
    let mut chars = part.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// fnmatch(3) for one path component, with a leading `.` matched only
/// explicitly.
fn fnmatch(p: &[u8], s: &[u8]) -> bool {
    if s.first() == Some(&b'.') && p.first() != Some(&b'.') {
        return false;
    }
    component_match(p, s)
}

fn component_match(p: &[u8], s: &[u8]) -> bool {
    let Some((&c, p_rest)) = p.split_first() else {
        return s.is_empty();
    };
    match c {
        b'*' => (0..=s.len()).any(|i| component_match(p_rest, &s[i..])),
        b'?' => !s.is_empty() && component_match(p_rest, &s[1..]),
        b'[' => match (s.split_first(), bracket(p_rest)) {
            (Some((&sc, s_rest)), Some((set, after))) => {
                set.contains(sc) && component_match(after, s_rest)
            }
            // An unclosed `[` is an ordinary character.
            (Some((&b'[', s_rest)), None) => component_match(p_rest, s_rest),
            _ => false,
        },
        b'\\' if !p_rest.is_empty() => match s.split_first() {
            Some((&sc, s_rest)) if sc == p_rest[0] => component_match(&p_rest[1..], s_rest),
            _ => false,
        },
        _ => match s.split_first() {
            Some((&sc, s_rest)) if sc == c => component_match(p_rest, s_rest),
            _ => false,
        },
    }
}

/// A bracket expression after its `[`: the set, and the pattern after `]`.
struct Set {
    negated: bool,
    ranges: Vec<(u8, u8)>,
}

impl Set {
    fn contains(&self, c: u8) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != self.negated
    }
}

fn bracket(p: &[u8]) -> Option<(Set, &[u8])> {
    let mut i = 0;
    let negated = matches!(p.first(), Some(b'!') | Some(b'^'));
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    let mut first = true;
    while i < p.len() {
        let c = p[i];
        if c == b']' && !first {
            return Some((Set { negated, ranges }, &p[i + 1..]));
        }
        first = false;
        let lo = if c == b'\\' && i + 1 < p.len() {
            i += 1;
            p[i]
        } else {
            c
        };
        if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
            ranges.push((lo, p[i + 2]));
            i += 3;
        } else {
            ranges.push((lo, lo));
            i += 1;
        }
    }
    None
}

/// OpenSSH refuses a config file that someone else could have written (on
/// Windows: its owner and ACL, as OpenSSH for Windows checks them).
pub(super) fn check_permissions(
    path: &Path,
    meta: &std::fs::Metadata,
) -> Result<(), ConfigPermissionError> {
    platform::check_config_permissions(path, meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_patterns() {
        assert!(fnmatch(b"*.conf", b"a.conf"));
        assert!(!fnmatch(b"*.conf", b".hidden.conf"));
        assert!(fnmatch(b".*", b".hidden"));
        assert!(fnmatch(b"c?", b"c1"));
        assert!(fnmatch(b"[ab]x", b"bx"));
        assert!(!fnmatch(b"[!ab]x", b"bx"));
        assert!(fnmatch(b"[a-c]", b"b"));
        assert!(fnmatch(b"[]]", b"]"));
        assert!(fnmatch(b"\\*", b"*"));
        assert!(!fnmatch(b"\\*", b"x"));
        assert!(fnmatch(b"[x", b"[x"));
    }

    #[test]
    fn globs_in_lexical_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        // B1, not B: on Windows file names are case-insensitive (B.conf is b.conf).
        for name in ["b.conf", "a.conf", "c.txt", ".h.conf", "B1.conf"] {
            std::fs::write(dir.path().join(name), "").expect("write");
        }
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/z.conf"), "").expect("write");
        // On Windows the pattern has `/` only, as `files` makes it.
        let d = platform::include_pattern(dir.path().display().to_string());
        let names = |pattern: String| -> Vec<String> {
            glob(&pattern)
                .iter()
                .map(|p| {
                    p.strip_prefix(dir.path())
                        .expect("inside")
                        .to_string_lossy()
                        .replace('\\', "/")
                })
                .collect()
        };
        assert_eq!(
            names(format!("{d}/*.conf")),
            ["B1.conf", "a.conf", "b.conf"]
        );
        assert_eq!(names(format!("{d}/*/*.conf")), ["sub/z.conf"]);
        assert_eq!(names(format!("{d}/c.txt")), ["c.txt"]);
        assert!(names(format!("{d}/missing")).is_empty());
        assert!(names(format!("{d}/*.none")).is_empty());
    }

    #[test]
    fn anchoring() {
        let home = Path::new("/nonexistent-home");
        assert!(files("x", true, home).expect("ok").is_empty());
        assert_eq!(
            files("~/x", false, home).expect_err("refused").to_string(),
            "bad include path ~/x (no ~ in the system config)"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join(".ssh")).expect("mkdir");
        std::fs::write(dir.path().join(".ssh/inc"), "").expect("write");
        assert_eq!(
            files("inc", true, dir.path()).expect("ok"),
            [dir.path().join(".ssh/inc")]
        );
        assert_eq!(
            files("~/.ssh/in*", true, dir.path()).expect("ok"),
            [dir.path().join(".ssh/inc")]
        );
    }
}
