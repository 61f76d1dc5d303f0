#include "Backend.h"

#include "Logging.h"

#include <algorithm>

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

PoolRoutingGuard::~PoolRoutingGuard() {
  if (!active_) return;
  try {
    backend_.endAllocateToPool();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning,
                   std::string("ending the pool routing after an error failed too: ") + e.what());
  }
}

}  // namespace graphtrees
