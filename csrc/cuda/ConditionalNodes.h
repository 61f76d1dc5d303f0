#pragma once

// torch.cond and torch.while_loop recorded as CUDA conditional nodes (Note [Conditional nodes on
// CUDA] in ConditionalNodes.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>

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
  // The kinds ("cond", "while_loop") noted on this thread since the last take(), in the order
  // their nodes were begun: what a finished capture holds (Graph::conditionals()).
  static std::vector<std::string> take();

  // The CUDA backend's capture of one function on this thread, into `pool` on `device`: what
  // graphtrees' own conditional-node capture needs (a torch without one), and the end of any
  // body the function left open.
  class CaptureScope {
   public:
    CaptureScope(c10::DeviceIndex device, c10::cuda::MempoolId_t pool);
    ~CaptureScope();
    CaptureScope(const CaptureScope&) = delete;
    CaptureScope& operator=(const CaptureScope&) = delete;
  };
};

}  // namespace graphtrees
