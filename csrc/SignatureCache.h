#pragma once

// The call signatures of one graphed callable, each with its function record, and the policy that
// bounds how many are kept (max_recorded_shapes): Note [Eviction without thrashing].

#include "FunctionRecord.h"
#include "KeyObjects.h"
#include "OutputSpec.h"

#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
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

  // The tensors of `out`, what a run of the call (`args`, `kwargs`) returned, for the tree:
  // Note [Results of a signature]. Empty when the signature runs eagerly from now on.
  std::vector<at::Tensor> learnResults(py::handle out, py::handle args, py::handle kwargs);
};

// Note [Signatures and blocking calls]
// A wrapper's signatures are shared by every thread that calls it, and the calls that evict a
// signature's recordings (TreeRegistry::evictFunction) wait for other threads' tree locks with
// the GIL released: another thread calling the same wrapper runs in the middle of them. So
// nothing here is held across a call out -- no iterator, no reference into the map, no lock: a
// signature is handed out as a shared_ptr (a call in flight keeps its own even if it is evicted),
// makeRoom picks a victim, lets go of the map while `evict` runs, and erases the victim only if
// the key still names that same signature; insert() keeps the signature another thread put under
// the key first, and refuses past the bound (the caller makes room again). The mutex guards the
// map and the counters for the short sections between: no Python runs under it and nothing waits
// in it, so it never waits for the GIL's holder (Note [Locks and the GIL] in TreeLock.h).
class SignatureCache {
 public:
  // `max_recorded_shapes` > 0 bounds the signatures; `plain_lru`: evict without the thrashing
  // rule (backward graphs, whose signatures follow their forwards').
  SignatureCache(int max_recorded_shapes, bool plain_lru)
      : max_(max_recorded_shapes), plain_lru_(plain_lru) {}

  // The signature of `key`, or nullptr; counts one use either way. Shared, so that a call in
  // flight keeps its signature even if another thread evicts it. `trim_due`, when given, says
  // whether the cache is past its bound and trim() is due (Note [Signatures past the bound]).
  std::shared_ptr<Signature> find(const std::string& key, bool* trim_due = nullptr);
  // The signature of `key`, or nullptr, without counting a use.
  std::shared_ptr<Signature> peek(const std::string& key) const;

  enum class Room {
    kRoom,       // below the bound (or none): insert
    kOverBound,  // every signature is on a current path and stays: insert past the bound for now
    kThrashing,  // Note [Eviction without thrashing]: keep the recorded ones, run the new eagerly
  };
  // Makes room for a new signature: when at the bound, evicts the least recently used one through
  // `evict` (which removes its recordings from their trees, may block, and returns false while one
  // is on a current path: the next candidate is tried). Called with nothing of the cache held.
  Room makeRoom(const std::function<bool(const Signature& victim)>& evict);
  // Evicts the least recently used signatures that have gone unused for a while, never `keep`,
  // through `evict` until the cache is within its bound again; when it is not, it is due again
  // once one goes idle, or kTrimInterval calls later (Note [Signatures past the bound]). Called
  // with nothing of the cache held.
  void trim(const std::function<bool(const Signature& victim)>& evict, const Signature* keep);
  // Adds `sig` under `key` and returns it; or returns the signature another thread added under
  // `key` first; or nullptr when the cache is at its bound again and `over_bound` is false (make
  // room again).
  std::shared_ptr<Signature> insert(const std::string& key, std::shared_ptr<Signature> sig,
                                    bool over_bound);
  // Erases `key` if it still names `sig` (another thread may have evicted it and reused the key).
  void erase(const std::string& key, const Signature* sig);
  // Erases every signature of `sigs` still in the cache (those added since stay).
  void erase(const std::vector<std::shared_ptr<Signature>>& sigs);
  // The signatures now, for a walk that may block or run Python.
  std::vector<std::shared_ptr<Signature>> snapshot() const;

  size_t size() const;
  int maxRecordedShapes() const { return max_; }

 private:
  struct Candidate {
    uint64_t last_used;
    std::string key;
    std::shared_ptr<Signature> sig;
  };
  // The signatures, least recently used first (the mutex held).
  std::vector<Candidate> lruOrder() const;
  // Evicts the candidates in `order` but `keep` through `evict` while the cache holds `below` or
  // more; whether it holds fewer in the end. `wasted`: evictions of recordings that never
  // replayed count towards thrashing (Note [Eviction without thrashing]).
  bool evictWhileAtLeast(const std::vector<Candidate>& order, size_t below,
                         const std::function<bool(const Signature& victim)>& evict,
                         const Signature* keep, bool wasted);

  // A signature unused for kIdleFactor * max_ calls has gone idle (Note [Eviction without
  // thrashing], Note [Signatures past the bound]).
  static constexpr uint64_t kIdleFactor = 4;
  static constexpr uint64_t kTrimInterval = 64;
  const int max_;
  const bool plain_lru_;
  mutable std::mutex mutex_;  // guards everything below
  uint64_t use_counter_ = 0;  // calls (one tick each)
  // Evictions in a row that threw away a recording that never replayed.
  int wasted_evictions_ = 0;
  uint64_t next_trim_at_ = 0;  // use_counter_ from which trim() is due while past the bound
  std::unordered_map<std::string, std::shared_ptr<Signature>> signatures_;
};

}  // namespace graphtrees
