#include "CpuBackend.h"

#include "AutocastState.h"
#include "CollectiveBuffers.h"
#include "CpuPool.h"
#include "FailureInjection.h"
#include "Logging.h"
#include "ThreadState.h"

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/UniqueVoidPtr.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
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

// Replay allocations look exactly like ordinary CPU allocations to kernels: their DataPtr's
// context is the data pointer itself (oneDNN and c10's raw_allocate assert that), so the deleter
// finds the replay an allocation belongs to from its address alone. While a replay runs, its
// liveness is this thread's (no lock beyond its own); allocations still alive when it ends (kept
// by the function, an error the replay reports) move to a process-wide map. An allocation freed
// by another thread while its replay runs is not seen (it stays "alive" for that replay).
thread_local ReplayLiveness* tls_replay = nullptr;

std::mutex& escapedMutex() {
  static auto* m = new std::mutex();  // never destroyed, like the map it guards
  return *m;
}
std::unordered_multimap<uintptr_t, std::shared_ptr<ReplayLiveness>>& escaped() {
  static auto* owners = new std::unordered_multimap<uintptr_t, std::shared_ptr<ReplayLiveness>>();
  return *owners;  // never destroyed: deleters may run during interpreter shutdown
}

bool isReplayAllocation(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (ReplayLiveness* l = tls_replay) {
    std::lock_guard<std::mutex> lock(l->mutex);
    if (l->alive.count(p)) return true;
  }
  std::lock_guard<std::mutex> lock(escapedMutex());
  return escaped().count(p) > 0;
}

void replayFree(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (ReplayLiveness* l = tls_replay) {
    std::lock_guard<std::mutex> lock(l->mutex);
    if (l->alive.erase(p)) return;
  }
  std::shared_ptr<ReplayLiveness> liveness;
  {
    std::lock_guard<std::mutex> lock(escapedMutex());
    auto it = escaped().find(p);
    if (it == escaped().end()) return;
    liveness = std::move(it->second);
    escaped().erase(it);
  }
  std::lock_guard<std::mutex> lock(liveness->mutex);
  liveness->alive.erase(p);
}

// Makes `liveness` this thread's current replay for the guard's lifetime; on the way out, what is
// still alive moves to the process-wide map.
class ReplayScope {
 public:
  explicit ReplayScope(std::shared_ptr<ReplayLiveness> liveness)
      : liveness_(std::move(liveness)), prev_(tls_replay) {
    tls_replay = liveness_.get();
  }
  ~ReplayScope() {
    tls_replay = prev_;
    std::lock_guard<std::mutex> lock(liveness_->mutex);
    if (liveness_->alive.empty()) return;
    std::lock_guard<std::mutex> owners(escapedMutex());
    for (const auto& kv : liveness_->alive) escaped().emplace(kv.first, liveness_);
  }
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;

 private:
  std::shared_ptr<ReplayLiveness> liveness_;
  ReplayLiveness* prev_;
};

// Note [Rejected captures]
// A CUDA stream capture fails when the function synchronises with the host (.item(), bool() of a
// tensor, .tolist(), printing, nonzero and boolean-mask indexing, unique, torch.equal, ...). The
// CPU emulation would record such a function without complaint, because its replay re-runs the
// Python code, so a test passing on CPU would say nothing about CUDA. During a CPU capture a
// thread-local RecordFunction observer therefore watches the ops the function dispatches (nested
// ones included) and Tensor.tolist(), which ATen does not dispatch, is reported by the Python
// layer through noteHostSync(). Any of them makes the capture rejected exactly like a CUDA one:
// capture() throws CaptureRejected and the tree runs the function eagerly from then on (a capture
// that ran to its end hands its real results over, so this call does not run it twice). Ops
// whose CPU kernels read values where their CUDA kernels do not (_assert_async) are exempt,
// with everything they call.
struct HostSyncWatch {
  std::string first;  // "aten::item (.item(), ...)": the first host read met
  int exempt_depth = 0;
  bool collectives = false;  // a c10d op was dispatched (Note [Collective buffers])
};

thread_local HostSyncWatch* tls_watch = nullptr;

const char* hostSyncDescription(const char* op) {
  static const std::unordered_map<std::string, const char*> ops = {
      {"aten::item", ".item(), or int()/float() of a tensor"},
      {"aten::is_nonzero", "bool() of a tensor, e.g. `if tensor:`"},
      {"aten::_local_scalar_dense", "reading a tensor's value on the host (.item(), bool(), ...)"},
      {"aten::nonzero", "nonzero(), torch.where(cond) or indexing with a boolean mask"},
      {"aten::argwhere", "argwhere()"},
      {"aten::masked_select", "masked_select() (also used when a tensor is printed)"},
      {"aten::_unique", "unique()"},
      {"aten::_unique2", "unique()"},
      {"aten::unique_dim", "unique(dim=...)"},
      {"aten::unique_consecutive", "unique_consecutive()"},
      {"aten::unique_dim_consecutive", "unique_consecutive(dim=...)"},
      {"aten::equal", "torch.equal()"},
      {"c10d::barrier",
       "torch.distributed.barrier() (it blocks the host until every rank arrives)"},
      {"c10d::monitored_barrier_", "torch.distributed.monitored_barrier() (it blocks the host)"},
  };
  auto it = ops.find(op);
  return it == ops.end() ? nullptr : it->second;
}

bool exemptFromHostSyncWatch(const char* op) {
  return std::strcmp(op, "aten::_assert_async") == 0 ||
         std::strcmp(op, "aten::_functional_assert_async") == 0;
}

std::unique_ptr<at::ObserverContext> watchOpStart(const at::RecordFunction& fn) {
  HostSyncWatch* w = tls_watch;
  if (w == nullptr) return nullptr;
  const char* op = fn.name();
  w->collectives = w->collectives || CollectiveBuffers::isCollective(op);
  if (exemptFromHostSyncWatch(op)) {
    w->exempt_depth++;
  } else if (w->exempt_depth == 0 && w->first.empty()) {
    if (const char* what = hostSyncDescription(op)) w->first = std::string(op) + " (" + what + ")";
  }
  return nullptr;
}

void watchOpEnd(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  HostSyncWatch* w = tls_watch;
  if (w != nullptr && exemptFromHostSyncWatch(fn.name()) && w->exempt_depth > 0) w->exempt_depth--;
}

// Installs the watch on this thread for the lifetime of the guard.
class HostSyncWatchGuard {
 public:
  explicit HostSyncWatchGuard(HostSyncWatch* watch)
      : prev_(tls_watch),
        handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&watchOpStart, &watchOpEnd)
                                               .needsInputs(false)
                                               .needsOutputs(false)
                                               .scopes({at::RecordScope::FUNCTION}))) {
    tls_watch = watch;
  }
  ~HostSyncWatchGuard() {
    tls_watch = prev_;
    at::removeCallback(handle_);
  }
  HostSyncWatchGuard(const HostSyncWatchGuard&) = delete;
  HostSyncWatchGuard& operator=(const HostSyncWatchGuard&) = delete;

 private:
  HostSyncWatch* prev_;
  at::CallbackHandle handle_;
  at::RecordFunctionGuard enabled_{true};  // observe even where RecordFunction is switched off
};

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

// Frees through raw_deallocate (oneDNN's scratch memory) must find replay allocations too.
void routerRawDelete(void* ptr) {
  if (isReplayAllocation(ptr)) {
    replayFree(ptr);
  } else if (CpuPool::poolOfAllocated(ptr) != nullptr) {
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
  void* ptr = reinterpret_cast<void*>(rec[i].ptr);
  return c10::DataPtr(ptr, ptr, &replayFree, c10::Device(c10::DeviceType::CPU));
}

// Installed once as c10's CPU allocator; see Note [CPU emulation of graphs].
class RouterAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    RouteState* st = tls_route;
    if (C10_LIKELY(st == nullptr) || nbytes == 0) return g_fallback->allocate(nbytes);
    if (st->mode == RouteMode::kReplay) return replayAllocate(st, nbytes);
    TORCH_CHECK_WITH(OutOfMemoryError, !consumeInjectedFailure(FailurePoint::kPoolAlloc),
                     "graphtrees: injected out-of-memory error allocating ", nbytes,
                     " bytes in the CPU pool");
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
  CpuGraph(std::vector<Allocation> allocations, std::vector<OutputLayout> outputs, std::string name,
           bool uses_collectives)
      : uses_collectives_(uses_collectives),
        allocations_(std::move(allocations)),
        footprint_(footprintOf(allocations_)),
        outputs_(std::move(outputs)),
        name_(std::move(name)) {
    for (const auto& o : outputs_) output_storages_.insert(reinterpret_cast<uintptr_t>(o.storage));
  }

  void replay(const RunFn& run, const std::vector<at::Tensor>& call_inputs,
              const std::vector<int64_t>& copied,
              const std::vector<at::Tensor>& placeholders) override {
    std::vector<at::Tensor> inputs = call_inputs;  // the recording's addresses for copied inputs
    for (size_t k = 0; k < copied.size(); ++k) inputs[copied[k]] = placeholders[k];
    RouteState st;
    st.mode = RouteMode::kReplay;
    st.recorded = &allocations_;
    st.function_name = &name_;
    st.liveness = std::make_shared<ReplayLiveness>();
    ReplayScope replay_scope(st.liveness);
    std::vector<at::Tensor> outputs;
    CollectiveBuffers collective_buffers(uses_collectives_);
    {
      RouteGuard guard(&st);
      RecordingGraphScope recording;   // the recorded program runs again, as it was captured
      AutocastCacheOff no_cast_cache;  // as it ran when captured (Note [Autocast and recordings])
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
    size_t kept = 0;  // Note [Collective buffers]: a collective's are not kept
    {
      std::lock_guard<std::mutex> lock(st.liveness->mutex);
      for (const auto& kv : st.liveness->alive) {
        kept += output_storages_.count(kv.first) || collective_buffers.contains(kv.first) ? 0 : 1;
      }
    }
    TORCH_CHECK(kept == 0, "graphtrees: the replay of '", name_, "' kept ", kept,
                " tensor(s) it allocated without returning them (for example a cache stored on a "
                "module or in a global). Their memory belongs to the graph and is overwritten by "
                "the next run. Create such state before wrapping the function, or return it.");
  }

  const std::vector<Interval>& footprint() const override { return footprint_; }

 private:
  bool uses_collectives_;  // Note [Collective buffers]
  std::vector<Allocation> allocations_;
  std::vector<Interval> footprint_;
  std::vector<OutputLayout> outputs_;
  std::unordered_set<uintptr_t> output_storages_;
  std::string name_;
};

}  // namespace

CpuBackend::CpuBackend() : pool_(CpuPool::create()) {
  installRouter();
}

CpuBackend::~CpuBackend() {
  try {
    releasePool();
  } catch (const std::exception& e) {
    logMessage(LogLevel::kWarning, std::string("releasing the CPU pool failed: ") + e.what());
  }
}

void CpuBackend::releasePool() {
  if (pool_ == nullptr) return;
  CpuPool* pool = pool_;
  pool_ = nullptr;
  // A pool that a failed restore left inconsistent has blocks nobody will free; the tree has
  // invalidated every output by now, so nothing can reach them.
  if (poisoned_) {
    pool->releaseAll();
  } else {
    pool->release();
  }
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kReleasePool),
              "graphtrees: injected failure after releasing the CPU pool (as an asynchronous "
              "device error surfacing at the final synchronisation)");
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
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kEndAllocate),
              "graphtrees: injected failure after ending the routing into the CPU pool (as an "
              "asynchronous device error surfacing at the synchronisation)");
}

std::unique_ptr<Graph> CpuBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                           std::vector<at::Tensor>* outputs,
                                           const std::string& function_name,
                                           const std::vector<at::Generator>& /*generators*/) {
  TORCH_INTERNAL_ASSERT(pool_ != nullptr);
  checkRouterInstalled();
  std::vector<Allocation> allocations;
  RouteState st;
  st.mode = RouteMode::kCapture;
  st.pool = pool_;
  st.recording = &allocations;
  st.function_name = &function_name;
  HostSyncWatch watch;
  bool ran = false;
  try {
    RouteGuard guard(&st);
    HostSyncWatchGuard watching(&watch);
    *outputs = run(inputs);
    ran = true;
  } catch (...) {
    // On CUDA the host read itself would have failed the capture, before this error.
    if (watch.first.empty()) throw;
  }
  if (!watch.first.empty()) {
    if (!ran) outputs->clear();
    throw CaptureRejected(
        "it reads tensor values on the host while it is recorded: " + watch.first +
            ". A CUDA graph capture cannot synchronise with the host. Keep such code "
            "out of the graphed function, or express it with tensor ops (e.g. "
            "torch.where instead of `if tensor:`)",
        ran);
  }
  if (consumeInjectedFailure(FailurePoint::kCaptureEnd)) {
    // The function ran to its end: its results are this call's (its side effects happened once).
    throw CaptureRejected("injected failure at the end of the capture", /*ran=*/true);
  }
  std::vector<OutputLayout> layouts;
  layouts.reserve(outputs->size());
  for (const auto& t : *outputs) layouts.push_back(layoutOf(t));
  return std::make_unique<CpuGraph>(std::move(allocations), std::move(layouts), function_name,
                                    watch.collectives);
}

void CpuBackend::copyInputs(const std::vector<at::Tensor>& dst,
                            const std::vector<at::Tensor>& src) {
  TORCH_INTERNAL_ASSERT(dst.size() == src.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

std::shared_ptr<Checkpoint> CpuBackend::checkpoint() {
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kCheckpoint),
              "graphtrees: injected failure while checkpointing the CPU pool");
  return pool_->checkpoint();
}

RestoreResult CpuBackend::restore(const Checkpoint& checkpoint) {
  if (consumeInjectedFailure(FailurePoint::kBackendRestore)) {
    throw RestoreError("injected failure before the restore changed the CPU pool",
                       /*pool_unchanged=*/true);
  }
  RestoreResult r;
  try {
    r = pool_->restore(checkpoint);
  } catch (const std::exception& e) {
    throw RestoreError(e.what(), /*pool_unchanged=*/true);  // CpuPool::restore is all or nothing
  }
  if (consumeInjectedFailure(FailurePoint::kPartialRestore)) {
    // As c10's setCheckpointPoolState can fail: the pool has changed and the blocks it
    // re-created are never handed out.
    for (auto& dp : r.dataptrs_allocd) {
      dp.compare_exchange_deleter(&CpuPool::deleteBlock, &c10::detail::deleteNothing);
    }
    poisoned_ = true;
    throw RestoreError("injected failure after the restore changed the CPU pool",
                       /*pool_unchanged=*/false);
  }
  return r;
}

void noteHostSync(const char* what) {
  HostSyncWatch* w = tls_watch;
  if (w != nullptr && w->exempt_depth == 0 && w->first.empty()) w->first = what;
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

void CpuBackend::setReservedLimit(int64_t bytes) {
  if (pool_ != nullptr) pool_->setLimit(bytes);
}

int64_t CpuBackend::refusedBytes() const {
  return pool_ != nullptr ? pool_->refusedBytes() : 0;
}

int64_t CpuBackend::releaseFreeSegments(const std::vector<const Checkpoint*>& keep) {
  return pool_ != nullptr ? pool_->releaseFreeSegments(keep) : 0;
}

}  // namespace graphtrees
