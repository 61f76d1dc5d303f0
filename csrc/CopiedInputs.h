#pragma once

// The inputs a recording copies into placeholders, and the ones it copies back.
//
// Note [Copied inputs written back]
// A function that mutates an input graphtrees copies (x.add_(y) on an argument) would mutate
// the graph's private placeholder: the caller's tensor would keep its old values. Instead the
// recording notes which placeholders the capture mutated (their version counters moved), and
// the recording call and every replay copy those placeholders back into the caller's tensors
// (one device copy each), so that the caller sees what eager execution leaves. It needs a
// tensor a copy can fill (no overlapping elements) that shares its storage with no other
// input (eagerly, a mutation through one would show through the other) and a mutation a
// version counter shows, of its values only: a tensor made under inference_mode (no counter),
// an in-place collective, or a change of its shape or strides (squeeze_, t_) still makes the
// function run eagerly, with the reason. Both the warmup (on the
// caller's tensors) and the capture (on the placeholders) check. PyTorch's trees run such
// graphs eagerly.

#include "InputMutationCheck.h"
#include "TreeNode.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace graphtrees {

class CopiedInputs {
 public:
  // Fills rec->inputs, rec->dense and rec->copied: a placeholder in the pool (the caller must
  // route allocations there) for each input of kind kCopied, holding a copy of it.
  static void makePlaceholders(const std::vector<at::Tensor>& ins,
                               const std::vector<InputKind>& kinds, Recording* rec);

  // After a run that `mutations` watched over inputs `which` of the run's tensors: the first of
  // them it mutated in a way that cannot be written back into `ins` (the caller's tensors at the
  // same positions), or -1, with `*op` and `*why` saying how. `written_back` (if given) gets the
  // positions in `which` of the mutated inputs that can be.
  static int64_t firstNotWrittenBack(const InputMutationCheck& mutations,
                                     const std::vector<at::Tensor>& ins,
                                     const std::vector<int64_t>& which, std::string* op,
                                     std::string* why, std::vector<size_t>* written_back);

  // "" when input `i` of `ins` can be written back, else why not.
  static std::string whyNotWrittenBack(const std::vector<at::Tensor>& ins, int64_t i);
};

}  // namespace graphtrees
