#include "cuda/CudaBackend.h"

#include "Logging.h"
#include "ProcessState.h"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/_foreach_copy.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cstdlib>
#include <set>
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

class CudaGraph final : public Graph {
 public:
  CudaGraph(std::unique_ptr<at::cuda::CUDAGraph> graph, std::vector<Interval> footprint)
      : graph_(std::move(graph)), footprint_(std::move(footprint)) {}

  // The addresses are baked into the graph: no Python runs, inputs are already in place.
  void replay(const RunFn& /*run*/, const std::vector<at::Tensor>& /*inputs*/,
              const std::vector<int64_t>& /*copied*/,
              const std::vector<at::Tensor>& /*placeholders*/) override {
    graph_->replay();
  }
  const std::vector<Interval>& footprint() const override { return footprint_; }

 private:
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  std::vector<Interval> footprint_;
};

bool samePool(const c10::cuda::MempoolId_t& a, const c10::cuda::MempoolId_t& b) {
  return a.first == b.first && a.second == b.second;
}

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

}  // namespace

CudaBackend::CudaBackend(c10::Device device)
    : device_(device),
      pool_(at::cuda::graph_pool_handle()),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
  c10::cuda::CUDAGuard guard(device_.index());
  // The tree holds one reference to its pool for its whole life.
  CCA::createOrIncrefPool(device_.index(), pool_);
  pool_alive_ = true;
}

CudaBackend::~CudaBackend() {
  try {
    releasePool();
  } catch (const std::exception& e) {
    logMessage(LogLevel::kWarning, std::string("releasing the CUDA pool failed: ") + e.what());
  }
}

// Releases first and synchronises last, so that an asynchronous error of earlier work (a
// device-side assert, an illegal access) cannot keep the pool alive: the error is thrown after the
// pool is gone.
void CudaBackend::releasePool() {
  if (!pool_alive_) return;
  pool_alive_ = false;
  segments_.clear();
  c10::cuda::CUDAGuard guard(device_.index());
  std::string error;
  collectError(&error, "releasePool", [&] { CCA::releasePool(device_.index(), pool_); });
  // At use count 0 the pool is only "freeable": its segments stay reserved until emptyCache()
  // (never while any capture or routing is under way). Hand them back now. A pool that a failed
  // restore left inconsistent keeps blocks the allocator thinks are allocated: those stay.
  collectError(&error, "emptyCache", [&] { CCA::emptyCache(pool_); });
  collectError(&error, "synchronize", [&] { c10::cuda::device_synchronize(); });
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kReleasePool),
              "graphtrees: injected failure after releasing the CUDA pool");
  TORCH_CHECK(error.empty(), "graphtrees: releasing the pool of the ", device_, " tree: ", error,
              poisoned_ ? " (the pool was left inconsistent by a failed restore; its blocks stay "
                          "reserved for the life of the process)"
                        : "");
}

void CudaBackend::beginAllocateToPool() {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();    // the tree's stream starts after the caller's work
  at::cuda::clearCublasWorkspaces();  // so that a workspace is not created inside the pool
  const auto tid = std::this_thread::get_id();
  CCA::beginAllocateToPool(device_.index(), pool_,
                           [tid](cudaStream_t) { return std::this_thread::get_id() == tid; });
  // User code run while routed (a warmup) runs on the tree's device and stream, so that tensors
  // made with a bare "cuda" device land in this pool.
  routing_device_.set_index(device_.index());
  saved_stream_ = c10::cuda::getCurrentCUDAStream(device_.index());
  c10::cuda::setCurrentCUDAStream(stream_);
  applyLimit();  // Note [Memory budget] in Backend.h
}

void CudaBackend::endAllocateToPool() {
  std::string error;
  // Un-route first: nothing below may leave this thread routed into the pool.
  collectError(&error, "setMemoryFraction", [&] { liftLimit(); });
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
    collectError(&error, "synchronize", [] { c10::cuda::device_synchronize(); });
    refreshSegments();
  }
  routing_device_.reset();
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kEndAllocate),
              "graphtrees: injected failure after ending the routing into the CUDA pool");
  TORCH_CHECK(error.empty(), "graphtrees: ending the routing into the pool of the ", device_,
              " tree: ", error);
}

// Note [Rejected captures on CUDA]
// A capture fails when the function does something a stream capture forbids: a host sync
// (.item(), .cpu(), printing, x[mask], nonzero), a pageable host-to-device copy, a side stream
// that is never joined. The forbidden call raises inside the user's code (usually "operation not
// permitted when stream is capturing") and the capture is invalidated; cudaStreamEndCapture then
// fails too. On torch 2.11 and 2.13 CUDAGraph::capture_end() throws at that point *before* it
// ends the allocator routing, and the graph's destructor releases the pool only after a capture
// that ended: the device and the host allocator would route this thread into the pool forever,
// each holding one more reference, and every later capture in the process would be affected.
// So a failed capture is undone here: the graph is destroyed, both routings are ended (an error
// saying they were already ended, as torch 2.14 does itself, is ignored), the device pool's use
// count is brought back to what it was before capture_begin(), and on torch < 2.14 the host
// pool's reference is released. The capture is rejected (CaptureRejected) when the stream was
// invalidated or capture_end() failed; an exception of the user's code with the capture still
// valid is the user's own error and is rethrown after the capture ended normally.
void CudaBackend::abandonCapture(std::unique_ptr<at::cuda::CUDAGraph> graph, int uses_before,
                                 bool host_routed) {
  graph.reset();
  (void)cudaGetLastError();  // the capture error is not sticky; do not leave it for others
  std::string ignored;
  collectError(&ignored, "", [&] { CCA::endAllocateToPool(device_.index(), pool_); });
  collectError(&ignored, "", [&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool_); });
  int uses = uses_before;
  collectError(&ignored, "", [&] { uses = CCA::getPoolUseCount(device_.index(), pool_); });
  for (; uses > uses_before; --uses) {
    collectError(&ignored, "", [&] { CCA::releasePool(device_.index(), pool_); });
  }
#if !GRAPHTREES_CAPTURE_END_CLEANS_UP
  if (host_routed) {
    collectError(&ignored, "", [&] { at::getHostAllocator(at::kCUDA)->release_pool(pool_); });
  }
#else
  (void)host_routed;
#endif
  collectError(&ignored, "", [] { at::cuda::clearCublasWorkspaces(); });
  refreshSegments();
}

std::unique_ptr<Graph> CudaBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor>* outputs,
                                            const std::string& function_name) {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
  // Blocks allocated before the capture: only those still allocated, at the same place and size,
  // after it (and not holding an output) are outside the capture's footprint.
  std::set<std::pair<uintptr_t, size_t>> allocated_before;
  for (const auto& seg : poolLayout()) {
    for (const auto& b : seg.second) {
      if (b.allocated) allocated_before.emplace(b.ptr, b.size);
    }
  }
  const int uses_before = CCA::getPoolUseCount(device_.index(), pool_);
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  std::exception_ptr user_error;
  std::string rejected;
  {
    c10::cuda::CUDAStreamGuard stream_guard(stream_);
    // Note [Memory budget] in Backend.h: the cap holds while the capture allocates.
    struct LimitScope {
      CudaBackend* backend;
      ~LimitScope() {
        try {
          backend->liftLimit();
        } catch (const std::exception& e) {
          logMessage(LogLevel::kWarning, std::string("restoring the memory fraction: ") + e.what());
        }
      }
    } limit_scope{this};
    applyLimit();
    try {
      graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    } catch (const std::exception& e) {
      const std::string why = e.what();
      abandonCapture(std::move(graph), uses_before, /*host_routed=*/false);
      throw CaptureRejected("starting the CUDA graph capture failed: " + why);
    }
    bool injected = false;
    try {
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
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_.stream(), &status) != cudaSuccess ||
        status == cudaStreamCaptureStatusInvalidated) {
      rejected = user_error ? messageOf(user_error) : "the stream capture was invalidated";
    }
    if (injected && rejected.empty()) rejected = "injected failure at the end of the capture";
    bool ended = true;
    try {
      graph->capture_end();
    } catch (const std::exception& e) {
      ended = false;
      if (rejected.empty()) rejected = user_error ? messageOf(user_error) : e.what();
    }
    if (ended && rejected.empty() && user_error) {
      // The user's own error, with the capture intact: the graph cleans up after itself.
      outputs->clear();
      graph.reset();
      std::rethrow_exception(user_error);
    }
    if (!rejected.empty()) {
      outputs->clear();
      (void)cudaGetLastError();  // capture errors are not sticky; leave none for later checks
      if (ended) {
        graph.reset();
        refreshSegments();
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
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
  refreshSegments();
  // Footprint: the pool's segments minus the blocks that the capture cannot have written.
  std::vector<Interval> output_ranges;
  for (const auto& o : *outputs) {
    const auto begin = reinterpret_cast<uintptr_t>(o.storage().data());
    if (begin != 0) output_ranges.push_back({begin, begin + o.storage().nbytes()});
  }
  std::vector<Interval> protected_blocks;
  for (const auto& seg : poolLayout()) {
    for (const auto& b : seg.second) {
      if (!b.allocated || !allocated_before.count({b.ptr, b.size})) continue;
      const bool holds_output =
          std::any_of(output_ranges.begin(), output_ranges.end(),
                      [&](const Interval& r) { return r.begin < b.ptr + b.size && r.end > b.ptr; });
      if (!holds_output) protected_blocks.push_back({b.ptr, b.ptr + b.size});
    }
  }
  mergeIntervals(&protected_blocks);
  std::vector<Interval> footprint;
  for (const auto& seg : segments_) {
    uintptr_t cursor = seg.begin;
    for (const auto& p : protected_blocks) {
      if (p.end <= seg.begin || p.begin >= seg.end) continue;
      if (p.begin > cursor) footprint.push_back({cursor, p.begin});
      cursor = std::max(cursor, p.end);
    }
    if (cursor < seg.end) footprint.push_back({cursor, seg.end});
  }
  mergeIntervals(&footprint);
  return std::make_unique<CudaGraph>(std::move(graph), std::move(footprint));
}

void CudaBackend::copyInputs(const std::vector<at::Tensor>& dst,
                             const std::vector<at::Tensor>& src) {
  if (dst.empty()) return;
  c10::cuda::CUDAGuard guard(device_.index());
  at::_foreach_copy_(dst, src);  // one batched launch on the caller's current stream
}

std::shared_ptr<Checkpoint> CudaBackend::checkpoint() {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kCheckpoint),
              "graphtrees: injected failure while checkpointing the CUDA pool");
  std::vector<uintptr_t> bases;
  for (const auto& seg : poolLayout()) bases.push_back(seg.first.begin);
  return std::make_shared<CudaCheckpoint>(CCA::getCheckpointState(device_.index(), pool_),
                                          std::move(bases));
}

void CudaBackend::setReservedLimit(int64_t bytes) {
  limit_ = bytes;
}

// c10 has no per-pool cap, only a per-process fraction of the device that bounds the bytes all
// pools reserve together. While this thread allocates into the pool, the fraction is lowered so
// that the device's other reservations may stay and this pool may grow up to the cap; c10 then
// fails the allocation with its out-of-memory error. Another thread allocating on the device in
// that window is bounded too (README "Memory budget").
void CudaBackend::applyLimit() {
  if (limit_ < 0 || saved_fraction_) return;
  const c10::DeviceIndex dev = device_.index();
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t device_reserved = CCA::getDeviceStats(dev).reserved_bytes[agg].current;
  const int64_t allowed = device_reserved - stats().reserved_bytes + limit_;
  saved_fraction_ = CCA::getMemoryFraction(dev);
  const double fraction = static_cast<double>(std::max<int64_t>(allowed, 0)) /
                          static_cast<double>(std::max<size_t>(total_bytes, 1));
  CCA::setMemoryFraction(std::min(fraction, *saved_fraction_), dev);
}

void CudaBackend::liftLimit() {
  if (!saved_fraction_) return;
  const double saved = *saved_fraction_;
  saved_fraction_.reset();
  CCA::setMemoryFraction(saved, device_.index());
}

int64_t CudaBackend::refusedBytes() const {
  return 0;  // c10's out-of-memory error does not say how much the pool lacked
}

// c10's emptyCache(pool) returns every free segment of the pool at once; it runs only when none
// of them is in a kept checkpoint (a restore fails on a segment that is gone).
int64_t CudaBackend::releaseFreeSegments(const std::vector<const Checkpoint*>& keep) {
  if (!pool_alive_) return 0;
  c10::cuda::CUDAGuard guard(device_.index());
  std::unordered_set<uintptr_t> kept;
  for (const Checkpoint* c : keep) {
    const auto* cp = dynamic_cast<const CudaCheckpoint*>(c);
    TORCH_INTERNAL_ASSERT(cp != nullptr, "checkpoint of another backend");
    kept.insert(cp->segments_.begin(), cp->segments_.end());
  }
  int64_t free_bytes = 0;
  for (const auto& seg : poolLayout()) {
    const bool all_free = std::none_of(seg.second.begin(), seg.second.end(),
                                       [](const Block& b) { return b.allocated; });
    if (!all_free) continue;
    if (kept.count(seg.first.begin)) return 0;
    free_bytes += static_cast<int64_t>(seg.first.end - seg.first.begin);
  }
  if (free_bytes == 0) return 0;
  const int64_t before = stats().reserved_bytes;
  try {
    c10::cuda::device_synchronize();
    CCA::emptyCache(pool_);  // asserts that no thread routes allocations on the device
  } catch (const std::exception& e) {
    logMessage(LogLevel::kDebug,
               std::string("returning free segments of the pool failed: ") + e.what());
  }
  refreshSegments();
  return before - stats().reserved_bytes;
}

RestoreResult CudaBackend::restore(const Checkpoint& checkpoint) {
  const auto* cp = dynamic_cast<const CudaCheckpoint*>(&checkpoint);
  TORCH_INTERNAL_ASSERT(cp != nullptr, "checkpoint of another backend");
  c10::cuda::CUDAGuard guard(device_.index());
  try {
    c10::cuda::device_synchronize();  // setCheckpointPoolState needs every block's events done
  } catch (const std::exception& e) {
    throw RestoreError(std::string("synchronize: ") + e.what(), /*pool_unchanged=*/true);
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
    throw RestoreError(e.what(), /*pool_unchanged=*/false);
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

std::vector<std::pair<Interval, std::vector<CudaBackend::Block>>> CudaBackend::poolLayout() const {
  std::vector<std::pair<Interval, std::vector<Block>>> out;
  const CCA::SnapshotInfo snap = CCA::snapshot(pool_, /*include_traces=*/false);
  for (const auto& seg : snap.segments) {
    if (seg.device != device_.index() || !samePool(seg.owner_private_pool_id, pool_)) continue;
    std::vector<Block> blocks;
    uintptr_t addr = seg.address;
    for (const auto& b : seg.blocks) {
      blocks.push_back({addr, b.size, b.allocated});
      addr += b.size;
    }
    out.push_back({{seg.address, seg.address + seg.total_size}, std::move(blocks)});
  }
  return out;
}

void CudaBackend::refreshSegments() {
  segments_.clear();
  if (!pool_alive_) return;
  for (const auto& seg : poolLayout()) segments_.push_back(seg.first);
  mergeIntervals(&segments_);
}

std::vector<void*> CudaBackend::allocatedBlocks() {
  std::vector<void*> out;
  for (const auto& seg : poolLayout()) {
    for (const auto& b : seg.second) {
      if (b.allocated) out.push_back(reinterpret_cast<void*>(b.ptr));
    }
  }
  return out;
}

PoolStats CudaBackend::stats() {
  PoolStats s;
  if (!pool_alive_) return s;
  for (const auto& seg : poolLayout()) {
    s.segments += 1;
    s.reserved_bytes += static_cast<int64_t>(seg.first.end - seg.first.begin);
    for (const auto& b : seg.second) {
      s.blocks += 1;
      if (b.allocated) {
        s.allocated_blocks += 1;
        s.allocated_bytes += static_cast<int64_t>(b.size);
      }
    }
  }
  return s;
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

std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not) {
  *why_not = cudaBackendDisabledReason();
  if (!why_not->empty()) return nullptr;
  return std::make_unique<CudaBackend>(device);
}

}  // namespace graphtrees
