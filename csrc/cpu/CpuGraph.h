#pragma once

// A CPU emulation graph: what a CPU capture recorded, and its replay.
//
// Note [CPU graphs]
// A CUDA graph replay runs the recorded kernels at the recorded addresses and no Python at all:
// Python attributes read while recording are baked, side effects happen only while warming up
// and recording. A CPU graph replays the same way. While the CPU backend captures a function it
// records the program the function dispatches (cpu/ProgramRecorder.h); a replay runs that
// program from C++ through the dispatcher, with the GIL released, under the replay routing that
// answers each allocation with its recorded address (Note [CPU emulation of graphs]), so outputs
// land where the recording's did. Random ops draw fresh numbers on every replay (as a CUDA graph
// with its generators registered); collectives are waited for before the next op.
// Some work does not go through the dispatcher (a pybind function writing into a tensor, a numpy
// view of tensor memory, ctypes, Inductor's CPU kernels). So a program is kept only once it is
// proved complete (proveProgram): right after the capture, the memory the recording wrote is
// filled with 0x00, the storages it wrote that it did not make get their old bytes back, the RNG
// (the default generator and every generator an op took) goes back to where the capture started,
// the program runs, and every output must equal the captured one bit for bit (and every such
// storage its captured bytes); then again over 0xFF. Then everything is put back as the capture
// left it. Work outside the dispatcher that no output and no op-written storage shows (a pybind
// call updating a tensor no op touches) is not seen; verify=True finds it once it matters. A
// program that dispatches collectives is not proved: running them once more would take this rank
// out of step with the others. A function whose proof fails, or whose recording met something a
// program cannot express, keeps the Python replay: the function is run again under the replay
// routing, its allocations checked against the recording's (the divergence, kept-tensor and
// collective-buffer checks below exist only for it). tree_info() says which replay each node has
// ("cpu_replay"), and the log says once why a function has the Python replay.

#include "Backend.h"
#include "RngStates.h"
#include "cpu/OpProgram.h"
#include "cpu/ProgramRecorder.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/core/Generator.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace graphtrees {

// Where and how a recording's output lay, so that a replay can be checked against it.
struct OutputLayout {
  const void* storage;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset;
};
OutputLayout layoutOf(const at::Tensor& t);

// The default CPU generator, then `generators`.
std::vector<at::Generator> withDefaultCpuGenerator(const std::vector<at::Generator>& generators);

class CpuGraph final : public Graph {
 public:
  // `program`: nullptr for the Python replay. `controls`: the kinds of the control steps the
  // recording made (OpProgram::controlKinds()), kept when the program is not.
  CpuGraph(std::vector<Allocation> allocations, std::vector<OutputLayout> outputs, std::string name,
           bool uses_collectives, std::unique_ptr<OpProgram> program,
           std::vector<std::string> controls);

  void replay(const RunFn& run, const std::vector<at::Tensor>& inputs,
              const std::vector<int64_t>& copied,
              const std::vector<at::Tensor>& placeholders) override;
  const std::vector<Interval>& footprint() const override { return footprint_; }
  const char* cpuReplay() const override { return program_ ? "program" : "python"; }
  bool replaysProgram() const override { return program_ != nullptr; }
  std::vector<std::string> conditionals() const override {
    std::vector<std::string> out;
    for (const auto& k : controls_) {
      out.push_back(k + (!program_     ? ":python-replay"
                         : k == "cond" ? ":program-branch"
                                       : ":program-loop"));
    }
    return out;
  }
  std::string explainDifference(const std::function<void()>& eager,
                                const std::vector<at::Tensor>& eager_inputs) const override;

 private:
  void replayProgram(const std::vector<at::Tensor>& inputs);
  void replayPython(const RunFn& run, const std::vector<at::Tensor>& inputs);

  bool uses_collectives_;  // Note [Collective buffers]
  std::vector<Allocation> allocations_;
  std::vector<Interval> footprint_;
  std::vector<OutputLayout> outputs_;
  std::unordered_set<uintptr_t> output_storages_;
  std::string name_;
  std::unique_ptr<OpProgram> program_;
  std::vector<std::string> controls_;
};

// The completeness proof of Note [CPU graphs]: empty if `program`, run on the capture's `inputs`
// from the RNG states `at_start`, reproduces `outputs` and the final bytes of `saved` (the
// storages it wrote that the function did not make); otherwise why not. Leaves memory and RNG
// (the default CPU generator and `generators`) as the capture left them either way.
std::string proveProgram(const OpProgram& program, const std::vector<at::Tensor>& inputs,
                         const std::vector<at::Tensor>& outputs,
                         const std::vector<Allocation>& allocations,
                         const std::vector<ProgramRecorder::SavedStorage>& saved,
                         const RngStates& at_start, const std::vector<at::Generator>& generators,
                         const std::string& function_name);

}  // namespace graphtrees
