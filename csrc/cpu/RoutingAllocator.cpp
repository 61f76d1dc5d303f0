#include "cpu/RoutingAllocator.h"

#include "Backend.h"
#include "FailureInjection.h"
#include "cpu/CpuPool.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

namespace {

// Replay allocations look exactly like ordinary CPU allocations to kernels: their DataPtr's
// context is the data pointer itself (oneDNN and c10's raw_allocate assert that), so the deleter
// finds the replay an allocation belongs to from its address alone. While a replay runs, its
// liveness is this thread's (no lock beyond its own); allocations still alive when it ends (kept
// by the function, an error the replay reports) move to a process-wide map. An allocation freed
// by another thread while its replay runs (gloo's worker dropping a collective's input) is found
// through the replays under way, which a process-wide list holds.
thread_local ReplayLiveness* tls_replay = nullptr;
thread_local RouteState* tls_route = nullptr;

std::mutex& escapedMutex() {
  static auto* m = new std::mutex();  // never destroyed, like the map it guards
  return *m;
}
std::unordered_multimap<uintptr_t, std::shared_ptr<ReplayLiveness>>& escaped() {
  static auto* owners = new std::unordered_multimap<uintptr_t, std::shared_ptr<ReplayLiveness>>();
  return *owners;  // never destroyed: deleters may run during interpreter shutdown
}

std::mutex& activeMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<ReplayLiveness*>& activeReplays() {
  static auto* v = new std::vector<ReplayLiveness*>();
  return *v;  // never destroyed, as escaped()
}

bool isReplayAllocation(void* ptr) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (ReplayLiveness* l = tls_replay) {
    std::lock_guard<std::mutex> lock(l->mutex);
    if (l->alive.count(p)) return true;
  }
  {
    std::lock_guard<std::mutex> active(activeMutex());
    for (ReplayLiveness* l : activeReplays()) {
      std::lock_guard<std::mutex> lock(l->mutex);
      if (l->alive.count(p)) return true;
    }
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
  {
    // Another thread's replay, still under way.
    std::lock_guard<std::mutex> active(activeMutex());
    for (ReplayLiveness* l : activeReplays()) {
      std::lock_guard<std::mutex> lock(l->mutex);
      if (l->alive.erase(p)) return;
    }
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
      std::unique_lock<std::mutex> lock(st->liveness->mutex);
      auto& alive = st->liveness->alive;
      // Also alive: what an earlier replay left at this address (a collective's temporary
      // that the worker thread still holds), which this replay's liveness does not list.
      const auto escaped_here = [&] {
        std::lock_guard<std::mutex> owners(escapedMutex());
        return escaped().count(begin) > 0;
      };
      const auto overlapping = [&] {
        auto it = alive.upper_bound(begin);
        if (it != alive.begin() && std::prev(it)->second.first > begin) --it;
        return (it != alive.end() && it->first < end) ? it : alive.end();
      };
      auto it = overlapping();
      bool left_by_earlier = it == alive.end() && st->wait_for_frees && escaped_here();
      // Note [Collective buffers]: a collective's worker thread may drop its reference to a
      // temporary a moment after the call returned; a replay of a function with collectives
      // waits for that (as long as a warmup waits for such blocks) before calling it a
      // data-dependent lifetime.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      while ((it != alive.end() || left_by_earlier) && st->wait_for_frees &&
             std::chrono::steady_clock::now() < deadline) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        lock.lock();
        it = overlapping();
        left_by_earlier = it == alive.end() && escaped_here();
      }
      if (left_by_earlier) {
        st->divergence = "allocation #" + std::to_string(i) +
                         " would reuse memory that an earlier replay's collective still holds";
      } else if (it != alive.end()) {
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

std::atomic<int> g_captures{0};  // CPU captures under way, on all threads
std::mutex& otherThreadMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_set<uintptr_t>& otherThreadAllocations() {
  static auto* s = new std::unordered_set<uintptr_t>();
  return *s;
}
bool g_other_thread_overflow = false;  // under otherThreadMutex()

void noteOtherThreadAllocation(const void* ptr) {
  std::lock_guard<std::mutex> lock(otherThreadMutex());
  if (g_captures.load(std::memory_order_relaxed) == 0) return;
  auto& noted = otherThreadAllocations();
  if (noted.size() >= OtherThreadAllocations::kMaxNoted) {
    g_other_thread_overflow = true;
  } else {
    noted.insert(reinterpret_cast<uintptr_t>(ptr));
  }
}

// Installed once as c10's CPU allocator; see Note [CPU emulation of graphs].
class RouterAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    RouteState* st = tls_route;
    if (C10_LIKELY(st == nullptr) || nbytes == 0) {
      c10::DataPtr dp = g_fallback->allocate(nbytes);
      // Note [Tensors made on other threads] in RoutingAllocator.h.
      if (C10_UNLIKELY(g_captures.load(std::memory_order_relaxed) > 0) && dp.get() != nullptr) {
        noteOtherThreadAllocation(dp.get());
      }
      return dp;
    }
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

RouterAllocator* router() {
  static RouterAllocator* r = [] {
    g_fallback = c10::GetCPUAllocator();
    auto* a = new RouterAllocator();
    c10::SetCPUAllocator(a, /*priority=*/1);
    return a;
  }();
  return r;
}

}  // namespace

RouteState replayRoute(const std::vector<Allocation>* recorded, const std::string* function_name) {
  RouteState st;
  st.mode = RouteMode::kReplay;
  st.recorded = recorded;
  st.function_name = function_name;
  st.liveness = std::make_shared<ReplayLiveness>();
  return st;
}

void pushRoute(RouteState* state) {
  state->prev = tls_route;
  tls_route = state;
}

RouteState* popRoute() {
  RouteState* st = tls_route;
  TORCH_INTERNAL_ASSERT(st != nullptr, "graphtrees: no CPU routing to end");
  tls_route = st->prev;
  return st;
}

RouteState* currentRoute() {
  return tls_route;
}

RouteSuspended::RouteSuspended() : saved_(tls_route) {
  tls_route = nullptr;
}

RouteSuspended::~RouteSuspended() {
  tls_route = saved_;
}

ReplayScope::ReplayScope(std::shared_ptr<ReplayLiveness> liveness)
    : liveness_(std::move(liveness)), prev_(tls_replay) {
  tls_replay = liveness_.get();
  std::lock_guard<std::mutex> active(activeMutex());
  activeReplays().push_back(liveness_.get());
}

ReplayScope::~ReplayScope() {
  tls_replay = prev_;
  // Under the list's lock until its survivors are in escaped(): a free by another thread finds
  // them in one place or the other.
  std::lock_guard<std::mutex> active(activeMutex());
  auto& v = activeReplays();
  v.erase(std::find(v.begin(), v.end(), liveness_.get()));
  std::lock_guard<std::mutex> lock(liveness_->mutex);
  if (liveness_->alive.empty()) return;
  std::lock_guard<std::mutex> owners(escapedMutex());
  for (const auto& kv : liveness_->alive) escaped().emplace(kv.first, liveness_);
}

OtherThreadAllocations::OtherThreadAllocations() {
  std::lock_guard<std::mutex> lock(otherThreadMutex());
  g_captures.fetch_add(1);
}

OtherThreadAllocations::~OtherThreadAllocations() {
  std::lock_guard<std::mutex> lock(otherThreadMutex());
  if (g_captures.fetch_sub(1) == 1) {
    otherThreadAllocations().clear();
    g_other_thread_overflow = false;
  }
}

bool OtherThreadAllocations::contains(const void* ptr) {
  std::lock_guard<std::mutex> lock(otherThreadMutex());
  return g_other_thread_overflow ||
         otherThreadAllocations().count(reinterpret_cast<uintptr_t>(ptr)) > 0;
}

void installRouter() {
  router();
}

void checkRouterInstalled() {
  TORCH_CHECK(c10::GetCPUAllocator() == router(),
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

}  // namespace graphtrees
