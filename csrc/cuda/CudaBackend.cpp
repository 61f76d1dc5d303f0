#include "cuda/CudaBackend.h"

#include "FailureInjection.h"
#include "Logging.h"
#include "PythonHooks.h"
#include "ThreadState.h"
#include "cuda/ConditionalNodes.h"
#include "cuda/CudaGraph.h"
#include "cuda/DeviceLock.h"
#include "cuda/InputCopies.h"
#include "cuda/MemoryLimit.h"
#include "cuda/PoolLayout.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <unordered_set>
#include <utility>

// torch >= 2.14's CUDAGraph ends the allocator routing and releases the pool itself when a
// capture fails; 2.11 (the GPU machine's) and 2.13 do neither.
#define GRAPHTREES_CAPTURE_END_CLEANS_UP \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14))

// Declared in <ATen/cuda/CUDAContextLight.h>, which also pulls in the cuBLAS/cuSPARSE headers that
// a CUDA toolkit without those libraries lacks; the function is exported by libtorch_cuda.
namespace at::cuda {
void clearCublasWorkspaces();
}  // namespace at::cuda

namespace graphtrees {

namespace CCA = c10::cuda::CUDACachingAllocator;

namespace {

class CudaCheckpoint final : public Checkpoint {
 public:
  CudaCheckpoint(std::shared_ptr<CCA::AllocatorState> state, std::vector<uintptr_t> segments)
      : state_(std::move(state)), segments_(std::move(segments)) {}
  std::shared_ptr<CCA::AllocatorState> state_;
  std::vector<uintptr_t> segments_;  // base addresses: a restore needs each of them to exist
};

// Runs `f`, keeping the first error's message in `*error` instead of throwing.
template <typename F>
void collectError(std::string* error, const char* what, F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    if (error->empty()) *error = std::string(what) + ": " + e.what_without_backtrace();
  } catch (const std::exception& e) {
    if (error->empty()) *error = std::string(what) + ": " + e.what();
  }
}

// A message without c10's C++ stack trace (TORCH_SHOW_CPP_STACKTRACES=1 appends one to what()).
std::string messageOf(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

std::string messageOf(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

at::HostAllocator* hostAllocator() {
  return at::getHostAllocator(at::kCUDA);
}

}  // namespace

CudaBackend::CudaBackend(c10::Device device)
    : device_(device),
      pool_(at::cuda::graph_pool_handle()),
      streams_(device.index()),
      stream_(streams_.stream()),
      limit_(device.index()) {
  c10::cuda::CUDAGuard guard(device_.index());
  // The tree holds one reference to its pool for its whole life, in both allocators. The host
  // allocator creates a pool's record at its first routing, with one reference, and every capture
  // and graph reset takes and drops one more: without a reference of the tree's own, the count
  // would reach 0 when a tree's first capture is rejected or its last graph is evicted, and torch
  // 2.11 then refuses every later capture into the pool (its create_or_incref assert).
  CCA::createOrIncrefPool(device_.index(), pool_);
  pool_alive_ = true;
  try {
    hostAllocator()->begin_allocate_to_pool(pool_, [](c10::Stream) { return false; });
    hostAllocator()->end_allocate_to_pool(pool_);
  } catch (...) {
    pool_alive_ = false;
    CCA::releasePool(device_.index(), pool_);
    throw;
  }
}

CudaBackend::~CudaBackend() {
  try {
    releasePool();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning,
                   std::string("releasing the CUDA pool failed: ") + messageOf(e));
  }
}

// Note [Streams of the pool] in PoolStreams.cpp.
void CudaBackend::beginCall() {
  streams_.beginCall();
}

void CudaBackend::endCall() {
  streams_.endCall();
}

// Releases first and synchronises last, so that an asynchronous error of earlier work (a
// device-side assert, an illegal access) cannot keep the pool alive: the error is thrown after the
// pool is gone.
void CudaBackend::releasePool() {
  if (!pool_alive_) return;
  pool_alive_ = false;
  segments_.clear();
  DeviceLock lock(device_.index());  // emptyCache() asserts that no capture is under way
  c10::cuda::CUDAGuard guard(device_.index());
  std::string error;
  collectError(&error, "releasePool", [&] { CCA::releasePool(device_.index(), pool_); });
  collectError(&error, "release the host pool", [&] { hostAllocator()->release_pool(pool_); });
  // At use count 0 the pool is only "freeable": its segments stay reserved until emptyCache()
  // (never while any capture or routing is under way). Hand them back now, and the host pool's
  // record and pinned blocks with them. A pool that a failed restore left inconsistent keeps
  // blocks the allocator thinks are allocated: those stay.
  collectError(&error, "emptyCache", [&] { CCA::emptyCache(pool_); });
  collectError(&error, "empty the host cache", [&] { hostAllocator()->empty_cache(); });
  collectError(&error, "synchronize", [&] {
    streams_.join();
    streams_.sync();
  });
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kReleasePool),
              "graphtrees: injected failure after releasing the CUDA pool");
  TORCH_CHECK(error.empty(), "graphtrees: releasing the pool of the ", device_, " tree: ", error,
              poisoned_ ? " (the pool was left inconsistent by a failed restore; its blocks stay "
                          "reserved for the life of the process)"
                        : "");
}

// Note [Routing, undone on failure]
// The steps that can fail come first (the lock, the waits), and each step that succeeded is
// undone when a later one throws: a half-begun routing would route every later allocation of this
// thread into the pool, keep the stream switched and leak the pool reference c10 took.
void CudaBackend::beginAllocateToPool() {
  // Note [One allocation phase per device]; endAllocateToPool() unlocks.
  DeviceLock::lock(device_.index());
  bool routed = false;
  try {
    c10::cuda::CUDAGuard guard(device_.index());
    // The tree's stream starts after the caller's work and the pool's last use.
    streams_.join();
    at::cuda::clearCublasWorkspaces();  // so that a workspace is not created inside the pool
    const auto tid = std::this_thread::get_id();
    const int uses_before = CCA::getPoolUseCount(device_.index(), pool_);
    try {
      CCA::beginAllocateToPool(device_.index(), pool_,
                               [tid](cudaStream_t) { return std::this_thread::get_id() == tid; });
    } catch (...) {
      // c10 increfs before it checks that the pool is not routed already.
      for (int u = CCA::getPoolUseCount(device_.index(), pool_); u > uses_before; --u) {
        CCA::releasePool(device_.index(), pool_);
      }
      throw;
    }
    routed = true;
    limit_.apply(stats().reserved_bytes);  // Note [Memory budget] in Backend.h
  } catch (...) {
    if (routed) {
      std::string ignored;
      collectError(&ignored, "", [&] { limit_.lift(); });
      collectError(&ignored, "", [&] { CCA::endAllocateToPool(device_.index(), pool_); });
      collectError(&ignored, "", [&] { CCA::releasePool(device_.index(), pool_); });
    }
    DeviceLock::unlock(device_.index());
    throw;
  }
  routing_locks_++;
  // User code run while routed (a warmup) runs on the tree's device and stream, so that tensors
  // made with a bare "cuda" device land in this pool.
  routing_device_.set_index(device_.index());
  saved_stream_ = c10::cuda::getCurrentCUDAStream(device_.index());
  c10::cuda::setCurrentCUDAStream(stream_);
}

void CudaBackend::endAllocateToPool() {
  std::string error;
  // Un-route first: nothing below may leave this thread routed into the pool.
  collectError(&error, "setMemoryFraction", [&] { limit_.lift(); });
  if (saved_stream_) {
    c10::cuda::setCurrentCUDAStream(*saved_stream_);
    saved_stream_.reset();
  }
  {
    c10::cuda::CUDAGuard guard(device_.index());
    collectError(&error, "endAllocateToPool",
                 [&] { CCA::endAllocateToPool(device_.index(), pool_); });
    // Balances beginAllocateToPool's incref.
    collectError(&error, "releasePool", [&] { CCA::releasePool(device_.index(), pool_); });
    collectError(&error, "clearCublasWorkspaces", [] { at::cuda::clearCublasWorkspaces(); });
    // Synchronise last: the caller's stream sees the results, and an asynchronous error of the
    // routed work surfaces here, as an exception of this call.
    collectError(&error, "synchronize", [&] { streams_.sync(); });
    collectError(&error, "snapshot", [&] { refreshSegments(); });
  }
  routing_device_.reset();
  if (routing_locks_ > 0) {
    routing_locks_--;
    DeviceLock::unlock(device_.index());
  }
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kEndAllocate),
              "graphtrees: injected failure after ending the routing into the CUDA pool");
  TORCH_CHECK(error.empty(), "graphtrees: ending the routing into the pool of the ", device_,
              " tree: ", error);
}

// Note [Locks around user code] in DeviceLock.h: the routing is this thread's own.
std::vector<at::Tensor> CudaBackend::runRouted(const RunFn& run,
                                               const std::vector<at::Tensor>& ins) {
  if (limit_.capped()) {  // not lent (Note [Memory budget] above MemoryLimit): held as a capture's
    DeviceLock::CapturingUserCode held(device_.index());
    return run(ins);
  }
  // Not the capture gate (Note [Random numbers while a graph is captured]): a capture would wait
  // for this code, which may wait for that capture.
  DeviceLock::Lent lent(device_.index());
  return run(ins);
}

std::string CudaBackend::capturingElsewhere() const {
  if (!DeviceLock::capturingUserCodeElsewhere(device_.index())) return std::string();
  return "it was called while another thread's capture (or budgeted warmup) on " + device_.str() +
         " ran user code (a thread it starts and joins, say) and held the device";
}

std::string CudaBackend::awaitCapturesElsewhere() {
  if (!DeviceLock::awaitCaptureElsewhere(device_.index(), kCapturePatience)) return std::string();
  std::string why = capturingElsewhere();  // empty if the capture's code returned just now
  return why.empty() ? why : why + " (waited " + std::to_string(kCapturePatience.count()) + " ms)";
}

// Note [Rejected captures on CUDA]
// A capture fails when the function does something a stream capture forbids. Two kinds:
//   - the stream capture is invalidated: a host sync (.item(), printing, x[mask], nonzero) or an
//     unjoined side stream; the forbidden call raises inside the user's code (usually "operation
//     not permitted when stream is capturing") and cudaStreamEndCapture fails too;
//   - torch refuses the call with a check before any CUDA call (torch 2.11: .tolist(), .cpu(),
//     pageable host-to-device copies, an unregistered generator): the capture stays valid.
// The first is undone here and thrown as CaptureRejected; the second ends the capture normally
// and rethrows the user's error, which the tree takes for a rejected capture too (Note [Errors
// during a capture] in TreeManager.h). A function that changed the current stream or device
// and left it changed is rejected as well: its later work ran outside the capture.
// Either way the cuBLAS workspaces are cleared once the capture is over, as after a capture that
// is kept: c10 makes a handle's workspace at its first GEMM on a stream and keeps it in a map for
// the life of the process, so one made on the tree's stream during the capture is a pool block
// that nothing of the tree owns (found on the CUDA stand-in: Mixtral's capture, refused by torch
// 2.11 at a pageable host-to-device copy after its first matmul, left a 32 MiB workspace in the
// pool).
// Undoing a capture: on torch 2.11 and 2.13 CUDAGraph::capture_end() throws *before* it ends the
// allocator routing, and the graph's destructor releases the pool only after a capture that
// ended. So abandonCapture() ends a stream capture that is still under way, takes the
// generators out of capture mode (Note [Generators and captures] in CudaGraph.cpp), destroys the
// graph, ends both routings (an error saying they were already ended, as torch 2.14 does itself, is
// ignored), brings the device pool's use count back to what it was before capture_begin(), and on
// torch < 2.14 releases the host pool's reference -- unless capture_end() had marked the capture
// ended (an instantiation that failed), in which case the graph's reset released it.
void CudaBackend::abandonCapture(std::unique_ptr<TreeGraph> graph, int uses_before,
                                 bool host_routed) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_.stream(), &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t zombie = nullptr;
    (void)cudaStreamEndCapture(stream_.stream(), &zombie);
    if (zombie != nullptr) (void)cudaGraphDestroy(zombie);
  }
  (void)cudaGetLastError();  // the capture error is not sticky; do not leave it for others
  graph->leaveGeneratorCaptures();
  const bool graph_releases_host_pool = graph->captureEnded();
  // Both routings end before the graph goes: their filters read the graph (review 4, #9).
  std::string ignored;
  collectError(&ignored, "", [&] { CCA::endAllocateToPool(device_.index(), pool_); });
  collectError(&ignored, "", [&] { hostAllocator()->end_allocate_to_pool(pool_); });
  graph.reset();
  int uses = uses_before;
  collectError(&ignored, "", [&] { uses = CCA::getPoolUseCount(device_.index(), pool_); });
  for (; uses > uses_before; --uses) {
    collectError(&ignored, "", [&] { CCA::releasePool(device_.index(), pool_); });
  }
#if !GRAPHTREES_CAPTURE_END_CLEANS_UP
  if (host_routed && !graph_releases_host_pool) {
    collectError(&ignored, "", [&] { hostAllocator()->release_pool(pool_); });
  }
#else
  (void)host_routed;
  (void)graph_releases_host_pool;
#endif
  collectError(&ignored, "", [] { at::cuda::clearCublasWorkspaces(); });
  collectError(&ignored, "", [&] { refreshSegments(); });
}

std::unique_ptr<Graph> CudaBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor>* outputs,
                                            const CaptureSpec& spec) {
  const std::string& function_name = spec.function_name;
  DeviceLock lock(device_.index());  // Note [One allocation phase per device]
  c10::cuda::CUDAGuard guard(device_.index());
  streams_.join();  // Note [Streams of the pool]
  at::cuda::clearCublasWorkspaces();
  // Blocks allocated before the capture (PoolLayout::footprintSince).
  const auto allocated_before = layout().allocated();
  const int uses_before = CCA::getPoolUseCount(device_.index(), pool_);
  auto graph = std::make_unique<TreeGraph>();
  graph->registerGenerators(spec.generators, device_.index());  // Note [Generators and captures]
  std::exception_ptr user_error;
  std::string rejected;
  {
    c10::cuda::CUDAStreamGuard stream_guard(stream_);
    // Note [Memory budget] in Backend.h: the cap holds while the capture allocates.
    MemoryLimit::Scope limit_scope(limit_);
    limit_.apply(stats().reserved_bytes);
    // Note [Random numbers while a graph is captured] in DeviceLock.h.
    CaptureGate gate(device_.index(), /*exclusive=*/true);
    try {
      graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    } catch (const c10::OutOfMemoryError&) {
      // The generators' seed and offset tensors did not fit: the tree's out-of-memory path.
      abandonCapture(std::move(graph), uses_before, /*host_routed=*/false);
      throw;
    } catch (const std::exception& e) {
      const std::string why = messageOf(e);
      abandonCapture(std::move(graph), uses_before, /*host_routed=*/false);
      throw CaptureRejected("starting the CUDA graph capture failed: " + why);
    }
    bool injected = false;
    try {
      DeviceCaptureScope no_frees;  // Note [Freeing during a capture] in ThreadState.h
      DeviceLock::CapturingUserCode busy(device_.index());  // Note [Locks around user code]
      // Note [Conditional nodes on CUDA]: a body left open ends here, before capture_end().
      ConditionalNodes::CaptureScope conditionals(device_.index(), pool_);
      *outputs = run(inputs);
      if (consumeInjectedFailure(FailurePoint::kCaptureEnd)) {
        // A real invalidation: querying a capturing stream is forbidden during a capture.
        injected = true;
        (void)cudaStreamQuery(stream_.stream());
        (void)cudaGetLastError();
      }
    } catch (...) {
      user_error = std::current_exception();
    }
    // The function may have switched the current stream or device and left it so: its work from
    // then on ran outside the capture, and capture_end() must run on the capture's stream.
    if (c10::cuda::current_device() != device_.index()) c10::cuda::set_device(device_.index());
    if (c10::cuda::getCurrentCUDAStream(device_.index()) != stream_) {
      if (!user_error) {
        rejected =
            "the function changed the current CUDA stream and did not restore it, so its "
            "later work ran outside the capture (join side streams with wait_stream and "
            "restore the stream, e.g. with torch.cuda.stream(s): ...)";
      }
      c10::cuda::setCurrentCUDAStream(stream_);
    }
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_.stream(), &status) != cudaSuccess ||
        status == cudaStreamCaptureStatusInvalidated) {
      rejected = user_error ? messageOf(user_error) : "the stream capture was invalidated";
    }
    if (injected && rejected.empty()) rejected = "injected failure at the end of the capture";
    // A capture that ended but is not kept: the graph goes, and so does the cuBLAS workspace that
    // its first GEMM on the tree's stream made inside the pool (Note [Rejected captures on CUDA]).
    auto discard_ended_capture = [&] {
      // Note [Conditional nodes on CUDA]: the pool references torch's bodies kept go with it.
      destroyGraph(std::move(graph), device_.index(), pool_,
                   CCA::getPoolUseCount(device_.index(), pool_) - uses_before);
      std::string ignored;
      collectError(&ignored, "", [] { at::cuda::clearCublasWorkspaces(); });
      refreshSegments();
    };
    bool ended = true;
    try {
      graph->capture_end();
    } catch (const std::exception& e) {
      ended = false;
      if (rejected.empty()) rejected = user_error ? messageOf(user_error) : messageOf(e);
    }
    if (ended && rejected.empty() && user_error) {
      // An error with the capture intact (a check torch makes before any CUDA call): the graph
      // cleans up after itself, and the tree decides (Note [Errors during a capture]).
      outputs->clear();
      discard_ended_capture();
      std::rethrow_exception(user_error);
    }
    if (!rejected.empty()) {
      outputs->clear();
      (void)cudaGetLastError();  // capture errors are not sticky; leave none for later checks
      if (ended) {
        discard_ended_capture();
      } else {
        abandonCapture(std::move(graph), uses_before, /*host_routed=*/true);
      }
      throw CaptureRejected("CUDA rejected the capture of '" + function_name + "': " + rejected +
                            ". A CUDA graph cannot record host synchronisation (.item(), "
                            "bool(tensor), .cpu(), printing), data-dependent shapes (x[mask], "
                            "nonzero) or unjoined side streams");
    }
    graph->replay();  // the recording's outputs hold real values from here on
  }
  streams_.sync();
  at::cuda::clearCublasWorkspaces();
  refreshSegments();
  std::vector<Interval> footprint = layout().footprintSince(allocated_before, inputs, *outputs);
  const int pool_refs = CCA::getPoolUseCount(device_.index(), pool_) - uses_before;
  return std::make_unique<CudaGraph>(std::move(graph), std::move(footprint), device_.index(),
                                     ConditionalNodes::take(), pool_, pool_refs);
}

void CudaBackend::copyInputs(const std::vector<at::Tensor>& dst,
                             const std::vector<at::Tensor>& src) {
  copyIntoPlaceholders(dst, src, device_.index());  // Note [Input copies of a replay]
}

std::shared_ptr<Checkpoint> CudaBackend::checkpoint() {
  DeviceLock lock(device_.index());
  c10::cuda::CUDAGuard guard(device_.index());
  streams_.join();
  streams_.sync();
  // c10 refuses to checkpoint a block with pending events (a record_stream() on a pool tensor);
  // an allocation made with no routing active processes the completed ones. It is only needed
  // when events are pending, so a device too full for it skips it (review 4, #15).
  try {
    CCA::raw_delete(CCA::raw_alloc(1));
  } catch (const c10::OutOfMemoryError&) {
  }
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kCheckpoint),
              "graphtrees: injected failure while checkpointing the CUDA pool");
  // The layout is a value: a range-for over segments() of the temporary would read a vector
  // destroyed before the loop body (stack-use-after-scope, found by AddressSanitizer).
  const PoolLayout pool_layout = layout();
  std::vector<uintptr_t> bases;
  for (const auto& seg : pool_layout.segments()) bases.push_back(seg.range.begin);
  return std::make_shared<CudaCheckpoint>(CCA::getCheckpointState(device_.index(), pool_),
                                          std::move(bases));
}

// Note [Memory budget on CUDA]
// c10 returns a private pool's segments to the device only once the pool is "freeable" (nothing
// holds it: emptyCache(pool) walks those pools only). A live tree holds its pool, and so does every
// graph, so no segment of a live pool can be given back. Nor does evicting a recording make room
// inside the pool: in c10's view a node owns no block (its placeholders are non-owning views after
// the recording, its temporaries are free at its checkpoint, replayed outputs own nothing), so
// what eviction would free is free already (review 4, #4: on the stand-in, every out-of-memory
// call evicted one more recording and the pool's bytes never moved). The budget therefore caps
// the pool's growth, and a function that meets it runs eagerly, without eviction or retry,
// until the budget changes (returnsSegments() is false; Note [Out of memory] in TreeManager.h).
// Without a budget, a failed warmup or capture is tried once more after freeCachedMemory() gave
// the default pool's cached blocks back, which c10 does not do by itself while a pool is routed.
int64_t CudaBackend::releaseFreeSegments(const std::vector<const Checkpoint*>& /*keep*/) {
  return 0;
}

bool CudaBackend::freeCachedMemory() {
  DeviceLock lock(device_.index());
  c10::cuda::CUDAGuard guard(device_.index());
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t before = CCA::getDeviceStats(device_.index()).reserved_bytes[agg].current;
  try {
    CCA::emptyCache();  // the default pool: blocks cached by eager work
  } catch (const std::exception& e) {
    // A capture of the user's own is under way on the device.
    GRAPHTREES_LOG(LogLevel::kDebug, std::string("emptying the CUDA cache failed: ") + e.what());
    return false;
  }
  return CCA::getDeviceStats(device_.index()).reserved_bytes[agg].current < before;
}

RestoreResult CudaBackend::restore(const Checkpoint& checkpoint) {
  const auto* cp = dynamic_cast<const CudaCheckpoint*>(&checkpoint);
  TORCH_INTERNAL_ASSERT(cp != nullptr, "checkpoint of another backend");
  DeviceLock lock(device_.index());
  c10::cuda::CUDAGuard guard(device_.index());
  try {
    streams_.join();
    streams_.sync();  // setCheckpointPoolState needs every block's events done
  } catch (const std::exception& e) {
    throw RestoreError(std::string("synchronize: ") + messageOf(e), /*pool_unchanged=*/true);
  }
  if (consumeInjectedFailure(FailurePoint::kBackendRestore)) {
    throw RestoreError("injected failure before the restore changed the CUDA pool",
                       /*pool_unchanged=*/true);
  }
  CCA::CheckpointDelta delta;
  try {
    delta = CCA::setCheckpointPoolState(device_.index(), cp->state_);
  } catch (const std::exception& e) {
    // c10's restore frees every block, then re-creates the checkpoint's layout; a failure on the
    // way leaves blocks that no DataPtr will ever free (Note [Failed restores] in TreeManager).
    poisoned_ = true;
    refreshSegments();
    throw RestoreError(messageOf(e), /*pool_unchanged=*/false);
  }
  RestoreResult r;
  r.ptrs_freed = std::move(delta.ptrs_freed);
  r.dataptrs_allocd = std::move(delta.dataptrs_allocd);
  refreshSegments();
  return r;
}

void CudaBackend::freeBlock(void* ptr) {
  CCA::raw_delete(ptr);
}

c10::DeleterFnPtr CudaBackend::poolDeleter() const {
  return CCA::get()->raw_deleter();
}

bool CudaBackend::inPool(const void* ptr) const {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  return std::any_of(segments_.begin(), segments_.end(),
                     [p](const Interval& s) { return p >= s.begin && p < s.end; });
}

bool CudaBackend::checkLiveAllocations(const std::unordered_set<void*>& expected) {
  c10::cuda::CUDAGuard guard(device_.index());
  return CCA::checkPoolLiveAllocations(device_.index(), pool_, expected);
}

PoolLayout CudaBackend::layout() const {
  return PoolLayout::of(device_.index(), pool_);
}

void CudaBackend::refreshSegments() {
  segments_.clear();
  if (pool_alive_) segments_ = layout().ranges();
}

std::vector<void*> CudaBackend::allocatedBlocks() {
  return layout().allocatedBlocks();
}

PoolStats CudaBackend::stats() {
  return pool_alive_ ? layout().stats() : PoolStats();
}

std::string cudaBackendDisabledReason() {
  const std::string allocator = CCA::name();
  if (allocator != "native") {
    return "the CUDA caching allocator backend is '" + allocator +
           "' (PYTORCH_CUDA_ALLOC_CONF=backend:...); CUDA graph trees need the native caching "
           "allocator's private pools and checkpoints";
  }
  const char* enabled = std::getenv("GRAPHTREES_CUDA");
  if (enabled == nullptr || std::string(enabled) != "1") {
    return "the CUDA backend is compiled in but not yet verified on a GPU in this release; set "
           "GRAPHTREES_CUDA=1 to use it";
  }
  return "";
}

bool cudaCurrentStreamIsCapturing(c10::Device device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not) {
  *why_not = cudaBackendDisabledReason();
  if (!why_not->empty()) return nullptr;
  return std::make_unique<CudaBackend>(device);
}

}  // namespace graphtrees
