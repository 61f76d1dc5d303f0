#pragma once

// The C++ side of torch.cond and torch.while_loop run by graphtrees' Python layer inside a warmup,
// a recording or a Python replay (Note [Control flow in a recording] in
// graphtrees/_control_flow.py): the events that make a CPU program's control steps (Note [Control
// steps of a program] in cpu/OpProgram.h), the predicate read in place, the pause of the routing
// and the recording around a loop's unrecorded iterations, and the RNG kept around an untaken arm.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace graphtrees {

// `event`, with its tensors:
//   "begin_cond" [pred] | "begin_while_loop" carried | "next_arm" | "end_cond" outs0, outs1 |
//   "end_while_loop" [pred], body_outs -- recorded by the thread's program recorder, if any;
//   "pause" / "resume" -- ops are neither steps nor routed into the pool in between (nested);
//   "hold_rng" [a tensor on the device] / "restore_rng" -- the device's default generator and
//   those the ops in between take (Note [Generators an untaken arm draws from]).
//   "watch_generators" / "generators_taken" -- whether the ops in between took a generator as an
//   argument (what the second returns).
// Returns whether a program recorder saw it.
bool cpuControlFlowEvent(const std::string& event, const std::vector<at::Tensor>& first,
                         const std::vector<at::Tensor>& second);

// A one-element CPU tensor read as a condition in place, without dispatching an op.
bool cpuControlFlowPredicate(const at::Tensor& pred);

}  // namespace graphtrees
