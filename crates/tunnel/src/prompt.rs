//! Questions on the terminal (host-key confirmation, passwords).
//!
//! Prompts appear only when both stdin and stderr are terminals: when a
//! script runs `tunnel up` there is nobody to answer, and a hidden prompt
//! would hang it.

use std::io::{BufRead, IsTerminal, Write};

pub fn available() -> bool {
    std::io::stdin().is_terminal() && std::io::stderr().is_terminal()
}

/// Ask a visible question; `None` when no terminal or on read failure.
pub async fn ask(question: String) -> Option<String> {
    if !available() {
        return None;
    }
    tokio::task::spawn_blocking(move || {
        let mut err = std::io::stderr();
        write!(err, "{question}").ok()?;
        err.flush().ok()?;
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).ok()?;
        Some(line)
    })
    .await
    .ok()
    .flatten()
}

/// Ask for a secret without echo; `None` when no terminal or on failure.
pub async fn secret(question: String) -> Option<String> {
    if !available() {
        return None;
    }
    tokio::task::spawn_blocking(move || rpassword::prompt_password(question).ok())
        .await
        .ok()
        .flatten()
}
