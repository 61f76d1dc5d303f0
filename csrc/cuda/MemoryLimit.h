#pragma once

// Note [Memory budget] (Backend.h) on CUDA: c10 has no per-pool cap, only a per-process fraction of
// the device that bounds the bytes all pools reserve together. While a thread allocates into a
// tree's pool, the fraction is lowered so that the device's other reservations may stay and the
// pool may grow up to the cap; c10 then fails the allocation with its out-of-memory error.
// Another thread allocating on the device in that window is bounded too (docs/serving.md, "Memory
// budget and out of memory"). Applied and lifted under the device's allocation lock (Note [One
// allocation phase per device] in DeviceLock.h). A warmup lends that lock out while the user's
// code runs (Note [Locks around user code]), but not the warmup of a tree with a budget: the
// fraction it applied counts only its own pool's growth, so a second budgeted warmup beside it
// would run out of memory under the first one's fraction although each pool stayed under its
// own cap (found in review, reproduced on the CUDA stand-in). So at most one limit is applied on
// a device at a time; the device still keeps one record of them (the fraction the user set,
// saved when the first is applied and put back when the last is lifted, and in between the
// lowest of the applied ones), which a limit applied by a capture and one by a warmup share.

#include <c10/core/Device.h>

#include <cstdint>

namespace graphtrees {

class MemoryLimit {
 public:
  explicit MemoryLimit(c10::DeviceIndex device) : device_(device) {}
  // Lifts a limit still applied (the device keeps no entry for a limit that is gone).
  ~MemoryLimit();
  MemoryLimit(const MemoryLimit&) = delete;
  MemoryLimit& operator=(const MemoryLimit&) = delete;

  // The cap on the pool's reserved bytes; -1 removes it.
  void setBytes(int64_t bytes) { limit_ = bytes; }
  bool capped() const { return limit_ >= 0; }
  // Lowers the device's fraction so that a pool that reserves `pool_reserved` bytes now can grow
  // to the cap and no further. Nothing without a cap, or while applied already.
  void apply(int64_t pool_reserved);
  // Puts the fraction saved by apply() back.
  void lift();

  // Lifts on destruction (a failure is logged); apply() by the caller.
  class Scope {
   public:
    explicit Scope(MemoryLimit& limit) : limit_(limit) {}
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    MemoryLimit& limit_;
  };

 private:
  c10::DeviceIndex device_;
  int64_t limit_ = -1;
  bool applied_ = false;
};

}  // namespace graphtrees
