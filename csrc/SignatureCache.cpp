#include "SignatureCache.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace graphtrees {

std::shared_ptr<Signature> SignatureCache::find(const std::string& key) {
  ++use_counter_;
  auto it = signatures_.find(key);
  if (it == signatures_.end()) return nullptr;
  it->second->last_used = use_counter_;
  return it->second;
}

void SignatureCache::insert(const std::string& key, std::shared_ptr<Signature> sig) {
  sig->last_used = use_counter_;
  signatures_.emplace(key, std::move(sig));
}

// Note [Eviction without thrashing]
// With max_recorded_shapes, a new signature normally evicts the least recently used one. When
// more signatures cycle than fit, that throws every recording away before it replays (a warmup
// and a recording per call, nothing replayed). So once max_recorded_shapes evictions in a row
// threw away recordings that never replayed, the callable is thrashing: the recorded signatures
// are kept and a new one runs eagerly (logged once, with the advice to use buckets) -- unless
// the least recently used one has gone unused for kIdleFactor * max_recorded_shapes calls, which
// is how a workload that moved on to other shapes gets them recorded. An eviction of a recording
// that did replay ends the streak. Backward graphs keep plain LRU: their signatures follow their
// forwards', and a forward that runs eagerly must not leave its graphed backward waiting.
bool SignatureCache::makeRoom(const std::function<bool(const Signature& victim)>& evict) {
  if (max_ <= 0 || signatures_.size() < static_cast<size_t>(max_)) return true;
  constexpr uint64_t kIdleFactor = 4;
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& kv : signatures_) order.emplace_back(kv.second->last_used, kv.first);
  std::sort(order.begin(), order.end());
  const bool thrashing = !plain_lru_ && wasted_evictions_ >= max_;
  if (thrashing && !order.empty() &&
      use_counter_ - order.front().first < kIdleFactor * static_cast<uint64_t>(max_)) {
    return false;
  }
  for (const auto& candidate : order) {
    auto it = signatures_.find(candidate.second);
    if (!evict(*it->second)) continue;
    wasted_evictions_ = it->second->record.replays == 0 ? wasted_evictions_ + 1 : 0;
    signatures_.erase(it);
    return true;
  }
  return true;  // every one is on the current path: the bound is exceeded for now
}

}  // namespace graphtrees
