//! GPU and per-process memory through NVML.
//!
//! NVML is loaded with `dlopen` when [`Nvml::open`] runs, so nothing links against the driver
//! and no CUDA context is created: reading memory this way costs the GPU nothing.

use crate::process::{self, ProcessDetails};
use crate::ProbeError;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use serde::Serialize;

/// An initialised NVML library. Opening it takes tens of milliseconds, so keep one around.
pub struct Nvml {
    inner: nvml_wrapper::Nvml,
}

/// Everything `%gpumem` shows, read at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct GpuSnapshot {
    pub driver_version: String,
    pub cuda_driver_version: Option<String>,
    pub gpus: Vec<GpuInfo>,
}

/// One GPU as NVML numbers it (NVML index, not the CUDA ordinal).
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub pci_bus_id: String,
    pub memory_used: u64,
    pub memory_free: u64,
    pub memory_total: u64,
    /// Percent of time a kernel ran over the last sample period; `None` where unsupported (MIG).
    pub utilization_gpu: Option<u32>,
    pub processes: Vec<GpuProcess>,
}

/// A process holding memory on a GPU.
#[derive(Debug, Clone, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    /// Bytes of GPU memory; `None` where the driver does not say (some containers, WDDM).
    pub used_memory: Option<u64>,
    #[serde(flatten)]
    pub details: ProcessDetails,
}

fn nvml_error(err: NvmlError) -> ProbeError {
    match err {
        NvmlError::LibloadingError(e) => ProbeError::NoDriver(format!("libnvidia-ml: {e}")),
        NvmlError::DriverNotLoaded => {
            ProbeError::NoDriver("the NVIDIA driver is not loaded".into())
        }
        NvmlError::NoPermission => ProbeError::Nvml("no permission to query NVML".into()),
        other => ProbeError::Nvml(other.to_string()),
    }
}

impl Nvml {
    /// Loads `libnvidia-ml.so.1` and initialises NVML.
    pub fn open() -> Result<Self, ProbeError> {
        let inner = nvml_wrapper::Nvml::init().map_err(nvml_error)?;
        Ok(Self { inner })
    }

    /// Reads memory, utilisation and processes of every GPU.
    pub fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let nvml = &self.inner;
        let count = nvml.device_count().map_err(nvml_error)?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            gpus.push(self.gpu(index)?);
        }
        let cuda_driver_version = nvml.sys_cuda_driver_version().ok().map(|v| {
            format!(
                "{}.{}",
                nvml_wrapper::cuda_driver_version_major(v),
                nvml_wrapper::cuda_driver_version_minor(v)
            )
        });
        Ok(GpuSnapshot {
            driver_version: nvml.sys_driver_version().map_err(nvml_error)?,
            cuda_driver_version,
            gpus,
        })
    }

    fn gpu(&self, index: u32) -> Result<GpuInfo, ProbeError> {
        let device = self.inner.device_by_index(index).map_err(nvml_error)?;
        let memory = device.memory_info().map_err(nvml_error)?;
        let mut processes: Vec<GpuProcess> = Vec::new();
        // A process can appear in both lists (compute and graphics); report it once.
        let compute = device.running_compute_processes().unwrap_or_default();
        let graphics = device.running_graphics_processes().unwrap_or_default();
        for p in compute.into_iter().chain(graphics) {
            if processes.iter().any(|seen| seen.pid == p.pid) {
                continue;
            }
            let used_memory = match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some(bytes),
                UsedGpuMemory::Unavailable => None,
            };
            processes.push(GpuProcess {
                pid: p.pid,
                used_memory,
                details: process::details(p.pid),
            });
        }
        processes.sort_by_key(|p| std::cmp::Reverse(p.used_memory.unwrap_or(0)));
        Ok(GpuInfo {
            index,
            name: device.name().map_err(nvml_error)?,
            uuid: device.uuid().map_err(nvml_error)?,
            pci_bus_id: device.pci_info().map(|p| p.bus_id).unwrap_or_default(),
            memory_used: memory.used,
            memory_free: memory.free,
            memory_total: memory.total,
            utilization_gpu: device.utilization_rates().ok().map(|u| u.gpu),
            processes,
        })
    }
}
