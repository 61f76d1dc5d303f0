#include "CopiedInputs.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>

namespace graphtrees {

void CopiedInputs::makePlaceholders(const std::vector<at::Tensor>& ins,
                                    const std::vector<InputKind>& kinds, Recording* rec) {
  for (size_t i = 0; i < ins.size(); ++i) {
    if (kinds[i] != InputKind::kCopied) continue;
    const at::Tensor& src = ins[i];
    // The placeholder keeps the caller's strides (a compiled graph was made for them), gaps
    // included (a slice such as tokens[:, :-1]); only an input whose elements overlap (an
    // expanded tensor) gets a contiguous placeholder, since nothing can be copied into it.
    rec->dense[i] = TreeNode::elementsDoNotOverlap(src) ? 1 : 0;
    // The same tensor as an earlier copied argument shares its placeholder (its signature
    // says so: FlatArgs::rekey); a replay copies it into that placeholder once per position.
    const auto same = std::find_if(rec->copied.begin(), rec->copied.end(), [&](int64_t j) {
      return ins[j].unsafeGetTensorImpl() == src.unsafeGetTensorImpl();
    });
    if (same != rec->copied.end()) {
      rec->dense[i] = rec->dense[*same];
      rec->inputs[i] = rec->inputs[*same];
      rec->copied.push_back(static_cast<int64_t>(i));
      continue;
    }
    at::Tensor ph = rec->dense[i] ? at::empty_strided(src.sizes(), src.strides(), src.options())
                                  : at::empty(src.sizes(), src.options());
    // A conjugate or negative view's placeholder is one too, so that its bytes are the
    // caller's and an output aliasing it reads the caller's memory the same way.
    if (src.is_conj()) ph.unsafeGetTensorImpl()->_set_conj(true);
    if (src.is_neg()) ph.unsafeGetTensorImpl()->_set_neg(true);
    ph.copy_(src);
    rec->inputs[i] = std::move(ph);
    rec->copied.push_back(static_cast<int64_t>(i));
  }
}

int64_t CopiedInputs::firstNotWrittenBack(const InputMutationCheck& mutations,
                                          const std::vector<at::Tensor>& ins,
                                          const std::vector<int64_t>& which, std::string* op,
                                          std::string* why, std::vector<size_t>* written_back) {
  if (mutations.watchedMutation()) return mutations.firstMutated(op);  // no version to tell
  const std::vector<int64_t> changed = mutations.versionMutated();
  for (size_t k = 0; k < which.size(); ++k) {
    const int64_t i = which[k];
    // A metadata op need not move the version counter; either change is a mutation.
    const bool metadata = mutations.metadataChanged(i);
    if (!metadata && std::find(changed.begin(), changed.end(), i) == changed.end()) continue;
    *why = metadata ? "its shape or strides changed in place (squeeze_, t_, resize_, as_strided_)"
                    : whyNotWrittenBack(ins, i);
    if (!why->empty()) return i;
    if (written_back != nullptr) written_back->push_back(k);
  }
  return -1;
}

std::string CopiedInputs::whyNotWrittenBack(const std::vector<at::Tensor>& ins, int64_t i) {
  const at::Tensor& t = ins[i];
  if (!t.has_storage()) return "it has no storage";
  if (t.requires_grad()) return "it requires grad";
  if (!TreeNode::elementsDoNotOverlap(t)) return "its elements overlap (an expanded tensor)";
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  for (size_t j = 0; j < ins.size(); ++j) {
    if (static_cast<int64_t>(j) == i || !ins[j].has_storage()) continue;
    if (ins[j].unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) continue;  // the same tensor
    if (ins[j].storage().unsafeGetStorageImpl() == storage) {
      return "it shares its memory with input #" + std::to_string(j);
    }
  }
  return "";
}

}  // namespace graphtrees
