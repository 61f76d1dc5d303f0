#pragma once

// verify=True: every replay checked against an eager run.
//
// Note [Verified replays]
// A recording bakes what it saw: Python attributes, globals, numbers and branches decided by
// them. A verified replay therefore also runs the function eagerly, outside the pool, on copies of
// its input tensors taken before the replay and from the RNG states the replay started with, and
// compares every output (graphtrees/_verify.py: exact for integer and bool dtypes, the usual
// per-dtype tolerances for floating ones). A mismatch raises graphtrees.ReplayMismatchError naming
// the function, the output and the largest difference; on the CPU backend it also names the first
// recorded op whose non-tensor argument the eager run passes differently (the graph's
// explainDifference()). verify="warn" logs that once and returns the eager result instead.
// The eager run happens after the replay, so the RNG goes back to where the replay left it, and
// state the function mutates outside its arguments (a buffer on a module) is mutated twice.

#include "GraphOptions.h"
#include "PyTree.h"
#include "RngStates.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace graphtrees {

class Graph;

class ReplayVerifier {
 public:
  // Before the call: copies of the argument tensors of `flat` and the RNG states of `device`'s
  // default generator and of `flat.generators`.
  ReplayVerifier(const FlatArgs& flat, c10::Device device);

  // After a replay of `graph` returned `replayed`: runs `eager` on the copies, compares, and
  // returns what the call returns (`replayed`, or the eager result under verify="warn"); raises
  // graphtrees.ReplayMismatchError on a mismatch under verify=True.
  py::object check(const std::string& name, Verify mode, py::object replayed, const Graph& graph,
                   const std::function<py::object(const std::vector<at::Tensor>&)>& eager);

 private:
  std::vector<at::Tensor> copies_;  // the argument tensors, copied before the call
  std::vector<at::Tensor> inputs_;  // the graph's inputs as the eager run sees them
  std::vector<at::Generator> generators_;
  RngStates before_;
};

}  // namespace graphtrees
