//! libtorch through tch (cargo feature `torch`), reached by gpukernel through the plugin
//! (`plugin/`, `libgpuprobe_torch.so`).
//!
//! Anything here that touches CUDA creates a CUDA context in this process (about 0.5 GiB of
//! GPU memory), so callers do it only when a magic needs libtorch on the GPU.

use crate::plugin_api::{DeviceSpec, LibtorchInfo, Reply, Request};
use crate::ProbeError;
use tch::{Device, Kind, Tensor};

/// Asks libtorch about CUDA. This initialises the CUDA driver when one is present.
pub fn libtorch_info() -> LibtorchInfo {
    LibtorchInfo {
        cuda_available: tch::Cuda::is_available(),
        cuda_device_count: tch::Cuda::device_count(),
        cudnn_available: tch::Cuda::cudnn_is_available(),
    }
}

fn device(spec: DeviceSpec) -> Device {
    match spec {
        DeviceSpec::Cpu => Device::Cpu,
        DeviceSpec::Cuda(i) => Device::Cuda(i),
    }
}

/// Runs a small computation on `device` and returns its result, proving libtorch loads and
/// computes: the trace of `A @ A^T` for `A = arange(9).reshape(3, 3)`, the sum of squares 0..8.
pub fn smoke_test(device: Device) -> Result<f64, ProbeError> {
    let torch_err = |e: tch::TchError| ProbeError::Torch(e.to_string());
    let a = Tensor::f_arange(9, (Kind::Float, device))
        .and_then(|t| t.f_reshape([3, 3]))
        .map_err(torch_err)?;
    let trace = a
        .f_matmul(&a.tr())
        .and_then(|p| p.f_trace())
        .map_err(torch_err)?;
    trace.f_double_value(&[]).map_err(torch_err)
}

/// Serves one plugin request (JSON in, [`Reply`] out). `progress` receives events of long
/// operations and returns true to cancel.
pub fn handle(request: &str, _progress: &dyn Fn(&str) -> bool) -> Reply {
    let request: Request = match serde_json::from_str(request) {
        Ok(r) => r,
        Err(e) => return Reply::failure("bad_request", e.to_string()),
    };
    let result = match request {
        Request::Info => serde_json::to_value(libtorch_info()).map_err(|e| e.to_string()),
        Request::Smoke { device: spec } => smoke_test(device(spec))
            .map(serde_json::Value::from)
            .map_err(|e| e.to_string()),
    };
    match result {
        Ok(value) => Reply::Ok(value),
        Err(message) => Reply::failure("torch", message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_computes_on_cpu() {
        let trace = smoke_test(Device::Cpu).expect("libtorch runs on CPU");
        assert_eq!(trace, (0..9).map(|i| (i * i) as f64).sum::<f64>());
    }

    #[test]
    fn handles_json_requests() {
        let never = |_: &str| false;
        match handle(r#"{"op":"smoke","device":"cpu"}"#, &never) {
            Reply::Ok(v) => assert_eq!(v, 204.0),
            Reply::Error(e) => panic!("{e:?}"),
        }
        assert!(
            matches!(handle("{\"op\":\"nope\"}", &never), Reply::Error(f) if f.kind == "bad_request")
        );
    }
}
