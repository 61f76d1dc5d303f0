#pragma once

// The CUDA backend: real CUDA graphs (at::cuda::CUDAGraph) recorded into one private pool of
// c10's CUDA caching allocator per tree, and that allocator's checkpoint API for branch switches.
//
// Note [CUDA backend calls]
//   pool        at::cuda::graph_pool_handle() + createOrIncrefPool(); on reset releasePool(),
//               then emptyCache(pool) so that the pool's segments (and, with expandable
//               segments, their address space) go back to the device, then a sync
//   warmup      beginAllocateToPool(thread filter) on the tree's own stream and device (a device
//               guard held while routed), cuBLAS workspaces cleared around it;
//               endAllocateToPool() + releasePool() (balances begin's incref), sync last
//   capture     CUDAGraph::capture_begin(pool, thread-local mode) on the tree's stream, Python's
//               GC paused; one replay. A capture CUDA invalidates is undone by hand on torch
//               < 2.14, whose capture_end() throws before it un-routes (Note [Rejected captures
//               on CUDA] in CudaBackend.cpp)
//   replay      CUDAGraph::replay() on the caller's current stream (inputs copied on that stream)
//   checkpoint  getCheckpointState(); restore: setCheckpointPoolState() after a device sync
// Compiles against torch 2.11 and 2.14: the calls above have the same spelling in both; the one
// behaviour that differs (capture_end's clean-up) is gated on TORCH_VERSION_MINOR.

#include "Backend.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace at::cuda {
struct CUDAGraph;
}  // namespace at::cuda

namespace graphtrees {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(c10::Device device);
  ~CudaBackend() override;

  c10::Device device() const override { return device_; }
  std::string name() const override { return "cuda-graphs"; }

  void releasePool() override;
  void beginAllocateToPool() override;
  void endAllocateToPool() override;
  std::unique_ptr<Graph> capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                 std::vector<at::Tensor>* outputs,
                                 const std::string& function_name) override;
  void copyInputs(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) override;
  std::shared_ptr<Checkpoint> checkpoint() override;
  RestoreResult restore(const Checkpoint& checkpoint) override;
  void freeBlock(void* ptr) override;
  c10::DeleterFnPtr poolDeleter() const override;
  bool inPool(const void* ptr) const override;
  bool checkLiveAllocations(const std::unordered_set<void*>& expected) override;
  std::vector<void*> allocatedBlocks() override;
  PoolStats stats() override;
  void setReservedLimit(int64_t bytes) override;
  int64_t refusedBytes() const override;
  int64_t releaseFreeSegments(const std::vector<const Checkpoint*>& keep) override;

 private:
  struct Block {
    uintptr_t ptr;
    size_t size;
    bool allocated;
  };
  // The pool's segments and blocks, from the allocator's snapshot.
  std::vector<std::pair<Interval, std::vector<Block>>> poolLayout() const;
  void refreshSegments();
  // Lower c10's memory fraction of the device so that the pool cannot grow past limit_ while this
  // thread allocates into it; liftLimit() puts the previous fraction back.
  void applyLimit();
  void liftLimit();
  // Undoes a capture that failed after capture_begin(): un-routes both allocators and releases
  // every pool reference the capture took (`uses_before`: the pool's use count before it).
  // `host_routed`: capture_begin() got as far as routing the host allocator.
  void abandonCapture(std::unique_ptr<at::cuda::CUDAGraph> graph, int uses_before,
                      bool host_routed);

  c10::Device device_;
  c10::cuda::MempoolId_t pool_;
  bool pool_alive_ = false;
  bool poisoned_ = false;  // a failed setCheckpointPoolState left the pool inconsistent
  c10::cuda::CUDAStream stream_;
  std::optional<c10::cuda::CUDAStream> saved_stream_;  // during pool routing
  c10::cuda::OptionalCUDAGuard routing_device_;        // during pool routing
  std::vector<Interval> segments_;                     // cached for inPool()
  int64_t limit_ = -1;                                 // graphtrees.set_memory_budget
  std::optional<double> saved_fraction_;               // while the limit is applied
};

// Returns nullptr (with `why_not`) when CUDA graphs cannot be used: the allocator is not c10's
// native caching allocator (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), or the backend was
// not enabled (see README: it is enabled with GRAPHTREES_CUDA=1 until it is verified on a GPU).
std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not);
// Why makeCudaBackend() would refuse, or "" when the CUDA backend is enabled.
std::string cudaBackendDisabledReason();

}  // namespace graphtrees
