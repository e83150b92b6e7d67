//! What magics may ask of the Python kernel behind gpukernel (proxy mode only).

use super::CancelToken;
use serde::{Deserialize, Serialize};
use std::time::Duration;

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

/// Why an expression evaluated in the Python kernel gave no value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// The expression raised (`ename: evalue`, as Python names it).
    #[error("{ename}: {evalue}")]
    Raised { ename: String, evalue: String },
    /// No answer within the bound; the Python kernel was interrupted.
    #[error("no answer from the Python kernel within {0:?}; it was interrupted")]
    TimedOut(Duration),
    /// No answer within the bound and nothing interrupted (see
    /// [`PythonKernel::evaluate_within`]): the Python kernel is busy with later cells.
    #[error("no answer from the Python kernel within {0:?} (busy with later cells)")]
    NoAnswer(Duration),
    /// The user interrupted while we waited.
    #[error("interrupted")]
    Cancelled,
    /// The channel to the Python kernel failed (it died, say).
    #[error("{0}")]
    Channel(String),
    /// An answer came that is not what the expression returns.
    #[error("{0}")]
    Unreadable(String),
}

/// How long [`PythonKernel::evaluate_bounded`] waits, what ends the wait early, and who hears
/// how long it has waited so far (twice a second, for live progress).
pub struct Bound<'a> {
    pub limit: Duration,
    pub cancel: &'a CancelToken,
    pub tick: &'a mut dyn FnMut(Duration),
}

/// The Python kernel, as magics see it.
pub trait PythonKernel: Send + Sync {
    /// Evaluates `expression` in the Python kernel as a silent user_expression (no output, no
    /// history, no execution count; after earlier cells finish) and returns its `text/plain`.
    /// Past `bound.limit` the kernel is interrupted and the wait ends a few seconds later at
    /// the most; a cancel ends it the same way (the interrupt has reached the kernel too).
    fn evaluate_bounded(&self, expression: &str, bound: Bound<'_>) -> Result<String, EvalError>;
    /// Evaluates `expression` like [`Self::evaluate_bounded`] but never interrupts the kernel:
    /// past `limit` it stops waiting ([`EvalError::NoAnswer`]); the expression still runs when
    /// the kernel gets to it and its answer is dropped. For work that must not disturb cells
    /// queued behind it (the diagnosis after a failed cell).
    fn evaluate_within(&self, expression: &str, limit: Duration) -> Result<String, EvalError>;
    fn pid(&self) -> u32;
    /// Reads torch's state in the Python kernel (waits for earlier cells to finish).
    fn torch(&self) -> Result<TorchState, EvalError>;
    /// `gc.collect()` then `torch.cuda.empty_cache()` in the Python kernel, if torch is
    /// imported and has initialised CUDA there; never imports anything.
    fn empty_cache(&self) -> Result<(), EvalError>;
}

/// Whether `name` can name a notebook variable:
/// identifiers joined by dots (`model`, `trainer.model`), nothing that evaluates code.
pub fn is_variable_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                && chars.all(|c| c == '_' || c.is_alphanumeric())
        })
}

/// An expression calling `function` of a private Python module made from `source` with
/// keyword arguments `args` (a JSON object). The module is kept in `sys.modules[key]` (key
/// plus a hash of the source, so a newer gpukernel's code replaces an older one) until the
/// module itself removes it; the notebook's namespace gains nothing. The module must define
/// `call(user_ns, name, args_json)` returning JSON text, which is the expression's repr.
pub fn module_call_expression(
    key: &str,
    source: &str,
    function: &str,
    args: &serde_json::Value,
) -> String {
    let key = format!("{key}_{:016x}", fnv1a(source.as_bytes()));
    let literal = |s: &str| serde_json::Value::from(s).to_string(); // JSON strings are Python's
    format!(
        "(lambda sys, types: (lambda m: type('GpuKernelJSON', (), {{'__repr__': lambda self, \
         s=m.call(get_ipython().user_ns, {function}, {args}): s}})())(sys.modules.get({key}) or \
         (lambda m: (exec({source}, m.__dict__), sys.modules.__setitem__({key}, m), m)[2])\
         (types.ModuleType({key}))))(__import__('sys'), __import__('types'))",
        function = literal(function),
        args = literal(&args.to_string()),
        key = literal(&key),
        source = literal(source),
    )
}

/// FNV-1a: a stable, dependency-free fingerprint of embedded sources.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
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
pub fn parse_torch_state(text: &str) -> Result<TorchState, EvalError> {
    serde_json::from_str(text)
        .map_err(|e| EvalError::Unreadable(format!("unreadable torch state ({e}): {text}")))
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
}
