#pragma once

// The tree manager: one per device, shared by every wrapped callable on that device. It decides,
// for each call, whether to warm up, record a new node or replay an existing one; it owns the
// private pool (through its Backend), tracks the liveness of every output it handed out, restores
// the pool to checkpoints on branch switches and invalidates outputs whose memory a later run
// overwrites. It talks to the device only through the Backend interface.

#include "Backend.h"
#include "TreeNode.h"

#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

// Per wrapped callable (all its signatures): when it last ran, for Note [Ending a path].
struct CallableState {
  uint64_t epoch = 0;
  int64_t last_generation = -1;
  int runs_in_generation = 0;
};

// One function of the tree: a wrapped callable with one call signature. Owned by the wrapper;
// the tree refers to it by id only, so a wrapper may die while its recordings stay in the tree.
struct FunctionRecord {
  // What the function is in a training step (see Note [Pending backward]).
  enum class Mode : uint8_t { kInference, kForward, kBackward };

  int64_t id = 0;
  Mode mode = Mode::kInference;
  std::string name;
  std::vector<uint8_t> is_static;  // per flat input
  int warmup_iters = 1;
  int rerecord_limit = 8;

  // Why the function runs eagerly from now on; empty while it is graphed.
  std::string eager_reason;

  // State that belongs to one tree; reset when the trees are reset (see TreeManager::epoch()).
  uint64_t epoch = 0;
  int warmups = 0;
  int rerecords = 0;
  // Shared by every signature of one wrapped callable (a new shape of a compiled graph is still a
  // call of that graph); never null once the record is used.
  std::shared_ptr<CallableState> callable = std::make_shared<CallableState>();
};

enum class RunKind { kEager, kWarmup, kRecord, kReplay };

struct CallResult {
  std::vector<at::Tensor> outputs;
  RunKind kind = RunKind::kEager;
};

// Restoring a pool checkpoint failed (PyTorch issue #140419: setCheckpointPoolState can assert
// "Expected curr_block->next == nullptr"). Thrown before the call ran the user's function; the
// caller retires the tree and runs the call again on a fresh one.
class RestoreFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct NodeInfo {
  int64_t id = 0;
  int64_t parent = -1;
  int64_t function_id = 0;
  std::string function;
  std::vector<int64_t> children;
  int64_t pool_bytes = 0;
  int64_t num_outputs = 0;
  std::string input_kinds;  // one letter per flat input: S(tatic), M(anaged), C(opied)
  int64_t live_outputs = 0;
  int64_t replays = 0;
  bool on_current_path = false;
};

struct TreeInfo {
  std::string device;
  std::string backend;
  std::string state = "none";
  int64_t generation = 0;
  int64_t num_nodes = 0;
  int64_t num_roots = 0;
  int64_t num_checkpoints = 0;
  int64_t num_rerecords = 0;
  int64_t num_fallbacks = 0;
  int64_t num_warmups = 0;
  int64_t num_recordings = 0;
  int64_t num_replays = 0;
  int64_t num_invalidations = 0;
  int64_t num_evictions = 0;
  int64_t num_migrations = 0;  // gradients copied out of the pool instead of invalidated
  int64_t retired_trees = 0;   // trees of this device retired after a failed restore
  int64_t leaked_bytes = 0;    // pool bytes a half-done restore left unreachable until reset()
  bool pending_backward = false;
  int64_t live_outputs = 0;
  int64_t current_node = -1;
  PoolStats pool;
  std::vector<NodeInfo> nodes;
};

class TreeManager {
 public:
  // The manager of `device`, created on first use. Returns nullptr (and sets `why_not`) when no
  // backend can serve the device. With create=false returns nullptr if none exists.
  // Shared: a call in flight keeps its tree alive even if another thread resets the trees.
  static std::shared_ptr<TreeManager> get(c10::Device device, bool create, std::string* why_not);
  // Frees every tree: nodes, graphs and pools. Live outputs are invalidated. A tree that a call
  // on another thread is using goes when that call ends. Refused inside a graphed call.
  static void resetAll();
  // Takes `tree` out of service after a RestoreFailed: the next get() creates a fresh tree (and
  // pool) for the device; the retired one, with its live outputs, stays until resetAll().
  static void retire(TreeManager* tree, const std::string& why);
  // Testing hook: the next `n` restores fail with RestoreFailed before touching anything.
  static void failNextRestores(int n);
  // Starts a new generation in every tree at its next call.
  static void markStepBegin();
  // Increases each time the trees are reset; function records compare against it.
  static uint64_t epoch();
  // True while the calling thread is inside a tree call (a nested wrapped call runs eagerly).
  static bool inCall();
  // Called (without the manager's lock) when untracked pool allocations block a restore, so that
  // the Python layer can collect garbage cycles before the check is repeated.
  static void setCollectGarbageHook(std::function<void()> hook);
  // When on, every call ends by checking checkPoolInvariants() (a debugging aid used by the
  // tests; costs a walk over the pool per call).
  static void setDebugChecks(bool on);

  explicit TreeManager(std::unique_ptr<Backend> backend);
  // Calls close(); errors become warnings.
  ~TreeManager();
  // Invalidates every live output, frees every node and graph and releases the pool. Errors met
  // after the pool is released (an asynchronous device error surfacing at the final sync) are
  // thrown. Idempotent.
  void close();

  // Runs one call of `fn` on flat `inputs`. `run` calls the user's callable on a flat input list
  // and returns its flat tensor outputs. The caller holds mutex().
  CallResult call(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);

  // Counts an eager fallback decided outside the tree (logged once per function and reason).
  void noteFallback(FunctionRecord& fn, const std::string& reason);

  // Removes every recording of function `function_id` (and the subtrees below them), invalidating
  // their live outputs, so that their pool memory is reused. Returns false, removing nothing,
  // while one of them is on the current path.
  bool evictFunction(int64_t function_id, const std::string& why);

  // With debug checks on (setDebugChecks), asserts checkPoolInvariants(). Called by the wrapper
  // once the call's results are in the caller's hands.
  void debugCheck(const FunctionRecord& fn, RunKind kind);

  TreeInfo info();
  std::string toDot();
  // True iff the pool's allocated blocks are exactly the live outputs that own pool memory, and
  // (when no replay happened since the last restore) every live output owns its block.
  bool checkPoolInvariants(std::string* why);
  c10::Device device() const { return backend_->device(); }
  std::recursive_mutex& mutex() { return mutex_; }

 private:
  struct Tracked {
    c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
    uintptr_t ptr = 0;
    size_t nbytes = 0;
    int64_t generation = 0;
    TreeNode* node = nullptr;  // nullptr for warmup outputs
    std::string producer;      // function name, for error messages
    bool migrate = false;      // a gradient: copied out of the pool instead of invalidated
  };
  enum class PathState { kNone, kWarmup, kRecording, kExecution };

  struct Classified {
    std::vector<InputKind> kinds;
    std::vector<uintptr_t> key_ptrs;
    uint64_t key_hash = 0;
    bool consumes_generation_output = false;
  };

  CallResult callImpl(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);
  Classified classify(const FunctionRecord& fn, const std::vector<at::Tensor>& inputs);
  void resetFunctionIfStale(FunctionRecord& fn);
  bool allGenerationOutputsDead();
  void endPath(const std::string& why, const std::vector<at::Tensor>& spare);
  void prepareToAllocate(std::vector<at::Tensor>* inputs, const std::vector<uint8_t>& is_static);
  void restoreCheckpoint(TreeNode* node, std::vector<at::Tensor>* inputs,
                         const std::vector<uint8_t>& is_static);
  void cloneInputsAtRisk(std::vector<at::Tensor>* inputs, const std::vector<uint8_t>& is_static,
                         const std::unordered_set<int64_t>& slots_at_risk);
  using LiveMap = std::unordered_map<int64_t, Tracked>;
  // Frees the block `entry` owns (if any) and makes every access to its storage raise.
  void invalidate(const Tracked& entry, const std::string& by);
  // Whether the entry no longer describes pool memory: its storage died, or it was moved out of
  // the pool (resize_(), share_memory_()), in which case its data is its own now.
  static bool gone(const Tracked& entry);
  LiveMap::iterator eraseEntry(LiveMap::iterator it);
  void trackStorage(const c10::Storage& storage, int64_t slot, TreeNode* node,
                    const FunctionRecord& fn);
  // Gives a live storage fresh memory outside the pool with its current contents (Note
  // [Pinned gradients]).
  void migrate(const Tracked& entry);
  bool ownsPoolBlock(const c10::StorageImpl& storage) const;
  // If `storage` owns a pool block, makes its deleter a no-op (the block stays allocated for the
  // caller to free or restore) and returns true.
  bool disown(c10::StorageImpl& storage) const;
  bool deadBeforeHolds(const TreeNode& node);
  void pruneDead();

  CallResult runEager(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run,
                      const std::string& reason);
  CallResult warmup(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run);
  CallResult record(FunctionRecord& fn, const std::vector<at::Tensor>& inputs, const RunFn& run,
                    const Classified& cls);
  CallResult replay(TreeNode& node, FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                    const RunFn& run);
  TreeNode* findChild(const FunctionRecord& fn, const Classified& cls, std::string* mismatch);
  void noteGenerationRun(FunctionRecord& fn);
  void finishRun(FunctionRecord& fn, const CallResult& result);
  void removeNode(TreeNode* node, const std::string& why);

  std::unique_ptr<Backend> backend_;
  std::recursive_mutex mutex_;
  TreeNode root_;  // sentinel: its children are the roots
  std::vector<TreeNode*> path_;
  TreeNode* current_ = nullptr;
  PathState state_ = PathState::kNone;
  bool dirty_ = false;  // a replay happened since the pool's bookkeeping was last exact
  bool closed_ = false;
  int64_t generation_ = 0;
  int64_t seen_step_ = 0;
  int64_t next_node_id_ = 0;
  int64_t next_slot_id_ = 1;
  std::vector<int64_t> generation_slots_;
  LiveMap live_;  // slot -> the live storage that holds it
  std::unordered_map<const c10::StorageImpl*, int64_t> slot_of_;
  std::unordered_set<int64_t> root_functions_;
  std::unordered_set<std::string> logged_;
  // A forward ran and its backward has not run yet: no new generation starts on its own.
  int64_t pending_forwards_ = 0;
  // Outputs of backward functions, held until the node runs again or the step ends, so that
  // autograd copies gradients into .grad instead of stealing pool memory (see Note [Pinned
  // gradients]).
  std::unordered_map<int64_t, std::vector<at::Tensor>> pinned_;

  int64_t num_checkpoints_ = 0;
  int64_t num_rerecords_ = 0;
  int64_t num_fallbacks_ = 0;
  int64_t num_warmups_ = 0;
  int64_t num_recordings_ = 0;
  int64_t num_replays_ = 0;
  int64_t num_invalidations_ = 0;
  int64_t num_evictions_ = 0;
  int64_t num_migrations_ = 0;
  int64_t num_nodes_ = 0;
};

}  // namespace graphtrees
