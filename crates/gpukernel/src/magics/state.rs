//! GPU state kept across magics: the NVML handle, opened on first use.

use gpuprobe::{GpuSnapshot, Nvml, ProbeError};
use std::sync::{Mutex, PoisonError};

#[derive(Default)]
pub struct GpuState {
    nvml: Mutex<Option<Nvml>>,
}

impl GpuState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads all GPUs; opens NVML the first time (and retries while there is no driver).
    pub fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let mut nvml = self.nvml.lock().unwrap_or_else(PoisonError::into_inner);
        if nvml.is_none() {
            *nvml = Some(Nvml::open()?);
        }
        match nvml.as_ref() {
            Some(handle) => handle.snapshot(),
            None => Err(ProbeError::Nvml("NVML handle missing".into())),
        }
    }
}
