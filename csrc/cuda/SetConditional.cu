// The kernel that sets a conditional node's handle from a predicate on the device (Note
// [Conditional nodes on CUDA] in ConditionalNodes.cpp), for a torch whose at::cuda::CUDAGraph has
// no conditional-node capture of its own.

#include <cuda_runtime.h>

namespace graphtrees {

namespace {

__global__ void set_conditional_handle_kernel(cudaGraphConditionalHandle handle, const bool* pred) {
  cudaGraphSetConditional(handle, *pred ? 1u : 0u);
}

}  // namespace

cudaError_t launchSetConditional(cudaGraphConditionalHandle handle, const bool* pred,
                                 cudaStream_t stream) {
  set_conditional_handle_kernel<<<1, 1, 0, stream>>>(handle, pred);
  return cudaGetLastError();
}

}  // namespace graphtrees
