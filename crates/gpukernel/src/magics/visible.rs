//! Which NVML GPU each CUDA ordinal is, as processes started here see them
//! (`CUDA_VISIBLE_DEVICES`: indices or UUID prefixes; unset means all, in order).
//!
//! NVML numbers GPUs by PCI bus id; CUDA does too when `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and on
//! the usual server of identical GPUs either way. When torch in the Python kernel reports device
//! UUIDs, those win (see `gpumem`).

use gpuprobe::GpuInfo;

/// For each NVML GPU (by position in `gpus`), its CUDA ordinal, or `None` if hidden.
pub fn cuda_ordinals(visible: Option<&str>, gpus: &[GpuInfo]) -> Vec<Option<usize>> {
    let mut ordinals = vec![None; gpus.len()];
    let Some(visible) = visible.map(str::trim) else {
        return (0..gpus.len()).map(Some).collect();
    };
    for (ordinal, entry) in visible.split(',').map(str::trim).enumerate() {
        if entry.is_empty() {
            break;
        }
        let found = match entry.parse::<u32>() {
            Ok(index) => gpus.iter().position(|g| g.index == index),
            // CUDA takes any unique prefix of the UUID, with or without "GPU-".
            Err(_) if entry.starts_with("GPU-") => {
                gpus.iter().position(|g| g.uuid.starts_with(entry))
            }
            Err(_) => gpus
                .iter()
                .position(|g| g.uuid.trim_start_matches("GPU-").starts_with(entry)),
        };
        // CUDA stops at the first invalid entry; so do we.
        let Some(position) = found else { break };
        if ordinals[position].is_some() {
            break;
        }
        ordinals[position] = Some(ordinal);
    }
    ordinals
}

/// The NVML GPU whose UUID torch reported (torch prints it without the "GPU-" prefix).
pub fn by_uuid<'a>(gpus: &'a [GpuInfo], uuid: &str) -> Option<&'a GpuInfo> {
    let uuid = uuid.trim_start_matches("GPU-");
    gpus.iter()
        .find(|g| !uuid.is_empty() && g.uuid.trim_start_matches("GPU-") == uuid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus() -> Vec<GpuInfo> {
        (0..4)
            .map(|i| GpuInfo {
                index: i,
                name: "H200".into(),
                uuid: format!("GPU-{i}{i}aa-bb"),
                pci_bus_id: format!("0000:0{i}:00.0"),
                memory_used: 0,
                memory_free: 0,
                memory_total: 0,
                utilization_gpu: None,
                processes: vec![],
            })
            .collect()
    }

    #[test]
    fn unset_means_all_in_order() {
        assert_eq!(
            cuda_ordinals(None, &gpus()),
            vec![Some(0), Some(1), Some(2), Some(3)]
        );
    }

    #[test]
    fn indices_reorder_and_hide() {
        assert_eq!(
            cuda_ordinals(Some("2,0"), &gpus()),
            vec![Some(1), None, Some(0), None]
        );
        assert_eq!(cuda_ordinals(Some(""), &gpus()), vec![None; 4]);
    }

    #[test]
    fn uuid_prefixes_and_invalid_entries() {
        assert_eq!(
            cuda_ordinals(Some("GPU-33,11aa"), &gpus()),
            vec![None, Some(1), None, Some(0)]
        );
        // Everything after an invalid entry is ignored, as CUDA does.
        assert_eq!(
            cuda_ordinals(Some("1,7,2"), &gpus()),
            vec![None, Some(0), None, None]
        );
        assert_eq!(by_uuid(&gpus(), "22aa-bb").map(|g| g.index), Some(2));
        assert!(by_uuid(&gpus(), "").is_none());
    }
}
