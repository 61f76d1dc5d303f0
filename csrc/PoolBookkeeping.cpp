#include "PoolBookkeeping.h"

#include "CallRange.h"
#include "FailureInjection.h"
#include "Logging.h"
#include "PythonHooks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

namespace graphtrees {

// Before anything allocates in the pool after replays, the pool's bookkeeping must describe the
// memory that live outputs occupy. See Note [Checkpointing].
void PoolBookkeeping::prepareToAllocate(TreeNode* current, std::vector<at::Tensor>* inputs,
                                        const std::vector<uint8_t>& is_static,
                                        const ArgumentAliases& aliases) {
  if (!stale_) return;
  if (current != nullptr) {
    restore(current, inputs, is_static, aliases);
    return;
  }
  // The path ended after replays. Blocks that live outputs own are allocated in the pool; replayed
  // outputs own nothing, so the allocator may hand their memory out again: they are invalidated.
  const auto at_risk = live_.slotsWhere([&](const LiveOutput&, const c10::StorageImpl& storage) {
    return !live_.ownsPoolBlock(storage);
  });
  cloneInputsAtRisk(inputs, is_static, aliases, at_risk);
  live_.invalidateIf([&](int64_t slot, const LiveOutput&,
                         const c10::StorageImpl&) { return at_risk.count(slot) > 0; },
                     [] { return std::string("a new recording or warmup reuses its memory"); });
  stale_ = false;
}

void PoolBookkeeping::cloneInputsAtRisk(std::vector<at::Tensor>* inputs,
                                        const std::vector<uint8_t>& is_static,
                                        const ArgumentAliases& aliases,
                                        const std::unordered_set<int64_t>& slots_at_risk) const {
  if (slots_at_risk.empty()) return;
  // One clone per tensor: the positions of one tensor stay one tensor (Note [Argument aliases]).
  std::vector<at::Tensor> clones(inputs->size());  // at the first position of each tensor
  for (size_t i = 0; i < inputs->size(); ++i) {
    at::Tensor& t = (*inputs)[i];
    const LiveOutput* e = live_.find(t.storage().unsafeGetStorageImpl());
    const int64_t slot = live_.slotOf(t.storage().unsafeGetStorageImpl());
    if (slot < 0 || !slots_at_risk.count(slot)) continue;
    // on_overwrite="copy": the output is moved out of the pool, rebound in place, and stays the
    // caller's tensor, which the run uses and mutates as eagerly (Note [Copied inputs written
    // back] in WriteBack.h).
    if (e != nullptr && e->copy_on_overwrite && e->nbytes > 0) continue;
    // A static input is used at its address, so a copy cannot stand in for it.
    TORCH_CHECK(!is_static[i], "graphtrees: static input ", i,
                " is an output of an earlier graphed run whose pool memory the next run reuses. "
                "Pass a tensor with a stable address as a static input (e.g. .clone() it once).");
    const size_t first = aliases.sameAs(i);
    if (first != i && clones[first].defined()) {
      t = clones[first];
      continue;
    }
    t = t.clone();
    clones[i] = t;
  }
}

// Note [Checkpointing]
// After node N is recorded, the pool's state is checkpointed (backend checkpoint()) together with
// the set of output slots that were live at that moment. Replays write memory without telling the
// allocator: afterwards its bookkeeping no longer matches what live outputs occupy (replayed
// outputs are non-owning views of pool memory). Before the pool must allocate again -- a warmup or
// a new recording while the path continues from N -- the pool is restored to N's checkpoint:
//   1. every live output that owns a pool block gives up ownership (its deleter becomes a no-op),
//      because the restore frees every block;
//   2. the restore re-creates N's layout; blocks that were allocated in it come back as owning
//      DataPtrs;
//   3. each live output whose slot was live at N's checkpoint takes the DataPtr of its block
//      (set_data_ptr_noswap), so the allocator cannot hand that memory out and the block is freed
//      when the tensor dies;
//   4. blocks whose tensors died since are freed (their DataPtrs are simply dropped), and live
//      outputs that the checkpoint does not protect are invalidated: the new run may reuse them.
// Only the allocator's bookkeeping is reset, never memory contents, so live outputs keep their
// data.
void PoolBookkeeping::restore(TreeNode* node, std::vector<at::Tensor>* inputs,
                              const std::vector<uint8_t>& is_static,
                              const ArgumentAliases& aliases) {
  // Note [Call ranges]: the node restored to, inside the warmup or recording it makes room for.
  CallRange range(CallRange::Kind::kRestore, &backend_, node->functionName(), node->id());
  if (consumeInjectedFailure(FailurePoint::kRestore)) {
    throw RestoreFailed("injected failure (graphtrees._C._inject_failure(\"restore\"))");
  }
  if (!node->published()) {  // not expected: nodes are published with a checkpoint
    throw RestoreFailed("node " + std::to_string(node->id()) + " has no checkpoint");
  }
  live_.pruneGone();
  if (!live_.unownedBlocks().empty()) {
    const bool collected = collectGarbage();  // dead cycles may hold pool tensors
    live_.pruneGone();
    waitForUnownedBlocks();
    const auto extra = live_.unownedBlocks().size();
    TORCH_CHECK(extra == 0 || collected, "graphtrees: ", extra,
                " tensor(s) allocated in graphtrees' pool by a warmup or recording are still alive "
                "and were never returned by the graphed function; garbage cycles may hold them, "
                "but no garbage is collected while another thread captures a graph. Call the "
                "function again once that capture has ended.");
    if (extra > 0) {
      TORCH_CHECK(false, "graphtrees: ", extra,
                  " tensor(s) allocated in graphtrees' pool by a warmup or recording are still "
                  "alive but were never returned by the graphed function (for example a cache "
                  "created lazily inside forward and stored on a module or in a global). The pool "
                  "cannot be restored for the next recording without freeing their memory. Create "
                  "such state before wrapping the function (e.g. run it once eagerly), register "
                  "it as a buffer before the first call, or return it.");
    }
  }
  const auto& protected_slots = node->checkpoint().live_slots;
  std::unordered_set<int64_t> unprotected;
  for (int64_t slot : live_.liveSlots()) {
    if (!std::binary_search(protected_slots.begin(), protected_slots.end(), slot)) {
      unprotected.insert(slot);
    }
  }
  cloneInputsAtRisk(inputs, is_static, aliases, unprotected);
  auto disowned = live_.disownAll();
  RestoreResult restored;
  try {
    restored = backend_.restore(*node->checkpoint().pool);
  } catch (const RestoreError& e) {
    // Note [Failed restores]
    // A restore that failed before it changed the pool (the CPU pool's restore is all or
    // nothing) leaves every block where it was: the outputs that gave up ownership above take it
    // back, and nothing leaks. One that failed half-way (c10's setCheckpointPoolState frees every
    // block, then re-creates the checkpoint's layout) leaves blocks that no DataPtr will ever
    // free: the outputs stay disowned (their memory stays readable, since a retired pool never
    // allocates again), and every block still allocated is counted as leaked until reset().
    if (e.poolUnchanged()) {
      live_.reown(disowned);
    } else {
      try {
        leaked_bytes_ += backend_.stats().allocated_bytes;
      } catch (const std::exception&) {
        // The count stays a lower bound.
      }
    }
    throw RestoreFailed(std::string("restoring the pool: ") + e.what() +
                        (e.poolUnchanged() ? " (the pool was left unchanged)"
                                           : " (the pool was left inconsistent; its memory is "
                                             "not reused until graphtrees.reset())"));
  }
  disowned.clear();
  live_.adopt(&restored, unprotected);
  counters_.num_checkpoints++;
  stale_ = false;
  GRAPHTREES_LOG(LogLevel::kDebug,
                 "restored the pool to the checkpoint of node " + std::to_string(node->id()) +
                     " ('" + node->functionName() +
                     "'); checkpoints so far: " + std::to_string(counters_.num_checkpoints));
}

int64_t PoolBookkeeping::releaseUnneededSegments(const TreeNode& root) {
  const int64_t freed = backend_.releaseFreeSegments(checkpointsBelow(root));
  counters_.bytes_released += freed;
  return freed;
}

// Note [Kept state]
// A warmup may create tensors and keep them without returning them: a cache or buffer a module
// creates lazily on its first call (transformers' StaticCache does). They were allocated in the
// pool, untracked, and would block every later restore. At the end of each warmup, blocks that no
// tracked output owns are looked up among the live tensor objects (Python's gc), and each storage
// found is moved out of the pool (its bytes copied, the storage rebound in place): the recording
// then sees an ordinary tensor at a fixed address. Logged at INFO, counted as a migration. A
// tensor created and kept by a recording is still an error (its memory belongs to the graph).
NodeCheckpoint PoolBookkeeping::checkpoint(std::shared_ptr<Checkpoint> pool, const TreeNode& node) {
  NodeCheckpoint cp;
  cp.pool = std::move(pool);
  cp.live_slots = live_.liveSlots();
  for (const Slot& s : node.slots()) cp.live_slots.push_back(s.id);
  std::sort(cp.live_slots.begin(), cp.live_slots.end());
  return cp;
}

// Note [Blocks a collective holds]
// A collective that a warmup runs eagerly (NCCL's, gloo's) hands its work object to a watchdog or
// worker thread, which holds the collective's tensors -- pool blocks, since the warmup was routed
// -- until it retires the work, about 100 ms later at most. Those blocks belong to no Python
// tensor, so neither the garbage collector nor Note [Kept state] frees them. Before calling them
// kept, this waits up to 200 ms, with the GIL released, for the allocator to see them freed. The
// pool invariant check (checkInvariants) waits the same way after a recording, whose collectives
// hand their tensors over just the same.
void PoolBookkeeping::waitForUnownedBlocks() {
  for (int i = 0; i < 200 && !live_.unownedBlocks().empty(); ++i) {
    runBlocking([] { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
  }
}

bool PoolBookkeeping::checkInvariants(std::string* why) {
  std::string first;
  if (live_.checkInvariants(exact(), &first)) return true;
  waitForUnownedBlocks();  // a collective's worker may not have dropped its tensors yet
  return live_.checkInvariants(exact(), why);
}

void PoolBookkeeping::moveKeptStateOutOfPool(const std::string& function_name) {
  if (live_.unownedBlocks().empty()) return;
  const std::vector<void*> kept = live_.unownedBlocks();
  int64_t moved = 0;
  int64_t bytes = 0;
  for (const c10::Storage& storage : findStorages(kept)) {
    if (live_.contains(storage.unsafeGetStorageImpl())) continue;
    bytes += static_cast<int64_t>(storage.nbytes());
    live_.moveOutOfPool(*storage.unsafeGetStorageImpl());
    moved++;
  }
  // What no Python tensor holds may be a collective's, about to be freed.
  if (!live_.unownedBlocks().empty()) waitForUnownedBlocks();
  if (moved > 0) {
    GRAPHTREES_LOG(LogLevel::kInfo, "moved " + std::to_string(moved) + " tensor(s) (" +
                                        bytesString(bytes) + ") that a warmup of '" +
                                        function_name +
                                        "' created and kept without returning them (lazily created "
                                        "state, such as a cache) out of graphtrees' pool");
  }
}

}  // namespace graphtrees
