#pragma once

// The tree manager: one per device (TreeRegistry), shared by every wrapped callable on that
// device. It decides, for each call, whether to warm up, record a new node or replay an existing
// one; it owns the private pool (through its Backend) and the ledger of outputs it handed out
// (LiveOutputs), restores the pool to checkpoints on branch switches and invalidates outputs whose
// memory a later run overwrites. It talks to the device only through the Backend interface.

#include "Backend.h"
#include "BackendCall.h"
#include "CallRange.h"
#include "FunctionRecord.h"
#include "LiveOutputs.h"
#include "PathPolicy.h"
#include "PoolBookkeeping.h"
#include "ThreadState.h"
#include "TreeLock.h"
#include "TreeNode.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

struct TreeInfo;  // TreeInfo.h, which includes this header

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
  // and returns its flat tensor outputs. Reached through TreeRegistry::call, which holds the
  // tree's lock, marks the call in flight and lends the lock out while `run` runs (Note [User
  // code outside the tree lock] in TreeLock.h).
  CallResult call(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);

  // Counts an eager fallback decided outside the tree (logged once per function and reason).
  void noteFallback(FunctionRecord& fn, const std::string& reason);

  // Removes every recording of function `function_id` (and the subtrees below them), invalidating
  // their live outputs, so that their pool memory is reused. While one of them is on the current
  // path it removes nothing and returns false, or, with `later`, keeps the eviction pending until
  // the path moves off them and returns true. While a call is in flight (Note [User code outside
  // the tree lock] in TreeLock.h) the eviction is pending until that call ends; true.
  bool evictFunction(int64_t function_id, const std::string& why, bool later = false);

  // With debug checks on, asserts checkPoolInvariants(). Called once the call's results are in
  // the caller's hands.
  void debugCheck(const FunctionRecord& fn, RunKind kind);

  TreeInfo snapshot();
  // True iff the pool's allocated blocks are exactly the live outputs that own pool memory, and
  // (when no replay happened since the last restore) every live output owns its block.
  bool checkPoolInvariants(std::string* why) { return bookkeeping_.checkInvariants(why); }
  c10::Device device() const { return backend_->device(); }
  int64_t owner() const { return owner_; }
  // How many functions this tree keeps a state of (evicted ones are forgotten).
  size_t functionStates() const { return functions_.size(); }
  // This tree's state of function `function_id`, or nullptr if it never ran here.
  const FunctionState* functionState(int64_t function_id) const {
    auto it = functions_.find(function_id);
    return it == functions_.end() ? nullptr : &it->second;
  }
  const StepCounter& steps() const { return policy_.steps(); }
  // Whether any of `tensors` is a live output of this tree.
  bool producedAny(const std::vector<at::Tensor>& tensors) const {
    return std::any_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
      return t.defined() && t.has_storage() && live_.contains(t.storage().unsafeGetStorageImpl());
    });
  }
  // Live outputs, after dropping the dead ones.
  int64_t liveOutputs() {
    live_.pruneGone();
    return static_cast<int64_t>(live_.size());
  }
  // True iff no call holds the tree and none of its outputs is alive (an orphan may be freed).
  bool idle() {
    std::unique_lock<TreeLock> lock(lock_, std::try_to_lock);
    return lock.owns_lock() && !lock_.callInFlight() && liveOutputs() == 0;
  }
  // Applies the pending evictions (applyPending()), first ending the path if its first recording
  // is one of them (the whole path goes with it): torch._dynamo.reset() with graphtrees.install().
  // Nothing while a call is in flight.
  // Ordered as a call's work (runOrdered(): the path's end migrates on_overwrite="copy" outputs).
  void settlePending() {
    if (lock_.callInFlight()) return;
    runOrdered(*backend_, [&] {
      if (!path_.empty() &&
          std::any_of(pending_evictions_.begin(), pending_evictions_.end(),
                      [&](const auto& p) { return p.first == path_[0]->functionId(); })) {
        endPath("its recordings were evicted", {});
      }
      applyPending();
    });
  }
  // True iff idle() and the tree holds no recording: freeing it loses nothing but its counters.
  bool empty() { return counters_.num_nodes == 0 && idle(); }
  std::string backendName() const { return backend_->name(); }
  // Whether another thread's capture on the tree's device runs user code: what needs the device's
  // lock waits (Note [Locks around user code] in cuda/DeviceLock.h).
  bool deviceCapturingElsewhere() const { return !backend_->capturingElsewhere().empty(); }
  // Note [Memory budget] in Backend.h; -1: none. Applied when the call in flight ends, if any
  // (Note [User code outside the tree lock] in TreeLock.h).
  void setMemoryBudget(int64_t bytes) {
    if (lock_.callInFlight()) {
      pending_budget_ = bytes;
      return;
    }
    pending_budget_.reset();
    budget_ = bytes;
    budget_epoch_++;  // functions that ran out of memory under the old budget try again
    backend_->setReservedLimit(bytes);
  }

  // Pool bytes a restore that failed half-way left unreachable (Note [Failed restores]).
  int64_t leakedBytes() const { return bookkeeping_.leakedBytes(); }

 private:
  friend class TreeRegistry;  // holds mutex() for the length of a call (TreeRegistry::Handle)
  TreeLock& mutex() { return lock_; }
  // What other threads asked for while a call was in flight (and evictions of recordings that
  // were on the path): applied at the end of each call.
  void applyPending() {
    if (pending_budget_) setMemoryBudget(*pending_budget_);
    std::vector<std::pair<int64_t, std::string>> pending;
    pending.swap(pending_evictions_);
    for (auto& [id, why] : pending) evictFunction(id, why, /*later=*/true);
  }

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
  // This tree's state of `fn`.
  FunctionState& stateOf(FunctionRecord& fn);
  void endPath(const PathEnd& why, const std::vector<at::Tensor>& spare);

  CallResult runEager(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run,
                      const std::string& reason);
  // Note [The inputs a run uses]
  // Before a warmup or a recording allocates in the pool, prepareToAllocate() may restore the pool
  // to a checkpoint; a live output that the restore does not protect is invalidated, and an input
  // that is such an output is replaced by a clone first. From then on the call's own argument list
  // names tensors that raise "overwritten" when read: every run of the function -- the warmup, the
  // capture and each of their eager fallbacks (rejected capture, input mutation, failed checkpoint,
  // out of memory) -- must use the prepared list. warmup() and record() therefore receive only the
  // prepared list (allocationInputs()), so the caller's list cannot be named by mistake.
  // The inputs a warmup or recording runs on.
  std::vector<at::Tensor> allocationInputs(const FunctionRecord& fn,
                                           const std::vector<at::Tensor>& inputs);
  // `ins`: allocationInputs() of the call. `retried`: this is the one retry after an out-of-memory
  // error that Backend::freeCachedMemory() made room for.
  CallResult warmup(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                    bool retried = false);
  // Note [Errors during a capture]
  // The warmup ran this function on the same kind of inputs without an error, so an error now
  // comes from the capture itself: torch refuses a host read, a pageable host-to-device copy or
  // an unregistered generator with a check before any CUDA call (the stream capture stays
  // valid, the backend ended it cleanly), or the function takes another path when
  // torch.cuda.is_current_stream_capturing() says True. Either way it is a rejected capture:
  // the function runs eagerly from now on, with the reason logged once. Only if the eager run
  // fails too is the error the user's own; then it propagates and the function is not marked
  // eager. torch refuses with RuntimeErrors: an error of another type (a ValueError, a
  // KeyError) is the user's own at once, and so are a keyboard interrupt and an error that the
  // run itself turned into an eager reason (propagatesAsIs() in PythonHooks.h): it propagates as
  // it is, the function is not run a second time (its side effects would happen twice) nor
  // marked eager, and its next call records it again.
  // A recording is three steps; the first two return false with the call's result in
  // `*fallback` when the function runs eagerly instead.
  CallResult record(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                    const CallKey& key, bool retried = false);
  bool copyIntoPlaceholders(FunctionRecord& fn, const std::vector<at::Tensor>& ins,
                            const RunFn& run, const CallKey& key, bool retried, Recording* rec,
                            CallResult* fallback);
  bool capture(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
               const CallKey& key, bool retried, Recording* rec, CallResult* fallback);
  // Note [Copied inputs written back] in WriteBack.h.
  // Note [Publishing a node]
  // The pool is checkpointed before the node is built and enters the tree: a checkpoint that
  // throws (c10's refuses blocks with pending cross-stream events) leaves the tree exactly as it
  // was, and the function runs eagerly from then on. The recording ran the function (CPU) or its
  // graph (CUDA) once, for real: its results are this call's, so that the function's side effects
  // (an in-place update of a static input, a collective) happen once. Nothing that can fail runs
  // after the node is published.
  CallResult publish(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                     Recording&& rec);
  CallResult replay(TreeNode& node, FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                    const RunFn& run);
  // The recording of this call under the current node, or nullptr with why none matches.
  TreeNode* findChild(const FunctionRecord& fn, const CallKey& key, std::string* mismatch) const {
    const TreeNode& parent = current_ != nullptr ? *current_ : root_;
    return parent.matchingChild(
        fn.id, key.kinds, key.key_ptrs, key.key_hash,
        [this](int64_t slot) { return live_.liveInGeneration(slot, policy_.generation()); },
        mismatch);
  }
  // Note [A failed replay]
  // A replay invalidates the live outputs in its footprint first, then copies its inputs in,
  // replays and writes back. An error in those steps (a CPU Python replay that diverges from its
  // recording, a failed input copy or write-back) leaves the tree consistent: the path stays at
  // the node's parent, nothing of the replay is tracked, and what its memory holds is read by
  // nobody (every output over it was invalidated). The error propagates to the caller -- the
  // function may have run (a Python replay), so it is not run a second time -- and when the
  // failure is graphtrees' own (a c10::Error: the divergence, a copy), the function runs eagerly
  // from its next call, with the reason, rather than failing the same way at each call. An error
  // raised by the user's code in a Python replay (any Python exception, RuntimeError included)
  // and an out-of-memory error (Note [Out of memory]) do not mark it. The mutations such a
  // failed Python replay made to copied inputs are not written back (eagerly the caller would
  // see those made before the error).
  // Note [Pinned gradients]
  // A backward's outputs are gradients. Autograd "steals" a gradient whose only reference is its
  // own (it becomes .grad without a copy) and accumulates in place into such buffers; a gradient in
  // pool memory would then be overwritten by the next replay. The tree keeps one extra reference to
  // each backward output until the node runs again or the step ends, so autograd copies gradients
  // into .grad, as it does for any gradient it cannot steal.
  void finishRun(FunctionRecord& fn, const CallResult& result);
  void removeNode(TreeNode* node, const std::string& why);
  // Note [Recordings that can never replay]
  // A recording reads its static inputs (parameters, a StaticCache's tensors) at their addresses.
  // Once one of those storages has been freed, nothing can hand the recording its input again: a
  // new tensor at that address is a new input, and a call with another address re-records. HF's
  // generate() makes a new StaticCache at every call, so without this each call would re-record its
  // decode graph until rerecord_limit made it eager. Such recordings are removed before their
  // function records under the same parent (their memory is reused), and the new recording is not
  // a re-record (even if an older sibling still lives): rerecord_limit counts real churn, static
  // inputs that move while they live.
  // Removes the recordings of `fn` under `parent` whose static inputs were freed; true if any.
  bool replaceStaleRecordings(TreeNode& parent, const FunctionRecord& fn);
  // Note [Out of memory]
  // An allocation that fails while a warmup, the placeholders or a capture allocate in the pool
  // (the device is out of memory, or the pool reached its budget: Note [Memory budget] in
  // Backend.h) leaves the tree and the pool as they were: the failed run's tensors are freed as the
  // error unwinds (the backend undoes a capture), nothing was published, and the segments the
  // failed run added that no checkpoint needs go back to the device. The call then runs eagerly,
  // with the reason logged. Under a budget, recordings off the current path are evicted, least
  // recently used first, until enough segments came free. The function tries again at a later call
  // once an eviction happened (or after reset()); until then it warms up and records nothing and
  // runs eagerly, while its existing recordings still replay.
  // On a backend whose pool returns nothing to the device while it lives (CUDA: returnsSegments()
  // is false), eviction cannot make room: every block a recording "owns" is already free to the
  // allocator (placeholders and replayed outputs own nothing, temporaries are free at the
  // checkpoint), so an out-of-memory error under a budget means the pool is at its budget, and
  // evicting would only destroy one useful recording per call (review 4, #4). There the function
  // runs eagerly, nothing is evicted and nothing retried, until set_memory_budget() changes the
  // budget or reset() frees the tree.
  // Whether a run that ran out of memory is tried once more, after the device's cache outside
  // the pool was given back (Backend::freeCachedMemory()). Not under a budget on a device whose
  // pool gives nothing back: the budget is what failed, and memory cached outside the pool does
  // not change the pool's headroom (Note [Out of memory]).
  bool retryAfterFreeingCache(bool retried) {
    if (retried || (budget_ >= 0 && !backend_->returnsSegments())) return false;
    return backend_->freeCachedMemory();
  }
  CallResult outOfMemory(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                         const RunFn& run, const char* during, const std::string& what);
  // Evicts recordings off the current path that produced none of `inputs`, least recently used
  // first, until the segments released cover what the pool lacked (any bytes when the backend
  // cannot tell) or none is left; returns the bytes released.
  int64_t evictForMemory(const std::vector<at::Tensor>& inputs, std::string* evicted);

  std::unique_ptr<Backend> backend_;
  const int64_t owner_;
  // By function id; erased when the function is evicted (its signature is gone).
  std::unordered_map<int64_t, FunctionState> functions_;
  TreeLock lock_;
  // Note [User code outside the tree lock]: evictions (function id, why) and a memory budget
  // waiting for the call in flight to end, or for the path to move off the recordings.
  std::vector<std::pair<int64_t, std::string>> pending_evictions_;
  std::optional<int64_t> pending_budget_;
  TreeCounters counters_;  // Note [Tree counters]; lent to live_ and bookkeeping_
  PathPolicy policy_;      // Note [Ending a path]
  LiveOutputs live_;
  PoolBookkeeping bookkeeping_;  // Note [Checkpointing]
  TreeNode root_;                // sentinel: its children are the roots
  std::vector<TreeNode*> path_;
  TreeNode* current_ = nullptr;
  PathState state_ = PathState::kNone;
  bool closed_ = false;
  int64_t next_node_id_ = 0;
  uint64_t use_clock_ = 0;  // ticks at every recording and replay (TreeNode::last_used_)
  int64_t budget_ = -1;
  int64_t budget_epoch_ = 0;
  std::unordered_set<int64_t> root_functions_;
  std::unordered_set<std::string> logged_;
  // Outputs of backward functions, held until the node (or the function, for a warmup) runs again
  // or the step ends, so that autograd copies gradients into .grad instead of stealing pool
  // memory (see Note [Pinned gradients]).
  std::unordered_map<int64_t, std::vector<at::Tensor>> pinned_by_node_;
  std::unordered_map<int64_t, std::vector<at::Tensor>> pinned_by_warmup_function_;
};

}  // namespace graphtrees
