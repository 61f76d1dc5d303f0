#include "InputMutationCheck.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>

#include <cstring>

namespace graphtrees {

std::string InputMutationCheck::reason(int64_t input, const std::string& op,
                                       const std::string& advice) {
  return "it mutates its input tensor #" + std::to_string(input) + " in place" +
         (op.empty() ? "" : " (" + op + ")") + "; a graph would mutate a private copy instead" +
         advice;
}

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
  metas_.reserve(which_.size());
  for (int64_t i : which_) {
    versions_.push_back(versionOf(tensors_[i]));
    metas_.push_back(
        {tensors_[i].sizes().vec(), tensors_[i].strides().vec(), tensors_[i].storage_offset()});
    if (!tensors_[i].has_storage()) continue;
    const c10::StorageImpl* storage = tensors_[i].storage().unsafeGetStorageImpl();
    if (tensors_[i].is_inference()) unversioned_.emplace(storage, i);
    watched_.emplace(storage, i);
  }
  if (watched_.empty()) return;
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

bool InputMutationCheck::metadataChanged(int64_t i) const {
  for (size_t k = 0; k < which_.size(); ++k) {
    if (which_[k] != i) continue;
    const at::Tensor& t = tensors_[i];
    return !t.sizes().equals(metas_[k].sizes) || !t.strides().equals(metas_[k].strides) ||
           t.storage_offset() != metas_[k].offset;
  }
  return false;
}

std::vector<int64_t> InputMutationCheck::versionMutated() const {
  std::vector<int64_t> out;
  for (size_t k = 0; k < which_.size(); ++k) {
    if (versions_[k] >= 0 && versionOf(tensors_[which_[k]]) != versions_[k]) {
      out.push_back(which_[k]);
    }
  }
  return out;
}

std::unique_ptr<at::ObserverContext> InputMutationCheck::onStart(const at::RecordFunction& fn) {
  if (InputMutationCheck* c = tls_check) c->check(fn);
  return nullptr;
}

namespace {
// c10d's in-place collectives: "c10d::allreduce_", "c10d::broadcast_", "c10d::_allgather_base_"...
bool isInPlaceCollective(const char* name) {
  const size_t n = std::strlen(name);
  return n > 7 && std::strncmp(name, "c10d::", 6) == 0 && name[n - 1] == '_';
}
}  // namespace

void InputMutationCheck::check(const at::RecordFunction& fn) {
  if (watched_mutation_ >= 0) return;
  const bool collective = isInPlaceCollective(fn.name());
  if (!collective && unversioned_.empty()) return;
  const auto schema = fn.operator_schema();
  if (!schema) return;
  const auto inputs = fn.inputs();
  const auto& args = schema->arguments();
  const auto& among = collective ? watched_ : unversioned_;
  auto written = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return false;
    auto it = among.find(t.storage().unsafeGetStorageImpl());
    if (it == among.end()) return false;
    watched_mutation_ = it->second;
    op_ = fn.name();
    return true;
  };
  auto anyWritten = [&](const c10::IValue& v) {
    if (v.isTensor()) return written(v.toTensor());
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        if (written(t)) return true;
      }
    } else if (v.isList()) {  // Tensor[][] (allgather_'s outputs)
      for (const c10::IValue& inner : v.toListRef()) {
        if (inner.isTensorList()) {
          for (const at::Tensor& t : inner.toTensorVector()) {
            if (written(t)) return true;
          }
        }
      }
    }
    return false;
  };
  if (collective) {  // the first argument is what it writes
    if (!inputs.empty()) anyWritten(inputs[0]);
    return;
  }
  for (size_t i = 0; i < args.size() && i < inputs.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (anyWritten(inputs[i])) return;
  }
}

}  // namespace graphtrees
