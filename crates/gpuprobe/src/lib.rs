//! GPU facts for gpukernel, with no knowledge of Jupyter.
//!
//! - [`nvml`]: per-GPU and per-process memory through NVML, loaded at run time, so a binary
//!   built here runs (and explains itself) on machines with no NVIDIA driver.
//! - [`process`]: who a pid belongs to and what it runs, read from `/proc`.
//! - `torch` (cargo feature `torch`): libtorch through tch; the allocator shim lives here.
//!
//! Everything returns plain data; rendering is the caller's business.

pub mod error;
pub mod nvml;
pub mod plugin_api;
pub mod process;
#[cfg(feature = "torch")]
pub mod torch;
pub mod units;

pub use error::ProbeError;
pub use nvml::{GpuInfo, GpuProcess, GpuSnapshot, Nvml};
