#pragma once

// What the stand-in exports besides the CUDA API: counters and switches for tests (reached from
// Python with ctypes, tests/cuda_standin/standin.py), and the one call the cuBLAS stand-in makes
// into the runtime. All of it is C, prefixed standin_.

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct StandinStats {
  int64_t mallocs;          // cudaMalloc / cuMemCreate that succeeded
  int64_t frees;            // cudaFree / cuMemRelease
  int64_t bytes_in_use;     // device bytes allocated now (counted against the capacity)
  int64_t peak_bytes;       // their maximum
  int64_t oom;              // allocations refused for want of capacity (or injected)
  int64_t kernel_launches;  // kernels submitted outside captures (never executed)
  int64_t kernel_nodes;     // kernels captured into graphs
  int64_t copies;           // memcpy / memset work that ran (bytes really moved)
  int64_t captures_begun;
  int64_t captures_ended;        // EndCapture that returned a graph
  int64_t captures_invalidated;  // captures an illegal call invalidated
  int64_t graph_launches;
  int64_t unsafe_calls;      // calls a capture forbade (cudaErrorStreamCaptureUnsupported)
  int64_t device_faults;     // graph nodes or queued work that touched unallocated memory
  int64_t sticky_error;      // the cudaError_t every call now fails with, 0 if none
  int64_t deferred;          // 1 in deferred mode (CUDA_STANDIN_DEFERRED=1)
  int64_t capacity;          // device bytes
  int64_t live_graphs;       // cudaGraph_t not destroyed
  int64_t live_execs;        // cudaGraphExec_t not destroyed
  int64_t vmm_mapped_bytes;  // bytes mapped through cuMemMap now
} StandinStats;

void standin_stats(StandinStats* out);
// The device's memory; allocations past it fail with cudaErrorMemoryAllocation.
void standin_set_capacity(int64_t bytes);
// Makes the n-th device allocation from now (1: the next one) and the count - 1 after it fail as
// out of memory (c10 retries a failed cudaMalloc once after emptying its cache: count=2 makes
// the allocation fail for c10); n = 0 disarms.
void standin_fail_allocation(int64_t n, int64_t count);
// Makes the next call of `call` fail with `error` (a cudaError_t): one of
// cudaGraphInstantiateWithFlags, cudaGraphLaunch, cudaStreamEndCapture, cudaStreamSynchronize,
// cudaMemcpyAsync. Returns 0, or -1 for a call that cannot be made to fail.
int standin_fail_next(const char* call, int error);
// The last failure the stand-in reported (a refused call or a device fault), "" if none.
size_t standin_last_message(char* buf, size_t len);
void standin_clear_sticky_error(void);
// Kernels launched or captured whose name contains `substring` (all of them for "").
int64_t standin_kernel_count(const char* substring);
void standin_reset_counters(void);
// Submits a kernel by name to `stream` (a cudaStream_t): what the cuBLAS stand-in's GEMMs do.
int standin_launch(const char* name, void* stream, unsigned grid_x, unsigned block_x);
// Whether [p, p + n) lies in live device memory.
int standin_is_device_memory(const void* p, size_t n);

#ifdef __cplusplus
}
#endif
