#pragma once

// The lock of one tree, held by a call for its length (TreeRegistry::Handle) and lent out while
// the call runs the user's code: Note [User code outside the tree lock].

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace graphtrees {

// Note [User code outside the tree lock]
// A call holds its tree's lock from the moment it finds the tree until its results are built
// (TreeRegistry::call), but never across the user's code: a warmup, a recording's run of the
// function, a Python replay or an eager run may wait for another thread that needs the same tree
// -- the backward that autograd runs on its device thread (it belongs with its forward's tree),
// a thread the function starts and joins, a thread whose new signature evicts recordings from
// every tree of the device -- and a lock held across that code would deadlock both threads
// (issue 39). So TreeManager::call marks the call in flight (Call) and lends the lock out around
// every run of the user's code (Lent): the thread gives up every level it holds and takes them
// back, waiting with the GIL released, when the code returns. Eager fallbacks decided before the
// tree runs anything (GraphedCallable::fallback) count themselves and let go of the tree before
// they run the function.
// While a call is in flight, another thread may take the lock, but only for what cannot disturb
// the run (which is in the middle of a warmup or a capture, its pool routed, its path half
// built):
// * a call of its own on the tree runs eagerly instead, as a nested call does ("Nested graphed
//   calls" in docs/limitations.md), counted as a fallback with the reason logged once; a
//   backward's eager run still closes its forward's pending backward (Note [Pending backward] in
//   PathPolicy.cpp);
// * producedAny() reads the ledger of outputs, which only the lock's holder changes;
// * an eviction (TreeManager::evictFunction) and a memory budget wait in the tree and are applied
//   when the call in flight ends (evictions of recordings on the current path wait until the
//   path moves off them).
// Everything else holds the lock only for bookkeeping, never across user code or a wait for
// another thread, so a thread waiting for the lock is never waited for by its holder: no cycle.
// The owner thread's own nested graphed calls run eagerly without touching the tree
// (inTreeCall()); introspection from inside the user's code (tree_info(), signatures()) takes
// the lent lock like any other thread and reads a tree in the middle of a call.
//
// Note [Locks and the GIL]
// Every lock graphtrees takes, and the order they nest in (outermost first):
// * the GIL. Released before any wait below that can be long (runBlocking): a tree lock, a device
//   lock, the capture gate. A thread never waits for the GIL while it holds a short mutex.
// * the device lock (cuda/DeviceLock.h): one allocation phase per device. A thread that must
//   wait for it lends its tree lock out first (lendWhileWaiting), so no thread ever waits for the
//   device lock while holding a tree lock; a thread holding the device lock may wait for a tree
//   lock (a capture whose user code returned takes its own back). Lent around a warmup's user
//   code (not when the tree has a memory budget); a capture cannot lend it and marks the device
//   instead, and the calls that would need it meanwhile wait only a while, then run eagerly
//   (Note [Locks around user code] there).
// * the capture gate (torch 2.11 only, Note [Random numbers while a graph is captured]): taken
//   exclusively inside the device lock by a capture, shared by a replay, which holds no other
//   lock of graphtrees then.
// * the tree lock (this file): recursive, held by a call for its length, lent around every run of
//   the user's code (Note [User code outside the tree lock]), and while its call waits for the
//   device lock -- which can happen in the middle of the tree's bookkeeping (a restore, a node's
//   removal), so what another thread does with a lent lock only reads (tree_info() prunes
//   nothing then) or waits, and a node is destroyed only once it is out of its parent's vector.
// * short mutexes, the leaves: the registry's (TreeRegistry.cpp), a wrapper's signature cache
//   (Note [Signatures and blocking calls] in SignatureCache.h), the hooks' (PythonHooks.h), the
//   log queue's, the CPU pool's (cpu/). Nothing waits for another lock or runs Python under them,
//   and log lines are emitted outside every lock (Note [Logs outside the locks] in Logging.h).
// Python's own locks sit above all of these: the collector's pause (_scope_lock in _hooks.py) is
// never held into a graphed call.
// What the GIL alone guards: a wrapper's Python-facing state (GraphedCallable: its options, its
// result structures, its verify state) and the FunctionRecord fields that every thread's tree
// writes (eager_reason, replays: H9 of design review 6), and graphtrees' Python objects (argument
// specs, key objects, the thread stash). On today's CPython those writes never interleave,
// because each happens with the GIL held and no call out between its read and its write. A
// free-threaded Python (3.13t) would race there: the extension does not declare itself safe
// without the GIL (no py::mod_gil_not_used()), so such a Python turns the GIL back on when it
// imports graphtrees, until those fields get a lock of their own (docs/limitations.md).

class TreeLock {
 public:
  TreeLock() = default;
  TreeLock(const TreeLock&) = delete;
  TreeLock& operator=(const TreeLock&) = delete;

  // Recursive on one thread. lock() waits with the GIL released (runBlocking).
  void lock();
  bool try_lock();
  void unlock();

  // Whether a call on this tree is in flight (its user's code may be running, the lock lent out),
  // on any thread / on a thread other than the caller's. Asked under the lock.
  bool callInFlight() const { return call_thread_ != std::thread::id(); }
  bool callInFlightElsewhere() const {
    return callInFlight() && call_thread_ != std::this_thread::get_id();
  }

  // Runs `wait` (a wait for another lock: the device's) with the lock of the calling thread's call
  // in flight lent out, if the thread holds it, so that no thread waits for the device lock while
  // it holds a tree lock (Note [Locks around user code] in cuda/DeviceLock.h).
  static void lendWhileWaiting(const std::function<void()>& wait);

  // Marks the call of the calling thread, which holds the lock, in flight for its lifetime.
  class Call {
   public:
    explicit Call(TreeLock& lock);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    TreeLock& lock_;
    TreeLock* outer_;  // the thread's call in flight before this one (none expected)
  };

  // Lends the lock out while the call in flight runs the user's code: every level the calling
  // thread holds is released at construction and taken back at destruction.
  class Lent {
   public:
    explicit Lent(TreeLock& lock);
    ~Lent();
    Lent(const Lent&) = delete;
    Lent& operator=(const Lent&) = delete;

   private:
    TreeLock& lock_;
    int depth_;
  };

 private:
  // Takes `depth` levels for the calling thread, waiting with the GIL released.
  void acquire(int depth);

  std::mutex mutex_;
  std::condition_variable freed_;
  std::thread::id owner_;  // the holder, or none
  int depth_ = 0;
  std::thread::id call_thread_;  // the thread whose call is in flight, or none
};

}  // namespace graphtrees
