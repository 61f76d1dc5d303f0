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

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

namespace graphtrees {

// The calling thread's step counter; markStepBegin() increments it.
using StepCounter = std::shared_ptr<std::atomic<int64_t>>;
const StepCounter& threadStepCounter();
void markStepBegin();
// A small number naming the calling thread: 1 for the first thread that asks, and so on.
int64_t threadId();
// Called with the threadId() of a thread that exits (if it ever asked for one). Runs on that
// thread, after its Python state is gone: it must not touch Python.
void setThreadExitHook(std::function<void(int64_t)> hook);

// True while the calling thread is inside a tree call (a nested wrapped call runs eagerly).
bool inTreeCall();
class CallDepthGuard {
 public:
  CallDepthGuard();
  ~CallDepthGuard();
  CallDepthGuard(const CallDepthGuard&) = delete;
  CallDepthGuard& operator=(const CallDepthGuard&) = delete;
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
