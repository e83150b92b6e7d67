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
