#pragma once

// The object `graphtrees.cudagraphify()` returns: a callable that flattens its arguments in C++,
// picks the function record for the call signature, and hands the call to the device's tree.

#include "PyTree.h"
#include "TreeManager.h"

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

// Locks a tree for this thread, releasing the GIL while waiting for another thread's call.
std::unique_lock<std::recursive_mutex> lockTree(TreeManager& tree);

class GraphedCallable {
 public:
  GraphedCallable(py::object fn, const std::vector<int64_t>& static_argnums, int warmup_iters,
                  int rerecord_limit, py::object module, std::string name);

  py::object call(const py::args& args, const py::kwargs& kwargs);

  // Per-signature state, for introspection.
  py::list signatures() const;
  const std::string& name() const { return name_; }

  // Bumped whenever any module registers a parameter, buffer or submodule (Python hooks), so that
  // wrapped modules re-read their parameters only then.
  static void bumpModuleEpoch() { module_epoch_counter_++; }

 private:
  struct Signature {
    FunctionRecord record;
    std::unique_ptr<OutputSpec> spec;
  };

  py::object fallback(const py::args& args, const py::kwargs& kwargs, const FlatArgs& flat,
                      const std::string& reason);
  Signature& signatureFor(const FlatArgs& flat);
  void refreshModuleTensors();

  py::object fn_;
  py::object module_;
  std::string name_;
  std::vector<uint8_t> static_args_;
  int warmup_iters_;
  int rerecord_limit_;
  std::unordered_map<std::string, std::unique_ptr<Signature>> signatures_;
  FunctionRecord unsupported_;  // for fallbacks decided before a signature exists
  std::vector<at::Tensor> module_tensors_;
  uint64_t module_epoch_ = 0;

  static std::atomic<uint64_t> module_epoch_counter_;
};

}  // namespace graphtrees
