// gpuprobe's shim over libtorch's CUDA caching allocator; C ABI in allocator.h.
//
// tch has no allocator API, so this reaches c10 directly. Rules kept throughout:
// - no C++ exception leaves an extern "C" function (`guarded` catches everything, and
//   c10::OutOfMemoryError by type, so an OOM is never recognised by matching its text);
// - nothing here creates a CUDA context except gpa_try_allocate: stats, empty-cache and
//   reset-peak do nothing on CUDA until the allocator is initialised, and cudaMemGetInfo is
//   only called for devices that already have a primary context.
//
// Built without GPUPROBE_SHIM_CUDA (a libtorch with no libc10_cuda or no CUDA headers), the
// CUDA allocator cannot exist, so everything reports "not initialised".

#include "allocator.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#ifdef GPUPROBE_SHIM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>

namespace {

void write_err(char* err, size_t err_len, const char* msg) noexcept {
  if (err == nullptr || err_len == 0) {
    return;
  }
  if (msg == nullptr) {
    msg = "";
  }
  size_t n = std::strlen(msg);
  if (n >= err_len) {
    n = err_len - 1;
  }
  std::memcpy(err, msg, n);
  err[n] = '\0';
}

// Runs `body` (which returns a GPA_* code) and turns every exception into a code + message.
template <typename F>
int guarded(char* err, size_t err_len, F&& body) noexcept {
  try {
    return body();
  } catch (const c10::OutOfMemoryError& e) {
    // Before c10::Error: OutOfMemoryError derives from it.
    write_err(err, err_len, e.what_without_backtrace());
    return GPA_OUT_OF_MEMORY;
  } catch (const c10::Error& e) {
    write_err(err, err_len, e.what_without_backtrace());
    return GPA_ERROR;
  } catch (const std::exception& e) {
    write_err(err, err_len, e.what());
    return GPA_ERROR;
  } catch (...) {
    write_err(err, err_len, "unknown C++ exception in gpuprobe's allocator shim");
    return GPA_ERROR;
  }
}

int not_initialised(char* err, size_t err_len) noexcept {
  write_err(err, err_len,
            "the CUDA caching allocator is not initialised in this process (CUDA not used yet)");
  return GPA_NOT_INITIALISED;
}

// The CUDA caching allocator, or null when this process has none set up. Never initialises
// CUDA: c10 registers the allocator object statically and sets it up on CUDA's lazy init.
c10::DeviceAllocator* initialised_allocator() {
#ifdef GPUPROBE_SHIM_CUDA
  c10::DeviceAllocator* allocator = c10::getDeviceAllocator(c10::kCUDA);
  if (allocator != nullptr && allocator->initialized()) {
    return allocator;
  }
#endif
  return nullptr;
}

// The device count CUDA reports; only called once the allocator is initialised, so the
// runtime is already up and this creates nothing.
int32_t visible_devices() {
#ifdef GPUPROBE_SHIM_CUDA
  return static_cast<int32_t>(c10::cuda::device_count());
#else
  return 0;
#endif
}

bool valid_device(int32_t device, char* err, size_t err_len) {
  const int32_t count = visible_devices();
  if (device >= 0 && device < count) {
    return true;
  }
  const std::string msg = "cuda:" + std::to_string(device) + " does not exist (this process sees " +
                          std::to_string(count) + " CUDA device(s))";
  write_err(err, err_len, msg.c_str());
  return false;
}

bool has_context(int32_t device) {
#ifdef GPUPROBE_SHIM_CUDA
  return c10::cuda::hasPrimaryContext(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
  return false;
#endif
}

void copy_stat(const c10::CachingAllocator::StatArray& from, gpa_stat_t* to) {
  const auto& aggregate = from[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  to->current = aggregate.current;
  to->peak = aggregate.peak;
  to->allocated = aggregate.allocated;
  to->freed = aggregate.freed;
}

}  // namespace

extern "C" {

int gpa_initialized(int32_t* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (out == nullptr) {
      throw std::invalid_argument("gpa_initialized: null output");
    }
    *out = initialised_allocator() != nullptr ? 1 : 0;
    return GPA_OK;
  });
}

int gpa_device_count(int32_t* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (out == nullptr) {
      throw std::invalid_argument("gpa_device_count: null output");
    }
    if (initialised_allocator() == nullptr) {
      return not_initialised(err, err_len);
    }
    *out = visible_devices();
    return GPA_OK;
  });
}

int gpa_device_stats(int32_t device, gpa_device_stats_t* out, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (out == nullptr) {
      throw std::invalid_argument("gpa_device_stats: null output");
    }
    c10::DeviceAllocator* allocator = initialised_allocator();
    if (allocator == nullptr) {
      return not_initialised(err, err_len);
    }
    if (!valid_device(device, err, err_len)) {
      return GPA_ERROR;
    }
    const auto index = static_cast<c10::DeviceIndex>(device);
    const auto stats = allocator->getDeviceStats(index);
    gpa_device_stats_t result{};
    copy_stat(stats.allocated_bytes, &result.allocated_bytes);
    copy_stat(stats.reserved_bytes, &result.reserved_bytes);
    copy_stat(stats.active_bytes, &result.active_bytes);
    copy_stat(stats.inactive_split_bytes, &result.inactive_split_bytes);
    result.num_alloc_retries = stats.num_alloc_retries;
    result.num_ooms = stats.num_ooms;
    if (has_context(device)) {
      const auto [free_bytes, total_bytes] = allocator->getMemoryInfo(index);
      result.has_context = 1;
      result.free_bytes = free_bytes;
      result.total_bytes = total_bytes;
    }
    *out = result;
    return GPA_OK;
  });
}

int gpa_segments(int32_t device, gpa_segment_t* out, size_t capacity, size_t* count, char* err,
                 size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (count == nullptr || (out == nullptr && capacity > 0)) {
      throw std::invalid_argument("gpa_segments: null output");
    }
    if (initialised_allocator() == nullptr) {
      return not_initialised(err, err_len);
    }
    if (!valid_device(device, err, err_len)) {
      return GPA_ERROR;
    }
    size_t found = 0;
#ifdef GPUPROBE_SHIM_CUDA
    // Without traces: the segments alone, as torch.cuda.memory_snapshot() lists them.
    const auto info = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, false);
    for (const auto& segment : info.segments) {
      if (segment.device != static_cast<c10::DeviceIndex>(device)) {
        continue;
      }
      if (found < capacity) {
        out[found] = gpa_segment_t{static_cast<uint64_t>(segment.address),
                                   static_cast<uint64_t>(segment.total_size),
                                   segment.is_expandable ? 1 : 0};
      }
      ++found;
    }
#endif
    *count = found;
    return GPA_OK;
  });
}

int gpa_empty_cache(char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    c10::DeviceAllocator* allocator = initialised_allocator();
    if (allocator == nullptr) {
      return not_initialised(err, err_len);
    }
    allocator->emptyCache();
    return GPA_OK;
  });
}

int gpa_reset_peak(int32_t device, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    c10::DeviceAllocator* allocator = initialised_allocator();
    if (allocator == nullptr) {
      return not_initialised(err, err_len);
    }
    if (!valid_device(device, err, err_len)) {
      return GPA_ERROR;
    }
    allocator->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return GPA_OK;
  });
}

int gpa_set_memory_fraction(int32_t device, double fraction, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (initialised_allocator() == nullptr) {
      return not_initialised(err, err_len);
    }
    if (!valid_device(device, err, err_len)) {
      return GPA_ERROR;
    }
    if (!std::isfinite(fraction) || fraction < 0.0 || fraction > 1.0) {
      throw std::invalid_argument("memory fraction must be between 0 and 1, got " +
                                  std::to_string(fraction));
    }
    // c10 reads the device's total memory and switches to the device, which would create a
    // context there: refuse instead, since a context costs about 0.5 GiB.
    if (!has_context(device)) {
      throw std::runtime_error("cuda:" + std::to_string(device) +
                               " has no CUDA context in this process yet; setting its memory "
                               "fraction would create one");
    }
#ifdef GPUPROBE_SHIM_CUDA
    // c10 makes `device` current; the guard puts the caller's device back afterwards. (The
    // generic guard, not CUDAGuard, whose inline code would need libcudart at link time.)
    c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction,
                                                       static_cast<c10::DeviceIndex>(device));
#endif
    return GPA_OK;
  });
}

int gpa_try_allocate(int32_t device, uint64_t bytes, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (device < 0 || device > std::numeric_limits<c10::DeviceIndex>::max()) {
      throw std::invalid_argument("bad CUDA device index " + std::to_string(device));
    }
    if (bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw std::invalid_argument("allocation size " + std::to_string(bytes) + " is too large");
    }
    // A tensor rather than raw_alloc: it takes the same path as the user's tensors, including
    // CUDA's lazy initialisation and the allocator's free-cache-and-retry before an OOM.
    at::Tensor block =
        at::empty({static_cast<int64_t>(bytes)},
                  at::TensorOptions().dtype(at::kByte).device(
                      c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))));
    (void)block;
    return GPA_OK;
  });
}

int gpa_selftest_throw(int32_t what, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    switch (what) {
      case 1:
        TORCH_CHECK_WITH(OutOfMemoryError, false, "selftest: CUDA out of memory. Tried to allocate 1 byte");
        break;
      case 2:
        TORCH_CHECK(false, "selftest: a c10::Error");
        break;
      case 3:
        throw std::runtime_error("selftest: a std::runtime_error");
      case 4:
        throw 42;
      default:
        break;
    }
    return GPA_OK;
  });
}

}  // extern "C"
