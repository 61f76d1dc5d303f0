#pragma once

// What graphtrees knows of the calling thread: its identity and step counter, whether it is inside
// a tree call, whether it is recording a graph, and the capture scope around a recording.
//
// Note [Steps, generations and threads]
// Two counters order what happens:
//   step        per thread; mark_step_begin() (or torch.compiler.cudagraph_mark_step_begin())
//               increments the calling thread's. Each tree belongs to one thread and remembers
//               the value of its thread's counter it last saw: a different value at its next call
//               ends its current path (Note [Ending a path]).
//   generation  per tree: the index of its current path. Ending a path increments it. Every
//               tracked output carries the generation it was produced in; "an output of this
//               generation" is what makes an input managed and what keeps a path going.
// Each thread has its own tree per device (TreeRegistry), with its own pool and its own steps, so
// a call on one thread never ends another thread's step or overwrites its outputs. A backward
// that autograd runs on a thread of its own runs in the tree whose outputs it reads: its forward's.
// And a call on a thread that works for another -- autograd runs CUDA backwards on a device thread
// of its own, which carries the calling thread's thread-local state -- counts as that thread's
// (callerThread()): its tree, its steps, as on CPU, where autograd runs on the calling thread.
// Without it, the backward of a forward that ran eagerly (nothing of the tree to read) would get
// a tree and a pool of its own on the device thread, whose steps never begin (found on the CUDA
// stand-in). The calling thread's identity travels in torch's thread-local Python objects, which
// autograd (and at::launch) hand to the threads that run work for it, as PyTorch's trees do.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

// The calling thread's step counter; markStepBegin() increments it.
using StepCounter = std::shared_ptr<std::atomic<int64_t>>;
const StepCounter& threadStepCounter();
void markStepBegin();
// A small number naming the calling thread: 1 for the first thread that asks, and so on.
int64_t threadId();
// The thread a graphed call counts as (see above): the calling thread, or the thread whose work
// it runs. Needs the GIL.
struct CallerThread {
  int64_t id;
  StepCounter steps;
};
CallerThread callerThread();
// Called with the threadId() of a thread that exits (if it ever asked for one). Runs on that
// thread, after its Python state is gone: it must not touch Python.
void setThreadExitHook(std::function<void(int64_t)> hook);

// True while the calling thread is inside a tree call (a nested wrapped call runs eagerly).
bool inTreeCall();
// The c10::DeviceType of the tree whose call is in flight on this thread (the innermost guard
// given one: an eager run inside a call keeps its call's), or -1. The Python layer decides by it
// whether torch.cond can become a CPU program's control step (Note [Control flow in a recording]).
int treeCallDeviceType();
// Note [A wrapper's cond split into tree branches]
// A function recorded whole (cudagraphify) cannot be cut at a torch.cond by graphtrees: only a
// graph can. When a CUDA warmup refuses a cond that the tree-branch form could serve (a branch
// that draws random numbers, a driver without conditional nodes), graphtrees/_control_flow.py
// asks for that form here, on the thread whose call it is; the outermost GraphedCallable takes
// the request when its call returns and, if the function was made by cudagraphify, hands its
// later calls to the function traced by torch.compile and split at the cond (Note [Tree
// branches] in graphtrees/_piecewise.py; graphtrees/_dynamo_backend.py, TreeBranchForm).
void requestTreeBranches(const std::string& why);
// The request made on this thread since the last take, or ''; clears it.
std::string takeTreeBranchRequest();
class CallDepthGuard {
 public:
  explicit CallDepthGuard(int device_type = -1);
  ~CallDepthGuard();
  CallDepthGuard(const CallDepthGuard&) = delete;
  CallDepthGuard& operator=(const CallDepthGuard&) = delete;

 private:
  int outer_device_type_;
};

// True while the calling thread runs a graph's program as a recording: during any capture, and
// during a CPU emulation replay (which re-runs the recorded Python). The Python layer answers
// torch.cuda.is_current_stream_capturing() with it, so that code which avoids host syncs while
// captured (transformers' masks, for one) takes the same path on the CPU backend as on CUDA.
bool recordingGraph();
class RecordingGraphScope {
 public:
  RecordingGraphScope();
  ~RecordingGraphScope();
  RecordingGraphScope(const RecordingGraphScope&) = delete;
  RecordingGraphScope& operator=(const RecordingGraphScope&) = delete;
};

// Note [Freeing during a capture]
// Between capture_begin() and the end of a device capture, c10's allocator refuses to see a
// capture it cannot use: once a forbidden call (a host sync, gloo's stream synchronisation) has
// invalidated the capture, the next block freed or allocated on that stream fails c10's
// "Invalid stream capture status" assert -- and a free runs in a tensor's destructor, where the
// exception ends the process. So while a backend runs the function inside a device capture,
// graphtrees frees none of the function's tensors: the frames of the traceback a failed run left
// are not cleared then (GraphedCallable); they are freed with the error, after the backend has
// ended the capture. Found on the CUDA stand-in (tests/cuda_standin).
bool deviceCaptureUnderway();
class DeviceCaptureScope {
 public:
  DeviceCaptureScope();
  ~DeviceCaptureScope();
  DeviceCaptureScope(const DeviceCaptureScope&) = delete;
  DeviceCaptureScope& operator=(const DeviceCaptureScope&) = delete;
};

// Note [Inputs of a split graph]
// A whole compiled graph's inputs are the inputs of its call, which a new step never invalidates
// (Note [Ending a path]). A split graph is several calls, one per recorded piece, so a step that
// begins at its first piece would invalidate what only a later piece reads: state that an earlier
// graph returned and dynamo stored on a module (transformers' StaticCache makes its later layers'
// tensors inside the first forward), still an output in the pool. While a split graph runs, the
// storages of the whole graph's inputs are spared like a call's own inputs, as they are for the
// graph run whole.
class SparedInputsScope {
 public:
  explicit SparedInputsScope(std::vector<const void*> storages);
  ~SparedInputsScope();
  SparedInputsScope(const SparedInputsScope&) = delete;
  SparedInputsScope& operator=(const SparedInputsScope&) = delete;

 private:
  size_t previous_size_;
};
// The storages (StorageImpl*) every open SparedInputsScope of this thread spares.
const std::vector<const void*>& sparedInputs();

// RAII around every capture: a RecordingGraphScope, and the Python layer's capture scope
// (captureScopeHook() in PythonHooks.h: the GC paused, host reads watched), left on destruction.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  RecordingGraphScope recording_;
  std::function<void()> exit_;
};

}  // namespace graphtrees
