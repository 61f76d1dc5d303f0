// Streams, events, host functions and synchronisation; the queue engine.

#include "standin.h"

#include <algorithm>
#include <unordered_set>

// Note [Stand-in streams]
// Every stream is a queue of work (copies, memsets, kernels, host functions, event records,
// graph launches, waits). Work carries the dependencies CUDA gives it: the work before it in its
// stream, the events cudaStreamWaitEvent made it wait for, and the legacy default stream's
// implicit synchronisation with blocking streams (the legacy stream waits for every blocking
// stream, and they wait for it; cudaStreamNonBlocking streams, which c10 uses, take no part).
// Running a stream's queue up to a point first runs, recursively, everything that work depends
// on -- and nothing else. So synchronising the legacy stream waits for the blocking streams: while
// one of them captures, in any thread and mode, that is cudaErrorStreamCaptureImplicit and
// invalidates the capture, as work submitted to the legacy stream is (Note [Stand-in captures]).
//   - Eager mode (the default): work runs when it is submitted, so every stream is always idle.
//   - Deferred mode (CUDA_STANDIN_DEFERRED=1): work runs only when the host waits for it --
//     cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize, a synchronous copy
//     (cudaMemcpy, or any copy to pageable memory), cudaFree/cudaFreeHost (which wait for the
//     device), a stream or event query (a query of unfinished work runs it and answers
//     cudaErrorNotReady once). Work of a stream that nobody waits for stays pending while other
//     streams run ahead, so a missing dependency (a wait_stream or record_stream left out, a
//     buffer reused across streams too early) shows up as a wrong value in a copy, as it could
//     on a GPU -- but deterministically.
// What neither mode models: real concurrency between kernels (kernels never run), and timing.
// Capture (Note [Stand-in captures]) diverts a capturing stream's work into its graph instead.
// Host functions (cudaLaunchHostFunc, stream callbacks, host nodes of a replay) run without the
// stand-in's lock (runUnlocked), as a driver runs them on its own thread with no API lock: a host
// function that needs the GIL must not wait for a thread that holds the GIL and waits for the
// stand-in. Meanwhile other threads' calls proceed.

namespace standin {

namespace {

std::unordered_set<CUstream_st*>& liveStreams() {
  static auto* s = new std::unordered_set<CUstream_st*>();
  return *s;
}
// The live streams that synchronise with the legacy stream (created without
// cudaStreamNonBlocking): what the legacy stream's work waits for. Kept apart from liveStreams so
// that this wait costs nothing per op for torch's pool of non-blocking streams (one per priority
// and device, 32 each), which would make every legacy-stream op of the process dearer the moment
// anything takes a stream from that pool -- a cost a driver does not have.
std::vector<CUstream_st*>& blockingStreams() {
  static auto* s = new std::vector<CUstream_st*>();
  return *s;
}
std::unordered_set<CUevent_st*>& liveEvents() {
  static auto* s = new std::unordered_set<CUevent_st*>();
  return *s;
}
thread_local CUstream_st* per_thread_stream = nullptr;
uint64_t next_stream_id = 1;

CUstream_st* newStream(unsigned flags, int priority) {
  auto* s = new CUstream_st();  // never freed: a stale handle is recognised, not reused
  s->id = next_stream_id++;
  s->flags = flags;
  s->priority = priority;
  liveStreams().insert(s);
  if ((flags & cudaStreamNonBlocking) == 0) blockingStreams().push_back(s);
  return s;
}

bool pending(const CUstream_st* s) {
  return s->queue_head < s->queue.size();
}

// Whether `call` was given a live event; a null one is an error the caller reports, any other
// is badHandle() (Note [Stand-in handles]).
bool liveEvent(cudaEvent_t e, const char* call) {
  if (liveEvents().count(e)) return true;
  if (e != nullptr) badHandle(call, HandleKind::kEvent, e);
  return false;
}

bool eventComplete(const CUevent_st* e) {
  return e->stream == nullptr || e->stream->done_seq >= e->seq;
}

// The event's recording, if it is part of a capture still under way.
Capture* activeCaptureOf(const CUevent_st* e) {
  return e->capture != nullptr && e->capture->active ? e->capture : nullptr;
}

}  // namespace

CUstream_st* legacyStream() {
  static CUstream_st* s = [] {
    auto* l = new CUstream_st();
    l->legacy = true;
    return l;
  }();
  return s;
}

CUstream_st* resolveStream(cudaStream_t h, const char* call) {
  if (h == nullptr || h == cudaStreamLegacy) return legacyStream();
  if (h == cudaStreamPerThread) {
    if (per_thread_stream == nullptr) {
      per_thread_stream = newStream(0, 0);
      per_thread_stream->per_thread = true;
    }
    return per_thread_stream;
  }
  if (liveStreams().count(h)) return h;
  badHandle(call, HandleKind::kStream, h);
  return nullptr;
}

uint64_t enqueue(CUstream_st* s, const char* what, std::function<void()> run,
                 std::vector<std::pair<CUstream_st*, uint64_t>> waits) {
  Op op;
  op.seq = s->next_seq++;
  op.what = what;
  op.run = std::move(run);
  op.waits = std::move(waits);
  CUstream_st* legacy = legacyStream();
  if (s->legacy) {
    for (CUstream_st* b : blockingStreams()) {
      if (b->next_seq - 1 > b->done_seq) {
        op.waits.push_back({b, b->next_seq - 1});
      }
    }
  } else if ((s->flags & cudaStreamNonBlocking) == 0 && legacy->next_seq - 1 > legacy->done_seq) {
    op.waits.push_back({legacy, legacy->next_seq - 1});
  }
  const uint64_t seq = op.seq;
  s->queue.push_back(std::move(op));
  if (!config().deferred) runUpTo(s, seq);
  return seq;
}

void runUpTo(CUstream_st* s, uint64_t seq) {
  while (s->queue_head < s->queue.size() && s->queue[s->queue_head].seq <= seq) {
    Op op = std::move(s->queue[s->queue_head]);
    s->queue_head++;
    for (auto& w : op.waits) runUpTo(w.first, w.second);
    if (op.run) op.run();
    // A host function ran unlocked (runUnlocked): another thread may have run further meanwhile.
    if (op.seq > s->done_seq) s->done_seq = op.seq;
  }
  if (s->queue_head == s->queue.size()) {
    s->queue.clear();
    s->queue_head = 0;
    s->done_seq = s->next_seq - 1;
  }
}

void runStream(CUstream_st* s) {
  runUpTo(s, s->next_seq - 1);
}

void runAll() {
  runStream(legacyStream());
  std::vector<CUstream_st*> all(liveStreams().begin(), liveStreams().end());
  for (CUstream_st* s : all) runStream(s);
}

}  // namespace standin

using namespace standin;

extern "C" {

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* pStream, unsigned int flags, int priority) {
  Lock lock;
  if (pStream == nullptr) return setError(cudaErrorInvalidValue);
  *pStream = newStream(flags, std::max(-5, std::min(0, priority)));
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int flags) {
  return cudaStreamCreateWithPriority(pStream, flags, 0);
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  return cudaStreamCreateWithPriority(pStream, 0, 0);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamDestroy");
  if (s == nullptr || s->legacy || s->per_thread) {
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy(%s): not a created stream",
                hex(stream).c_str());
  }
  if (s->capture != nullptr) {
    invalidate(s->capture, "cudaStreamDestroy of a capturing stream");
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamDestroy: the stream is capturing");
  }
  runStream(s);  // its work still completes
  s->alive = false;
  liveStreams().erase(s);
  auto& blocking = blockingStreams();
  blocking.erase(std::remove(blocking.begin(), blocking.end(), s), blocking.end());
  retireHandle(s, HandleKind::kStream, "cudaStreamDestroy");
  return cudaSuccess;
}

cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int* priority) {
  Lock lock;
  CUstream_st* s = resolveStream(hStream, "cudaStreamGetPriority");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamGetPriority: unknown stream");
  *priority = s->priority;
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamQuery");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery(%s): unknown stream",
                hex(stream).c_str());
  if (s->capture != nullptr) {
    invalidate(s->capture, "cudaStreamQuery of the capturing stream");
    stats().unsafe_calls++;
    return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamQuery: the stream is capturing");
  }
  cudaError_t e = checkUnsafe("cudaStreamQuery");
  if (e != cudaSuccess) return e;
  if (stickyError() != cudaSuccess) return setError(stickyError());
  if (pending(s)) {
    runStream(s);  // a query makes progress: the next one sees the work done
    return cudaErrorNotReady;
  }
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamSynchronize");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize(%s): unknown stream",
                hex(stream).c_str());
  if (s->capture != nullptr) {
    invalidate(s->capture, "cudaStreamSynchronize of the capturing stream");
    stats().unsafe_calls++;
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamSynchronize: the stream is capturing");
  }
  if (s->legacy) {
    // The legacy stream waits for every blocking stream, a capturing one too, from any thread.
    bool captured = false;
    cudaError_t e = captureCheck(s, "cudaStreamSynchronize", &captured);
    if (e != cudaSuccess) {
      stats().unsafe_calls++;
      return e;
    }
  }
  cudaError_t e = checkUnsafe("cudaStreamSynchronize");
  if (e != cudaSuccess) return e;
  if ((e = injectedFailure("cudaStreamSynchronize")) != cudaSuccess) return e;
  stats().host_waits++;
  runStream(s);
  return setError(stickyError());
}

cudaError_t cudaDeviceSynchronize(void) {
  Lock lock;
  if (anyCapture()) {
    // It would wait for the capturing streams: illegal from any thread, in any mode.
    stats().unsafe_calls++;
    invalidateAll("cudaDeviceSynchronize");
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaDeviceSynchronize while a stream is capturing (it waits for every stream)");
  }
  stats().host_waits++;
  runAll();
  return setError(stickyError());
}

cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback,
                                  void* userData, unsigned int /*flags*/) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamAddCallback");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamAddCallback: unknown stream");
  if (s->capture != nullptr) {
    invalidate(s->capture, "cudaStreamAddCallback in a capture");
    return fail(cudaErrorStreamCaptureUnsupported,
                "cudaStreamAddCallback cannot be captured (use cudaLaunchHostFunc)");
  }
  enqueue(s, "callback", [callback, stream, userData] {
    runUnlocked([&] { callback(stream, cudaSuccess, userData); });
  });
  return cudaSuccess;
}

namespace {
// `internal`: the value engine's own host work (standin_launch_internal_host_func), allowed in a
// conditional node's body (Note [Stand-in conditional nodes] in capture.cpp).
cudaError_t launchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData, bool internal) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaLaunchHostFunc");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaLaunchHostFunc: unknown stream");
  bool captured = false;
  cudaError_t e = captureCheck(s, "cudaLaunchHostFunc", &captured);
  if (e != cudaSuccess) return e;
  if (captured) {
    if (!internal && s->capture->graph->body_of != nullptr) {
      invalidate(s->capture, "cudaLaunchHostFunc in a conditional node's body");
      return fail(cudaErrorStreamCaptureUnsupported,
                  "cudaLaunchHostFunc while capturing into a conditional node's body, which "
                  "takes kernels, copies, memsets, empty and conditional nodes only");
    }
    NodeData n;
    n.kind = NodeKind::kHost;
    n.name = "host function";
    n.fn = fn;
    n.user_data = userData;
    n.internal = internal;
    addCaptureNode(s, std::move(n));
    return cudaSuccess;
  }
  enqueue(s, "host function", [fn, userData] { runUnlocked([&] { fn(userData); }); });
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
  return launchHostFunc(stream, fn, userData, /*internal=*/false);
}

__attribute__((visibility("default"))) int standin_launch_internal_host_func(void* stream,
                                                                             void (*fn)(void*),
                                                                             void* data) {
  return static_cast<int>(
      launchHostFunc(static_cast<cudaStream_t>(stream), fn, data, /*internal=*/true));
}

// ---- events -----------------------------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  Lock lock;
  if (event == nullptr) return setError(cudaErrorInvalidValue);
  auto* e = new CUevent_st();  // never freed (queued records may still name it)
  e->flags = flags;
  liveEvents().insert(e);
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, 0);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Lock lock;
  if (!liveEvent(event, "cudaEventDestroy"))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy(%s): unknown event",
                hex(event).c_str());
  event->alive = false;
  liveEvents().erase(event);
  retireHandle(event, HandleKind::kEvent, "cudaEventDestroy");
  return cudaSuccess;
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  Lock lock;
  if (!liveEvent(event, "cudaEventRecord"))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord(%s): unknown event",
                hex(event).c_str());
  CUstream_st* s = resolveStream(stream, "cudaEventRecord");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown stream %s",
                hex(stream).c_str());
  bool captured = false;
  cudaError_t e = captureCheck(s, "cudaEventRecord", &captured);
  if (e != cudaSuccess) return e;
  if (captured) {
    if ((flags & cudaEventRecordExternal) && s->capture->graph->body_of != nullptr) {
      invalidate(s->capture, "an external event record in a conditional node's body");
      return fail(cudaErrorStreamCaptureUnsupported,
                  "cudaEventRecordWithFlags(cudaEventRecordExternal) while capturing into a "
                  "conditional node's body, which takes kernels, copies, memsets, empty and "
                  "conditional nodes only");
    }
    if (flags & cudaEventRecordExternal) {
      NodeData n;
      n.kind = NodeKind::kEventRecord;
      n.name = "event record";
      n.event = event;
      addCaptureNode(s, std::move(n));
      return cudaSuccess;
    }
    // A capture event: it stands for the stream's dependency set at this point.
    event->capture = s->capture;
    event->capture_deps = s->deps;
    event->stream = nullptr;
    return cudaSuccess;
  }
  event->capture = nullptr;
  event->capture_deps.clear();
  event->stream = s;
  event->seq = enqueue(s, "event record", [event] { event->time_ms = nowMs(); });
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return cudaEventRecordWithFlags(event, stream, 0);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  Lock lock;
  if (!liveEvent(event, "cudaEventQuery"))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery(%s): unknown event",
                hex(event).c_str());
  if (Capture* c = activeCaptureOf(event)) {
    invalidate(c, "cudaEventQuery of an event recorded in the capture");
    return fail(cudaErrorCapturedEvent,
                "cudaEventQuery: the event was recorded in a capture under way");
  }
  cudaError_t e = checkUnsafe("cudaEventQuery");
  if (e != cudaSuccess) return e;
  if (!eventComplete(event)) {
    runUpTo(event->stream, event->seq);
    return cudaErrorNotReady;
  }
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Lock lock;
  if (!liveEvent(event, "cudaEventSynchronize"))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize(%s): unknown event",
                hex(event).c_str());
  if (Capture* c = activeCaptureOf(event)) {
    invalidate(c, "cudaEventSynchronize of an event recorded in the capture");
    return fail(cudaErrorCapturedEvent,
                "cudaEventSynchronize: the event was recorded in a capture under way");
  }
  cudaError_t e = checkUnsafe("cudaEventSynchronize");
  if (e != cudaSuccess) return e;
  stats().host_waits++;
  if (event->stream != nullptr) runUpTo(event->stream, event->seq);
  return setError(stickyError());
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Lock lock;
  if (ms == nullptr) return setError(cudaErrorInvalidValue);
  if (!liveEvent(start, "cudaEventElapsedTime") || !liveEvent(end, "cudaEventElapsedTime"))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: unknown event");
  if ((start->flags | end->flags) & cudaEventDisableTiming) {
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
  }
  if (start->stream == nullptr || end->stream == nullptr)
    return setError(cudaErrorInvalidResourceHandle);
  if (!eventComplete(start) || !eventComplete(end)) return setError(cudaErrorNotReady);
  *ms = static_cast<float>(end->time_ms - start->time_ms);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  Lock lock;
  CUstream_st* s = resolveStream(stream, "cudaStreamWaitEvent");
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown stream %s",
                hex(stream).c_str());
  if (!liveEvent(event, "cudaStreamWaitEvent"))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown event %s",
                hex(event).c_str());
  if (Capture* c = activeCaptureOf(event)) {
    if (s->capture == nullptr) {
      // The stream joins the capture, forked from the point the event stands for.
      if (s->legacy) {
        invalidate(c, "the legacy stream joined a capture");
        return fail(cudaErrorStreamCaptureImplicit,
                    "cudaStreamWaitEvent: the legacy stream cannot join a capture");
      }
      s->capture = c;
      s->deps = event->capture_deps;
      s->dep_edges.assign(s->deps.size(), cudaGraphEdgeData{});
      c->streams.push_back(s);
      return cudaSuccess;
    }
    if (s->capture != c) {
      invalidate(s->capture, "a wait on an event of another capture");
      invalidate(c, "a wait on an event of another capture");
      return fail(cudaErrorStreamCaptureMerge,
                  "cudaStreamWaitEvent: the event belongs to another capture");
    }
    for (CUgraphNode_st* d : event->capture_deps) {
      if (std::find(s->deps.begin(), s->deps.end(), d) == s->deps.end()) s->deps.push_back(d);
    }
    s->dep_edges.assign(s->deps.size(), cudaGraphEdgeData{});
    return cudaSuccess;
  }
  if (s->capture != nullptr) {
    if (s->capture->invalidated) return setError(cudaErrorStreamCaptureInvalidated);
    if (flags & cudaEventWaitExternal) {
      return fail(cudaErrorNotSupported,
                  "cudaStreamWaitEvent(cudaEventWaitExternal) in a capture is not modelled");
    }
    invalidate(s->capture, "a wait on an event recorded outside the capture");
    return fail(cudaErrorStreamCaptureIsolation,
                "cudaStreamWaitEvent: a capturing stream waits on an event recorded outside the "
                "capture (only cudaEventWaitExternal may cross the boundary)");
  }
  // A record of a capture that has ended means nothing outside it: no dependency.
  if (event->stream == nullptr || eventComplete(event)) return cudaSuccess;
  enqueue(s, "wait", nullptr, {{event->stream, event->seq}});
  return cudaSuccess;
}

}  // extern "C"
