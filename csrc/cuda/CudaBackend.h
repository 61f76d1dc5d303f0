#pragma once

// The CUDA backend: real CUDA graphs (at::cuda::CUDAGraph) recorded into one private pool of
// c10's CUDA caching allocator per tree, and that allocator's checkpoint API for branch switches.
//
// Note [CUDA backend calls]
//   pool        at::cuda::graph_pool_handle() + createOrIncrefPool(), and a lifetime reference on
//               the host (pinned) allocator's pool of the same id; on reset both are released,
//               then emptyCache(pool) and the host allocator's empty_cache() hand the memory back
//   warmup      beginAllocateToPool(thread filter) on the tree's own stream and device (a device
//               guard held while routed), cuBLAS workspaces cleared around it;
//               endAllocateToPool() + releasePool() (balances begin's incref), the tree's stream
//               synced last
//   capture     CUDAGraph::capture_begin(pool, thread-local mode) on the tree's stream, generator
//               arguments registered first, Python's GC paused; one replay; cuBLAS workspaces
//               cleared after it, kept or not. A failed capture is undone by hand (Note
//               [Rejected captures on CUDA] in CudaBackend.cpp)
//   replay      CUDAGraph::replay() on the caller's current stream (inputs copied on that stream)
//   checkpoint  getCheckpointState(); restore: setCheckpointPoolState() after the pool's work is
//               done
// Everything except replay runs under the device's allocation lock (Note [One allocation phase
// per device] in DeviceLock.h). The streams using the pool are ordered by an event of the tree's,
// and the host waits for the tree's own stream only (Note [Streams of the pool] in
// PoolStreams.cpp): never for a caller's stream, the legacy default stream or the whole device.
// Compiles against torch 2.11 and 2.14: the calls above have the same spelling in both; what
// differs (capture_end's clean-up, the generators' capture state) is gated on TORCH_VERSION_MINOR
// or detected from the headers' declarations.

#include "Backend.h"
#include "cuda/MemoryLimit.h"
#include "cuda/NvtxRanges.h"
#include "cuda/PoolLayout.h"
#include "cuda/PoolStreams.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace graphtrees {

struct TreeGraph;  // at::cuda::CUDAGraph, as graphtrees captures it (CudaBackend.cpp)

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(c10::Device device);
  ~CudaBackend() override;

  c10::Device device() const override { return device_; }
  std::string name() const override { return "cuda-graphs"; }

  void releasePool() override;
  void beginAllocateToPool() override;
  void endAllocateToPool() override;
  std::vector<at::Tensor> runRouted(const RunFn& run, const std::vector<at::Tensor>& ins) override;
  std::string capturingElsewhere() const override;
  std::string awaitCapturesElsewhere() override;
  std::unique_ptr<Graph> capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                 std::vector<at::Tensor>* outputs,
                                 const CaptureSpec& spec) override;
  void copyInputs(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) override;
  void beginCall() override;
  void endCall() override;
  const RangeMarks* rangeMarks() const override { return &NvtxRanges::marks(); }
  std::shared_ptr<Checkpoint> checkpoint() override;
  RestoreResult restore(const Checkpoint& checkpoint) override;
  void freeBlock(void* ptr) override;
  c10::DeleterFnPtr poolDeleter() const override;
  bool inPool(const void* ptr) const override;
  bool checkLiveAllocations(const std::unordered_set<void*>& expected) override;
  std::vector<void*> allocatedBlocks() override;
  PoolStats stats() override;
  void setReservedLimit(int64_t bytes) override { limit_.setBytes(bytes); }
  // c10's out-of-memory error does not say how much the pool lacked.
  int64_t refusedBytes() const override { return 0; }
  int64_t releaseFreeSegments(const std::vector<const Checkpoint*>& keep) override;
  bool returnsSegments() const override { return false; }
  bool freeCachedMemory() override;

 private:
  // The pool's segments and blocks, from the allocator's snapshot.
  PoolLayout layout() const;
  void refreshSegments();
  // Undoes a capture that failed after capture_begin(): ends a stream capture still under way,
  // takes the generators out of capture mode, un-routes both allocators and releases every pool
  // reference the capture took (`uses_before`: the pool's use count before it). `host_routed`:
  // capture_begin() got as far as routing the host allocator.
  void abandonCapture(std::unique_ptr<TreeGraph> graph, int uses_before, bool host_routed);

  c10::Device device_;
  c10::cuda::MempoolId_t pool_;
  bool pool_alive_ = false;
  bool poisoned_ = false;  // a failed setCheckpointPoolState left the pool inconsistent
  // The tree's own stream (review 4, #10): not one of c10's pooled streams, which
  // torch.cuda.Stream() hands out again, so nobody else's kernels land in its captures; never
  // destroyed. With the event that orders the pool's users (both Notes in PoolStreams.cpp).
  PoolStreams streams_;
  c10::cuda::CUDAStream stream_;                       // streams_.stream()
  std::optional<c10::cuda::CUDAStream> saved_stream_;  // during pool routing
  c10::cuda::OptionalCUDAGuard routing_device_;        // during pool routing
  std::vector<Interval> segments_;                     // cached for inPool()
  MemoryLimit limit_;                                  // graphtrees.set_memory_budget
  int routing_locks_ = 0;  // device locks held between begin- and endAllocateToPool
};

// Returns nullptr (with `why_not`) when CUDA graphs cannot be used: the allocator is not c10's
// native caching allocator (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), or the backend was
// not enabled (see README: it is enabled with GRAPHTREES_CUDA=1 until it is verified on a GPU).
std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not);
// Why makeCudaBackend() would refuse, or "" when the CUDA backend is enabled.
std::string cudaBackendDisabledReason();
// Whether the current stream of `device` is capturing (a capture of the caller's own).
bool cudaCurrentStreamIsCapturing(c10::Device device);

}  // namespace graphtrees
