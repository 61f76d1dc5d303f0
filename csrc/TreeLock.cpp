#include "TreeLock.h"

#include "Logging.h"
#include "PythonHooks.h"

#include <c10/util/Exception.h>

namespace graphtrees {

namespace {
thread_local TreeLock* call_in_flight = nullptr;  // the lock of this thread's call in flight
}  // namespace

void TreeLock::lendWhileWaiting(const std::function<void()>& wait) {
  TreeLock* lock = call_in_flight;
  bool held = false;
  if (lock != nullptr) {
    std::lock_guard<std::mutex> guard(lock->mutex_);
    held = lock->depth_ > 0 && lock->owner_ == std::this_thread::get_id();
  }
  if (!held) {
    wait();
    return;
  }
  Lent lent(*lock);
  wait();
}

bool TreeLock::try_lock() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    const std::thread::id me = std::this_thread::get_id();
    if (depth_ > 0 && owner_ != me) return false;
    owner_ = me;
    if (depth_++ > 0) return true;
  }
  holdLogs();  // Note [Logs outside the locks] in Logging.h
  return true;
}

void TreeLock::acquire(int depth) {
  const std::thread::id me = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (depth_ > 0 && owner_ == me) {
      depth_ += depth;
      return;
    }
    if (depth_ == 0) {
      owner_ = me;
      depth_ = depth;
      holdLogs();  // Note [Logs outside the locks] in Logging.h
      return;
    }
  }
  // The holder may need the GIL (a log line) before it lets go.
  runBlocking([&] {
    std::unique_lock<std::mutex> guard(mutex_);
    freed_.wait(guard, [&] { return depth_ == 0; });
    owner_ = me;
    depth_ = depth;
  });
  holdLogs();
}

void TreeLock::lock() {
  acquire(1);
}

void TreeLock::unlock() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    TORCH_INTERNAL_ASSERT(depth_ > 0 && owner_ == std::this_thread::get_id(),
                          "graphtrees: a tree lock released by a thread that does not hold it");
    if (--depth_ > 0) return;
    owner_ = std::thread::id();
  }
  freed_.notify_all();
  releaseLogs();  // emits what the thread logged while it held the lock
}

TreeLock::Call::Call(TreeLock& lock) : lock_(lock) {
  std::lock_guard<std::mutex> guard(lock_.mutex_);
  TORCH_INTERNAL_ASSERT(lock_.depth_ > 0 && lock_.owner_ == std::this_thread::get_id(),
                        "graphtrees: a tree call without the tree's lock");
  TORCH_INTERNAL_ASSERT(lock_.call_thread_ == std::thread::id(),
                        "graphtrees: two calls in flight on one tree");
  lock_.call_thread_ = lock_.owner_;
  outer_ = call_in_flight;
  call_in_flight = &lock_;
}

TreeLock::Call::~Call() {
  call_in_flight = outer_;
  std::lock_guard<std::mutex> guard(lock_.mutex_);
  lock_.call_thread_ = std::thread::id();
}

TreeLock::Lent::Lent(TreeLock& lock) : lock_(lock) {
  {
    std::lock_guard<std::mutex> guard(lock_.mutex_);
    TORCH_INTERNAL_ASSERT(lock_.depth_ > 0 && lock_.owner_ == std::this_thread::get_id() &&
                              lock_.call_thread_ == lock_.owner_,
                          "graphtrees: the tree lock lent by a thread without a call in flight");
    depth_ = lock_.depth_;
    lock_.depth_ = 0;
    lock_.owner_ = std::thread::id();
  }
  lock_.freed_.notify_all();
  releaseLogs();  // before the user's code runs
}

TreeLock::Lent::~Lent() {
  lock_.acquire(depth_);
}

}  // namespace graphtrees
