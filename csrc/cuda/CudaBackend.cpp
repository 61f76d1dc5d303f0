#include "cuda/CudaBackend.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/_foreach_copy.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

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
  explicit CudaCheckpoint(std::shared_ptr<CCA::AllocatorState> state) : state_(std::move(state)) {}
  std::shared_ptr<CCA::AllocatorState> state_;
};

class CudaGraph final : public Graph {
 public:
  CudaGraph(std::unique_ptr<at::cuda::CUDAGraph> graph, std::vector<Interval> footprint)
      : graph_(std::move(graph)), footprint_(std::move(footprint)) {}

  // The addresses are baked into the graph: no Python runs, inputs are already in place.
  void replay(const RunFn& /*run*/, const std::vector<at::Tensor>& /*inputs*/) override {
    graph_->replay();
  }
  const std::vector<Interval>& footprint() const override { return footprint_; }
  bool replayRunsCallable() const override { return false; }

 private:
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  std::vector<Interval> footprint_;
};

bool samePool(const c10::cuda::MempoolId_t& a, const c10::cuda::MempoolId_t& b) {
  return a.first == b.first && a.second == b.second;
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
    TORCH_WARN("graphtrees: releasing the CUDA pool failed: ", e.what());
  }
}

void CudaBackend::releasePool() {
  if (!pool_alive_) return;
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();
  CCA::releasePool(device_.index(), pool_);
  pool_alive_ = false;
  segments_.clear();
}

void CudaBackend::synchronize() {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();
}

void CudaBackend::beginAllocateToPool() {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();    // the tree's stream starts after the caller's work
  at::cuda::clearCublasWorkspaces();  // so that a workspace is not created inside the pool
  const auto tid = std::this_thread::get_id();
  CCA::beginAllocateToPool(device_.index(), pool_,
                           [tid](cudaStream_t) { return std::this_thread::get_id() == tid; });
  saved_stream_ = c10::cuda::getCurrentCUDAStream(device_.index());
  c10::cuda::setCurrentCUDAStream(stream_);
}

void CudaBackend::endAllocateToPool() {
  c10::cuda::CUDAGuard guard(device_.index());
  if (saved_stream_) {
    c10::cuda::setCurrentCUDAStream(*saved_stream_);
    saved_stream_.reset();
  }
  c10::cuda::device_synchronize();  // the caller's stream sees the results
  CCA::endAllocateToPool(device_.index(), pool_);
  CCA::releasePool(device_.index(), pool_);  // balances beginAllocateToPool's incref
  at::cuda::clearCublasWorkspaces();
  refreshSegments();
}

std::unique_ptr<Graph> CudaBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor>* outputs,
                                            const std::string& function_name) {
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
  // Blocks allocated before the capture are protected; the capture may write anything else in
  // the pool's segments (including segments it creates).
  std::vector<Interval> protected_blocks;
  for (const auto& seg : poolLayout()) {
    for (const auto& b : seg.second) {
      if (b.allocated) protected_blocks.push_back({b.ptr, b.ptr + b.size});
    }
  }
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  {
    c10::cuda::CUDAStreamGuard stream_guard(stream_);
    graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    try {
      *outputs = run(inputs);
    } catch (...) {
      try {
        graph->capture_end();
      } catch (const std::exception& e) {
        TORCH_WARN("graphtrees: ending the aborted capture of '", function_name,
                   "' failed: ", e.what());
      }
      throw;
    }
    graph->capture_end();
    graph->replay();  // the recording's outputs hold real values from here on
  }
  c10::cuda::device_synchronize();
  at::cuda::clearCublasWorkspaces();
  refreshSegments();
  // Footprint: the pool's segments minus the blocks that were protected before the capture.
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
  return std::make_shared<CudaCheckpoint>(CCA::getCheckpointState(device_.index(), pool_));
}

RestoreResult CudaBackend::restore(const Checkpoint& checkpoint) {
  const auto* cp = dynamic_cast<const CudaCheckpoint*>(&checkpoint);
  TORCH_INTERNAL_ASSERT(cp != nullptr, "checkpoint of another backend");
  c10::cuda::CUDAGuard guard(device_.index());
  c10::cuda::device_synchronize();  // setCheckpointPoolState needs every block's events done
  CCA::CheckpointDelta delta = CCA::setCheckpointPoolState(device_.index(), cp->state_);
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

std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not) {
  const std::string allocator = CCA::name();
  if (allocator != "native") {
    *why_not = "the CUDA caching allocator backend is '" + allocator +
               "' (PYTORCH_CUDA_ALLOC_CONF=backend:...); CUDA graph trees need the native caching "
               "allocator's private pools and checkpoints";
    return nullptr;
  }
  const char* enabled = std::getenv("GRAPHTREES_CUDA");
  if (enabled == nullptr || std::string(enabled) != "1") {
    *why_not =
        "the CUDA backend is compiled in but not yet verified on a GPU in this release; set "
        "GRAPHTREES_CUDA=1 to use it";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(device);
}

}  // namespace graphtrees
