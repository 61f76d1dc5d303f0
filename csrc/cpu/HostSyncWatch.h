#pragma once

// What a CUDA capture would reject, watched during a CPU capture (Note [Rejected captures]).

#include "CaptureObserver.h"

#include <string>

namespace graphtrees {

struct HostSyncWatch {
  std::string first;  // "aten::item (.item(), ...)": the first host read met
  int exempt_depth = 0;
  bool collectives = false;  // a c10d op was dispatched (Note [Collective buffers])
};

// Fills `watch` from this thread's ops for the lifetime of the guard: a watcher of the capture
// observer (Note [One capture observer] in CaptureObserver.h), shown every op but those that an
// exempt op calls.
class HostSyncWatchGuard : public CaptureWatcher {
 public:
  explicit HostSyncWatchGuard(HostSyncWatch* watch);
  ~HostSyncWatchGuard() override;

 private:
  Descend onStart(const ObservedOp& op, int level) override;
  void onEnd(const ObservedOp& op, int level, Descend chosen) override;

  HostSyncWatch* watch_;
  HostSyncWatch* prev_;  // for noteHostSync(), which no op shows
};

// Reports a host read that ATen does not dispatch (Tensor.tolist()) on the calling thread: during
// a CPU capture it rejects the recording; elsewhere it does nothing.
void noteHostSync(const char* what);

}  // namespace graphtrees
