#include "cuda/ConditionalNodes.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/version.h>

#include <string>
#include <type_traits>
#include <utility>

namespace graphtrees {

// Note [Conditional nodes on CUDA]
// Inside a graphtrees recording on CUDA, graphtrees/_control_flow.py records a torch.cond as two
// IF nodes -- one on the predicate whose body runs the true branch and leaves its results in
// their buffers, one on the negated predicate whose body runs the false branch and copies its
// results into those buffers, so that later work sees one address whichever branch ran -- and a
// torch.while_loop as one WHILE node whose body runs the loop body, copies its results into the
// carried buffers and sets the node's value from the cond function for the next iteration. The
// predicate is read on the device by a kernel that sets the node's handle: a replay makes no host
// sync. torch's at::cuda::CUDAGraph does the capture work where it has it (after torch 2.11:
// begin_capture_to_if_node, begin_capture_to_while_node, set_conditional_handle_for_current_node,
// end_capture_to_conditional_node): it makes the handle and the node on the capturing graph,
// launches its set-handle kernel, captures the body on a stream of its own into the node's body
// graph, and routes that stream's allocations into the graph's pool; the bodies are warmed up
// before (the warmup runs every arm). graphtrees uses those members where the torch it was built
// against declares them (detected at compile time, below) and the driver is CUDA 12.4 or later;
// otherwise unavailableReason() says why, and a torch.cond in a CUDA recording runs eagerly with
// that reason. A body may not hold what a conditional node refuses (host functions, events, memory
// allocation nodes, and in torch random numbers: _control_flow.py refuses a branch that draws any,
// seen in the warmup); CUDA and torch refuse the rest during the capture, which graphtrees rejects
// with their message.

namespace {

template <typename G, typename = void>
struct HasConditionalCapture : std::false_type {};
template <typename G>
struct HasConditionalCapture<G, std::void_t<decltype(&G::begin_capture_to_if_node),
                                            decltype(&G::begin_capture_to_while_node),
                                            decltype(&G::end_capture_to_conditional_node),
                                            decltype(&G::set_conditional_handle_for_current_node),
                                            decltype(&G::get_currently_capturing_graph)>>
    : std::true_type {};

constexpr bool kTorchHasConditionalCapture = HasConditionalCapture<at::cuda::CUDAGraph>::value;

thread_local std::vector<std::string> tls_kinds;

template <typename G>
void runStep(const std::string& what, const at::Tensor& pred) {
  if constexpr (HasConditionalCapture<G>::value) {
    G* graph = G::get_currently_capturing_graph();
    TORCH_CHECK(graph != nullptr, "graphtrees: a conditional node outside a capture (", what, ")");
    if (what == "cond" || what == "else") {
      graph->begin_capture_to_if_node(pred);
    } else if (what == "while_loop") {
      graph->begin_capture_to_while_node(pred);
    } else if (what == "set") {
      graph->set_conditional_handle_for_current_node(pred);
    } else {
      graph->end_capture_to_conditional_node();
    }
  } else {
    (void)pred;
    TORCH_CHECK(false, "graphtrees: ", ConditionalNodes::unavailableReason(), " (", what, ")");
  }
}

}  // namespace

const std::string& ConditionalNodes::unavailableReason() {
  static const std::string reason = []() -> std::string {
    if (!kTorchHasConditionalCapture) {
      return "the torch graphtrees was built against (" + std::to_string(TORCH_VERSION_MAJOR) +
             "." + std::to_string(TORCH_VERSION_MINOR) +
             ") cannot capture CUDA conditional nodes (at::cuda::CUDAGraph gained them after "
             "torch 2.11)";
    }
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) {
      (void)cudaGetLastError();
      return "the CUDA driver's version could not be read";
    }
    if (driver < 12040) {
      return "the CUDA driver (" + std::to_string(driver / 1000) + "." +
             std::to_string(driver % 1000 / 10) +
             ") has no WHILE conditional nodes (CUDA 12.4 or later has them)";
    }
    return "";
  }();
  return reason;
}

void ConditionalNodes::step(const std::string& what, const at::Tensor& pred) {
  const bool with_pred = what != "end";
  TORCH_CHECK(
      what == "cond" || what == "else" || what == "while_loop" || what == "set" || what == "end",
      "graphtrees: unknown conditional-node step '", what, "'");
  if (with_pred) {
    TORCH_CHECK(
        pred.defined() && pred.is_cuda() && pred.dim() == 0 && pred.scalar_type() == at::kBool,
        "graphtrees: a conditional node's predicate must be a boolean scalar tensor on "
        "the recording's CUDA device, got ",
        pred.defined() ? pred.toString() : std::string("none"));
  }
  runStep<at::cuda::CUDAGraph>(what, pred);
  if (what == "cond" || what == "while_loop") tls_kinds.push_back(what);
}

std::vector<std::string> ConditionalNodes::take() {
  return std::exchange(tls_kinds, {});
}

}  // namespace graphtrees
