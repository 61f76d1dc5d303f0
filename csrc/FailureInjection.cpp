#include "FailureInjection.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <mutex>

namespace graphtrees {

namespace {

// Armed failures and the passing arrivals before them, per point. Guarded by injectionMutex();
// `g_armed` lets the unarmed case (every call of a program that is not a test) skip the lock.
struct Injection {
  int failures = 0;
  int skip = 0;
};
std::array<Injection, static_cast<size_t>(FailurePoint::kCount)> g_injected{};
std::atomic<bool> g_armed{false};
std::mutex& injectionMutex() {
  static std::mutex m;
  return m;
}
std::atomic<bool> g_debug_checks{false};

}  // namespace

const std::vector<FailurePointInfo>& failurePoints() {
  static const std::vector<FailurePointInfo> points = {
      {FailurePoint::kRestore, "restore",
       "the tree's pool restore fails before it touches anything (PyTorch issue #140419)"},
      {FailurePoint::kBackendRestore, "backend_restore",
       "the backend's restore fails and leaves the pool unchanged"},
      {FailurePoint::kPartialRestore, "partial_restore",
       "the backend's restore fails after it changed the pool, as c10's can"},
      {FailurePoint::kCheckpoint, "checkpoint", "the checkpoint after a recording fails"},
      {FailurePoint::kCaptureEnd, "capture_end", "the device rejects a capture at its end"},
      {FailurePoint::kEndAllocate, "end_allocate",
       "ending the routing into the pool reports an asynchronous device error"},
      {FailurePoint::kReleasePool, "release_pool",
       "releasing the pool at reset reports an asynchronous device error"},
      {FailurePoint::kPoolAlloc, "pool_alloc",
       "an allocation in the pool (warmup, placeholders, capture) runs out of memory"},
  };
  return points;
}

FailurePoint failurePointFromName(const std::string& name) {
  std::string names;
  for (const auto& p : failurePoints()) {
    if (name == p.name) return p.point;
    names += std::string(names.empty() ? "" : ", ") + p.name;
  }
  TORCH_CHECK_VALUE(false, "graphtrees: unknown failure point '", name, "'; expected one of ",
                    names);
}

void injectFailure(FailurePoint point, int n, int skip) {
  TORCH_CHECK_VALUE(n >= 0 && skip >= 0,
                    "graphtrees: injected failures and skips must be >= 0, got n=", n,
                    ", skip=", skip);
  std::lock_guard<std::mutex> lock(injectionMutex());
  g_injected[static_cast<size_t>(point)] = {n, skip};
  bool armed = false;
  for (const auto& i : g_injected) armed = armed || i.failures > 0;
  g_armed = armed;
}

bool consumeInjectedFailure(FailurePoint point) {
  if (C10_LIKELY(!g_armed.load(std::memory_order_relaxed))) return false;
  std::lock_guard<std::mutex> lock(injectionMutex());
  Injection& i = g_injected[static_cast<size_t>(point)];
  if (i.failures == 0) return false;
  if (i.skip > 0) {
    i.skip--;
    return false;
  }
  i.failures--;
  return true;
}

int pendingInjectedFailures(FailurePoint point) {
  std::lock_guard<std::mutex> lock(injectionMutex());
  return g_injected[static_cast<size_t>(point)].failures;
}

bool debugChecksEnabled() {
  return g_debug_checks.load();
}
void setDebugChecks(bool on) {
  g_debug_checks = on;
}

}  // namespace graphtrees
