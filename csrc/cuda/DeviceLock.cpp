#include "cuda/DeviceLock.h"

#include "PythonHooks.h"

#include <map>
#include <mutex>

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

DeviceLock::DeviceLock(c10::DeviceIndex device) : device_(device) {
  lock(device_);
}

DeviceLock::~DeviceLock() {
  unlock(device_);
}

}  // namespace graphtrees
