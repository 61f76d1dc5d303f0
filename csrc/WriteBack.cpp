#include "WriteBack.h"

#include "OwnSyncScope.h"
#include "TensorMeta.h"

#include <ATen/ops/equal.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace graphtrees {

namespace {

// The bytes of `t`'s elements, on the host, as a uint8 tensor with `t`'s strides and one more dim
// for the bytes of an element: compared bit for bit (NaNs, signed zeros). The range the elements
// span is copied as one contiguous block (a plain device-to-host copy, which the CUDA stand-in
// executes too: a device-side comparison is a kernel), then viewed there.
at::Tensor hostBytes(const at::Tensor& t) {
  const int64_t item = static_cast<int64_t>(t.itemsize());
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  TensorMeta range;
  range.sizes = {span * item};
  range.strides = {1};
  range.storage_offset = t.storage_offset() * item;
  range.dtype = c10::ScalarType::Byte;
  range.device = t.device();
  at::Tensor host;
  {
    OwnSyncScope own;  // Note [Syncs of graphtrees' own] in OwnSyncScope.cpp
    host = makeTensor(t.storage(), range).to(c10::Device(c10::DeviceType::CPU));
  }
  std::vector<int64_t> sizes = t.sizes().vec();
  std::vector<int64_t> strides = t.strides().vec();
  for (auto& s : strides) s *= item;
  sizes.push_back(item);
  strides.push_back(1);
  return host.as_strided(sizes, strides, host.storage_offset());
}

// Whether the run changed `ran`'s values away from `caller`'s (a write no op shows).
bool bytesDiffer(const at::Tensor& ran, const at::Tensor& caller) {
  if (!ran.has_storage() || !caller.has_storage() || ran.numel() == 0) return false;
  if (!elementsDoNotOverlap(ran) || ran.sizes() != caller.sizes() ||
      ran.strides() != caller.strides() || ran.itemsize() != caller.itemsize()) {
    return false;
  }
  return !at::equal(hostBytes(ran), hostBytes(caller));
}

// "" when input `i` of `callers` can be written back, else why not.
std::string whyNotWrittenBack(const std::vector<at::Tensor>& callers, int64_t i,
                              const ArgumentAliases& aliases) {
  const at::Tensor& t = callers[i];
  if (!t.has_storage()) return "it has no storage";
  if (t.requires_grad()) return "it requires grad";
  if (!elementsDoNotOverlap(t)) return "its elements overlap (an expanded tensor)";
  if (const int64_t other = aliases.sharesStorageWith(static_cast<size_t>(i)); other >= 0) {
    return "it shares its memory with input #" + std::to_string(other);
  }
  return "";
}

}  // namespace

std::string WriteBackRefusal::reason(const std::string& advice) const {
  return InputMutationCheck::reason(
      input, op,
      (why.empty() ? std::string()
                   : ", and the copy cannot be written back into it (" + why + ")") +
          advice);
}

WriteBack WriteBack::decide(const InputMutationCheck& mutations,
                            const std::vector<at::Tensor>& callers,
                            const std::vector<int64_t>& which, const ArgumentAliases& aliases,
                            const std::vector<at::Tensor>* ran, WriteBackRefusal* refused) {
  *refused = WriteBackRefusal();
  WriteBack out;
  if (mutations.watchedMutation()) {  // an inference tensor's or a collective's
    refused->input = mutations.firstMutated(&refused->op);
    return out;
  }
  std::vector<std::string> ops;
  const std::vector<int64_t> changed = mutations.mutated(&ops);
  for (size_t k = 0; k < which.size(); ++k) {
    const int64_t i = which[k];
    const auto found = std::find(changed.begin(), changed.end(), i);
    // A metadata op need not move the version counter; either change is a mutation.
    const bool metadata = mutations.metadataChanged(i);
    // A write no op shows (ctypes, a raw kernel): the placeholder no longer holds the caller's
    // values. Only the recording can tell (its run is on a copy).
    const bool unseen = found == changed.end() && !metadata && ran != nullptr &&
                        (*ran)[i].unsafeGetTensorImpl() != callers[i].unsafeGetTensorImpl() &&
                        bytesDiffer((*ran)[i], callers[i]);
    if (found == changed.end() && !metadata && !unseen) continue;
    const std::string why =
        metadata ? "its shape or strides changed in place (squeeze_, t_, resize_, as_strided_)"
                 : whyNotWrittenBack(callers, i, aliases);
    if (!why.empty()) {
      refused->input = i;
      refused->why = why;
      if (found != changed.end()) refused->op = ops[found - changed.begin()];
      return WriteBack();
    }
    out.inputs_.push_back(i);
    out.positions_.push_back(k);
  }
  return out;
}

void WriteBack::keepFirstOf(const std::vector<size_t>& first) {
  std::vector<int64_t> inputs;
  std::vector<size_t> positions;
  for (size_t n = 0; n < inputs_.size(); ++n) {
    const size_t k = first[positions_[n]];
    if (std::find(positions.begin(), positions.end(), k) != positions.end()) continue;
    // The first position's placeholder is the one shared, and its flat input the same tensor.
    inputs.push_back(inputs_[n]);
    positions.push_back(k);
  }
  inputs_ = std::move(inputs);
  positions_ = std::move(positions);
}

void WriteBack::apply(const std::vector<at::Tensor>& placeholders,
                      const std::vector<at::Tensor>& targets) const {
  for (size_t n = 0; n < inputs_.size(); ++n)
    targets[inputs_[n]].copy_(placeholders[positions_[n]]);
}

}  // namespace graphtrees
