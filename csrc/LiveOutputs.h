#pragma once

// The ledger of outputs the tree handed out and that may still be alive: one entry per storage,
// identified by a slot id that stays the same across replays of the node that produced it.
//
// Note [Output ownership]
// A tracked output is in one of these states:
//   owning      its DataPtr owns a pool block (outputs of warmups and recordings, and outputs a
//               restore gave ownership to): the block is freed when the tensor dies, and the
//               allocator's bookkeeping knows the memory is in use;
//   non-owning  a replayed output: a view of pool memory that the graph writes without telling
//               the allocator, so the bookkeeping may believe that memory free;
//   gone        its storage died, or was moved out of the pool (resize_(), share_memory_()): the
//               tree no longer has anything to do with it and the entry is dropped. Every
//               question the ledger answers ("is it live?") treats gone entries as dead; there is
//               no separate "expired" notion;
//   invalidated a later run is about to write its memory: an owned block is freed and the storage
//               is made to raise on access (the overwritten-output error), or, for an output
//               marked copy-on-overwrite (a gradient that may sit in .grad), its bytes are copied
//               out of the pool into fresh memory first (a migration) and it stays valid;
//   disowned    only inside a restore: an owning output gives up its block (its deleter becomes a
//               no-op) because the restore frees every block; afterwards it adopts the restored
//               block again, or takes its ownership back if the restore failed before changing
//               the pool (see Note [Failed restores] in PoolBookkeeping.cpp).
// The invariant the tests check after every call (checkInvariants): the pool's allocated blocks
// are exactly the blocks that owning outputs hold, and while the bookkeeping is exact (no replay
// since the last restore) no live output is non-owning.

#include "Backend.h"
#include "TreeCounters.h"

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

class TreeNode;
struct RestoreResult;

struct LiveOutput {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
  uintptr_t ptr = 0;  // the storage's data when it was tracked
  size_t nbytes = 0;
  int64_t generation = 0;
  TreeNode* node = nullptr;        // nullptr for warmup outputs
  std::string producer;            // function name, for error messages
  bool copy_on_overwrite = false;  // a gradient: migrated out of the pool instead of invalidated
};

class LiveOutputs {
 public:
  // `counters`: the tree's (num_invalidations, num_migrations), Note [Tree counters].
  LiveOutputs(Backend& backend, TreeCounters& counters) : backend_(backend), counters_(counters) {}

  int64_t newSlot() { return next_slot_++; }
  void track(const c10::Storage& storage, int64_t slot, TreeNode* node, const std::string& producer,
             bool copy_on_overwrite, int64_t generation);
  // Tracks the outputs of a warmup that own a pool block of their own (not an input's storage,
  // not an output tracked already), without a node.
  void trackWarmupOutputs(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs, const std::string& producer,
                          bool copy_on_overwrite, int64_t generation);

  // The entry of a storage, or nullptr.
  const LiveOutput* find(const c10::StorageImpl* storage) const;
  // The slot of a storage, or -1.
  int64_t slotOf(const c10::StorageImpl* storage) const;
  bool contains(const c10::StorageImpl* storage) const { return slotOf(storage) >= 0; }

  // A new generation begins: "live in this generation" forgets the old one.
  void startGeneration() { generation_slots_.clear(); }
  // Whether slot `slot` holds a live output produced in `generation`.
  bool liveInGeneration(int64_t slot, int64_t generation) const;
  // Whether any output produced in `generation` is live.
  bool anyLiveInGeneration(int64_t generation) const;

  // Drops entries whose storage is gone.
  void pruneGone();
  // Invalidates (Note [Output ownership]) and drops every live entry for which
  // `pred(slot, entry, storage)` holds; drops gone entries on the way. `why()` gives the reason
  // for the error message; it is called only if something is invalidated (this runs on every
  // replay). Returns how many were invalidated or migrated.
  template <typename Pred, typename Why>
  int64_t invalidateIf(Pred pred, Why why) {
    int64_t n = 0;
    std::string reason;
    for (auto it = live_.begin(); it != live_.end();) {
      auto strong = it->second.weak.lock();
      if (!strong || isGone(it->second, *strong)) {
        it = erase(it);
      } else if (pred(it->first, it->second, *strong)) {
        if (n == 0) reason = why();
        invalidate(it->second, *strong, reason);
        it = erase(it);
        n++;
      } else {
        ++it;
      }
    }
    return n;
  }
  // Slots of live outputs for which `pred(entry, storage)` holds.
  template <typename Pred>
  std::unordered_set<int64_t> slotsWhere(Pred pred) const {
    std::unordered_set<int64_t> out;
    for (const auto& kv : live_) {
      auto strong = kv.second.weak.lock();
      if (strong && !isGone(kv.second, *strong) && pred(kv.second, *strong)) out.insert(kv.first);
    }
    return out;
  }
  // Sorted slots of every live output.
  std::vector<int64_t> liveSlots() const;
  // Blocks that live owning outputs hold.
  std::unordered_set<void*> owningBlocks() const;
  // Allocated blocks of the pool that no live output owns (empty when the invariant of Note
  // [Output ownership] holds for the allocated blocks).
  std::vector<void*> unownedBlocks() const;
  size_t size() const { return live_.size(); }
  std::unordered_map<int64_t, int64_t> liveCountPerNode() const;

  bool ownsPoolBlock(const c10::StorageImpl& storage) const;
  // If `storage` owns a pool block, makes its deleter a no-op and returns true.
  bool disown(c10::StorageImpl& storage) const;

  // The restore protocol (Note [Checkpointing] in PoolBookkeeping.cpp). disownAll() makes every
  // owning output give up its block and returns them; reown() gives it back (a restore that
  // failed before changing the pool); adopt() hands each live output outside `at_risk` the
  // restored block at its address and invalidates the others.
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> disownAll();
  void reown(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& storages);
  void adopt(RestoreResult* restored, const std::unordered_set<int64_t>& at_risk);

  // Gives an untracked storage that lives in the pool fresh memory outside it, with its current
  // contents (state a warmup created and kept; Note [Kept state]); frees its pool block if it
  // owned one.
  void moveOutOfPool(c10::StorageImpl& storage);
  // The results of a run that the tree hands out untracked (a rejected CPU recording's): moves
  // their pool storages out of the pool. False, moving nothing, when one of them is the storage of
  // `inputs[i]` for an i in `copied` (a placeholder: eagerly it would be the caller's tensor).
  bool moveResultsOutOfPool(const std::vector<at::Tensor>& results,
                            const std::vector<at::Tensor>& inputs,
                            const std::vector<int64_t>& copied);

  // Invalidates every live output (the tree is freed) and forgets everything.
  void invalidateAll(const std::string& why);

  // Note [Output ownership]'s invariant; `bookkeeping_exact`: no replay since the last restore.
  bool checkInvariants(bool bookkeeping_exact, std::string* why);

 private:
  using Map = std::unordered_map<int64_t, LiveOutput>;
  static bool isGone(const LiveOutput& e, const c10::StorageImpl& storage) {
    return storage.data_ptr().get() != reinterpret_cast<void*>(e.ptr);
  }
  Map::iterator erase(Map::iterator it);
  void invalidate(const LiveOutput& e, c10::StorageImpl& storage, const std::string& why);
  // Gives `storage` fresh memory outside the pool with its current contents.
  void migrate(const LiveOutput& e, c10::StorageImpl& storage);

  Backend& backend_;
  Map live_;  // slot -> the live storage that holds it
  std::unordered_map<const c10::StorageImpl*, int64_t> slot_of_;
  std::vector<int64_t> generation_slots_;  // slots tracked since the generation began
  int64_t next_slot_ = 1;
  TreeCounters& counters_;
};

}  // namespace graphtrees
