//! The built `libgpuprobe_torch.so`, loaded with `dlopen` as gpukernel loads it, answers the
//! allocator requests through its C ABI, in a process whose libtorch it shares (as in a Python
//! kernel that imported torch).
//!
//! Needs the plugin built first: scripts/setup builds it (`cargo build --release -p
//! gpuprobe-torch`) and scripts/env.sh points `GPUKERNEL_TORCH_PLUGIN` at it.
#![cfg(feature = "torch")]

use libloading::Library;
use serde_json::{json, Value};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

type ProgressFn = unsafe extern "C" fn(*const c_char, *mut c_void) -> c_int;
type CallFn = unsafe extern "C" fn(*const c_char, Option<ProgressFn>, *mut c_void) -> *mut c_char;
type FreeFn = unsafe extern "C" fn(*mut c_char);

/// `$GPUKERNEL_TORCH_PLUGIN`, else a plugin cargo built in this target dir (this profile's,
/// then release).
fn plugin_path() -> PathBuf {
    if let Some(path) = std::env::var_os("GPUKERNEL_TORCH_PLUGIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("test path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps/<test>");
    let here = profile_dir.join("libgpuprobe_torch.so");
    let release = profile_dir.join("../release/libgpuprobe_torch.so");
    if here.exists() || !release.exists() {
        here
    } else {
        release
    }
}

struct Plugin {
    _library: Library,
    call: CallFn,
    free: FreeFn,
}

impl Plugin {
    fn load() -> Plugin {
        let path = plugin_path();
        assert!(
            path.exists(),
            "{} is missing: build it with `cargo build --release -p gpuprobe-torch` (or set \
             GPUKERNEL_TORCH_PLUGIN)",
            path.display()
        );
        // SAFETY: our own plugin; its initialisers (libtorch's) are safe to run once.
        let library = unsafe { Library::new(&path) }.expect("dlopen the plugin");
        // SAFETY: signatures as declared in plugin/src/lib.rs.
        unsafe {
            let version = *library
                .get::<unsafe extern "C" fn() -> u32>(b"gpuprobe_torch_abi_version\0")
                .expect("abi symbol");
            assert_eq!(version(), gpuprobe::plugin_api::ABI_VERSION);
            let call = *library
                .get::<CallFn>(b"gpuprobe_torch_call\0")
                .expect("call");
            let free = *library
                .get::<FreeFn>(b"gpuprobe_torch_free\0")
                .expect("free");
            Plugin {
                _library: library,
                call,
                free,
            }
        }
    }

    fn call(&self, request: Value) -> Value {
        let request = CString::new(request.to_string()).expect("no NUL");
        // SAFETY: a valid C string; no progress callback.
        let raw = unsafe { (self.call)(request.as_ptr(), None, std::ptr::null_mut()) };
        assert!(!raw.is_null(), "the plugin returned nothing");
        // SAFETY: a C string owned by the plugin until freed below, once.
        let text = unsafe { CStr::from_ptr(raw) }
            .to_string_lossy()
            .into_owned();
        unsafe { (self.free)(raw) };
        serde_json::from_str(&text).expect("the reply is JSON")
    }
}

#[test]
fn allocator_requests_round_trip_through_the_c_abi() {
    let plugin = Plugin::load();
    let uninitialised = json!({"ok": {"initialized": false, "devices": []}});
    assert_eq!(plugin.call(json!({"op": "allocator_stats"})), uninitialised);
    assert_eq!(plugin.call(json!({"op": "empty_cache"})), uninitialised);

    for request in [
        json!({"op": "reset_peak", "device": 0}),
        json!({"op": "set_memory_fraction", "device": 0, "fraction": 0.5}),
    ] {
        let reply = plugin.call(request.clone());
        assert_eq!(
            reply["error"]["kind"], "not_initialised",
            "{request} -> {reply}"
        );
    }
    let reply = plugin.call(json!({"op": "set_memory_fraction", "device": 0, "fraction": 2.0}));
    assert_eq!(reply["error"]["kind"], "bad_request", "{reply}");

    // Still computes afterwards, and still has not set up CUDA.
    assert_eq!(
        plugin.call(json!({"op": "smoke", "device": "cpu"})),
        json!({"ok": 204.0})
    );
    assert_eq!(plugin.call(json!({"op": "allocator_stats"})), uninitialised);
}

#[test]
fn try_allocate_without_a_gpu_is_an_error_reply_not_a_crash() {
    let plugin = Plugin::load();
    let info = plugin.call(json!({"op": "info"}));
    if info["ok"]["cuda_device_count"].as_i64().unwrap_or(0) > 0 {
        eprintln!(
            "skipped: this machine has CUDA devices (bench/gpu/allocator_check.py covers them)"
        );
        return;
    }
    let reply = plugin.call(json!({"op": "try_allocate", "device": 0, "bytes": 1 << 20}));
    assert_eq!(reply["error"]["kind"], "torch", "{reply}");
    assert_eq!(
        plugin.call(json!({"op": "allocator_stats"})),
        json!({"ok": {"initialized": false, "devices": []}})
    );
}
