#include "cuda/NvtxRanges.h"

#include <cstdlib>

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define GRAPHTREES_HAS_NVTX 1
#else
#define GRAPHTREES_HAS_NVTX 0
#endif

namespace graphtrees {

bool NvtxRanges::attached() {
#if GRAPHTREES_HAS_NVTX
  static const bool injected = std::getenv("NVTX_INJECTION64_PATH") != nullptr;
  return injected;
#else
  return false;
#endif
}

void NvtxRanges::push(const std::string& text) {
#if GRAPHTREES_HAS_NVTX
  nvtxRangePushA(text.c_str());
#else
  (void)text;
#endif
}

void NvtxRanges::pop() {
#if GRAPHTREES_HAS_NVTX
  nvtxRangePop();
#endif
}

const RangeMarks& NvtxRanges::marks() {
  static const RangeMarks kMarks{&NvtxRanges::attached, &NvtxRanges::push, &NvtxRanges::pop};
  return kMarks;
}

}  // namespace graphtrees
