#include "Backend.h"

#include "Logging.h"

#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>

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

std::vector<at::Tensor> Backend::runRouted(const RunFn& run, const std::vector<at::Tensor>& ins) {
  return run(ins);
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

// Note [Input copies in inference mode]
// Inference mode is not part of a call's key, so a recording made under torch.inference_mode()
// (its placeholders are inference tensors) replays under no_grad too, where a copy into an
// inference tensor raises. A replay's copies therefore run in inference mode, whichever backend
// makes them: they record no autograd history either way, and a placeholder that is a normal
// tensor still has its version bumped.
void copyReplayInputs(Backend& backend, const std::vector<at::Tensor>& dst,
                      const std::vector<at::Tensor>& src) {
  c10::InferenceMode any_mode;
  backend.copyInputs(dst, src);
}

}  // namespace graphtrees
