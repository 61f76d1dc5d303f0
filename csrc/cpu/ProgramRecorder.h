#pragma once

// Records the op program (cpu/OpProgram.h) of one run of a function on the calling thread.

#include "cpu/OpProgram.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/record_function.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace graphtrees {

class CpuPool;

// Note [Recording an op program]
// A thread-local RecordFunction observer sees every op the thread dispatches. Only top-level ops
// become steps: an op called from inside another op's kernel is that op's business (a depth
// count over dispatcher ops). Tensors are told apart by their TensorImpl: the recorder keeps a
// weak reference to each one it has seen, which keeps the identity (no other tensor can take the
// address) without keeping the tensor, or its memory, alive -- a strong one would change the
// allocation pattern being recorded. A tensor the recorder has not seen is
//   - a wrapped number (a Python number passed to an op): a constant;
//   - memory outside the pool: a tensor from outside the function, held by the program;
//   - memory in the pool: a tensor made while the function ran but not by an op (torch.tensor,
//     a pybind or ctypes call): the program cannot make it, so the recording keeps the Python
//     replay (the reason names the op).
// For the completeness proof (cpu/CpuGraph.cpp), the bytes of every storage that existed before
// the capture are saved the first time an op writes it (schema `Tensor(a!)`, and the c10d ops,
// which write without saying so).
class ProgramRecorder {
 public:
  // A storage the function wrote that it did not make.
  struct SavedStorage {
    c10::Storage storage;
    std::vector<uint8_t> before;  // its bytes before the first write
  };

  // Records while it lives. `inputs`: the graph's flat inputs. `allocations`: the capture's
  // allocation list and `pool` its pool; both nullptr for a trace (an eager run, compared with a
  // recorded program by OpProgram::firstDifference).
  ProgramRecorder(const std::vector<at::Tensor>& inputs, const std::vector<Allocation>* allocations,
                  const CpuPool* pool);
  ~ProgramRecorder();
  ProgramRecorder(const ProgramRecorder&) = delete;
  ProgramRecorder& operator=(const ProgramRecorder&) = delete;

  // Stops recording; the program, or nullptr with the reason in `why`.
  std::unique_ptr<OpProgram> finish(std::string* why);
  std::vector<SavedStorage>& savedStorages() { return saved_; }

 private:
  static std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn);
  static void onEnd(const at::RecordFunction& fn, at::ObserverContext* ctx);
  void start(const at::RecordFunction& fn);
  void end(const at::RecordFunction& fn);
  OpProgram::Arg argument(const c10::IValue& value, const c10::Argument& schema, bool writes);
  int32_t slotOf(const at::Tensor& t, bool writes);
  int32_t newSlot(const at::Tensor& t);
  void noteWrite(const at::Tensor& t);
  void fail(std::string why);

  std::unique_ptr<OpProgram> program_;
  const std::vector<Allocation>* allocations_;
  const CpuPool* pool_;
  std::unordered_map<const c10::TensorImpl*, int32_t> slots_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> seen_;  // Note [Recording an op program]
  std::unordered_set<uintptr_t> made_;  // the capture's allocations, as they are seen
  size_t made_seen_ = 0;
  std::unordered_set<const c10::StorageImpl*> saved_set_;
  std::vector<SavedStorage> saved_;
  std::string failure_;
  int depth_ = 0;
  ProgramRecorder* prev_;
  at::CallbackHandle handle_;
  at::RecordFunctionGuard enabled_{true};
};

}  // namespace graphtrees
