#pragma once

// Watches, on the calling thread and while it lives, for ops that write to given input storages,
// from the ops' own schemas (an argument annotated as written, `Tensor(a!)`). Used during warmups
// for inputs that have no version counter to compare: tensors made under torch.inference_mode().

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <unordered_map>

namespace graphtrees {

class MutationWatch {
 public:
  // `watched`: storage -> the flat input index it belongs to.
  explicit MutationWatch(std::unordered_map<const c10::StorageImpl*, int64_t> watched);
  ~MutationWatch();
  MutationWatch(const MutationWatch&) = delete;
  MutationWatch& operator=(const MutationWatch&) = delete;

  // The first watched input an op wrote to, or -1.
  int64_t firstMutated() const { return first_mutated_; }
  // The op that wrote to it ("aten::add_").
  const std::string& mutatingOp() const { return op_; }

 private:
  static std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn);
  void check(const at::RecordFunction& fn);

  std::unordered_map<const c10::StorageImpl*, int64_t> watched_;
  int64_t first_mutated_ = -1;
  std::string op_;
  MutationWatch* prev_;
  at::CallbackHandle handle_;
  at::RecordFunctionGuard enabled_{true};
};

}  // namespace graphtrees
