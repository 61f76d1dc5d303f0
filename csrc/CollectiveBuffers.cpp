#include "CollectiveBuffers.h"

#include <ATen/core/Tensor.h>

#include <cstring>

namespace graphtrees {

bool CollectiveBuffers::isCollective(const char* op) {
  return std::strncmp(op, "c10d::", 6) == 0 || std::strncmp(op, "_c10d_functional::", 18) == 0 ||
         std::strncmp(op, "c10d_functional::", 17) == 0;
}

Descend CollectiveBuffers::onStart(const ObservedOp& op, int /*level*/) {
  if (!isCollective(op.fn.name())) return Descend::kNested;
  auto note = [this](const at::Tensor& t) {
    if (t.defined() && t.has_storage())
      ptrs_.insert(reinterpret_cast<uintptr_t>(t.storage().data()));
  };
  for (const c10::IValue& v : op.fn.inputs()) {
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
  return Descend::kNested;
}

CollectiveBuffers::CollectiveBuffers(bool active)
    : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/false}) {
  if (active) startWatching();
}

CollectiveBuffers::~CollectiveBuffers() {
  stopWatching();
}

}  // namespace graphtrees
