//! libtorch's CUDA caching allocator in this process (cargo feature `torch`), through the C++
//! shim in `shim/allocator.cpp`. The only `unsafe` of gpuprobe's libtorch code is here.
//!
//! Nothing here creates a CUDA context except [`try_allocate`]: until CUDA has been used in
//! this process the allocator is "not initialised" and every query answers without touching
//! CUDA.

use crate::plugin_api::{AllocatorStats, DeviceAllocatorStats, Stat};
use crate::stranded::Segment;
use std::ffi::{c_char, c_int, CStr};
use thiserror::Error;

/// Why an allocator operation failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllocatorError {
    /// CUDA ran out of memory (a `c10::OutOfMemoryError`, told apart by type in C++).
    #[error("{0}")]
    OutOfMemory(String),
    /// CUDA has not been used in this process, so there is no allocator state to act on.
    #[error("the CUDA caching allocator is not initialised in this process (CUDA not used yet)")]
    NotInitialised,
    /// A bad argument, refused before reaching libtorch.
    #[error("{0}")]
    InvalidArgument(String),
    /// Any other libtorch or C++ error.
    #[error("libtorch: {0}")]
    Torch(String),
}

// Return codes of shim/allocator.h.
const GPA_OK: c_int = 0;
const GPA_NOT_INITIALISED: c_int = 1;
const GPA_OUT_OF_MEMORY: c_int = 2;

/// `gpa_stat_t` in allocator.h.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawStat {
    current: i64,
    peak: i64,
    allocated: i64,
    freed: i64,
}

/// `gpa_device_stats_t` in allocator.h.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawDeviceStats {
    allocated_bytes: RawStat,
    reserved_bytes: RawStat,
    active_bytes: RawStat,
    inactive_split_bytes: RawStat,
    num_alloc_retries: i64,
    num_ooms: i64,
    has_context: i32,
    free_bytes: u64,
    total_bytes: u64,
}

/// `gpa_segment_t` in allocator.h.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawSegment {
    address: u64,
    total_size: u64,
    is_expandable: i32,
}

extern "C" {
    fn gpa_initialized(out: *mut i32, err: *mut c_char, err_len: usize) -> c_int;
    fn gpa_device_count(out: *mut i32, err: *mut c_char, err_len: usize) -> c_int;
    fn gpa_device_stats(
        device: i32,
        out: *mut RawDeviceStats,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn gpa_segments(
        device: i32,
        out: *mut RawSegment,
        capacity: usize,
        count: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn gpa_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
    fn gpa_reset_peak(device: i32, err: *mut c_char, err_len: usize) -> c_int;
    fn gpa_set_memory_fraction(
        device: i32,
        fraction: f64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn gpa_try_allocate(device: i32, bytes: u64, err: *mut c_char, err_len: usize) -> c_int;
    fn gpa_autocast(cuda: i32, enabled: i32, bf16: i32, err: *mut c_char, err_len: usize) -> c_int;
    #[cfg(test)]
    fn gpa_selftest_throw(what: i32, err: *mut c_char, err_len: usize) -> c_int;
}

/// Room for libtorch's message (an OOM message with its hints is about 600 bytes).
const ERR_LEN: usize = 2048;

/// Calls a shim function with an error buffer and maps its code to a Result.
fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), AllocatorError> {
    let mut err = [0u8; ERR_LEN];
    let code = f(err.as_mut_ptr().cast(), err.len());
    let message = || {
        CStr::from_bytes_until_nul(&err)
            .map(|m| m.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unreadable error message".into())
    };
    match code {
        GPA_OK => Ok(()),
        GPA_NOT_INITIALISED => Err(AllocatorError::NotInitialised),
        GPA_OUT_OF_MEMORY => Err(AllocatorError::OutOfMemory(message())),
        _ => Err(AllocatorError::Torch(message())),
    }
}

/// c10 indexes devices with an `int8_t`.
fn device_index(device: usize) -> Result<i32, AllocatorError> {
    i8::try_from(device)
        .map(i32::from)
        .map_err(|_| AllocatorError::InvalidArgument(format!("no CUDA device {device}")))
}

/// Whether the CUDA caching allocator is set up, i.e. CUDA has been used in this process.
pub fn initialized() -> Result<bool, AllocatorError> {
    let mut out = 0i32;
    // SAFETY: `out` and the buffer outlive the call; the shim writes at most `len` bytes.
    call(|err, len| unsafe { gpa_initialized(&mut out, err, len) })?;
    Ok(out != 0)
}

/// Visible CUDA devices; [`AllocatorError::NotInitialised`] before CUDA is used.
pub fn device_count() -> Result<usize, AllocatorError> {
    let mut out = 0i32;
    // SAFETY: as in `initialized`.
    call(|err, len| unsafe { gpa_device_count(&mut out, err, len) })?;
    Ok(usize::try_from(out).unwrap_or(0))
}

fn stat(raw: RawStat) -> Stat {
    Stat {
        current: raw.current,
        peak: raw.peak,
    }
}

/// The allocator's figures for one device. `free`/`total` are 0 when this process has no
/// context on the device: reading them would create one.
pub fn device_stats(device: usize) -> Result<DeviceAllocatorStats, AllocatorError> {
    let index = device_index(device)?;
    let mut raw = RawDeviceStats::default();
    // SAFETY: `raw` is a #[repr(C)] mirror of gpa_device_stats_t; it and the buffer outlive
    // the call.
    call(|err, len| unsafe { gpa_device_stats(index, &mut raw, err, len) })?;
    Ok(DeviceAllocatorStats {
        device,
        allocated_bytes: stat(raw.allocated_bytes),
        reserved_bytes: stat(raw.reserved_bytes),
        active_bytes: stat(raw.active_bytes),
        inactive_split_bytes: stat(raw.inactive_split_bytes),
        num_alloc_retries: raw.num_alloc_retries,
        num_ooms: raw.num_ooms,
        free: raw.free_bytes,
        total: raw.total_bytes,
    })
}

/// Every visible device's figures, or `initialized: false` (and no devices) before CUDA is
/// used in this process.
pub fn snapshot() -> Result<AllocatorStats, AllocatorError> {
    let count = match device_count() {
        Ok(count) => count,
        Err(AllocatorError::NotInitialised) => return Ok(AllocatorStats::default()),
        Err(e) => return Err(e),
    };
    let devices = (0..count).map(device_stats).collect::<Result<_, _>>()?;
    Ok(AllocatorStats {
        initialized: true,
        devices,
    })
}

/// The caching allocator's segments on `device` (what `torch.cuda.memory_snapshot()` lists
/// for it); [`AllocatorError::NotInitialised`] before CUDA is used.
pub fn segments(device: usize) -> Result<Vec<Segment>, AllocatorError> {
    let index = device_index(device)?;
    let mut raw = vec![RawSegment::default(); 64];
    loop {
        let mut count = 0usize;
        let capacity = raw.len();
        let out = raw.as_mut_ptr();
        // SAFETY: `out` points at `capacity` #[repr(C)] mirrors of gpa_segment_t, of which the
        // shim writes at most `capacity`; they, `count` and the buffer outlive the call.
        call(|err, len| unsafe { gpa_segments(index, out, capacity, &mut count, err, len) })?;
        if count <= capacity {
            raw.truncate(count);
            break;
        }
        // More segments than room (or some made between two calls): again with room for all.
        raw.resize(count + 16, RawSegment::default());
    }
    Ok(raw
        .into_iter()
        .map(|s| Segment {
            address: s.address,
            bytes: s.total_size,
            expandable: s.is_expandable != 0,
        })
        .collect())
}

/// Returns cached, unused blocks to CUDA. `Ok(false)`: nothing to do, CUDA was never used.
pub fn empty_cache() -> Result<bool, AllocatorError> {
    // SAFETY: the buffer outlives the call.
    match call(|err, len| unsafe { gpa_empty_cache(err, len) }) {
        Ok(()) => Ok(true),
        Err(AllocatorError::NotInitialised) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Sets the peak figures of `device` to their current values.
pub fn reset_peak(device: usize) -> Result<(), AllocatorError> {
    let index = device_index(device)?;
    // SAFETY: the buffer outlives the call.
    call(|err, len| unsafe { gpa_reset_peak(index, err, len) })
}

/// Caps this process's allocator on `device` at `fraction` (0 to 1) of its memory. Refused
/// for a device with no context in this process, rather than creating one.
pub fn set_memory_fraction(device: usize, fraction: f64) -> Result<(), AllocatorError> {
    let index = device_index(device)?;
    if !(0.0..=1.0).contains(&fraction) {
        return Err(AllocatorError::InvalidArgument(format!(
            "memory fraction must be between 0 and 1, got {fraction}"
        )));
    }
    // SAFETY: the buffer outlives the call.
    call(|err, len| unsafe { gpa_set_memory_fraction(index, fraction, err, len) })
}

/// Allocates `bytes` on `device` through the caching allocator, as a tensor would, and frees
/// them (the block stays cached). Creates a CUDA context on `device` if there is none.
pub fn try_allocate(device: usize, bytes: u64) -> Result<(), AllocatorError> {
    let index = device_index(device)?;
    // Tensor sizes are int64_t in libtorch.
    if i64::try_from(bytes).is_err() {
        return Err(AllocatorError::InvalidArgument(format!(
            "cannot allocate {bytes} bytes: more than a tensor can hold"
        )));
    }
    // SAFETY: the buffer outlives the call.
    call(|err, len| unsafe { gpa_try_allocate(index, bytes, err, len) })
}

/// Mixed precision while it lives: autocast on (CUDA or the CPU) with bf16 or fp16, off
/// again and its cached weight casts freed when dropped. Lives in this module because the
/// switch is in the same C++ shim (tch only wraps the deprecated fp16-only CUDA switch).
pub struct Autocast {
    cuda: i32,
}

impl Autocast {
    pub fn enter(cuda: bool, bf16: bool) -> Result<Self, AllocatorError> {
        let cuda = i32::from(cuda);
        // SAFETY: the buffer outlives the call.
        call(|err, len| unsafe { gpa_autocast(cuda, 1, i32::from(bf16), err, len) })?;
        Ok(Self { cuda })
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        let cuda = self.cuda;
        // SAFETY: the buffer outlives the call. Turning autocast off cannot usefully fail.
        let _ = call(|err, len| unsafe { gpa_autocast(cuda, 0, 0, err, len) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selftest(what: i32) -> Result<(), AllocatorError> {
        // SAFETY: the buffer outlives the call.
        call(|err, len| unsafe { gpa_selftest_throw(what, err, len) })
    }

    #[test]
    fn exceptions_become_typed_errors() {
        assert_eq!(selftest(0), Ok(()));
        match selftest(1) {
            Err(AllocatorError::OutOfMemory(m)) => {
                assert!(m.contains("selftest: CUDA out of memory"), "{m}")
            }
            other => panic!("c10::OutOfMemoryError must map to OutOfMemory, got {other:?}"),
        }
        match selftest(2) {
            Err(AllocatorError::Torch(m)) => assert!(m.contains("selftest: a c10::Error"), "{m}"),
            other => panic!("c10::Error must map to Torch, got {other:?}"),
        }
        match selftest(3) {
            Err(AllocatorError::Torch(m)) => assert_eq!(m, "selftest: a std::runtime_error"),
            other => panic!("std::exception must map to Torch, got {other:?}"),
        }
        match selftest(4) {
            Err(AllocatorError::Torch(m)) => assert!(m.contains("unknown C++ exception"), "{m}"),
            other => panic!("a non-std throw must map to Torch, got {other:?}"),
        }
    }

    #[test]
    fn long_messages_are_truncated_not_overrun() {
        let mut err = [b'x'; 8];
        // SAFETY: the shim is told the buffer holds 8 bytes.
        let code = unsafe { gpa_selftest_throw(3, err.as_mut_ptr().cast(), err.len()) };
        assert_ne!(code, GPA_OK);
        assert_eq!(&err, b"selftes\0");
    }

    #[test]
    fn bad_arguments_are_refused_before_libtorch() {
        assert!(matches!(
            set_memory_fraction(0, 1.5),
            Err(AllocatorError::InvalidArgument(_))
        ));
        assert!(matches!(
            set_memory_fraction(0, f64::NAN),
            Err(AllocatorError::InvalidArgument(_))
        ));
        assert!(matches!(
            reset_peak(1000),
            Err(AllocatorError::InvalidArgument(_))
        ));
        assert!(matches!(
            try_allocate(0, u64::MAX),
            Err(AllocatorError::InvalidArgument(_))
        ));
        assert!(matches!(
            segments(1000),
            Err(AllocatorError::InvalidArgument(_))
        ));
    }

    #[test]
    fn segments_are_not_read_before_cuda_is_used() {
        // These tests use CUDA nowhere (the CPU machine has none): the shim answers without
        // creating a context, and the search leaves the room out.
        if tch::Cuda::is_available() {
            return;
        }
        assert_eq!(segments(0), Err(AllocatorError::NotInitialised));
    }

    #[test]
    fn autocast_changes_the_compute_dtype_while_it_lives() {
        let a = tch::Tensor::ones([4, 4], (tch::Kind::Float, tch::Device::Cpu));
        {
            let _amp = Autocast::enter(false, true).expect("autocast on the CPU");
            assert_eq!(a.matmul(&a).kind(), tch::Kind::BFloat16);
        }
        assert_eq!(a.matmul(&a).kind(), tch::Kind::Float);
    }
}
