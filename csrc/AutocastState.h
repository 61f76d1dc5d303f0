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
