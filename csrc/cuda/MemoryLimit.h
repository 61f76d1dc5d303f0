#pragma once

// Note [Memory budget] (Backend.h) on CUDA: c10 has no per-pool cap, only a per-process fraction of
// the device that bounds the bytes all pools reserve together. While a thread allocates into a
// tree's pool, the fraction is lowered so that the device's other reservations may stay and the
// pool may grow up to the cap; c10 then fails the allocation with its out-of-memory error.
// Another thread allocating on the device in that window is bounded too (docs/serving.md, "Memory
// budget and out of memory"). Applied and lifted under the device's allocation lock (Note [One
// allocation phase per device] in DeviceLock.h), so that the fraction saved is always the one the
// user set.

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

namespace graphtrees {

class MemoryLimit {
 public:
  explicit MemoryLimit(c10::DeviceIndex device) : device_(device) {}

  // The cap on the pool's reserved bytes; -1 removes it.
  void setBytes(int64_t bytes) { limit_ = bytes; }
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
  std::optional<double> saved_fraction_;  // while applied
};

}  // namespace graphtrees
