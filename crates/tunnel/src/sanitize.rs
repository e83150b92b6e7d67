//! Text a server sends (banners, keyboard-interactive names, instructions
//! and prompts, remote log lines in errors) made safe to print on the
//! user's terminal, as OpenSSH does with its `vis`-style escaping: a
//! malicious server must not be able to move the cursor, rewrite earlier
//! lines, set the window title or fake a local prompt with escape sequences.
//!
//! Printable characters (any script), `\n` and `\t` pass; a CR before LF is
//! dropped (banners use CRLF line ends); every other control character, C1
//! control and bidirectional override is written as a visible octal or
//! `\u{..}` escape, so an ESC sequence prints as inert text (`\033[2J`).

use std::fmt::Write;

/// `text` with every terminal control character escaped.
pub fn for_terminal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' if chars.peek() == Some(&'\n') => {}
            c if (c as u32) < 0x80 && c.is_control() => {
                let _ = write!(out, "\\{:03o}", c as u32);
            }
            c if c.is_control() || is_bidi_control(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// Unicode's explicit direction controls: they reorder what the terminal
/// shows ("Trojan Source") without being control characters.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_printable_text_newlines_and_tabs() {
        let s = "Welcome to gpu01\n\tAuthorized use only.\nNutzung: ü, 中文, emoji 🚀\n";
        assert_eq!(for_terminal(s), s);
        assert_eq!(for_terminal(""), "");
    }

    #[test]
    fn escapes_escape_sequences_and_other_controls() {
        // Clear the screen, set the window title, fake a prompt on the line above.
        assert_eq!(for_terminal("\x1b[2J\x1b[H"), "\\033[2J\\033[H");
        assert_eq!(
            for_terminal("\x1b]0;pwned\x07Password: "),
            "\\033]0;pwned\\007Password: "
        );
        assert_eq!(for_terminal("a\rb\x08c\x7f\0"), "a\\015b\\010c\\177\\000");
        // C1 controls (the 8-bit CSI) and direction overrides.
        assert_eq!(for_terminal("x\u{9b}2Jy"), "x\\u{9b}2Jy");
        assert_eq!(for_terminal("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert!(!for_terminal("\x1b\u{9b}\u{2066}\x07\r")
            .chars()
            .any(|c| c.is_control()));
    }

    #[test]
    fn crlf_line_ends_become_lf() {
        assert_eq!(for_terminal("line 1\r\nline 2\r\n"), "line 1\nline 2\n");
        assert_eq!(for_terminal("\r\r\n"), "\\015\n");
    }
}
