#include "ThreadState.h"

#include "Logging.h"
#include "PythonHooks.h"

#include <mutex>

namespace graphtrees {

namespace {

std::atomic<int64_t> g_next_thread_id{1};
thread_local int tls_call_depth = 0;
thread_local int tls_recording_depth = 0;

std::mutex& exitHookMutex() {
  static auto* m = new std::mutex();  // never destroyed: used by exiting threads
  return *m;
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
      std::lock_guard<std::mutex> lock(exitHookMutex());
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
  std::lock_guard<std::mutex> lock(exitHookMutex());
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

CaptureScope::CaptureScope() {
  if (auto enter = captureScopeHook().get()) exit_ = (*enter)();
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
