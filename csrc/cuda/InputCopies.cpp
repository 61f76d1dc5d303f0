#include "cuda/InputCopies.h"

#include <ATen/ops/_foreach_copy.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace graphtrees {

// Note [Input copies of a replay]
// A replay copies each copied input into its placeholder on the caller's current stream. Most
// calls have one or two of them, and for those `_foreach_copy_` is the dearest part of a replay's
// host side: the dispatcher, then multi_tensor_apply filling and copying a ~4 KiB kernel argument
// block (two thirds of the instructions of a one-input replay, measured with callgrind on the
// CUDA stand-in). A copy that is a plain byte copy -- strided and not quantized, same dtype and
// strides, dense, no conj or neg bit, on this device, not overlapping its placeholder -- is one
// cudaMemcpyAsync (what copy_ itself issues for such a pair), as long as there are at most
// kMemcpyInputs of them: for more, one batched `_foreach_copy_` launch costs the host less than
// as many memcpys (two is a guess a GPU run must check: bench_gpu.py times 1 and 8 inputs). Every
// other copy (another layout, another device) goes through `_foreach_copy_`, which handles all.
// They run in inference mode (Note [Input copies in inference mode] in Backend.cpp).
namespace {

constexpr size_t kMemcpyInputs = 2;

bool isByteCopy(const at::Tensor& dst, const at::Tensor& src) {
  if (src.layout() != at::kStrided || dst.layout() != at::kStrided || src.is_quantized() ||
      dst.is_quantized() || src.device() != dst.device() ||
      src.scalar_type() != dst.scalar_type() || src.sizes() != dst.sizes() ||
      src.strides() != dst.strides() || src.is_conj() || src.is_neg() || dst.is_conj() ||
      dst.is_neg() || !src.is_non_overlapping_and_dense()) {
    return false;
  }
  // Dense with strides >= 0 (torch has no others): the elements are the nbytes from data_ptr.
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  const auto* d = static_cast<const char*>(dst.const_data_ptr());
  const size_t n = src.nbytes();
  return s == d || s + n <= d || d + n <= s;  // the same bytes (nothing to do), or apart
}

}  // namespace

void copyIntoPlaceholders(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                          c10::DeviceIndex device) {
  TORCH_INTERNAL_ASSERT(dst.size() == src.size());
  if (dst.empty()) return;
  c10::cuda::CUDAGuard guard(device);
  bool by_memcpy = dst.size() <= kMemcpyInputs;
  for (size_t i = 0; by_memcpy && i < dst.size(); ++i) by_memcpy = isByteCopy(dst[i], src[i]);
  if (by_memcpy) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    for (size_t i = 0; i < dst.size(); ++i) {
      const void* from = src[i].const_data_ptr();
      void* to = dst[i].mutable_data_ptr();
      if (from == to || src[i].nbytes() == 0) continue;
      C10_CUDA_CHECK(cudaMemcpyAsync(to, from, src[i].nbytes(), cudaMemcpyDeviceToDevice, stream));
      if (!dst[i].is_inference()) dst[i].unsafeGetTensorImpl()->bump_version();  // as copy_ does
    }
    return;
  }
  at::_foreach_copy_(dst, src);  // one batched launch on the caller's current stream
}

}  // namespace graphtrees
