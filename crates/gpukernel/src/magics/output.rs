//! What a magic produces, as plain data: the kernel turns these into iopub messages.

use serde_json::{Map, Value};

/// A MIME bundle: `{"text/plain": ..., "text/html": ...}`.
pub type Bundle = Map<String, Value>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamName {
    Stdout,
    Stderr,
}

impl StreamName {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamName::Stdout => "stdout",
            StreamName::Stderr => "stderr",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Stream {
        name: StreamName,
        text: String,
    },
    /// A display; with `display_id` it can later be replaced by an [`Output::Update`].
    Display {
        data: Bundle,
        display_id: Option<String>,
    },
    /// Replaces the display with this id wherever it is shown.
    Update {
        data: Bundle,
        display_id: String,
    },
    /// The cell's value (`Out[n]`), for magics whose result scripts consume.
    Result {
        data: Bundle,
    },
    /// Text for the pager (`%magic?`), sent as an execute_reply payload.
    Page {
        data: Bundle,
    },
}

impl Output {
    /// The cell's value when a script asked for it (`--json`), else a plain display.
    pub fn value_or_display(data: Bundle, as_value: bool) -> Self {
        if as_value {
            Output::Result { data }
        } else {
            Output::Display {
                data,
                display_id: None,
            }
        }
    }
}

/// Builds a bundle from text and optional HTML.
pub fn bundle(text: impl Into<String>, html: Option<String>) -> Bundle {
    let mut data = Bundle::new();
    data.insert("text/plain".into(), Value::String(text.into()));
    if let Some(html) = html {
        data.insert("text/html".into(), Value::String(html));
    }
    data
}

/// Receives outputs as a magic produces them, so long magics show progress live.
pub trait OutputSink: Send + Sync {
    fn emit(&self, output: Output);
    /// An owned sink with the same destination, for output that outlives the magic (a gauge).
    fn detach(&self) -> std::sync::Arc<dyn OutputSink>;
}

/// A magic's failure, shown as an `error` output (IPython's shape: ename, evalue, traceback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MagicError {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

impl MagicError {
    pub fn new(ename: &str, evalue: impl Into<String>) -> Self {
        let evalue = evalue.into();
        Self {
            ename: ename.to_string(),
            traceback: vec![format!("{ename}: {evalue}")],
            evalue,
        }
    }

    /// Wrong magic name, flags or values; IPython calls these UsageError.
    pub fn usage(evalue: impl Into<String>) -> Self {
        Self::new("UsageError", evalue)
    }

    pub fn interrupted() -> Self {
        Self::new("KeyboardInterrupt", "interrupted by the user")
    }
}

/// Escapes text for HTML output.
pub fn html_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}
