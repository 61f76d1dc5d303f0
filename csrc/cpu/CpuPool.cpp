#include "cpu/CpuPool.h"

#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace graphtrees {

namespace {

std::mutex& poolMutex() {
  static std::mutex m;
  return m;
}

// Allocated block address -> pool. Guarded by poolMutex().
std::unordered_map<uintptr_t, CpuPool*>& blockOwners() {
  static auto* owners = new std::unordered_map<uintptr_t, CpuPool*>();  // never destroyed:
  return *owners;  // deleters may run during interpreter shutdown
}

std::atomic<int64_t> next_pool_id{1};

// Every live pool (guarded by poolMutex()).
std::unordered_map<CpuPool*, bool>& livePools() {
  static auto* pools = new std::unordered_map<CpuPool*, bool>();
  return *pools;
}

}  // namespace

// A checkpoint: the layout of every segment of the pool (block sizes and allocation state).
class CpuPool::State : public Checkpoint {
 public:
  struct BlockState {
    size_t size;
    bool allocated;
  };
  struct SegmentState {
    uintptr_t base;
    size_t size;
    std::vector<BlockState> blocks;
  };
  int64_t pool_id = 0;
  std::vector<SegmentState> segments;
};

CpuPool* CpuPool::create() {
  std::lock_guard<std::mutex> lock(poolMutex());
  return new CpuPool(next_pool_id++);
}

CpuPool::CpuPool(int64_t id) : id_(id) {
  livePools()[this] = true;
}

CpuPool::~CpuPool() {
  livePools().erase(this);
  for (auto& kv : segments_) {
    Block* b = kv.second->head;
    while (b) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    c10::free_cpu(reinterpret_cast<void*>(kv.second->base));
  }
}

size_t CpuPool::roundSize(size_t nbytes) {
  return ((nbytes + kMinBlockSize - 1) / kMinBlockSize) * kMinBlockSize;
}

size_t CpuPool::segmentSize(size_t rounded, bool small) {
  if (small) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return ((rounded + kRoundLarge - 1) / kRoundLarge) * kRoundLarge;
}

CpuPool::Segment* CpuPool::newSegment(size_t rounded, bool small) {
  const size_t seg_size = segmentSize(rounded, small);
  if (limit_ >= 0 && reserved_bytes_ + static_cast<int64_t>(seg_size) > limit_) {
    refused_bytes_ = static_cast<int64_t>(seg_size);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "graphtrees: CPU pool ", id_, " holds ",
                     reserved_bytes_, " bytes and may hold at most ", limit_,
                     " (graphtrees.set_memory_budget); a new segment of ", seg_size,
                     " bytes would exceed that");
  }
  void* mem = c10::alloc_cpu(seg_size);
  auto seg = std::make_unique<Segment>();
  seg->base = reinterpret_cast<uintptr_t>(mem);
  seg->size = seg_size;
  seg->small = small;
  auto* block = new Block();
  block->ptr = seg->base;
  block->size = seg_size;
  block->segment = seg.get();
  seg->head = block;
  Segment* raw = seg.get();
  segments_.emplace(seg->base, std::move(seg));
  reserved_bytes_ += static_cast<int64_t>(seg_size);
  num_blocks_ += 1;
  freeSet(small).insert(block);
  return raw;
}

void* CpuPool::malloc(size_t nbytes) {
  TORCH_INTERNAL_ASSERT(nbytes > 0);
  std::lock_guard<std::mutex> lock(poolMutex());
  TORCH_INTERNAL_ASSERT(!released_, "graphtrees: allocation from a released CPU pool");
  const size_t rounded = roundSize(nbytes);
  const bool small = rounded <= kSmallSize;
  auto& free_set = freeSet(small);
  Block key;
  key.size = rounded;
  key.ptr = 0;
  auto it = free_set.lower_bound(&key);  // best fit: smallest block that is large enough
  Block* block;
  if (it == free_set.end()) {
    newSegment(rounded, small);
    it = free_set.lower_bound(&key);
    TORCH_INTERNAL_ASSERT(it != free_set.end());
  }
  block = *it;
  free_set.erase(it);
  const size_t remaining = block->size - rounded;
  const bool split = small ? remaining >= kMinBlockSize : remaining > kSmallSize;
  if (split) {
    auto* rest = new Block();
    rest->ptr = block->ptr + rounded;
    rest->size = remaining;
    rest->segment = block->segment;
    rest->prev = block;
    rest->next = block->next;
    if (block->next) block->next->prev = rest;
    block->next = rest;
    block->size = rounded;
    free_set.insert(rest);
    num_blocks_ += 1;
  }
  block->allocated = true;
  allocated_.emplace(block->ptr, block);
  allocated_bytes_ += static_cast<int64_t>(block->size);
  blockOwners()[block->ptr] = this;
  return reinterpret_cast<void*>(block->ptr);
}

CpuPool::Block* CpuPool::blockAt(uintptr_t ptr) const {
  auto it = allocated_.find(ptr);
  return it == allocated_.end() ? nullptr : it->second;
}

void CpuPool::freeLocked(Block* block) {
  TORCH_INTERNAL_ASSERT(block->allocated);
  allocated_.erase(block->ptr);
  blockOwners().erase(block->ptr);
  allocated_bytes_ -= static_cast<int64_t>(block->size);
  block->allocated = false;
  auto& free_set = freeSet(block->segment->small);
  // Coalesce with free neighbours.
  for (Block* neighbour : {block->prev, block->next}) {
    if (!neighbour || neighbour->allocated) continue;
    free_set.erase(neighbour);
    if (neighbour == block->prev) {
      neighbour->size += block->size;
      neighbour->next = block->next;
      if (block->next) block->next->prev = neighbour;
      if (block->segment->head == block) block->segment->head = neighbour;
      delete block;
      block = neighbour;
    } else {
      block->size += neighbour->size;
      block->next = neighbour->next;
      if (neighbour->next) neighbour->next->prev = block;
      delete neighbour;
    }
    num_blocks_ -= 1;
  }
  free_set.insert(block);
}

void CpuPool::free(void* ptr) {
  std::lock_guard<std::mutex> lock(poolMutex());
  Block* block = blockAt(reinterpret_cast<uintptr_t>(ptr));
  TORCH_CHECK(block != nullptr, "graphtrees: freeing ", ptr,
              " which is not an allocated block of CPU pool ", id_);
  freeLocked(block);
  maybeDestroyLocked();
}

void CpuPool::deleteBlock(void* ptr) {
  std::lock_guard<std::mutex> lock(poolMutex());
  auto& owners = blockOwners();
  auto it = owners.find(reinterpret_cast<uintptr_t>(ptr));
  // A block that a restore took away from its owner is no longer registered: the owner's late
  // free is ignored (the tree never lets this happen to a tensor it tracks).
  if (it == owners.end()) return;
  CpuPool* pool = it->second;
  pool->freeLocked(pool->blockAt(reinterpret_cast<uintptr_t>(ptr)));
  pool->maybeDestroyLocked();
}

c10::DataPtr CpuPool::makeDataPtr(void* ptr) {
  return c10::DataPtr(ptr, ptr, &CpuPool::deleteBlock, c10::Device(c10::DeviceType::CPU));
}

CpuPool* CpuPool::poolOfAllocated(const void* ptr) {
  std::lock_guard<std::mutex> lock(poolMutex());
  auto& owners = blockOwners();
  auto it = owners.find(reinterpret_cast<uintptr_t>(ptr));
  return it == owners.end() ? nullptr : it->second;
}

bool CpuPool::contains(const void* ptr) const {
  std::lock_guard<std::mutex> lock(poolMutex());
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto it = segments_.upper_bound(p);
  if (it == segments_.begin()) return false;
  --it;
  return p < it->second->base + it->second->size;
}

std::shared_ptr<Checkpoint> CpuPool::checkpoint() {
  std::lock_guard<std::mutex> lock(poolMutex());
  auto state = std::make_shared<State>();
  state->pool_id = id_;
  for (auto& kv : segments_) {
    State::SegmentState seg{kv.second->base, kv.second->size, {}};
    for (Block* b = kv.second->head; b; b = b->next) seg.blocks.push_back({b->size, b->allocated});
    state->segments.push_back(std::move(seg));
  }
  return state;
}

// Note [CPU pool restore]
// Same algorithm as c10's setCheckpointPoolState: free every block currently allocated in the
// pool, then lay every checkpointed segment out exactly as it was, then hand out owning DataPtrs
// for the blocks that were allocated in the checkpoint. Segments created after the checkpoint stay
// in the pool, entirely free. The caller decides which of the returned DataPtrs become owned by
// live tensors; the others free their block when dropped.
RestoreResult CpuPool::restore(const Checkpoint& checkpoint) {
  const auto* state = dynamic_cast<const State*>(&checkpoint);
  TORCH_INTERNAL_ASSERT(state && state->pool_id == id_, "checkpoint of another pool");
  RestoreResult result;
  std::lock_guard<std::mutex> lock(poolMutex());
  // All or nothing: everything that can fail is checked before the pool changes, so a failed
  // restore leaves the pool exactly as it was (see RestoreError::poolUnchanged()).
  for (const auto& seg_state : state->segments) {
    auto it = segments_.find(seg_state.base);
    TORCH_CHECK(it != segments_.end() && it->second->size == seg_state.size,
                "graphtrees: a checkpointed segment of CPU pool ", id_, " is no longer in it");
    size_t total = 0;
    for (const auto& bs : seg_state.blocks) total += bs.size;
    TORCH_CHECK(total == seg_state.size, "graphtrees: a checkpointed segment of CPU pool ", id_,
                " does not add up to its size");
  }
  while (!allocated_.empty()) {
    Block* b = allocated_.begin()->second;
    result.ptrs_freed.push_back(reinterpret_cast<void*>(b->ptr));
    freeLocked(b);
  }
  for (const auto& seg_state : state->segments) {
    Segment* seg = segments_.at(seg_state.base).get();
    // After freeing everything the segment is one free block.
    TORCH_INTERNAL_ASSERT(entirelyFree(*seg));
    freeSet(seg->small).erase(seg->head);
    delete seg->head;
    num_blocks_ -= 1;
    seg->head = nullptr;
    Block* prev = nullptr;
    uintptr_t ptr = seg->base;
    for (const auto& bs : seg_state.blocks) {
      auto* b = new Block();
      b->ptr = ptr;
      b->size = bs.size;
      b->segment = seg;
      b->prev = prev;
      if (prev) {
        prev->next = b;
      } else {
        seg->head = b;
      }
      num_blocks_ += 1;
      if (bs.allocated) {
        b->allocated = true;
        allocated_.emplace(b->ptr, b);
        allocated_bytes_ += static_cast<int64_t>(b->size);
        blockOwners()[b->ptr] = this;
      } else {
        freeSet(seg->small).insert(b);
      }
      ptr += bs.size;
      prev = b;
    }
    TORCH_INTERNAL_ASSERT(ptr == seg->base + seg->size);
  }
  // Everything was freed first, so the allocated blocks are exactly the checkpoint's.
  for (auto& kv : allocated_) {
    result.dataptrs_allocd.push_back(makeDataPtr(reinterpret_cast<void*>(kv.first)));
  }
  return result;
}

bool CpuPool::checkLiveAllocations(const std::unordered_set<void*>& expected) {
  std::lock_guard<std::mutex> lock(poolMutex());
  if (expected.size() != allocated_.size()) return false;
  for (void* p : expected) {
    if (!allocated_.count(reinterpret_cast<uintptr_t>(p))) return false;
  }
  return true;
}

std::vector<void*> CpuPool::allocatedBlocks() {
  std::lock_guard<std::mutex> lock(poolMutex());
  std::vector<void*> out;
  out.reserve(allocated_.size());
  for (auto& kv : allocated_) out.push_back(reinterpret_cast<void*>(kv.first));
  return out;
}

PoolStats CpuPool::stats() {
  std::lock_guard<std::mutex> lock(poolMutex());
  PoolStats s;
  s.reserved_bytes = reserved_bytes_;
  s.allocated_bytes = allocated_bytes_;
  s.segments = static_cast<int64_t>(segments_.size());
  s.blocks = num_blocks_;
  s.allocated_blocks = static_cast<int64_t>(allocated_.size());
  return s;
}

std::vector<int64_t> CpuPool::globalStats() {
  std::lock_guard<std::mutex> lock(poolMutex());
  std::vector<int64_t> out{0, 0, 0};
  for (auto& kv : livePools()) {
    out[0] += 1;
    out[1] += static_cast<int64_t>(kv.first->allocated_.size());
    out[2] += kv.first->reserved_bytes_;
  }
  return out;
}

void CpuPool::setLimit(int64_t bytes) {
  std::lock_guard<std::mutex> lock(poolMutex());
  limit_ = bytes;
}

int64_t CpuPool::releaseFreeSegments(const std::vector<const Checkpoint*>& keep) {
  std::set<uintptr_t> kept;
  for (const Checkpoint* c : keep) {
    const auto* state = dynamic_cast<const State*>(c);
    TORCH_INTERNAL_ASSERT(state && state->pool_id == id_, "checkpoint of another pool");
    for (const auto& seg : state->segments) kept.insert(seg.base);
  }
  std::lock_guard<std::mutex> lock(poolMutex());
  int64_t freed = 0;
  for (auto it = segments_.begin(); it != segments_.end();) {
    if (entirelyFree(*it->second) && !kept.count(it->first)) {
      freed += static_cast<int64_t>(it->second->size);
      it = releaseSegmentLocked(it);
    } else {
      ++it;
    }
  }
  return freed;
}

std::map<uintptr_t, std::unique_ptr<CpuPool::Segment>>::iterator CpuPool::releaseSegmentLocked(
    std::map<uintptr_t, std::unique_ptr<Segment>>::iterator it) {
  Segment* seg = it->second.get();
  freeSet(seg->small).erase(seg->head);
  delete seg->head;
  num_blocks_ -= 1;
  reserved_bytes_ -= static_cast<int64_t>(seg->size);
  c10::free_cpu(reinterpret_cast<void*>(seg->base));
  return segments_.erase(it);
}

void CpuPool::release() {
  std::lock_guard<std::mutex> lock(poolMutex());
  released_ = true;
  maybeDestroyLocked();
}

void CpuPool::releaseAll() {
  std::lock_guard<std::mutex> lock(poolMutex());
  released_ = true;
  for (auto& kv : allocated_) blockOwners().erase(kv.first);
  allocated_.clear();
  delete this;
}

void CpuPool::maybeDestroyLocked() {
  if (!released_) return;
  // Return fully free segments to the system right away.
  for (auto it = segments_.begin(); it != segments_.end();) {
    it = entirelyFree(*it->second) ? releaseSegmentLocked(it) : std::next(it);
  }
  if (allocated_.empty()) delete this;
}

}  // namespace graphtrees
