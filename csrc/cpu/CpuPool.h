#pragma once

// A private memory pool for the CPU emulation backend, modelled on one private pool of c10's CUDA
// caching allocator: segments obtained from the system, blocks carved out of them with size
// rounding, best-fit search, splitting and coalescing, and per-pool accounting. Checkpoint and
// restore follow the contract of getCheckpointState/setCheckpointPoolState.
//
// All pools share one mutex: blocks are freed from arbitrary threads by DataPtr deleters, which
// find their pool through a process-wide map from block address to pool.

#include "Backend.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

namespace graphtrees {

class CpuPool {
 public:
  // Size classes, as in c10's CUDA caching allocator.
  static constexpr size_t kMinBlockSize = 512;        // every block is a multiple of this
  static constexpr size_t kSmallSize = 1 << 20;       // requests up to this use small segments
  static constexpr size_t kSmallBuffer = 2 << 20;     // size of a small segment
  static constexpr size_t kLargeBuffer = 20 << 20;    // segment for requests in (1 MiB, 10 MiB)
  static constexpr size_t kMinLargeAlloc = 10 << 20;  // requests above get a segment of their own
  static constexpr size_t kRoundLarge = 2 << 20;      // ... rounded up to this

  // Creates a pool. The pool object lives until release() was called and its last allocated
  // block was freed, whichever comes last.
  static CpuPool* create();

  // Allocates `nbytes` (0 is not allowed) and returns the block's address. Throws
  // c10::OutOfMemoryError when that needs a segment the limit does not allow.
  void* malloc(size_t nbytes);
  // Caps the bytes of segments the pool may hold (-1: no cap). Segments it holds already stay.
  void setLimit(int64_t bytes);
  // Size of the last segment the limit refused.
  int64_t refusedBytes() const { return refused_bytes_; }
  // Returns to the system every entirely free segment that none of `keep` (checkpoints of this
  // pool) contains: a restore needs every segment of its checkpoint. Returns the bytes freed.
  int64_t releaseFreeSegments(const std::vector<const Checkpoint*>& keep);
  // Frees an allocated block of this pool.
  void free(void* ptr);
  // Owning DataPtr for an allocated block: its deleter frees the block.
  static c10::DataPtr makeDataPtr(void* ptr);
  // The deleter of those DataPtrs (frees the block in whichever pool owns it).
  static void deleteBlock(void* ptr);
  // The pool that owns the allocated block at `ptr`, if any.
  static CpuPool* poolOfAllocated(const void* ptr);

  bool contains(const void* ptr) const;

  std::shared_ptr<Checkpoint> checkpoint();
  RestoreResult restore(const Checkpoint& checkpoint);

  bool checkLiveAllocations(const std::unordered_set<void*>& expected);
  std::vector<void*> allocatedBlocks();
  PoolStats stats();

  // Returns all fully free segments to the system now and the others once they drain, then
  // deletes the pool. The pool must not be used afterwards.
  void release();
  // Returns every segment to the system now, allocated blocks included, and deletes the pool.
  // Only for a pool whose allocated blocks nothing can reach any more (a pool left inconsistent
  // by a failed restore, once its tree has invalidated every output).
  void releaseAll();

  int64_t id() const { return id_; }

  // Totals over every CPU pool still alive, including released pools whose last blocks are
  // still in use: {pools, allocated blocks, reserved bytes}.
  static std::vector<int64_t> globalStats();

 private:
  struct Segment;
  struct Block {
    uintptr_t ptr = 0;
    size_t size = 0;
    bool allocated = false;
    Block* prev = nullptr;
    Block* next = nullptr;
    Segment* segment = nullptr;
  };
  struct Segment {
    uintptr_t base = 0;
    size_t size = 0;
    bool small = false;
    Block* head = nullptr;
  };
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  class State;

  explicit CpuPool(int64_t id);
  ~CpuPool();

  static size_t roundSize(size_t nbytes);
  static size_t segmentSize(size_t rounded, bool small);
  // Frees the segment at `it` (entirely free) and returns the next one.
  std::map<uintptr_t, std::unique_ptr<Segment>>::iterator releaseSegmentLocked(
      std::map<uintptr_t, std::unique_ptr<Segment>>::iterator it);
  static bool entirelyFree(const Segment& seg) {
    return seg.head && !seg.head->next && !seg.head->allocated;
  }
  std::set<Block*, BlockLess>& freeSet(bool small) { return small ? small_free_ : large_free_; }
  Segment* newSegment(size_t rounded, bool small);
  void freeLocked(Block* block);
  void maybeDestroyLocked();
  Block* blockAt(uintptr_t ptr) const;

  int64_t id_;
  bool released_ = false;
  std::map<uintptr_t, std::unique_ptr<Segment>> segments_;  // by base address
  std::map<uintptr_t, Block*> allocated_;                   // allocated blocks by address
  std::set<Block*, BlockLess> small_free_;
  std::set<Block*, BlockLess> large_free_;
  int64_t allocated_bytes_ = 0;
  int64_t reserved_bytes_ = 0;
  int64_t num_blocks_ = 0;
  int64_t limit_ = -1;
  int64_t refused_bytes_ = 0;
};

}  // namespace graphtrees
