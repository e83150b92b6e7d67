//! What magics may ask of the Python kernel behind gpukernel (proxy mode only).

use serde::{Deserialize, Serialize};

/// The caching allocator of one CUDA device in the Python kernel, as torch reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    pub index: u32,
    /// The device's UUID as torch reports it (no "GPU-" prefix), to match NVML's GPU.
    #[serde(default)]
    pub uuid: Option<String>,
    pub allocated: u64,
    pub reserved: u64,
    pub peak_allocated: u64,
    pub num_ooms: u64,
}

/// torch in the Python kernel, read without importing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchState {
    pub imported: bool,
    pub version: Option<String>,
    pub cuda_initialized: bool,
    pub devices: Vec<DeviceMemory>,
}

/// The Python kernel, as magics see it.
pub trait PythonKernel: Send + Sync {
    fn pid(&self) -> u32;
    /// Reads torch's state in the Python kernel (waits for earlier cells to finish).
    fn torch(&self) -> Result<TorchState, String>;
    /// `gc.collect()` then `torch.cuda.empty_cache()` in the Python kernel, if torch is
    /// imported and has initialised CUDA there; never imports anything.
    fn empty_cache(&self) -> Result<(), String>;
    /// Saves the `torch.nn.Module` named `name` (a dotted name) as TorchScript into a private
    /// temporary file, leaving the module untouched (see `export_module.py`).
    /// `train`: trace (if it comes to that) in training mode rather than eval mode.
    fn export_module(
        &self,
        name: &str,
        input: Option<&[i64]>,
        vocab: Option<i64>,
        train: bool,
    ) -> Result<ExportedModule, String>;
}

/// A notebook module saved by [`PythonKernel::export_module`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ExportedModule {
    /// The TorchScript file (0600); the caller removes it.
    pub path: String,
    /// `"script"` or `"trace"`.
    pub method: String,
    pub training: bool,
    pub parameters: u64,
}

/// Whether `name` can name a notebook variable for [`PythonKernel::export_module`]:
/// identifiers joined by dots (`model`, `trainer.model`), nothing that evaluates code.
pub fn is_variable_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                && chars.all(|c| c == '_' || c.is_alphanumeric())
        })
}

const EXPORT_MODULE_SOURCE: &str = include_str!("export_module.py");

/// The user expression behind [`PythonKernel::export_module`]: runs `export_module.py` in a
/// namespace of its own and evaluates to an object whose repr is the result's JSON.
pub fn export_module_expression(
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
pub fn parse_exported_module(text: &str) -> Result<ExportedModule, String> {
    serde_json::from_str(text).map_err(|e| format!("unreadable export result ({e}): {text}"))
}

/// Code for [`PythonKernel::empty_cache`]: leaves no names behind in the user's namespace.
pub const EMPTY_CACHE_CODE: &str = "(lambda m: (__import__('gc').collect(), m.cuda.empty_cache()) \
    if m is not None and m.cuda.is_initialized() else None)(__import__('sys').modules.get('torch'))";

/// A Python expression evaluating to an object whose repr is the [`TorchState`] JSON. It looks
/// torch up in `sys.modules` and so never imports it, and touches CUDA only if torch already
/// initialised it (no new context).
pub const TORCH_STATE_EXPR: &str = r#"(lambda sys, json: (lambda m: type('GpuKernelJSON', (), {'__repr__': lambda self, s=json.dumps({
  'imported': m is not None,
  'version': getattr(m, '__version__', None),
  'cuda_initialized': bool(m is not None and m.cuda.is_initialized()),
  'devices': [dict(index=i, uuid=str(m.cuda.get_device_properties(i).uuid),
                   allocated=m.cuda.memory_allocated(i), reserved=m.cuda.memory_reserved(i),
                   peak_allocated=m.cuda.max_memory_allocated(i),
                   num_ooms=m.cuda.memory_stats(i).get('num_ooms', 0))
              for i in range(m.cuda.device_count())] if m is not None and m.cuda.is_initialized() else [],
}): s})())(sys.modules.get('torch')))(__import__('sys'), __import__('json'))"#;

/// Parses the `text/plain` of the expression's result.
pub fn parse_torch_state(text: &str) -> Result<TorchState, String> {
    serde_json::from_str(text).map_err(|e| format!("unreadable torch state ({e}): {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dotted_identifiers_name_variables() {
        for ok in ["model", "trainer.model", "_m2", "modèle"] {
            assert!(is_variable_name(ok), "{ok}");
        }
        for bad in [
            "",
            "m()",
            "a..b",
            "2x",
            "a.b[0]",
            "x; import os",
            "./model.pt",
        ] {
            assert!(!is_variable_name(bad), "{bad}");
        }
    }

    #[test]
    fn the_export_expression_quotes_its_arguments() {
        let e = export_module_expression("net", Some(&[3, 32, 32]), None, true);
        assert!(e.contains(r#""net", [3,32,32], None, True"#), "{e}");
        assert!(e.starts_with("(lambda ns, json: (exec(\""));
    }
}
