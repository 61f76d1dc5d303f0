#include "TreeNode.h"

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_set>

namespace graphtrees {

uint64_t TreeNode::hashKey(int64_t function_id, const std::vector<uintptr_t>& ptrs) {
  // FNV-1a over the words: cheap, and collisions are resolved by keyEquals().
  uint64_t h = 1469598103934665603ULL ^ static_cast<uint64_t>(function_id);
  for (uintptr_t p : ptrs) {
    h ^= static_cast<uint64_t>(p);
    h *= 1099511628211ULL;
    h ^= h >> 29;
  }
  return h;
}

std::unique_ptr<TreeNode> TreeNode::fromRecording(
    int64_t id, TreeNode* parent, Recording&& rec, const std::function<int64_t()>& new_slot,
    const std::function<bool(const c10::StorageImpl*)>& tracked,
    std::vector<int64_t> must_stay_dead, std::vector<c10::Storage>* slot_storages) {
  auto node = std::make_unique<TreeNode>(id, parent);
  node->must_stay_dead_ = std::move(must_stay_dead);
  node->function_id_ = rec.function_id;
  node->function_name_ = rec.function_name;
  node->input_kinds_ = rec.input_kinds;
  node->key_ptrs_ = std::move(rec.key_ptrs);
  node->key_hash_ = rec.key_hash;
  for (size_t i = 0; i < rec.inputs.size(); ++i) {
    if (rec.input_kinds[i] == InputKind::kStatic && rec.inputs[i].has_storage()) {
      node->static_storages_.push_back(rec.inputs[i].storage().getWeakStorageImpl());
    }
  }
  node->footprint_ = rec.graph->footprint();
  for (const auto& ph : rec.plan.placeholders()) {
    const auto begin = reinterpret_cast<uintptr_t>(ph.storage().data());
    node->footprint_.push_back({begin, begin + ph.storage().nbytes()});
  }
  mergeIntervals(&node->footprint_);

  std::unordered_map<const c10::StorageImpl*, int64_t> input_of;
  for (size_t i = 0; i < rec.inputs.size(); ++i) {
    input_of.emplace(rec.inputs[i].storage().unsafeGetStorageImpl(), static_cast<int64_t>(i));
  }
  std::unordered_map<const c10::StorageImpl*, int64_t> slot_index;
  const c10::Device device = rec.graph_device;
  for (const auto& o : rec.outputs) {
    TORCH_CHECK(o.device() == device, "graphtrees: '", rec.function_name, "' returned a tensor on ",
                o.device(), " while its graph runs on ", device,
                "; every tensor output of a graphed function must be on the graph's device.");
    OutputInfo info;
    info.meta = metaOf(o);
    c10::StorageImpl* impl = o.storage().unsafeGetStorageImpl();
    const auto data = reinterpret_cast<uintptr_t>(impl->data());
    const size_t nbytes = impl->nbytes();
    auto in = input_of.find(impl);
    auto known = slot_index.find(impl);
    if (nbytes == 0 || data == 0) {
      info.kind = OutputKind::kEmpty;
    } else if (in != input_of.end() && !(rec.input_kinds[in->second] == InputKind::kCopied &&
                                         !rec.plan.dense()[in->second])) {
      // Keeps eager's aliasing: the output is a view of the caller's own input.
      info.kind = OutputKind::kInputAlias;
      info.index = in->second;
      const auto& src = rec.inputs[in->second];
      info.byte_delta = o.storage_offset() * static_cast<int64_t>(o.itemsize()) -
                        src.storage_offset() * static_cast<int64_t>(src.itemsize());
    } else if (known != slot_index.end()) {
      info.kind = OutputKind::kPool;
      info.index = known->second;
    } else if (node->overlapsFootprint(data, data + nbytes)) {
      info.kind = OutputKind::kPool;
      info.index = static_cast<int64_t>(node->slots_.size());
      slot_index.emplace(impl, info.index);
      node->slots_.push_back({new_slot(), data, nbytes});
      slot_storages->push_back(o.storage());
    } else {
      TORCH_CHECK(!tracked(impl), "graphtrees: '", rec.function_name,
                  "' returned a tensor produced by an earlier graphed call that was not passed "
                  "to it as an argument. Pass that tensor as an argument instead of capturing it.");
      info.kind = OutputKind::kConstant;
      info.index = static_cast<int64_t>(node->constants_.size());
      node->constants_.push_back(o.storage());
    }
    node->outputs_.push_back(std::move(info));
  }
  rec.plan.detach(device);  // Note [A call's inputs] in InputPlan.h
  node->input_plan_ = std::move(rec.plan);
  node->graph_ = std::move(rec.graph);
  rec.outputs.clear();
  rec.inputs.clear();
  return node;
}

TreeNode* TreeNode::addChild(std::unique_ptr<TreeNode> child) {
  TreeNode* raw = child.get();
  children_[raw->key_hash_].push_back(raw);
  owned_.push_back(std::move(child));
  return raw;
}

void TreeNode::removeChild(TreeNode* child) {
  auto it = children_.find(child->key_hash_);
  if (it != children_.end()) {
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), child), v.end());
    if (v.empty()) children_.erase(it);
  }
  // The child is destroyed once the vector is whole again: destroying its graph may wait for the
  // device lock and lend the tree lock out meanwhile (Note [Locks and the GIL] in TreeLock.h), and
  // another thread's tree_info() then walks these children.
  std::unique_ptr<TreeNode> doomed;
  for (auto& p : owned_) {
    if (p.get() == child) doomed = std::move(p);
  }
  owned_.erase(std::remove(owned_.begin(), owned_.end(), nullptr), owned_.end());
}

std::string TreeNode::whyKeyDiffers(const std::vector<InputKind>& kinds,
                                    const std::vector<uintptr_t>& key_ptrs) const {
  size_t k = 0;  // Note [Matching a child]: the key's words, in flat-input order
  for (size_t i = 0; i < kinds.size(); ++i) {
    const InputKind then = input_kinds_[i];
    if (then != kinds[i]) {
      return "input " + std::to_string(i) +
             (then == InputKind::kManaged ? " was an output of the previous call when recorded "
                                            "and is not now"
                                          : " is an output of the previous call now");
    }
    if (then == InputKind::kStatic) {
      if (key_ptrs_[k] != key_ptrs[k])
        return "static input " + std::to_string(i) + " changed address";
      k += 1;
    } else if (then == InputKind::kManaged) {
      if (key_ptrs_[k + 1] != key_ptrs[k + 1]) {
        return "input " + std::to_string(i) + " (an output of an earlier call) changed address";
      }
      k += 2;
    }
  }
  return "";
}

int64_t TreeNode::countChildrenOf(int64_t function_id) const {
  int64_t n = 0;
  for (const auto& c : owned_) n += c->function_id_ == function_id ? 1 : 0;
  return n;
}

bool TreeNode::overlapsFootprint(uintptr_t begin, uintptr_t end) const {
  if (end <= begin) return false;
  // First interval that ends after `begin`.
  auto it = std::upper_bound(footprint_.begin(), footprint_.end(), begin,
                             [](uintptr_t b, const Interval& iv) { return b < iv.end; });
  return it != footprint_.end() && it->begin < end;
}

int64_t TreeNode::poolBytes() const {
  int64_t n = 0;
  for (const auto& iv : footprint_) n += static_cast<int64_t>(iv.end - iv.begin);
  return n;
}

std::vector<at::Tensor> TreeNode::buildOutputs(const std::vector<c10::Storage>& storages,
                                               const std::vector<at::Tensor>& inputs) const {
  std::vector<at::Tensor> out;
  out.reserve(outputs_.size());
  for (const auto& o : outputs_) {
    switch (o.kind) {
      case OutputKind::kPool:
        out.push_back(makeTensor(storages[o.index], o.meta));
        break;
      case OutputKind::kInputAlias: {
        const at::Tensor& in = inputs[o.index];
        const int64_t item = static_cast<int64_t>(c10::elementSize(o.meta.dtype));
        const int64_t bytes =
            in.storage_offset() * static_cast<int64_t>(in.itemsize()) + o.byte_delta;
        TORCH_INTERNAL_ASSERT(bytes >= 0 && bytes % item == 0);
        TensorMeta meta = o.meta;
        meta.storage_offset = bytes / item;
        out.push_back(makeTensor(in.storage(), meta));
        break;
      }
      case OutputKind::kEmpty:
        out.push_back(makeTensor(
            c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, o.meta.device),
                         c10::GetAllocator(o.meta.device.type()), /*resizable=*/true),
            o.meta));
        break;
      case OutputKind::kConstant:
        out.push_back(makeTensor(constants_[o.index], o.meta));
        break;
    }
  }
  return out;
}

TreeNode* leastRecentlyUsedExcept(TreeNode& root, const std::vector<const TreeNode*>& keep) {
  std::unordered_set<const TreeNode*> kept;
  for (const TreeNode* k : keep) {
    for (const TreeNode* a = k; a != nullptr && kept.insert(a).second; a = a->parent()) {
    }
  }
  TreeNode* best = nullptr;
  uint64_t best_used = 0;
  int best_depth = -1;
  // Post-order: a subtree's most recent use is the largest of its nodes'.
  std::function<uint64_t(TreeNode*, int)> visit = [&](TreeNode* n, int depth) -> uint64_t {
    uint64_t used = n->lastUsed();
    for (const auto& c : n->ownedChildren()) used = std::max(used, visit(c.get(), depth + 1));
    if (n != &root && !kept.count(n) &&
        (best == nullptr || used < best_used || (used == best_used && depth > best_depth))) {
      best = n;
      best_used = used;
      best_depth = depth;
    }
    return used;
  };
  visit(&root, 0);
  return best;
}

std::vector<const Checkpoint*> checkpointsBelow(const TreeNode& root) {
  std::vector<const Checkpoint*> out;
  forEachNode(root, [&](const TreeNode& n) {
    if (n.published()) out.push_back(n.checkpoint().pool.get());
    return true;
  });
  return out;
}

TreeNode* TreeNode::matchingChild(int64_t function_id, const std::vector<InputKind>& kinds,
                                  const std::vector<uintptr_t>& key_ptrs, uint64_t key_hash,
                                  const std::function<bool(int64_t)>& alive,
                                  std::string* mismatch) const {
  if (const auto* candidates = childrenFor(key_hash)) {
    for (TreeNode* c : *candidates) {
      if (!c->keyEquals(function_id, key_ptrs)) continue;
      if (std::none_of(c->must_stay_dead_.begin(), c->must_stay_dead_.end(), alive)) return c;
      *mismatch = "an output of an earlier call in this step that was dead when node " +
                  std::to_string(c->id()) + " was recorded is alive now";
    }
  }
  // Explain why no recording of this function under this node matches (rare path).
  for (const auto& c : owned_) {
    if (!mismatch->empty()) break;
    if (c->function_id_ == function_id) *mismatch = c->whyKeyDiffers(kinds, key_ptrs);
  }
  return nullptr;
}

void TreeNode::publish(NodeCheckpoint checkpoint) {
  TORCH_INTERNAL_ASSERT(!published() && checkpoint.pool != nullptr,
                        "a node is published once, with a checkpoint");
  checkpoint_ = std::move(checkpoint);
}

}  // namespace graphtrees
