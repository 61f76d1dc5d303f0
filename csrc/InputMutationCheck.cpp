#include "InputMutationCheck.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>

namespace graphtrees {

namespace {
thread_local InputMutationCheck* tls_check = nullptr;

int64_t versionOf(const at::Tensor& t) {
  return t.is_inference() ? -1 : static_cast<int64_t>(t._version());
}
}  // namespace

InputMutationCheck::InputMutationCheck(const std::vector<at::Tensor>& tensors,
                                       const std::vector<int64_t>& which)
    : tensors_(tensors), which_(which) {
  versions_.reserve(which_.size());
  for (int64_t i : which_) {
    versions_.push_back(versionOf(tensors_[i]));
    if (tensors_[i].is_inference()) {
      unversioned_.emplace(tensors_[i].storage().unsafeGetStorageImpl(), i);
    }
  }
  if (unversioned_.empty()) return;
  enabled_.emplace(true);  // observe even where RecordFunction is switched off
  handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&InputMutationCheck::onStart)
                                           .needsInputs(true)
                                           .scopes({at::RecordScope::FUNCTION}));
  prev_ = tls_check;
  tls_check = this;
}

InputMutationCheck::~InputMutationCheck() {
  if (!handle_) return;
  tls_check = prev_;
  at::removeCallback(*handle_);
}

int64_t InputMutationCheck::firstMutated(std::string* op) const {
  if (watched_mutation_ >= 0) {
    *op = op_;
    return watched_mutation_;
  }
  for (size_t k = 0; k < which_.size(); ++k) {
    if (versions_[k] >= 0 && versionOf(tensors_[which_[k]]) != versions_[k]) return which_[k];
  }
  return -1;
}

std::unique_ptr<at::ObserverContext> InputMutationCheck::onStart(const at::RecordFunction& fn) {
  if (InputMutationCheck* c = tls_check) c->check(fn);
  return nullptr;
}

void InputMutationCheck::check(const at::RecordFunction& fn) {
  if (watched_mutation_ >= 0) return;
  const auto schema = fn.operator_schema();
  if (!schema) return;
  const auto inputs = fn.inputs();
  const auto& args = schema->arguments();
  auto written = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return false;
    auto it = unversioned_.find(t.storage().unsafeGetStorageImpl());
    if (it == unversioned_.end()) return false;
    watched_mutation_ = it->second;
    op_ = fn.name();
    return true;
  };
  for (size_t i = 0; i < args.size() && i < inputs.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const c10::IValue& v = inputs[i];
    if (v.isTensor()) {
      if (written(v.toTensor())) return;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        if (written(t)) return;
      }
    }
  }
}

}  // namespace graphtrees
