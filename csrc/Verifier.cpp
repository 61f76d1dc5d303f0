#include "Verifier.h"

#include "Backend.h"
#include "ThreadState.h"

#include <ATen/Context.h>

namespace graphtrees {

ReplayVerifier::ReplayVerifier(const FlatArgs& flat, c10::Device device,
                               std::vector<at::Tensor> state)
    : state_(std::move(state)) {
  for (const auto& t : state_) state_before_.push_back(t.clone());
  generators_.push_back(at::globalContext().defaultGenerator(device));
  generators_.insert(generators_.end(), flat.generators.begin(), flat.generators.end());
  for (size_t i = 0; i < flat.tensors.size(); ++i) {
    // Module tensors (after the argument ones) are read in place by the eager run; the same
    // tensor passed twice is one copy, as it is one tensor eagerly.
    at::Tensor copy = flat.tensors[i];
    if (i < flat.keyed_tensors) {
      size_t same = 0;
      while (same < i &&
             flat.tensors[same].unsafeGetTensorImpl() != flat.tensors[i].unsafeGetTensorImpl()) {
        ++same;
      }
      copy = same < i ? copies_[same] : flat.tensors[i].clone();
      copies_.push_back(copy);
    }
    inputs_.push_back(std::move(copy));
  }
  before_ = RngStates(generators_);
}

py::object ReplayVerifier::check(
    const std::string& name, Verify mode, py::object replayed, const Graph& graph,
    const std::function<py::object(const std::vector<at::Tensor>&)>& eager) {
  const RngStates after(generators_);
  // What the replay wrote into the state, then the state as the call found it for the eager run.
  std::vector<at::Tensor> replayed_state;
  for (size_t i = 0; i < state_.size(); ++i) {
    replayed_state.push_back(state_[i].clone());
    state_[i].copy_(state_before_[i]);
  }
  const auto leave_as_replayed = [&] {
    after.restore();
    for (size_t i = 0; i < state_.size(); ++i) state_[i].copy_(replayed_state[i]);
  };
  try {
    before_.restore();
    py::object expected;
    std::string baked;
    {
      // The eager run is part of this call: graphed functions it calls run eagerly, as they did
      // while it was recorded, instead of entering the tree (review 4, #6).
      CallDepthGuard depth;
      baked = graph.explainDifference([&] { expected = eager(copies_); }, inputs_);
    }
    py::object result = py::module_::import("graphtrees._verify")
                            .attr("check")(name, mode == Verify::kWarn, std::move(replayed),
                                           std::move(expected), baked, replayed_state, state_);
    leave_as_replayed();
    return result;
  } catch (...) {
    leave_as_replayed();
    throw;
  }
}

}  // namespace graphtrees
