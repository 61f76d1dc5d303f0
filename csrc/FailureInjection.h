#pragma once

// What the tests drive: failure injection at the points where a device, the allocator or a
// teardown can fail (every failure path of a recording, a checkpoint, a restore and a teardown can
// be driven on the CPU backend), and the switch of the per-call pool-invariant check.
// graphtrees._C.failure_points lists the points, and graphtrees._C._inject_failure arms them.

#include <string>
#include <vector>

namespace graphtrees {

// The points, in the order of kFailurePoints' rows.
enum class FailurePoint : int {
  kRestore = 0,     // the tree's restore, before it touches anything (PyTorch issue #140419)
  kBackendRestore,  // the backend's restore, leaving the pool unchanged
  kPartialRestore,  // the backend's restore, after it changed the pool (as c10's can)
  kCheckpoint,      // the backend's checkpoint after a recording
  kCaptureEnd,      // the end of a capture: the device rejects the recording
  kEndAllocate,     // the end of pool routing (an asynchronous error surfacing at the sync)
  kReleasePool,     // releasing the pool at reset (an asynchronous error at the final sync)
  kPoolAlloc,       // an allocation in the pool (warmup, placeholders, capture): out of memory
  kCount
};

struct FailurePointInfo {
  FailurePoint point;
  const char* name;  // as graphtrees._C._inject_failure takes it
  const char* what;  // what failing there simulates
};
// The one table of the points (graphtrees._C.failure_points, CONTRIBUTING.md).
const std::vector<FailurePointInfo>& failurePoints();

// Parses a point's name; throws ValueError (listing the names) for anything else.
FailurePoint failurePointFromName(const std::string& name);
// After `skip` arrivals at `point` that pass, the next `n` fail (n = 0 disarms it).
void injectFailure(FailurePoint point, int n, int skip = 0);
// True (and counts one down) if a failure is armed at `point` and its skips are used up.
bool consumeInjectedFailure(FailurePoint point);
// Failures still armed at `point` (a test learns whether its injection was reached).
int pendingInjectedFailures(FailurePoint point);

// When on, every call ends by checking the pool invariant (Note [Output ownership]); the tests
// turn it on.
bool debugChecksEnabled();
void setDebugChecks(bool on);

}  // namespace graphtrees
