#pragma once

// The tree manager: one per device (TreeRegistry), shared by every wrapped callable on that
// device. It decides, for each call, whether to warm up, record a new node or replay an existing
// one; it owns the private pool (through its Backend) and the ledger of outputs it handed out
// (LiveOutputs), restores the pool to checkpoints on branch switches and invalidates outputs whose
// memory a later run overwrites. It talks to the device only through the Backend interface.

#include "Backend.h"
#include "LiveOutputs.h"
#include "PoolBookkeeping.h"
#include "ProcessState.h"
#include "TreeInfo.h"
#include "TreeNode.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

// Per wrapped callable (all its signatures), per tree: when it last ran, for Note [Ending a path].
struct CallableState {
  int64_t last_generation = -1;
  int runs_in_generation = 0;
};

// Per function, per tree.
struct FunctionState {
  int warmups = 0;
  int rerecords = 0;
  // Note [Out of memory]: num_evictions of the tree when a warmup or recording of this function
  // ran out of memory (-1: it did not); it tries again once an eviction happened since.
  int64_t oom_at_evictions = -1;
  std::string oom_reason;
};

// What a function is in a training step (see Note [Pending backward]).
enum class FunctionMode : uint8_t { kInference, kForward, kBackward };

// One function of the tree: a wrapped callable with one call signature. Owned by the wrapper;
// a tree refers to it by id only, so a wrapper may die while its recordings stay in the tree.
// Several trees (one per thread) may run it; what is per tree lives in the tree.
struct FunctionRecord {
  int64_t id = 0;
  int64_t callable_id = 0;  // shared by every signature of one wrapped callable
  FunctionMode mode = FunctionMode::kInference;
  std::string name;
  std::vector<uint8_t> is_static;  // per flat input
  int warmup_iters = 1;
  int rerecord_limit = 8;
  // Runs on outputs of its own step before a new step starts anyway (a feedback loop h = f(h)).
  int chain_limit = 16;
  // on_overwrite="copy": an output the user still holds when a later run is about to write its
  // memory is copied out of the pool instead of invalidated (Note [Output ownership]).
  bool copy_on_overwrite = false;

  // The torch.Generator objects among its arguments (part of its signature, by identity): a
  // recording registers them with the graph, so that each replay draws fresh numbers from them.
  std::vector<at::Generator> generators;

  // Why the function runs eagerly from now on; empty while it is graphed.
  std::string eager_reason;
  int64_t replays = 0;  // over its life, in every tree: GraphedCallable's eviction policy

  // The tree that ran it last (its serial) and this record's state there: a cache of the
  // tree's own maps, so that a call costs no lookup when one thread runs the function.
  int64_t state_tree = -1;
  FunctionState* state = nullptr;
  CallableState* callable_state = nullptr;
};

enum class RunKind { kEager, kWarmup, kRecord, kReplay };

struct CallResult {
  std::vector<at::Tensor> outputs;
  RunKind kind = RunKind::kEager;
};

class TreeManager {
 public:
  // `owner`: the threadId() of the thread the tree belongs to; `steps`: that thread's step
  // counter (Note [Steps, generations and threads]).
  TreeManager(std::unique_ptr<Backend> backend, int64_t owner, StepCounter steps);
  // Calls close(); errors become warnings.
  ~TreeManager();
  // Invalidates every live output, frees every node and graph and releases the pool. Errors met
  // after the pool is released (an asynchronous device error surfacing at the final sync) are
  // thrown. Idempotent.
  void close();

  // Runs one call of `fn` on flat `inputs`. `run` calls the user's callable on a flat input list
  // and returns its flat tensor outputs. Reached through a TreeRegistry::Handle, which holds the
  // tree's lock.
  CallResult call(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);

  // Counts an eager fallback decided outside the tree (logged once per function and reason).
  void noteFallback(FunctionRecord& fn, const std::string& reason);

  // Removes every recording of function `function_id` (and the subtrees below them), invalidating
  // their live outputs, so that their pool memory is reused. Returns false, removing nothing,
  // while one of them is on the current path.
  bool evictFunction(int64_t function_id, const std::string& why);

  // With debug checks on, asserts checkPoolInvariants(). Called once the call's results are in
  // the caller's hands.
  void debugCheck(const FunctionRecord& fn, RunKind kind);

  TreeInfo snapshot();
  // True iff the pool's allocated blocks are exactly the live outputs that own pool memory, and
  // (when no replay happened since the last restore) every live output owns its block.
  bool checkPoolInvariants(std::string* why);
  c10::Device device() const { return backend_->device(); }
  int64_t owner() const { return owner_; }
  // This tree's state of function `function_id`, or nullptr if it never ran here.
  const FunctionState* functionState(int64_t function_id) const {
    auto it = functions_.find(function_id);
    return it == functions_.end() ? nullptr : &it->second;
  }
  const StepCounter& steps() const { return steps_; }
  // Whether any of `tensors` is a live output of this tree.
  bool producedAny(const std::vector<at::Tensor>& tensors);
  // Live outputs, after dropping the dead ones.
  int64_t liveOutputs();
  std::string backendName() const { return backend_->name(); }
  // Note [Memory budget] in Backend.h; -1: none.
  void setMemoryBudget(int64_t bytes) {
    budget_ = bytes;
    backend_->setReservedLimit(bytes);
  }

  // Pool bytes a restore that failed half-way left unreachable (Note [Failed restores]).
  int64_t leakedBytes() const { return bookkeeping_.leakedBytes(); }
  std::recursive_mutex& mutex() { return mutex_; }

 private:
  enum class PathState { kNone, kWarmup, kRecording, kExecution };

  // How this call's inputs relate to the tree, and the key its node is found by (Note [Matching a
  // child] in TreeNode.h).
  struct CallKey {
    std::vector<InputKind> kinds;
    std::vector<uintptr_t> key_ptrs;
    uint64_t key_hash = 0;
    bool consumes_generation_output = false;
  };

  CallResult callImpl(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);
  CallKey keyOf(const FunctionRecord& fn, const std::vector<at::Tensor>& inputs) const;
  // This tree's state of `fn` (cached in the record).
  FunctionState& stateOf(FunctionRecord& fn);
  void endPath(const std::string& why, const std::vector<at::Tensor>& spare);
  bool mustStayDeadHolds(const TreeNode& node) const;

  CallResult runEager(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run,
                      const std::string& reason);
  // The inputs a warmup or recording runs on (Note [The inputs a run uses] in TreeManager.cpp).
  std::vector<at::Tensor> allocationInputs(const FunctionRecord& fn,
                                           const std::vector<at::Tensor>& inputs);
  // `ins`: allocationInputs() of the call. `retried`: this is the one retry after an out-of-memory
  // error that Backend::freeCachedMemory() made room for.
  CallResult warmup(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                    bool retried = false);
  CallResult record(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                    const CallKey& key, bool retried = false);
  CallResult replay(TreeNode& node, FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                    const RunFn& run);
  TreeNode* findChild(const FunctionRecord& fn, const CallKey& key, std::string* mismatch) const;
  void noteGenerationRun(FunctionRecord& fn);
  void finishRun(FunctionRecord& fn, const CallResult& result);
  void removeNode(TreeNode* node, const std::string& why);
  // Note [Out of memory].
  CallResult outOfMemory(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                         const RunFn& run, const char* during, const std::string& what);
  // Evicts recordings off the current path that produced none of `inputs`, least recently used
  // first, until the segments released cover what the pool lacked (any bytes when the backend
  // cannot tell) or none is left; returns the bytes released.
  int64_t evictForMemory(const std::vector<at::Tensor>& inputs, std::string* evicted);

  std::unique_ptr<Backend> backend_;
  const int64_t serial_;  // unique over the process's life (FunctionRecord::state_tree)
  const int64_t owner_;
  const StepCounter steps_;
  std::unordered_map<int64_t, FunctionState> functions_;  // by function id; never erased
  std::unordered_map<int64_t, CallableState> callables_;  // by callable id; never erased
  std::recursive_mutex mutex_;
  LiveOutputs live_;
  PoolBookkeeping bookkeeping_;  // Note [Checkpointing]
  TreeNode root_;                // sentinel: its children are the roots
  std::vector<TreeNode*> path_;
  TreeNode* current_ = nullptr;
  PathState state_ = PathState::kNone;
  bool closed_ = false;
  int64_t generation_ = 0;
  int64_t seen_step_ = 0;
  int64_t next_node_id_ = 0;
  uint64_t use_clock_ = 0;  // ticks at every recording and replay (TreeNode::last_used_)
  int64_t budget_ = -1;
  std::unordered_set<int64_t> root_functions_;
  std::unordered_set<std::string> logged_;
  // A forward ran and its backward has not run yet: no new generation starts on its own.
  int64_t pending_forwards_ = 0;
  // Outputs of backward functions, held until the node (or the function, for a warmup) runs again
  // or the step ends, so that autograd copies gradients into .grad instead of stealing pool
  // memory (see Note [Pinned gradients]).
  std::unordered_map<int64_t, std::vector<at::Tensor>> pinned_by_node_;
  std::unordered_map<int64_t, std::vector<at::Tensor>> pinned_by_warmup_function_;

  int64_t num_rerecords_ = 0;
  int64_t num_fallbacks_ = 0;
  int64_t num_warmups_ = 0;
  int64_t num_recordings_ = 0;
  int64_t num_replays_ = 0;
  int64_t num_evictions_ = 0;
  int64_t num_oom_ = 0;  // warmups and recordings that ran out of memory
  int64_t num_nodes_ = 0;
};

}  // namespace graphtrees
