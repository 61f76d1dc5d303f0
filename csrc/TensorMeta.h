#pragma once

// A tensor's geometry kept without the tensor (sizes, strides, offset, dtype, device and the
// conjugate and negative bits), and the few operations on it that several rooms need: rebuilding
// a tensor over a given storage, a storage that owns nothing, and whether a tensor's elements
// overlap. Nothing here knows the tree.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace graphtrees {

struct TensorMeta {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  // A conjugate or negative view ((z * 2).conj(), .mH, torch._neg_view): the bytes are the
  // unconjugated values and the bit says how to read them, so a rebuilt tensor needs it too.
  bool conj = false;
  bool neg = false;
};

TensorMeta metaOf(const at::Tensor& t);

// Builds a tensor over `storage` with the given metadata (no allocation, no dispatch).
at::Tensor makeTensor(c10::Storage storage, const TensorMeta& meta);

// A storage of `nbytes` at `ptr` that owns nothing.
c10::Storage nonOwningStorage(uintptr_t ptr, size_t nbytes, c10::Device device);

// Whether no two elements of `t` share memory (dense, or strided with gaps such as a slice); an
// expanded tensor (stride 0) overlaps.
bool elementsDoNotOverlap(const at::Tensor& t);

}  // namespace graphtrees
