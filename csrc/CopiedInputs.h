#pragma once

// The placeholders a recording copies its copied inputs into. What a run's mutations of them do
// is WriteBack's (Note [Copied inputs written back] in WriteBack.h).

#include "ArgumentAliases.h"
#include "TreeNode.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace graphtrees {

class CopiedInputs {
 public:
  // Fills rec->inputs, rec->dense and rec->copied: a placeholder in the pool (the caller must
  // route allocations there) for each input of kind kCopied, holding a copy of it. The positions
  // of one tensor share one placeholder (Note [Argument aliases]).
  static void makePlaceholders(const std::vector<at::Tensor>& ins,
                               const std::vector<InputKind>& kinds, const ArgumentAliases& aliases,
                               Recording* rec);
};

}  // namespace graphtrees
