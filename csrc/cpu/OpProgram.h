#pragma once

// A CPU graph's op program: the top-level ATen and custom ops a function dispatched while it was
// recorded, replayed from C++ through the dispatcher (Note [CPU graphs] in cpu/CpuGraph.h).
// ProgramRecorder (cpu/ProgramRecorder.h) builds one.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace graphtrees {

struct RouteState;

// Note [Values of an op program]
// Every tensor a program touches is a slot: slots [0, num_inputs) are the graph's flat inputs (a
// replay fills them with the call's inputs, placeholders substituted); then come the tensors from
// outside the function that its ops read (parameters, buffers, constants it closed over: the
// program holds them) and one per tensor an op returned that the program had not seen, numbered
// in the order the recording met them.
// Everything else in an op's arguments is a constant, baked exactly as a CUDA graph bakes it --
// including Python numbers, which reach ATen as "wrapped number" tensors made outside the
// dispatcher (the program holds its own copy). A replay drops each op result after its last use,
// which is never later than the recording did, so its allocations, answered at the recorded
// addresses, never overlap a value that is still alive.
class OpProgram {
 public:
  struct Arg {
    enum class Kind : uint8_t { kConstant, kSlot, kSlotList, kOptionalSlotList };
    Kind kind = Kind::kConstant;
    c10::IValue constant;        // kConstant (a wrapped number: its own tensor)
    c10::IValue shown;           // what the value was, for diagnostics (a wrapped number's value)
    std::vector<int32_t> slots;  // kSlot: one; lists: one per element (-1: None)
  };
  struct Control;
  struct Step {
    explicit Step(c10::OperatorHandle handle) : op(std::move(handle)) {}
    explicit Step(std::shared_ptr<const Control> c) : control(std::move(c)) {}
    std::optional<c10::OperatorHandle> op;  // none: a control step
    std::shared_ptr<const Control> control;
    std::vector<Arg> args;
    // Per returned value: the slots its tensors go to (-1: a tensor the program knew already,
    // such as the `self` an in-place op returns).
    std::vector<std::vector<int32_t>> results;
    std::vector<size_t> waits;     // returned values that are c10d Work: waited for at once
    std::vector<int32_t> release;  // op-result slots whose last use is this op
    size_t alloc_begin = 0;        // the recording's allocation cursor before and after the op
    size_t alloc_end = 0;
  };
  // Note [Control steps of a program]
  // torch.cond and torch.while_loop inside a recording (Note [Control flow in a recording] in
  // graphtrees/_control_flow.py) are one step each, holding sub-programs over the same slots:
  //   kCond: arms[0] the true branch, arms[1] the false one. A replay reads slot `pred` (a value
  //     an earlier step made, read on the host: on CPU that is what a conditional node's kernel
  //     does on the device) and runs one arm. The step's results are the slots `outs[0]` (what
  //     arms[0] returned); when arms[1] runs, its results `outs[1]` are copied to where arms[0]'s
  //     lay when recorded (`homes`), as a CUDA IF/ELSE node's else-branch copies into the
  //     if-branch's outputs, so that later steps and the graph's outputs find them there.
  //   kWhileLoop: arms[0] computes the predicate (slot `pred`), arms[1] the body; while the
  //     predicate holds, the body runs and its results `outs[1]` are copied into the carried
  //     slots `carried` (clones the recording made before the loop). Each iteration's allocations
  //     are answered at the addresses of the one recorded iteration: all of them are dead by the
  //     end of an iteration, as they were when recorded.
  // Slots made inside an arm are dropped inside it after their last use there, except the
  // results the step hands on (outs[0] of a cond).
  //
  // Note [Arms a recording did not run]
  // A recording ran every arm (the warmup of each, Note [Control flow in a recording]), but the
  // proof (proveProgram in cpu/CpuGraph.cpp) replays the program on the recording's inputs, which
  // take one arm of each cond and may make no trip of a loop: an arm whose work bypassed the
  // dispatcher (a torch.tensor([...]) constant, filled by Python) would replay unproven, and a
  // later call taking it would read memory no op wrote. So the proof also runs, in each of its
  // runs over memory filled with different bytes, the arm each cond does not take (before the
  // one it takes, at the arm's recorded addresses, every generator the program takes held) and
  // the body of a loop that makes no trip, and keeps copies of their results: results that
  // differ from one run to the next read memory no op wrote, and the node keeps the Python
  // replay. Inside such an arm a loop runs its cond and body once at most, as it did when
  // recorded (on values no call gives it, it might never end).
  struct Home {
    void* data;
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    at::ScalarType dtype;
  };
  struct Control {
    enum class Kind : uint8_t { kCond, kWhileLoop };
    Kind kind = Kind::kCond;
    int32_t pred = -1;
    std::vector<Step> arms[2];
    std::vector<int32_t> outs[2];
    std::vector<Home> homes;       // kCond: where outs[0] lay when recorded
    std::vector<int32_t> carried;  // kWhileLoop
    std::vector<int32_t> drop[2];  // arm-made slots handed out of the arm, dropped after it
  };

  size_t numOps() const { return steps_.size(); }
  // Runs the program on `inputs` (the call's flat inputs, placeholders substituted). `route`: the
  // replay routing (its cursor is set to each op's first recorded allocation, skipping the ones
  // Python made between ops), or nullptr.
  // The proof's run (Note [Arms a recording did not run]).
  struct Proof {
    std::vector<at::Generator> generators;  // put back after an untaken arm (the default included)
    std::vector<at::Tensor> untaken;        // copies of the untaken arms' results, in order
    int depth = 0;                          // untaken arms open around the step running
  };
  // `proof`: the arms the call does not take run too (Proof).
  void run(const std::vector<at::Tensor>& inputs, RouteState* route,
           const std::string& function_name, Proof* proof = nullptr) const;
  // The first op of this (recorded) program whose name or non-tensor argument differs from
  // `eager`'s (a trace of the same function run eagerly on copies of the same inputs), described
  // for a user; empty if none does.
  std::string firstDifference(const OpProgram& eager) const;
  // "aten::mul.Tensor"
  static std::string opName(const Step& step);
  // The kinds of its control steps, outermost first ("cond", "while_loop").
  std::vector<std::string> controlKinds() const;

 private:
  friend class ProgramRecorder;
  void runSteps(const std::vector<Step>& steps, std::vector<at::Tensor>& values,
                torch::jit::Stack& stack, RouteState* route, const std::string& function_name,
                Proof* proof) const;
  void runControl(const Control& c, std::vector<at::Tensor>& values, torch::jit::Stack& stack,
                  RouteState* route, const std::string& function_name, Proof* proof) const;
  std::vector<Step> steps_;
  int32_t num_inputs_ = 0;
  int32_t num_slots_ = 0;
  std::vector<std::pair<int32_t, at::Tensor>> held_;  // tensors from outside, by slot
};

// The value of a one-element CPU tensor as a condition, read in place (no op dispatched).
bool readPredicate(const at::Tensor& pred);

}  // namespace graphtrees
