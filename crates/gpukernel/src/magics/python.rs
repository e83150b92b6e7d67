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
