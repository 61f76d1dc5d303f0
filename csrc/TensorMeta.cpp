#include "TensorMeta.h"

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>

#include <algorithm>
#include <utility>

namespace graphtrees {

TensorMeta metaOf(const at::Tensor& t) {
  TensorMeta m;
  m.sizes = t.sizes().vec();
  m.strides = t.strides().vec();
  m.storage_offset = t.storage_offset();
  m.dtype = t.scalar_type();
  m.device = t.device();
  m.conj = t.is_conj();
  m.neg = t.is_neg();
  return m;
}

at::Tensor makeTensor(c10::Storage storage, const TensorMeta& meta) {
  c10::DispatchKeySet keys(c10::computeDispatchKey(meta.dtype, c10::kStrided, meta.device));
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys,
                                                    c10::scalarTypeToTypeMeta(meta.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(meta.sizes, meta.strides, meta.storage_offset);
  if (meta.conj) t.unsafeGetTensorImpl()->_set_conj(true);
  if (meta.neg) t.unsafeGetTensorImpl()->_set_neg(true);
  return t;
}

c10::Storage nonOwningStorage(uintptr_t ptr, size_t nbytes, c10::Device device) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                      c10::DataPtr(reinterpret_cast<void*>(ptr), device),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

bool elementsDoNotOverlap(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that matter
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the furthest element offset the smaller-stride dims reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += stride * (size - 1);
  }
  return true;
}

}  // namespace graphtrees
