#pragma once

// torch.cond and torch.while_loop recorded as CUDA conditional nodes (Note [Conditional nodes on
// CUDA] in ConditionalNodes.cpp).

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace graphtrees {

class ConditionalNodes {
 public:
  // Why a capture on this build of torch and this driver cannot hold conditional nodes, or "".
  static const std::string& unavailableReason();
  // One step of graphtrees/_control_flow.py's conditional-node sequence, in the capture under way
  // on the current stream: "cond" (an IF node running the body captured next when `pred` is
  // true; noted as a torch.cond), "else" (an IF node on `pred`, the cond's negated predicate, not
  // noted), "while_loop" (a WHILE node on `pred`, noted), "set" (inside a WHILE body: sets the
  // node's value from `pred` for the next iteration) and "end" (ends the innermost body).
  static void step(const std::string& what, const at::Tensor& pred);
  // The kinds ("cond", "while_loop") noted on this thread since the last take(), outermost and
  // earliest first: what a finished capture holds (Graph::conditionals()).
  static std::vector<std::string> take();
};

}  // namespace graphtrees
