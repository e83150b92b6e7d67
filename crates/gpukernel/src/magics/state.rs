//! GPU state kept across magics: the NVML handle (opened on first use) and the running gauge.

use super::{gauge, CancelToken, OutputSink};
use gpuprobe::{GpuSnapshot, Nvml, ProbeError};
use std::sync::{Arc, Mutex, PoisonError};

#[derive(Default)]
struct Inner {
    nvml: Mutex<Option<Nvml>>,
    watch: Mutex<Option<CancelToken>>,
}

/// Cheap to clone; clones share the NVML handle and the gauge.
#[derive(Clone, Default)]
pub struct GpuState {
    inner: Arc<Inner>,
}

impl GpuState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads all GPUs; opens NVML the first time (and retries while there is no driver).
    pub fn snapshot(&self) -> Result<GpuSnapshot, ProbeError> {
        let mut nvml = self
            .inner
            .nvml
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if nvml.is_none() {
            *nvml = Some(Nvml::open()?);
        }
        match nvml.as_ref() {
            Some(handle) => handle.snapshot(),
            None => Err(ProbeError::Nvml("NVML handle missing".into())),
        }
    }

    /// Starts a gauge on its own thread (replacing a running one); it updates `out`'s display
    /// until [`Self::stop_watch`], `count` updates, or the process ends.
    pub fn start_watch(&self, out: Arc<dyn OutputSink>, interval: f64, count: Option<u64>) {
        let token = CancelToken::new();
        if let Some(old) = self
            .inner
            .watch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(token.clone())
        {
            old.cancel();
        }
        let state = self.clone();
        std::thread::spawn(move || {
            gauge::run(&state, out.as_ref(), &token, interval, count);
        });
    }

    /// Stops the running gauge; false if there was none.
    pub fn stop_watch(&self) -> bool {
        match self
            .inner
            .watch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    /// gpukernel's own caching allocator, if libtorch is loaded (a libtorch magic ran): one
    /// line per device with its figures and the CUDA context's cost (NVML's figure for this
    /// process less what the allocator reserves). `None` when libtorch was never loaded.
    pub fn own_allocator(&self, snapshot: Option<&GpuSnapshot>) -> Option<String> {
        #[cfg(feature = "torch")]
        {
            use gpuprobe::plugin_api::{AllocatorStats, Request};
            use gpuprobe::units::human_bytes;
            let plugin = crate::torch_plugin::loaded()?;
            let stats = plugin
                .request(&Request::AllocatorStats)
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    serde_json::from_value::<AllocatorStats>(v).map_err(|e| e.to_string())
                });
            let stats = match stats {
                Ok(stats) => stats,
                Err(e) => {
                    return Some(format!(
                        "gpukernel: libtorch loaded; allocator unreadable: {e}\n"
                    ))
                }
            };
            if !stats.initialized {
                return Some(
                    "gpukernel: libtorch loaded, no CUDA context (holds no GPU memory).\n".into(),
                );
            }
            let me = std::process::id();
            let nvml_total: u64 = snapshot
                .map(|s| {
                    s.gpus
                        .iter()
                        .flat_map(|g| g.processes.iter())
                        .filter(|p| p.pid == me)
                        .filter_map(|p| p.used_memory)
                        .sum()
                })
                .unwrap_or(0);
            let mut text = String::from("gpukernel's own allocator (libtorch):\n");
            let mut reserved_total = 0u64;
            for d in &stats.devices {
                let reserved = d.reserved_bytes.current.max(0) as u64;
                reserved_total += reserved;
                text.push_str(&format!(
                    "  cuda:{} allocated {}, reserved {}, peak {}\n",
                    d.device,
                    human_bytes(d.allocated_bytes.current.max(0) as u64),
                    human_bytes(reserved),
                    human_bytes(d.allocated_bytes.peak.max(0) as u64)
                ));
            }
            if nvml_total > 0 {
                text.push_str(&format!(
                    "  CUDA context and libraries: {} (process total {} less reserved)\n",
                    human_bytes(nvml_total.saturating_sub(reserved_total)),
                    human_bytes(nvml_total)
                ));
            }
            Some(text)
        }
        #[cfg(not(feature = "torch"))]
        {
            let _ = snapshot;
            None
        }
    }

    /// Empties gpukernel's own caching allocator if libtorch is loaded and holds a CUDA
    /// context; says what it did. Never loads libtorch just for this.
    pub fn empty_own_cache(&self) -> String {
        #[cfg(feature = "torch")]
        {
            use gpuprobe::plugin_api::{AllocatorStats, Request};
            let Some(plugin) = crate::torch_plugin::loaded() else {
                return "libtorch not loaded: no CUDA context, nothing cached".into();
            };
            match plugin
                .request(&Request::EmptyCache)
                .map(serde_json::from_value::<AllocatorStats>)
            {
                Ok(Ok(stats)) if !stats.initialized => "no CUDA context: nothing cached".into(),
                Ok(Ok(stats)) => {
                    let reserved: i64 =
                        stats.devices.iter().map(|d| d.reserved_bytes.current).sum();
                    format!(
                        "emptied its cache; allocator reserves {} now",
                        gpuprobe::units::human_bytes(reserved.max(0) as u64)
                    )
                }
                Ok(Err(e)) => format!("unreadable allocator stats: {e}"),
                Err(e) => format!("empty_cache failed: {e}"),
            }
        }
        #[cfg(not(feature = "torch"))]
        {
            "this build has no libtorch: no CUDA context, nothing cached".into()
        }
    }
}
