//! Reply contents of the magics-only kernel.

use crate::magics::{cell, MagicError, Registry};
use serde_json::{json, Map, Value};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub fn kernel_info() -> Value {
    json!({
        "status": "ok",
        "protocol_version": crate::wire::PROTOCOL_VERSION,
        "implementation": "gpukernel",
        "implementation_version": VERSION,
        "language_info": {
            "name": "gpu-magics",
            "version": VERSION,
            "mimetype": "text/x-gpu-magics",
            "file_extension": ".txt",
            "codemirror_mode": "ipython",
            "pygments_lexer": "ipython3",
        },
        "banner": format!("gpukernel {VERSION}: GPU magics only (no Python). %gpuhelp lists them."),
        "help_links": [],
        "debugger": false,
    })
}

/// usage_request (JupyterLab's resource panel): this process's memory and the CPU count.
pub fn usage() -> Value {
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map(|pages| pages * 4096);
    json!({
        "kernel_memory": rss,
        "pid": std::process::id(),
        "cpu_count": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    })
}

fn is_code(line: &str) -> bool {
    let trimmed = line.trim();
    !trimmed.is_empty() && !trimmed.starts_with('#')
}

pub fn is_complete(registry: &Registry, code: &str) -> Value {
    if cell::ends_in_continuation(code) {
        return json!({"status": "incomplete", "indent": ""});
    }
    let has_other = cell::split(code, |n| registry.is_ours(n))
        .iter()
        .any(|s| matches!(s, cell::Segment::Other(text) if text.lines().any(is_code)));
    if has_other {
        json!({"status": "invalid"})
    } else {
        json!({"status": "complete"})
    }
}

/// Lines that are not our magics, in the magics-only kernel: blank lines and comments are
/// fine; anything else is an error that says where Python runs.
pub fn not_a_magic(registry: &Registry, text: &str) -> Result<(), MagicError> {
    let Some(line) = text.lines().find(|l| is_code(l)) else {
        return Ok(());
    };
    if let Some(name) = cell::magic_name(line) {
        return Err(registry.unknown(name));
    }
    Err(MagicError::usage(format!(
        "{:?} is not a GPU magic. This is the magics-only kernel: it runs %magics, not Python. \
         Pick the \"Python 3 (GPU magics)\" kernel (gpu-python) to mix Python and magics.",
        line.trim()
    )))
}

/// This kernel evaluates no expressions; say so for each one asked.
pub fn user_expressions(asked: &Map<String, Value>) -> Map<String, Value> {
    asked
        .keys()
        .map(|key| {
            let error = json!({"status": "error", "ename": "UsageError",
                               "evalue": "the magics-only kernel evaluates no expressions",
                               "traceback": []});
            (key.clone(), error)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_complete_statuses() {
        let r = Registry::new();
        assert_eq!(is_complete(&r, "%gpumem")["status"], "complete");
        assert_eq!(
            is_complete(&r, "# note\n%gpuhelp\n\n")["status"],
            "complete"
        );
        assert_eq!(is_complete(&r, "%gpumem \\")["status"], "incomplete");
        assert_eq!(is_complete(&r, "print(1)")["status"], "invalid");
    }

    #[test]
    fn python_in_the_magics_kernel_explains_itself() {
        let r = Registry::new();
        assert!(not_a_magic(&r, "\n# c\n").is_ok());
        let err = not_a_magic(&r, "x = 1\n").unwrap_err();
        assert!(err.evalue.contains("gpu-python"));
        let err = not_a_magic(&r, "%nosuch 1\n").unwrap_err();
        assert!(err.evalue.contains("unknown magic %nosuch"));
    }
}
