//! FFI shim: loads `libgpuprobe_torch.so` on first use and calls it. The only `unsafe` in
//! gpukernel lives here.
//!
//! Looked up in order: `$GPUKERNEL_TORCH_PLUGIN`, next to the gpukernel binary, then
//! `../lib/gpukernel/` from it. libtorch itself is found through the plugin's RUNPATH or
//! `LD_LIBRARY_PATH` (point it at `torch/lib` of a torch 2.11 install).

use gpuprobe::plugin_api::{ProgressFn, Reply, Request, ABI_VERSION};
use serde_json::Value;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;
use thiserror::Error;

pub const FILE_NAME: &str = "libgpuprobe_torch.so";

#[derive(Debug, Error, Clone)]
pub enum PluginError {
    #[error("libtorch support is not installed: {0}")]
    NotFound(String),
    #[error(
        "cannot load {path}: {reason}. Point LD_LIBRARY_PATH at torch/lib of a torch 2.11 install"
    )]
    Load { path: String, reason: String },
    #[error(
        "{path} speaks ABI {found}, this gpukernel needs {ABI_VERSION}: install matching builds"
    )]
    Abi { path: String, found: u32 },
    #[error("libtorch: {0}")]
    Failed(String),
}

type CallFn = unsafe extern "C" fn(*const c_char, Option<ProgressFn>, *mut c_void) -> *mut c_char;
type FreeFn = unsafe extern "C" fn(*mut c_char);

pub struct TorchPlugin {
    // Kept loaded for the life of the process: libtorch cannot be unloaded safely.
    _library: libloading::Library,
    call: CallFn,
    free: FreeFn,
    pub path: PathBuf,
}

static PLUGIN: OnceLock<Result<TorchPlugin, PluginError>> = OnceLock::new();

/// The plugin, loaded on the first call.
pub fn plugin() -> Result<&'static TorchPlugin, PluginError> {
    PLUGIN.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// The plugin if an earlier call loaded it; never loads it (so never loads libtorch).
pub fn loaded() -> Option<&'static TorchPlugin> {
    PLUGIN.get().and_then(|loaded| loaded.as_ref().ok())
}

fn candidates() -> Vec<PathBuf> {
    let mut paths = Vec::new();
    if let Some(path) = std::env::var_os("GPUKERNEL_TORCH_PLUGIN") {
        paths.push(PathBuf::from(path));
        return paths;
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.canonicalize().ok())
        .and_then(|exe| exe.parent().map(PathBuf::from))
    {
        paths.push(dir.join(FILE_NAME));
        paths.push(dir.join("../lib/gpukernel").join(FILE_NAME));
    }
    paths
}

fn load() -> Result<TorchPlugin, PluginError> {
    let paths = candidates();
    let Some(path) = paths.iter().find(|p| p.exists()).cloned() else {
        let looked: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        return Err(PluginError::NotFound(format!(
            "no {FILE_NAME} in {} (build it with `cargo build --release -p gpuprobe-torch`, \
             or set GPUKERNEL_TORCH_PLUGIN)",
            looked.join(", ")
        )));
    };
    let shown = path.display().to_string();
    let load_err = |e: libloading::Error| PluginError::Load {
        path: shown.clone(),
        reason: e.to_string(),
    };
    tracing::info!("loading {shown}");
    // SAFETY: loading runs the library's initialisers; it is our own plugin, built with the
    // same toolchain, and libtorch's initialisers are safe to run once per process.
    let library = unsafe { libloading::Library::new(&path) }.map_err(load_err)?;
    // SAFETY: the symbols are declared in plugin/src/lib.rs with exactly these signatures.
    let (version, call, free) = unsafe {
        let version = *library
            .get::<unsafe extern "C" fn() -> u32>(b"gpuprobe_torch_abi_version\0")
            .map_err(load_err)?;
        let call = *library
            .get::<CallFn>(b"gpuprobe_torch_call\0")
            .map_err(load_err)?;
        let free = *library
            .get::<FreeFn>(b"gpuprobe_torch_free\0")
            .map_err(load_err)?;
        (version, call, free)
    };
    // SAFETY: a plain function with no arguments.
    let found = unsafe { version() };
    if found != ABI_VERSION {
        return Err(PluginError::Abi { path: shown, found });
    }
    Ok(TorchPlugin {
        _library: library,
        call,
        free,
        path,
    })
}

type Progress<'a> = &'a mut dyn FnMut(&str) -> bool;

unsafe extern "C" fn trampoline(event: *const c_char, data: *mut c_void) -> c_int {
    // SAFETY: `data` is the `&mut Progress` passed by `TorchPlugin::call` for this call only,
    // and `event` a valid C string from the plugin.
    let progress = unsafe { &mut *(data as *mut Progress) };
    let event = unsafe { CStr::from_ptr(event) }.to_string_lossy();
    c_int::from(progress(&event))
}

impl TorchPlugin {
    /// Runs `request`; `progress` gets JSON events and returns true to cancel.
    pub fn call(
        &self,
        request: &Request,
        mut progress: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Value, PluginError> {
        let json =
            serde_json::to_string(request).map_err(|e| PluginError::Failed(e.to_string()))?;
        let json = CString::new(json).map_err(|e| PluginError::Failed(e.to_string()))?;
        let data = &mut progress as *mut Progress as *mut c_void;
        // SAFETY: valid C string; the trampoline and `data` outlive the call.
        let raw = unsafe { (self.call)(json.as_ptr(), Some(trampoline), data) };
        if raw.is_null() {
            return Err(PluginError::Failed("the plugin returned nothing".into()));
        }
        // SAFETY: `raw` is a C string owned by the plugin until we free it below.
        let text = unsafe { CStr::from_ptr(raw) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: returned by gpuprobe_torch_call, freed once.
        unsafe { (self.free)(raw) };
        match serde_json::from_str::<Reply>(&text) {
            Ok(Reply::Ok(value)) => Ok(value),
            Ok(Reply::Error(f)) => Err(PluginError::Failed(format!("{} ({})", f.message, f.kind))),
            Err(e) => Err(PluginError::Failed(format!("unreadable reply: {e}"))),
        }
    }

    /// A call with no progress reporting.
    pub fn request(&self, request: &Request) -> Result<Value, PluginError> {
        self.call(request, &mut |_| false)
    }
}
