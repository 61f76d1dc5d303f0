#pragma once

// The one interface the tree manager drives. The tree manager knows nothing about CUDA or about
// the CPU emulation: everything device-specific (pools, allocation routing, capture, replay,
// checkpoint/restore of the pool's bookkeeping) lives behind this interface.
//
// The contract mirrors what the c10 CUDA caching allocator and at::cuda::CUDAGraph offer:
//   - one private pool per backend instance (created in the constructor, released by
//     releasePool() or the destructor);
//   - beginAllocateToPool()/endAllocateToPool() route the *calling thread's* allocations into
//     the pool (warmup, placeholder allocation);
//   - capture() runs a function once with allocations routed into the pool and returns a Graph
//     that can replay it at the recorded addresses without consulting the allocator;
//   - checkpoint()/restore() follow getCheckpointState/setCheckpointPoolState: after a restore the
//     pool's bookkeeping equals the checkpoint exactly; blocks that were allocated in the
//     checkpoint come back as owning DataPtrs, everything else in the pool is free.

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

namespace graphtrees {

// A half-open byte range [begin, end) of device memory.
struct Interval {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};

struct PoolStats {
  int64_t reserved_bytes = 0;   // bytes of segments owned by the pool
  int64_t allocated_bytes = 0;  // bytes of blocks currently allocated in the pool
  int64_t segments = 0;
  int64_t blocks = 0;  // all blocks, free and allocated
  int64_t allocated_blocks = 0;
};

// Opaque snapshot of a pool's bookkeeping (c10's AllocatorState).
struct Checkpoint {
  virtual ~Checkpoint() = default;
};

// What a restore changed (c10's CheckpointDelta).
struct RestoreResult {
  std::vector<void*> ptrs_freed;  // blocks that were allocated before the restore
  std::vector<c10::DataPtr>
      dataptrs_allocd;  // owning pointers to the checkpoint's allocated blocks
};

using RunFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// The device refused to record the function: a CUDA stream capture was invalidated (a host sync
// such as .item(), a data-dependent shape such as x[mask], an unjoined side stream, ...) or, on
// the CPU emulation, the function did what a CUDA capture forbids. capture() throws it after it
// has undone everything the capture set up (allocator routing, pool references); the tree then
// runs that function eagerly from now on. See Note [Rejected captures].
// `ran()`: the function ran to its end and `outputs` holds its real results (the CPU emulation
// runs it for real while it records), so the tree can hand those out instead of running it again.
class CaptureRejected : public std::runtime_error {
 public:
  explicit CaptureRejected(const std::string& what, bool ran = false)
      : std::runtime_error(what), ran_(ran) {}
  bool ran() const { return ran_; }

 private:
  bool ran_;
};

// restore() failed. `poolUnchanged()` says whether the pool's bookkeeping is exactly as it was
// before the call (the CPU pool's restore is all-or-nothing; c10's setCheckpointPoolState is
// not, so a CUDA failure leaves the pool in an unknown state and its blocks are never reused).
class RestoreError : public std::runtime_error {
 public:
  RestoreError(const std::string& what, bool pool_unchanged)
      : std::runtime_error(what), pool_unchanged_(pool_unchanged) {}
  bool poolUnchanged() const { return pool_unchanged_; }

 private:
  bool pool_unchanged_;
};

// What a capture is asked to record.
struct CaptureSpec {
  std::string function_name;
  // Generators passed as arguments: registered with the graph, so that its replays advance them.
  std::vector<at::Generator> generators;
  // Non-empty: the CPU emulation replays by re-running the function, for this reason
  // (cpu_replay="python", a graph Inductor compiled); see Note [CPU graphs].
  std::string python_replay;
};

// A recorded graph.
class Graph {
 public:
  virtual ~Graph() = default;
  // Re-executes the recording. `inputs` are the call's flat inputs; `placeholders[k]` stands in
  // for input `copied[k]` (the current call's value, already copied to the address the recording
  // used). A CUDA graph ignores all of it (its addresses are baked in); the CPU emulation re-runs
  // `run` on the inputs with the placeholders substituted. `run` is the current call's callable,
  // so a graph keeps no Python object alive.
  virtual void replay(const RunFn& run, const std::vector<at::Tensor>& inputs,
                      const std::vector<int64_t>& copied,
                      const std::vector<at::Tensor>& placeholders) = 0;
  // Every byte range the recording wrote through the allocator (outputs and temporaries),
  // sorted and merged. A replay writes inside these ranges only.
  virtual const std::vector<Interval>& footprint() const = 0;
  // How a CPU emulation graph replays: "program" (its recorded ops, run from C++) or "python"
  // (the function run again); nullptr for a device graph.
  virtual const char* cpuReplay() const { return nullptr; }
  virtual bool replaysProgram() const { return false; }
  // The control steps its replay decides itself, outermost first, as "kind:form": kind "cond" or
  // "while_loop"; form "program-branch" / "program-loop" (a CPU program's step, Note [Control
  // steps of a program] in cpu/OpProgram.h), "python-replay" (the same, in a CPU graph that
  // replays its Python code) or "conditional-node" (Note [Conditional nodes on CUDA] in
  // cuda/ConditionalNodes.cpp).
  virtual std::vector<std::string> conditionals() const { return {}; }
  // Runs `eager` (the function, eagerly, on `eager_inputs`: copies of a replay's inputs) and
  // names the first recorded op whose non-tensor argument the eager run passes differently (a
  // Python value the recording baked in); empty when none does or the graph cannot tell.
  virtual std::string explainDifference(const std::function<void()>& eager,
                                        const std::vector<at::Tensor>& /*eager_inputs*/) const {
    eager();
    return std::string();
  }
};

// Ranges of a tracing tool of a device's own (Note [Call ranges] in CallRange.h), with no state:
// whether one is attached now (asked at every call: it must be cheap), and a range's begin and
// end around a graphed call, nested as calls nest. CUDA: NVTX (cuda/NvtxRanges.h).
struct RangeMarks {
  bool (*attached)();
  void (*push)(const std::string& text);
  void (*pop)();
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual c10::Device device() const = 0;
  virtual std::string name() const = 0;

  // Frees the pool: called by reset(). Live blocks stay valid until their owners free them. The
  // pool is released (and its memory handed back) before anything that can fail runs; an error
  // met afterwards (an asynchronous device error surfacing at the final synchronisation) is
  // thrown, so callers that must not throw (destructors) catch it.
  virtual void releasePool() = 0;

  // Routes the calling thread's allocations into the pool until endAllocateToPool().
  // endAllocateToPool() un-routes first and synchronises last: if the synchronisation reports an
  // asynchronous error of the work done while routed, the routing has already ended when it
  // throws.
  virtual void beginAllocateToPool() = 0;
  virtual void endAllocateToPool() = 0;
  // Runs the user's code of a warmup, between the two: a backend whose routing holds a lock that
  // other threads need lends it out meanwhile (CUDA: Note [Locks around user code] in
  // cuda/DeviceLock.h).
  virtual std::vector<at::Tensor> runRouted(const RunFn& run, const std::vector<at::Tensor>& ins);
  // Why the calling thread must not wait for the device now (empty if it may): another thread's
  // capture on this backend's device is running the user's code, which may be waiting for this
  // thread. Asked without waiting.
  virtual std::string capturingElsewhere() const { return std::string(); }
  // The same, after waiting a while for such a capture's user code to return: a call that would
  // warm up or record runs eagerly, with this reason, if it is not empty.
  virtual std::string awaitCapturesElsewhere() { return std::string(); }

  // Runs `run(inputs)` once while recording into the pool; `outputs` receives its result (real,
  // owning tensors that hold the recorded values). Throws what `run` throws, after undoing the
  // capture, or CaptureRejected when the device refused to record it.
  virtual std::unique_ptr<Graph> capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                         std::vector<at::Tensor>* outputs,
                                         const CaptureSpec& spec) = 0;

  // Copies `src[i]` into `dst[i]` (placeholders) before a replay; called through
  // copyReplayInputs(), in inference mode.
  virtual void copyInputs(const std::vector<at::Tensor>& dst,
                          const std::vector<at::Tensor>& src) = 0;

  // A graphed call begins, and has queued all of its work (write-back included): a backend whose
  // work runs asynchronously on the caller's streams orders the pool's users there (CUDA: Note
  // [Streams of the pool] in cuda/PoolStreams.cpp). The CPU emulation runs synchronously.
  virtual void beginCall() {}
  virtual void endCall() {}

  // The ranges of the device's own tracing tool (Note [Call ranges] in CallRange.h), or nullptr.
  // The same as BackendFactory.h's rangeMarks() of the device, which reaches them without a
  // backend (an eager run decided outside the tree).
  virtual const RangeMarks* rangeMarks() const { return nullptr; }

  // Both wait for the work queued on the pool's memory first (the device synchronisation is
  // theirs, not the caller's). restore() throws RestoreError on failure.
  virtual std::shared_ptr<Checkpoint> checkpoint() = 0;
  virtual RestoreResult restore(const Checkpoint& checkpoint) = 0;

  // Frees one allocated block of the pool (c10's raw_delete).
  virtual void freeBlock(void* ptr) = 0;
  // The deleter of owning DataPtrs that the pool hands out.
  virtual c10::DeleterFnPtr poolDeleter() const = 0;
  // Whether `ptr` lies inside a segment of this backend's pool.
  virtual bool inPool(const void* ptr) const = 0;
  // True iff the pool's allocated blocks are exactly `expected` (c10's checkPoolLiveAllocations).
  virtual bool checkLiveAllocations(const std::unordered_set<void*>& expected) = 0;
  // Start addresses of all allocated blocks (for diagnostics).
  virtual std::vector<void*> allocatedBlocks() = 0;
  virtual PoolStats stats() = 0;

  // Note [Memory budget]
  // graphtrees.set_memory_budget(device, n) caps the bytes of segments the pool may hold: an
  // allocation in the pool that needs a segment beyond the cap fails with c10::OutOfMemoryError,
  // like a device that is out of memory (-1 removes the cap; segments held already stay). The
  // tree then runs the call eagerly, evicts recordings not on the current path and returns the
  // segments that no remaining checkpoint needs (releaseFreeSegments()).
  virtual void setReservedLimit(int64_t bytes) = 0;
  // Size of the last segment the cap refused; 0 when the backend cannot tell.
  virtual int64_t refusedBytes() const = 0;
  // Returns to the device the pool's entirely free segments that none of `keep` contains (a
  // restore needs every segment of its checkpoint), and the bytes freed. A backend that cannot
  // release segments selectively releases none while any free segment is in `keep`.
  virtual int64_t releaseFreeSegments(const std::vector<const Checkpoint*>& keep) = 0;
  // Whether releaseFreeSegments() can return anything while the pool lives. c10 returns a private
  // pool's segments only once nothing holds the pool (Note [Memory budget on CUDA] in
  // CudaBackend.cpp): there, evicting recordings cannot make room, so under a budget the tree
  // evicts nothing and the function runs eagerly until the budget changes (Note [Out of memory]
  // in TreeManager.h).
  virtual bool returnsSegments() const = 0;
  // Gives memory the device's allocator caches outside the pool back to the device (c10's
  // emptyCache() of the default pool), after an out-of-memory error and with no routing active.
  // Returns true if that may have made room (the failed run is tried once more).
  virtual bool freeCachedMemory() = 0;
};

// Routes this thread's allocations into the pool. end() ends the routing on the success path and
// lets its errors (an asynchronous device error surfacing at the synchronisation) propagate; on
// the error path the destructor ends it and turns its errors into a warning, so that the
// original error is the one that propagates.
class PoolRoutingGuard {
 public:
  explicit PoolRoutingGuard(Backend& backend) : backend_(backend) {
    backend_.beginAllocateToPool();
  }
  void end() {
    active_ = false;
    backend_.endAllocateToPool();
  }
  ~PoolRoutingGuard();  // ends the routing if end() was not called; never throws
  PoolRoutingGuard(const PoolRoutingGuard&) = delete;
  PoolRoutingGuard& operator=(const PoolRoutingGuard&) = delete;

 private:
  Backend& backend_;
  bool active_ = true;
};

// A replay's input copies: backend.copyInputs(dst, src) in inference mode (Note [Input copies in
// inference mode] in Backend.cpp).
void copyReplayInputs(Backend& backend, const std::vector<at::Tensor>& dst,
                      const std::vector<at::Tensor>& src);

// Sorts and merges overlapping or touching intervals in place.
void mergeIntervals(std::vector<Interval>* intervals);

}  // namespace graphtrees
