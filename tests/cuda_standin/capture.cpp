// Stream capture, graphs and their replays, user objects.

#include "standin.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

// Note [Stand-in captures]
// cudaStreamBeginCapture starts a capture on a created stream (the legacy stream cannot
// capture); the work submitted to a capturing stream becomes nodes of its graph instead of
// running, each after the stream's current dependency set. A stream joins a capture by waiting
// on an event recorded in it (cudaEventRecord in a capture records the dependency set, not a
// node) and must be joined back into the origin stream the same way before cudaStreamEndCapture,
// or the capture ends with cudaErrorStreamCaptureUnjoined.
// The modes follow the runtime's rule for "potentially unsafe" calls -- cudaMalloc, cudaFree,
// cudaHostAlloc/Register, cudaFreeHost, cudaMemcpy, and the synchronisations and queries of
// streams and events: a thread is forbidden them while a capture it began is under way (unless
// that capture is cudaStreamCaptureModeRelaxed), and, in its own mode Global (the default of
// cudaThreadExchangeStreamCaptureMode), while another thread's Global capture is under way. A
// forbidden call fails with cudaErrorStreamCaptureUnsupported and invalidates the capture that
// forbade it. Always illegal, in any mode: synchronising or querying a capturing stream (900) or
// an event recorded in a capture (cudaErrorCapturedEvent), cudaDeviceSynchronize while anything
// captures (900, every capture invalidated), the legacy stream while a blocking stream captures
// (cudaErrorStreamCaptureImplicit), a wait on an event recorded outside the capture
// (cudaErrorStreamCaptureIsolation) or in another capture (cudaErrorStreamCaptureMerge), a
// pageable copy, cudaStreamAddCallback. Work submitted to an invalidated capture fails with
// cudaErrorStreamCaptureInvalidated; EndCapture then returns it, names the call that
// invalidated the capture, and ends the capture for every stream in it. EndCapture from a
// stream that did not begin the capture is cudaErrorStreamCaptureUnmatched; from another thread,
// unless Relaxed, cudaErrorStreamCaptureWrongThread.
// Not modelled (each a reported cudaErrorNotSupported): memory-allocation nodes
// (cudaMallocAsync in a capture), child-graph nodes, a graph launched into a capture, external
// event waits.
//
// Note [Stand-in graphs]
// A graph is its nodes, in creation order (a topological order: a node's dependencies exist
// before it). cudaGraphInstantiateWithFlags snapshots them; cudaGraphLaunch submits one piece of
// work that replays them in order: copies and memsets move bytes, host nodes run, kernel nodes
// are counted. A node whose memory is no longer allocated when it runs -- the graph outlived a
// cudaFree of a buffer it reads or writes -- is a sticky device fault (cudaErrorIllegalAddress)
// reported with the node's name. User objects are reference-counted: graphs and executable
// graphs hold their references (an executable graph takes its own at instantiation), and a
// destructor runs once the count reaches zero, outside the stand-in's lock. A destroyed graph or
// executable graph keeps its handle, retired: using it ends the process (Note [Stand-in handles]).
//
// Note [Stand-in conditional nodes]
// A conditional handle (cudaGraphConditionalHandleCreate) belongs to one graph and holds a value:
// its default, put back at each launch of an executable graph made from that graph when the
// handle has cudaGraphCondAssignDefault (otherwise kept from the last launch, the default at
// instantiation). A conditional node (cudaGraphAddNode, type cudaGraphNodeTypeConditional) takes a
// handle of the graph it is added to and makes its body graphs, owned by the node (destroyed with
// it; cudaGraphDestroy refuses them): IF with one body (run when the value is non-zero) or two (the
// second when it is zero), WHILE with one (run while the value is non-zero, checked before each
// iteration), SWITCH with any number (body[value], none past the end). Bodies are filled by
// cudaStreamBeginCaptureToGraph or by adding nodes, and take only what the driver allows there:
// kernels, copies, memsets, empty nodes and conditional nodes -- a host node (cudaLaunchHostFunc)
// fails with cudaErrorStreamCaptureUnsupported and invalidates the capture, as does an external
// event record, and cudaGraphAddNode of a host node fails with cudaErrorInvalidValue (the other
// types it could add there are not modelled at all).
// The value engine's own host work is not the program's (it stands for the computation of the
// op's kernel) and is allowed there (standin_launch_internal_host_func).
// The value is set on the device by a kernel calling cudaGraphSetConditional. Kernels are never
// run here, so the one such kernel the stand-in knows -- any kernel named
// `set_conditional_handle_kernel(unsigned long long handle, const bool* pred)`: torch's
// (aten/src/ATen/cuda/CUDAGraph.cu) and graphtrees' (csrc/cuda/SetConditional.cu) -- is executed
// by the stand-in when it runs: it reads the predicate's byte from device memory and sets the
// value to 0 or 1. Run outside a graph it is a device fault (the handle is a graph's). With the
// value engine loaded, a predicate whose bytes no engine op computed (a Triton kernel's, say) is a
// device fault rather than a guess; without the engine a predicate is whatever bytes memory holds
// (poison for new memory), and a WHILE node stops with a device fault after
// CUDA_STANDIN_WHILE_LIMIT iterations (default 1,000,000) rather than hang (the node only: a loop
// run eagerly on such a predicate, by torch or by a warmup, still does not end). Instantiation
// snapshots the bodies with the graph; a replay runs the taken bodies' nodes in order (each
// counted in stats()["conditional_runs"]), their value computations with them.

namespace standin {

namespace {

std::vector<Capture*>& activeCaptures() {
  static auto* v = new std::vector<Capture*>();
  return *v;
}
uint64_t next_capture_id = 1;
thread_local cudaStreamCaptureMode thread_mode = cudaStreamCaptureModeGlobal;

// Note [Stand-in conditional nodes]
struct ConditionalHandle {
  CUgraph_st* graph = nullptr;
  unsigned default_value = 0;
  unsigned flags = 0;
};
std::map<uint64_t, ConditionalHandle>& conditionalHandles() {
  static auto* m = new std::map<uint64_t, ConditionalHandle>();
  return *m;
}
std::map<uint64_t, unsigned>& conditionalValues() {
  static auto* m = new std::map<uint64_t, unsigned>();
  return *m;
}
uint64_t next_conditional_handle = 1;

std::unordered_set<CUgraph_st*>& liveGraphs() {
  static auto* s = new std::unordered_set<CUgraph_st*>();
  return *s;
}
std::unordered_set<CUgraphExec_st*>& liveExecs() {
  static auto* s = new std::unordered_set<CUgraphExec_st*>();
  return *s;
}

// Whether `call` was given a live graph (executable graph); a null one is an error the caller
// reports, any other is badHandle() (Note [Stand-in handles]).
bool liveGraph(cudaGraph_t g, const char* call) {
  if (liveGraphs().count(g)) return true;
  if (g != nullptr) badHandle(call, HandleKind::kGraph, g);
  return false;
}
bool liveExec(cudaGraphExec_t x, const char* call) {
  if (liveExecs().count(x)) return true;
  if (x != nullptr) badHandle(call, HandleKind::kGraphExec, x);
  return false;
}

const char* modeName(cudaStreamCaptureMode m) {
  switch (m) {
    case cudaStreamCaptureModeGlobal:
      return "global";
    case cudaStreamCaptureModeThreadLocal:
      return "thread-local";
    case cudaStreamCaptureModeRelaxed:
      return "relaxed";
  }
  return "?";
}

Capture* prohibitingCapture() {
  if (thread_mode == cudaStreamCaptureModeRelaxed) return nullptr;
  const auto me = std::this_thread::get_id();
  for (Capture* c : activeCaptures()) {
    if (c->thread == me && c->mode != cudaStreamCaptureModeRelaxed) return c;
    if (c->thread != me && c->mode == cudaStreamCaptureModeGlobal &&
        thread_mode == cudaStreamCaptureModeGlobal) {
      return c;
    }
  }
  return nullptr;
}

CUgraph_st* newGraph() {
  auto* g = new CUgraph_st();
  liveGraphs().insert(g);
  stats().live_graphs++;
  return g;
}

void releaseUserObject(CUuserObject_st* o, unsigned count) {
  if (count == 0) return;
  o->refs -= count;
  if (o->refs <= 0) {
    cudaHostFn_t destroy = o->destroy;
    void* ptr = o->ptr;
    delete o;
    if (destroy != nullptr) afterUnlock([destroy, ptr] { destroy(ptr); });
  }
}

// The graph's nodes and references go; its handle stays, retired (Note [Stand-in handles]). The
// bodies of its conditional nodes go with it, and so do its conditional handles.
void destroyGraph(CUgraph_st* g, const char* by) {
  for (auto& uo : g->user_objects) releaseUserObject(uo.first, uo.second);
  g->user_objects.clear();
  for (auto& n : g->nodes) {
    for (CUgraph_st* body : n->data.bodies) destroyGraph(body, by);
    n->data.bodies.clear();
  }
  g->nodes.clear();
  for (auto it = conditionalHandles().begin(); it != conditionalHandles().end();) {
    if (it->second.graph == g) {
      conditionalValues().erase(it->first);
      it = conditionalHandles().erase(it);
    } else {
      ++it;
    }
  }
  liveGraphs().erase(g);
  stats().live_graphs--;
  retireHandle(g, HandleKind::kGraph, by);
}

void leaveCapture(Capture* c) {
  for (CUstream_st* s : c->streams) {
    s->capture = nullptr;
    s->deps.clear();
    s->dep_edges.clear();
  }
  c->active = false;
  auto& v = activeCaptures();
  v.erase(std::remove(v.begin(), v.end(), c), v.end());
  if (c->graph != nullptr) c->graph->capturing = false;
}

// An executable graph's copy of a graph's nodes, its conditional nodes' bodies included; the user
// objects of the graph and of its bodies become the executable's, and the handles of the graph and
// of its bodies are noted: put back to their defaults at each launch (cudaGraphCondAssignDefault)
// or now.
std::shared_ptr<const std::vector<NodeData>> snapshot(CUgraph_st* g, CUgraphExec_st* exec) {
  auto nodes = std::make_shared<std::vector<NodeData>>();
  nodes->reserve(g->nodes.size());
  for (const auto& n : g->nodes) {
    NodeData d = n->data;
    for (CUgraph_st* body : d.bodies) d.body_nodes.push_back(snapshot(body, exec));
    nodes->push_back(std::move(d));
  }
  for (auto& uo : g->user_objects) {
    uo.first->refs += uo.second;
    exec->user_objects.push_back(uo);
  }
  for (const auto& [handle, h] : conditionalHandles()) {
    if (h.graph != g) continue;
    if (h.flags & cudaGraphCondAssignDefault) {
      exec->conditional_defaults.emplace_back(handle, h.default_value);
    } else {
      conditionalValues()[handle] = h.default_value;
    }
  }
  return nodes;
}

}  // namespace

unsigned conditionalValue(uint64_t handle) {
  auto it = conditionalValues().find(handle);
  return it == conditionalValues().end() ? 0 : it->second;
}

void setConditionalValue(uint64_t handle, unsigned value) {
  conditionalValues()[handle] = value;
}

int64_t whileLimit() {
  static const int64_t limit = [] {
    const char* v = std::getenv("CUDA_STANDIN_WHILE_LIMIT");
    const long long n = v != nullptr ? std::atoll(v) : 0;
    return n > 0 ? static_cast<int64_t>(n) : int64_t(1000000);
  }();
  return limit;
}

void invalidate(Capture* c, const std::string& why) {
  if (c == nullptr || !c->active || c->invalidated) return;
  c->invalidated = true;
  c->why = why;
  stats().captures_invalidated++;
  trace("capture %llu invalidated by %s", (unsigned long long)c->id, why.c_str());
}

void invalidateAll(const std::string& why) {
  for (Capture* c : activeCaptures()) invalidate(c, why);
}

cudaError_t checkUnsafe(const char* call) {
  Capture* c = prohibitingCapture();
  if (c == nullptr) return cudaSuccess;
  stats().unsafe_calls++;
  invalidate(c, call);
  return fail(cudaErrorStreamCaptureUnsupported,
              "%s while capture %llu (%s mode, %s thread) is under way: a potentially unsafe "
              "call, forbidden in this thread's %s mode",
              call, (unsigned long long)c->id, modeName(c->mode),
              c->thread == std::this_thread::get_id() ? "this" : "another", modeName(thread_mode));
}

bool anyCapture() {
  return !activeCaptures().empty();
}

cudaError_t captureCheck(CUstream_st* s, const char* call, bool* captured) {
  *captured = false;
  if (s->capture != nullptr) {
    if (s->capture->invalidated) return setError(cudaErrorStreamCaptureInvalidated);
    *captured = true;
    return cudaSuccess;
  }
  if (s->legacy) {
    for (Capture* c : activeCaptures()) {
      for (CUstream_st* cs : c->streams) {
        if ((cs->flags & cudaStreamNonBlocking) == 0) {
          invalidate(c, std::string(call) + " on the legacy stream");
          return fail(cudaErrorStreamCaptureImplicit,
                      "%s on the legacy default stream while blocking stream %llu captures", call,
                      (unsigned long long)cs->id);
        }
      }
    }
  }
  return cudaSuccess;
}

CUgraphNode_st* addCaptureNode(CUstream_st* s, NodeData data) {
  CUgraph_st* g = s->capture->graph;
  auto node = std::make_unique<CUgraphNode_st>();
  if (data.kind == NodeKind::kKernel) stats().kernel_nodes++;
  if (data.kind == NodeKind::kHost) stats().host_nodes++;
  node->data = std::move(data);
  node->deps = s->deps;
  node->graph = g;
  node->index = g->nodes.size();
  CUgraphNode_st* raw = node.get();
  g->nodes.push_back(std::move(node));
  s->deps.assign(1, raw);
  s->dep_edges.assign(1, cudaGraphEdgeData{});
  noteValuesNode(s, raw);
  return raw;
}

}  // namespace standin

using namespace standin;

namespace {

cudaError_t beginCapture(cudaStream_t stream, CUgraph_st* into, const cudaGraphNode_t* deps,
                         size_t num_deps, cudaStreamCaptureMode mode, const char* call) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, call);
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "%s: unknown stream %s", call, hex(stream).c_str());
  if (s->legacy)
    return fail(cudaErrorStreamCaptureUnsupported, "%s: the legacy stream cannot capture", call);
  if (s->capture != nullptr)
    return fail(cudaErrorIllegalState, "%s: the stream is capturing already", call);
  if (into != nullptr && !liveGraph(into, call))
    return fail(cudaErrorInvalidValue, "%s: unknown graph", call);
  auto* c = new Capture();  // never freed: capture events keep naming it
  c->id = next_capture_id++;
  c->mode = mode;
  c->origin = s;
  c->thread = std::this_thread::get_id();
  c->owns_graph = into == nullptr;
  c->graph = into != nullptr ? into : newGraph();
  c->graph->capturing = true;
  c->streams.push_back(s);
  s->capture = c;
  s->deps.assign(deps, deps + num_deps);
  s->dep_edges.assign(num_deps, cudaGraphEdgeData{});
  activeCaptures().push_back(c);
  stats().captures_begun++;
  trace("%s: capture %llu on stream %llu (%s)", call, (unsigned long long)c->id,
        (unsigned long long)s->id, modeName(mode));
  return cudaSuccess;
}

// Every node reachable backwards from `from`.
std::unordered_set<CUgraphNode_st*> ancestors(const std::vector<CUgraphNode_st*>& from) {
  std::unordered_set<CUgraphNode_st*> seen;
  std::vector<CUgraphNode_st*> todo(from.begin(), from.end());
  while (!todo.empty()) {
    CUgraphNode_st* n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    for (CUgraphNode_st* d : n->deps) todo.push_back(d);
  }
  return seen;
}

}  // namespace

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  return beginCapture(stream, nullptr, nullptr, 0, mode, "cudaStreamBeginCapture");
}

cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t stream, cudaGraph_t graph,
                                          const cudaGraphNode_t* dependencies,
                                          const cudaGraphEdgeData* /*dependencyData*/,
                                          size_t numDependencies, cudaStreamCaptureMode mode) {
  return beginCapture(stream, graph, dependencies, numDependencies, mode,
                      "cudaStreamBeginCaptureToGraph");
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* pGraph) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamEndCapture");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamEndCapture: unknown stream");
  Capture* c = s->capture;
  if (c == nullptr)
    return fail(cudaErrorIllegalState, "cudaStreamEndCapture: the stream is not capturing");
  // A capture into a graph the caller made (cudaStreamBeginCaptureToGraph: a conditional node's
  // body, say) may be ended without asking for the graph back; torch does so.
  if (pGraph == nullptr && c->owns_graph) {
    return fail(cudaErrorInvalidValue, "cudaStreamEndCapture: no place for the captured graph");
  }
  if (c->origin == s && !c->invalidated && injectedFailure("cudaStreamEndCapture") != cudaSuccess) {
    invalidate(c, "a failure injected by standin_fail_next()");
  }
  if (c->origin != s) {
    invalidate(c, "cudaStreamEndCapture from a stream that joined the capture");
    return fail(cudaErrorStreamCaptureUnmatched,
                "cudaStreamEndCapture: capture %llu was not begun on this stream",
                (unsigned long long)c->id);
  }
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
    invalidate(c, "cudaStreamEndCapture from another thread");
    return fail(cudaErrorStreamCaptureWrongThread,
                "cudaStreamEndCapture: capture %llu (%s mode) was begun by another thread",
                (unsigned long long)c->id, modeName(c->mode));
  }
  std::string unjoined;
  if (!c->invalidated) {
    const auto joined = ancestors(s->deps);
    for (CUstream_st* other : c->streams) {
      if (other == s) continue;
      for (CUgraphNode_st* d : other->deps) {
        if (!joined.count(d)) {
          unjoined = "stream " + std::to_string(other->id) + "'s work after node " +
                     std::to_string(d->index) + " (" + d->data.name + ")";
          break;
        }
      }
      if (!unjoined.empty()) break;
    }
  }
  leaveCapture(c);
  cudaGraph_t ignored = nullptr;
  if (pGraph == nullptr) pGraph = &ignored;
  *pGraph = nullptr;
  if (c->invalidated || !unjoined.empty()) {
    if (c->owns_graph) destroyGraph(c->graph, "a failed cudaStreamEndCapture");
    c->graph = nullptr;
    if (c->invalidated) {
      return fail(cudaErrorStreamCaptureInvalidated,
                  "cudaStreamEndCapture: capture %llu was invalidated by %s",
                  (unsigned long long)c->id, c->why.c_str());
    }
    return fail(cudaErrorStreamCaptureUnjoined,
                "cudaStreamEndCapture: capture %llu has unjoined work: %s was never joined into "
                "the origin stream",
                (unsigned long long)c->id, unjoined.c_str());
  }
  *pGraph = c->graph;
  stats().captures_ended++;
  trace("capture %llu ended: %zu nodes", (unsigned long long)c->id, c->graph->nodes.size());
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* pCaptureStatus) {
  Lock lock;
  if (pCaptureStatus == nullptr) return setError(cudaErrorInvalidValue);
  CUstream_st* s = resolveStream(stream, "cudaStreamIsCapturing");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamIsCapturing: unknown stream %s",
                hex(stream).c_str());
  if (s->capture == nullptr) {
    *pCaptureStatus = cudaStreamCaptureStatusNone;
  } else {
    *pCaptureStatus = s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                              : cudaStreamCaptureStatusActive;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream,
                                     cudaStreamCaptureStatus* captureStatus_out,
                                     unsigned long long* id_out, cudaGraph_t* graph_out,
                                     const cudaGraphNode_t** dependencies_out,
                                     const cudaGraphEdgeData** edgeData_out,
                                     size_t* numDependencies_out) {
  Lock lock;
  if (captureStatus_out == nullptr) return setError(cudaErrorInvalidValue);
  CUstream_st* s = resolveStream(stream, "cudaStreamGetCaptureInfo");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamGetCaptureInfo: unknown stream");
  Capture* c = s->capture;
  if (c == nullptr) {
    *captureStatus_out = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  *captureStatus_out =
      c->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  if (id_out) *id_out = c->id;
  if (graph_out) *graph_out = c->graph;
  if (dependencies_out) *dependencies_out = s->deps.empty() ? nullptr : s->deps.data();
  if (edgeData_out) *edgeData_out = s->dep_edges.empty() ? nullptr : s->dep_edges.data();
  if (numDependencies_out) *numDependencies_out = s->deps.size();
  return cudaSuccess;
}

cudaError_t cudaStreamUpdateCaptureDependencies(cudaStream_t stream, cudaGraphNode_t* dependencies,
                                                const cudaGraphEdgeData* /*dependencyData*/,
                                                size_t numDependencies, unsigned int flags) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamUpdateCaptureDependencies");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle,
                "cudaStreamUpdateCaptureDependencies: unknown stream");
  if (s->capture == nullptr)
    return fail(cudaErrorIllegalState, "cudaStreamUpdateCaptureDependencies: not capturing");
  if (s->capture->invalidated) return setError(cudaErrorStreamCaptureInvalidated);
  if (flags == cudaStreamSetCaptureDependencies) s->deps.clear();
  for (size_t i = 0; i < numDependencies; ++i) {
    if (std::find(s->deps.begin(), s->deps.end(), dependencies[i]) == s->deps.end()) {
      s->deps.push_back(dependencies[i]);
    }
  }
  s->dep_edges.assign(s->deps.size(), cudaGraphEdgeData{});
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (mode == nullptr) return setError(cudaErrorInvalidValue);
  const cudaStreamCaptureMode old = thread_mode;
  thread_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

// ---- graphs -----------------------------------------------------------------------------------

cudaError_t cudaGraphCreate(cudaGraph_t* pGraph, unsigned int /*flags*/) {
  Lock lock;
  if (pGraph == nullptr) return setError(cudaErrorInvalidValue);
  *pGraph = newGraph();
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphDestroy"))
    return fail(cudaErrorInvalidValue, "cudaGraphDestroy(%s): unknown graph", hex(graph).c_str());
  if (graph->capturing)
    return fail(cudaErrorIllegalState, "cudaGraphDestroy: the graph is being captured into");
  if (graph->body_of != nullptr) {
    return fail(cudaErrorInvalidValue,
                "cudaGraphDestroy: the graph is a conditional node's body, owned by the node");
  }
  destroyGraph(graph, "cudaGraphDestroy");
  return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, size_t* numNodes) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphGetNodes") || numNodes == nullptr) {
    return setError(cudaErrorInvalidValue);
  }
  const size_t n = graph->nodes.size();
  if (nodes != nullptr) {
    for (size_t i = 0; i < *numNodes; ++i) nodes[i] = i < n ? graph->nodes[i].get() : nullptr;
  }
  *numNodes = n;
  return cudaSuccess;
}

cudaError_t cudaGraphNodeGetDependencies(cudaGraphNode_t node, cudaGraphNode_t* pDependencies,
                                         cudaGraphEdgeData* edgeData, size_t* pNumDependencies) {
  Lock lock;
  if (node == nullptr || pNumDependencies == nullptr) return setError(cudaErrorInvalidValue);
  const size_t n = node->deps.size();
  if (pDependencies != nullptr) {
    for (size_t i = 0; i < *pNumDependencies; ++i) {
      pDependencies[i] = i < n ? node->deps[i] : nullptr;
      if (edgeData != nullptr) edgeData[i] = cudaGraphEdgeData{};
    }
  }
  *pNumDependencies = n;
  return cudaSuccess;
}

cudaError_t cudaGraphAddNode(cudaGraphNode_t* pGraphNode, cudaGraph_t graph,
                             const cudaGraphNode_t* pDependencies,
                             const cudaGraphEdgeData* /*dependencyData*/, size_t numDependencies,
                             cudaGraphNodeParams* nodeParams) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphAddNode") || nodeParams == nullptr || pGraphNode == nullptr) {
    return setError(cudaErrorInvalidValue);
  }
  NodeData d;
  switch (nodeParams->type) {
    case cudaGraphNodeTypeEmpty:
      d.kind = NodeKind::kEmpty;
      d.name = "empty";
      break;
    case cudaGraphNodeTypeKernel:
      d.kind = NodeKind::kKernel;
      d.name = kernelName(nodeParams->kernel.func);
      d.grid = nodeParams->kernel.gridDim;
      d.block = nodeParams->kernel.blockDim;
      d.shmem = nodeParams->kernel.sharedMemBytes;
      break;
    case cudaGraphNodeTypeHost:
      d.kind = NodeKind::kHost;
      d.name = "host function";
      d.fn = nodeParams->host.fn;
      d.user_data = nodeParams->host.userData;
      break;
    case cudaGraphNodeTypeMemset:
      d.kind = NodeKind::kMemset;
      d.name = "memset node";
      d.dst = nodeParams->memset.dst;
      d.value = nodeParams->memset.value;
      d.elem = nodeParams->memset.elementSize;
      d.width = nodeParams->memset.width;
      d.height = nodeParams->memset.height;
      d.dpitch = nodeParams->memset.height > 1 ? nodeParams->memset.pitch
                                               : nodeParams->memset.width * d.elem;
      d.dst_known = true;
      break;
    case cudaGraphNodeTypeConditional: {
      const cudaConditionalNodeParams& c = nodeParams->conditional;
      auto it = conditionalHandles().find(c.handle);
      if (it == conditionalHandles().end() || it->second.graph != graph) {
        return fail(cudaErrorInvalidValue,
                    "cudaGraphAddNode: conditional handle %llu was not created for this graph",
                    (unsigned long long)c.handle);
      }
      const bool size_ok = c.type == cudaGraphCondTypeIf       ? (c.size == 1 || c.size == 2)
                           : c.type == cudaGraphCondTypeWhile  ? c.size == 1
                           : c.type == cudaGraphCondTypeSwitch ? c.size >= 1
                                                               : false;
      if (!size_ok) {
        return fail(cudaErrorInvalidValue,
                    "cudaGraphAddNode: a conditional node of type %d with %u bodies", (int)c.type,
                    c.size);
      }
      d.kind = NodeKind::kConditional;
      d.name = c.type == cudaGraphCondTypeIf      ? "conditional IF node"
               : c.type == cudaGraphCondTypeWhile ? "conditional WHILE node"
                                                  : "conditional SWITCH node";
      d.cond_handle = c.handle;
      d.cond_type = c.type;
      for (unsigned i = 0; i < c.size; ++i) d.bodies.push_back(newGraph());
      break;
    }
    default:
      return fail(cudaErrorNotSupported,
                  "cudaGraphAddNode: nodes of type %d (child graph, memcpy 3D, memory "
                  "allocation, event, semaphore) are not modelled",
                  (int)nodeParams->type);
  }
  if (graph->body_of != nullptr && d.kind == NodeKind::kHost) {
    return fail(cudaErrorInvalidValue,
                "cudaGraphAddNode: a host node in a conditional node's body (a body takes "
                "kernels, copies, memsets, empty and conditional nodes only)");
  }
  if (d.kind == NodeKind::kKernel) stats().kernel_nodes++;
  auto node = std::make_unique<CUgraphNode_st>();
  node->data = std::move(d);
  node->deps.assign(pDependencies, pDependencies + numDependencies);
  node->graph = graph;
  node->index = graph->nodes.size();
  for (CUgraph_st* body : node->data.bodies) body->body_of = node.get();
  if (node->data.kind == NodeKind::kConditional) {
    stats().conditional_nodes++;
    // CUDA-owned, valid for the node's lifetime: the node's own vector, never resized.
    nodeParams->conditional.phGraph_out = node->data.bodies.data();
  }
  *pGraphNode = node.get();
  graph->nodes.push_back(std::move(node));
  return cudaSuccess;
}

cudaError_t cudaGraphConditionalHandleCreate(cudaGraphConditionalHandle* pHandle_out,
                                             cudaGraph_t graph, unsigned int defaultLaunchValue,
                                             unsigned int flags) {
  Lock lock;
  if (pHandle_out == nullptr || !liveGraph(graph, "cudaGraphConditionalHandleCreate") ||
      (flags & ~unsigned(cudaGraphCondAssignDefault)) != 0) {
    return fail(cudaErrorInvalidValue, "cudaGraphConditionalHandleCreate: invalid arguments");
  }
  const uint64_t handle = next_conditional_handle++;
  conditionalHandles()[handle] = ConditionalHandle{graph, defaultLaunchValue, flags};
  conditionalValues()[handle] = defaultLaunchValue;
  *pHandle_out = handle;
  trace("cudaGraphConditionalHandleCreate: handle %llu (default %u, flags %u)",
        (unsigned long long)handle, defaultLaunchValue, flags);
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                          unsigned long long /*flags*/) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphInstantiateWithFlags") || pGraphExec == nullptr) {
    return fail(cudaErrorInvalidValue, "cudaGraphInstantiateWithFlags: unknown graph %s",
                hex(graph).c_str());
  }
  if (graph->capturing)
    return fail(cudaErrorIllegalState, "cudaGraphInstantiate: the graph is being captured into");
  if (cudaError_t e = injectedFailure("cudaGraphInstantiateWithFlags")) return e;
  if (graph->body_of != nullptr) {
    return fail(cudaErrorInvalidValue,
                "cudaGraphInstantiate: the graph is a conditional node's body");
  }
  auto* exec = new CUgraphExec_st();
  exec->nodes = snapshot(graph, exec);
  liveExecs().insert(exec);
  stats().live_execs++;
  *pGraphExec = exec;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* pGraphExec, cudaGraph_t graph,
                                 unsigned long long flags) {
  return cudaGraphInstantiateWithFlags(pGraphExec, graph, flags);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
  Lock lock;
  if (!liveExec(graphExec, "cudaGraphExecDestroy"))
    return fail(cudaErrorInvalidValue, "cudaGraphExecDestroy(%s): unknown executable graph",
                hex(graphExec).c_str());
  // Queued launches keep their own copy of the nodes; the executable graph can go, its handle
  // stays, retired (Note [Stand-in handles]).
  for (auto& uo : graphExec->user_objects) releaseUserObject(uo.first, uo.second);
  graphExec->user_objects.clear();
  graphExec->nodes.reset();
  liveExecs().erase(graphExec);
  stats().live_execs--;
  retireHandle(graphExec, HandleKind::kGraphExec, "cudaGraphExecDestroy");
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  Lock lock;
  if (!liveExec(graphExec, "cudaGraphLaunch"))
    return fail(cudaErrorInvalidValue, "cudaGraphLaunch(%s): unknown executable graph",
                hex(graphExec).c_str());
  if (stickyError() != cudaSuccess) return setError(stickyError());
  if (cudaError_t e = injectedFailure("cudaGraphLaunch")) return e;
  CUstream_st* s = resolveStream(stream, "cudaGraphLaunch");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: unknown stream %s",
                hex(stream).c_str());
  if (s->capture != nullptr) {
    invalidate(s->capture, "cudaGraphLaunch into a capture");
    return fail(cudaErrorNotSupported,
                "cudaGraphLaunch into a capturing stream (a child graph) is not modelled");
  }
  bool captured = false;
  cudaError_t e = captureCheck(s, "cudaGraphLaunch", &captured);
  if (e != cudaSuccess) return e;
  graphExec->launches++;
  stats().graph_launches++;
  // A launch holds the executable's user objects until it has run, as a driver does: a graph
  // destroyed with a launch still queued (deferred mode) keeps what its host work points to (the
  // value engine's computations) alive until then (found in review: a use after free).
  std::vector<std::pair<CUuserObject_st*, unsigned>> held = graphExec->user_objects;
  for (auto& uo : held) uo.first->refs += uo.second;
  enqueue(s, "graph launch",
          [nodes = graphExec->nodes, held, defaults = graphExec->conditional_defaults] {
            for (const auto& [handle, value] : defaults) setConditionalValue(handle, value);
            for (const NodeData& n : *nodes) {
              executeNode(n, "graph replay");
              if (stickyError() != cudaSuccess) break;
            }
            for (const auto& uo : held) releaseUserObject(uo.first, uo.second);
          });
  return cudaSuccess;
}

extern "C" __attribute__((visibility("default"))) int standin_values_attach(void* stream,
                                                                            void (*fn)(void*),
                                                                            void* data) {
  Lock lock;
  CUstream_st* s = resolveStream(static_cast<cudaStream_t>(stream), "standin_values_attach");
  if (s == nullptr || s->capture == nullptr) return 0;
  CUgraphNode_st* n = valuesNode(s);
  if (n == nullptr || n->graph != s->capture->graph || s->deps.size() != 1 || s->deps[0] != n ||
      n->data.then_fn != nullptr) {
    return 0;
  }
  n->data.then_fn = fn;
  n->data.then_data = data;
  return 1;
}

cudaError_t cudaGraphDebugDotPrint(cudaGraph_t graph, const char* path, unsigned int /*flags*/) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphDebugDotPrint") || path == nullptr) {
    return setError(cudaErrorInvalidValue);
  }
  FILE* f = std::fopen(path, "w");
  if (f == nullptr)
    return fail(cudaErrorInvalidValue, "cudaGraphDebugDotPrint: cannot write %s", path);
  std::fprintf(f, "digraph standin_graph {\n");
  for (const auto& n : graph->nodes) {
    std::string label = n->data.name;
    for (char& c : label) {
      if (c == '"') c = '\'';
    }
    std::fprintf(f, "  n%zu [label=\"%zu: %s\"];\n", n->index, n->index, label.c_str());
    for (const CUgraphNode_st* d : n->deps)
      std::fprintf(f, "  n%zu -> n%zu;\n", d->index, n->index);
  }
  std::fprintf(f, "}\n");
  std::fclose(f);
  return cudaSuccess;
}

// ---- user objects -------------------------------------------------------------------------------

cudaError_t cudaUserObjectCreate(cudaUserObject_t* object_out, void* ptr, cudaHostFn_t destroy,
                                 unsigned int initialRefcount, unsigned int /*flags*/) {
  Lock lock;
  if (object_out == nullptr || initialRefcount == 0) return setError(cudaErrorInvalidValue);
  auto* o = new CUuserObject_st();
  o->ptr = ptr;
  o->destroy = destroy;
  o->refs = initialRefcount;
  *object_out = o;
  return cudaSuccess;
}

cudaError_t cudaUserObjectRetain(cudaUserObject_t object, unsigned int count) {
  Lock lock;
  object->refs += count;
  return cudaSuccess;
}

cudaError_t cudaUserObjectRelease(cudaUserObject_t object, unsigned int count) {
  Lock lock;
  releaseUserObject(object, count);
  return cudaSuccess;
}

cudaError_t cudaGraphRetainUserObject(cudaGraph_t graph, cudaUserObject_t object,
                                      unsigned int count, unsigned int flags) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphRetainUserObject"))
    return fail(cudaErrorInvalidValue, "cudaGraphRetainUserObject: unknown graph");
  if ((flags & cudaGraphUserObjectMove) == 0) object->refs += count;  // Move: the caller's refs
  graph->user_objects.push_back({object, count});
  return cudaSuccess;
}

cudaError_t cudaGraphReleaseUserObject(cudaGraph_t graph, cudaUserObject_t object,
                                       unsigned int count) {
  Lock lock;
  if (!liveGraph(graph, "cudaGraphReleaseUserObject"))
    return fail(cudaErrorInvalidValue, "cudaGraphReleaseUserObject: unknown graph");
  for (auto& uo : graph->user_objects) {
    if (uo.first == object && uo.second >= count) {
      uo.second -= count;
      if (uo.second == 0) {
        uo = graph->user_objects.back();
        graph->user_objects.pop_back();
      }
      releaseUserObject(object, count);
      return cudaSuccess;
    }
  }
  return fail(cudaErrorInvalidValue,
              "cudaGraphReleaseUserObject: the graph holds fewer references");
}

}  // extern "C"
