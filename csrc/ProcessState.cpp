#include "ProcessState.h"

#include "Logging.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <mutex>

namespace graphtrees {

namespace {

std::array<std::atomic<int>, static_cast<size_t>(FailurePoint::kCount)> g_injected{};
std::atomic<int64_t> g_step{0};
std::atomic<uint64_t> g_epoch{1};
thread_local int tls_call_depth = 0;
thread_local int tls_recording_depth = 0;
std::atomic<bool> g_debug_checks{false};

std::function<void()>& gcHook() {
  static std::function<void()> hook;
  return hook;
}
FindStoragesHook& findHook() {
  static FindStoragesHook hook;
  return hook;
}
BlockingWaitHook& waitHook() {
  static BlockingWaitHook hook;
  return hook;
}

std::mutex& hookMutex() {
  static std::mutex m;
  return m;
}
CaptureScopeHook& scopeHook() {
  static CaptureScopeHook hook;
  return hook;
}

}  // namespace

int64_t currentStep() {
  return g_step.load();
}
void markStepBegin() {
  g_step++;
}
uint64_t currentEpoch() {
  return g_epoch.load();
}
void advanceEpoch() {
  g_epoch++;
}

bool inTreeCall() {
  return tls_call_depth > 0;
}
CallDepthGuard::CallDepthGuard() {
  ++tls_call_depth;
}
CallDepthGuard::~CallDepthGuard() {
  --tls_call_depth;
}

bool recordingGraph() {
  return tls_recording_depth > 0;
}
RecordingGraphScope::RecordingGraphScope() {
  ++tls_recording_depth;
}
RecordingGraphScope::~RecordingGraphScope() {
  --tls_recording_depth;
}

bool debugChecksEnabled() {
  return g_debug_checks.load();
}
void setDebugChecks(bool on) {
  g_debug_checks = on;
}

// The hooks are installed once at import and cleared at exit, with no call in flight.
void setCollectGarbageHook(std::function<void()> hook) {
  gcHook() = std::move(hook);
}
void collectGarbage() {
  if (gcHook()) gcHook()();
}
void setFindStoragesHook(FindStoragesHook hook) {
  findHook() = std::move(hook);
}
std::vector<c10::Storage> findStorages(const std::vector<void*>& blocks) {
  return findHook() ? findHook()(blocks) : std::vector<c10::Storage>();
}
void setBlockingWaitHook(BlockingWaitHook hook) {
  waitHook() = std::move(hook);
}
void runBlocking(const std::function<void()>& wait) {
  if (waitHook()) {
    waitHook()(wait);
  } else {
    wait();
  }
}

FailurePoint failurePointFromName(const std::string& name) {
  static const std::array<const char*, static_cast<size_t>(FailurePoint::kCount)> names = {
      "restore",     "backend_restore", "partial_restore", "checkpoint",
      "capture_end", "end_allocate",    "release_pool"};
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
