//! libtorch through tch (cargo feature `torch`).
//!
//! Calling anything here that touches CUDA creates a CUDA context in this process (about
//! 0.5 GiB of GPU memory), so callers do it only when a magic needs libtorch on the GPU.

use crate::ProbeError;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

/// What this build's libtorch can do on this machine.
#[derive(Debug, Clone, Serialize)]
pub struct LibtorchInfo {
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
}

/// Asks libtorch about CUDA. This initialises the CUDA driver when one is present.
pub fn libtorch_info() -> LibtorchInfo {
    LibtorchInfo {
        cuda_available: tch::Cuda::is_available(),
        cuda_device_count: tch::Cuda::device_count(),
        cudnn_available: tch::Cuda::cudnn_is_available(),
    }
}

/// Runs a small computation on `device` and returns its result, proving libtorch loads and
/// computes: the trace of `A @ A^T` for a fixed 3x3 `A`, which is the sum of its squares (285).
pub fn smoke_test(device: Device) -> Result<f64, ProbeError> {
    let a = Tensor::f_arange(9, (Kind::Float, device))
        .and_then(|t| t.f_reshape([3, 3]))
        .map_err(|e| ProbeError::Torch(e.to_string()))?;
    let product = a
        .f_matmul(&a.tr())
        .and_then(|p| p.f_trace())
        .map_err(|e| ProbeError::Torch(e.to_string()))?;
    product
        .f_double_value(&[])
        .map_err(|e| ProbeError::Torch(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_computes_on_cpu() {
        let trace = smoke_test(Device::Cpu).expect("libtorch runs on CPU");
        assert_eq!(trace, (0..9).map(|i| (i * i) as f64).sum::<f64>());
    }
}
