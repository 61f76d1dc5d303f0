#include "TreeNode.h"

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>

#include <algorithm>

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
  owned_.erase(
      std::remove_if(owned_.begin(), owned_.end(),
                     [child](const std::unique_ptr<TreeNode>& p) { return p.get() == child; }),
      owned_.end());
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

at::Tensor makeTensor(c10::Storage storage, const TensorMeta& meta) {
  c10::DispatchKeySet keys(c10::computeDispatchKey(meta.dtype, c10::kStrided, meta.device));
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys,
                                                    c10::scalarTypeToTypeMeta(meta.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(meta.sizes, meta.strides, meta.storage_offset);
  return t;
}

TensorMeta metaOf(const at::Tensor& t) {
  TensorMeta m;
  m.sizes = t.sizes().vec();
  m.strides = t.strides().vec();
  m.storage_offset = t.storage_offset();
  m.dtype = t.scalar_type();
  m.device = t.device();
  return m;
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

}  // namespace graphtrees
