#pragma once

// Records the op program (cpu/OpProgram.h) of one run of a function on the calling thread.

#include "CaptureObserver.h"
#include "RngStates.h"
#include "cpu/OpProgram.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/core/Generator.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace graphtrees {

class CpuPool;

// Note [Recording an op program]
// A watcher of the capture observer (Note [One capture observer] in CaptureObserver.h) is shown
// every op the thread dispatches. Only top-level ops (level 0) become steps: an op called from
// inside another op's kernel is that op's business -- except that a composite op's calls are the
// steps (the recorder sees through it: Note [Composite ops are recorded decomposed] in
// ProgramRecorder.cpp). Tensors are told apart by
// their TensorImpl: the recorder keeps a weak reference to each one it has seen, which keeps the
// identity (no other tensor can take the address) without keeping the tensor, or its memory,
// alive -- a strong one would change the allocation pattern being recorded. A tensor the
// recorder has not seen is
//   - a wrapped number (a Python number passed to an op): a constant;
//   - memory outside the pool: a tensor from outside the function, held by the program;
//   - memory in the pool: a tensor made while the function ran but not by an op (Tensor.data, a
//     pybind or ctypes call): the program cannot make it, so the recording keeps the Python
//     replay (the reason names the op). (torch.tensor() is made by aten::empty and filled by
//     Python: the proof catches it.)
// For the completeness proof (cpu/CpuGraph.cpp), the bytes of every storage that existed before
// the capture are saved the first time an op takes it (schemas do not always say what an op
// writes: aten::batch_norm updates its running statistics unsaid, c10d's in-place ops too), and
// kept if the run changed them (up to kSavedBytesLimit in all: past it the program is not
// proved); so is the state of every generator an op takes.
class ProgramRecorder : public CaptureWatcher {
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
  ~ProgramRecorder() override;

  // Stops recording; the program, or nullptr with the reason in `why`.
  std::unique_ptr<OpProgram> finish(std::string* why);
  std::vector<SavedStorage>& savedStorages() { return saved_; }
  // Why the program cannot be proved (empty if it can).
  const std::string& unproven() const { return unproven_; }
  static constexpr size_t kSavedBytesLimit = size_t{1} << 30;
  // Python code read or handed out tensor memory outside the dispatcher (`what`: "Tensor.numpy()")
  // on this thread: the recording there, if any, keeps the Python replay.
  static void noteUndispatchedAccess(const std::string& what);
  // The recorder of the calling thread's capture (or trace), or nullptr.
  static ProgramRecorder* current();
  // A torch.cond or torch.while_loop, recorded as one control step (Note [Control steps of a
  // program] in cpu/OpProgram.h) while the Python layer runs its arms (Note [Control flow in a
  // recording] in graphtrees/_control_flow.py): begin, the ops of arms[0], nextArm(), the ops of
  // arms[1], end. Mistakes fail the program (the recording keeps the Python replay).
  void beginCond(const at::Tensor& pred);
  void beginWhileLoop(const std::vector<at::Tensor>& carried);
  void nextArm();
  void endCond(const std::vector<at::Tensor>& outs0, const std::vector<at::Tensor>& outs1);
  void endWhileLoop(const at::Tensor& pred, const std::vector<at::Tensor>& body_outs);
  // While paused, ops are not steps (the iterations of a loop after the recorded one).
  void pause(bool paused) { paused_ += paused ? 1 : -1; }
  bool paused() const { return paused_ > 0; }
  // The generators its ops took as arguments (a closure's, say), with their states when first
  // seen: the proof rewinds them too.
  const RngStates& generatorStates() const { return generators_; }

 private:
  Descend onStart(const ObservedOp& op, int level) override;
  void onEnd(const ObservedOp& op, int level, Descend chosen) override;
  void recordStep(const at::RecordFunction& fn, const c10::OperatorHandle& handle);
  void recordResults(const at::RecordFunction& fn);
  void noteNestedWrites(const ObservedOp& op);
  void noteGenerator(const at::Generator& g);
  OpProgram::Arg argument(const c10::IValue& value);
  int32_t slotOf(const at::Tensor& t);
  int32_t newSlot(const at::Tensor& t);
  void noteWrite(const at::Tensor& t);
  void fail(std::string why);
  int32_t knownSlot(const at::Tensor& t, const char* what);
  bool madeInArm(int32_t slot, int arm) const;
  void endControl();

  struct OpenControl {
    std::shared_ptr<OpProgram::Control> control;
    std::vector<OpProgram::Step>* parent;
    int arm = 0;
    int32_t first_slot[3] = {0, 0, 0};  // slots made in arm a: [first_slot[a], first_slot[a+1])
  };
  std::vector<std::unique_ptr<OpenControl>> open_;
  std::vector<OpProgram::Step>* target_ =
      nullptr;  // where steps go: the program's, or an open arm's
  int paused_ = 0;

  std::unique_ptr<OpProgram> program_;
  const std::vector<Allocation>* allocations_;
  const CpuPool* pool_;
  std::unordered_map<const c10::TensorImpl*, int32_t> slots_;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> seen_;  // Note [Recording an op program]
  std::unordered_set<uintptr_t> made_;  // the capture's allocations, as they are seen
  size_t made_seen_ = 0;
  std::unordered_set<const c10::StorageImpl*> saved_set_;
  std::vector<SavedStorage> saved_;
  size_t saved_bytes_ = 0;
  std::string unproven_;
  RngStates generators_;
  std::string failure_;
  ProgramRecorder* prev_;  // for noteUndispatchedAccess(), which no op shows
};

}  // namespace graphtrees
