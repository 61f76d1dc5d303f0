#pragma once

// The options of a graphed callable, under the names users pass them by (graphtrees.cudagraphify,
// graphtrees.compile and the dynamo backend all come through validateOptions()).

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <vector>

namespace graphtrees {

namespace py = pybind11;

// on_overwrite=: what happens to a live output whose memory a later run is about to reuse (Note
// [Output ownership] in LiveOutputs.h).
enum class OnOverwrite : uint8_t { kRaise, kCopy };

// cpu_replay=: how CPU emulation replays run (Note [CPU graphs] in cpu/CpuGraph.h).
enum class CpuReplay : uint8_t { kProgram, kPython };

// verify=: whether each replay is checked against an eager run (Note [Verified replays] in
// Verifier.h); GRAPHTREES_VERIFY=1 (or "warn") sets the default for a process.
enum class Verify : uint8_t { kOff, kRaise, kWarn };

// cond_form=: how a torch.cond is recorded where a conditional node cannot hold it, or always
// split (Note [A wrapper's cond split into tree branches] in ThreadState.h). Read in Python
// (graphtrees.cudagraphify, the compile backend); kept here so that it is checked with the
// others and GraphedCallable.options shows it.
enum class CondForm : uint8_t { kAuto, kTreeBranch };

struct GraphOptions {
  std::vector<int64_t> static_argnums;
  int warmup_iters = 1;
  int rerecord_limit = 8;
  int max_recorded_shapes =
      0;                 // > 0 bounds the recorded signatures (Note [Eviction without thrashing])
  int chain_limit = 16;  // runs on its own outputs in one step before a new step
  OnOverwrite on_overwrite = OnOverwrite::kRaise;
  std::vector<int64_t> buckets;  // sorted, unique; empty: no padding (Note [Buckets])
  int64_t bucket_dim = 0;
  CpuReplay cpu_replay = CpuReplay::kProgram;
  Verify verify = Verify::kOff;
  CondForm cond_form = CondForm::kAuto;
};

// The option names, in the order cudagraphify's signature lists them.
const std::vector<std::string>& graphOptionNames();

// The one place where user-facing options are checked: `options` holds any of
// graphOptionNames() (defaults for the others). ValueError (TypeError for an unknown option)
// naming `who`. max_recorded_shapes is at least `min_recorded_shapes` (0 means unbounded).
GraphOptions validateOptions(const std::string& who, const py::dict& options,
                             int64_t min_recorded_shapes = 0);

// The options as a dict of Python values, under their names (GraphedCallable.options).
py::dict toDict(const GraphOptions& options);

}  // namespace graphtrees
