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
int64_t versionOf(const at::Tensor& t) {
  return t.is_inference() ? -1 : static_cast<int64_t>(t._version());
}
}  // namespace

InputMutationCheck::InputMutationCheck(const std::vector<at::Tensor>& tensors,
                                       const std::vector<int64_t>& which)
    : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/false}), tensors_(tensors), which_(which) {
  versions_.reserve(which_.size());
  metas_.reserve(which_.size());
  written_by_.resize(which_.size());
  for (size_t k = 0; k < which_.size(); ++k) {
    const at::Tensor& t = tensors_[which_[k]];
    versions_.push_back(versionOf(t));
    metas_.push_back({t.sizes().vec(), t.strides().vec(), t.storage_offset()});
    if (!t.has_storage()) continue;
    watched_[t.storage().unsafeGetStorageImpl()].push_back(k);
  }
  if (!watched_.empty()) startWatching();
}

InputMutationCheck::~InputMutationCheck() {
  stopWatching();
}

int64_t InputMutationCheck::firstMutated(std::string* op) const {
  if (watched_mutation_ >= 0) {
    *op = op_;
    return watched_mutation_;
  }
  for (size_t k = 0; k < which_.size(); ++k) {
    if (versions_[k] >= 0 && versionOf(tensors_[which_[k]]) != versions_[k]) return which_[k];
    if (!written_by_[k].empty()) {
      *op = written_by_[k];
      return which_[k];
    }
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

std::vector<int64_t> InputMutationCheck::mutated(std::vector<std::string>* ops) const {
  std::vector<int64_t> out;
  for (size_t k = 0; k < which_.size(); ++k) {
    const bool counter = versions_[k] >= 0 && versionOf(tensors_[which_[k]]) != versions_[k];
    if (!counter && written_by_[k].empty()) continue;
    out.push_back(which_[k]);
    if (ops != nullptr) ops->push_back(counter ? std::string() : written_by_[k]);
  }
  return out;
}

Descend InputMutationCheck::onStart(const ObservedOp& op, int /*level*/) {
  check(op);
  return Descend::kNested;
}

namespace {
// c10d's in-place collectives: "c10d::allreduce_", "c10d::broadcast_", "c10d::_allgather_base_"...
bool isInPlaceCollective(const char* name) {
  const size_t n = std::strlen(name);
  return n > 7 && std::strncmp(name, "c10d::", 6) == 0 && name[n - 1] == '_';
}
}  // namespace

void InputMutationCheck::check(const ObservedOp& op) {
  if (watched_mutation_ >= 0) return;
  const at::RecordFunction& fn = op.fn;
  const bool collective = isInPlaceCollective(fn.name());
  const auto inputs = fn.inputs();
  if (inputs.empty()) return;
  // Marks the watched inputs over `t`'s storage written by this op; an inference tensor's write,
  // or a collective's, cannot be written back (watched_mutation_).
  auto written = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    auto it = watched_.find(t.storage().unsafeGetStorageImpl());
    if (it == watched_.end()) return;
    for (size_t k : it->second) {
      if (collective || tensors_[which_[k]].is_inference()) {
        watched_mutation_ = which_[k];
        op_ = fn.name();
        return;
      }
      if (written_by_[k].empty()) written_by_[k] = fn.name();
    }
  };
  auto anyWritten = [&](const c10::IValue& v) {
    if (v.isTensor()) {
      written(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) written(t);
    } else if (v.isList()) {  // Tensor[][] (allgather_'s outputs)
      for (const c10::IValue& inner : v.toListRef()) {
        if (inner.isTensorList()) {
          for (const at::Tensor& t : inner.toTensorVector()) written(t);
        }
      }
    }
  };
  if (collective) {  // the first argument is what it writes
    anyWritten(inputs[0]);
    return;
  }
  const auto& handle = op.handle();  // the schema, not a copy of it (operator_schema())
  if (!handle) return;
  const auto& args = handle->schema().arguments();
  for (size_t i = 0; i < args.size() && i < inputs.size() && watched_mutation_ < 0; ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    anyWritten(inputs[i]);
  }
}

}  // namespace graphtrees
