#include "CaptureWatcher.h"

#include "CaptureObserver.h"

namespace graphtrees {

const std::optional<c10::OperatorHandle>& ObservedOp::handle() const {
  if (!looked_up_) {
    looked_up_ = true;
    if (const auto name = fn.operator_name()) {
      named_ = true;
      handle_ = c10::Dispatcher::singleton().findOp(*name);
    }
  }
  return handle_;
}

bool ObservedOp::named() const {
  handle();
  return named_;
}

CaptureWatcher::CaptureWatcher(Needs needs) : needs_(needs) {}

CaptureWatcher::~CaptureWatcher() {
  stopWatching();
}

void CaptureWatcher::startWatching() {
  if (observer_ != nullptr) return;
  CaptureObserver* o = CaptureObserver::current();
  if (o == nullptr) {
    own_ = std::make_unique<CaptureObserver>();
    o = own_.get();
  }
  o->attach(this);
}

void CaptureWatcher::refuseRecording(const std::string& why) {
  if (observer_ != nullptr) observer_->refuse(why);
}

void CaptureWatcher::stopWatching() {
  if (observer_ != nullptr) observer_->detach(this);
  own_.reset();
}

}  // namespace graphtrees
