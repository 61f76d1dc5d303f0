#include "cuda/CudaGraph.h"

#include "cuda/DeviceLock.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace graphtrees {

// Note [Generators and captures]
// A CUDA graph advances a generator's philox offset on every replay only if the generator was
// registered with the graph before capture_begin(). The device's default generator registers
// itself; a torch.Generator("cuda") passed as an argument is registered here (PyTorch's trees do
// the same), so each replay draws fresh numbers from it, as eager calls would. c10 registers a
// generator's state, which CUDAGeneratorImpl keeps private (torch 2.14 binds no overload that
// takes the generator itself): generatorState() reads it through a pointer to the member, taken
// where C++ allows naming a private member, in an explicit template instantiation.
// torch 2.11 is different, and registering its way matters (review 4, #1): its state keeps the
// set of graphs registered with it, which only the overload taking the Generator fills
// (CUDAGeneratorImpl::register_graph); the state overload only adds the state to the graph's
// map. ~CUDAGraph then unregisters the graph from every state in its map and TORCH_CHECKs that
// the state knew it -- inside a destructor, so a state added half-way ends the process with
// std::terminate. So on 2.11 generators are registered through the Generator overload, the
// default generator too, before a memory budget lowers the fraction (its first registration
// allocates its seed and offset tensors: an out-of-memory error there would leave it half-way,
// review 4, #2), and ~TreeGraph takes out of the map every state that does not list the graph,
// whatever path left it there. The overloads and the set are detected from the headers.
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

// torch 2.11: the state lists the graphs registered with it; register through the Generator.
template <typename Graph, typename State = at::CUDAGeneratorState>
auto registerGenerator(Graph& graph, const at::Generator& gen, int)
    -> decltype((void)std::declval<State&>().registered_graphs_, void()) {
  graph.register_generator_state(gen);
}
template <typename Graph>
void registerGenerator(Graph& graph, const at::Generator& gen, ...) {
  graph.register_generator_state(generatorState(gen));
}
// Whether registering the default generator ourselves is needed (torch 2.11; later torch
// registers it in capture_begin() without allocating).
template <typename State = at::CUDAGeneratorState>
constexpr auto statesListGraphs(int)
    -> decltype((void)std::declval<State&>().registered_graphs_, bool()) {
  return true;
}
constexpr bool statesListGraphs(...) {
  return false;
}

// torch 2.11: the states in the map that do not list `graph` (nothing on later torch).
template <typename Graph, typename Map, typename State = at::CUDAGeneratorState>
auto halfRegistered(const Graph* graph, const Map& states, int)
    -> decltype((void)std::declval<State&>().registered_graphs_,
                std::vector<typename Map::key_type>()) {
  std::vector<typename Map::key_type> out;
  for (const auto& kv : states) {
    const auto& graphs = kv.first->registered_graphs_;
    if (graphs.find(const_cast<Graph*>(graph)) == graphs.end()) out.push_back(kv.first);
  }
  return out;
}
template <typename Graph, typename Map>
std::vector<typename Map::key_type> halfRegistered(const Graph*, const Map&, ...) {
  return {};
}

}  // namespace

TreeGraph::~TreeGraph() {
  for (const auto& state :
       halfRegistered<at::cuda::CUDAGraph>(this, captured_generator_states_, 0)) {
    captured_generator_states_.erase(captured_generator_states_.find(state));
  }
}

bool TreeGraph::drawsRandomNumbers() const {
  return std::any_of(captured_generator_states_.begin(), captured_generator_states_.end(),
                     [](const auto& kv) { return kv.second != 0; });
}

void TreeGraph::registerGenerators(const std::vector<at::Generator>& generators,
                                   c10::DeviceIndex device) {
  if (statesListGraphs(0)) {
    registerGenerator(*this, at::cuda::detail::getDefaultCUDAGenerator(device), 0);
  }
  for (const at::Generator& gen : generators) {
    // torch.Generator("cuda") has no device index: it belongs to the current device, which the
    // capture runs on (found on the CUDA stand-in: such generators were never registered).
    const c10::DeviceIndex index = gen.defined() ? gen.device().index() : -1;
    if (gen.defined() && gen.device().is_cuda() && (index == device || index < 0)) {
      registerGenerator(*this, gen, 0);
    }
  }
}

void TreeGraph::leaveGeneratorCaptures() {
  for (auto& kv : captured_generator_states_) leaveCaptureMode(*kv.first, capture_id_, 0);
}

CudaGraph::~CudaGraph() {
  DeviceLock lock(device_);
  destroyGraph(std::move(graph_), device_, pool_, pool_refs_);
}

void destroyGraph(std::unique_ptr<TreeGraph> graph, c10::DeviceIndex device,
                  c10::cuda::MempoolId_t pool, int capture_refs) {
  namespace CCA = c10::cuda::CUDACachingAllocator;
  if (capture_refs <= 1) {  // a plain capture: its reset gives its one reference back
    graph.reset();
    return;
  }
  try {
    const int before = CCA::getPoolUseCount(device, pool);
    graph.reset();
    const int after = CCA::getPoolUseCount(device, pool);
    for (int kept = capture_refs - (before - after); kept > 0; --kept) {
      CCA::releasePool(device, pool);
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): a destructor's work
    graph.reset();
  }
}

void CudaGraph::replay(const RunFn& /*run*/, const std::vector<at::Tensor>& /*inputs*/,
                       const std::vector<int64_t>& /*copied*/,
                       const std::vector<at::Tensor>& /*placeholders*/) {
  if (draws_random_numbers_ && CaptureGate::needed()) {
    // Note [Random numbers while a graph is captured] in DeviceLock.h.
    CaptureGate gate(device_, /*exclusive=*/false);
    graph_->replay();
    return;
  }
  graph_->replay();
}

}  // namespace graphtrees
