#include "cuda/CudaGraph.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace graphtrees {

// Note [Generators and captures]
// A CUDA graph advances a generator's philox offset on every replay only if the generator was
// registered with the graph before capture_begin(). The device's default generator registers
// itself; a torch.Generator("cuda") passed as an argument is registered here (PyTorch's trees do
// the same), so each replay draws fresh numbers from it, as eager calls would. c10 registers a
// generator's state, which CUDAGeneratorImpl keeps private (torch 2.14 binds no overload that
// takes the generator itself): generatorState() reads it through a pointer to the member, taken
// where C++ allows naming a private member, in an explicit template instantiation.
// A capture that fails leaves the generators it registered in capture mode on torch 2.11 (its
// CUDAGeneratorState::capturing_ is reset only by a successful capture_end()): every later eager
// random op on the device would raise "Offset increment outside graph capture". abandonCapture()
// resets the flag; torch >= 2.12 keeps one capture state per capture id instead, which eager ops
// do not consult. The flag is detected from the declarations, not from the version number.
namespace {

template <typename Tag, typename Tag::type Member>
struct PrivateMember {
  friend typename Tag::type memberOf(Tag) { return Member; }
};
struct GeneratorStateTag {
  using type = c10::intrusive_ptr<at::CUDAGeneratorState> at::CUDAGeneratorImpl::*;
  friend type memberOf(GeneratorStateTag);
};
template struct PrivateMember<GeneratorStateTag, &at::CUDAGeneratorImpl::state_>;

c10::intrusive_ptr<at::CUDAGeneratorState> generatorState(const at::Generator& gen) {
  auto* impl = gen.get<at::CUDAGeneratorImpl>();
  return impl->*memberOf(GeneratorStateTag{});
}

// torch 2.11: a public flag per generator state.
template <typename State>
auto leaveCaptureMode(State& state, unsigned long long /*capture_id*/, int)
    -> decltype(state.capturing_ = false, void()) {
  state.capturing_ = false;
}
// torch >= 2.12 keeps one capture state per capture id, which an eager op never consults (its
// remove_capture_state() is not exported: the entry of an abandoned capture stays, a few bytes).
template <typename State>
void leaveCaptureMode(State& /*state*/, unsigned long long /*capture_id*/, ...) {}

}  // namespace

void TreeGraph::registerGenerators(const std::vector<at::Generator>& generators,
                                   c10::DeviceIndex device) {
  for (const at::Generator& gen : generators) {
    if (gen.defined() && gen.device().is_cuda() && gen.device().index() == device) {
      register_generator_state(generatorState(gen));
    }
  }
}

void TreeGraph::leaveGeneratorCaptures() {
  for (auto& kv : captured_generator_states_) leaveCaptureMode(*kv.first, capture_id_, 0);
}

void CudaGraph::replay(const RunFn& /*run*/, const std::vector<at::Tensor>& /*inputs*/,
                       const std::vector<int64_t>& /*copied*/,
                       const std::vector<at::Tensor>& /*placeholders*/) {
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream(device_).stream();
  if (C10_UNLIKELY(std::find(replay_streams_->begin(), replay_streams_->end(), s) ==
                   replay_streams_->end())) {
    replay_streams_->push_back(s);
  }
  graph_->replay();
}

}  // namespace graphtrees
