#include "cuda/PoolStreams.h"

#include "PythonHooks.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <vector>

namespace graphtrees {

// Note [Streams of the pool]
// One pool serves every stream a tree's functions are called on: a replay copies its inputs into
// the placeholders and launches its graph on the caller's current stream; warmups, placeholder
// copies, captures, checkpoints and restores run on the tree's own stream. They are ordered by
// one event of the tree's (`used_`), never by a caller's stream handle:
//   - at the end of every call, its write-back included, the event is recorded on the caller's
//     stream (endCall);
//   - a call on another stream makes that stream wait for it before anything else (beginCall):
//     before it invalidates, migrates or copies anything. After `with torch.cuda.stream(s1):
//     y = g(x)`, `with torch.cuda.stream(s2): z = g(x2)` cannot let its input copies and kernels
//     overwrite the placeholders and outputs that the first replay still uses (the stand-in's
//     deferred mode shows the value that would be lost);
//   - a phase on the tree's stream makes it wait for the caller's stream and the event (join),
//     and the host waits for the tree's stream alone, where it must (sync): at the end of a warmup
//     or a capture (their asynchronous errors surface there, and the caller's stream sees their
//     results), at a checkpoint and a restore (c10 wants the pool's events done), at the release.
// This replaces a list of every caller stream ever seen, each synchronised at every phase: a
// stream its owner destroyed since (an ExternalStream of another library) was synchronised again,
// which is undefined behaviour on a driver (the stand-in ends the process); the list grew without
// bound; and the legacy default stream in it made every phase cudaStreamSynchronize(0), which
// waits for every blocking stream (contrary to Note [One allocation phase per device] in
// DeviceLock.h) and is illegal while another thread captures on one. The stream the event was
// recorded on is kept as a number to compare, never passed to CUDA: a new stream at the address
// of a destroyed one skips a wait it does not need, since the driver releases a destroyed stream
// only once its work is done.
// The host waits are cudaStreamSynchronize on the tree's stream, not c10's stream_synchronize(),
// which checks the user's torch.cuda.set_sync_debug_mode(): under "error" graphtrees' own
// bookkeeping raised (Note [Syncs of graphtrees' own] in OwnSyncScope.cpp).
// Not ordered, as in PyTorch's own trees: the caller's work queued on its stream after a call (a
// read of an output) against a later call from another stream that reuses that memory; as for
// any memory used on two streams, the caller orders that (wait_stream).
//
// Note [The tree's stream]
// A tree warms up and captures on a stream of its own (review 4, #10), and objects made during a
// warmup may name it and outlive the tree: a torch.cuda.Stream taken as the current stream there,
// a record_stream() on it of a tensor the warmup used (c10 records an event on that stream when
// the tensor is freed, whenever that is), a cuBLAS workspace keyed by it. Destroying the stream
// with the tree left them a stale handle, on which a real driver may crash (the stand-in ends the
// process). So a tree's stream is never destroyed: when its tree goes, it goes to a per-device
// list of spare streams, and the next tree of the device takes it from there. A process holds as
// many such streams per device as it ever had trees alive there at once (one per thread that used
// the device; usually one). A stream taken from the list may still receive work from such an
// object (an event record); the new tree's phases wait for whatever is queued on their stream, as
// on any stream. c10's stream pool is no alternative: torch.cuda.Stream() hands the same streams
// out to everyone, whose kernels would then land in the tree's captures.
namespace {

struct SpareStream {
  c10::DeviceIndex device;
  cudaStream_t stream;
};

std::mutex& spareStreamsMutex() {
  static auto* m = new std::mutex();  // leaked, like the list: trees may go at exit
  return *m;
}

std::vector<SpareStream>& spareStreams() {
  static auto* v = new std::vector<SpareStream>();
  return *v;
}

cudaStream_t takeStream(c10::DeviceIndex device) {
  {
    std::lock_guard<std::mutex> lock(spareStreamsMutex());
    auto& spare = spareStreams();
    for (auto it = spare.begin(); it != spare.end(); ++it) {
      if (it->device == device) {
        const cudaStream_t s = it->stream;
        spare.erase(it);
        return s;
      }
    }
  }
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t s = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void giveBackStream(c10::DeviceIndex device, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(spareStreamsMutex());
  spareStreams().push_back({device, s});
}

cudaEvent_t createEvent() {
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void destroyEvent(cudaEvent_t e) {
  if (e != nullptr && cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace

PoolStreams::PoolStreams(c10::DeviceIndex device)
    : device_(device),
      own_(takeStream(device)),
      stream_(c10::cuda::getStreamFromExternal(own_, device)) {
  c10::cuda::CUDAGuard guard(device_);
  try {
    used_ = createEvent();
    joined_ = createEvent();
  } catch (...) {
    destroyEvent(used_);
    giveBackStream(device_, own_);
    throw;
  }
}

PoolStreams::~PoolStreams() {
  c10::cuda::CUDAGuard guard(device_);
  if (cudaStreamSynchronize(own_) != cudaSuccess) {
    (void)cudaGetLastError();  // an asynchronous error that the pool's release surfaced already
  }
  giveBackStream(device_, own_);  // Note [The tree's stream]: never destroyed
  destroyEvent(used_);
  destroyEvent(joined_);
}

void PoolStreams::beginCall() {
  if (!used_recorded_) return;
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_).stream();
  if (reinterpret_cast<uintptr_t>(current) == used_on_) return;
  c10::cuda::CUDAGuard guard(device_);  // stream 0 is the current device's legacy stream
  C10_CUDA_CHECK(cudaStreamWaitEvent(current, used_, 0));
}

void PoolStreams::endCall() {
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_).stream();
  C10_CUDA_CHECK(cudaEventRecord(used_, current));
  used_on_ = reinterpret_cast<uintptr_t>(current);
  used_recorded_ = true;
}

void PoolStreams::join() {
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_).stream();
  if (current != own_) {
    C10_CUDA_CHECK(cudaEventRecord(joined_, current));
    C10_CUDA_CHECK(cudaStreamWaitEvent(own_, joined_, 0));
  }
  if (used_recorded_ && used_on_ != reinterpret_cast<uintptr_t>(own_)) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(own_, used_, 0));
  }
}

void PoolStreams::sync() {
  const cudaStream_t own = own_;
  runBlocking([own] { C10_CUDA_CHECK(cudaStreamSynchronize(own)); });
}

}  // namespace graphtrees
