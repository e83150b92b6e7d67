//! GPU facts for gpukernel, with no knowledge of Jupyter.
//!
//! - [`nvml`]: per-GPU and per-process memory through NVML, loaded at run time, so a binary
//!   built here runs (and explains itself) on machines with no NVIDIA driver.
//! - [`process`]: who a pid belongs to and what it runs, read from `/proc`.
//! - `torch` (cargo feature `torch`): libtorch through tch; serves the plugin's requests.
//! - [`search`] and [`loss`]: the batch-size search and the loss a trial step computes, pure
//!   and shared by both `%maxbatch` engines; `output` (feature `torch`): which of a
//!   TorchScript model's outputs that loss is computed on.
//! - [`stranded`]: the room a recommendation leaves for a block the CUDA cache strands as it
//!   fragments, pure like the search.
//! - `allocator` (cargo feature `torch`): libtorch's CUDA caching allocator through a small C++
//!   shim (`shim/`), since tch has no allocator API.
//!
//! Everything returns plain data; rendering is the caller's business.

#[cfg(feature = "torch")]
pub mod allocator;
pub mod error;
pub mod loss;
#[cfg(feature = "torch")]
pub mod maxbatch;
pub mod nvml;
#[cfg(feature = "torch")]
pub mod output;
pub mod plugin_api;
pub mod process;
pub mod search;
pub mod stranded;
#[cfg(feature = "torch")]
pub mod torch;
pub mod units;

pub use error::ProbeError;
pub use nvml::{GpuInfo, GpuProcess, GpuSnapshot, Nvml};
