#pragma once

// Process-wide hooks below the tree manager and the backends: failure injection for the tests
// (every failure path of a recording, a checkpoint, a restore and a teardown can be driven on the
// CPU backend) and the capture scope, which the Python layer fills in (the garbage collector is
// paused during a capture, and host reads that ATen does not dispatch are watched).

#include <functional>
#include <string>

namespace graphtrees {

// Where a failure can be injected. Each point fails the next `n` times it is reached.
enum class FailurePoint : int {
  kRestore = 0,      // the tree's restore, before it touches anything (PyTorch issue #140419)
  kBackendRestore,   // the backend's restore, leaving the pool unchanged
  kPartialRestore,   // the backend's restore, after it changed the pool (as c10's can)
  kCheckpoint,       // the backend's checkpoint after a recording
  kCaptureEnd,       // the end of a capture: the device rejects the recording
  kEndAllocate,      // the end of pool routing (an asynchronous error surfacing at the sync)
  kReleasePool,      // releasing the pool at reset (an asynchronous error at the final sync)
  kCount
};

// Parses "restore", "backend_restore", "partial_restore", "checkpoint", "capture_end",
// "end_allocate" or "release_pool"; throws ValueError for anything else.
FailurePoint failurePointFromName(const std::string& name);
// The next `n` arrivals at `point` fail (n = 0 disarms it).
void injectFailure(FailurePoint point, int n);
// True (and counts one down) if a failure is armed at `point`.
bool consumeInjectedFailure(FailurePoint point);

// Called around every capture (CUDA and CPU) with the GIL held; the returned function ends the
// scope. Installed by the bindings; empty means no scope.
using CaptureScopeHook = std::function<std::function<void()>()>;
void setCaptureScopeHook(CaptureScopeHook hook);

// RAII: enters the capture scope (if a hook is installed) and leaves it on destruction.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  std::function<void()> exit_;
};

}  // namespace graphtrees
