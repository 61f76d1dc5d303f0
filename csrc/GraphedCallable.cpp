#include "GraphedCallable.h"

#include "AutocastState.h"
#include "Logging.h"
#include "ProcessState.h"
#include "TreeRegistry.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <mutex>

namespace graphtrees {

std::atomic<uint64_t> GraphedCallable::module_epoch_counter_{1};

namespace {

std::atomic<int64_t> next_function_id{1};
constexpr size_t kSignatureWarnLimit = 8;

// torch.OutOfMemoryError (what c10::OutOfMemoryError becomes in Python).
py::handle outOfMemoryErrorType() {
  static PyObject* type =
      py::object(py::module_::import("torch").attr("OutOfMemoryError")).release().ptr();
  return type;
}

// Drops the locals of the frames an exception passed through, so that tensors allocated in the
// pool by the failed call are freed now rather than when the traceback dies.
void clearTracebackFrames(const py::error_already_set& e) {
  try {
    py::object tb = e.trace();
    if (!tb.is_none()) py::module_::import("traceback").attr("clear_frames")(tb);
  } catch (const py::error_already_set&) {
    // Best effort only.
  }
}

}  // namespace

namespace {
// An int option (not a bool) with a lower bound, or ValueError naming `who` and the option.
int64_t intOption(const std::string& who, const char* name, const py::handle& value, int64_t min) {
  const bool ok =
      PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()) && value.cast<int64_t>() >= min;
  TORCH_CHECK_VALUE(ok, who, ": ", name, " must be an int >= ", min, ", got ",
                    py::repr(value).cast<std::string>());
  return value.cast<int64_t>();
}
}  // namespace

GraphOptions validateOptions(const std::string& who, const py::dict& options,
                             int64_t min_signatures) {
  static const char* const kKnown[] = {"static_argnums", "warmup_iters",        "rerecord_limit",
                                       "on_overwrite",   "max_recorded_shapes", "chain_limit",
                                       "buckets",        "bucket_dim"};
  for (auto item : options) {
    const std::string key = py::str(item.first).cast<std::string>();
    const bool known =
        std::any_of(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return key == k; });
    TORCH_CHECK_TYPE(known, who, ": unexpected option '", key, "'");
  }
  auto get = [&](const char* name, py::object fallback) -> py::object {
    return options.contains(name) ? py::reinterpret_borrow<py::object>(options[name]) : fallback;
  };
  GraphOptions o;
  const py::object static_argnums = get("static_argnums", py::tuple());
  std::vector<py::handle> positions;
  if (PyLong_Check(static_argnums.ptr())) {
    positions.push_back(static_argnums);
  } else {
    for (py::handle h : static_argnums) positions.push_back(h);
  }
  for (py::handle h : positions) {
    const bool ok = PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr()) && h.cast<int64_t>() >= 0;
    TORCH_CHECK_VALUE(ok, who,
                      ": static_argnums must be non-negative ints (positions of positional "
                      "arguments), got ",
                      py::repr(h).cast<std::string>());
    o.static_argnums.push_back(h.cast<int64_t>());
  }
  o.warmup_iters =
      static_cast<int>(intOption(who, "warmup_iters", get("warmup_iters", py::int_(1)), 1));
  o.rerecord_limit =
      static_cast<int>(intOption(who, "rerecord_limit", get("rerecord_limit", py::int_(8)), 0));
  o.max_signatures = static_cast<int>(intOption(
      who, "max_recorded_shapes", get("max_recorded_shapes", py::int_(0)), min_signatures));
  o.chain_limit =
      static_cast<int>(intOption(who, "chain_limit", get("chain_limit", py::int_(16)), 1));
  const py::object policy = get("on_overwrite", py::str("raise"));
  const bool is_str = py::isinstance<py::str>(policy);
  const std::string p = is_str ? policy.cast<std::string>() : "";
  TORCH_CHECK_VALUE(p == "raise" || p == "copy", who,
                    ": on_overwrite must be 'raise' or 'copy', got ",
                    py::repr(policy).cast<std::string>());
  o.copy_on_overwrite = p == "copy";
  const py::object buckets = get("buckets", py::none());
  if (!buckets.is_none()) {
    bool ok = py::isinstance<py::iterable>(buckets) && !py::isinstance<py::str>(buckets);
    if (ok) {
      for (py::handle h : buckets) {
        ok = ok && PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr()) && h.cast<int64_t>() >= 1;
        if (ok) o.buckets.push_back(h.cast<int64_t>());
      }
    }
    TORCH_CHECK_VALUE(ok && !o.buckets.empty(), who,
                      ": buckets must be a non-empty sequence of ints >= 1, got ",
                      py::repr(buckets).cast<std::string>());
    std::sort(o.buckets.begin(), o.buckets.end());
    o.buckets.erase(std::unique(o.buckets.begin(), o.buckets.end()), o.buckets.end());
  }
  o.bucket_dim = intOption(who, "bucket_dim", get("bucket_dim", py::int_(0)), 0);
  return o;
}

GraphedCallable::GraphedCallable(py::object fn, const GraphOptions& options, py::object module,
                                 std::string name, FunctionMode mode, std::string eager_reason)
    : fn_(std::move(fn)),
      module_(std::move(module)),
      name_(std::move(name)),
      warmup_iters_(options.warmup_iters),
      rerecord_limit_(options.rerecord_limit),
      chain_limit_(options.chain_limit),
      copy_on_overwrite_(options.copy_on_overwrite),
      buckets_(options.buckets),
      bucket_dim_(options.bucket_dim),
      mode_(mode),
      eager_reason_(std::move(eager_reason)),
      max_signatures_(options.max_signatures),
      callable_id_(next_function_id++) {
  TORCH_CHECK_TYPE(PyCallable_Check(fn_.ptr()), "graphtrees.cudagraphify expects a callable, got ",
                   py::str(py::type::of(fn_).attr("__name__")).cast<std::string>());
  for (int64_t i : options.static_argnums) {
    if (static_cast<size_t>(i) >= static_args_.size()) static_args_.resize(i + 1, 0);
    static_args_[i] = 1;
  }
  unsupported_.id = next_function_id++;
  unsupported_.name = name_;
  unsupported_.callable_id = callable_id_;
}

void GraphedCallable::refreshModuleTensors() {
  const uint64_t e = module_epoch_counter_.load();
  if (module_.is_none() || e == module_epoch_) return;
  // Built aside and swapped in: another thread may run while parameters() runs Python.
  std::vector<at::Tensor> tensors;
  for (py::handle p : module_.attr("parameters")()) tensors.push_back(p.cast<at::Tensor>());
  for (py::handle b : module_.attr("buffers")()) tensors.push_back(b.cast<at::Tensor>());
  module_tensors_ = std::move(tensors);
  module_epoch_ = e;
}

// Note [Eviction without thrashing]
// With max_recorded_shapes, a new signature normally evicts the least recently used one. When
// more signatures cycle than fit, that throws every recording away before it replays (a warmup
// and a recording per call, nothing replayed). So once max_recorded_shapes evictions in a row
// threw away recordings that never replayed, the callable is thrashing: the recorded signatures
// are kept and a new one runs eagerly (logged once, with the advice to use buckets) -- unless
// the least recently used one has gone unused for kIdleFactor * max_recorded_shapes calls, which
// is how a workload that moved on to other shapes gets them recorded. An eviction of a recording
// that did replay ends the streak. Backward graphs keep plain LRU: their signatures follow their
// forwards', and a forward that runs eagerly must not leave its graphed backward waiting.
bool GraphedCallable::evictLeastRecentlyUsed() {
  constexpr uint64_t kIdleFactor = 4;
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& kv : signatures_) order.emplace_back(kv.second->last_used, kv.first);
  std::sort(order.begin(), order.end());
  const bool thrashing = mode_ != FunctionMode::kBackward && wasted_evictions_ >= max_signatures_;
  if (thrashing && !order.empty() &&
      use_counter_ - order.front().first < kIdleFactor * static_cast<uint64_t>(max_signatures_)) {
    return false;
  }
  for (const auto& candidate : order) {
    Signature& victim = *signatures_.at(candidate.second);
    const bool evicted = TreeRegistry::evictFunction(
        victim.device, victim.record.id,
        "'" + victim.record.name + "' is the least recently used of " +
            std::to_string(signatures_.size()) + " recorded signatures of '" + name_ +
            "' (max_recorded_shapes=" + std::to_string(max_signatures_) + ")");
    if (evicted) {
      wasted_evictions_ = victim.record.replays == 0 ? wasted_evictions_ + 1 : 0;
      signatures_.erase(candidate.second);
      return true;
    }
  }
  return true;  // every one is on the current path: the bound is exceeded for now
}

std::shared_ptr<GraphedCallable::Signature> GraphedCallable::signatureFor(const FlatArgs& flat,
                                                                          c10::Device device) {
  ++use_counter_;
  auto it = signatures_.find(flat.key);
  if (it != signatures_.end()) {
    it->second->last_used = use_counter_;
    return it->second;
  }
  if (max_signatures_ > 0 && signatures_.size() >= static_cast<size_t>(max_signatures_) &&
      !evictLeastRecentlyUsed()) {
    return nullptr;
  }
  auto sig = std::make_shared<Signature>();
  sig->device = device;
  sig->last_used = use_counter_;
  FunctionRecord& r = sig->record;
  r.id = next_function_id++;
  r.mode = mode_;
  r.callable_id = callable_id_;
  r.eager_reason = eager_reason_;
  r.name = signatures_created_ == 0 ? name_ : name_ + "#" + std::to_string(signatures_created_);
  signatures_created_++;
  r.is_static = flat.is_static;
  r.warmup_iters = warmup_iters_;
  r.rerecord_limit = rerecord_limit_;
  r.chain_limit = chain_limit_;
  r.copy_on_overwrite = copy_on_overwrite_;
  r.generators = flat.generators;
  // Buckets are meant to be many signatures: the warning counts past them.
  const size_t warn_at = kSignatureWarnLimit + buckets_.size();
  if (max_signatures_ == 0 && signatures_.size() == warn_at) {
    logMessage(LogLevel::kWarning,
               "'" + name_ + "' has been called with more than " + std::to_string(warn_at) +
                   " distinct signatures (shapes, dtypes or non-tensor argument values); each one "
                   "is warmed up and recorded separately and keeps its own pool memory");
  }
  signatures_.emplace(flat.key, sig);
  return sig;
}

py::object GraphedCallable::fallback(const py::args& args, const py::kwargs& kwargs,
                                     const FlatArgs& flat, const std::string& reason) {
  TreeRegistry::Handle tree;
  if (!flat.tensors.empty()) tree = TreeRegistry::acquire(flat.tensors[0].device(), true);
  if (tree) {
    tree->noteFallback(unsupported_, reason);
  } else if (logged_reasons_.insert(reason).second) {
    logMessage(LogLevel::kWarning, "running '" + name_ + "' eagerly: " + reason);
  }
  return fn_(*args, **kwargs);
}

// Note [Buckets]
// With buckets, the batch size b of a call is the size along bucket_dim of its first non-static
// tensor argument. Every non-static tensor argument of that size along bucket_dim is padded with
// zeros to the smallest bucket >= b, the call runs (and is recorded) at the bucket's size, and
// every tensor result whose size along bucket_dim is that bucket is narrowed back to b (a view
// of the padded result). A batch above the largest bucket runs eagerly. All buckets' recordings
// live in the one tree and pool; a function whose result mixes the batch (a sum over it, say)
// sees the zeros, which is the caller's to account for.
py::object GraphedCallable::call(const py::args& args, const py::kwargs& kwargs) {
  if (buckets_.empty() || inTreeCall()) return callExact(args, kwargs);
  FlatArgs flat;
  flattenArgs(args, kwargs, static_args_, &flat);
  if (!flat.unsupported.empty()) return callExact(args, kwargs, &flat);  // eager, logged there
  const int64_t d = bucket_dim_;
  int64_t b = -1;
  for (size_t i = 0; i < flat.tensors.size() && b < 0; ++i) {
    if (!flat.is_static[i] && flat.tensors[i].dim() > d) b = flat.tensors[i].size(d);
  }
  if (b < 0) return callExact(args, kwargs, &flat);
  auto it = std::lower_bound(buckets_.begin(), buckets_.end(), b);
  if (it == buckets_.end()) {
    return fallback(args, kwargs, flat,
                    "its batch size (dimension " + std::to_string(d) +
                        ") is above the largest bucket (" + std::to_string(buckets_.back()) +
                        "); add a larger bucket to graph it");
  }
  const int64_t bucket = *it;
  if (bucket == b) return callExact(args, kwargs, &flat);
  for (size_t i = 0; i < flat.tensors.size(); ++i) {
    at::Tensor& t = flat.tensors[i];
    if (flat.is_static[i] || t.dim() <= d || t.size(d) != b) continue;
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[d] = bucket;
    at::Tensor padded = at::zeros(sizes, t.options());
    padded.narrow(d, 0, b).copy_(t);
    t = std::move(padded);
  }
  auto rebuilt = rebuildArgs(args, kwargs, flat.tensors);
  py::object out = callExact(py::reinterpret_borrow<py::args>(rebuilt.first),
                             py::reinterpret_borrow<py::kwargs>(rebuilt.second));
  std::vector<at::Tensor> outs;
  const OutputSpec spec = OutputSpec::flatten(out, &outs, name_);
  for (at::Tensor& t : outs) {
    if (t.dim() > d && t.size(d) == bucket) t = t.narrow(d, 0, b);
  }
  return spec.unflatten(outs);
}

py::object GraphedCallable::callExact(const py::args& args, const py::kwargs& kwargs,
                                      FlatArgs* flattened) {
  // A graphed function called while another one is being warmed up, recorded or replayed on this
  // thread is part of that run: it runs eagerly inside it.
  if (inTreeCall()) return fn_(*args, **kwargs);

  FlatArgs flat;
  if (flattened != nullptr) {
    flat = std::move(*flattened);
  } else {
    flattenArgs(args, kwargs, static_args_, &flat);
  }
  if (!module_.is_none()) {
    refreshModuleTensors();
    const std::vector<at::Tensor> module_tensors = module_tensors_;  // a stable snapshot
    flat.key.push_back(module_.attr("training").cast<bool>() ? 'R' : 'E');
    const auto count = static_cast<uint32_t>(module_tensors.size());
    flat.key.append(reinterpret_cast<const char*>(&count), sizeof(count));
    for (const auto& t : module_tensors) {
      flat.tensors.push_back(t);
      flat.is_static.push_back(1);
    }
  }
  if (!flat.unsupported.empty())
    return fallback(args, kwargs, flat, "it was called with " + flat.unsupported);
  if (flat.tensors.empty()) {
    return fallback(args, kwargs, flat, "it has no tensor arguments to tell its device");
  }
  const c10::Device device = flat.tensors[0].device();
  // Autocast changes what the function computes: a recording made under it is another function
  // (Note [Autocast and recordings] in AutocastState.h).
  if (at::autocast::is_autocast_enabled(device.type())) {
    flat.key.push_back('A');
    flat.key.push_back(static_cast<char>(at::autocast::get_autocast_dtype(device.type())));
  }
  const bool grad = at::GradMode::is_enabled();
  for (size_t i = 0; i < flat.tensors.size(); ++i) {
    const at::Tensor& t = flat.tensors[i];
    if (t.device() != device) {
      return fallback(args, kwargs, flat,
                      "its tensors are on several devices (" + device.str() + " and " +
                          t.device().str() + "); a graph runs on one device");
    }
    if (grad && t.requires_grad()) {
      return fallback(args, kwargs, flat,
                      std::string("it needs autograd: grad mode is on and ") +
                          (flat.is_static[i] ? "a parameter or static input" : "an input") +
                          " requires grad. Call it under torch.no_grad() or "
                          "torch.inference_mode() to graph it");
    }
  }
  std::string why_not;
  // A backward belongs with its forward, whichever thread autograd runs it on.
  std::shared_ptr<TreeManager> found = TreeRegistry::find(
      device, &why_not, mode_ == FunctionMode::kBackward ? &flat.tensors : nullptr);
  if (found == nullptr) return fallback(args, kwargs, flat, why_not);

  const std::shared_ptr<Signature> sig_holder = signatureFor(flat, device);
  if (!sig_holder) {
    return fallback(args, kwargs, flat,
                    "more call signatures (shapes, dtypes, argument values) keep coming than "
                    "max_recorded_shapes=" +
                        std::to_string(max_signatures_) +
                        " recordings are kept for, and every eviction threw away a recording "
                        "that never replayed; the recorded signatures are kept and new ones run "
                        "eagerly. Pass buckets=[...] to graphtrees.cudagraphify to pad batch "
                        "sizes up to a few recorded sizes, or raise max_recorded_shapes");
  }
  Signature& sig = *sig_holder;
  py::object result;
  const std::string& fname = sig.record.name;
  RunFn run = [&](const std::vector<at::Tensor>& tensors) {
    auto rebuilt = rebuildArgs(args, kwargs, tensors);
    py::object out;
    try {
      out = fn_(*rebuilt.first, **rebuilt.second);
    } catch (py::error_already_set& e) {
      // A backend may handle this error (a rejected capture): free the pool tensors that the
      // failed run's frames hold before it does anything else.
      clearTracebackFrames(e);
      // Out of memory comes back as the C++ error it started as, which the tree handles (Note
      // [Out of memory] in TreeManager.cpp).
      if (e.matches(outOfMemoryErrorType())) {
        const std::string what = py::str(e.value()).cast<std::string>();
        TORCH_CHECK_WITH(OutOfMemoryError, false, what);
      }
      throw;
    }
    std::vector<at::Tensor> outs;
    OutputSpec spec = OutputSpec::flatten(out, &outs, fname);
    if (!sig.spec) {
      sig.spec = std::make_unique<OutputSpec>(std::move(spec));
    } else if (sig.record.eager_reason.empty() && !sig.spec->sameAs(spec)) {
      sig.record.eager_reason = "its non-tensor results change between calls (first " +
                                sig.spec->describe() + ", now " + spec.describe() + ")";
      throw std::runtime_error(
          "graphtrees: '" + fname + "' returned " + spec.describe() +
          " where an earlier call returned " + sig.spec->describe() +
          ". A recorded graph returns the non-tensor values it saw when it was recorded, so "
          "results whose structure or Python values change between calls cannot be graphed; "
          "return such values as tensors. This function runs eagerly from now on.");
    }
    result = std::move(out);
    return outs;
  };

  CallResult r;
  TreeRegistry::Handle tree;
  try {
    tree = TreeRegistry::call(std::move(found), sig.record, flat.tensors, run, &r);
  } catch (py::error_already_set& e) {
    clearTracebackFrames(e);
    throw;
  }
  py::object out = (r.kind == RunKind::kEager || r.kind == RunKind::kWarmup)
                       ? std::move(result)
                       : sig.spec->unflatten(r.outputs);
  result = py::object();
  r.outputs.clear();
  tree->debugCheck(sig.record, r.kind);
  return out;
}

py::list GraphedCallable::signatures() const {
  py::list out;
  for (const auto& kv : signatures_) {
    const FunctionRecord& r = kv.second->record;
    // Warmups and re-records are per tree: the calling thread's.
    const FunctionState* state = nullptr;
    TreeRegistry::Handle tree = TreeRegistry::acquire(kv.second->device, /*create=*/false);
    if (tree) state = tree->functionState(r.id);
    py::dict d;
    d["function_id"] = r.id;
    d["name"] = r.name;
    d["warmups"] = state ? state->warmups : 0;
    d["rerecords"] = state ? state->rerecords : 0;
    d["eager_reason"] = r.eager_reason.empty() ? py::object(py::none()) : py::str(r.eager_reason);
    out.append(d);
  }
  return out;
}

}  // namespace graphtrees
