#pragma once

// Above the tree manager: one tree per thread and device, created on first use, handed out locked
// (Note [Steps, generations and threads] in ThreadState.h); the retire-and-retry after a failed
// restore; reset of every tree; the trees of threads that exited. The Python-facing layer never
// decides a tree's lifecycle: it asks the registry.

#include "TreeInfo.h"
#include "TreeManager.h"

#include <c10/core/Device.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace graphtrees {

class TreeRegistry {
 public:
  // A tree locked by the calling thread for as long as the handle lives (but lent out while a
  // call runs user code: Note [User code outside the tree lock] in TreeLock.h). The tree stays
  // alive while a handle holds it, even if another thread resets the trees meanwhile.
  class Handle {
   public:
    Handle() = default;
    Handle(Handle&&) = default;
    // Unlocks the old tree before dropping the reference that may keep it alive.
    Handle& operator=(Handle&& other) noexcept {
      if (this != &other) {
        if (lock_.owns_lock()) lock_.unlock();
        lock_ = std::move(other.lock_);
        tree_ = std::move(other.tree_);
      }
      return *this;
    }
    TreeManager* operator->() const { return tree_.get(); }
    TreeManager& operator*() const { return *tree_; }
    explicit operator bool() const { return tree_ != nullptr; }

   private:
    friend class TreeRegistry;
    explicit Handle(std::shared_ptr<TreeManager> tree);
    std::shared_ptr<TreeManager> tree_;
    std::unique_lock<TreeLock> lock_;
  };

  // The calling thread's tree of the device, locked (waiting without the GIL if another thread
  // holds it). Created on first use unless `create` is false; empty, with `why_not` set, when no
  // backend can serve the device.
  static Handle acquire(c10::Device device, bool create, std::string* why_not = nullptr);
  // The calling thread's tree of the device, created if needed, not locked; nullptr (with
  // `why_not`) when no backend can serve the device. With `produced_by`, a tree of another
  // thread that produced one of those tensors comes first (a backward that autograd runs on its
  // own thread belongs with its forward).
  static std::shared_ptr<TreeManager> find(c10::Device device, std::string* why_not,
                                           const std::vector<at::Tensor>* produced_by = nullptr);

  // Counts an eager fallback of the calling thread on `device` that found no tree there: no tree
  // (nor a CUDA stream) is made only to count it. The tree made later starts with the count, and
  // info() reports it meanwhile.
  static void countFallbackWithoutTree(c10::Device device);

  // Removes the recordings of `function_id` from every tree of the device. False if one of them
  // is on its tree's current path (that tree keeps them), unless `later`: then that tree removes
  // them once its path moves off them (TreeManager::evictFunction).
  static bool evictFunction(c10::Device device, int64_t function_id, const std::string& why,
                            bool later = false);

  // Runs one call of `fn` on `tree` (from find()) and returns the tree that ran it, still locked
  // (the caller rebuilds the results and runs the debug check under the lock). A restore that
  // fails before the call ran anything retires the tree and the call runs again on a fresh one.
  // While another thread's call on the tree is in flight (its user code runs: Note [User code
  // outside the tree lock] in TreeLock.h), the call runs eagerly, as a nested call does, and
  // the handle returned is empty.
  static Handle call(std::shared_ptr<TreeManager> tree, FunctionRecord& fn,
                     const std::vector<at::Tensor>& inputs, const RunFn& run, CallResult* result);

  // Frees every tree: nodes, graphs and pools; live outputs are invalidated. A tree that a call on
  // another thread is using goes when that call ends. Refused inside a graphed call. Errors of a
  // teardown (an asynchronous device error at the final sync) are thrown after everything is
  // freed.
  static void resetAll();
  // Applies the evictions waiting in every tree (TreeManager::settlePending()), then frees the
  // trees (of every thread and device) that hold no recording, no live output and no call: what
  // torch._dynamo.reset() gives back after it evicted graphtrees.install()'s functions. Refused
  // inside a graphed call.
  static void releaseEmptyTrees();

  // Note [Memory budget] in Backend.h: the cap on the bytes of each pool of `device` (-1 removes
  // it), one pool per thread. It applies to the device's trees now and to those created later,
  // reset() included.
  static void setMemoryBudget(c10::Device device, int64_t bytes);
  static int64_t memoryBudget(c10::Device device);

  // The calling thread's tree of the device as introspection sees it (the registry's counters
  // included); none gives `info.backend` empty and zeros.
  static TreeInfo info(c10::Device device, bool* has_tree);

 private:
  static void retire(const std::shared_ptr<TreeManager>& tree, const std::string& why);
  // Runs the call on `tree` with the call marked in flight and the lock lent out around `run`;
  // false (the handle released, the call run eagerly) while another thread's call is in flight.
  static bool runOn(Handle& tree, FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                    const RunFn& run, CallResult* result);
  // The tree of thread `owner` (whose step counter is `steps`) for `device`, created if `create`.
  static std::shared_ptr<TreeManager> findOrCreate(int64_t owner, const StepCounter& steps,
                                                   c10::Device device, bool create,
                                                   std::string* why_not);
};

}  // namespace graphtrees
