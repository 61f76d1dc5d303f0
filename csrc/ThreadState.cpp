#include "ThreadState.h"

#include "Logging.h"
#include "PythonHooks.h"

#include <ATen/ThreadLocalPythonObjects.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace graphtrees {

namespace {

std::atomic<int64_t> g_next_thread_id{1};
thread_local int tls_call_depth = 0;
thread_local int tls_call_device_type = -1;
thread_local int tls_recording_depth = 0;
thread_local int tls_device_capture_depth = 0;

std::mutex& exitHookMutex() {
  static auto* m = new std::mutex();  // never destroyed: used by exiting threads
  return *m;
}
std::function<void(int64_t)>& threadExitHook() {
  static auto* hook = new std::function<void(int64_t)>();  // never destroyed: threads may exit
  return *hook;                                            // during static destruction
}

// The step counters of the threads alive, by id (callerThread()).
std::mutex& countersMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_map<int64_t, StepCounter>& countersById() {
  static auto* m = new std::unordered_map<int64_t, StepCounter>();
  return *m;
}

// What a thread is to graphtrees; created when the thread first asks.
struct ThreadIdentity {
  int64_t id = g_next_thread_id++;
  StepCounter steps = std::make_shared<std::atomic<int64_t>>(0);
  ThreadIdentity() {
    std::lock_guard<std::mutex> lock(countersMutex());
    countersById()[id] = steps;
  }
  ~ThreadIdentity() {
    {
      std::lock_guard<std::mutex> lock(countersMutex());
      countersById().erase(id);
    }
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

namespace {

// Note [The thread stash outlives its thread]
// The stash lives in torch's thread-local Python objects, which a thread destroys when it ends --
// after Python has let go of the thread, so that dropping the last reference there takes the GIL
// from a thread Python no longer knows. While the interpreter finalizes (a program whose worker
// threads end as the main thread exits), taking the GIL ends such a thread with a forced unwind
// through a noexcept destructor: std::terminate, the process aborted after its work was done.
// So every stash has a second owner here, and a thread's end never drops the last reference:
// stashes that only this keeper still holds are dropped when a thread stashes its own, with the
// GIL held; those left at exit stay (the keeper is never destroyed).
void keepStash(std::shared_ptr<c10::SafePyObject> stash) {
  static auto* mutex = new std::mutex();
  static auto* kept = new std::vector<std::shared_ptr<c10::SafePyObject>>();
  std::vector<std::shared_ptr<c10::SafePyObject>> dropped;  // dropped outside the mutex
  std::lock_guard<std::mutex> lock(*mutex);
  for (auto& s : *kept) {
    if (s.use_count() == 1) dropped.push_back(std::move(s));
  }
  kept->erase(std::remove(kept->begin(), kept->end(), nullptr), kept->end());
  kept->push_back(std::move(stash));
}

}  // namespace

CallerThread callerThread() {
  static const std::string kKey = "graphtrees.thread";
  ThreadIdentity& me = thisThread();
  if (at::impl::ThreadLocalPythonObjects::contains(kKey)) {
    const auto& stash = at::impl::ThreadLocalPythonObjects::get(kKey);
    const int64_t owner = PyLong_AsLongLong(stash->ptr(::getPyInterpreter()));
    if (owner == me.id) return {me.id, me.steps};
    if (owner > 0) {
      std::lock_guard<std::mutex> lock(countersMutex());
      auto it = countersById().find(owner);
      if (it != countersById().end()) return {owner, it->second};
    }
    PyErr_Clear();
  }
  // This thread's own: stashed, so that the threads that work for it count as it.
  PyObject* id = PyLong_FromLongLong(me.id);
  if (id != nullptr) {
    auto stash = std::make_shared<c10::SafePyObject>(id, ::getPyInterpreter());
    keepStash(stash);
    at::impl::ThreadLocalPythonObjects::set(kKey, std::move(stash));
  }
  return {me.id, me.steps};
}
void setThreadExitHook(std::function<void(int64_t)> hook) {
  std::lock_guard<std::mutex> lock(exitHookMutex());
  threadExitHook() = std::move(hook);
}

bool inTreeCall() {
  return tls_call_depth > 0;
}
int treeCallDeviceType() {
  return tls_call_depth > 0 ? tls_call_device_type : -1;
}
namespace {
thread_local std::string tls_tree_branch_request;
}  // namespace
void requestTreeBranches(const std::string& why) {
  if (tls_tree_branch_request.empty()) tls_tree_branch_request = why;
}
std::string takeTreeBranchRequest() {
  std::string why;
  why.swap(tls_tree_branch_request);
  return why;
}
CallDepthGuard::CallDepthGuard(int device_type) : outer_device_type_(tls_call_device_type) {
  ++tls_call_depth;
  if (device_type >= 0) tls_call_device_type = device_type;
}
CallDepthGuard::~CallDepthGuard() {
  --tls_call_depth;
  tls_call_device_type = outer_device_type_;
}

namespace {
thread_local std::vector<const void*> tls_spared;
}  // namespace

SparedInputsScope::SparedInputsScope(std::vector<const void*> storages)
    : previous_size_(tls_spared.size()) {
  tls_spared.insert(tls_spared.end(), storages.begin(), storages.end());
}
SparedInputsScope::~SparedInputsScope() {
  tls_spared.resize(previous_size_);
}
const std::vector<const void*>& sparedInputs() {
  return tls_spared;
}

bool deviceCaptureUnderway() {
  return tls_device_capture_depth > 0;
}
DeviceCaptureScope::DeviceCaptureScope() {
  tls_device_capture_depth++;
}
DeviceCaptureScope::~DeviceCaptureScope() {
  tls_device_capture_depth--;
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
    GRAPHTREES_LOG(LogLevel::kWarning,
                   std::string("leaving the capture scope failed: ") + e.what());
  }
}

}  // namespace graphtrees
