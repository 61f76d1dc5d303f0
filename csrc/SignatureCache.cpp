#include "SignatureCache.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

namespace graphtrees {

// Note [Results of a signature]
// The first run of a signature (a warmup) learns the structure of its results, which every
// replay rebuilds around the replayed tensors, and tells whether they can be graphed at all. A
// result type graphtrees cannot rebuild (transformers' DynamicCache, say) makes the function
// eager, like an argument it cannot graph: this call returns the real result (the warmup's pool
// tensors it holds are moved out of the pool as kept state), later ones run eagerly. So do
// results that need autograd although no argument does (the function reaches parameters through
// a closure: cudagraphify(lambda x: lin(x))): a replay would return them detached, and their
// .grad would never be set. A function that runs eagerly anyway needs no result structure.
// Later runs (warmups, the recording) must return the same structure and equal non-tensor
// values: a recorded graph returns the values it saw when it was recorded. One that changes
// makes the function eager and raises (the structure is part of what the call signature, Note
// [The call signature] in CallSignature.h, cannot see).
std::vector<at::Tensor> Signature::learnResults(py::handle out, py::handle args,
                                                py::handle kwargs) {
  const std::string& fname = record.name;
  std::vector<at::Tensor> outs;
  if (!spec) {
    if (!record.eager_reason.empty()) return outs;
    try {
      spec = std::make_unique<OutputSpec>(OutputSpec::flatten(out, &outs, fname, args, kwargs));
    } catch (const py::type_error& e) {
      const std::string what = e.what();
      record.eager_reason =
          what.substr(what.find(": ") + 2) +
          (what.find("Cache") != std::string::npos
               ? " (for a transformers model, pass use_cache=False, or pass a StaticCache "
                 "as its cache argument: a cache passed in is returned as it is)"
               : "");
      outs.clear();
    }
    if (at::GradMode::is_enabled() &&
        std::any_of(outs.begin(), outs.end(),
                    [](const at::Tensor& t) { return t.requires_grad(); })) {
      record.eager_reason =
          "its results require grad through tensors that are not its arguments "
          "(parameters reached through a closure): pass the module to "
          "graphtrees.cudagraphify (its parameters are then inputs), train through "
          "torch.compile(backend=\"graphtrees\"), or call it under torch.no_grad()";
      outs.clear();
    }
    return outs;
  }
  OutputSpec now = OutputSpec::flatten(out, &outs, fname, args, kwargs);
  if (record.eager_reason.empty() && !spec->sameAs(now)) {
    record.eager_reason = "its non-tensor results change between calls (first " + spec->describe() +
                          ", now " + now.describe() + ")";
    throw std::runtime_error(
        "graphtrees: '" + fname + "' returned " + now.describe() +
        " where an earlier call returned " + spec->describe() +
        ". A recorded graph returns the non-tensor values it saw when it was recorded, so "
        "results whose structure or Python values change between calls cannot be graphed; "
        "return such values as tensors. This function runs eagerly from now on.");
  }
  return outs;
}

std::shared_ptr<Signature> SignatureCache::find(const std::string& key, bool* trim_due) {
  std::lock_guard<std::mutex> guard(mutex_);
  ++use_counter_;
  if (trim_due != nullptr) {
    *trim_due =
        max_ > 0 && signatures_.size() > static_cast<size_t>(max_) && use_counter_ >= next_trim_at_;
  }
  auto it = signatures_.find(key);
  if (it == signatures_.end()) return nullptr;
  it->second->last_used = use_counter_;
  return it->second;
}

std::shared_ptr<Signature> SignatureCache::peek(const std::string& key) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = signatures_.find(key);
  return it == signatures_.end() ? nullptr : it->second;
}

std::shared_ptr<Signature> SignatureCache::insert(const std::string& key,
                                                  std::shared_ptr<Signature> sig, bool over_bound) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (auto it = signatures_.find(key); it != signatures_.end()) return it->second;
  if (!over_bound && max_ > 0 && signatures_.size() >= static_cast<size_t>(max_)) return nullptr;
  sig->last_used = use_counter_;
  signatures_.emplace(key, sig);
  return sig;
}

void SignatureCache::erase(const std::string& key, const Signature* sig) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = signatures_.find(key);
  if (it != signatures_.end() && it->second.get() == sig) signatures_.erase(it);
}

void SignatureCache::erase(const std::vector<std::shared_ptr<Signature>>& sigs) {
  std::lock_guard<std::mutex> guard(mutex_);
  for (auto it = signatures_.begin(); it != signatures_.end();) {
    const bool listed = std::find(sigs.begin(), sigs.end(), it->second) != sigs.end();
    it = listed ? signatures_.erase(it) : std::next(it);
  }
}

std::vector<std::shared_ptr<Signature>> SignatureCache::snapshot() const {
  std::lock_guard<std::mutex> guard(mutex_);
  std::vector<std::shared_ptr<Signature>> out;
  out.reserve(signatures_.size());
  for (const auto& kv : signatures_) out.push_back(kv.second);
  return out;
}

size_t SignatureCache::size() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return signatures_.size();
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
SignatureCache::Room SignatureCache::makeRoom(
    const std::function<bool(const Signature& victim)>& evict) {
  std::vector<Candidate> order;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (max_ <= 0 || signatures_.size() < static_cast<size_t>(max_)) return Room::kRoom;
    order = lruOrder();
    const bool thrashing = !plain_lru_ && wasted_evictions_ >= max_;
    if (thrashing &&
        use_counter_ - order.front().last_used < kIdleFactor * static_cast<uint64_t>(max_)) {
      return Room::kThrashing;
    }
  }
  // On past the first victim while the cache is still at or past the bound: a signature that
  // threads racing for the room inserted past it (Note [Signatures and blocking calls]) goes
  // with the next new one, so the bound holds again.
  if (evictWhileAtLeast(order, static_cast<size_t>(max_), evict, nullptr, /*wasted=*/true)) {
    return Room::kRoom;
  }
  return Room::kOverBound;  // every one is on a current path: the bound is exceeded for now
}

// Note [Signatures past the bound]
// A new signature goes in past the bound when every recorded one is on a tree's current path
// (another thread's call in flight, or the outputs it returned last): makeRoom says kOverBound.
// With T threads calling one wrapper the cache may then hold up to max_recorded_shapes + T. The
// next new signature evicts back down, but a workload whose calls all hit recorded signatures
// makes none, and recordings nothing uses any more (those of threads that have exited, of shapes
// gone by) would stay for good. So a call that finds its signature while the cache is past the
// bound trims it: the least recently used signatures that have gone idle (unused for
// kIdleFactor * max_recorded_shapes calls), never its own, are evicted as makeRoom evicts. Only
// idle ones: a workload that keeps more signatures than the bound on its path (a step that
// chains more shapes, pending backwards holding their forwards) keeps using them, and evicting
// them before they record would make them eager by the thrashing rule; for the same reason a
// trim's evictions do not count towards thrashing. While none is idle the next trim is due when
// the first one goes idle; a trim that evicted too few (the idle ones still on a path) is tried
// again kTrimInterval calls later: each try waits for the other threads' tree locks, which
// replays must not pay on every call.
void SignatureCache::trim(const std::function<bool(const Signature& victim)>& evict,
                          const Signature* keep) {
  std::vector<Candidate> idle;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (max_ <= 0 || signatures_.size() <= static_cast<size_t>(max_)) return;
    const uint64_t idle_after = kIdleFactor * static_cast<uint64_t>(max_);
    uint64_t first_idle_at = std::numeric_limits<uint64_t>::max();
    for (Candidate& c : lruOrder()) {
      if (use_counter_ - c.last_used >= idle_after) {
        idle.push_back(std::move(c));
      } else {
        first_idle_at = std::min(first_idle_at, c.last_used + idle_after);
      }
    }
    // None idle yet: due when the first one goes idle. Otherwise, unless it ends within the
    // bound, kTrimInterval calls later.
    next_trim_at_ = idle.empty() ? first_idle_at : use_counter_ + kTrimInterval;
  }
  if (evictWhileAtLeast(idle, static_cast<size_t>(max_) + 1, evict, keep, /*wasted=*/false)) {
    std::lock_guard<std::mutex> guard(mutex_);
    next_trim_at_ = 0;  // within the bound: the next time past it trims at once
  }
}

std::vector<SignatureCache::Candidate> SignatureCache::lruOrder() const {
  std::vector<Candidate> order;
  order.reserve(signatures_.size());
  for (const auto& kv : signatures_) order.push_back({kv.second->last_used, kv.first, kv.second});
  std::sort(order.begin(), order.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.last_used, a.key) < std::tie(b.last_used, b.key);
  });
  return order;
}

bool SignatureCache::evictWhileAtLeast(const std::vector<Candidate>& order, size_t below,
                                       const std::function<bool(const Signature& victim)>& evict,
                                       const Signature* keep, bool wasted) {
  // Note [Signatures and blocking calls]: `evict` runs with nothing of the cache held.
  for (const Candidate& candidate : order) {
    if (candidate.sig.get() == keep) continue;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (signatures_.size() < below) return true;  // another thread made room
      auto it = signatures_.find(candidate.key);
      if (it == signatures_.end() || it->second != candidate.sig) continue;  // evicted meanwhile
    }
    if (!evict(*candidate.sig)) continue;
    std::lock_guard<std::mutex> guard(mutex_);
    if (wasted) wasted_evictions_ = candidate.sig->record.replays == 0 ? wasted_evictions_ + 1 : 0;
    auto it = signatures_.find(candidate.key);
    if (it != signatures_.end() && it->second == candidate.sig) signatures_.erase(it);
  }
  std::lock_guard<std::mutex> guard(mutex_);
  return signatures_.size() < below;
}

}  // namespace graphtrees
