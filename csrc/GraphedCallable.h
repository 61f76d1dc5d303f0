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
#include <unordered_set>
#include <vector>

namespace graphtrees {

// The options of a graphed callable, validated (validateOptions()).
struct GraphOptions {
  std::vector<int64_t> static_argnums;
  int warmup_iters = 1;
  int rerecord_limit = 8;
  int max_signatures = 0;          // > 0 bounds the recorded signatures (LRU eviction past it)
  int chain_limit = 16;            // runs on its own outputs in one step before a new step
  bool copy_on_overwrite = false;  // on_overwrite="copy"
  std::vector<int64_t> buckets;    // sorted, unique; empty: no padding
  int64_t bucket_dim = 0;
};

// The one place where user-facing options are checked (cudagraphify and graphtrees.compile both
// come here): `options` holds any of static_argnums, warmup_iters, rerecord_limit,
// max_recorded_shapes, on_overwrite, chain_limit, buckets, bucket_dim (defaults for the others).
// ValueError (or TypeError for an unknown option) naming `who`. max_recorded_shapes is at least
// `min_signatures` (0 means unbounded).
GraphOptions validateOptions(const std::string& who, const py::dict& options,
                             int64_t min_signatures = 0);

class GraphedCallable {
 public:
  // `mode`: what the function is in a training step. `eager_reason`, when not empty, makes every
  // call run eagerly (a compile-time skip). TypeError if `fn` is not callable.
  GraphedCallable(py::object fn, const GraphOptions& options, py::object module, std::string name,
                  FunctionMode mode, std::string eager_reason);

  // With buckets, pads the call's batch up to a bucket first and narrows the results back
  // (Note [Buckets]); then callExact().
  py::object call(const py::args& args, const py::kwargs& kwargs);

  const std::vector<int64_t>& buckets() const { return buckets_; }
  int64_t bucketDim() const { return bucket_dim_; }
  int warmupIters() const { return warmup_iters_; }

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
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    uint64_t last_used = 0;
  };

  // `flat`: the arguments already flattened (without module tensors), or nullptr.
  py::object callExact(const py::args& args, const py::kwargs& kwargs, FlatArgs* flat = nullptr);
  py::object fallback(const py::args& args, const py::kwargs& kwargs, const FlatArgs& flat,
                      const std::string& reason);
  // Shared, so that a call in flight keeps its signature even if another thread evicts it.
  // nullptr when the signature is new and Note [Eviction without thrashing] keeps the recorded
  // ones instead.
  std::shared_ptr<Signature> signatureFor(const FlatArgs& flat, c10::Device device);
  // False when the least recently used signature is too hot to evict (thrashing).
  bool evictLeastRecentlyUsed();
  void refreshModuleTensors();

  py::object fn_;
  py::object module_;
  std::string name_;
  std::vector<uint8_t> static_args_;
  int warmup_iters_;
  int rerecord_limit_;
  int chain_limit_;
  bool copy_on_overwrite_;
  std::vector<int64_t> buckets_;
  int64_t bucket_dim_;
  FunctionMode mode_;
  std::string eager_reason_;
  int max_signatures_;
  uint64_t use_counter_ = 0;  // calls (one tick each)
  // Evictions in a row that threw away a recording that never replayed.
  int wasted_evictions_ = 0;
  int64_t callable_id_;
  int64_t signatures_created_ = 0;
  std::unordered_map<std::string, std::shared_ptr<Signature>> signatures_;
  FunctionRecord unsupported_;  // for fallbacks decided before a signature exists
  std::unordered_set<std::string> logged_reasons_;  // fallbacks with no tree to count them
  std::vector<at::Tensor> module_tensors_;
  uint64_t module_epoch_ = 0;

  static std::atomic<uint64_t> module_epoch_counter_;
};

}  // namespace graphtrees
