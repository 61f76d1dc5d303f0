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
// The eager run happens after the replay, so the RNG goes back to where the replay left it.
// State the function writes outside its arguments (a module's buffer, a KV cache and its position
// counter held in a closure) gets the same treatment: a verified signature's first run notes, under
// a dispatch mode, the tensors it writes that are neither arguments nor made by the run
// (graphtrees/_verify.py, run_noting_state_writes); each verified call copies them before the
// call, puts that copy back for the eager run, compares what the eager run wrote with what the
// replay wrote, and leaves them as the replay left them. So the eager run sees what the replay
// saw, the state is updated once, and verify="warn" changes no state. A write the first run did
// not make (a branch taken later) is not covered; the CPU backend's recorded ops would name it.

#include "CallSignature.h"
#include "GraphOptions.h"
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
  // Before the call: copies of the argument tensors of `flat`, of `state` (the tensors the
  // function writes that are not arguments) and the RNG states of `device`'s default generator
  // and of `flat.generators`.
  ReplayVerifier(const FlatArgs& flat, c10::Device device, std::vector<at::Tensor> state);

  // After a replay of `graph` returned `replayed`: runs `eager` on the copies, compares, and
  // returns what the call returns (`replayed`, or the eager result under verify="warn"); raises
  // graphtrees.ReplayMismatchError on a mismatch under verify=True.
  py::object check(const std::string& name, Verify mode, py::object replayed, const Graph& graph,
                   const std::function<py::object(const std::vector<at::Tensor>&)>& eager);

 private:
  std::vector<at::Tensor> copies_;        // the argument tensors, copied before the call
  std::vector<at::Tensor> inputs_;        // the graph's inputs as the eager run sees them
  std::vector<at::Tensor> state_;         // written by the function, not arguments
  std::vector<at::Tensor> state_before_;  // their values before the call
  std::vector<at::Generator> generators_;
  RngStates before_;
};

}  // namespace graphtrees
