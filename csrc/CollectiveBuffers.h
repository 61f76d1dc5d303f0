#pragma once

// Note [Collective buffers]
// A CPU emulation Python replay (Note [CPU graphs] in cpu/CpuGraph.h) re-runs the function; a
// program replay waits for each collective's work and needs none of this. A c10d collective in a
// re-run function (gloo's) hands its tensors
// to the process group's worker thread, which drops its references some time after the collective
// returned -- until the next collective arrives, under load. Whether the replay "kept" a tensor
// must not depend on how fast that thread is: the storages passed to c10d ops during the replay
// are collected here, and the replay's kept-tensor check does not count them (they stay replay
// allocations, freed when the worker drops them; the collective completed before it returned, so
// nothing writes them). A capture that dispatched no c10d op replays without the watch.

#include "CaptureObserver.h"

#include <cstdint>
#include <unordered_set>

namespace graphtrees {

// A watcher of the capture observer (Note [One capture observer] in CaptureObserver.h), shown
// every op, nested ones included; the replay's own observer where none is open.
class CollectiveBuffers : public CaptureWatcher {
 public:
  // Watches the c10d ops this thread dispatches for the object's lifetime, if `active`.
  explicit CollectiveBuffers(bool active);
  ~CollectiveBuffers() override;
  CollectiveBuffers(const CollectiveBuffers&) = delete;
  CollectiveBuffers& operator=(const CollectiveBuffers&) = delete;

  // Whether a storage starting at `ptr` was passed to a collective.
  bool contains(uintptr_t ptr) const { return ptrs_.count(ptr) > 0; }
  // Whether `op` (a RecordFunction name) is a c10d operator.
  static bool isCollective(const char* op);

 private:
  Descend onStart(const ObservedOp& op, int level) override;

  std::unordered_set<uintptr_t> ptrs_;
};

}  // namespace graphtrees
