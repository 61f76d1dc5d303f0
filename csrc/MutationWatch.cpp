#include "MutationWatch.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>

namespace graphtrees {

namespace {
thread_local MutationWatch* tls_watch = nullptr;
}  // namespace

MutationWatch::MutationWatch(std::unordered_map<const c10::StorageImpl*, int64_t> watched)
    : watched_(std::move(watched)),
      prev_(tls_watch),
      handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&MutationWatch::onStart)
                                             .needsInputs(true)
                                             .scopes({at::RecordScope::FUNCTION}))) {
  tls_watch = this;
}

MutationWatch::~MutationWatch() {
  tls_watch = prev_;
  at::removeCallback(handle_);
}

std::unique_ptr<at::ObserverContext> MutationWatch::onStart(const at::RecordFunction& fn) {
  if (MutationWatch* w = tls_watch) w->check(fn);
  return nullptr;
}

void MutationWatch::check(const at::RecordFunction& fn) {
  if (first_mutated_ >= 0) return;
  const auto schema = fn.operator_schema();
  if (!schema) return;
  const auto inputs = fn.inputs();
  const auto& args = schema->arguments();
  auto written = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return false;
    auto it = watched_.find(t.storage().unsafeGetStorageImpl());
    if (it == watched_.end()) return false;
    first_mutated_ = it->second;
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
