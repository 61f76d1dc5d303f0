#pragma once

// A graphed call as one range in the profiler's trace (and in Nsight Systems through the backend).
//
// Note [Call ranges]
// Every call the tree runs opens one range named for what happened -- graphtrees::replay,
// graphtrees::record, graphtrees::warmup, graphtrees::eager -- and a restore of the pool to a
// checkpoint opens graphtrees::restore inside the warmup or recording it makes room for. A range
// is an at::RecordFunction of RecordScope::USER_SCOPE (what torch.profiler.record_function opens)
// whose keyword inputs carry the function's name ("function"), the node's id ("node": the node
// replayed, the node restored to, or the id the recording is to get -- a recording that the
// device refuses or that raises makes no node, and its id is never seen in tree_info(); -1 for
// none) and, for an eager run, its reason ("reason"), given when the profiler asks for inputs
// (torch.profiler with record_shapes=True, which reports them as the event's kwinputs). The
// replay range encloses the input copies, the replay and the write-back; the record range, a
// recording that the device refused and the eager run that replaced it (graphtrees::eager,
// nested, with the reason) -- unless the refused recording's own run is kept as the call's result
// (TreeManager::capture()'s keep path: the CPU emulation's capture ran to its end), when nothing
// runs again and no eager range is nested.
// Zero cost when nothing watches: a range is begun only when the thread's cached RecordFunction
// callbacks of USER_SCOPE are not empty (at::getStepCallbacksUnlessEmpty, what
// RECORD_FUNCTION_WITH_SCOPE asks first: a thread-local read; at::hasCallbacks() would copy the
// global callbacks under a mutex), or the device's tracing tool is attached (RangeMarks in
// Backend.h; CUDA: NVTX with an injected tool, cuda/NvtxRanges.h) -- asked of the tree's backend,
// or, for an eager run decided outside the tree (GraphedCallable::fallback(),
// TreeRegistry::runOn()'s call from another thread), of BackendFactory.h's rangeMarks(device); the
// text of such a range is built only then. The CPU emulation's own observers (CaptureObserver and
// its watchers: ProgramRecorder, HostSyncWatch, InputMutationCheck, PlaceholderViewCheck) see
// RecordScope::FUNCTION only: a range is never recorded as an op nor counted as one. A range begun
// before an observer was registered ends with the callbacks it began with (RecordFunction keeps
// them), so the observer never sees it either.

#include <ATen/record_function.h>

#include <cstdint>
#include <optional>
#include <string>

namespace graphtrees {

class Backend;
struct RangeMarks;

class CallRange {
 public:
  enum class Kind { kReplay, kRecord, kWarmup, kRestore, kEager };

  // Begins the range when something watches. `backend`: the tree's, for its device's own ranges
  // too (Backend::rangeMarks()). `function`, `reason`: read now, not kept.
  CallRange(Kind kind, Backend* backend, const std::string& function, int64_t node,
            const std::string& reason = std::string());
  // The same without a backend: `marks`, the device's (BackendFactory.h's rangeMarks(device);
  // nullptr: the profiler's ranges only).
  CallRange(Kind kind, const RangeMarks* marks, const std::string& function, int64_t node,
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
  const RangeMarks* marked_ = nullptr;  // the tool whose range is open
};

}  // namespace graphtrees
