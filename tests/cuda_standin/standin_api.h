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
  int64_t host_nodes;        // host nodes captured into graphs (cudaLaunchHostFunc)
  int64_t unknown_reads;     // device-to-host copies that read bytes the value mode does not know
  int64_t host_waits;  // the host waited for the device: stream, event and device synchronisation,
                       // a synchronous copy to or from device memory
  int64_t
      conditional_nodes;  // conditional nodes added to graphs (Note [Stand-in conditional nodes])
  int64_t conditional_runs;  // bodies of conditional nodes executed (a WHILE body: each iteration)
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
// standin_launch of a routine that writes the device memory at `out` (nullptr: unknown): the
// cuBLAS stand-in's GEMMs, for the value mode's coverage check.
int standin_launch_writes(const char* name, void* stream, unsigned grid_x, unsigned block_x,
                          void* out);
// Whether [p, p + n) lies in live device memory.
int standin_is_device_memory(const void* p, size_t n);

// ---- the value mode (Note [Stand-in values], tests/cuda_standin/values.cpp) ----
// A host pointer aliasing device bytes [p, p + n) through the stand-in's private mapping, for the
// value engine's host work; NULL (and a report) if the range is not inside one live device
// allocation (an expandable segment's mapped chunks that are contiguous count as one).
void* standin_host_view(const void* p, size_t n);
// The engine announces itself; from then on a kernel launched while no engine op is computing
// (standin_values_enter/exit, per thread) marks the device memory its pointer arguments point
// into as unknown when it runs. `op` (a string that outlives the call) names the op computing:
// a device-to-host copy while one computes means that op's CUDA kernel reads device values the
// engine has not computed yet, and fails naming it.
void standin_values_engine(int on);
int standin_values_active(void);  // whether an engine announced itself
void standin_values_enter(const char* op);
void standin_values_exit(void);
int standin_values_computing(void);
// Marks [p, p + n) as unknown (1) or known (0): the engine's host work, in stream order.
void standin_values_mark(const void* p, size_t n, int unknown);
// Whether any byte of [p, p + n) is unknown.
int standin_values_unknown(const void* p, size_t n);
// Launches that no engine op computed, and the name of the last one ("" if none).
int64_t standin_values_uncomputed(char* last_name, size_t len);
// Counts and names (as the last uncomputed one) work the engine could not compute (an op with
// no host kernel).
void standin_values_note(const char* what);
// Attaches `fn(data)` to the last node the current engine op captured on `stream`, if that node
// is still the stream's last (run after the node's own work at every replay): 1 if attached; 0
// if not (the stream is not capturing, or the op captured nothing there), and the caller makes a
// host node instead.
int standin_values_attach(void* stream, void (*fn)(void*), void* data);
// The value mode's own host work as a host function on `stream` (cudaLaunchHostFunc, but allowed
// in a conditional node's body, which takes no host node of the program's: this one stands for
// the computation of the op's kernel, which a GPU runs inside the body).
int standin_launch_internal_host_func(void* stream, void (*fn)(void*),
                                      void* data);  // a cudaError_t

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include <cuda_runtime_api.h>

// The value mode's host work `fn(data)`, in stream order (Note [Stand-in values] in values.cpp),
// for the value engine and the cuBLAS stand-in alike. On a capturing stream `data` becomes the
// graph's (a user object that `destroy` frees with it) and `fn` travels with the current op's last
// captured node (standin_values_attach), or becomes a host node; otherwise `fn` runs as stream work
// and frees `data` itself. `*persistent` says which before `fn` can run.
inline cudaError_t standin_submit_host_work(cudaStream_t stream, cudaHostFn_t fn, void* data,
                                            cudaHostFn_t destroy, bool* persistent) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  if (cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr, nullptr) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    status = cudaStreamCaptureStatusNone;
  }
  *persistent = status == cudaStreamCaptureStatusActive;
  if (*persistent) {
    cudaUserObject_t obj = nullptr;
    if (cudaUserObjectCreate(&obj, data, destroy, 1, cudaUserObjectNoDestructorSync) ==
        cudaSuccess) {
      cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove);
    }
    if (standin_values_attach(stream, fn, data) == 1) return cudaSuccess;
  }
  return static_cast<cudaError_t>(standin_launch_internal_host_func(stream, fn, data));
}
#endif
