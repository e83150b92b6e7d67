//! Memory in use on the search's GPU outside the allocator it sizes, for the report.
//!
//! A limit is what the GPU has free plus what the sized allocator holds (the Python kernel's
//! for the python engine, gpukernel's own for the libtorch engine), within its memory
//! fraction. On a shared server another user's training can hold most of the card: the
//! search then sizes against what it leaves, correctly for that moment, and the answer changes
//! when that process ends or grows. The report says so and names who holds it (NVML's
//! processes, as `%gpumem` lists them), so that a small limit is not taken for the card's.

use crate::magics::visible;
use gpuprobe::units::human_bytes;
use gpuprobe::{GpuInfo, GpuSnapshot, Nvml};

/// Memory outside the allocator below which nothing is said: the process's own CUDA context
/// and the driver's share (about 0.5 to 1 GiB on an H100) are always there.
const WORTH_A_NOTE: u64 = 2 << 30;

/// Processes named at most, largest first.
const NAMED: usize = 3;

/// A process other than the one sized holding memory on its GPU. Its command line is left
/// out: the report is saved with the notebook, and another user's command can hold paths or
/// tokens (`%gpumem` shows it to whoever asks there).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Holder {
    pub(super) pid: u32,
    pub(super) bytes: u64,
    pub(super) user: Option<String>,
    /// The notebook's Python kernel (outside gpukernel's allocator, for the libtorch engine).
    pub(super) your_kernel: bool,
}

/// The GPU's memory as the sized process read it when the search began.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Budget {
    pub(super) total: u64,
    pub(super) free: u64,
    /// What the sized allocator reserved.
    pub(super) reserved: u64,
    /// `torch.cuda.get_per_process_memory_fraction`, or 1.0 where free memory set the limit.
    pub(super) fraction: f64,
}

impl Budget {
    /// In use outside the sized allocator: other processes, and every CUDA context.
    fn outside(&self) -> u64 {
        self.total
            .saturating_sub(self.free)
            .saturating_sub(self.reserved)
    }

    /// Whether free memory, not the memory fraction, set the limit.
    fn free_sets_the_limit(&self) -> bool {
        ((self.free + self.reserved) as f64) < self.total as f64 * self.fraction.min(1.0)
    }

    /// Whether memory outside the allocator set the limit, enough to say so (then it is
    /// worth asking NVML who holds it).
    pub(super) fn worth_a_note(&self) -> bool {
        self.outside() >= WORTH_A_NOTE && self.free_sets_the_limit()
    }
}

/// NVML's view of the GPUs now; `None` without a driver NVML can read (no process is named).
pub(super) fn snapshot() -> Option<GpuSnapshot> {
    Nvml::open().and_then(|nvml| nvml.snapshot()).ok()
}

/// The GPU torch reports by `uuid` (the python engine: the Python kernel's device).
pub(super) fn gpu_by_uuid<'a>(snapshot: &'a GpuSnapshot, uuid: &str) -> Option<&'a GpuInfo> {
    visible::by_uuid(&snapshot.gpus, uuid)
}

/// The GPU a process with `visible` as its `CUDA_VISIBLE_DEVICES` sees as CUDA `ordinal` (the
/// libtorch engine's device, in gpukernel).
#[cfg(feature = "torch")]
pub(super) fn gpu_by_ordinal<'a>(
    snapshot: &'a GpuSnapshot,
    ordinal: usize,
    visible: Option<&str>,
) -> Option<&'a GpuInfo> {
    let ordinals = visible::cuda_ordinals(visible, &snapshot.gpus);
    let position = ordinals.iter().position(|&o| o == Some(ordinal))?;
    snapshot.gpus.get(position)
}

/// The processes that held memory on the GPU as the search began (`at_start`) other than
/// `own_pid` (the process whose allocator was sized), largest first, `python_pid` marked as
/// the notebook's kernel. Empty where NVML does not list `own_pid` in the later reading
/// (`now`, when it holds a CUDA context): in a container NVML gives the host's pids, which
/// name other processes (or none) in this one's `/proc`, and the sized process would be
/// listed as another.
pub(super) fn holders(
    at_start: &GpuInfo,
    now: &GpuInfo,
    own_pid: u32,
    python_pid: Option<u32>,
) -> Vec<Holder> {
    if !now.processes.iter().any(|p| p.pid == own_pid) {
        return Vec::new();
    }
    let mut found: Vec<Holder> = at_start
        .processes
        .iter()
        .filter(|p| p.pid != own_pid)
        .filter_map(|p| {
            Some(Holder {
                pid: p.pid,
                bytes: p.used_memory.filter(|&b| b > 0)?,
                user: p.details.user.clone(),
                your_kernel: Some(p.pid) == python_pid,
            })
        })
        .collect();
    found.sort_by_key(|h| std::cmp::Reverse(h.bytes));
    found
}

/// The report's note, where memory outside `allocator` (whose: "your Python kernel's
/// allocator") set a limit well below the card's (or its memory fraction's); none otherwise.
pub(super) fn note(
    budget: &Budget,
    limit: u64,
    holders: &[Holder],
    allocator: &str,
) -> Option<String> {
    if !budget.worth_a_note() {
        return None;
    }
    let named: Vec<String> = holders.iter().take(NAMED).map(holder_text).collect();
    let who = if named.is_empty() {
        String::new()
    } else {
        let more = holders.len().saturating_sub(NAMED);
        format!(
            " (held by {}{})",
            named.join("; "),
            if more > 0 {
                format!("; {more} more processes")
            } else {
                String::new()
            }
        )
    };
    Some(format!(
        "{} of this GPU's {} was in use outside {allocator} when the search began{who}: the \
         limit ({}) is what that left, so these batch sizes hold while it stays so; run \
         %maxbatch again when it changes (%gpumem shows who holds what)",
        human_bytes(budget.outside()),
        human_bytes(budget.total),
        human_bytes(limit),
    ))
}

fn holder_text(h: &Holder) -> String {
    let who = match (&h.user, h.your_kernel) {
        (_, true) => " (your Python kernel)".to_string(),
        (Some(user), false) => format!(" ({user})"),
        (None, false) => String::new(),
    };
    format!("pid {}{who} {}", h.pid, human_bytes(h.bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuprobe::process::ProcessDetails;
    use gpuprobe::GpuProcess;

    const GIB: u64 = 1 << 30;
    const PYTHON: &str = "your Python kernel's allocator";

    fn budget(free: u64, reserved: u64, fraction: f64) -> Budget {
        Budget {
            total: 80 * GIB,
            free,
            reserved,
            fraction,
        }
    }

    fn holder(pid: u32, gib: u64) -> Holder {
        Holder {
            pid,
            bytes: gib * GIB,
            user: Some("bob".into()),
            your_kernel: false,
        }
    }

    #[test]
    fn memory_another_process_holds_is_named_where_it_set_the_limit() {
        // Another user's training holds 70 GiB: the kernel had 6 GiB free beside its 0.2.
        let b = budget(6 * GIB, GIB / 5, 1.0);
        let held = [holder(4242, 70), holder(77, 3)];
        let text = note(&b, 6 * GIB + GIB / 5, &held, PYTHON).unwrap();
        assert!(
            text.starts_with(
                "73.8 GiB of this GPU's 80.0 GiB was in use outside your Python kernel's \
                 allocator when the search began (held by pid 4242 (bob) 70.0 GiB; pid 77 \
                 (bob) 3.00 GiB): the limit (6.20 GiB) is what that left"
            ),
            "{text}"
        );
        // Without NVML's processes the bytes are still said.
        let text = note(&b, 6 * GIB, &[], PYTHON).unwrap();
        assert!(
            text.contains("allocator when the search began: the limit"),
            "{text}"
        );
        // Five processes: three named, the rest counted.
        let many: Vec<Holder> = (1..=5).map(|p| holder(p, 10)).collect();
        let text = note(&b, 6 * GIB, &many, PYTHON).unwrap();
        assert!(text.contains("; 2 more processes)"), "{text}");
        // For the libtorch engine the notebook's kernel is outside gpukernel's allocator.
        let kernel = Holder {
            your_kernel: true,
            ..holder(5, 4)
        };
        let text = note(&b, 6 * GIB, &[kernel], "gpukernel's allocator").unwrap();
        assert!(
            text.contains(
                "outside gpukernel's allocator when the search began (held by pid 5 \
                           (your Python kernel) 4.00 GiB)"
            ),
            "{text}"
        );
    }

    #[test]
    fn nothing_is_said_for_a_context_or_where_the_fraction_set_the_limit() {
        // A card to itself: the kernel's context and the driver's share only.
        let alone = budget(79 * GIB, GIB / 4, 1.0);
        assert_eq!(note(&alone, 79 * GIB, &[], PYTHON), None);
        // A memory fraction of 0.3 (24 GiB) below what others left (40 GiB free): the
        // fraction set the limit, not them.
        let b = budget(40 * GIB, GIB, 0.3);
        assert_eq!(note(&b, 24 * GIB, &[holder(9, 39)], PYTHON), None);
        // The same fraction with 6 GiB free: they set it.
        let b = budget(6 * GIB, GIB, 0.3);
        assert!(note(&b, 7 * GIB, &[holder(9, 72)], PYTHON).is_some());
    }

    fn gpu(index: u32, uuid: &str, processes: Vec<(u32, Option<u64>)>) -> GpuInfo {
        GpuInfo {
            index,
            name: "H100".into(),
            uuid: uuid.into(),
            pci_bus_id: String::new(),
            memory_used: 0,
            memory_free: 0,
            memory_total: 0,
            utilization_gpu: None,
            processes: processes
                .into_iter()
                .map(|(pid, used_memory)| GpuProcess {
                    pid,
                    used_memory,
                    details: ProcessDetails {
                        user: None,
                        command: None,
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn holders_are_the_other_processes_on_the_sized_gpu_largest_first() {
        let snapshot = GpuSnapshot {
            driver_version: "580".into(),
            cuda_driver_version: None,
            gpus: vec![
                gpu(
                    0,
                    "GPU-aaaa",
                    vec![
                        (10, Some(GIB)),
                        (7, Some(5 * GIB)),
                        (11, Some(9 * GIB)),
                        (12, None),
                    ],
                ),
                gpu(1, "GPU-bbbb", vec![(13, Some(50 * GIB)), (7, Some(GIB))]),
            ],
        };
        let on = |gpu: &GpuInfo, own, python| -> Vec<(u32, u64, bool)> {
            holders(gpu, gpu, own, python)
                .iter()
                .map(|h| (h.pid, h.bytes / GIB, h.your_kernel))
                .collect()
        };
        let first = gpu_by_uuid(&snapshot, "aaaa").expect("torch's uuid, without GPU-");
        assert_eq!(on(first, 7, None), vec![(11, 9, false), (10, 1, false)]);
        // gpukernel (7) sizing for a notebook whose kernel is 10.
        assert_eq!(on(first, 7, Some(10)), vec![(11, 9, false), (10, 1, true)]);
        // A process NVML does not list by its pid (a container: the host's pids) names none.
        assert_eq!(on(first, 99, None), vec![]);
        let second = gpu_by_uuid(&snapshot, "GPU-bbbb").expect("NVML's spelling too");
        assert_eq!(on(second, 7, None), vec![(13, 50, false)]);
        // gpukernel makes its CUDA context in the search: named from the reading before it,
        // once the reading after it lists gpukernel.
        let before = gpu(0, "GPU-aaaa", vec![(11, Some(9 * GIB))]);
        let after = gpu(0, "GPU-aaaa", vec![(11, Some(9 * GIB)), (7, Some(GIB))]);
        let named: Vec<u32> = holders(&before, &after, 7, None)
            .iter()
            .map(|h| h.pid)
            .collect();
        assert_eq!(named, vec![11]);
        assert_eq!(holders(&before, &before, 7, None), vec![]);
    }

    #[cfg(feature = "torch")]
    #[test]
    fn the_libtorch_engines_gpu_is_found_by_its_cuda_ordinal() {
        let snapshot = GpuSnapshot {
            driver_version: "580".into(),
            cuda_driver_version: None,
            gpus: (0..3)
                .map(|i| gpu(i, &format!("GPU-{i}{i}"), vec![]))
                .collect(),
        };
        let uuid = |visible, ordinal| {
            gpu_by_ordinal(&snapshot, ordinal, visible).map(|g: &GpuInfo| g.uuid.clone())
        };
        assert_eq!(uuid(None, 1).as_deref(), Some("GPU-11"));
        // CUDA_VISIBLE_DEVICES=2,0: CUDA's 0 is NVML's 2.
        assert_eq!(uuid(Some("2,0"), 0).as_deref(), Some("GPU-22"));
        assert_eq!(uuid(Some("2,0"), 1).as_deref(), Some("GPU-00"));
        assert_eq!(uuid(Some("2,0"), 2), None);
    }
}
