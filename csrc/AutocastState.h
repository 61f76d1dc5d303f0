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
TORCH_API void clear_cache();
}  // namespace at::autocast

namespace graphtrees {

// Note [Autocast and recordings]
// Under autocast with its cache enabled, a cast of a leaf tensor that requires grad (a parameter)
// is made once per autocast region and cached. A warmup would leave that cache's copies in the
// pool, untracked, and a capture would reuse them instead of recording the casts: the graph would
// read memory that is freed and reused when the region ends, and never see parameter updates.
// Warmups, captures and CPU-emulation replays (the only replays that run Python) therefore run
// with the cache disabled (the casts become part of the recording), and the autocast state is
// part of the call key (Note [The call signature] in CallSignature.h).
// An autocast region opened *inside* the function turns the cache back on (torch.autocast's
// __enter__ sets it), and under an outer region its __exit__ does not clear it: the casts it
// cached during a warmup would live in the pool, held by C++ where Note [Kept state] cannot
// find them, and a capture would reuse them. So the cache is also cleared when a warmup or
// capture starts and when it ends; an outer region then merely casts its weights once more.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) {
    if (prev_) at::autocast::set_autocast_cache_enabled(false);
    at::autocast::clear_cache();
  }
  ~AutocastCacheOff() {
    at::autocast::clear_cache();
    if (prev_) at::autocast::set_autocast_cache_enabled(true);
  }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool prev_;
};

}  // namespace graphtrees
