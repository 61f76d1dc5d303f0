#include "cuda/DeviceLock.h"

#include "PythonHooks.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace graphtrees {

namespace {

std::recursive_mutex& deviceMutex(c10::DeviceIndex device) {
  static std::mutex guard;
  static auto* mutexes = new std::map<c10::DeviceIndex, std::recursive_mutex>();  // never freed
  std::lock_guard<std::mutex> lock(guard);
  return (*mutexes)[device];
}

}  // namespace

void DeviceLock::lock(c10::DeviceIndex device) {
  std::recursive_mutex& m = deviceMutex(device);
  if (m.try_lock()) return;
  runBlocking([&m] { m.lock(); });
}

void DeviceLock::unlock(c10::DeviceIndex device) {
  deviceMutex(device).unlock();
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
