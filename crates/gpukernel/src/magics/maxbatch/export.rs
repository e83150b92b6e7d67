//! `--engine libtorch` on a notebook module: the Python kernel saves it as TorchScript in a
//! private file (`export_module.py`), leaving the module untouched.

use crate::magics::python::{Bound, EvalError, PythonKernel};
use crate::magics::CancelToken;
use serde::Deserialize;
use std::time::Duration;

/// A notebook module saved by [`export`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(super) struct ExportedModule {
    /// The TorchScript file (0600); the caller removes it.
    pub path: String,
    /// `"script"` or `"trace"`.
    pub method: String,
    pub training: bool,
    pub parameters: u64,
    /// The token ids' range: `--vocab`, else the first layer's Embedding.
    #[serde(default)]
    pub vocab: Option<i64>,
    /// The forward's optional targets argument, which this engine does not pass.
    #[serde(default)]
    pub targets_parameter: Option<String>,
    /// A LightningModule with its own training_step, which this engine does not run.
    #[serde(default)]
    pub lightning: bool,
    /// The module's layers that take (seq, batch, ...) (`batch_first=False`).
    #[serde(default)]
    pub seq_first: Vec<String>,
    /// Bytes the notebook's process had allocated on the module's GPU (absent off the GPU).
    #[serde(default)]
    pub held_on_device: Option<u64>,
    /// How much of that is the module's own weights, buffers and gradients.
    #[serde(default)]
    pub own_bytes: Option<u64>,
    /// What the notebook's allocator may hold on that GPU (its memory fraction applied).
    #[serde(default)]
    pub allocator_limit: Option<u64>,
    /// Whether the notebook's allocator maps expandable segments (which strand no block).
    #[serde(default)]
    pub expandable_segments: Option<bool>,
}

/// Why a module could not be exported.
#[derive(Debug, thiserror::Error)]
pub(super) enum ExportError {
    /// The Python side raised (not a module, scripting and tracing failed) or gave no answer.
    #[error(transparent)]
    Python(#[from] EvalError),
    #[error("unreadable export result ({source}): {text}")]
    Unreadable {
        source: serde_json::Error,
        text: String,
    },
}

const EXPORT_MODULE_SOURCE: &str = include_str!("export_module.py");

/// The user expression behind [`export`]: runs `export_module.py` in a
/// namespace of its own and evaluates to an object whose repr is the result's JSON.
fn export_module_expression(
    name: &str,
    input: Option<&[i64]>,
    vocab: Option<i64>,
    train: bool,
) -> String {
    // JSON literals are Python literals (strings, lists of ints); null is spelt None.
    let literal = |v: serde_json::Value| match v {
        serde_json::Value::Null => "None".to_string(),
        other => other.to_string(),
    };
    format!(
        "(lambda ns, json: (exec({source}, ns), type('GpuKernelJSON', (), {{'__repr__': \
         lambda self, s=json.dumps(ns['export'](get_ipython().user_ns, {name}, {input}, \
         {vocab}, {train})): s}})())[1])({{}}, __import__('json'))",
        source = literal(serde_json::Value::from(EXPORT_MODULE_SOURCE)),
        name = literal(serde_json::Value::from(name)),
        input = literal(serde_json::json!(input)),
        vocab = literal(serde_json::json!(vocab)),
        train = if train { "True" } else { "False" },
    )
}

/// Parses the `text/plain` of [`export_module_expression`]'s result.
fn parse_exported_module(text: &str) -> Result<ExportedModule, ExportError> {
    serde_json::from_str(text).map_err(|source| ExportError::Unreadable {
        source,
        text: text.to_string(),
    })
}

/// Saves the `torch.nn.Module` named `name` (a dotted name) as TorchScript into a private
/// temporary file, leaving the module untouched. `train`: trace (if it comes to that) in
/// training mode rather than eval mode.
pub(super) fn export(
    python: &dyn PythonKernel,
    cancel: &CancelToken,
    name: &str,
    input: Option<&[i64]>,
    vocab: Option<i64>,
    train: bool,
) -> Result<ExportedModule, ExportError> {
    let expression = export_module_expression(name, input, vocab, train);
    let text = python.evaluate_bounded(
        &expression,
        Bound {
            limit: Duration::from_secs(600),
            cancel,
            tick: &mut |_| {},
        },
    )?;
    parse_exported_module(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_export_expression_quotes_its_arguments() {
        let e = export_module_expression("net", Some(&[3, 32, 32]), None, true);
        assert!(e.contains(r#""net", [3,32,32], None, True"#), "{e}");
        assert!(e.starts_with("(lambda ns, json: (exec(\""));
    }
}
