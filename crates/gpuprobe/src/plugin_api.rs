//! The JSON contract between gpukernel and `libgpuprobe_torch.so` (always compiled, so the
//! kernel can speak it without linking libtorch).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::ffi::{c_char, c_int, c_void};

/// Bumped when the C functions change (not when a request is added).
pub const ABI_VERSION: u32 = 1;

/// Steps per trial of the libtorch engine: the second runs on the cache the first left behind (gradients
/// and optimizer state allocated, blocks split), which is what every later training step
/// sees. A single clean step underestimates it: a batch found that way can OOM at step 2.
/// And a third, as the python engine runs at most (some models' third step needs more).
pub const STEPS_PER_TRIAL: usize = 3;

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
    /// This process's caching allocator: whether it is initialised (CUDA has been used in
    /// this process) and, if so, [`AllocatorStats`] per visible device. Never creates a
    /// context.
    AllocatorStats,
    /// Releases cached, unused blocks of this process's caching allocator (no-op without a
    /// context). Replies with [`AllocatorStats`] after.
    EmptyCache,
    /// Resets the peak counters of `device`. Replies with [`AllocatorStats`] after.
    ResetPeak { device: usize },
    /// Caps this process's allocator on `device` at `fraction` (0 to 1) of the device's
    /// memory. Replies with [`AllocatorStats`] after. Refused for a device that has no CUDA
    /// context in this process (setting it would create one).
    SetMemoryFraction { device: usize, fraction: f64 },
    /// Allocates `bytes` on `device` through the caching allocator, as a tensor would, and
    /// frees them (the block stays cached). Creates a CUDA context when there is none. An OOM
    /// is a `Failure` of kind `"out_of_memory"`; replies with [`AllocatorStats`] after.
    TryAllocate { device: usize, bytes: u64 },
    /// `%maxbatch`: search for the largest batch that fits; progress events are
    /// `{"event":"trial_start", "batch"}` before each trial and `{"event":"trial", "batch",
    /// "outcome", "fits", "ms", "limit"}` after it. Replies [`MaxBatchReport`].
    MaxBatch(MaxBatchRequest),
    /// Builds the model and runs one step of batch 1 on the CPU (no GPU here). Replies a
    /// sentence saying what ran.
    ValidateOnCpu(MaxBatchRequest),
    /// Runs `steps` training steps at `batch` (checking a search's answer). Replies
    /// [`StepsReport`].
    Steps {
        setup: MaxBatchRequest,
        batch: u64,
        steps: u32,
    },
    /// `%maxbatch --throughput`: samples per second of `steps` timed training steps (after two
    /// warm-up steps) at each of `batches`, each from a fresh model. Progress events are
    /// `{"event":"throughput", "batch", "samples_per_s", "out_of_memory"}`; replies a list of
    /// [`ThroughputPoint`].
    Throughput {
        setup: MaxBatchRequest,
        batches: Vec<u64>,
        steps: u32,
    },
}

/// What [`Request::Steps`] ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepsReport {
    /// Steps that ran before the first out of memory, or all of them.
    pub steps_run: u32,
    pub out_of_memory: bool,
    /// The cache's reserved peak over the steps that ran.
    pub peak: u64,
    /// Bytes allocated once the model was dropped and the cache emptied.
    pub after_allocated: i64,
}

/// Training speed at one batch size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThroughputPoint {
    pub batch: u64,
    /// `None` when the batch ran out of memory.
    pub samples_per_s: Option<f64>,
}

/// Built-in architectures (`tch::vision`, random weights) that [`ModelSource::Builtin`] names.
pub const BUILTIN_MODELS: &[&str] = &[
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
    "efficientnet_b0",
    "efficientnet_b1",
    "efficientnet_b2",
    "efficientnet_b3",
    "efficientnet_b4",
    "efficientnet_b5",
    "efficientnet_b6",
    "efficientnet_b7",
    "mobilenet_v2",
    "inception_v3",
    "convmixer_1536_20",
    "convmixer_1024_20",
];

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelSource {
    /// A `tch::vision` architecture with random weights.
    Builtin { name: String },
    /// A TorchScript file.
    TorchScript { path: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    None,
    Sgd,
    Adam,
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    Fp16,
    Bf16,
}

/// What `%maxbatch` asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaxBatchRequest {
    pub model: ModelSource,
    /// Shape of one sample (default: the built-in's usual input).
    pub input: Option<Vec<i64>>,
    /// Integer token inputs in `0..vocab` instead of floats (language models).
    pub vocab: Option<i64>,
    /// Parameters and inputs in this precision instead of fp32.
    pub dtype: Option<Precision>,
    /// Mixed precision: fp32 parameters and optimizer state, the forward pass autocast to this.
    #[serde(default)]
    pub amp: Option<Precision>,
    pub optimizer: OptimizerKind,
    /// Forward only, without gradients.
    pub inference: bool,
    pub device: usize,
    /// The size of the card to answer for, in bytes (default: this device as it is, i.e. what
    /// it has free plus what we hold). The CUDA context's own memory is taken off it.
    pub limit: Option<u64>,
    /// Without `limit`: the allocator's budget in bytes as another process has it (a notebook
    /// module's kernel, capped by its memory fraction), taken as it is: that process's own
    /// CUDA context is outside its allocator too.
    #[serde(default)]
    pub allocator_budget: Option<u64>,
    pub max_batch: u64,
    pub max_trials: usize,
    /// Stop once the answer is within this fraction of the true maximum (0: to the sample).
    #[serde(default)]
    pub tolerance: f64,
    /// Run Lightning's double-then-bisect instead (for benchmarks).
    #[serde(default)]
    pub baseline_search: bool,
    /// The loss of the training step (`None`: inferred from the output, see [`crate::loss`]).
    #[serde(default)]
    pub loss: Option<crate::loss::LossKind>,
    /// The number of classes the loss's targets range over, which also picks the dimension.
    #[serde(default)]
    pub target_classes: Option<i64>,
    /// A trial still running after this many seconds stops at its next step and fails the
    /// search with a message (a single libtorch op cannot be interrupted).
    #[serde(default)]
    pub trial_timeout_s: Option<f64>,
}

/// The result of [`Request::MaxBatch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MaxBatchReport {
    pub search: crate::search::SearchResult,
    /// The loss the trials computed (`None`: inference, no loss).
    #[serde(default)]
    pub loss: Option<crate::loss::LossPlan>,
    /// What the loss was computed on where the model returns several tensors.
    #[serde(default)]
    pub loss_inputs: Option<crate::loss::LossInputs>,
    /// What the caching allocator could hold during the search (the card less the context).
    pub limit: u64,
    /// This process's CUDA context on the device (NVML's figure less the allocator's), taken
    /// off `--limit`; `None` where NVML could not say.
    #[serde(default)]
    pub context_bytes: Option<u64>,
    /// Allocated bytes with the model built, before the first trial.
    pub baseline_allocated: u64,
    /// Allocated and reserved bytes after the model was dropped and the cache emptied.
    pub after_allocated: u64,
    pub after_reserved: u64,
    /// (batch, milliseconds) of each trial.
    pub trial_ms: Vec<(u64, f64)>,
    /// (batch, the cache's reserved peak) of each trial that ran: what the device had to
    /// hold, beside the allocated peak the fit uses.
    #[serde(default)]
    pub trial_reserved: Vec<(u64, u64)>,
    /// (batch, the largest segment it made the cache reserve) of each trial that ran, where
    /// the segments could be read and are not expandable: for `stranded::room_of_trials`.
    #[serde(default)]
    pub trial_blocks: Vec<(u64, u64)>,
    pub elapsed_ms: f64,
    pub device_total: u64,
    /// Where free memory set the limit (no `--limit`, no notebook budget below it): what was
    /// free and what this process's cache held then. Memory in use outside this process
    /// (another user's training on a shared card) is what the rest of the card holds.
    #[serde(default)]
    pub free_at_start: Option<FreeAtStart>,
}

/// The device's free memory, and what this process's caching allocator held, at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeAtStart {
    pub free: u64,
    pub reserved: u64,
}

/// One figure of the allocator, as c10 keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
}

/// c10's DeviceStats for one device (aggregate over pools).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAllocatorStats {
    pub device: usize,
    pub allocated_bytes: Stat,
    pub reserved_bytes: Stat,
    pub active_bytes: Stat,
    pub inactive_split_bytes: Stat,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    /// cudaMemGetInfo for the device: (free, total). Both 0 when this process has no context
    /// on the device (reading them would create one).
    pub free: u64,
    pub total: u64,
}

/// Reply to [`Request::AllocatorStats`] and the other allocator requests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorStats {
    /// False until CUDA is used in this process (no context yet); then `devices` is empty.
    pub initialized: bool,
    pub devices: Vec<DeviceAllocatorStats>,
}

/// What libtorch can do on this machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LibtorchInfo {
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
}

/// `kind` is `"out_of_memory"` when CUDA ran out of memory (detected by the exception's type
/// in C++, never by its text), `"not_initialised"` (an allocator operation before CUDA was
/// used in this process), `"torch"` for other libtorch errors, `"bad_request"`, `"panic"`.
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// gpukernel builds these requests and reads these replies: their JSON is the contract.
    #[test]
    fn allocator_requests_and_replies_keep_their_json_shape() {
        let cases = [
            (Request::AllocatorStats, json!({"op": "allocator_stats"})),
            (Request::EmptyCache, json!({"op": "empty_cache"})),
            (
                Request::ResetPeak { device: 1 },
                json!({"op": "reset_peak", "device": 1}),
            ),
            (
                Request::SetMemoryFraction {
                    device: 0,
                    fraction: 0.5,
                },
                json!({"op": "set_memory_fraction", "device": 0, "fraction": 0.5}),
            ),
            (
                Request::TryAllocate {
                    device: 0,
                    bytes: 1 << 40,
                },
                json!({"op": "try_allocate", "device": 0, "bytes": 1u64 << 40}),
            ),
        ];
        for (request, expected) in cases {
            assert_eq!(serde_json::to_value(&request).ok(), Some(expected));
        }
        let stats = AllocatorStats {
            initialized: true,
            devices: vec![DeviceAllocatorStats {
                allocated_bytes: Stat {
                    current: 1,
                    peak: 2,
                },
                ..Default::default()
            }],
        };
        let value = serde_json::to_value(&stats).expect("serialises");
        assert_eq!(
            value["devices"][0]["allocated_bytes"],
            json!({"current": 1, "peak": 2})
        );
        assert_eq!(value["devices"][0]["free"], 0);
        let back: AllocatorStats = serde_json::from_value(value).expect("round trip");
        assert_eq!(back, stats);
    }
}
