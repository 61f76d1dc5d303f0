#pragma once

// The few things C++ asks of the Python layer, each through one hook that graphtrees/_hooks.py
// installs at import (through the bindings) and clears at exit: collecting garbage, finding the
// tensors over pool blocks, waiting with the GIL released, entering the capture scope, telling an
// error that must propagate (an interruption, the user's own error) from a rejected capture. Below
// the tree manager and the backends; knows nothing of Python.
//
// Every hook follows one rule (Hook<Sig>): it is read under its own lock into a shared copy and
// called with no lock held, so a hook may block, call back into graphtrees, or be replaced while
// another thread runs it. A hook that is not installed does nothing (documented per hook).

#include <c10/core/Storage.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace graphtrees {

template <typename Sig>
class Hook {
 public:
  void set(std::function<Sig> fn) {
    auto held = fn ? std::make_shared<const std::function<Sig>>(std::move(fn)) : nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = std::move(held);
  }
  // The installed function, or nullptr.
  std::shared_ptr<const std::function<Sig>> get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return fn_;
  }

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<const std::function<Sig>> fn_;
};

// Collects garbage cycles (Python's gc) when untracked pool allocations block a restore. Called
// by the restoring thread, which holds its tree's lock: the collection runs finalizers under it.
// Returns whether it collected: it does not while any thread captures a graph (a finalizer could
// free that capture's tensors, Note [Freeing during a capture] in ThreadState.h), nor until
// installed.
Hook<bool()>& collectGarbageHook();
bool collectGarbage();

// Finds the storages of live tensors whose data starts at one of `blocks` (Python's gc knows every
// tensor object); used to move state a warmup created and kept out of the pool. Returns nothing
// until installed.
using FindStoragesFn = std::vector<c10::Storage>(const std::vector<void*>&);
Hook<FindStoragesFn>& findStoragesHook();
std::vector<c10::Storage> findStorages(const std::vector<void*>& blocks);

// Runs `wait` (a blocking lock acquisition or sleep) through the hook, which releases the GIL
// around it; runs it directly if none is installed.
using BlockingWaitFn = void(const std::function<void()>&);
Hook<BlockingWaitFn>& blockingWaitHook();
void runBlocking(const std::function<void()>& wait);

// Called around every capture (CUDA and CPU) with the GIL held; the returned function ends the
// scope (CaptureScope in ThreadState.h). Empty: no scope.
using CaptureScopeFn = std::function<void()>();
Hook<CaptureScopeFn>& captureScopeHook();

// Whether `error`, raised while a function was being recorded, must propagate as it is rather
// than be taken for a rejected capture (Note [Errors during a capture] in TreeManager.h): an
// interruption (Python's KeyboardInterrupt or SystemExit) or the user's own error, a Python
// exception that is not a RuntimeError -- torch refuses what a capture cannot record with
// RuntimeErrors. False until installed.
using PropagatesFn = bool(const std::exception&);
Hook<PropagatesFn>& propagatesHook();
bool propagatesAsIs(const std::exception& error);

}  // namespace graphtrees
