#include "cuda/ConditionalNodes.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

namespace graphtrees {

// SetConditional.cu
cudaError_t launchSetConditional(cudaGraphConditionalHandle handle, const bool* pred,
                                 cudaStream_t stream);

// Note [Conditional nodes on CUDA]
// Inside a graphtrees recording on CUDA, graphtrees/_control_flow.py records a torch.cond as two
// IF nodes -- one on the predicate whose body runs the true branch and leaves its results in
// their buffers, one on the negated predicate whose body runs the false branch and copies its
// results into those buffers, so that later work sees one address whichever branch ran -- and a
// torch.while_loop as one WHILE node whose body runs the loop body, copies its results into the
// carried buffers and sets the node's value from the cond function for the next iteration. The
// predicate is read on the device by a kernel that sets the node's handle: a replay makes no host
// sync. The bodies are warmed up before (the warmup runs every arm, eagerly).
//
// Where torch's at::cuda::CUDAGraph can capture conditional nodes (after torch 2.11:
// begin_capture_to_if_node, begin_capture_to_while_node, set_conditional_handle_for_current_node,
// end_capture_to_conditional_node; detected at compile time, below), graphtrees uses it. On a
// torch without it (2.11, the GPU machine's), graphtrees captures them itself, in the same steps:
//   1. on the capturing stream, a handle on the capturing graph (default 0, put back at each
//      launch), the set-handle kernel (SetConditional.cu) reading the predicate, and the
//      conditional node after the stream's dependencies, which then become the node -- for a
//      cond, one IF/ELSE node where the driver has them (CUDA 12.8), whose ELSE body takes the
//      false branch (the "else" step then makes no node of its own), else two IF nodes;
//   2. the body captured into the node's body graph (cudaStreamBeginCaptureToGraph) on a stream
//      of graphtrees' own -- one per device and nesting depth, never destroyed, so that the pool
//      blocks a body allocates keep a live stream and serve the next body at that depth -- made
//      the current stream until the body ends;
//   3. the body stream's allocations routed into the recording's pool: c10 routes a capture's
//      allocations by a filter on the stream's capture id (beginAllocateToPool), one routing per
//      pool. So the first body of a capture replaces torch's routing (endAllocateToPool, then
//      beginAllocateToPool) by one whose filter accepts the capture's id and the ids of the bodies
//      open now; it serves the rest of the capture, and capture_end() removes it as it would have
//      removed torch's. The pool use count beginAllocateToPool takes is given back at once
//      (releasePool): the capture holds the pool already.
// Otherwise (a driver older than CUDA 12.4, which has no WHILE nodes) unavailableReason() says
// why, and a torch.cond in a CUDA recording runs eagerly with that reason. A body may not hold what
// a conditional node refuses (host functions, events, memory-allocation nodes). _control_flow.py
// refuses, from what the warmup saw, an arm that draws random numbers (torch refuses RNG in a
// conditional body) or reads the host (.item(): a sync invalidates the body's capture); CUDA
// refuses the rest during the capture. A body whose capture failed is ended whatever state
// torch's CUDAGraph is in (abandonBody), so that the process stays usable and the recording is
// rejected with CUDA's message. torch 2.14's capture keeps two references to the pool per body
// that the graph's reset does not give back; the CUDA backend counts the references a capture
// took and gives back, when the graph goes, those its reset kept (destroyGraph in CudaGraph.h),
// so that graphtrees.reset() frees the pool.

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

constexpr bool kTorchCaptures = HasConditionalCapture<at::cuda::CUDAGraph>::value;

thread_local std::vector<std::string> tls_kinds;

// A body whose capture failed (a host sync in it invalidated it): its capture ends, whatever
// state torch's CUDAGraph is left in (torch 2.14 throws before it pops its stream guard; the
// graph is discarded with the rejected capture), and the stream before it is current again, so
// that the process stays usable and the recording is rejected with CUDA's message.
void abandonBody(cudaStream_t parent, c10::DeviceIndex device) {
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (current != parent && cudaStreamIsCapturing(current, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t ignored = nullptr;
    (void)cudaStreamEndCapture(current, &ignored);
  }
  (void)cudaGetLastError();
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(parent, device));
}

// torch's capture (kTorchCaptures). `parents`: the current stream before each open body.
template <typename G>
void torchStep(const std::string& what, const at::Tensor& pred, c10::DeviceIndex device,
               std::vector<cudaStream_t>* parents) {
  if constexpr (HasConditionalCapture<G>::value) {
    const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device).stream();
    // The graph capturing on the current stream (a body's too); torch refuses when that capture
    // was invalidated, which ends the body like any failure of the step.
    const auto capturing = [&what] {
      G* graph = G::get_currently_capturing_graph();
      TORCH_CHECK(graph != nullptr, "graphtrees: a conditional node outside a capture (", what,
                  ")");
      return graph;
    };
    if (what == "cond" || what == "else" || what == "while_loop") {
      try {
        if (what == "while_loop") {
          capturing()->begin_capture_to_while_node(pred);
        } else {
          capturing()->begin_capture_to_if_node(pred);
        }
      } catch (...) {
        abandonBody(current, device);
        throw;
      }
      parents->push_back(current);
    } else if (what == "set") {
      capturing()->set_conditional_handle_for_current_node(pred);
    } else {
      TORCH_CHECK(!parents->empty(),
                  "graphtrees: the end of a conditional node's body that was never begun");
      const cudaStream_t parent = parents->back();
      parents->pop_back();
      try {
        capturing()->end_capture_to_conditional_node();
      } catch (...) {
        abandonBody(parent, device);
        throw;
      }
    }
  } else {
    (void)what;
    (void)pred;
    (void)device;
    (void)parents;
    TORCH_INTERNAL_ASSERT(false);
  }
}

// graphtrees' own capture: the state of this thread's capture (CaptureScope).
struct OpenBody {
  cudaStream_t parent;
  cudaStream_t stream;
  unsigned long long capture_id;
  cudaGraphConditionalHandle handle;
  bool is_while;
  cudaGraph_t else_body = nullptr;  // an IF/ELSE node's, kept for the "else" step
};
struct OwnCapture {
  c10::DeviceIndex device;
  c10::cuda::MempoolId_t pool;
  std::vector<OpenBody> bodies;  // innermost last
  // The ELSE body of the IF/ELSE node whose IF body ended last, for the cond's "else" step; and
  // the stream that captured into that node.
  cudaGraph_t else_body = nullptr;
  cudaStream_t else_parent = nullptr;
  // torch's capture: the current stream before each open body.
  std::vector<cudaStream_t> torch_parents;
  // The capture ids graphtrees' routing accepts (step 3 of the Note): the capture's and the open
  // bodies'; nullptr until the capture's first body.
  std::shared_ptr<std::vector<unsigned long long>> routed;
};
thread_local OwnCapture* tls_capture = nullptr;

cudaStream_t bodyStream(c10::DeviceIndex device, size_t depth) {
  static std::mutex mutex;
  static auto* streams = new std::map<std::pair<c10::DeviceIndex, size_t>, cudaStream_t>();
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& s = (*streams)[{device, depth}];
  if (s == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}

unsigned long long captureId(cudaStream_t stream, cudaGraph_t* graph, const cudaGraphNode_t** deps,
                             size_t* num_deps) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id, graph, deps, nullptr, num_deps));
  TORCH_CHECK(status == cudaStreamCaptureStatusActive,
              "graphtrees: a conditional node needs the stream capture under way on the current "
              "stream, which is ",
              status == cudaStreamCaptureStatusNone ? "not capturing" : "invalidated");
  return id;
}

void setCurrent(cudaStream_t stream, c10::DeviceIndex device) {
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(stream, device));
}

bool hasIfElse() {
  int driver = 0;
  return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12080;
}

void beginBody(OwnCapture& c, cudaStream_t parent, unsigned long long outer, cudaGraph_t body,
               cudaGraphConditionalHandle handle, bool is_while);

// `what`: "cond" (an IF/ELSE node where the driver has them, CUDA 12.8, else an IF node), "else"
// (the ELSE body of the node the cond's "cond" step made, or an IF node of its own), "while_loop".
void ownBegin(OwnCapture& c, const at::Tensor& pred, const std::string& what) {
  const cudaStream_t parent = c10::cuda::getCurrentCUDAStream(c.device).stream();
  cudaGraph_t graph = nullptr;
  const unsigned long long outer = captureId(parent, &graph, nullptr, nullptr);
  const bool is_while = what == "while_loop";
  if (what == "else" && c.else_body != nullptr && c.else_parent == parent) {
    cudaGraph_t body = std::exchange(c.else_body, nullptr);
    beginBody(c, parent, outer, body, 0, false);
    return;
  }
  c.else_body = nullptr;
  const bool if_else = what == "cond" && hasIfElse();
  cudaGraphConditionalHandle handle = 0;
  C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  C10_CUDA_CHECK(launchSetConditional(handle, pred.const_data_ptr<bool>(), parent));
  const cudaGraphNode_t* deps = nullptr;
  size_t num_deps = 0;
  captureId(parent, &graph, &deps, &num_deps);
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = is_while ? cudaGraphCondTypeWhile : cudaGraphCondTypeIf;
  params.conditional.size = if_else ? 2 : 1;
  cudaGraphNode_t node = nullptr;
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, nullptr, num_deps, &params));
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(parent, &node, nullptr, 1,
                                                     cudaStreamSetCaptureDependencies));
  cudaGraph_t else_body = if_else ? params.conditional.phGraph_out[1] : nullptr;
  beginBody(c, parent, outer, params.conditional.phGraph_out[0], handle, is_while);
  c.bodies.back().else_body = else_body;
}

void beginBody(OwnCapture& c, cudaStream_t parent, unsigned long long outer, cudaGraph_t body,
               cudaGraphConditionalHandle handle, bool is_while) {
  const cudaStream_t stream = bodyStream(c.device, c.bodies.size());
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(stream, body, nullptr, nullptr, 0,
                                               cudaStreamCaptureModeThreadLocal));
  unsigned long long id = 0;
  try {
    id = captureId(stream, nullptr, nullptr, nullptr);
    if (c.routed == nullptr) {  // step 3 of the Note
      c.routed = std::make_shared<std::vector<unsigned long long>>(1, outer);
      auto routed = c.routed;
      c10::cuda::CUDACachingAllocator::endAllocateToPool(c.device, c.pool);
      c10::cuda::CUDACachingAllocator::beginAllocateToPool(
          c.device, c.pool, [routed](cudaStream_t s) {
            cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
            unsigned long long sid = 0;
            if (cudaStreamGetCaptureInfo(s, &status, &sid) != cudaSuccess) {
              (void)cudaGetLastError();
              return false;
            }
            return status == cudaStreamCaptureStatusActive &&
                   std::find(routed->begin(), routed->end(), sid) != routed->end();
          });
      c10::cuda::CUDACachingAllocator::releasePool(c.device, c.pool);
    }
  } catch (...) {
    cudaGraph_t ignored = nullptr;  // the body's capture ends with the failure
    (void)cudaStreamEndCapture(stream, &ignored);
    (void)cudaGetLastError();
    throw;
  }
  c.routed->push_back(id);
  c.bodies.push_back(OpenBody{parent, stream, id, handle, is_while, nullptr});
  setCurrent(stream, c.device);
}

void ownEnd(OwnCapture& c) {
  TORCH_CHECK(!c.bodies.empty(),
              "graphtrees: the end of a conditional node's body that was "
              "never begun");
  const OpenBody body = c.bodies.back();
  c.bodies.pop_back();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(body.stream, &graph);
  if (ended != cudaSuccess) (void)cudaGetLastError();
  auto& ids = *c.routed;
  ids.erase(std::remove(ids.begin(), ids.end(), body.capture_id), ids.end());
  setCurrent(body.parent, c.device);
  c.else_body = body.else_body;
  c.else_parent = body.parent;
  C10_CUDA_CHECK(ended);
}

void ownStep(const std::string& what, const at::Tensor& pred) {
  TORCH_CHECK(tls_capture != nullptr,
              "graphtrees: a conditional node outside a graphtrees CUDA recording (", what, ")");
  OwnCapture& c = *tls_capture;
  if (what == "cond" || what == "else" || what == "while_loop") {
    ownBegin(c, pred, what);
  } else if (what == "set") {
    TORCH_CHECK(!c.bodies.empty() && c.bodies.back().is_while,
                "graphtrees: 'set' outside a WHILE node's body");
    C10_CUDA_CHECK(launchSetConditional(c.bodies.back().handle, pred.const_data_ptr<bool>(),
                                        c.bodies.back().stream));
  } else {
    ownEnd(c);
  }
}

}  // namespace

const std::string& ConditionalNodes::unavailableReason() {
  static const std::string reason = []() -> std::string {
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
  TORCH_CHECK(
      what == "cond" || what == "else" || what == "while_loop" || what == "set" || what == "end",
      "graphtrees: unknown conditional-node step '", what, "'");
  if (what != "end") {
    TORCH_CHECK(
        pred.defined() && pred.is_cuda() && pred.dim() == 0 && pred.scalar_type() == at::kBool,
        "graphtrees: a conditional node's predicate must be a boolean scalar tensor on "
        "the recording's CUDA device, got ",
        pred.defined() ? pred.toString() : std::string("none"));
  }
  TORCH_CHECK(unavailableReason().empty(), "graphtrees: ", unavailableReason());
  if constexpr (kTorchCaptures) {
    TORCH_CHECK(tls_capture != nullptr,
                "graphtrees: a conditional node outside a graphtrees CUDA recording (", what, ")");
    torchStep<at::cuda::CUDAGraph>(what, pred, tls_capture->device, &tls_capture->torch_parents);
  } else {
    ownStep(what, pred);
  }
  if (what == "cond" || what == "while_loop") tls_kinds.push_back(what);
}

std::vector<std::string> ConditionalNodes::take() {
  return std::exchange(tls_kinds, {});
}

ConditionalNodes::CaptureScope::CaptureScope(c10::DeviceIndex device, c10::cuda::MempoolId_t pool) {
  TORCH_INTERNAL_ASSERT(tls_capture == nullptr, "graphtrees: nested CUDA captures on a thread");
  tls_capture = new OwnCapture{device, pool};
  tls_kinds.clear();
}

ConditionalNodes::CaptureScope::~CaptureScope() {
  // A body the function left open (an exception that skipped _control_flow.py's end): ended, so
  // that the capture can end; the capture is rejected anyway.
  while (!tls_capture->bodies.empty()) {
    try {
      ownEnd(*tls_capture);
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): already failing
    }
  }
  if (!tls_capture->torch_parents.empty()) {
    abandonBody(tls_capture->torch_parents.front(), tls_capture->device);
  }
  delete tls_capture;
  tls_capture = nullptr;
}

}  // namespace graphtrees
