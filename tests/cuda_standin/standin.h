#pragma once

// The CUDA stand-in: a CUDA runtime (libcudart.so.13), driver (libcuda.so.1) and cuBLAS /
// cuBLASLt (libcublas.so.13, libcublasLt.so.13) for machines without a GPU, so that real torch
// runs its real CUDACachingAllocator, CUDAGraph and generators, and graphtrees' CUDA backend on
// them. It is a test tool: nothing of it ships with graphtrees. README.md in this folder says how
// it is built and run; each area's semantics are in a Note of its own file:
//   Note [Stand-in memory]            memory.cpp   host memory under a capacity, poisoned, that
//                                                  host code cannot touch
//   Note [Stand-in streams]           streams.cpp  queues, events, eager and deferred execution
//   Note [Stand-in handles]           state.cpp    a destroyed or unknown handle ends the process
//   Note [Stand-in captures]          capture.cpp  stream capture, its modes and its errors
//   Note [Stand-in graphs]            capture.cpp  graphs, replays, user objects
//   Note [Stand-in kernels]           kernels.cpp  registration and launches, never executed
//   Note [Stand-in driver]            driver.cpp   the driver API, virtual memory on mmap
//   Note [Stand-in cuBLAS]            cublas.cpp   handles, workspaces and GEMMs as kernels
//   Note [Unmodelled calls]           state.cpp    what the stand-in refuses, and how
//   Note [Stand-in conditional nodes] capture.cpp  IF / WHILE / SWITCH nodes, their handles, the
//                                                  kernel that sets one, their bodies' limits
//   Note [Stand-in values]            values.cpp   the value mode: an engine (its own library)
//                                                  computes each aten op on the host, in stream
//                                                  order; unknown values
//
// Everything below is internal to libcudart.so.13; the other libraries reach it through the
// exported standin_* functions (standin_api.h).

#include <cuda_runtime_api.h>

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "standin_api.h"

namespace standin {

// ---- configuration (environment, read once) ------------------------------------------------
struct Config {
  size_t capacity;  // CUDA_STANDIN_MEMORY: device bytes, e.g. "8G" (default 16G)
  int poison;       // CUDA_STANDIN_POISON: byte new memory is filled with; -1: "off"
  bool deferred;    // CUDA_STANDIN_DEFERRED=1: streams run at synchronisation points
  bool trace;       // CUDA_STANDIN_TRACE=1: every modelled call on stderr
  bool quiet;       // CUDA_STANDIN_QUIET=1: no error reports on stderr
  // CUDA_STANDIN_HOST_ACCESS=1 (debugging): host code may read and write device memory; by
  // default it faults as on a GPU (Note [Stand-in memory]).
  bool host_access;
  // CUDA_STANDIN_HANDLE_ERRORS=1 (debugging): a destroyed or unknown handle fails the call; by
  // default it ends the process (Note [Stand-in handles]).
  bool handle_errors;
};
Config& config();

// ---- the one lock ------------------------------------------------------------------------------
// One recursive mutex guards all state. Callbacks that may call back into Python (user-object
// destructors) are queued with afterUnlock() and run once the outermost Lock is released.
class Lock {
 public:
  Lock();
  ~Lock();
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
};
void afterUnlock(std::function<void()> fn);
// Runs `fn` with the calling thread's hold on the lock released (all levels of it), then takes it
// back: how host functions and host nodes run, as a driver runs them on its own thread without
// an API lock (a host function may wait for the GIL that another thread, waiting for the
// stand-in, holds).
void runUnlocked(const std::function<void()>& fn);

// ---- errors and reports ----------------------------------------------------------------------
// Records `e` as the calling thread's last error and returns it (cudaSuccess leaves it alone).
cudaError_t setError(cudaError_t e);
// Reports why a call failed (stderr, unless quiet; kept for standin_last_message) and returns e.
cudaError_t fail(cudaError_t e, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void trace(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// A device-side fault (a graph node or a queued copy touching memory that is no longer
// allocated): sticky, as on a GPU, until standin_clear_sticky_error().
void deviceFault(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
cudaError_t stickyError();
// The error standin_fail_next() armed for `call` (consumed), or cudaSuccess.
cudaError_t injectedFailure(const char* call);
const char* errorName(cudaError_t e);
const char* errorString(cudaError_t e);
StandinStats& stats();

// ---- handles ---------------------------------------------------------------------------------
enum class HandleKind { kStream, kEvent, kGraph, kGraphExec };
// Records that `handle` was destroyed by `by` (a handle is never freed, so never reused).
void retireHandle(const void* handle, HandleKind kind, const char* by);
// `call` was given a handle of `kind` that is not live: ends the process naming the call, the
// handle and whether it was destroyed or never created (Note [Stand-in handles]); returns only
// with CUDA_STANDIN_HANDLE_ERRORS=1, after reporting it, for the call to fail.
void badHandle(const char* call, HandleKind kind, const void* handle);

// ---- memory ----------------------------------------------------------------------------------
enum class MemKind { kDevice, kSymbol, kMapped, kPinned, kRegistered };
struct Allocation {
  uintptr_t base = 0;
  size_t size = 0;
  MemKind kind = MemKind::kDevice;
  // Where the stand-in itself reads and writes the allocation's bytes: a second mapping of the
  // same pages for device memory (whose own addresses the host cannot touch), base for host
  // memory (Note [Stand-in memory]).
  uintptr_t view = 0;
};
// The live allocation that contains address p, or nullptr (callers check the extent).
const Allocation* findAllocation(const void* p);
inline bool isDeviceKind(MemKind k) {
  return k == MemKind::kDevice || k == MemKind::kSymbol || k == MemKind::kMapped;
}
// Whether [p, p + n) lies in device memory (a live device, symbol or mapped allocation).
bool isDeviceRange(const void* p, size_t n);
// Whether p is in page-locked host memory (cudaHostAlloc or cudaHostRegister).
bool isPinned(const void* p, size_t n);
// One device: its properties and attributes (state.cpp), for the runtime and the driver.
void fillProperties(cudaDeviceProp* p);
// The driver's CUDA version, as cudaDriverGetVersion says it (CUDA_STANDIN_DRIVER_VERSION, default
// 13000): an older one shows what a driver without conditional nodes does.
int driverVersion();
bool deviceAttribute(int attr, int* value);
int currentDevice();
cudaError_t memsetD32(void* p, unsigned value, size_t count, cudaStream_t stream, const char* call);
// `view`: the stand-in's own address of the bytes at `base` (0: base itself).
void registerAllocation(uintptr_t base, size_t size, MemKind kind, uintptr_t view = 0);
// The address at which the stand-in moves the bytes at p: p's place in its allocation's view,
// or p itself (host memory the stand-in does not know).
void* hostView(const void* p);
void unregisterAllocation(uintptr_t base);
// Bytes of device memory in use, counted against the capacity; reserve() fails past it.
bool reserveDeviceBytes(size_t n);
void releaseDeviceBytes(size_t n);
void poison(void* p, size_t n);

// ---- streams ---------------------------------------------------------------------------------
struct Capture;

// A unit of work in a stream's queue (Note [Stand-in streams]).
struct Op {
  uint64_t seq = 0;
  const char* what = "";
  std::vector<std::pair<CUstream_st*, uint64_t>> waits;  // run those streams up to seq first
  std::function<void()> run;
};

}  // namespace standin

struct CUstream_st {
  uint64_t id = 0;
  unsigned flags = 0;  // cudaStreamNonBlocking
  int priority = 0;
  bool legacy = false;
  bool per_thread = false;
  bool alive = true;
  // Deferred execution: the ops not yet run, in order; every op with seq <= done_seq has run.
  std::vector<standin::Op> queue;
  size_t queue_head = 0;
  uint64_t next_seq = 1;
  uint64_t done_seq = 0;
  // Stream capture: the capture this stream takes part in, and its current dependency set.
  standin::Capture* capture = nullptr;
  std::vector<CUgraphNode_st*> deps;
  std::vector<cudaGraphEdgeData> dep_edges;  // zeroed, as many as deps (GetCaptureInfo)
};

struct CUevent_st {
  unsigned flags = 0;
  bool alive = true;
  CUstream_st* stream = nullptr;  // the stream of its last record; nullptr: never recorded
  uint64_t seq = 0;               // complete once stream->done_seq >= seq
  double time_ms = 0;             // when the record ran (cudaEventElapsedTime)
  // A record inside a capture: the capture and the dependency set at that point.
  standin::Capture* capture = nullptr;
  std::vector<CUgraphNode_st*> capture_deps;
};

namespace standin {

CUstream_st* legacyStream();
// Resolves a handle (0, cudaStreamLegacy, cudaStreamPerThread or a created stream) that `call`
// was given; a destroyed or unknown one is badHandle(), and nullptr if that returns.
CUstream_st* resolveStream(cudaStream_t s, const char* call);
// Adds `op` to the stream's queue with the stream's implicit dependencies (the legacy stream's
// synchronisation with blocking streams); in eager mode it runs at once. Returns its seq.
uint64_t enqueue(CUstream_st* s, const char* what, std::function<void()> run,
                 std::vector<std::pair<CUstream_st*, uint64_t>> waits = {});
// Runs the stream's queue up to and including `seq` (everything it depends on first).
void runUpTo(CUstream_st* s, uint64_t seq);
void runStream(CUstream_st* s);  // its whole queue
void runAll();                   // every stream: the device is idle afterwards
double nowMs();

// ---- captures --------------------------------------------------------------------------------
struct Capture {
  uint64_t id = 0;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  CUstream_st* origin = nullptr;
  std::thread::id thread;
  CUgraph_st* graph = nullptr;
  bool owns_graph = true;  // false: cudaStreamBeginCaptureToGraph
  bool active = true;      // false once EndCapture ended it (the object stays: events name it)
  bool invalidated = false;
  std::string why;  // the first call that invalidated it
  std::vector<CUstream_st*> streams;
};
// Invalidates the capture (the first reason is kept; it is reported at EndCapture).
void invalidate(Capture* c, const std::string& why);
// A call the capture rules call "potentially unsafe" (Note [Stand-in captures]): returns
// cudaErrorStreamCaptureUnsupported and invalidates the capture that forbids it, or cudaSuccess.
cudaError_t checkUnsafe(const char* call);
// Whether any capture is under way on the device, from any thread.
bool anyCapture();
void invalidateAll(const std::string& why);
// For work submitted to `s`: cudaSuccess, or the error a capture state makes it fail with.
// `*captured` is set when the work must become a node of s's capture instead of running.
cudaError_t captureCheck(CUstream_st* s, const char* call, bool* captured);
enum class NodeKind { kKernel, kMemcpy, kMemset, kHost, kEventRecord, kEmpty, kConditional };
struct NodeData {
  NodeKind kind = NodeKind::kEmpty;
  std::string name;  // kernel name, or what made the node
  dim3 grid{1, 1, 1}, block{1, 1, 1};
  size_t shmem = 0;
  // memcpy (2D: rows of `width` bytes with pitches) / memset (rows of width elements)
  void* dst = nullptr;
  const void* src = nullptr;
  // Which sides were device or pinned memory when the work was submitted: they must still be
  // allocated when it runs (a replay long after the capture, or a queued copy).
  bool dst_known = false, src_known = false;
  size_t width = 0, height = 1, dpitch = 0, spitch = 0;
  unsigned value = 0;
  unsigned elem = 1;  // memset element size: 1, 2 or 4 bytes
  // A device copy or memset made by an op's own CUDA kernel while the value engine computes that
  // op (Note [Stand-in values] in values.cpp): its bytes are the op's to compute, so it moves
  // none -- an in-place op whose kernel copied into its input first would otherwise be computed
  // from what that copy left (found by the OpInfo sweep: mvlgamma_).
  bool op_computes = false;
  cudaHostFn_t fn = nullptr;
  void* user_data = nullptr;
  CUevent_st* event = nullptr;
  // A kernel that no value engine op computes (Note [Stand-in values] in values.cpp): the device
  // ranges its pointer arguments point into, marked unknown each time it runs.
  std::shared_ptr<const std::vector<std::pair<uintptr_t, size_t>>> unknown;
  // The value engine's computation of the op that captured this node, its last on the stream
  // (standin_values_attach): run right after the node's own work, so that it sits wherever the
  // op's kernel sits -- a conditional body, say, which takes no host node.
  cudaHostFn_t then_fn = nullptr;
  void* then_data = nullptr;
  // A host node of the value engine's own (standin_launch_internal_host_func): allowed in a
  // conditional body, which takes no host node of the program's.
  bool internal = false;
  // Note [Stand-in conditional nodes]. A kernel that sets a conditional handle: the handle, and
  // the device byte whose value (non-zero: 1) it sets, read when the kernel runs.
  uint64_t sets_handle = 0;
  const void* predicate = nullptr;
  // A conditional node: its handle, type and body graphs (the template's, owned by the node), and
  // once instantiated the bodies' nodes.
  uint64_t cond_handle = 0;
  cudaGraphConditionalNodeType cond_type = cudaGraphCondTypeIf;
  std::vector<CUgraph_st*> bodies;
  std::vector<std::shared_ptr<const std::vector<NodeData>>> body_nodes;
};
// Note [Stand-in conditional nodes]: a handle's value, as the last kernel that set it left it (or
// its default), and the limit on a WHILE node's iterations (CUDA_STANDIN_WHILE_LIMIT).
unsigned conditionalValue(uint64_t handle);
void setConditionalValue(uint64_t handle, unsigned value);
int64_t whileLimit();
// Adds a node to s's capture after its current dependencies; they become {node}.
CUgraphNode_st* addCaptureNode(CUstream_st* s, NodeData data);
// Runs one node's work now (a replay, or a queued op); reports faults as device faults.
void executeNode(const NodeData& n, const char* where);
// The value mode: the last node an engine op (standin_values_enter) captured on this thread, and
// its stream; noted by addCaptureNode, forgotten when the next op begins.
void noteValuesNode(CUstream_st* s, CUgraphNode_st* node);
CUgraphNode_st* valuesNode(CUstream_st* s);

// ---- kernels ---------------------------------------------------------------------------------
// Validates a launch and submits it to `stream` (a capture node or a queued no-op).
// `params`: the kernel's argument pointers (cudaLaunchKernel's args, cuLaunchKernel's
// kernelParams), read only for the value mode's coverage check; nullptr if unknown.
cudaError_t launch(const char* name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                   const void* func_key, void** params = nullptr);
const char* kernelName(const void* host_fun);
void resetLaunchCounts();

// ---- the value mode (Note [Stand-in values] in values.cpp) -----------------------------------
// Whether a value engine registered itself (standin_values_engine): only then is a launch that
// no engine op computes marked unknown.
bool valuesEngine();
// Whether the calling thread is inside an engine op (standin_values_enter/exit), and its name.
bool valuesComputing();
const char* valuesOp();
// Unknown-value bookkeeping of device bytes (its own mutex; callable without the lock).
void markUnknown(uintptr_t p, size_t n);
void markKnown(uintptr_t p, size_t n);
bool anyUnknown(uintptr_t p, size_t n);
// The device ranges that a kernel's pointer arguments point into (from each pointer to the end of
// its allocation: the extent a kernel writes is not known), read without faulting.
std::vector<std::pair<uintptr_t, size_t>> pointerArgRanges(void** params);
void noteUncomputedLaunch(const char* name);

// ---- helpers ---------------------------------------------------------------------------------
std::string hex(const void* p);

}  // namespace standin

// Opaque handles the headers only declare.
struct CUgraphNode_st {
  standin::NodeData data;
  std::vector<CUgraphNode_st*> deps;
  CUgraph_st* graph = nullptr;
  size_t index = 0;
};
struct CUgraph_st {
  std::vector<std::unique_ptr<CUgraphNode_st>> nodes;
  std::vector<std::pair<CUuserObject_st*, unsigned>> user_objects;
  bool capturing = false;
  // A conditional node's body (Note [Stand-in conditional nodes]): owned by that node, it takes
  // kernels, copies, memsets, empty nodes and conditional nodes only.
  CUgraphNode_st* body_of = nullptr;
};
struct CUgraphExec_st {
  // In creation order, a topological order; shared with the launches still queued.
  std::shared_ptr<const std::vector<standin::NodeData>> nodes;
  std::vector<std::pair<CUuserObject_st*, unsigned>> user_objects;
  uint64_t launches = 0;
  // The conditional handles put back to their defaults at each launch (cudaGraphCondAssignDefault).
  std::vector<std::pair<uint64_t, unsigned>> conditional_defaults;
};
struct CUuserObject_st {
  void* ptr = nullptr;
  cudaHostFn_t destroy = nullptr;
  long refs = 0;
};
