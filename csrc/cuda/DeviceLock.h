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
// The lock is never held across the user's code where it can be given up (Note [Locks around
// user code] below).

// Note [Locks around user code]
// The user's function may wait for another thread that makes graphed calls on the same device: a
// thread it starts and joins, or the backward that autograd runs on its device thread (Note [User
// code outside the tree lock] in TreeLock.h). A device lock held across that code made such a
// thread wait forever (design review 6, H2). So:
// * a warmup lends the lock out around the user's run (DeviceLock::Lent): its routing is the
//   thread's own (c10 routes by the calling thread), so another tree may restore, copy, capture
//   or warm up meanwhile -- except the warmup of a tree with a memory budget, whose fraction
//   would bound the other tree's allocations too (Note [Memory budget] above MemoryLimit): it
//   keeps the lock and marks the device as a capture does (below);
// * a capture cannot lend it (a second capture, a checkpoint or a restore would break it), so it
//   marks the device while the user's code runs (CapturingUserCode). A graphed call on another
//   thread that would warm up or record meanwhile (both need the lock) waits for the capture's
//   user code to return, but only for a while (kCapturePatience, Backend::awaitCapturesElsewhere(),
//   asked by TreeManager::callImpl): it may be the very thread the capture waits for, and past the
//   patience it runs eagerly instead, with the reason, as a call on a tree with a call in flight
//   does. Threads that merely happen to run beside a capture (a server's request threads) thus
//   still warm up and record as they would alone; only a thread the capture's user code really
//   waits for pays the patience, once per call made while it waits. Replays go on meanwhile
//   (they do not take the lock); evictions wait in the tree, and the trees of exited threads are
//   freed later (both free graphs and pools, which takes the lock);
// * a call that must wait for the device lock lends its tree lock out while it waits
//   (TreeLock::lendWhileWaiting), so no call waits for the device lock while holding a tree lock.
//   The order is therefore: device lock, then tree lock -- a thread holding the device lock may
//   wait for a tree lock (a capture whose user code returned takes its tree lock back; a thread
//   its user code joins looks for a backward's tree or sets a budget), never the reverse. What
//   holds a tree lock and takes the device lock outside a call (close() at reset, an eviction from
//   an idle tree) works on a tree no call holds.
// What is left: a thread whose graphed call began before the capture and waits for the device
// lock while the capture's user code waits for it still waits until the capture ends, and so does
// a replay of a graph that draws random numbers on torch 2.11 (the capture gate); see "Nested
// graphed calls" in docs/limitations.md.

#include <c10/core/Device.h>

#include <chrono>
#include <shared_mutex>

namespace graphtrees {

// How long a call that would warm up or record waits for another thread's capture to finish
// running the user's code before it runs eagerly (Note [Locks around user code]): far longer
// than a capture of user code takes, short enough that a thread the capture joins costs little.
constexpr std::chrono::milliseconds kCapturePatience{1000};

// Holds `device`'s allocation lock for its lifetime. The lock is recursive (a thread may take it
// again while it holds it) and is waited for with the GIL released and the thread's tree lock
// lent out (Note [Locks around user code]).
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

  // Whether a capture on a thread other than the caller's is running the user's code on `device`
  // (CapturingUserCode).
  static bool capturingUserCodeElsewhere(c10::DeviceIndex device);
  // Waits, with the GIL released and the thread's tree lock lent out, until no other thread's
  // capture on `device` runs the user's code or `patience` has passed; returns whether one still
  // does (Note [Locks around user code]).
  static bool awaitCaptureElsewhere(c10::DeviceIndex device, std::chrono::milliseconds patience);

  // Gives up every level of `device`'s lock the calling thread holds, and takes them back at
  // destruction: around a warmup's run of the user's code.
  class Lent {
   public:
    explicit Lent(c10::DeviceIndex device);
    ~Lent();
    Lent(const Lent&) = delete;
    Lent& operator=(const Lent&) = delete;

   private:
    c10::DeviceIndex device_;
    int depth_;
  };

  // Marks `device` for its lifetime as capturing the user's code on the calling thread, which
  // holds its lock.
  class CapturingUserCode {
   public:
    explicit CapturingUserCode(c10::DeviceIndex device);
    ~CapturingUserCode();
    CapturingUserCode(const CapturingUserCode&) = delete;
    CapturingUserCode& operator=(const CapturingUserCode&) = delete;

   private:
    c10::DeviceIndex device_;
  };

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
// still run side by side). Waited for with the GIL released. A warmup's run of the user's code
// (which lends the device lock out: Note [Locks around user code]) does not hold it: a capture
// would wait for that code, which may wait for the capture (a torch 2.11 run of the lock-order
// test deadlocked so); its CUDA random numbers raise while another thread captures, as the
// user's own eager ones do. torch >= 2.12 keeps one capture
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
