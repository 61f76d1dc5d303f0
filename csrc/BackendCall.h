#pragma once

// A graphed call, as the backend sees it (Note [Streams of the pool] in cuda/PoolStreams.cpp).

#include "Backend.h"
#include "Logging.h"

#include <exception>
#include <optional>
#include <string>

namespace graphtrees {

// Backend::beginCall() now, endCall() by end(), or by the destructor on the error path, which logs
// its errors so that the call's own error is the one that propagates.
class BackendCall {
 public:
  explicit BackendCall(Backend& backend) : backend_(backend) { backend_.beginCall(); }
  void end() {
    active_ = false;
    backend_.endCall();
  }
  ~BackendCall() {
    if (!active_) return;
    try {
      backend_.endCall();
    } catch (const std::exception& e) {
      GRAPHTREES_LOG(LogLevel::kDebug, std::string("ending a failed call: ") + e.what());
    }
  }
  BackendCall(const BackendCall&) = delete;
  BackendCall& operator=(const BackendCall&) = delete;

 private:
  Backend& backend_;
  bool active_ = true;
};

// Runs `work` outside a call, ordered as a call's work is (evictions, reset(): Note [Streams of
// the pool] in cuda/PoolStreams.cpp): after the pool's last use on any stream. A failure to order
// it is logged, and the work runs anyway: freeing must not stop halfway.
template <typename Work>
void runOrdered(Backend& backend, Work&& work) {
  std::optional<BackendCall> call;
  try {
    call.emplace(backend);
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning,
                   std::string("ordering work after the pool's use: ") + e.what());
  }
  work();
}  // ~BackendCall ends the call, logging its errors

}  // namespace graphtrees
