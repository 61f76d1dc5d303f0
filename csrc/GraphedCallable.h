#pragma once

// The object `graphtrees.cudagraphify()` returns: a callable that flattens its arguments in C++,
// picks the function record for the call signature, and hands the call to the device's tree.

#include "CallSignature.h"
#include "CallStats.h"
#include "FunctionRecord.h"
#include "GraphOptions.h"
#include "OutputSpec.h"
#include "PyTree.h"
#include "SignatureCache.h"

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace graphtrees {

class GraphedCallable {
 public:
  // `mode`: what the function is in a training step. `eager_reason`, when not empty, makes every
  // call run eagerly (a compile-time skip). TypeError if `fn` is not callable.
  GraphedCallable(py::object fn, const GraphOptions& options, py::object module, std::string name,
                  FunctionMode mode, std::string eager_reason);

  // With buckets, pads the call's batch up to a bucket first and narrows the results back
  // (Note [Buckets]); then callExact().
  py::object call(const py::args& args, const py::kwargs& kwargs);

  const GraphOptions& options() const { return options_; }
  // The example arguments with every non-static tensor's batch (Note [Buckets]) cut or
  // zero-padded to `size`, as (args, kwargs): what wrapped.capture() records each bucket with.
  py::tuple resizeExample(const py::args& args, const py::kwargs& kwargs, int64_t size) const;

  // Per-signature state, for introspection.
  py::list signatures() const;
  const std::string& name() const { return name_; }
  // With evictWhenFreed(), removes its recordings from every tree (as evictRecordings()).
  ~GraphedCallable();
  GraphedCallable(const GraphedCallable&) = delete;
  GraphedCallable& operator=(const GraphedCallable&) = delete;

  // Forgets every signature and removes their recordings from every tree (those on a tree's
  // current path once the path moves off them): torch._dynamo.reset() with graphtrees.install().
  void evictRecordings(const std::string& why);
  // Whether its recordings leave the trees when it is freed: graphtrees.install()'s functions,
  // which torch._dynamo.reset() frees before it calls the hook that would evict them.
  void setEvictWhenFreed(bool evict) { evict_when_freed_ = evict; }
  bool evictWhenFreed() const { return evict_when_freed_; }
  // FunctionRecord::counts_pending of the signatures made from now on.
  void setCountsPending(bool counts) { counts_pending_ = counts; }
  bool countsPending() const { return counts_pending_; }

  // Note [A wrapper's cond split into tree branches] in ThreadState.h: `factory(why)` returns
  // the callable that takes over this function's calls when a warmup asks for the tree-branch
  // form (or None to keep them here); `delegate`, once set, runs every call outside a tree call.
  void setTreeBranchFactory(py::object factory) { tree_branch_factory_ = std::move(factory); }
  py::object delegate() const { return delegate_ ? delegate_ : py::none(); }
  void setDelegate(py::object delegate) {
    delegate_ = delegate.is_none() ? py::object() : std::move(delegate);
  }

  // `counter`: a Python list whose item 0 counts the parameters, buffers and submodules any module
  // registered (graphtrees/_hooks.py; plain Python, so that dynamo traces the hooks with no graph
  // break); wrapped modules re-read their tensors only when it changed.
  static void setModuleEpochSource(py::object counter);

 private:
  // `flat`: the arguments already flattened (without module tensors), or nullptr.
  py::object callExact(const py::args& args, const py::kwargs& kwargs, FlatArgs* flat = nullptr);
  // Runs the call eagerly for `reason` (of kind `code`: Note [Reason kinds] in CallStats.h).
  py::object fallback(const py::args& args, const py::kwargs& kwargs, const FlatArgs& flat,
                      const std::string& reason, ReasonKind code);
  // nullptr when the signature is new and Note [Eviction without thrashing] keeps the recorded
  // ones instead.
  std::shared_ptr<Signature> signatureFor(const FlatArgs& flat, c10::Device device);
  void refreshModuleTensors();
  // Component 4 of the key (Note [The call signature]): the module's tensors, a stable snapshot.
  void addModuleTensors(FlatArgs* flat);
  // Why a new signature runs eagerly when signatureFor() returns nullptr.
  std::string thrashingReason() const;
  // One run of fn_ on `tensors` (the call's, or the tree's placeholders) in place of the call's.
  py::object runFunction(Signature& sig, const py::args& args, const py::kwargs& kwargs,
                         const std::vector<at::Tensor>& tensors, size_t keyed_tensors);
  // A call of `sig` returned: the warning past kSignatureWarnLimit signatures.
  void noteRan(Signature& sig);
  // Note [Buckets]: the call's batch size, or -1; the padding (or cut) of its tensors.
  int64_t batchOf(const FlatArgs& flat) const;
  void resizeBatch(FlatArgs* flat, int64_t from, int64_t to) const;
  // A verified signature's first run: runs fn_ noting the non-argument tensors it writes.
  py::object runFindingState(Signature& sig, const std::pair<py::tuple, py::dict>& rebuilt,
                             const std::vector<at::Tensor>& tensors, size_t keyed_tensors);

  py::object fn_;
  py::object module_;
  py::object tree_branch_factory_;  // Note [A wrapper's cond split into tree branches]
  py::object delegate_;
  std::string name_;
  const GraphOptions options_;
  std::vector<uint8_t> static_args_;  // options_.static_argnums, as a mask over positions
  FunctionMode mode_;
  bool counts_pending_ = true;
  std::string eager_reason_;
  SignatureCache signatures_;
  int64_t callable_id_;
  std::shared_ptr<CallStats> stats_;  // Note [Call statistics] in CallStats.h
  int64_t signatures_created_ = 0;
  int64_t signatures_ran_ = 0;  // signatures with a call that returned (the warning counts these)
  // The highest variant of a key ever made (Note [Objects in the call signature]): lookups scan
  // every variant up to it, past those evicted since.
  int64_t max_variant_ = -1;
  bool evict_when_freed_ = false;
  FunctionRecord unsupported_;  // for fallbacks decided before a signature exists
  std::unordered_set<std::string> logged_reasons_;  // fallbacks with no tree to count them
  // The module's parameters and buffers with their index (Note [Argument aliases]), swapped as
  // one: a call reads a stable snapshot.
  struct ModuleTensors {
    std::vector<at::Tensor> tensors;
    ModuleTensorIndex index;
  };
  std::shared_ptr<const ModuleTensors> module_tensors_;
  int64_t module_epoch_ = -1;
};

}  // namespace graphtrees
