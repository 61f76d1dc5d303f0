#pragma once

// Note [One allocation phase per device]
// Only one capture may be under way on a device while other threads touch it freely: a device
// synchronisation from any thread invalidates it, c10's emptyCache() asserts that none is under
// way, and torch 2.11 keeps one capture state per generator. Trees of different threads share
// the device, so everything a tree does with the allocator -- warmups (routed), placeholder
// copies, captures, checkpoints, restores and the release of its pool -- holds the device's
// allocation lock, taken with the GIL released. Replays do not take it: they launch a graph and
// allocate nothing. Waits are for streams (the tree's, the caller's and those replays ran on),
// never for the whole device, so a user's own capture on another stream stays valid too. With
// one phase at a time per device, the memory fraction that a budget lowers (applyLimit) is saved
// and restored by one tree at a time.

#include <c10/core/Device.h>

namespace graphtrees {

// Holds `device`'s allocation lock for its lifetime. The lock is recursive (a thread may take it
// again while it holds it) and is waited for with the GIL released.
class DeviceLock {
 public:
  explicit DeviceLock(c10::DeviceIndex device);
  ~DeviceLock();
  DeviceLock(const DeviceLock&) = delete;
  DeviceLock& operator=(const DeviceLock&) = delete;

  // For a lock held from one call to another (pool routing): lock() in the first, unlock() in
  // the second, on the same thread.
  static void lock(c10::DeviceIndex device);
  static void unlock(c10::DeviceIndex device);

 private:
  c10::DeviceIndex device_;
};

}  // namespace graphtrees
