#pragma once

// Above the tree manager: one tree per device, created on first use, handed out locked; the
// retire-and-retry after a failed restore; reset of every tree. The Python-facing layer never
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
  // A tree locked by the calling thread for as long as the handle lives. The tree stays alive
  // while a handle holds it, even if another thread resets the trees meanwhile.
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
    std::unique_lock<std::recursive_mutex> lock_;
  };

  // The device's tree, locked (waiting without the GIL if another thread holds it). Created on
  // first use unless `create` is false; empty, with `why_not` set, when no backend can serve the
  // device.
  static Handle acquire(c10::Device device, bool create, std::string* why_not = nullptr);
  // The device's tree, created if needed, not locked; nullptr (with `why_not`) when no backend
  // can serve the device.
  static std::shared_ptr<TreeManager> find(c10::Device device, std::string* why_not);

  // Runs one call of `fn` on `tree` (from find()) and returns the tree that ran it, still locked
  // (the caller rebuilds the results and runs the debug check under the lock). A restore that
  // fails before the call ran anything retires the tree and the call runs again on a fresh one.
  static Handle call(std::shared_ptr<TreeManager> tree, FunctionRecord& fn,
                     const std::vector<at::Tensor>& inputs, const RunFn& run, CallResult* result);

  // Frees every tree: nodes, graphs and pools; live outputs are invalidated. A tree that a call on
  // another thread is using goes when that call ends. Refused inside a graphed call. Errors of a
  // teardown (an asynchronous device error at the final sync) are thrown after everything is
  // freed.
  static void resetAll();

  // The device's tree as introspection sees it (the registry's counters included); a device
  // without a tree gives `info.backend` empty and zeros.
  static TreeInfo info(c10::Device device, bool* has_tree);

 private:
  static void retire(const std::shared_ptr<TreeManager>& tree, const std::string& why);
};

}  // namespace graphtrees
