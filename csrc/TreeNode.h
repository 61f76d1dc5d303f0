#pragma once

// One recorded graph in the tree, with everything needed to replay it without running Python
// (on CUDA) and to rebuild its outputs: how each input is fed, where each output lives, which
// memory the recording wrote, and the pool checkpoint taken right after it was recorded.
//
// Note [Matching a child]
// A call continues the path at a child of the current node (or at a root) whose key matches:
//   the function id, then key_ptrs_, in flat-input order:
//     a static input contributes one word, its data pointer (a moved parameter re-records);
//     a managed input contributes two words, its flat index and its data pointer (an output of
//     an earlier node used in place must be the same block it was when recorded);
//     a copied input contributes nothing (it is copied into the placeholder wherever it is).
// Children are bucketed by a hash of the key; keyEquals() settles collisions. A matching child
// is taken only while its must_stay_dead_ slots are still dead: outputs of ancestors that were
// dead when it was recorded, whose memory its recording may have reused.
//
// Note [Footprints and stale outputs]
// A node's footprint is every byte range its recording wrote through the allocator: outputs,
// temporaries and the copied inputs' placeholders (sorted and merged). A replay writes inside it
// and nowhere else, without telling the allocator. So before a replay, every live output that
// overlaps the footprint is stale and is invalidated (Note [Output ownership]); a live output
// outside it stays valid however many replays run. An input that lies inside the footprint is
// cloned before the placeholders are written, so that the replay reads what the caller passed.

#include "Backend.h"
#include "InputPlan.h"
#include "Recording.h"
#include "TensorMeta.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

// What a restore to a node needs (Note [Checkpointing] in PoolBookkeeping.cpp): the pool's
// bookkeeping right after the node was recorded, and the output slots that were live then (a
// restore keeps exactly those). Taken by PoolBookkeeping::checkpoint(), set once by publish().
struct NodeCheckpoint {
  std::shared_ptr<Checkpoint> pool;
  std::vector<int64_t> live_slots;  // sorted
};

class TreeNode {
 public:
  TreeNode(int64_t id, TreeNode* parent) : id_(id), parent_(parent) {}

  // Builds a node from a recording: classifies each output (a pool slot of its own, a view of an
  // input, empty, or a constant outside the pool), computes the footprint and turns the
  // placeholders into non-owning views. `new_slot` hands out slot ids; `tracked(storage)` says
  // whether a storage is a live output of an earlier call (returning one that was not passed in
  // is an error). `slot_storages` receives the storage of each slot, for the caller to track.
  // `must_stay_dead`: the ancestors' slots that were dead at the recording (Note [Matching a
  // child]). The node enters the tree with publish().
  static std::unique_ptr<TreeNode> fromRecording(
      int64_t id, TreeNode* parent, Recording&& rec, const std::function<int64_t()>& new_slot,
      const std::function<bool(const c10::StorageImpl*)>& tracked,
      std::vector<int64_t> must_stay_dead, std::vector<c10::Storage>* slot_storages);

  int64_t id() const { return id_; }
  TreeNode* parent() const { return parent_; }

  // Sets the node's checkpoint; once, before the node is reachable from the tree (Note
  // [Publishing a node] in TreeManager.h).
  void publish(NodeCheckpoint checkpoint);
  const NodeCheckpoint& checkpoint() const { return checkpoint_; }
  bool published() const { return checkpoint_.pool != nullptr; }
  // The node was recorded (replayed = false) or replayed at tick `clock` of the tree's use clock.
  void markRun(uint64_t clock, bool replayed) {
    last_used_ = clock;
    replays_ += replayed ? 1 : 0;
  }

  int64_t functionId() const { return function_id_; }
  const std::string& functionName() const { return function_name_; }
  const std::vector<InputKind>& inputKinds() const { return input_kinds_; }
  // How the copied inputs are fed and written back (Note [A call's inputs] in InputPlan.h).
  const InputPlan& inputPlan() const { return input_plan_; }
  const std::vector<Slot>& slots() const { return slots_; }
  int64_t numOutputs() const { return static_cast<int64_t>(outputs_.size()); }
  const std::vector<int64_t>& mustStayDead() const { return must_stay_dead_; }
  int64_t replays() const { return replays_; }
  uint64_t lastUsed() const { return last_used_; }
  // Whether every static input the recording read is still alive (Note [Recordings that can
  // never replay] in TreeManager.h).
  bool staticInputsAlive() const {
    return std::none_of(
        static_storages_.begin(), static_storages_.end(),
        [](const c10::weak_intrusive_ptr<c10::StorageImpl>& w) { return w.expired(); });
  }
  Graph& graph() const { return *graph_; }
  std::shared_ptr<const Graph> sharedGraph() const { return graph_; }

  // The key children are found by (Note [Matching a child]).
  static uint64_t hashKey(int64_t function_id, const std::vector<uintptr_t>& ptrs);
  bool keyEquals(int64_t function_id, const std::vector<uintptr_t>& ptrs) const {
    return function_id_ == function_id && key_ptrs_ == ptrs;
  }

  // Why this node's key does not match a call with input kinds `kinds` and key `key_ptrs` of the
  // same function (for the re-record log), or "" if it does.
  std::string whyKeyDiffers(const std::vector<InputKind>& kinds,
                            const std::vector<uintptr_t>& key_ptrs) const;

  // The child recorded for a call of `function_id` with this key (Note [Matching a child]) whose
  // must-stay-dead slots are all dead (`alive(slot)` says), or nullptr, with `*mismatch` saying
  // why no child of the function matches.
  TreeNode* matchingChild(int64_t function_id, const std::vector<InputKind>& kinds,
                          const std::vector<uintptr_t>& key_ptrs, uint64_t key_hash,
                          const std::function<bool(int64_t)>& alive, std::string* mismatch) const;

  // The children recorded under this key hash (in recording order), or nullptr.
  const std::vector<TreeNode*>* childrenFor(uint64_t hash) const {
    auto it = children_.find(hash);
    return it == children_.end() ? nullptr : &it->second;
  }
  TreeNode* addChild(std::unique_ptr<TreeNode> child);
  const std::vector<std::unique_ptr<TreeNode>>& ownedChildren() const { return owned_; }
  // Destroys `child` and its subtree.
  void removeChild(TreeNode* child);
  void clearChildren() {
    children_.clear();
    owned_.clear();
  }
  // Number of recordings of `function_id` directly under this node.
  int64_t countChildrenOf(int64_t function_id) const;

  // Whether [begin, end) overlaps memory this node's replay writes (Note [Footprints and stale
  // outputs]).
  bool overlapsFootprint(uintptr_t begin, uintptr_t end) const;

  // Rebuilds the outputs over `storages` (one per slot) and the call's inputs.
  std::vector<at::Tensor> buildOutputs(const std::vector<c10::Storage>& storages,
                                       const std::vector<at::Tensor>& inputs) const;

  int64_t poolBytes() const;

 private:
  // --- recorded state (filled by fromRecording(); the checkpoint by publish()) ---
  int64_t function_id_ = 0;
  std::string function_name_;
  std::shared_ptr<Graph> graph_;
  std::vector<InputKind> input_kinds_;
  InputPlan input_plan_;  // Recording::plan, its placeholders non-owning
  std::vector<uintptr_t> key_ptrs_;
  uint64_t key_hash_ = 0;
  std::vector<OutputInfo> outputs_;
  std::vector<Slot> slots_;
  std::vector<c10::Storage> constants_;  // storages of kConstant outputs
  std::vector<Interval> footprint_;      // sorted, merged
  NodeCheckpoint checkpoint_;
  // Ancestor slots dead at the recording (Note [Matching a child]).
  std::vector<int64_t> must_stay_dead_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> static_storages_;  // what it read in place
  int64_t replays_ = 0;
  uint64_t last_used_ = 0;  // the tree's use clock at its recording or latest replay

  int64_t id_;
  TreeNode* parent_;
  std::unordered_map<uint64_t, std::vector<TreeNode*>> children_;
  std::vector<std::unique_ptr<TreeNode>> owned_;
};

// For eviction (Note [Out of memory] in TreeManager.h): the node below `root` whose subtree was
// used least recently (by TreeNode::last_used_; the deeper one on a tie) among the nodes that are
// neither in `keep` nor an ancestor of one; nullptr if none.
TreeNode* leastRecentlyUsedExcept(TreeNode& root, const std::vector<const TreeNode*>& keep);
// The checkpoints of every node below `root`.
std::vector<const Checkpoint*> checkpointsBelow(const TreeNode& root);

// Visits every node below `root` in pre-order, children in recording order; a visit that returns
// false skips that node's subtree. `Node` is TreeNode or const TreeNode.
template <typename Node, typename Visit>
void forEachNode(Node& root, Visit&& visit) {
  std::vector<Node*> stack;
  auto pushChildren = [&stack](Node& n) {
    const auto& children = n.ownedChildren();
    for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push_back(it->get());
  };
  pushChildren(root);
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (visit(*n)) pushChildren(*n);
  }
}

}  // namespace graphtrees
