#pragma once

// NVTX ranges of graphed calls, for Nsight Systems (Note [Call ranges] in CallRange.h).
//
// Note [NVTX ranges]
// NVTX 3 is header-only (<nvtx3/nvToolsExt.h>, in the CUDA 12 and 13 toolkits): when the build
// finds the header (__has_include), CudaBackend marks each call's range with nvtxRangePushA and
// nvtxRangePop; without it no range is marked, and nothing else changes. NVTX hands ranges to a
// tool only when one is injected, which a profiler such as Nsight Systems does by naming its
// library in NVTX_INJECTION64_PATH for the process it profiles: attached() reads that variable
// once, and while it is unset no text is built and no NVTX call is made. attached() is static (no
// backend, no device state), so that an eager run decided before the tree is asked -- a fallback
// of GraphedCallable, a call on another thread while the tree runs user code -- marks its range
// too (BackendFactory.h's rangeMarks(device)).

#include "Backend.h"

#include <string>

namespace graphtrees {

class NvtxRanges {
 public:
  // Whether NVTX was compiled in and a tool is injected (read once per process).
  static bool attached();
  static void push(const std::string& text);
  static void pop();
  // The three above, as CudaBackend::rangeMarks() and BackendFactory.h's rangeMarks() give them.
  static const RangeMarks& marks();
};

}  // namespace graphtrees
