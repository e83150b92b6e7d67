// C ABI of gpuprobe's shim over libtorch's CUDA caching allocator (allocator.cpp).
// Mirrored by the `extern "C"` block in src/allocator.rs; change both together.
//
// Every function returns one of the GPA_* codes and never throws. On failure a NUL-terminated
// message is written into `err` (at most `err_len` bytes, truncated; `err` may be NULL).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  GPA_OK = 0,
  // The CUDA caching allocator has not been set up in this process: CUDA was never used.
  GPA_NOT_INITIALISED = 1,
  // c10::OutOfMemoryError (recognised by its type, not its text).
  GPA_OUT_OF_MEMORY = 2,
  // Any other exception from libtorch or the C++ runtime.
  GPA_ERROR = 3,
};

typedef struct {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} gpa_stat_t;

// c10's DeviceStats for one device, aggregate over pools (StatArray index 0).
typedef struct {
  gpa_stat_t allocated_bytes;
  gpa_stat_t reserved_bytes;
  gpa_stat_t active_bytes;
  gpa_stat_t inactive_split_bytes;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  // 1 when this process has a primary context on the device; only then are free/total read
  // (cudaMemGetInfo would otherwise create one).
  int32_t has_context;
  uint64_t free_bytes;
  uint64_t total_bytes;
} gpa_device_stats_t;

// One segment of the caching allocator: a cudaMalloc'd range (or, under expandable_segments,
// a mapped one that grows in place).
typedef struct {
  uint64_t address;
  uint64_t total_size;
  int32_t is_expandable;
} gpa_segment_t;

// *out = 1 when the CUDA caching allocator is set up (CUDA was initialised in this process).
int gpa_initialized(int32_t* out, char* err, size_t err_len);
// Visible CUDA devices. GPA_NOT_INITIALISED unless the allocator is set up.
int gpa_device_count(int32_t* out, char* err, size_t err_len);
int gpa_device_stats(int32_t device, gpa_device_stats_t* out, char* err, size_t err_len);
// Writes up to `capacity` of `device`'s segments into `out` and how many there are into
// *count, which may be more than `capacity`: call again with room for them all. Reads the
// allocator's snapshot without its traces.
int gpa_segments(int32_t device, gpa_segment_t* out, size_t capacity, size_t* count, char* err,
                 size_t err_len);
// Returns cached, unused blocks of every device to CUDA.
int gpa_empty_cache(char* err, size_t err_len);
int gpa_reset_peak(int32_t device, char* err, size_t err_len);
// Refuses (GPA_ERROR) a device with no context in this process rather than create one.
int gpa_set_memory_fraction(int32_t device, double fraction, char* err, size_t err_len);
// Allocates `bytes` on `device` through the caching allocator (as a tensor would) and frees
// them again. Initialises CUDA and creates a context on `device` when there is none.
int gpa_try_allocate(int32_t device, uint64_t bytes, char* err, size_t err_len);
// For tests: throws `what` (0 nothing, 1 c10::OutOfMemoryError, 2 c10::Error,
// 3 std::runtime_error, 4 a non-std exception) through the same guard as the functions above.
int gpa_selftest_throw(int32_t what, char* err, size_t err_len);

// Autocast (mixed precision) on CUDA (cuda != 0) or the CPU: `enabled` != 0 turns it on with
// bf16 (bf16 != 0) or fp16 and enters one nesting level; 0 turns it off, leaves the level and
// frees the cached weight casts when the last level is left. In autocast.cpp.
int gpa_autocast(int32_t cuda, int32_t enabled, int32_t bf16, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif
