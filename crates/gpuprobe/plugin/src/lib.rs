//! `libgpuprobe_torch.so`: gpuprobe's libtorch code behind a three-function C ABI.
//!
//! gpukernel loads this with `dlopen` the first time a magic needs libtorch. Linking libtorch
//! into gpukernel itself would cost every kernel start about 0.6 s and 0.5 GB of RSS, for
//! magics most sessions never run. Requests and replies are JSON (types in
//! `gpuprobe::plugin_api`), so the ABI never changes when an operation is added.

use gpuprobe::plugin_api::{ProgressFn, Reply, ABI_VERSION};
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The ABI version the caller must match.
#[no_mangle]
pub extern "C" fn gpuprobe_torch_abi_version() -> u32 {
    ABI_VERSION
}

/// Runs one JSON request and returns a JSON [`Reply`], to be released with
/// [`gpuprobe_torch_free`]. `progress`, if given, receives JSON events during long operations
/// and returns non-zero to cancel. Never unwinds into the caller.
///
/// # Safety
/// `request` must be a valid NUL-terminated string; `progress` and `data` must stay valid for
/// the duration of the call.
#[no_mangle]
pub unsafe extern "C" fn gpuprobe_torch_call(
    request: *const c_char,
    progress: Option<ProgressFn>,
    data: *mut c_void,
) -> *mut c_char {
    let reply = if request.is_null() {
        Reply::failure("bad_request", "null request")
    } else {
        // SAFETY: the caller promises a valid C string.
        let text = unsafe { CStr::from_ptr(request) }
            .to_string_lossy()
            .into_owned();
        let report = |event: &str| -> bool {
            let Some(callback) = progress else {
                return false;
            };
            let Ok(event) = CString::new(event) else {
                return false;
            };
            // SAFETY: the caller promises `progress` and `data` are valid during this call.
            unsafe { callback(event.as_ptr(), data) != 0 }
        };
        catch_unwind(AssertUnwindSafe(|| gpuprobe::torch::handle(&text, &report))).unwrap_or_else(
            |_| Reply::failure("panic", "libtorch code panicked; see the kernel log"),
        )
    };
    let json = serde_json::to_string(&reply).unwrap_or_else(|_| "{}".into());
    CString::new(json)
        .map(CString::into_raw)
        .unwrap_or(std::ptr::null_mut())
}

/// Releases a string returned by [`gpuprobe_torch_call`].
///
/// # Safety
/// `reply` must come from `gpuprobe_torch_call` and be freed once.
#[no_mangle]
pub unsafe extern "C" fn gpuprobe_torch_free(reply: *mut c_char) {
    if !reply.is_null() {
        // SAFETY: created by CString::into_raw in gpuprobe_torch_call.
        drop(unsafe { CString::from_raw(reply) });
    }
}
