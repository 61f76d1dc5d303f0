#pragma once

// A CPU graph's op program: the top-level ATen and custom ops a function dispatched while it was
// recorded, replayed from C++ through the dispatcher (Note [CPU graphs] in cpu/CpuGraph.h).
// ProgramRecorder (cpu/ProgramRecorder.h) builds one.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
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
  struct Step {
    explicit Step(c10::OperatorHandle handle) : op(std::move(handle)) {}
    c10::OperatorHandle op;
    std::vector<Arg> args;
    // Per returned value: the slots its tensors go to (-1: a tensor the program knew already,
    // such as the `self` an in-place op returns).
    std::vector<std::vector<int32_t>> results;
    std::vector<size_t> waits;     // returned values that are c10d Work: waited for at once
    std::vector<int32_t> release;  // op-result slots whose last use is this op
    size_t alloc_begin = 0;        // the recording's allocation cursor before and after the op
    size_t alloc_end = 0;
  };

  size_t numOps() const { return steps_.size(); }
  // Runs the program on `inputs` (the call's flat inputs, placeholders substituted). `route`: the
  // replay routing (its cursor is set to each op's first recorded allocation, skipping the ones
  // Python made between ops), or nullptr.
  void run(const std::vector<at::Tensor>& inputs, RouteState* route,
           const std::string& function_name) const;
  // The first op of this (recorded) program whose name or non-tensor argument differs from
  // `eager`'s (a trace of the same function run eagerly on copies of the same inputs), described
  // for a user; empty if none does.
  std::string firstDifference(const OpProgram& eager) const;
  // "aten::mul.Tensor"
  static std::string opName(const Step& step);

 private:
  friend class ProgramRecorder;
  std::vector<Step> steps_;
  int32_t num_inputs_ = 0;
  int32_t num_slots_ = 0;
  std::vector<std::pair<int32_t, at::Tensor>> held_;  // tensors from outside, by slot
};

}  // namespace graphtrees
