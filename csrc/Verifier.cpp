#include "Verifier.h"

#include "Backend.h"

#include <ATen/Context.h>

#include <mutex>

namespace graphtrees {

ReplayVerifier::ReplayVerifier(const FlatArgs& flat, c10::Device device) {
  generators_.push_back(at::globalContext().defaultGenerator(device));
  generators_.insert(generators_.end(), flat.generators.begin(), flat.generators.end());
  for (size_t i = 0; i < flat.tensors.size(); ++i) {
    // Module tensors (after the argument ones) are read in place by the eager run.
    inputs_.push_back(i < flat.keyed_tensors ? flat.tensors[i].clone() : flat.tensors[i]);
    if (i < flat.keyed_tensors) copies_.push_back(inputs_.back());
  }
  before_ = rngStates();
}

std::vector<std::pair<at::Generator, at::Tensor>> ReplayVerifier::rngStates() const {
  std::vector<std::pair<at::Generator, at::Tensor>> states;
  for (auto g : generators_) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.emplace_back(g, g.get_state());
  }
  return states;
}

void ReplayVerifier::setRng(const std::vector<std::pair<at::Generator, at::Tensor>>& states) {
  for (auto s : states) {  // a Generator is a handle: the copy sets the generator's state
    std::lock_guard<std::mutex> lock(s.first.mutex());
    s.first.set_state(s.second);
  }
}

py::object ReplayVerifier::check(
    const std::string& name, Verify mode, py::object replayed, const Graph& graph,
    const std::function<py::object(const std::vector<at::Tensor>&)>& eager) {
  const auto after = rngStates();
  setRng(before_);
  py::object expected;
  std::string baked;
  try {
    baked = graph.explainDifference([&] { expected = eager(copies_); }, inputs_);
  } catch (...) {
    setRng(after);
    throw;
  }
  setRng(after);
  return py::module_::import("graphtrees._verify")
      .attr("check")(name, mode == Verify::kWarn, std::move(replayed), std::move(expected), baked);
}

}  // namespace graphtrees
