#pragma once

// A graphed call as one range in the profiler's trace (and in Nsight Systems through the backend).
//
// Note [Call ranges]
// Every call the tree runs opens one range named for what happened -- graphtrees::replay,
// graphtrees::record, graphtrees::warmup, graphtrees::eager -- and a restore of the pool to a
// checkpoint opens graphtrees::restore inside the warmup or recording it makes room for. A range
// is an at::RecordFunction of RecordScope::USER_SCOPE (what torch.profiler.record_function opens)
// whose keyword inputs carry the function's name ("function"), the node's id ("node": the node
// replayed, the node a recording becomes, the node restored to; -1 for none) and, for an eager
// run, its reason ("reason"), given when the profiler asks for inputs (torch.profiler with
// record_shapes=True, which reports them as the event's kwinputs). The
// replay range encloses the input copies, the replay and the write-back; the record range, a
// recording that the device refused and the eager run that replaced it (graphtrees::eager,
// nested, with the reason).
// Zero cost when nothing watches: a range is begun only when the thread's cached RecordFunction
// callbacks of USER_SCOPE are not empty (at::getStepCallbacksUnlessEmpty, what
// RECORD_FUNCTION_WITH_SCOPE asks first: a thread-local read; at::hasCallbacks() would copy the
// global callbacks under a mutex), or the backend says a tracing tool is attached
// (Backend::marksRanges(); CUDA: NVTX with an injected tool, cuda/NvtxRanges.h); the text of a
// backend range is built only then. The CPU emulation's own observers (CaptureObserver and its
// watchers: ProgramRecorder, HostSyncWatch, InputMutationCheck, PlaceholderViewCheck) see
// RecordScope::FUNCTION only: a range is never recorded as an op nor counted as one. A range begun
// before an observer was registered ends with the callbacks it began with (RecordFunction keeps
// them), so the observer never sees it either.

#include <ATen/record_function.h>

#include <cstdint>
#include <optional>
#include <string>

namespace graphtrees {

class Backend;

class CallRange {
 public:
  enum class Kind { kReplay, kRecord, kWarmup, kRestore, kEager };

  // Begins the range when something watches. `backend`: the tree's, for its own ranges (nullptr:
  // the profiler's only). `function`, `reason`: read now, not kept.
  CallRange(Kind kind, Backend* backend, const std::string& function, int64_t node,
            const std::string& reason = std::string());
  ~CallRange();
  CallRange(const CallRange&) = delete;
  CallRange& operator=(const CallRange&) = delete;

  // "graphtrees::replay", ...
  static const char* name(Kind kind);
  // How many ranges were begun since the process started (for the tests: none while nothing
  // watches).
  static int64_t begun();

 private:
  std::optional<at::RecordFunction> record_;
  Backend* marked_ = nullptr;  // the backend whose range is open
};

}  // namespace graphtrees
