#include "Hooks.h"

#include "Logging.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <mutex>

namespace graphtrees {

namespace {

std::array<std::atomic<int>, static_cast<size_t>(FailurePoint::kCount)> g_injected{};

std::mutex& hookMutex() {
  static std::mutex m;
  return m;
}
CaptureScopeHook& scopeHook() {
  static CaptureScopeHook hook;
  return hook;
}

}  // namespace

FailurePoint failurePointFromName(const std::string& name) {
  static const std::array<const char*, static_cast<size_t>(FailurePoint::kCount)> names = {
      "restore",    "backend_restore", "partial_restore", "checkpoint",
      "capture_end", "end_allocate",   "release_pool"};
  for (size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<FailurePoint>(i);
  }
  TORCH_CHECK_VALUE(false, "graphtrees: unknown failure point '", name,
                    "'; expected one of restore, backend_restore, partial_restore, checkpoint, "
                    "capture_end, end_allocate, release_pool");
}

void injectFailure(FailurePoint point, int n) {
  TORCH_CHECK_VALUE(n >= 0, "graphtrees: the number of injected failures must be >= 0, got ", n);
  g_injected[static_cast<size_t>(point)] = n;
}

bool consumeInjectedFailure(FailurePoint point) {
  auto& counter = g_injected[static_cast<size_t>(point)];
  int n = counter.load();
  while (n > 0) {
    if (counter.compare_exchange_weak(n, n - 1)) return true;
  }
  return false;
}

void setCaptureScopeHook(CaptureScopeHook hook) {
  std::lock_guard<std::mutex> lock(hookMutex());
  scopeHook() = std::move(hook);
}

CaptureScope::CaptureScope() {
  CaptureScopeHook hook;
  {
    std::lock_guard<std::mutex> lock(hookMutex());
    hook = scopeHook();
  }
  if (hook) exit_ = hook();
}

CaptureScope::~CaptureScope() {
  if (!exit_) return;
  try {
    exit_();
  } catch (const std::exception& e) {
    logMessage(LogLevel::kWarning, std::string("leaving the capture scope failed: ") + e.what());
  }
}

}  // namespace graphtrees
