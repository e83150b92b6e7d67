use thiserror::Error;

/// Why a GPU fact could not be read.
#[derive(Debug, Error)]
pub enum ProbeError {
    /// No NVIDIA driver on this machine (libnvidia-ml cannot be loaded or the driver is not
    /// running). Not a bug: CPU-only machines land here.
    #[error("no NVIDIA driver found ({0})")]
    NoDriver(String),
    /// NVML loaded but a query failed.
    #[error("NVML query failed: {0}")]
    Nvml(String),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(String),
}
