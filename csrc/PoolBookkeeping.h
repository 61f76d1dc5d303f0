#pragma once

// Keeps the pool's bookkeeping describing the memory that live outputs occupy, which replays
// break (they write memory without telling the allocator): the checkpoint-and-restore protocol
// of Note [Checkpointing], and what a failed restore leaves behind (Note [Failed restores]).

#include "ArgumentAliases.h"
#include "Backend.h"
#include "LiveOutputs.h"
#include "TreeCounters.h"
#include "TreeNode.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace graphtrees {

// Restoring a pool checkpoint failed (PyTorch issue #140419: setCheckpointPoolState can assert
// "Expected curr_block->next == nullptr"). Thrown before the call ran the user's function; the
// registry retires the tree and runs the call again on a fresh one.
class RestoreFailed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PoolBookkeeping {
 public:
  // `counters`: the tree's (num_checkpoints, bytes_released), Note [Tree counters].
  PoolBookkeeping(Backend& backend, LiveOutputs& live, TreeCounters& counters)
      : backend_(backend), live_(live), counters_(counters) {}

  // A replay wrote pool memory without telling the allocator.
  void markStale() { stale_ = true; }
  // A recording just ended: the allocator saw every allocation.
  void markExact() { stale_ = false; }
  bool exact() const { return !stale_; }

  // Called before anything allocates in the pool (a warmup, placeholders, a capture). If replays
  // made the bookkeeping stale, restores the checkpoint of `current` (the node the path continues
  // from) or, when the path ended, invalidates the live outputs that own nothing. Live outputs it
  // must invalidate that are also this call's inputs are replaced by clones in `inputs` (a static
  // input cannot be: that is an error), one clone per tensor (`aliases`: Note [Argument
  // aliases]). Throws RestoreFailed when the restore fails.
  void prepareToAllocate(TreeNode* current, std::vector<at::Tensor>* inputs,
                         const std::vector<uint8_t>& is_static, const ArgumentAliases& aliases);

  // The pool's bookkeeping now (right after a recording); throws what the backend's throws.
  std::shared_ptr<Checkpoint> checkpointPool() { return backend_.checkpoint(); }
  // The checkpoint of `node`, just recorded and not yet in the tree: `pool` (checkpointPool()
  // right after its recording), and the live slots a restore to it keeps (those live now and the
  // node's own).
  NodeCheckpoint checkpoint(std::shared_ptr<Checkpoint> pool, const TreeNode& node);

  // At the end of a warmup: moves state the function created and kept without returning it out
  // of the pool (Note [Kept state] in PoolBookkeeping.cpp).
  void moveKeptStateOutOfPool(const std::string& function_name);
  // Note [Blocks a collective holds].
  void waitForUnownedBlocks();
  // LiveOutputs::checkInvariants, once a collective's worker had the time to let go of the
  // run's blocks (Note [Blocks a collective holds]).
  bool checkInvariants(std::string* why);

  // Returns the pool's free segments that no checkpoint of a node below `root` includes (Note
  // [Memory budget] in Backend.h); the bytes freed.
  int64_t releaseUnneededSegments(const TreeNode& root);

  // Pool bytes a restore that failed half-way left unreachable.
  int64_t leakedBytes() const { return leaked_bytes_; }

 private:
  void restore(TreeNode* node, std::vector<at::Tensor>* inputs,
               const std::vector<uint8_t>& is_static, const ArgumentAliases& aliases);
  void cloneInputsAtRisk(std::vector<at::Tensor>* inputs, const std::vector<uint8_t>& is_static,
                         const ArgumentAliases& aliases,
                         const std::unordered_set<int64_t>& slots_at_risk) const;

  Backend& backend_;
  LiveOutputs& live_;
  bool stale_ = false;
  TreeCounters& counters_;
  int64_t leaked_bytes_ = 0;
};

}  // namespace graphtrees
