#pragma once

// The one owner of the write-back of mutated copied inputs: the decision (which inputs a run
// mutated, and whether each can be written back), and its execution after the recording's run and
// after each replay, into the tensors the caller holds.
//
// Note [Copied inputs written back]
// A function that mutates an input graphtrees copies (x.add_(y) on an argument) would mutate
// the graph's private placeholder: the caller's tensor would keep its old values. Instead the
// recording notes which placeholders the capture mutated, and the recording call and every replay
// copy those placeholders back into the caller's tensors (one device copy each), so that the
// caller sees what eager execution leaves. A run mutated an input when
//   - its version counter moved (x.add_, out=, a view's in-place op);
//   - an op whose schema writes it (an argument annotated `Tensor(a!)`) took a tensor over its
//     storage: a torch.library op whose kernel is C++, Triton or Python below autograd, a write
//     through x.data or a DLPack alias -- none of which moves the input's counter
//     (InputMutationCheck watches every copied input's storage);
//   - (a recording) the placeholder's bytes differ from the caller's after the run: a write no op
//     shows (ctypes through data_ptr(), a raw kernel launch).
// It needs a tensor a copy can fill (no overlapping elements) that is the only tensor over its
// storage among the inputs (Note [Argument aliases]: eagerly a mutation through one would show
// through the other during the run), and a mutation of its values only: a tensor made under
// inference_mode (no counter, and no copy into it outside inference mode), an in-place
// collective, or a change of its shape or strides (squeeze_, t_) makes the function run eagerly,
// with the reason. Both the warmup (on the caller's tensors) and the capture (on the
// placeholders) decide. PyTorch's trees run such graphs eagerly.
//
// Where it goes (Note [The inputs a run uses] in TreeManager.h): a restore or a replay's
// footprint may reach an input that is a live pool output. One that is invalidated is read
// through a clone first, and the clone is what the write-back fills (outputs aliasing the input
// alias it). One that on_overwrite="copy" migrates out of the pool is rebound in place, keeps its
// values and stays the caller's: the run reads it there and the write-back fills it, as eagerly
// (InputPlan::writeBack()).

#include "ArgumentAliases.h"
#include "InputMutationCheck.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace graphtrees {

// Why a mutated input cannot be written back: the function runs eagerly.
struct WriteBackRefusal {
  int64_t input = -1;  // flat index; -1: nothing refused
  std::string op;      // the op that mutated it, when the schema watch saw it
  std::string why;     // why the copy cannot be written back ("" when the mutation is the reason)
  bool refused() const { return input >= 0; }
  // The function's eager reason.
  std::string reason(const std::string& advice) const;
};

class WriteBack {
 public:
  WriteBack() = default;

  // After a run watched by `mutations` over inputs `which` (flat indices; a capture's copied
  // inputs, in order): the inputs it mutated, to be written back into `callers` (the caller's
  // tensors at the same flat positions). `ran`: what the run used at each flat position (the
  // placeholders of a capture), compared bytewise with `callers` when `compare_bytes`; nullptr
  // for a warmup, which ran on `callers`. When one cannot be written back, `*refused` says which
  // and why, and nothing is returned.
  static WriteBack decide(const InputMutationCheck& mutations,
                          const std::vector<at::Tensor>& callers, const std::vector<int64_t>& which,
                          const ArgumentAliases& aliases, const std::vector<at::Tensor>* ran,
                          WriteBackRefusal* refused);

  // Whether a capture's run mutated any input (decide() with `ran`: to write back or refused).
  static bool mutatedAny(const InputMutationCheck& mutations,
                         const std::vector<at::Tensor>& callers, const std::vector<int64_t>& which,
                         const ArgumentAliases& aliases, const std::vector<at::Tensor>& ran,
                         WriteBackRefusal* refused) {
    return !decide(mutations, callers, which, aliases, &ran, refused).empty() || refused->refused();
  }

  bool empty() const { return inputs_.empty(); }
  size_t size() const { return inputs_.size(); }

  // Copies each written-back input's placeholder (`placeholders`, parallel to `copied` of the
  // decision's `which`) into `targets` (per flat input).
  void apply(const std::vector<at::Tensor>& placeholders,
             const std::vector<at::Tensor>& targets) const;
  // Keeps one entry per tensor: `first[k]` is the first position in `which` holding the same
  // tensor as position k (InputPlan's alias rule, Note [A call's inputs] in InputPlan.h).
  void keepFirstOf(const std::vector<size_t>& first);

 private:
  std::vector<int64_t> inputs_;    // flat indices of the inputs written back
  std::vector<size_t> positions_;  // parallel: their positions in `which` (a placeholder each)
};

}  // namespace graphtrees
