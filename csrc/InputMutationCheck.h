#pragma once

// Which of a function's inputs one run mutates in place. Version counters tell for ordinary
// tensors. Writes that move no counter -- a torch.library op whose kernel is C++, Triton or
// below autograd, a write through x.data or a DLPack alias, any tensor made under
// torch.inference_mode() -- are seen, on the calling thread and while the check lives, by the ops
// whose schema writes to an input's storage (an argument annotated `Tensor(a!)`): every watched
// input's storage is watched. In-place collectives (c10d::allreduce_ and the other `c10d::*_`
// ops) write their first argument without a version bump or a write annotation: they are watched
// for every input too. Writes no op shows at all (ctypes through data_ptr()) are WriteBack's to
// find (Note [Copied inputs written back] in WriteBack.h).

#include "CaptureObserver.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

// A watcher of the capture observer (Note [One capture observer] in CaptureObserver.h), shown
// every op, nested ones included.
class InputMutationCheck : public CaptureWatcher {
 public:
  // Starts checking inputs `which` (flat indices into `tensors`).
  InputMutationCheck(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& which);
  ~InputMutationCheck() override;
  InputMutationCheck(const InputMutationCheck&) = delete;
  InputMutationCheck& operator=(const InputMutationCheck&) = delete;

  // After the run: the first input it mutated (a flat index) or -1; `op` names the op when the
  // schema watch saw it.
  int64_t firstMutated(std::string* op) const;
  // After the run: every input it mutated (its version counter moved, or an op's schema wrote
  // its storage), in `which` order; `op` (if given) gets the op that wrote each, "" where the
  // counter told.
  std::vector<int64_t> mutated(std::vector<std::string>* ops = nullptr) const;
  // Whether a mutation cannot be written back whatever the input: an inference tensor's (no copy
  // into it outside inference mode) or an in-place collective's.
  bool watchedMutation() const { return watched_mutation_ >= 0; }
  // Whether input `i` (one of `which`) has other sizes, strides or offset than when the check
  // began: an in-place metadata op (squeeze_, t_, resize_, as_strided_).
  bool metadataChanged(int64_t i) const;
  // The eager reason for a function that mutated input `input` (by `op`, if known).
  static std::string reason(int64_t input, const std::string& op, const std::string& advice);

 private:
  Descend onStart(const ObservedOp& op, int level) override;
  void check(const ObservedOp& op);

  const std::vector<at::Tensor>& tensors_;
  std::vector<int64_t> which_;
  std::vector<int64_t> versions_;  // -1 for inference tensors
  struct Meta {
    std::vector<int64_t> sizes, strides;
    int64_t offset;
  };
  std::vector<Meta> metas_;  // parallel to which_
  // Every watched input's storage, with the inputs over it (positions in which_).
  std::unordered_map<const c10::StorageImpl*, std::vector<size_t>> watched_;
  std::vector<std::string> written_by_;  // parallel to which_: the op whose schema wrote it
  int64_t watched_mutation_ = -1;        // an inference tensor or a collective's (a flat index)
  std::string op_;
};

}  // namespace graphtrees
