// Mixed precision for %maxbatch --amp: turns autocast on for CUDA (or the CPU) with a chosen
// dtype. tch only wraps the deprecated at::autocast::set_enabled, which always means CUDA with
// fp16; bf16 needs set_autocast_dtype. Same error rules as allocator.cpp: nothing throws out.

#include "allocator.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <exception>

namespace {

void write_message(char* err, size_t err_len, const char* msg) noexcept {
  if (err == nullptr || err_len == 0) {
    return;
  }
  size_t n = std::strlen(msg);
  if (n >= err_len) {
    n = err_len - 1;
  }
  std::memcpy(err, msg, n);
  err[n] = '\0';
}

}  // namespace

extern "C" int gpa_autocast(int32_t cuda, int32_t enabled, int32_t bf16, char* err,
                            size_t err_len) {
  try {
    const at::DeviceType device = cuda != 0 ? at::kCUDA : at::kCPU;
    if (enabled != 0) {
      at::autocast::set_autocast_dtype(device, bf16 != 0 ? at::kBFloat16 : at::kHalf);
      at::autocast::set_autocast_enabled(device, true);
      at::autocast::increment_nesting();
    } else {
      at::autocast::set_autocast_enabled(device, false);
      // Casts of the weights are cached while autocast is on; the last exit frees them.
      if (at::autocast::decrement_nesting() == 0) {
        at::autocast::clear_cache();
      }
    }
    return GPA_OK;
  } catch (const c10::Error& e) {
    write_message(err, err_len, e.what_without_backtrace());
  } catch (const std::exception& e) {
    write_message(err, err_len, e.what());
  } catch (...) {
    write_message(err, err_len, "unknown C++ exception in gpuprobe's autocast shim");
  }
  return GPA_ERROR;
}
