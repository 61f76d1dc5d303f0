#pragma once

// The CUDA backend: real CUDA graphs (at::cuda::CUDAGraph) recorded into one private pool of
// c10's CUDA caching allocator per tree, and that allocator's checkpoint API for branch switches.
//
// Note [CUDA backend calls]
//   pool        at::cuda::graph_pool_handle() + createOrIncrefPool(); releasePool() on reset
//   warmup      beginAllocateToPool(thread filter) on the tree's own stream, cuBLAS workspaces
//               cleared around it; endAllocateToPool() + releasePool() (balances begin's incref)
//   capture     CUDAGraph::capture_begin(pool, thread-local mode) on the tree's stream; one replay
//   replay      CUDAGraph::replay() on the caller's current stream (inputs copied on that stream)
//   checkpoint  getCheckpointState(); restore: setCheckpointPoolState() after a device sync
// Compiles against torch 2.11 and 2.14: the calls above have the same spelling in both.

#include "Backend.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

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
  void synchronize() override;
  std::shared_ptr<Checkpoint> checkpoint() override;
  RestoreResult restore(const Checkpoint& checkpoint) override;
  void freeBlock(void* ptr) override;
  c10::DeleterFnPtr poolDeleter() const override;
  bool inPool(const void* ptr) const override;
  bool checkLiveAllocations(const std::unordered_set<void*>& expected) override;
  std::vector<void*> allocatedBlocks() override;
  PoolStats stats() override;

 private:
  struct Block {
    uintptr_t ptr;
    size_t size;
    bool allocated;
  };
  // The pool's segments and blocks, from the allocator's snapshot.
  std::vector<std::pair<Interval, std::vector<Block>>> poolLayout() const;
  void refreshSegments();

  c10::Device device_;
  c10::cuda::MempoolId_t pool_;
  bool pool_alive_ = false;
  c10::cuda::CUDAStream stream_;
  std::optional<c10::cuda::CUDAStream> saved_stream_;  // during pool routing
  std::vector<Interval> segments_;                     // cached for inPool()
};

// Returns nullptr (with `why_not`) when CUDA graphs cannot be used: the allocator is not c10's
// native caching allocator (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), or the backend was
// not enabled (see README: it is enabled with GRAPHTREES_CUDA=1 until it is verified on a GPU).
std::unique_ptr<Backend> makeCudaBackend(c10::Device device, std::string* why_not);

}  // namespace graphtrees
