//! Memory in use on the Python kernel's GPU outside its own allocator, for the report.
//!
//! The python engine's limit is what the GPU has free plus what the kernel's allocator holds
//! (within its memory fraction). On a shared server another user's training can hold most of
//! the card: the search then sizes against what it leaves, correctly for that moment, and the
//! answer changes when that process ends or grows. The report says so and names who holds it
//! (NVML's processes, as `%gpumem` lists them), so that a small limit is not taken for the
//! card's.

use gpuprobe::units::human_bytes;
use gpuprobe::GpuSnapshot;

/// Memory outside the kernel's allocator below which nothing is said: the kernel's own CUDA
/// context and the driver's share (about 0.5 to 1 GiB on an H100) are always there.
const WORTH_A_NOTE: u64 = 2 << 30;

/// Processes named at most, largest first.
const NAMED: usize = 3;

/// A process other than the Python kernel holding memory on its GPU. Its command line is left
/// out: the report is saved with the notebook, and another user's command can hold paths or
/// tokens (`%gpumem` shows it to whoever asks there).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Holder {
    pub(super) pid: u32,
    pub(super) bytes: u64,
    pub(super) user: Option<String>,
}

/// The GPU's memory as the Python kernel read it when the search began.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Budget {
    pub(super) total: u64,
    pub(super) free: u64,
    /// What the kernel's allocator reserved.
    pub(super) reserved: u64,
    /// `torch.cuda.get_per_process_memory_fraction`.
    pub(super) fraction: f64,
}

impl Budget {
    /// In use outside the kernel's allocator: other processes, and every CUDA context.
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

/// The processes other than `own_pid` that NVML shows on the GPU with `uuid` (torch gives it
/// without NVML's `GPU-` prefix), largest first. Empty where NVML does not list the kernel
/// itself there: in a container NVML gives the host's pids, which name other processes (or
/// none) in this one's `/proc`, and the kernel, holding a CUDA context, would be listed as
/// another.
pub(super) fn holders(snapshot: &GpuSnapshot, uuid: &str, own_pid: u32) -> Vec<Holder> {
    let uuid = uuid.trim_start_matches("GPU-");
    let processes: Vec<_> = snapshot
        .gpus
        .iter()
        .filter(|g| g.uuid.trim_start_matches("GPU-") == uuid)
        .flat_map(|g| g.processes.iter())
        .collect();
    if !processes.iter().any(|p| p.pid == own_pid) {
        return Vec::new();
    }
    let mut found: Vec<Holder> = processes
        .into_iter()
        .filter(|p| p.pid != own_pid)
        .filter_map(|p| {
            Some(Holder {
                pid: p.pid,
                bytes: p.used_memory.filter(|&b| b > 0)?,
                user: p.details.user.clone(),
            })
        })
        .collect();
    found.sort_by_key(|h| std::cmp::Reverse(h.bytes));
    found
}

/// The report's note, where memory outside the kernel's allocator set a limit well below
/// the card's (or its memory fraction's); none otherwise.
pub(super) fn note(budget: &Budget, limit: u64, holders: &[Holder]) -> Option<String> {
    if !budget.worth_a_note() {
        return None;
    }
    let outside = budget.outside();
    let named: Vec<String> = holders.iter().take(NAMED).map(holder_text).collect();
    let who = if named.is_empty() {
        String::new()
    } else {
        let more = holders.len().saturating_sub(NAMED);
        format!(
            " (other processes: {}{})",
            named.join("; "),
            if more > 0 {
                format!("; {more} more")
            } else {
                String::new()
            }
        )
    };
    Some(format!(
        "{} of this GPU's {} was in use outside your Python kernel's allocator when the search \
         began{who}: the limit ({}) is what that left, so these batch sizes hold while it \
         stays so; run %maxbatch again when it changes (%gpumem shows who holds what)",
        human_bytes(outside),
        human_bytes(budget.total),
        human_bytes(limit),
    ))
}

fn holder_text(h: &Holder) -> String {
    match &h.user {
        Some(user) => format!("pid {} ({user}) {}", h.pid, human_bytes(h.bytes)),
        None => format!("pid {} {}", h.pid, human_bytes(h.bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuprobe::process::ProcessDetails;
    use gpuprobe::{GpuInfo, GpuProcess};

    const GIB: u64 = 1 << 30;

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
        }
    }

    #[test]
    fn memory_another_process_holds_is_named_where_it_set_the_limit() {
        // Another user's training holds 70 GiB: the kernel had 6 GiB free beside its 0.2.
        let b = budget(6 * GIB, GIB / 5, 1.0);
        let text = note(&b, 6 * GIB + GIB / 5, &[holder(4242, 70), holder(77, 3)]).unwrap();
        assert!(
            text.starts_with("73.8 GiB of this GPU's 80.0 GiB was in use outside"),
            "{text}"
        );
        assert!(
            text.contains("(other processes: pid 4242 (bob) 70.0 GiB; pid 77 (bob) 3.00 GiB):"),
            "{text}"
        );
        assert!(
            text.contains("the limit (6.20 GiB) is what that left"),
            "{text}"
        );
        // Without NVML's processes the bytes are still said.
        let text = note(&b, 6 * GIB, &[]).unwrap();
        assert!(
            text.contains("allocator when the search began: the limit"),
            "{text}"
        );
        // Five processes: three named, the rest counted.
        let many: Vec<Holder> = (1..=5).map(|p| holder(p, 10)).collect();
        assert!(note(&b, 6 * GIB, &many).unwrap().contains("; 2 more)"));
    }

    #[test]
    fn nothing_is_said_for_a_context_or_where_the_fraction_set_the_limit() {
        // A card to itself: the kernel's context and the driver's share only.
        assert_eq!(note(&budget(79 * GIB, GIB / 4, 1.0), 79 * GIB, &[]), None);
        // A memory fraction of 0.3 (24 GiB) below what others left (40 GiB free): the
        // fraction set the limit, not them.
        let b = budget(40 * GIB, GIB, 0.3);
        assert_eq!(note(&b, 24 * GIB, &[holder(9, 39)]), None);
        // The same fraction with 6 GiB free: they set it.
        let b = budget(6 * GIB, GIB, 0.3);
        assert!(note(&b, 7 * GIB, &[holder(9, 72)]).is_some());
    }

    #[test]
    fn holders_are_the_other_processes_on_the_kernels_gpu_largest_first() {
        let process = |pid, bytes| GpuProcess {
            pid,
            used_memory: bytes,
            details: ProcessDetails {
                user: None,
                command: None,
            },
        };
        let gpu = |uuid: &str, processes| GpuInfo {
            index: 0,
            name: "H100".into(),
            uuid: uuid.into(),
            pci_bus_id: String::new(),
            memory_used: 0,
            memory_free: 0,
            memory_total: 0,
            utilization_gpu: None,
            processes,
        };
        let snapshot = GpuSnapshot {
            driver_version: "580".into(),
            cuda_driver_version: None,
            gpus: vec![
                gpu(
                    "GPU-aaaa",
                    vec![
                        process(10, Some(GIB)),
                        process(7, Some(5 * GIB)),
                        process(11, Some(9 * GIB)),
                        process(12, None),
                    ],
                ),
                gpu("GPU-bbbb", vec![process(13, Some(50 * GIB))]),
            ],
        };
        let pids: Vec<(u32, u64)> = holders(&snapshot, "aaaa", 7)
            .iter()
            .map(|h| (h.pid, h.bytes / GIB))
            .collect();
        assert_eq!(pids, vec![(11, 9), (10, 1)]);
        // A kernel NVML does not list by its pid (a container: the host's pids) names none.
        assert_eq!(holders(&snapshot, "aaaa", 99), vec![]);
    }
}
