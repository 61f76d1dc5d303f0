#include "CopiedInputs.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>

#include <c10/util/Exception.h>

namespace graphtrees {

void CopiedInputs::makePlaceholders(const std::vector<at::Tensor>& ins,
                                    const std::vector<InputKind>& kinds,
                                    const ArgumentAliases& aliases, Recording* rec) {
  for (size_t i = 0; i < ins.size(); ++i) {
    if (kinds[i] != InputKind::kCopied) continue;
    const at::Tensor& src = ins[i];
    // The placeholder keeps the caller's strides (a compiled graph was made for them), gaps
    // included (a slice such as tokens[:, :-1]); only an input whose elements overlap (an
    // expanded tensor) gets a contiguous placeholder, since nothing can be copied into it.
    rec->dense[i] = TreeNode::elementsDoNotOverlap(src) ? 1 : 0;
    // The same tensor as an earlier argument shares its placeholder (Note [Argument aliases]:
    // every position of it is copied then); a replay copies it in once per position.
    const size_t same = aliases.sameAs(i);
    if (same != i) {
      TORCH_INTERNAL_ASSERT(kinds[same] == InputKind::kCopied,
                            "the positions of one tensor have different input kinds");
      rec->dense[i] = rec->dense[same];
      rec->inputs[i] = rec->inputs[same];
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

}  // namespace graphtrees
