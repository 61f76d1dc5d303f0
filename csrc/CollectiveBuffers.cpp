#include "CollectiveBuffers.h"

#include <ATen/core/Tensor.h>

#include <cstring>

namespace graphtrees {

namespace {

thread_local CollectiveBuffers* tls_buffers = nullptr;

}  // namespace

bool CollectiveBuffers::isCollective(const char* op) {
  return std::strncmp(op, "c10d::", 6) == 0 || std::strncmp(op, "_c10d_functional::", 18) == 0 ||
         std::strncmp(op, "c10d_functional::", 17) == 0;
}

std::unique_ptr<at::ObserverContext> CollectiveBuffers::onStart(const at::RecordFunction& fn) {
  CollectiveBuffers* self = tls_buffers;
  if (self == nullptr || !isCollective(fn.name())) return nullptr;
  auto note = [self](const at::Tensor& t) {
    if (t.defined() && t.has_storage()) {
      self->ptrs_.insert(reinterpret_cast<uintptr_t>(t.storage().data()));
    }
  };
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      note(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) note(t);
    } else if (v.isList()) {  // a list of tensor lists (all_gather's outputs)
      for (const c10::IValue& inner : v.toListRef()) {
        if (inner.isTensorList()) {
          for (const at::Tensor& t : inner.toTensorList().vec()) note(t);
        }
      }
    }
  }
  return nullptr;
}

CollectiveBuffers::CollectiveBuffers(bool active) : active_(active) {
  if (!active_) return;
  prev_ = tls_buffers;
  tls_buffers = this;
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&CollectiveBuffers::onStart)
                                           .needsInputs(true)
                                           .needsOutputs(false)
                                           .scopes({at::RecordScope::FUNCTION}));
}

CollectiveBuffers::~CollectiveBuffers() {
  if (!active_) return;
  at::removeCallback(handle_);
  tls_buffers = prev_;
}

}  // namespace graphtrees
