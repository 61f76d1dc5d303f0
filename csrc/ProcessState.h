#pragma once

// Process-wide clocks and switches, below the tree manager and the backends: the step counter, the
// thread identities, the call depth, the debug-checks switch, the hooks the Python layer installs
// (garbage collection, blocking waits, the capture scope) and failure injection for the tests
// (every failure path of a recording, a checkpoint, a restore and a teardown can be driven on the
// CPU backend).
//
// Note [Steps, generations and threads]
// Two counters order what happens:
//   step        per thread; mark_step_begin() (or torch.compiler.cudagraph_mark_step_begin())
//               increments the calling thread's. Each tree belongs to one thread and remembers
//               the value of its thread's counter it last saw: a different value at its next call
//               ends its current path (Note [Ending a path]).
//   generation  per tree: the index of its current path. Ending a path increments it. Every
//               tracked output carries the generation it was produced in; "an output of this
//               generation" is what makes an input managed and what keeps a path going.
// Each thread has its own tree per device (TreeRegistry), with its own pool and its own steps, so
// a call on one thread never ends another thread's step or overwrites its outputs. A backward
// that autograd runs on a thread of its own runs in the tree whose outputs it reads: its forward's.

#include <c10/core/Storage.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

// The calling thread's step counter; markStepBegin() increments it.
using StepCounter = std::shared_ptr<std::atomic<int64_t>>;
const StepCounter& threadStepCounter();
void markStepBegin();
// A small number naming the calling thread: 1 for the first thread that asks, and so on.
int64_t threadId();
// Called with the threadId() of a thread that exits (if it ever asked for one). Runs on that
// thread, after its Python state is gone: it must not touch Python.
void setThreadExitHook(std::function<void(int64_t)> hook);

// True while the calling thread is inside a tree call (a nested wrapped call runs eagerly).
bool inTreeCall();
class CallDepthGuard {
 public:
  CallDepthGuard();
  ~CallDepthGuard();
  CallDepthGuard(const CallDepthGuard&) = delete;
  CallDepthGuard& operator=(const CallDepthGuard&) = delete;
};

// True while the calling thread runs a graph's program as a recording: during any capture, and
// during a CPU emulation replay (which re-runs the recorded Python). The Python layer answers
// torch.cuda.is_current_stream_capturing() with it, so that code which avoids host syncs while
// captured (transformers' masks, for one) takes the same path on the CPU backend as on CUDA.
bool recordingGraph();
class RecordingGraphScope {
 public:
  RecordingGraphScope();
  ~RecordingGraphScope();
  RecordingGraphScope(const RecordingGraphScope&) = delete;
  RecordingGraphScope& operator=(const RecordingGraphScope&) = delete;
};

// When on, every call ends by checking the pool invariant (Note [Output ownership]); the tests
// turn it on.
bool debugChecksEnabled();
void setDebugChecks(bool on);

// Collects garbage cycles (Python's gc) when untracked pool allocations block a restore. Called
// without any tree lock held; does nothing until the Python layer installs it.
void setCollectGarbageHook(std::function<void()> hook);
void collectGarbage();

// Finds the storages of live tensors whose data starts at one of `blocks` (Python's gc knows every
// tensor object); used to move state a warmup created and kept out of the pool. Returns nothing
// until the Python layer installs it.
using FindStoragesHook = std::function<std::vector<c10::Storage>(const std::vector<void*>&)>;
void setFindStoragesHook(FindStoragesHook hook);
std::vector<c10::Storage> findStorages(const std::vector<void*>& blocks);

// Runs `wait` (a blocking lock acquisition) through the installed hook, which releases the GIL
// around it; runs it directly if none is installed.
using BlockingWaitHook = std::function<void(const std::function<void()>&)>;
void setBlockingWaitHook(BlockingWaitHook hook);
void runBlocking(const std::function<void()>& wait);

// Whether `error` is an interruption that must propagate as it is (Python's KeyboardInterrupt or
// SystemExit), never be taken for a rejected capture. False until the bindings install the check.
using InterruptCheck = std::function<bool(const std::exception&)>;
void setInterruptCheck(InterruptCheck check);
bool isInterrupt(const std::exception& error);

// Where a failure can be injected. Each point fails the next `n` times it is reached.
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

// Parses "restore", "backend_restore", "partial_restore", "checkpoint", "capture_end",
// "end_allocate", "release_pool" or "pool_alloc"; throws ValueError for anything else.
FailurePoint failurePointFromName(const std::string& name);
// After `skip` arrivals at `point` that pass, the next `n` fail (n = 0 disarms it).
void injectFailure(FailurePoint point, int n, int skip = 0);
// True (and counts one down) if a failure is armed at `point` and its skips are used up.
bool consumeInjectedFailure(FailurePoint point);
// Failures still armed at `point` (a test learns whether its injection was reached).
int pendingInjectedFailures(FailurePoint point);

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
  RecordingGraphScope recording_;
  std::function<void()> exit_;
};

}  // namespace graphtrees
