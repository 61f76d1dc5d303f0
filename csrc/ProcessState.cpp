#include "ProcessState.h"

#include "Logging.h"

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
std::atomic<int64_t> g_next_thread_id{1};
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
  static auto* m = new std::mutex();  // never destroyed: used by exiting threads
  return *m;
}
CaptureScopeHook& scopeHook() {
  static CaptureScopeHook hook;
  return hook;
}

std::function<void(int64_t)>& threadExitHook() {
  static auto* hook = new std::function<void(int64_t)>();  // never destroyed: threads may exit
  return *hook;                                            // during static destruction
}

// What a thread is to graphtrees; created when the thread first asks.
struct ThreadIdentity {
  int64_t id = g_next_thread_id++;
  StepCounter steps = std::make_shared<std::atomic<int64_t>>(0);
  ~ThreadIdentity() {
    std::function<void(int64_t)> hook;
    {
      std::lock_guard<std::mutex> lock(hookMutex());
      hook = threadExitHook();
    }
    if (hook) hook(id);
  }
};

ThreadIdentity& thisThread() {
  thread_local ThreadIdentity identity;
  return identity;
}

}  // namespace

const StepCounter& threadStepCounter() {
  return thisThread().steps;
}
void markStepBegin() {
  (*thisThread().steps)++;
}
int64_t threadId() {
  return thisThread().id;
}
void setThreadExitHook(std::function<void(int64_t)> hook) {
  std::lock_guard<std::mutex> lock(hookMutex());
  threadExitHook() = std::move(hook);
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

InterruptCheck& interruptCheck() {
  static InterruptCheck check;
  return check;
}
void setInterruptCheck(InterruptCheck check) {
  interruptCheck() = std::move(check);
}
bool isInterrupt(const std::exception& error) {
  return interruptCheck() && interruptCheck()(error);
}

FailurePoint failurePointFromName(const std::string& name) {
  static const std::array<const char*, static_cast<size_t>(FailurePoint::kCount)> names = {
      "restore",     "backend_restore", "partial_restore", "checkpoint",
      "capture_end", "end_allocate",    "release_pool",    "pool_alloc"};
  for (size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<FailurePoint>(i);
  }
  TORCH_CHECK_VALUE(false, "graphtrees: unknown failure point '", name,
                    "'; expected one of restore, backend_restore, partial_restore, checkpoint, "
                    "capture_end, end_allocate, release_pool, pool_alloc");
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
