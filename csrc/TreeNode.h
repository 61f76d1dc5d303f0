#pragma once

// One recorded graph in the tree, with everything needed to replay it without running Python
// (on CUDA) and to rebuild its outputs: how each input is fed, where each output lives, which
// memory the recording wrote, and the pool checkpoint taken right after it was recorded.

#include "Backend.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

// How a recorded graph receives one flat tensor input.
enum class InputKind : uint8_t {
  kStatic,   // parameter, buffer or static_argnums: used in place, address checked
  kManaged,  // live output of an earlier node on the path: used in place, never copied
  kCopied,   // anything else: copied into a placeholder allocated in the pool at recording
};

struct TensorMeta {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
};

enum class OutputKind : uint8_t {
  kPool,        // lives in a block this node's recording allocated (slot `index`)
  kInputAlias,  // a view of flat input `index`, `byte_delta` bytes from that input's data
  kEmpty,       // no storage bytes: rebuilt as an empty tensor
  kConstant,    // a view of a tensor that lives outside the pool (closure, unregistered attr)
};

struct OutputInfo {
  OutputKind kind = OutputKind::kPool;
  int64_t index = 0;
  int64_t byte_delta = 0;
  TensorMeta meta;
};

// A block of pool memory that holds output storage: the same address on every replay.
struct Slot {
  int64_t id = 0;
  uintptr_t ptr = 0;
  size_t nbytes = 0;
};

class TreeNode {
 public:
  TreeNode(int64_t id, TreeNode* parent) : id_(id), parent_(parent) {}

  int64_t id() const { return id_; }
  TreeNode* parent() const { return parent_; }

  // The key children are found by: function id plus the addresses of static and managed inputs.
  static uint64_t hashKey(int64_t function_id, const std::vector<uintptr_t>& ptrs);
  bool keyEquals(int64_t function_id, const std::vector<uintptr_t>& ptrs) const {
    return function_id_ == function_id && key_ptrs_ == ptrs;
  }

  // The first child recorded for this key whose expectations hold, or nullptr.
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

  // Whether [begin, end) overlaps memory this node's replay writes.
  bool overlapsFootprint(uintptr_t begin, uintptr_t end) const;

  // Rebuilds the outputs over `storages` (one per slot) and the call's inputs.
  std::vector<at::Tensor> buildOutputs(const std::vector<c10::Storage>& storages,
                                       const std::vector<at::Tensor>& inputs) const;

  int64_t poolBytes() const;

  // --- recorded state (filled by the tree manager when recording) ---
  int64_t function_id_ = 0;
  std::string function_name_;
  std::unique_ptr<Graph> graph_;
  std::vector<InputKind> input_kinds_;
  std::vector<int64_t> copied_inputs_;    // flat indices of copied inputs
  std::vector<at::Tensor> placeholders_;  // non-owning views, parallel to copied_inputs_
  std::vector<uintptr_t> key_ptrs_;
  uint64_t key_hash_ = 0;
  std::vector<OutputInfo> outputs_;
  std::vector<Slot> slots_;
  std::vector<c10::Storage> constants_;  // storages of kConstant outputs
  std::vector<Interval> footprint_;      // sorted, merged
  std::shared_ptr<Checkpoint> checkpoint_;
  std::vector<int64_t> checkpoint_live_slots_;  // sorted slot ids live when checkpointed
  std::vector<int64_t> dead_before_;            // ancestor slots that were dead at recording
  int64_t replays_ = 0;

 private:
  int64_t id_;
  TreeNode* parent_;
  std::unordered_map<uint64_t, std::vector<TreeNode*>> children_;
  std::vector<std::unique_ptr<TreeNode>> owned_;
};

// Builds a tensor over `storage` with the given metadata (no allocation, no dispatch).
at::Tensor makeTensor(c10::Storage storage, const TensorMeta& meta);
TensorMeta metaOf(const at::Tensor& t);

}  // namespace graphtrees
