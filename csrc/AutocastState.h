#pragma once

// The few autocast calls graphtrees makes, declared here because <ATen/autocast_mode.h> pulls in
// every ATen operator (a large compile-time cost). The functions are exported by libtorch_cpu with
// the same signatures in torch 2.11 and 2.14.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Export.h>

namespace at::autocast {
TORCH_API bool is_autocast_enabled(c10::DeviceType device_type);
TORCH_API c10::ScalarType get_autocast_dtype(c10::DeviceType device_type);
TORCH_API bool is_autocast_cache_enabled();
TORCH_API void set_autocast_cache_enabled(bool enabled);
}  // namespace at::autocast

namespace graphtrees {

// Note [Autocast and recordings]
// Under autocast with its cache enabled, a cast of a leaf tensor that requires grad (a parameter)
// is made once per autocast region and cached. A warmup would leave that cache's copies in the
// pool, untracked, and a capture would reuse them instead of recording the casts: the graph would
// read memory that is freed and reused when the region ends, and never see parameter updates.
// Warmups, captures and CPU-emulation replays (the only replays that run Python) therefore run
// with the cache disabled (the casts become part of the recording), and the autocast state is
// part of the call signature (GraphedCallable).
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) {
    if (prev_) at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() {
    if (prev_) at::autocast::set_autocast_cache_enabled(true);
  }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool prev_;
};

}  // namespace graphtrees
