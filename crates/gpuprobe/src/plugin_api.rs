//! The JSON contract between gpukernel and `libgpuprobe_torch.so` (always compiled, so the
//! kernel can speak it without linking libtorch).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::ffi::{c_char, c_int, c_void};

/// Bumped when the C functions change (not when a request is added).
pub const ABI_VERSION: u32 = 1;

/// `progress(event_json, data)`: returns non-zero to ask the operation to stop.
pub type ProgressFn = unsafe extern "C" fn(*const c_char, *mut c_void) -> c_int;

/// Where libtorch should compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

/// One operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// CUDA availability as libtorch sees it (initialises the CUDA driver, not a context).
    Info,
    /// A small computation proving libtorch loads and computes.
    Smoke { device: DeviceSpec },
}

/// What libtorch can do on this machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LibtorchInfo {
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failure {
    pub kind: String,
    pub message: String,
}

/// `{"ok": ...}` or `{"error": {"kind", "message"}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    Ok(Value),
    Error(Failure),
}

impl Reply {
    pub fn failure(kind: &str, message: impl Into<String>) -> Self {
        Reply::Error(Failure {
            kind: kind.to_string(),
            message: message.into(),
        })
    }
}
