#pragma once

// A replay's input copies on CUDA (Note [Input copies of a replay] in InputCopies.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace graphtrees {

// Copies src[i] into dst[i] (the placeholders of a recording) on `device`'s current stream.
void copyIntoPlaceholders(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                          c10::DeviceIndex device);

}  // namespace graphtrees
