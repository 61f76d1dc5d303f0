#pragma once

// The streams of a tree's pool on its device: the tree's own stream, which is never destroyed
// (Note [The tree's stream]), and the event of the tree's that orders every stream using the pool
// (Note [Streams of the pool]); both Notes in PoolStreams.cpp.

#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace graphtrees {

class PoolStreams {
 public:
  explicit PoolStreams(c10::DeviceIndex device);
  // Hands the tree's stream on to the device's next tree; never destroys it.
  ~PoolStreams();
  PoolStreams(const PoolStreams&) = delete;
  PoolStreams& operator=(const PoolStreams&) = delete;

  // The tree's own stream: warmups, placeholder copies and captures run on it.
  const c10::cuda::CUDAStream& stream() const { return stream_; }
  // A call begins on the caller's current stream, which first waits for the pool's last use if
  // that was on another stream.
  void beginCall();
  // The call has queued all of its work: the pool's last use is on the caller's current stream.
  void endCall();
  // The tree's stream waits for the caller's current stream and for the pool's last use, before
  // it touches the pool.
  void join();
  // The host waits (GIL released) for the tree's stream: for everything join() made it wait for.
  void sync();

 private:
  c10::DeviceIndex device_;
  cudaStream_t own_;
  c10::cuda::CUDAStream stream_;
  cudaEvent_t used_ = nullptr;  // recorded at the end of every call
  uintptr_t used_on_ = 0;       // the stream it was recorded on, compared only (never used)
  bool used_recorded_ = false;
  cudaEvent_t joined_ = nullptr;  // the caller's stream, for the tree's stream to wait for
};

}  // namespace graphtrees
