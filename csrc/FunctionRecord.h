#pragma once

// What a tree knows of a graphed function: its identity and options (FunctionRecord, owned by the
// wrapper, one per call signature), its state in one tree (FunctionState, CallableState), and
// what one call did (CallResult).

#include "ArgumentAliases.h"
#include "Backend.h"
#include "DrawnGenerators.h"
#include "GraphOptions.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

// Per wrapped callable (all its signatures), per tree: when it last ran, for Note [Ending a path].
struct CallableState {
  int64_t last_generation = -1;
  int runs_in_generation = 0;
};

// Per function, per tree.
struct FunctionState {
  int warmups = 0;
  int rerecords = 0;
  // Note [Out of memory]: num_evictions of the tree when a warmup or recording of this function
  // ran out of memory (-1: it did not); it tries again once an eviction happened since.
  int64_t oom_at_evictions = -1;
  // Or, under a memory budget on a backend whose pool gives nothing back (CUDA): the tree's
  // budget epoch then; it tries again once the budget changed (or after reset()).
  int64_t oom_at_budget = -1;
  std::string oom_reason;
  // The generators on the tree's device its warmups drew from that are not arguments (Note
  // [Generators a function reaches itself] in DrawnGenerators.cpp); weak references.
  std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>> drawn_generators;
};

// What a function is in a training step (see Note [Pending backward]).
enum class FunctionMode : uint8_t { kInference, kForward, kBackward };

// One function of the tree: a wrapped callable with one call signature. Owned by the wrapper;
// a tree refers to it by id only, so a wrapper may die while its recordings stay in the tree.
// Several trees (one per thread) may run it; what is per tree lives in the tree.
struct FunctionRecord {
  int64_t id = 0;
  int64_t callable_id = 0;  // shared by every signature of one wrapped callable
  FunctionMode mode = FunctionMode::kInference;
  // Whether its runs open (a forward) or close (a backward) a pending backward: false for every
  // piece of a split graph but one (Note [Pending backward]).
  bool counts_pending = true;
  std::string name;
  // Per flat input: used in place (static_argnums, a module's tensors, and every other position
  // of such a tensor: ArgumentAliases::inPlace()).
  std::vector<uint8_t> is_static;
  // Which flat inputs are one tensor or share memory; the same for every call of the signature
  // (Note [Argument aliases]).
  ArgumentAliases aliases;
  // The wrapper's options (warmup_iters, rerecord_limit, chain_limit, on_overwrite, ...); the
  // wrapper outlives every call of its records.
  const GraphOptions* options = nullptr;

  // The torch.Generator objects among its arguments (part of its signature, by identity): a
  // recording registers them with the graph, so that each replay draws fresh numbers from them.
  std::vector<at::Generator> generators;

  // Why the function runs eagerly from now on; empty while it is graphed.
  std::string eager_reason;
  int64_t replays = 0;  // over its life, in every tree: GraphedCallable's eviction policy
};

// What a capture of `fn` is asked to record; `state`: its state in the recording tree.
inline CaptureSpec captureSpec(const FunctionRecord& fn, const FunctionState& state) {
  const bool python = fn.options != nullptr && fn.options->cpu_replay == CpuReplay::kPython;
  std::vector<at::Generator> drawn = DrawnGenerators::alive(state.drawn_generators);
  drawn.insert(drawn.begin(), fn.generators.begin(), fn.generators.end());
  return {fn.name, std::move(drawn),
          python ? "cpu_replay='python' was passed (graphtrees.compile passes it for graphs "
                   "Inductor compiled, whose CPU kernels are called outside the dispatcher)"
                 : ""};
}

// Whether `fn`'s outputs are copied out rather than invalidated when a replay overwrites them.
// Gradients (outputs of backward functions) always are: they may sit in .grad (Note [Pinned
// gradients]).
inline bool copyOnOverwrite(const FunctionRecord& fn) {
  return fn.options->on_overwrite == OnOverwrite::kCopy || fn.mode == FunctionMode::kBackward;
}

enum class RunKind { kEager, kWarmup, kRecord, kReplay };

struct CallResult {
  std::vector<at::Tensor> outputs;
  RunKind kind = RunKind::kEager;
  std::shared_ptr<const Graph> graph;  // a replay's graph
  std::string reason;  // why it ran eagerly, when the tree decided (else the record's eager_reason)
};

}  // namespace graphtrees
