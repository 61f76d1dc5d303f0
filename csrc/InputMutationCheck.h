#pragma once

// Which of a function's inputs one run mutates in place. Version counters tell for ordinary
// tensors; tensors made under torch.inference_mode() have none, so for them the check watches,
// on the calling thread and while it lives, for ops whose schema writes to their storage (an
// argument annotated `Tensor(a!)`). In-place collectives (c10d::allreduce_ and the other
// `c10d::*_` ops) write their first argument without a version bump or a write annotation: they
// are watched for every input.

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

class InputMutationCheck {
 public:
  // Starts checking inputs `which` (flat indices into `tensors`).
  InputMutationCheck(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& which);
  ~InputMutationCheck();
  InputMutationCheck(const InputMutationCheck&) = delete;
  InputMutationCheck& operator=(const InputMutationCheck&) = delete;

  // After the run: the first input it mutated (a flat index) or -1; `op` names the op when the
  // schema watch saw it.
  int64_t firstMutated(std::string* op) const;
  // After the run: every input whose version counter moved, and whether a mutation was seen
  // only by the schema watch (an inference tensor, an in-place collective).
  std::vector<int64_t> versionMutated() const;
  bool watchedMutation() const { return watched_mutation_ >= 0; }
  // Whether input `i` (one of `which`) has other sizes, strides or offset than when the check
  // began: an in-place metadata op (squeeze_, t_, resize_, as_strided_).
  bool metadataChanged(int64_t i) const;
  // The eager reason for a function that mutated input `input` (by `op`, if known).
  static std::string reason(int64_t input, const std::string& op, const std::string& advice);

 private:
  static std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn);
  void check(const at::RecordFunction& fn);

  const std::vector<at::Tensor>& tensors_;
  std::vector<int64_t> which_;
  std::vector<int64_t> versions_;  // -1 for inference tensors
  struct Meta {
    std::vector<int64_t> sizes, strides;
    int64_t offset;
  };
  std::vector<Meta> metas_;  // parallel to which_
  std::unordered_map<const c10::StorageImpl*, int64_t> unversioned_;
  std::unordered_map<const c10::StorageImpl*, int64_t> watched_;  // every input, for collectives
  int64_t watched_mutation_ = -1;
  std::string op_;
  InputMutationCheck* prev_ = nullptr;
  std::optional<at::CallbackHandle> handle_;
  std::optional<at::RecordFunctionGuard> enabled_;
};

}  // namespace graphtrees
