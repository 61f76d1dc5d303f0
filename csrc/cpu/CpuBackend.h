#pragma once

// The CPU emulation backend: reproduces CUDA-graph memory semantics on the CPU so that every
// behaviour of the tree runs for real, with real tensors, on machines without a GPU.
//
// Note [CPU emulation of graphs]
// At first use the backend installs a routing allocator as c10's CPU allocator. It forwards every
// allocation to the allocator it replaced, except on a thread that the backend is routing:
//   - pool mode (warmup, placeholders): allocations come from the tree's private CpuPool;
//   - capture mode: the same, and each allocation's size and address is recorded in order;
//   - replay mode: the n-th allocation is answered with the n-th recorded address, without
//     touching the pool, and frees do nothing -- just as a CUDA graph replay writes its recorded
//     addresses with no allocator accounting. A size that differs from the recording
//     (data-dependent control flow or shapes) is an error that names the function and the
//     allocation.
// Capture runs the callable once and records the ops it dispatches; a replay runs those ops
// again from C++ in replay mode (Note [CPU graphs] in cpu/CpuGraph.h), so its outputs land
// exactly where the recording's did. What a CUDA capture would reject, a CPU capture rejects too
// (Note [Rejected captures] in cpu/HostSyncWatch.cpp).

#include "Backend.h"

namespace graphtrees {

class CpuPool;

class CpuBackend final : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;

  c10::Device device() const override { return c10::Device(c10::DeviceType::CPU); }
  std::string name() const override { return "cpu-emulation"; }

  void releasePool() override;
  void beginAllocateToPool() override;
  void endAllocateToPool() override;
  // `spec.generators` need no registration: a replay's ops draw from them.
  std::unique_ptr<Graph> capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                 std::vector<at::Tensor>* outputs,
                                 const CaptureSpec& spec) override;
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
  bool returnsSegments() const override { return true; }
  // Nothing is cached outside the pool: the CPU allocator returns freed memory at once.
  bool freeCachedMemory() override { return false; }

 private:
  CpuPool* pool_;          // owned; released by releasePool() or the destructor
  bool poisoned_ = false;  // a failed restore left the pool's bookkeeping inconsistent
};

}  // namespace graphtrees
