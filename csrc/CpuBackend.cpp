#include "CpuBackend.h"

#include "CpuPool.h"

#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_set>

namespace graphtrees {

namespace {

struct Allocation {
  uintptr_t ptr;
  size_t nbytes;
};

enum class RouteMode { kPool, kCapture, kReplay };

// Which replay allocations are alive. A replay hands out recorded addresses; if a temporary lives
// longer than it did in the recording (a data-dependent lifetime), a later allocation would get
// memory it still uses. Shared with the replay DataPtrs' contexts, which may outlive the replay.
struct ReplayLiveness {
  std::mutex mutex;
  std::map<uintptr_t, std::pair<uintptr_t, size_t>> alive;  // start -> (end, allocation index)
};

struct ReplayToken {
  std::shared_ptr<ReplayLiveness> liveness;
  uintptr_t start;
};

void replayFree(void* ctx) {
  auto* token = static_cast<ReplayToken*>(ctx);
  {
    std::lock_guard<std::mutex> lock(token->liveness->mutex);
    token->liveness->alive.erase(token->start);
  }
  delete token;
}

// The routing of one thread. States nest (a stack through `prev`).
struct RouteState {
  RouteMode mode = RouteMode::kPool;
  CpuPool* pool = nullptr;
  std::vector<Allocation>* recording = nullptr;       // capture
  const std::vector<Allocation>* recorded = nullptr;  // replay
  size_t cursor = 0;                                  // replay
  std::string divergence;                             // replay: first mismatch, if any
  std::shared_ptr<ReplayLiveness> liveness;           // replay
  const std::string* function_name = nullptr;
  RouteState* prev = nullptr;
};

thread_local RouteState* tls_route = nullptr;

class RouteGuard {
 public:
  explicit RouteGuard(RouteState* state) : state_(state) {
    state_->prev = tls_route;
    tls_route = state_;
  }
  ~RouteGuard() { tls_route = state_->prev; }
  RouteGuard(const RouteGuard&) = delete;
  RouteGuard& operator=(const RouteGuard&) = delete;

 private:
  RouteState* state_;
};

c10::Allocator* g_fallback = nullptr;

void routerRawDelete(void* ptr) {
  if (CpuPool::poolOfAllocated(ptr) != nullptr) {
    CpuPool::deleteBlock(ptr);
  } else if (ptr != nullptr) {
    g_fallback->raw_deleter()(ptr);
  }
}

c10::DataPtr replayAllocate(RouteState* st, size_t nbytes) {
  const auto& rec = *st->recorded;
  const size_t i = st->cursor++;
  if (st->divergence.empty()) {
    if (i >= rec.size()) {
      st->divergence = "the replay made allocation #" + std::to_string(i) + " (" +
                       std::to_string(nbytes) + " bytes) but the recording made only " +
                       std::to_string(rec.size());
    } else if (rec[i].nbytes != nbytes) {
      st->divergence = "allocation #" + std::to_string(i) + " asked for " + std::to_string(nbytes) +
                       " bytes where the recording asked for " + std::to_string(rec[i].nbytes);
    } else {
      const uintptr_t begin = rec[i].ptr;
      const uintptr_t end = begin + nbytes;
      std::lock_guard<std::mutex> lock(st->liveness->mutex);
      auto& alive = st->liveness->alive;
      auto it = alive.upper_bound(begin);
      if (it != alive.begin() && std::prev(it)->second.first > begin) --it;
      if (it != alive.end() && it->first < end) {
        st->divergence = "allocation #" + std::to_string(i) +
                         " would reuse the memory of allocation #" +
                         std::to_string(it->second.second) +
                         ", which is still alive in this replay although it was freed at that "
                         "point of the recording (a data-dependent lifetime)";
      } else {
        alive.emplace(begin, std::make_pair(end, i));
      }
    }
  }
  TORCH_CHECK(st->divergence.empty(), "graphtrees: the replay of '", *st->function_name,
              "' diverged from its recording: ", st->divergence,
              ". Its allocations depend on the input values (data-dependent control flow or "
              "shapes), which a recorded graph cannot reproduce. Run it eagerly, or make the "
              "data-dependent part a separate, unwrapped function.");
  // Not owning pool memory: a replay writes the recorded address and the pool's bookkeeping is
  // untouched; the deleter only records that the allocation died.
  return c10::DataPtr(reinterpret_cast<void*>(rec[i].ptr),
                      new ReplayToken{st->liveness, rec[i].ptr}, &replayFree,
                      c10::Device(c10::DeviceType::CPU));
}

// Installed once as c10's CPU allocator; see Note [CPU emulation of graphs].
class RouterAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    RouteState* st = tls_route;
    if (C10_LIKELY(st == nullptr) || nbytes == 0) return g_fallback->allocate(nbytes);
    if (st->mode == RouteMode::kReplay) return replayAllocate(st, nbytes);
    void* ptr = st->pool->malloc(nbytes);
    if (st->mode == RouteMode::kCapture) {
      st->recording->push_back({reinterpret_cast<uintptr_t>(ptr), nbytes});
    }
    return CpuPool::makeDataPtr(ptr);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &routerRawDelete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RouterAllocator* installRouter() {
  static RouterAllocator* router = [] {
    g_fallback = c10::GetCPUAllocator();
    auto* r = new RouterAllocator();
    c10::SetCPUAllocator(r, /*priority=*/1);
    return r;
  }();
  return router;
}

void checkRouterInstalled() {
  TORCH_CHECK(c10::GetCPUAllocator() == installRouter(),
              "graphtrees: another CPU allocator replaced graphtrees' routing allocator after it "
              "was installed, so CPU graphs cannot be emulated. Do not install a custom CPU "
              "allocator (c10::SetCPUAllocator) in a process that uses graphtrees on CPU.");
}

std::vector<Interval> footprintOf(const std::vector<Allocation>& allocs) {
  std::vector<Interval> v;
  v.reserve(allocs.size());
  for (const auto& a : allocs) v.push_back({a.ptr, a.ptr + a.nbytes});
  mergeIntervals(&v);
  return v;
}

// Where and how a recording's output lay, so that a replay can be checked against it.
struct OutputLayout {
  const void* storage;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset;
};

OutputLayout layoutOf(const at::Tensor& t) {
  return {t.storage().data(), t.sizes().vec(), t.strides().vec(), t.storage_offset()};
}

class CpuGraph final : public Graph {
 public:
  CpuGraph(std::vector<Allocation> allocations, std::vector<OutputLayout> outputs, std::string name)
      : allocations_(std::move(allocations)),
        footprint_(footprintOf(allocations_)),
        outputs_(std::move(outputs)),
        name_(std::move(name)) {}

  void replay(const RunFn& run, const std::vector<at::Tensor>& inputs) override {
    RouteState st;
    st.mode = RouteMode::kReplay;
    st.recorded = &allocations_;
    st.function_name = &name_;
    st.liveness = std::make_shared<ReplayLiveness>();
    std::vector<at::Tensor> outputs;
    {
      RouteGuard guard(&st);
      outputs = run(inputs);
    }
    if (st.divergence.empty() && st.cursor != allocations_.size()) {
      st.divergence = "the replay made " + std::to_string(st.cursor) +
                      " allocations where the recording made " +
                      std::to_string(allocations_.size());
    }
    // The outputs must come back where and as the recording's did: the tree rebuilds them from
    // the recording's metadata (as a CUDA graph replay would).
    for (size_t i = 0; st.divergence.empty() && i < outputs.size(); ++i) {
      const OutputLayout now = layoutOf(outputs[i]);
      const OutputLayout& then = outputs_[i];
      if (now.storage != then.storage) {
        st.divergence = "output " + std::to_string(i) +
                        " came back at another address (the order of its allocations changed)";
      } else if (now.sizes != then.sizes || now.strides != then.strides ||
                 now.storage_offset != then.storage_offset) {
        st.divergence = "output " + std::to_string(i) + " has shape " +
                        c10::str(c10::IntArrayRef(now.sizes)) + " where the recording's had " +
                        c10::str(c10::IntArrayRef(then.sizes)) +
                        " (its shape or layout depends on the input values)";
      }
    }
    if (st.divergence.empty() && outputs.size() != outputs_.size()) {
      st.divergence = "it returned " + std::to_string(outputs.size()) +
                      " tensors where the "
                      "recording returned " +
                      std::to_string(outputs_.size());
    }
    TORCH_CHECK(st.divergence.empty(), "graphtrees: the replay of '", name_,
                "' diverged from its recording: ", st.divergence,
                ". It depends on the input values (data-dependent control flow, shapes or "
                "lifetimes), which a recorded graph cannot reproduce.");
    // Anything still alive that is not an output was kept by the function (on a module, in a
    // global): the next run would overwrite it without anyone knowing.
    outputs.clear();
    std::unordered_set<uintptr_t> output_storages;
    for (const auto& o : outputs_) output_storages.insert(reinterpret_cast<uintptr_t>(o.storage));
    size_t kept = 0;
    {
      std::lock_guard<std::mutex> lock(st.liveness->mutex);
      for (const auto& kv : st.liveness->alive) kept += output_storages.count(kv.first) ? 0 : 1;
    }
    TORCH_CHECK(kept == 0, "graphtrees: the replay of '", name_, "' kept ", kept,
                " tensor(s) it allocated without returning them (for example a cache stored on a "
                "module or in a global). Their memory belongs to the graph and is overwritten by "
                "the next run. Create such state before wrapping the function, or return it.");
  }

  const std::vector<Interval>& footprint() const override { return footprint_; }
  bool replayRunsCallable() const override { return true; }

 private:
  std::vector<Allocation> allocations_;
  std::vector<Interval> footprint_;
  std::vector<OutputLayout> outputs_;
  std::string name_;
};

}  // namespace

CpuBackend::CpuBackend() : pool_(CpuPool::create()) {
  installRouter();
}

CpuBackend::~CpuBackend() {
  releasePool();
}

void CpuBackend::releasePool() {
  if (pool_ != nullptr) {
    pool_->release();
    pool_ = nullptr;
  }
}

void CpuBackend::beginAllocateToPool() {
  TORCH_INTERNAL_ASSERT(pool_ != nullptr);
  checkRouterInstalled();
  auto* st = new RouteState();
  st->mode = RouteMode::kPool;
  st->pool = pool_;
  st->prev = tls_route;
  tls_route = st;
}

void CpuBackend::endAllocateToPool() {
  RouteState* st = tls_route;
  TORCH_INTERNAL_ASSERT(st != nullptr && st->mode == RouteMode::kPool && st->pool == pool_,
                        "endAllocateToPool without a matching beginAllocateToPool");
  tls_route = st->prev;
  delete st;
}

std::unique_ptr<Graph> CpuBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                           std::vector<at::Tensor>* outputs,
                                           const std::string& function_name) {
  TORCH_INTERNAL_ASSERT(pool_ != nullptr);
  checkRouterInstalled();
  std::vector<Allocation> allocations;
  RouteState st;
  st.mode = RouteMode::kCapture;
  st.pool = pool_;
  st.recording = &allocations;
  st.function_name = &function_name;
  {
    RouteGuard guard(&st);
    *outputs = run(inputs);
  }
  std::vector<OutputLayout> layouts;
  layouts.reserve(outputs->size());
  for (const auto& t : *outputs) layouts.push_back(layoutOf(t));
  return std::make_unique<CpuGraph>(std::move(allocations), std::move(layouts), function_name);
}

void CpuBackend::copyInputs(const std::vector<at::Tensor>& dst,
                            const std::vector<at::Tensor>& src) {
  TORCH_INTERNAL_ASSERT(dst.size() == src.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

std::shared_ptr<Checkpoint> CpuBackend::checkpoint() {
  return pool_->checkpoint();
}

RestoreResult CpuBackend::restore(const Checkpoint& checkpoint) {
  return pool_->restore(checkpoint);
}

void CpuBackend::freeBlock(void* ptr) {
  pool_->free(ptr);
}

c10::DeleterFnPtr CpuBackend::poolDeleter() const {
  return &CpuPool::deleteBlock;
}

bool CpuBackend::inPool(const void* ptr) const {
  return pool_ != nullptr && pool_->contains(ptr);
}

bool CpuBackend::checkLiveAllocations(const std::unordered_set<void*>& expected) {
  return pool_->checkLiveAllocations(expected);
}

std::vector<void*> CpuBackend::allocatedBlocks() {
  return pool_->allocatedBlocks();
}

PoolStats CpuBackend::stats() {
  return pool_ != nullptr ? pool_->stats() : PoolStats{};
}

}  // namespace graphtrees
