#include "cuda/DeviceLock.h"

#include "Logging.h"
#include "PythonHooks.h"
#include "TreeLock.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace graphtrees {

namespace {

// The allocation lock of one device: recursive on one thread, and lent out whole (Lent).
struct DeviceState {
  std::mutex mutex;
  std::condition_variable freed;
  std::thread::id owner;  // the holder, or none
  int depth = 0;
  std::thread::id capturing;  // the thread whose capture runs the user's code, or none
};

DeviceState& stateOf(c10::DeviceIndex device) {
  static std::mutex guard;
  static auto* states = new std::map<c10::DeviceIndex, DeviceState>();  // never freed
  std::lock_guard<std::mutex> lock(guard);
  return (*states)[device];
}

// Takes `depth` levels of `s` for the calling thread. A wait lends the thread's tree lock out and
// releases the GIL (Note [Locks around user code] in DeviceLock.h).
void acquire(DeviceState& s, int depth) {
  const std::thread::id me = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    if (s.depth > 0 && s.owner == me) {
      s.depth += depth;
      return;
    }
    if (s.depth == 0) {
      s.owner = me;
      s.depth = depth;
      holdLogs();  // Note [Logs outside the locks] in Logging.h
      return;
    }
  }
  TreeLock::lendWhileWaiting([&] {
    runBlocking([&] {
      std::unique_lock<std::mutex> guard(s.mutex);
      s.freed.wait(guard, [&] { return s.depth == 0; });
      s.owner = me;
      s.depth = depth;
    });
  });
  holdLogs();
}

}  // namespace

void DeviceLock::lock(c10::DeviceIndex device) {
  acquire(stateOf(device), 1);
}

void DeviceLock::unlock(c10::DeviceIndex device) {
  DeviceState& s = stateOf(device);
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    TORCH_INTERNAL_ASSERT(s.depth > 0 && s.owner == std::this_thread::get_id(),
                          "graphtrees: a device lock released by a thread that does not hold it");
    if (--s.depth > 0) return;
    s.owner = std::thread::id();
  }
  s.freed.notify_all();
  releaseLogs();
}

bool DeviceLock::capturingUserCodeElsewhere(c10::DeviceIndex device) {
  DeviceState& s = stateOf(device);
  std::lock_guard<std::mutex> guard(s.mutex);
  return s.capturing != std::thread::id() && s.capturing != std::this_thread::get_id();
}

bool DeviceLock::awaitCaptureElsewhere(c10::DeviceIndex device,
                                       std::chrono::milliseconds patience) {
  if (!capturingUserCodeElsewhere(device)) return false;
  DeviceState& s = stateOf(device);
  const std::thread::id me = std::this_thread::get_id();
  bool still = true;
  TreeLock::lendWhileWaiting([&] {
    runBlocking([&] {
      std::unique_lock<std::mutex> guard(s.mutex);
      still = !s.freed.wait_for(
          guard, patience, [&] { return s.capturing == std::thread::id() || s.capturing == me; });
    });
  });
  return still;
}

DeviceLock::Lent::Lent(c10::DeviceIndex device) : device_(device), depth_(0) {
  DeviceState& s = stateOf(device_);
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    if (s.depth == 0 || s.owner != std::this_thread::get_id()) return;  // not held: nothing lent
    depth_ = s.depth;
    s.depth = 0;
    s.owner = std::thread::id();
  }
  s.freed.notify_all();
  releaseLogs();
}

DeviceLock::Lent::~Lent() {
  if (depth_ > 0) acquire(stateOf(device_), depth_);
}

DeviceLock::CapturingUserCode::CapturingUserCode(c10::DeviceIndex device) : device_(device) {
  DeviceState& s = stateOf(device_);
  std::lock_guard<std::mutex> guard(s.mutex);
  TORCH_INTERNAL_ASSERT(s.depth > 0 && s.owner == std::this_thread::get_id(),
                        "graphtrees: a capture without its device's lock");
  s.capturing = s.owner;
}

DeviceLock::CapturingUserCode::~CapturingUserCode() {
  DeviceState& s = stateOf(device_);
  {
    std::lock_guard<std::mutex> guard(s.mutex);
    s.capturing = std::thread::id();
  }
  s.freed.notify_all();  // the calls waiting it out (awaitCaptureElsewhere)
}

namespace {
// torch 2.11: CUDAGeneratorState has one public capturing_ flag (Note [Random numbers while a
// graph is captured]).
template <typename State, typename = void>
struct HasGlobalCaptureFlag : std::false_type {};
template <typename State>
struct HasGlobalCaptureFlag<State, std::void_t<decltype(std::declval<State&>().capturing_)>>
    : std::true_type {};
}  // namespace

bool CaptureGate::needed() {
  return HasGlobalCaptureFlag<at::CUDAGeneratorState>::value;
}

std::shared_mutex& CaptureGate::of(c10::DeviceIndex device) {
  static std::mutex guard;
  static auto* gates = new std::map<c10::DeviceIndex, std::shared_mutex>();  // never freed
  std::lock_guard<std::mutex> lock(guard);
  return (*gates)[device];
}

CaptureGate::CaptureGate(c10::DeviceIndex device, bool exclusive) : exclusive_(exclusive) {
  if (!needed()) return;
  gate_ = &of(device);
  if (exclusive_) {
    if (!gate_->try_lock()) runBlocking([this] { gate_->lock(); });
  } else {
    if (!gate_->try_lock_shared()) runBlocking([this] { gate_->lock_shared(); });
  }
}

CaptureGate::~CaptureGate() {
  if (gate_ == nullptr) return;
  if (exclusive_) {
    gate_->unlock();
  } else {
    gate_->unlock_shared();
  }
}

DeviceLock::DeviceLock(c10::DeviceIndex device) : device_(device) {
  lock(device_);
}

DeviceLock::~DeviceLock() {
  unlock(device_);
}

}  // namespace graphtrees
