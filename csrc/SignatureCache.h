#pragma once

// The call signatures of one graphed callable, each with its function record, and the policy that
// bounds how many are kept (max_recorded_shapes): Note [Eviction without thrashing].

#include "FunctionRecord.h"
#include "PyTree.h"

#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

struct Signature {
  FunctionRecord record;
  std::unique_ptr<OutputSpec> spec;  // the structure of its results, from its first call
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  uint64_t last_used = 0;
  KeyObjects key_objects;  // Note [Objects in the call signature]
  bool ran = false;  // a call of it has returned (failed calls do not count as signatures seen)
  // verify: the tensors its first run wrote that are not its arguments (Note [Verified replays])
  bool verify_state_known = false;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> verify_state;
};

class SignatureCache {
 public:
  // `max_recorded_shapes` > 0 bounds the signatures; `plain_lru`: evict without the thrashing
  // rule (backward graphs, whose signatures follow their forwards').
  SignatureCache(int max_recorded_shapes, bool plain_lru)
      : max_(max_recorded_shapes), plain_lru_(plain_lru) {}

  // The signature of `key`, or nullptr; counts one use either way. Shared, so that a call in
  // flight keeps its signature even if another thread evicts it.
  std::shared_ptr<Signature> find(const std::string& key);
  // The signature of `key`, or nullptr, without counting a use.
  std::shared_ptr<Signature> peek(const std::string& key) const {
    auto it = signatures_.find(key);
    return it == signatures_.end() ? nullptr : it->second;
  }
  // Whether a new signature may be added: true when there is room, or when the least recently
  // used one could be evicted through `evict` (which removes its recordings from their tree and
  // returns false while one is on the current path; the next candidate is tried). False when the
  // callable thrashes and the recorded signatures are kept.
  bool makeRoom(const std::function<bool(const Signature& victim)>& evict);
  void insert(const std::string& key, std::shared_ptr<Signature> sig);
  void erase(const std::string& key) { signatures_.erase(key); }
  void clear() { signatures_.clear(); }

  size_t size() const { return signatures_.size(); }
  int maxRecordedShapes() const { return max_; }
  template <typename F>
  void forEach(F&& f) const {
    for (const auto& kv : signatures_) f(*kv.second);
  }

 private:
  int max_;
  bool plain_lru_;
  uint64_t use_counter_ = 0;  // calls (one tick each)
  // Evictions in a row that threw away a recording that never replayed.
  int wasted_evictions_ = 0;
  std::unordered_map<std::string, std::shared_ptr<Signature>> signatures_;
};

}  // namespace graphtrees
