#pragma once

// The CPU emulation's allocator: installed once as c10's CPU allocator, it forwards every
// allocation to the allocator it replaced except on a thread the CPU backend is routing (Note
// [CPU emulation of graphs] in cpu/CpuBackend.h). Routing states nest per thread (RouteGuard).

#include "Backend.h"

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace graphtrees {

class CpuPool;

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

// The routing of one thread.
struct RouteState {
  RouteMode mode = RouteMode::kPool;
  CpuPool* pool = nullptr;
  std::vector<Allocation>* recording = nullptr;       // capture
  const std::vector<Allocation>* recorded = nullptr;  // replay
  size_t cursor = 0;                                  // replay: the next recorded allocation
  std::string divergence;                             // replay: first mismatch, if any
  std::shared_ptr<ReplayLiveness> liveness;           // replay
  const std::string* function_name = nullptr;
  bool wait_for_frees = false;  // replay: another thread may still free (Note [Collective buffers])
  RouteState* prev = nullptr;
};

// The routing of a replay of `recorded` (Note [CPU emulation of graphs]), with a fresh liveness.
RouteState replayRoute(const std::vector<Allocation>* recorded, const std::string* function_name);

// Makes `state` the calling thread's routing until destroyed (or until popRoute()).
void pushRoute(RouteState* state);
// Undoes the last pushRoute() and returns its state.
RouteState* popRoute();
RouteState* currentRoute();

// Note [Tensors made on other threads]
// A function can have its work done on another thread (a ThreadPoolExecutor, an interop thread):
// that thread's ops are not the recording's (the recorder observes its own thread), nor are its
// allocations routed into the pool, so a tensor it made looks like one from before the call,
// which a program holds and reuses as it is -- the recording's value, on every replay. While a
// CPU capture is under way, the allocations the router hands to threads it does not route are
// noted (up to kMaxNoted, then every unrouted allocation counts until the captures end), and the
// recorder keeps the Python replay for a function whose ops take such a tensor.
class OtherThreadAllocations {
 public:
  OtherThreadAllocations();  // a capture begins
  ~OtherThreadAllocations();
  OtherThreadAllocations(const OtherThreadAllocations&) = delete;
  OtherThreadAllocations& operator=(const OtherThreadAllocations&) = delete;
  // Whether `ptr` (an allocation's start) was handed to an unrouted thread during a capture.
  static bool contains(const void* ptr);
  static constexpr size_t kMaxNoted = size_t{1} << 16;
};

class RouteGuard {
 public:
  explicit RouteGuard(RouteState* state) { pushRoute(state); }
  ~RouteGuard() { popRoute(); }
  RouteGuard(const RouteGuard&) = delete;
  RouteGuard& operator=(const RouteGuard&) = delete;
};

// No routing on this thread while it lives: allocations go to the allocator graphtrees replaced
// (copies taken for graphtrees' own checks, outside every pool).
class RouteSuspended {
 public:
  RouteSuspended();
  ~RouteSuspended();
  RouteSuspended(const RouteSuspended&) = delete;
  RouteSuspended& operator=(const RouteSuspended&) = delete;

 private:
  RouteState* saved_;
};

// Makes `liveness` this thread's current replay for the guard's lifetime; on the way out, what is
// still alive moves to a process-wide map, where the deleters of late frees find it.
class ReplayScope {
 public:
  explicit ReplayScope(std::shared_ptr<ReplayLiveness> liveness);
  ~ReplayScope();
  ReplayScope(const ReplayScope&) = delete;
  ReplayScope& operator=(const ReplayScope&) = delete;

 private:
  std::shared_ptr<ReplayLiveness> liveness_;
  ReplayLiveness* prev_;
};

// Installs the routing allocator (once per process).
void installRouter();
// TORCH_CHECKs that nobody replaced it since.
void checkRouterInstalled();

// The byte ranges of `allocs`, sorted and merged.
std::vector<Interval> footprintOf(const std::vector<Allocation>& allocs);

}  // namespace graphtrees
