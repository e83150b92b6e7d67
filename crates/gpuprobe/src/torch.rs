//! libtorch through tch (cargo feature `torch`), reached by gpukernel through the plugin
//! (`plugin/`, `libgpuprobe_torch.so`).
//!
//! Anything here that touches CUDA creates a CUDA context in this process (about 0.5 GiB of
//! GPU memory), so callers do it only when a magic needs libtorch on the GPU.

use crate::allocator::{self, AllocatorError};
use crate::plugin_api::{DeviceSpec, Failure, LibtorchInfo, Reply, Request};
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
pub fn handle(request: &str, progress: &dyn Fn(&str) -> bool) -> Reply {
    let request: Request = match serde_json::from_str(request) {
        Ok(r) => r,
        Err(e) => return Reply::failure("bad_request", e.to_string()),
    };
    let result = match request {
        Request::Info => serde_json::to_value(libtorch_info()).map_err(torch_failure),
        Request::Smoke { device: spec } => smoke_test(device(spec))
            .map(serde_json::Value::from)
            .map_err(torch_failure),
        Request::AllocatorStats => allocator_reply(Ok(())),
        Request::EmptyCache => allocator_reply(allocator::empty_cache().map(drop)),
        Request::ResetPeak { device } => allocator_reply(allocator::reset_peak(device)),
        Request::SetMemoryFraction { device, fraction } => {
            allocator_reply(allocator::set_memory_fraction(device, fraction))
        }
        Request::TryAllocate { device, bytes } => {
            allocator_reply(allocator::try_allocate(device, bytes))
        }
        Request::MaxBatch(request) => crate::maxbatch::run(&request, progress)
            .map_err(torch_failure)
            .and_then(|report| serde_json::to_value(report).map_err(torch_failure)),
        Request::Steps {
            setup,
            batch,
            steps,
        } => crate::maxbatch::steps(&setup, batch, steps)
            .map_err(torch_failure)
            .and_then(|report| serde_json::to_value(report).map_err(torch_failure)),
        Request::Throughput {
            setup,
            batches,
            steps,
        } => crate::maxbatch::throughput(&setup, &batches, steps, progress)
            .map_err(torch_failure)
            .and_then(|points| serde_json::to_value(points).map_err(torch_failure)),
        Request::ValidateOnCpu(request) => crate::maxbatch::validate_on_cpu(&request)
            .map(serde_json::Value::from)
            .map_err(torch_failure),
    };
    match result {
        Ok(value) => Reply::Ok(value),
        Err(failure) => Reply::Error(failure),
    }
}

fn torch_failure(error: impl ToString) -> Failure {
    Failure {
        kind: "torch".into(),
        message: error.to_string(),
    }
}

fn allocator_failure(error: AllocatorError) -> Failure {
    let kind = match error {
        AllocatorError::OutOfMemory(_) => "out_of_memory",
        AllocatorError::NotInitialised => "not_initialised",
        AllocatorError::InvalidArgument(_) => "bad_request",
        AllocatorError::Torch(_) => "torch",
    };
    Failure {
        kind: kind.into(),
        message: error.to_string(),
    }
}

/// The outcome of an allocator operation: on success the allocator's figures after it.
fn allocator_reply(done: Result<(), AllocatorError>) -> Result<serde_json::Value, Failure> {
    done.and_then(|()| allocator::snapshot())
        .map_err(allocator_failure)
        .and_then(|stats| serde_json::to_value(stats).map_err(torch_failure))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(request: &str) -> Reply {
        handle(request, &|_: &str| false)
    }

    fn failure(reply: Reply) -> Failure {
        match reply {
            Reply::Error(f) => f,
            Reply::Ok(v) => panic!("expected an error, got {v}"),
        }
    }

    // Nothing in this test binary uses CUDA (try_allocate_without_a_gpu... runs only where
    // there is none), so the allocator stays uninitialised on any machine.

    #[test]
    fn allocator_stats_before_cuda_is_uninitialised_and_creates_nothing() {
        match call(r#"{"op":"allocator_stats"}"#) {
            Reply::Ok(v) => assert_eq!(v, json!({"initialized": false, "devices": []})),
            Reply::Error(e) => panic!("{e:?}"),
        }
        // Asking did not set it up.
        assert_eq!(allocator::initialized(), Ok(false));
    }

    #[test]
    fn empty_cache_before_cuda_is_a_successful_no_op() {
        match call(r#"{"op":"empty_cache"}"#) {
            Reply::Ok(v) => assert_eq!(v, json!({"initialized": false, "devices": []})),
            Reply::Error(e) => panic!("{e:?}"),
        }
        assert_eq!(allocator::empty_cache(), Ok(false));
    }

    #[test]
    fn reset_peak_and_memory_fraction_before_cuda_say_not_initialised() {
        for request in [
            r#"{"op":"reset_peak","device":0}"#,
            r#"{"op":"set_memory_fraction","device":0,"fraction":0.5}"#,
        ] {
            let f = failure(call(request));
            assert_eq!(f.kind, "not_initialised", "{request}: {f:?}");
            assert!(f.message.contains("not initialised"), "{f:?}");
        }
        assert_eq!(
            allocator::reset_peak(0),
            Err(AllocatorError::NotInitialised)
        );
    }

    #[test]
    fn bad_allocator_arguments_are_bad_requests() {
        for request in [
            r#"{"op":"set_memory_fraction","device":0,"fraction":1.5}"#,
            r#"{"op":"set_memory_fraction","device":0,"fraction":-0.1}"#,
            r#"{"op":"reset_peak","device":500}"#,
            r#"{"op":"reset_peak"}"#,
        ] {
            assert_eq!(failure(call(request)).kind, "bad_request", "{request}");
        }
    }

    #[test]
    fn try_allocate_without_a_gpu_is_a_torch_error_not_a_crash() {
        if tch::Cuda::device_count() > 0 {
            eprintln!(
                "skipped: this machine has CUDA devices (bench/gpu/allocator_check.py covers them)"
            );
            return;
        }
        let f = failure(call(r#"{"op":"try_allocate","device":0,"bytes":1024}"#));
        assert_eq!(f.kind, "torch", "{f:?}");
        assert!(!f.message.is_empty());
        // The failed attempt left no half-initialised allocator behind.
        assert_eq!(allocator::initialized(), Ok(false));
    }

    #[test]
    fn allocator_errors_map_to_failure_kinds() {
        let oom = allocator_reply(Err(AllocatorError::OutOfMemory(
            "CUDA out of memory. Tried to allocate 2.00 GiB".into(),
        )));
        let oom = oom.expect_err("an OOM is a failure");
        assert_eq!(oom.kind, "out_of_memory");
        assert!(oom.message.contains("Tried to allocate"), "{oom:?}");
        let torch = allocator_reply(Err(AllocatorError::Torch("boom".into())));
        assert_eq!(torch.expect_err("a failure").kind, "torch");
    }

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
