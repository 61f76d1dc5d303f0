#pragma once

// What a CUDA capture would reject, watched during a CPU capture (Note [Rejected captures]).

#include <ATen/record_function.h>

#include <string>

namespace graphtrees {

struct HostSyncWatch {
  std::string first;  // "aten::item (.item(), ...)": the first host read met
  int exempt_depth = 0;
  bool collectives = false;  // a c10d op was dispatched (Note [Collective buffers])
};

// Installs `watch` on this thread for the lifetime of the guard.
class HostSyncWatchGuard {
 public:
  explicit HostSyncWatchGuard(HostSyncWatch* watch);
  ~HostSyncWatchGuard();
  HostSyncWatchGuard(const HostSyncWatchGuard&) = delete;
  HostSyncWatchGuard& operator=(const HostSyncWatchGuard&) = delete;

 private:
  HostSyncWatch* prev_;
  at::CallbackHandle handle_;
  at::RecordFunctionGuard enabled_{true};  // observe even where RecordFunction is switched off
};

// Reports a host read that ATen does not dispatch (Tensor.tolist()) on the calling thread: during
// a CPU capture it rejects the recording; elsewhere it does nothing.
void noteHostSync(const char* what);

}  // namespace graphtrees
