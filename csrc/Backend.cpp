#include "Backend.h"

#include "CpuBackend.h"

#include <algorithm>

#ifdef GRAPHTREES_WITH_CUDA
#include "cuda/CudaBackend.h"
#endif

namespace graphtrees {

void mergeIntervals(std::vector<Interval>* intervals) {
  auto& v = *intervals;
  std::sort(v.begin(), v.end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  size_t n = 0;
  for (const auto& iv : v) {
    if (iv.end <= iv.begin) continue;
    if (n > 0 && iv.begin <= v[n - 1].end) {
      v[n - 1].end = std::max(v[n - 1].end, iv.end);
    } else {
      v[n++] = iv;
    }
  }
  v.resize(n);
}

std::unique_ptr<Backend> makeBackend(c10::Device device, std::string* why_not) {
  switch (device.type()) {
    case c10::DeviceType::CPU:
      return std::make_unique<CpuBackend>();
    case c10::DeviceType::CUDA:
#ifdef GRAPHTREES_WITH_CUDA
      return makeCudaBackend(device, why_not);
#else
      *why_not =
          "graphtrees was built without its CUDA backend (no CUDA build of torch or no nvcc at "
          "build time); reinstall with a CUDA build of torch and the CUDA toolkit";
      return nullptr;
#endif
    default:
      *why_not =
          "graphtrees has no backend for device type '" + c10::DeviceTypeName(device.type()) + "'";
      return nullptr;
  }
}

}  // namespace graphtrees
