#pragma once

// Note [One allocation phase per device]
// Only one capture may be under way on a device while other threads touch it freely: a device
// synchronisation from any thread invalidates it, c10's emptyCache() asserts that none is under
// way, and torch 2.11 keeps one capture state per generator. Trees of different threads share
// the device, so everything a tree does with the allocator -- warmups (routed), placeholder
// copies, captures, checkpoints, restores and the release of its pool -- holds the device's
// allocation lock, taken with the GIL released. Replays do not take it: they launch a graph and
// allocate nothing. The host waits for the tree's own stream only (Note [Streams of the pool] in
// PoolStreams.cpp), never for the whole device or the legacy default stream, so a user's own
// capture on another stream stays valid too. With
// one phase at a time per device, the memory fraction that a budget lowers (applyLimit) is saved
// and restored by one tree at a time.

#include <c10/core/Device.h>

#include <shared_mutex>

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

// Note [Random numbers while a graph is captured]
// On torch 2.11 a generator's state has one "capturing" flag, which capture_begin() sets on the
// device's default generator (and on every generator registered with the graph) until
// capture_end(): while it is set, CUDA random numbers drawn on any other thread raise "Offset
// increment outside graph capture encountered unexpectedly" -- a replay advances its
// generators too, so another thread's replay of a graph that draws random numbers would raise
// (review 4, #3). The capture gate keeps the two apart: a capture holds it exclusively from
// capture_begin() to the end of the capture, a replay of such a graph holds it shared (replays
// still run side by side). Waited for with the GIL released. torch >= 2.12 keeps one capture
// state per capture id and needs no gate. Eager random ops of the user's own on other threads
// cannot be gated: on torch 2.11 they raise while graphtrees records (docs/limitations.md).
class CaptureGate {
 public:
  // Whether the gate is needed with this torch (decided from its headers).
  static bool needed();
  static std::shared_mutex& of(c10::DeviceIndex device);
  // Holds the gate shared (a replay) or exclusively (a capture) for its lifetime.
  CaptureGate(c10::DeviceIndex device, bool exclusive);
  ~CaptureGate();
  CaptureGate(const CaptureGate&) = delete;
  CaptureGate& operator=(const CaptureGate&) = delete;

 private:
  std::shared_mutex* gate_ = nullptr;
  bool exclusive_ = false;
};

}  // namespace graphtrees
