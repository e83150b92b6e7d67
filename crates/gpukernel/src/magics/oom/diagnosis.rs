//! From the probe's facts, NVML and what this session knows, the diagnosis: what was asked,
//! what was there, who holds the card, and the next steps ranked for this case.
//!
//! Pure data in, data out (no protocol, no Python): unit-tested below.

use super::facts::{parse_message, AllocatorFacts, LiveTensor, MessageFigures, ProbeFacts};
use super::procs::{classify, ProcessView, Role};
use crate::magics::visible;
use gpuprobe::units::human_bytes;
use gpuprobe::{GpuInfo, GpuSnapshot, ProbeError};
use serde::Serialize;
use std::collections::BTreeMap;

/// A `%maxbatch` result seen in this session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MaxBatchNote {
    pub model: String,
    pub max_batch: Option<u64>,
    pub recommended: Option<u64>,
}

/// Everything the diagnosis is made from.
pub struct Inputs<'a> {
    pub facts: &'a ProbeFacts,
    pub snapshot: Result<&'a GpuSnapshot, &'a ProbeError>,
    pub kernel_pid: Option<u32>,
    pub maxbatch: &'a [MaxBatchNote],
    /// `num_ooms` per CUDA device at the previous diagnosis (0 before the first).
    pub previous_ooms: &'a BTreeMap<u32, u64>,
    pub cuda_visible_devices: Option<&'a str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    pub exception_type: String,
    pub message: String,
    /// The allocator's `num_ooms` rose on this device since the last look (`None`: CUDA not
    /// initialised in the Python kernel, so the error was not raised by its allocator).
    pub allocator_confirms: Option<bool>,
    pub requested_bytes: Option<u64>,
    pub at_oom: MessageFigures,
    pub device: DeviceView,
    pub processes: Vec<ProcessView>,
    pub tensors: Vec<LiveTensor>,
    pub tensor_bytes_total: u64,
    pub traceback_bytes: u64,
    pub traceback_tensors: u64,
    pub has_traceback: bool,
    pub model: Option<String>,
    pub batch: Option<BatchView>,
    pub maxbatch: Option<MaxBatchNote>,
    pub alloc_conf: Option<String>,
    pub suggestions: Vec<Suggestion>,
    /// Set when NVML could not be read (no driver on this machine, say).
    pub nvml_error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeviceView {
    /// torch's CUDA ordinal.
    pub cuda_index: Option<u32>,
    pub nvml_index: Option<u32>,
    pub name: Option<String>,
    pub total_bytes: Option<u64>,
    pub nvml_free_bytes: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub reclaimable_bytes: Option<u64>,
    pub releasable_bytes: Option<u64>,
    pub largest_free_block_bytes: Option<u64>,
    /// Share of the cached free memory outside its largest block (0: one block, 1: dust).
    pub fragmentation: Option<f64>,
    pub num_ooms: Option<u64>,
    /// The cap `set_per_process_memory_fraction` puts on the Python kernel.
    pub cap_bytes: Option<u64>,
    /// Allocated bytes no notebook name reaches (the failed cell's frames and graph, mostly).
    pub unnamed_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BatchView {
    pub size: u64,
    /// Where the number came from.
    pub source: String,
}

/// One next step; `action` is what a script would do to follow it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Suggestion {
    #[serde(flatten)]
    pub action: Action,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Restart the kernel with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    ExpandableSegments {
        env: String,
    },
    StopProcess {
        pid: u32,
    },
    EmptyCache {
        command: String,
    },
    ClearTraceback {
        command: String,
        bytes: u64,
    },
    UseBatch {
        batch: u64,
        accumulation_steps: u64,
    },
    GradientAccumulation {
        from: u64,
        batch: u64,
        steps: u64,
    },
    RunMaxbatch {
        command: String,
    },
    MixedPrecision {
        code: String,
    },
}

const EXPANDABLE: &str = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True";
/// What a failed cell's traceback holds before it is worth a step of its own.
const WORTH_RELEASING: u64 = 64 << 20;

fn device_view(
    facts: &ProbeFacts,
    cuda_index: Option<u32>,
) -> (DeviceView, Option<&AllocatorFacts>) {
    let allocator = cuda_index.and_then(|i| facts.devices.iter().find(|d| d.index == i));
    let mut view = DeviceView {
        cuda_index,
        ..Default::default()
    };
    if let Some(a) = allocator {
        let reclaimable = a.reclaimable();
        view.allocated_bytes = Some(a.allocated);
        view.reserved_bytes = Some(a.reserved);
        view.reclaimable_bytes = Some(reclaimable);
        view.releasable_bytes = Some(a.releasable);
        view.largest_free_block_bytes = Some(a.largest_free_block);
        view.fragmentation = (reclaimable > 0)
            .then(|| 1.0 - a.largest_free_block.min(reclaimable) as f64 / reclaimable as f64);
        view.num_ooms = Some(a.num_ooms);
        view.cap_bytes = a.cap();
        let named = facts
            .named_bytes_by_device
            .get(&format!("cuda:{}", a.index))
            .copied()
            .unwrap_or(0);
        view.unnamed_bytes = Some(a.allocated.saturating_sub(named));
    }
    (view, allocator)
}

/// Builds the diagnosis.
pub fn diagnose(inputs: &Inputs) -> Diagnosis {
    let facts = inputs.facts;
    let exception = facts.exception.clone().unwrap_or_default();
    let message = exception.oom_message.clone().unwrap_or(exception.message);
    let at_oom = parse_message(&message);
    let cuda_index = at_oom.device.or(facts.current_device);
    let (mut device, allocator) = device_view(facts, cuda_index);
    let allocator_confirms = facts.cuda_initialized.then(|| {
        allocator
            .is_some_and(|a| a.num_ooms > inputs.previous_ooms.get(&a.index).copied().unwrap_or(0))
    });

    let mut processes = Vec::new();
    let mut nvml_error = None;
    match &inputs.snapshot {
        Ok(snapshot) => {
            let gpu = failed_gpu(snapshot, allocator, cuda_index, inputs.cuda_visible_devices);
            if let Some(gpu) = gpu {
                device.nvml_index = Some(gpu.index);
                device.name = Some(gpu.name.clone());
                device.total_bytes = Some(gpu.memory_total);
                device.nvml_free_bytes = Some(gpu.memory_free);
                processes = classify(&gpu.processes, inputs.kernel_pid);
            }
        }
        Err(e) => nvml_error = Some(e.to_string()),
    }

    let batch = batch_view(facts);
    let maxbatch = facts.model_name.as_ref().and_then(|m| {
        inputs
            .maxbatch
            .iter()
            .rev()
            .find(|n| &n.model == m)
            .cloned()
    });

    let mut diagnosis = Diagnosis {
        exception_type: exception.type_name,
        message,
        allocator_confirms,
        requested_bytes: at_oom.requested,
        at_oom,
        device,
        processes,
        tensors: facts.tensors.clone(),
        tensor_bytes_total: facts.tensor_bytes_total,
        traceback_bytes: facts.traceback_bytes,
        traceback_tensors: facts.traceback_tensors,
        has_traceback: facts.has_traceback,
        model: facts.model_name.clone(),
        batch,
        maxbatch,
        alloc_conf: facts.alloc_conf.clone(),
        suggestions: Vec::new(),
        nvml_error,
    };
    diagnosis.suggestions = suggest(&diagnosis);
    diagnosis
}

/// The GPU the OOM happened on, in NVML's list: by the allocator's UUID, else by the CUDA
/// ordinal through CUDA_VISIBLE_DEVICES.
fn failed_gpu<'a>(
    snapshot: &'a GpuSnapshot,
    allocator: Option<&AllocatorFacts>,
    cuda_index: Option<u32>,
    cuda_visible_devices: Option<&str>,
) -> Option<&'a GpuInfo> {
    allocator
        .and_then(|a| a.uuid.as_deref())
        .and_then(|u| visible::by_uuid(&snapshot.gpus, u))
        .or_else(|| {
            let ordinals = visible::cuda_ordinals(cuda_visible_devices, &snapshot.gpus);
            let index = cuda_index.unwrap_or(0) as usize;
            ordinals
                .iter()
                .position(|o| *o == Some(index))
                .and_then(|p| snapshot.gpus.get(p))
        })
}

/// The batch size of the failed step: the model's input's first dimension, else the
/// notebook's batch variable.
fn batch_view(facts: &ProbeFacts) -> Option<BatchView> {
    facts
        .input_batch
        .map(|size| BatchView {
            size,
            source: match &facts.model_name {
                Some(m) => format!("the first dimension of {m}'s input"),
                None => "the first dimension of the model's input".into(),
            },
        })
        .or_else(|| {
            facts.batch_value.map(|size| BatchView {
                size,
                source: format!(
                    "the notebook's variable {}",
                    facts.batch_variable.as_deref().unwrap_or("batch_size")
                ),
            })
        })
}

/// The next steps, best first. The model behind the order:
/// - the request failed although PyTorch had already returned its unused cache to the driver
///   and retried, so what this kernel caches is not what was missing; what was missing is
///   `shortfall` = request - (free + reserved-but-unallocated) at the moment of the OOM;
/// - fragmentation: the allocator held enough free memory, in pieces too small;
/// - memory other processes hold (a stale kernel, gpukernel's own libtorch cache) is memory
///   this kernel can get;
/// - otherwise the step itself needs less memory: a smaller batch (with accumulation to keep
///   the effective batch), a measured one from %maxbatch, mixed precision.
pub fn suggest(d: &Diagnosis) -> Vec<Suggestion> {
    let memory = Shortfall::of(d);
    let mut out = Vec::new();
    let release = release_traceback(d);
    let release_first = release.is_some();
    out.extend(release);
    out.extend(fragmentation(d, &memory));
    out.extend(stop_processes(d, &memory));
    out.extend(empty_cache(d, &memory, release_first));
    out.extend(smaller_batch(d));
    out.extend(run_maxbatch(d));
    out.push(mixed_precision());
    out
}

/// What the failed request met: how much it asked for, what the device (or the
/// per-process cap) had free, what the cache held free in pieces, and what was missing.
struct Shortfall {
    request: u64,
    free: u64,
    cached_free_at_oom: u64,
    missing: u64,
}

impl Shortfall {
    fn of(d: &Diagnosis) -> Self {
        let request = d.requested_bytes.unwrap_or(0);
        let mut free = d
            .at_oom
            .free_at_oom
            .or(d.device.nvml_free_bytes)
            .unwrap_or(0);
        // Under set_per_process_memory_fraction, what the cap leaves is what counts.
        if let Some(allowed) = d.at_oom.allowed_at_oom.or(d.device.cap_bytes) {
            let used = match (
                d.at_oom.allocated_at_oom,
                d.at_oom.reserved_unallocated_at_oom,
            ) {
                (Some(a), Some(r)) => a + r,
                _ => d.device.reserved_bytes.unwrap_or(0),
            };
            free = free.min(allowed.saturating_sub(used));
        }
        let cached_free_at_oom = d.at_oom.reserved_unallocated_at_oom.unwrap_or(0);
        Shortfall {
            request,
            free,
            cached_free_at_oom,
            missing: request.saturating_sub(free + cached_free_at_oom),
        }
    }

    /// Whether `bytes` more would have made up what was missing (or nothing was).
    fn covered_by(&self, bytes: u64) -> bool {
        self.missing == 0 || bytes >= self.missing
    }
}

/// IPython keeps the failed cell's traceback, and every frame's tensors with it: running
/// the cell again with them alive needs that much more.
fn release_traceback(d: &Diagnosis) -> Option<Suggestion> {
    let held = d.traceback_bytes.max(d.device.unnamed_bytes.unwrap_or(0));
    (d.has_traceback && held >= WORTH_RELEASING).then(|| Suggestion {
        action: Action::ClearTraceback {
            command: "%oom --release".into(),
            bytes: held,
        },
        text: format!(
            "First, `%oom --release`: IPython keeps the failed cell's traceback, and with it \
             about {} of GPU memory no variable of yours reaches (the step's partial \
             activations and their autograd graph); run again as is, the cell starts with \
             that much less. It returns the cache too.",
            human_bytes(held)
        ),
    })
}

/// At the OOM the allocator had already returned its wholly free segments and retried, so
/// what it still held free then (the message's figure) is memory in pieces: fragmentation
/// when it would have covered the request. After the cell the failed step's memory is back
/// in the cache, so today's figures decide only when the message has none.
fn fragmentation(d: &Diagnosis, memory: &Shortfall) -> Option<Suggestion> {
    let request = memory.request;
    let expandable_on = d
        .alloc_conf
        .as_deref()
        .is_some_and(|c| c.replace(' ', "").contains("expandable_segments:True"));
    let fragmented_at_oom = request > 0 && memory.cached_free_at_oom >= request;
    let fragmented_now = matches!(
        (d.device.reclaimable_bytes, d.device.largest_free_block_bytes),
        (Some(reclaimable), Some(largest)) if request > 0 && reclaimable >= request && largest < request
    );
    let fragmented = if d.at_oom.reserved_unallocated_at_oom.is_some() {
        fragmented_at_oom
    } else {
        fragmented_now
    };
    if !fragmented || expandable_on {
        return None;
    }
    let held = if fragmented_at_oom {
        memory.cached_free_at_oom
    } else {
        d.device.reclaimable_bytes.unwrap_or(0)
    };
    Some(Suggestion {
        action: Action::ExpandableSegments {
            env: EXPANDABLE.into(),
        },
        text: format!(
            "Fragmentation: PyTorch held {} free in its cache but no block of {}. Restart the \
             kernel with {EXPANDABLE} set (in the kernel's environment, or \
             `os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"] = \"expandable_segments:True\"` before \
             torch first uses CUDA) so freed pieces can be joined.",
            human_bytes(held),
            human_bytes(request)
        ),
    })
}

/// The user's other processes on this GPU, stale ones first, when stopping them would make
/// up what was missing.
fn stop_processes(d: &Diagnosis, memory: &Shortfall) -> Vec<Suggestion> {
    let mut others: Vec<&ProcessView> = d
        .processes
        .iter()
        .filter(|p| matches!(p.role, Role::YourKernel | Role::YourProcess))
        .filter(|p| p.used_memory.unwrap_or(0) > 0)
        .collect();
    others.sort_by_key(|p| (p.stale.is_none(), std::cmp::Reverse(p.used_memory)));
    let others_total: u64 = others.iter().filter_map(|p| p.used_memory).sum();
    if others.is_empty() || !memory.covered_by(others_total) {
        return Vec::new();
    }
    others
        .into_iter()
        .map(|p| {
            let why = match &p.stale {
                Some(reason) => format!("stale ({reason})"),
                None => "another of your processes".into(),
            };
            Suggestion {
                action: Action::StopProcess { pid: p.pid },
                text: format!(
                    "Stop pid {} ({why}, {}): it holds {} of this GPU. `kill {}` (or shut its \
                     notebook down from Jupyter).",
                    p.pid,
                    p.command.as_deref().map(short).unwrap_or("?"),
                    human_bytes(p.used_memory.unwrap_or(0)),
                    p.pid
                ),
            }
        })
        .collect()
}

/// %emptycache, when gpukernel's own libtorch holds enough, or when the cache's empty blocks
/// with what is free cover the request (and the traceback's release, which returns the cache
/// too, is not already the first step).
fn empty_cache(d: &Diagnosis, memory: &Shortfall, release_first: bool) -> Option<Suggestion> {
    let own = d
        .processes
        .iter()
        .find(|p| p.role == Role::ThisGpukernel)
        .and_then(|p| p.used_memory)
        .unwrap_or(0);
    let action = Action::EmptyCache {
        command: "%emptycache".into(),
    };
    if own > 0 && memory.covered_by(own) {
        return Some(Suggestion {
            action,
            text: format!(
                "Run %emptycache: gpukernel's own libtorch (from %maxbatch) holds {} of this \
                 GPU, and %emptycache returns its cache with the Python kernel's.",
                human_bytes(own)
            ),
        });
    }
    let releasable = d.device.releasable_bytes.unwrap_or(0);
    let covers =
        releasable + memory.free >= memory.request && memory.request > 0 && memory.missing == 0;
    (covers && !release_first).then(|| Suggestion {
        action,
        text: format!(
            "Run %emptycache: {} of cached blocks with nothing in them would go back to the \
             driver, which with {} free covers the {} asked for.",
            human_bytes(releasable),
            human_bytes(memory.free),
            human_bytes(memory.request)
        ),
    })
}

/// A batch that fits: %maxbatch's recommendation from this session when there is one (with
/// the accumulation that keeps the effective batch), else half the batch, accumulated twice.
fn smaller_batch(d: &Diagnosis) -> Option<Suggestion> {
    let batch = d.batch.as_ref().map(|b| b.size);
    match (&d.maxbatch, batch) {
        (Some(note), _) if note.recommended.is_some() => {
            let rec = note.recommended.unwrap_or(1).max(1);
            let steps = batch.map(|b| b.div_ceil(rec)).unwrap_or(1).max(1);
            let keep = match batch {
                Some(b) if steps > 1 => format!(
                    " To keep the effective batch of {b}, accumulate gradients over {steps} steps \
                     of {} ({} x {steps}).",
                    b.div_ceil(steps),
                    b.div_ceil(steps)
                ),
                _ => String::new(),
            };
            Some(Suggestion {
                action: Action::UseBatch {
                    batch: batch.map(|b| b.div_ceil(steps)).unwrap_or(rec).min(rec),
                    accumulation_steps: steps,
                },
                text: format!(
                    "%maxbatch found in this session that {} trains at batch {} at most; use \
                     batch {rec} or less.{keep}",
                    note.model,
                    note.max_batch
                        .map(|m| m.to_string())
                        .unwrap_or_else(|| "?".into())
                ),
            })
        }
        (_, Some(b)) if b >= 2 => {
            let half = b.div_ceil(2);
            Some(Suggestion {
                action: Action::GradientAccumulation {
                    from: b,
                    batch: half,
                    steps: 2,
                },
                text: format!(
                    "Halve the batch and accumulate: batch {b} -> {half} x 2 steps (call \
                     backward on each half, step the optimizer every 2) keeps the effective \
                     batch of {b} with about half the activation memory. {}",
                    match &d.model {
                        Some(m) => format!("`%maxbatch {m}` measures the largest that fits."),
                        None => String::new(),
                    }
                ),
            })
        }
        _ => None,
    }
}

/// `%maxbatch MODEL` when the model is known and this session has not sized it yet.
fn run_maxbatch(d: &Diagnosis) -> Option<Suggestion> {
    let model = d.model.as_ref().filter(|_| d.maxbatch.is_none())?;
    Some(Suggestion {
        action: Action::RunMaxbatch {
            command: format!("%maxbatch {model}"),
        },
        text: format!(
            "Run `%maxbatch {model}` for the largest batch whose full training step fits (a \
             few real steps, your state kept)."
        ),
    })
}

fn mixed_precision() -> Suggestion {
    Suggestion {
        action: Action::MixedPrecision {
            code: "with torch.autocast('cuda', dtype=torch.bfloat16): loss = ...".into(),
        },
        text: "If the step runs in fp32: mixed precision (`torch.autocast(\"cuda\", \
               dtype=torch.bfloat16)` around forward and loss) roughly halves activation memory."
            .into(),
    }
}

fn short(command: &str) -> &str {
    match command.char_indices().nth(60) {
        Some((i, _)) => &command[..i],
        None => command,
    }
}

#[cfg(test)]
mod tests {
    use super::super::facts::ExceptionFacts;
    use super::*;

    const GIB: u64 = 1 << 30;

    fn facts(message: &str) -> ProbeFacts {
        ProbeFacts {
            torch_imported: true,
            is_oom: true,
            exception: Some(ExceptionFacts {
                type_name: "torch.OutOfMemoryError".into(),
                name: "OutOfMemoryError".into(),
                message: message.into(),
                matches_reply: true,
                oom_message: None,
            }),
            ..Default::default()
        }
    }

    fn run(f: &ProbeFacts, notes: &[MaxBatchNote]) -> Diagnosis {
        diagnose(&Inputs {
            facts: f,
            snapshot: Err(&ProbeError::NoDriver("no libnvidia-ml".into())),
            kernel_pid: None,
            maxbatch: notes,
            previous_ooms: &BTreeMap::new(),
            cuda_visible_devices: None,
        })
    }

    fn kinds(d: &Diagnosis) -> Vec<String> {
        d.suggestions
            .iter()
            .map(|s| {
                serde_json::to_value(s).unwrap()["kind"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn a_cpu_raised_oom_gets_its_request_and_batch_advice() {
        let mut f = facts("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...");
        f.batch_value = Some(64);
        f.batch_variable = Some("batch_size".into());
        f.model_name = Some("model".into());
        let d = run(&f, &[]);
        assert_eq!(d.requested_bytes, Some(2 * GIB));
        assert_eq!(d.allocator_confirms, None);
        assert_eq!(d.device.cuda_index, Some(0));
        assert_eq!(
            kinds(&d),
            ["gradient_accumulation", "run_maxbatch", "mixed_precision"]
        );
        assert!(d.suggestions[0].text.contains("64 -> 32 x 2"));
    }

    #[test]
    fn fragmentation_comes_first() {
        let f = facts(
            "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 10.00 \
             GiB of which 200.00 MiB is free. ... and 3.00 GiB is reserved by PyTorch but \
             unallocated.",
        );
        let d = run(&f, &[]);
        assert_eq!(kinds(&d)[0], "expandable_segments");
        let mut f2 = f.clone();
        f2.alloc_conf = Some("expandable_segments:True".into());
        assert_ne!(kinds(&run(&f2, &[]))[0], "expandable_segments");
        // Little free in pieces at the OOM: the cache refilled afterwards (the failed step's
        // memory) is no sign of fragmentation.
        let mut f3 = facts(
            "Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 10.00 GiB of which \
             200.00 MiB is free. ... and 20.00 MiB is reserved by PyTorch but unallocated.",
        );
        f3.cuda_initialized = true;
        f3.devices = vec![AllocatorFacts {
            index: 0,
            allocated: GIB,
            reserved: 8 * GIB,
            largest_free_block: 512 << 20,
            ..Default::default()
        }];
        assert!(!kinds(&run(&f3, &[])).contains(&"expandable_segments".to_string()));
        f3.exception.as_mut().unwrap().message = "Tried to allocate 1.00 GiB".into();
        f3.current_device = Some(0);
        assert_eq!(kinds(&run(&f3, &[]))[0], "expandable_segments");
    }

    #[test]
    fn a_held_traceback_is_released_first_and_a_cap_counts() {
        let mut f = facts(
            "Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which \
             100.00 GiB is free. 24.00 GiB allowed; Of the allocated memory 21.00 GiB is \
             allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.",
        );
        f.cuda_initialized = true;
        f.has_traceback = true;
        f.input_batch = Some(512);
        f.devices = vec![AllocatorFacts {
            index: 0,
            allocated: 18 * GIB,
            reserved: 23 * GIB,
            largest_free_block: 5 * GIB,
            releasable: 4 * GIB,
            ..Default::default()
        }];
        f.named_bytes_by_device.insert("cuda:0".into(), 2 * GIB);
        let d = run(&f, &[]);
        assert_eq!(d.device.unnamed_bytes, Some(16 * GIB));
        assert_eq!(
            d.suggestions[0].action,
            Action::ClearTraceback {
                command: "%oom --release".into(),
                bytes: 16 * GIB
            }
        );
        // The cap leaves 2 GiB of the 100 free: no %emptycache, no fragmentation advice.
        assert_eq!(kinds(&d)[1], "gradient_accumulation");
        assert!(!kinds(&d).contains(&"empty_cache".to_string()));
    }

    #[test]
    fn a_maxbatch_result_for_the_model_gives_the_numbers() {
        let mut f = facts("Tried to allocate 512.00 MiB. GPU 1 has");
        f.model_name = Some("net".into());
        f.input_batch = Some(256);
        f.cuda_initialized = true;
        f.devices = vec![AllocatorFacts {
            index: 1,
            num_ooms: 1,
            allocated: 4 * GIB,
            reserved: 6 * GIB,
            largest_free_block: GIB,
            ..Default::default()
        }];
        let notes = [MaxBatchNote {
            model: "net".into(),
            max_batch: Some(100),
            recommended: Some(96),
        }];
        let d = run(&f, &notes);
        assert_eq!(d.allocator_confirms, Some(true));
        assert_eq!(d.device.reclaimable_bytes, Some(2 * GIB));
        assert_eq!(d.device.fragmentation, Some(0.5));
        assert_eq!(
            d.suggestions[0].action,
            Action::UseBatch {
                batch: 86,
                accumulation_steps: 3
            }
        );
        assert!(!kinds(&d).contains(&"run_maxbatch".to_string()));
    }
}
