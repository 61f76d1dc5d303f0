#include "InputPlan.h"

#include "TensorMeta.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>

#include <utility>

namespace graphtrees {

InputPlan InputPlan::record(const std::vector<at::Tensor>& ins, const std::vector<InputKind>& kinds,
                            const ArgumentAliases& aliases, std::vector<at::Tensor>* ran) {
  InputPlan plan;
  *ran = ins;
  plan.dense_.assign(ins.size(), 1);
  std::vector<int64_t> position_of(ins.size(), -1);  // flat index -> its position in copied_
  for (size_t i = 0; i < ins.size(); ++i) {
    if (kinds[i] != InputKind::kCopied) continue;
    const size_t k = plan.copied_.size();
    position_of[i] = static_cast<int64_t>(k);
    plan.copied_.push_back(static_cast<int64_t>(i));
    // The same tensor as an earlier argument shares its placeholder (Note [Argument aliases]:
    // every position of it is copied then).
    const size_t same = aliases.sameAs(i);
    if (same != i) {
      TORCH_INTERNAL_ASSERT(kinds[same] == InputKind::kCopied && position_of[same] >= 0,
                            "the positions of one tensor have different input kinds");
      const auto first = static_cast<size_t>(position_of[same]);
      plan.first_.push_back(first);
      plan.repeats_ = true;
      plan.dense_[i] = plan.dense_[same];
      plan.placeholders_.push_back(plan.placeholders_[first]);
      (*ran)[i] = plan.placeholders_[first];
      continue;
    }
    plan.first_.push_back(k);
    const at::Tensor& src = ins[i];
    // The placeholder keeps the caller's strides (a compiled graph was made for them), gaps
    // included (a slice such as tokens[:, :-1]); only an input whose elements overlap (an
    // expanded tensor) gets a contiguous placeholder, since nothing can be copied into it.
    plan.dense_[i] = elementsDoNotOverlap(src) ? 1 : 0;
    at::Tensor ph = plan.dense_[i] ? at::empty_strided(src.sizes(), src.strides(), src.options())
                                   : at::empty(src.sizes(), src.options());
    // A conjugate or negative view's placeholder is one too, so that its bytes are the caller's
    // and an output aliasing it reads the caller's memory the same way.
    if (src.is_conj()) ph.unsafeGetTensorImpl()->_set_conj(true);
    if (src.is_neg()) ph.unsafeGetTensorImpl()->_set_neg(true);
    ph.copy_(src);
    (*ran)[i] = ph;
    plan.placeholders_.push_back(std::move(ph));
  }
  return plan;
}

void InputPlan::setWriteBack(WriteBack decided) {
  write_back_ = std::move(decided);
  if (repeats_) write_back_.keepFirstOf(first_);
}

void InputPlan::detach(c10::Device device) {
  for (size_t k = 0; k < placeholders_.size(); ++k) {
    if (first_[k] != k) {
      placeholders_[k] = placeholders_[first_[k]];
      continue;
    }
    const at::Tensor& ph = placeholders_[k];
    placeholders_[k] = makeTensor(nonOwningStorage(reinterpret_cast<uintptr_t>(ph.storage().data()),
                                                   ph.storage().nbytes(), device),
                                  metaOf(ph));
  }
}

void InputPlan::copyIn(Backend& backend, const std::vector<at::Tensor>& sources) const {
  if (!repeats_) {
    copyReplayInputs(backend, placeholders_, sources);
    return;
  }
  std::vector<at::Tensor> dst, src;
  for (size_t k = 0; k < copied_.size(); ++k) {
    if (first_[k] != k) continue;
    dst.push_back(placeholders_[k]);
    src.push_back(sources[k]);
  }
  copyReplayInputs(backend, dst, src);
}

}  // namespace graphtrees
