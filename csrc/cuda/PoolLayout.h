#pragma once

// A private pool's segments and blocks as c10's allocator snapshot shows them, and what the CUDA
// backend reads off them: its stats, its allocated blocks, and a capture's footprint.

#include "Backend.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

namespace graphtrees {

class PoolLayout {
 public:
  struct Block {
    uintptr_t ptr;
    size_t size;
    bool allocated;
  };
  struct Segment {
    Interval range;
    std::vector<Block> blocks;
  };

  // The segments of `pool` on `device`, now.
  static PoolLayout of(c10::DeviceIndex device, c10::cuda::MempoolId_t pool);

  const std::vector<Segment>& segments() const { return segments_; }
  // The segments' ranges, merged.
  std::vector<Interval> ranges() const;
  std::vector<void*> allocatedBlocks() const;
  PoolStats stats() const;
  // (address, size) of every allocated block.
  std::set<std::pair<uintptr_t, size_t>> allocated() const;

  // What a capture wrote, from this layout (after it) and the blocks allocated before it: the
  // pool's segments minus the blocks that were allocated before and still are, at the same place
  // and size -- unless such a block now holds one of `outputs` (it was freed and allocated again
  // during the capture). An output that is one of `inputs`' storages (an alias: AOTAutograd's
  // forward returns inputs it saves for the backward) was not allocated by the capture, so its
  // block stays out (found on the CUDA stand-in).
  std::vector<Interval> footprintSince(const std::set<std::pair<uintptr_t, size_t>>& before,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs) const;

 private:
  std::vector<Segment> segments_;
};

}  // namespace graphtrees
