#pragma once

// A graphed call, as the backend sees it (Note [Streams of the pool] in cuda/PoolStreams.cpp).

#include "Backend.h"
#include "Logging.h"

#include <exception>
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

}  // namespace graphtrees
