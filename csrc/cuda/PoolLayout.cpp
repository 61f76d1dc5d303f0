#include "cuda/PoolLayout.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <unordered_set>

namespace graphtrees {

namespace CCA = c10::cuda::CUDACachingAllocator;

PoolLayout PoolLayout::of(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) {
  PoolLayout out;
  const CCA::SnapshotInfo snap = CCA::snapshot(pool, /*include_traces=*/false);
  for (const auto& seg : snap.segments) {
    const bool ours = seg.owner_private_pool_id.first == pool.first &&
                      seg.owner_private_pool_id.second == pool.second;
    if (seg.device != device || !ours) continue;
    Segment s{{seg.address, seg.address + seg.total_size}, {}};
    uintptr_t addr = seg.address;
    for (const auto& b : seg.blocks) {
      s.blocks.push_back({addr, b.size, b.allocated});
      addr += b.size;
    }
    out.segments_.push_back(std::move(s));
  }
  return out;
}

std::vector<Interval> PoolLayout::ranges() const {
  std::vector<Interval> out;
  for (const auto& s : segments_) out.push_back(s.range);
  mergeIntervals(&out);
  return out;
}

std::vector<void*> PoolLayout::allocatedBlocks() const {
  std::vector<void*> out;
  for (const auto& s : segments_) {
    for (const auto& b : s.blocks) {
      if (b.allocated) out.push_back(reinterpret_cast<void*>(b.ptr));
    }
  }
  return out;
}

PoolStats PoolLayout::stats() const {
  PoolStats st;
  for (const auto& s : segments_) {
    st.segments += 1;
    st.reserved_bytes += static_cast<int64_t>(s.range.end - s.range.begin);
    for (const auto& b : s.blocks) {
      st.blocks += 1;
      if (b.allocated) {
        st.allocated_blocks += 1;
        st.allocated_bytes += static_cast<int64_t>(b.size);
      }
    }
  }
  return st;
}

std::set<std::pair<uintptr_t, size_t>> PoolLayout::allocated() const {
  std::set<std::pair<uintptr_t, size_t>> out;
  for (const auto& s : segments_) {
    for (const auto& b : s.blocks) {
      if (b.allocated) out.emplace(b.ptr, b.size);
    }
  }
  return out;
}

std::vector<Interval> PoolLayout::footprintSince(
    const std::set<std::pair<uintptr_t, size_t>>& before, const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const c10::StorageImpl*> input_storages;
  for (const auto& t : inputs) {
    if (t.defined() && t.has_storage()) input_storages.insert(t.storage().unsafeGetStorageImpl());
  }
  std::vector<Interval> output_ranges;
  for (const auto& o : outputs) {
    if (!o.defined() || !o.has_storage() ||
        input_storages.count(o.storage().unsafeGetStorageImpl())) {
      continue;
    }
    const auto begin = reinterpret_cast<uintptr_t>(o.storage().data());
    if (begin != 0) output_ranges.push_back({begin, begin + o.storage().nbytes()});
  }
  std::vector<Interval> kept;
  for (const auto& s : segments_) {
    for (const auto& b : s.blocks) {
      if (!b.allocated || !before.count({b.ptr, b.size})) continue;
      const bool holds_output =
          std::any_of(output_ranges.begin(), output_ranges.end(),
                      [&](const Interval& r) { return r.begin < b.ptr + b.size && r.end > b.ptr; });
      if (!holds_output) kept.push_back({b.ptr, b.ptr + b.size});
    }
  }
  mergeIntervals(&kept);
  std::vector<Interval> footprint;
  for (const auto& seg : ranges()) {
    uintptr_t cursor = seg.begin;
    for (const auto& p : kept) {
      if (p.end <= seg.begin || p.begin >= seg.end) continue;
      if (p.begin > cursor) footprint.push_back({cursor, p.begin});
      cursor = std::max(cursor, p.end);
    }
    if (cursor < seg.end) footprint.push_back({cursor, seg.end});
  }
  mergeIntervals(&footprint);
  return footprint;
}

}  // namespace graphtrees
