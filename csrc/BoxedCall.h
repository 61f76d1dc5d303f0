#pragma once

// A graphed function in the boxed calling convention of AOTAutograd and Inductor: called with one
// list of inputs, which it empties (the callee owns them), Note [The boxed call in C++].

#include "GraphedCallable.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace graphtrees {

// Note [The boxed call in C++]
// torch.compile(backend="graphtrees") hands AOTAutograd one callable per recorded graph, which
// AOTAutograd's runtime wrapper calls as compiled_fn(args) with a list it expects the callee to
// clear (attribute _boxed_call). A Python adapter (list(args); args.clear(); graphed(*flat)) costs
// a frame, a list and a tuple on every replay; the adapter here does the same in C++: it moves
// the list's items into the argument tuple and empties the list before GraphedCallable::call, so
// a replay through torch.compile runs no Python of graphtrees' at all. Attributes set on it
// (`graphed`, read by tests and introspection) live in its __dict__ (py::dynamic_attr).
class BoxedCall {
 public:
  explicit BoxedCall(std::shared_ptr<GraphedCallable> graphed);

  // TypeError unless `inputs` is a list.
  py::object call(const py::handle& inputs) const;
  const std::shared_ptr<GraphedCallable>& graphed() const { return graphed_; }

 private:
  std::shared_ptr<GraphedCallable> graphed_;
};

}  // namespace graphtrees
