#include "GraphedCallable.h"

#include "BackendFactory.h"
#include "CallRange.h"
#include "Logging.h"
#include "ThreadState.h"
#include "TreeRegistry.h"
#include "Verifier.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <optional>

namespace graphtrees {

namespace {

std::atomic<int64_t> next_function_id{1};

PyObject*& moduleEpochSource() {
  static PyObject* source = nullptr;  // a strong reference, kept for the life of the process
  return source;
}

// The registrations counted so far, or -1 (re-read every call) before the Python layer set it.
int64_t moduleEpoch() {
  PyObject* source = moduleEpochSource();
  if (source == nullptr) return -1;
  return PyLong_AsLongLong(PyList_GET_ITEM(source, 0));
}
constexpr int64_t kSignatureWarnLimit = 8;

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
    // An error raised before any Python frame ran (a TypeError for a wrong number of arguments)
    // has no traceback at all: a null handle, which pybind11 cannot pass on.
    py::object tb = e.trace();
    if (tb && !tb.is_none()) py::module_::import("traceback").attr("clear_frames")(tb);
  } catch (const std::exception&) {
    // Best effort only: the user's own error is what propagates.
  }
}

// Note [Verified replays]: before the call, what the eager run of a verified replay needs.
std::optional<ReplayVerifier> verifierFor(Verify verify, const Signature& sig, const FlatArgs& flat,
                                          c10::Device device) {
  if (verify == Verify::kOff) return std::nullopt;
  std::vector<at::Tensor> state;
  for (const auto& weak : sig.verify_state) {
    if (auto impl = weak.lock()) state.emplace_back(std::move(impl));
  }
  return std::optional<ReplayVerifier>(std::in_place, flat, device, std::move(state));
}

}  // namespace

std::string GraphedCallable::thrashingReason() const {
  return "more call signatures (shapes, dtypes, argument values) keep coming than "
         "max_recorded_shapes=" +
         std::to_string(options_.max_recorded_shapes) +
         " recordings are kept for, and every eviction threw away a recording that never "
         "replayed; the recorded signatures are kept and new ones run eagerly. Pass "
         "buckets=[...] to graphtrees.cudagraphify to pad batch sizes up to a few recorded "
         "sizes, or raise max_recorded_shapes";
}

GraphedCallable::GraphedCallable(py::object fn, const GraphOptions& options, py::object module,
                                 std::string name, FunctionMode mode, std::string eager_reason)
    : fn_(std::move(fn)),
      module_(std::move(module)),
      name_(std::move(name)),
      options_(options),
      mode_(mode),
      eager_reason_(std::move(eager_reason)),
      signatures_(options.max_recorded_shapes, /*plain_lru=*/mode == FunctionMode::kBackward),
      callable_id_(next_function_id++),
      stats_(CallStats::create(name_, callable_id_)) {
  TORCH_CHECK_TYPE(PyCallable_Check(fn_.ptr()), "graphtrees.cudagraphify expects a callable, got ",
                   py::str(py::type::of(fn_).attr("__name__")).cast<std::string>());
  for (int64_t i : options_.static_argnums) {
    if (static_cast<size_t>(i) >= static_args_.size()) static_args_.resize(i + 1, 0);
    static_args_[i] = 1;
  }
  unsupported_.id = next_function_id++;
  unsupported_.name = name_;
  unsupported_.callable_id = callable_id_;
  unsupported_.options = &options_;
}

void GraphedCallable::setModuleEpochSource(py::object counter) {
  TORCH_CHECK_TYPE(PyList_CheckExact(counter.ptr()) && PyList_GET_SIZE(counter.ptr()) == 1,
                   "graphtrees: the module epoch is a list of one int");
  PyObject*& source = moduleEpochSource();
  Py_XDECREF(source);
  source = counter.release().ptr();
}

void GraphedCallable::refreshModuleTensors() {
  if (module_.is_none()) return;
  const int64_t e = moduleEpoch();
  if (e == module_epoch_ && e >= 0) return;
  // Built aside and swapped in: another thread may run while parameters() runs Python.
  std::vector<at::Tensor> tensors;
  for (py::handle p : module_.attr("parameters")()) tensors.push_back(p.cast<at::Tensor>());
  for (py::handle b : module_.attr("buffers")()) tensors.push_back(b.cast<at::Tensor>());
  auto fresh = std::make_shared<ModuleTensors>();
  fresh->index.build(tensors);
  fresh->tensors = std::move(tensors);
  module_tensors_ = std::move(fresh);
  module_epoch_ = e;
}

std::shared_ptr<Signature> GraphedCallable::signatureFor(const FlatArgs& flat, c10::Device device) {
  // Objects whose hashes collide with a signature's, but that are not its objects, get a key of
  // their own, a variant (Note [Objects in the call signature]). Evictions leave holes in the
  // chain of variants: every variant ever made is looked at, and a new one fills the first hole.
  // Evictions may block with the GIL released and let another thread add or evict signatures of
  // this function (Note [Signatures and blocking calls]): a new signature that lost its key or
  // its room to another thread looks again, a bounded number of times.
  const auto variantKey = [&](int64_t v) {
    return v < 0 ? flat.key : flat.key + '\x01' + std::to_string(v);
  };
  const auto evict_lru = [&](const Signature& victim) {
    return TreeRegistry::evictFunction(
        victim.device, victim.record.id,
        "'" + victim.record.name + "' is the least recently used of " +
            std::to_string(signatures_.size()) + " recorded signatures of '" + name_ +
            "' (max_recorded_shapes=" + std::to_string(options_.max_recorded_shapes) + ")");
  };
  constexpr int kAttempts = 8;
  for (int attempt = 1;; ++attempt) {
    int64_t hole = -2;
    for (int64_t v = -1; v <= max_variant_; ++v) {
      const std::string k = variantKey(v);
      std::shared_ptr<Signature> found = signatures_.peek(k);
      // An argument object it was made for has died: it can never match again, and its
      // recordings go with it (unless one is on the current path: then it stays).
      if (found && !found->key_objects.matches(flat.key_objects) && found->key_objects.anyDead() &&
          TreeRegistry::evictFunction(
              found->device, found->record.id,
              "'" + found->record.name + "' was recorded for an argument object that was freed")) {
        signatures_.erase(k, found.get());
        found = nullptr;
      }
      if (!found) {
        if (hole == -2) hole = v;
        continue;
      }
      if (found->key_objects.matches(flat.key_objects)) {
        bool trim_due = false;
        if (auto sig = signatures_.find(k, &trim_due)) {         // unless evicted since the peek
          if (trim_due) signatures_.trim(evict_lru, sig.get());  // Note [Signatures past the bound]
          return sig;
        }
        if (hole == -2) hole = v;
      }
    }
    if (hole == -2) hole = max_variant_ + 1;
    const std::string key = variantKey(hole);
    signatures_.find(key);  // counts the call (none there): Note [Eviction without thrashing]
    const SignatureCache::Room room = signatures_.makeRoom(evict_lru);
    if (room == SignatureCache::Room::kThrashing) return nullptr;
    auto sig = std::make_shared<Signature>();
    sig->device = device;
    FunctionRecord& r = sig->record;
    r.id = next_function_id++;
    r.mode = mode_;
    r.counts_pending = counts_pending_;
    r.callable_id = callable_id_;
    r.eager_reason = eager_reason_;
    // Note [Argument aliases]: every position of a tensor that is static somewhere is used in
    // place; the key holds the aliases, so every call of this signature has the same ones.
    r.aliases = flat.aliases;
    r.is_static = flat.aliases.inPlace(flat.is_static);
    r.options = &options_;
    r.generators = flat.generators;
    sig->key_objects.hold(flat.key_objects);
    r.name = signatures_created_ == 0 ? name_ : name_ + "#" + std::to_string(signatures_created_);
    const bool over_bound = room == SignatureCache::Room::kOverBound || attempt == kAttempts;
    std::shared_ptr<Signature> kept = signatures_.insert(key, sig, over_bound);
    if (kept == sig) {
      stats_->addSignature(r.id);  // Note [Call statistics] in CallStats.h
      signatures_created_++;
      max_variant_ = std::max(max_variant_, hole);
      return sig;
    }
    // Another thread added a signature under this key, or filled the room, meanwhile.
    if (kept && kept->key_objects.matches(flat.key_objects)) return kept;
  }
}

py::object GraphedCallable::runFindingState(Signature& sig,
                                            const std::pair<py::tuple, py::dict>& rebuilt,
                                            const std::vector<at::Tensor>& tensors,
                                            size_t keyed_tensors) {
  // The first run of a verified signature, under a dispatch mode that notes the tensors it
  // writes which neither are arguments nor were made by the run (Note [Verified replays]).
  py::list arguments;
  for (size_t i = 0; i < keyed_tensors && i < tensors.size(); ++i) arguments.append(tensors[i]);
  py::tuple r = py::module_::import("graphtrees._verify")
                    .attr("run_noting_state_writes")(fn_, rebuilt.first, rebuilt.second, arguments);
  sig.verify_state_known = true;
  sig.verify_state.clear();
  for (const auto& t : r[1].cast<std::vector<at::Tensor>>()) {
    sig.verify_state.emplace_back(t.getIntrusivePtr());
  }
  return r[0];
}

py::object GraphedCallable::fallback(const py::args& args, const py::kwargs& kwargs,
                                     const FlatArgs& flat, const std::string& reason,
                                     ReasonKind code) {
  TreeRegistry::Handle tree;
  const std::optional<c10::Device> device =
      flat.tensors.empty() ? flat.unsupported_device : flat.tensors[0].device();
  if (device && (device->is_cpu() || device->is_cuda())) {
    // The thread's tree counts the fallback; no tree (nor CUDA stream) is made only for that.
    tree = TreeRegistry::acquire(*device, /*create=*/false);
    if (!tree) TreeRegistry::countFallbackWithoutTree(*device);
  }
  if (tree) {
    tree->noteFallback(unsupported_, reason);
  } else if (logged_reasons_.insert(reason).second) {
    GRAPHTREES_LOG(LogLevel::kWarning, "running '" + name_ + "' eagerly: " + reason);
  }
  tree = TreeRegistry::Handle();  // Note [User code outside the tree lock] in TreeLock.h
  py::object out;
  {
    // Note [Call ranges]: the device's own tracing tool too (NVTX on CUDA), with no tree asked.
    CallRange range(CallRange::Kind::kEager, device ? rangeMarks(*device) : nullptr, name_, -1,
                    reason);
    out = fn_(*args, **kwargs);
  }
  stats_->note(RunKind::kEager, reason, code);  // Note [Call statistics]: once it returned
  return out;
}

// Note [Buckets]
// With buckets, the batch size b of a call is the size along bucket_dim of its first non-static
// tensor argument. Every non-static tensor argument of that size along bucket_dim is padded with
// zeros to the smallest bucket >= b, the call runs (and is recorded) at the bucket's size, and
// every tensor result whose size along bucket_dim is that bucket is narrowed back to b (a view
// of the padded result). A batch above the largest bucket runs eagerly. All buckets' recordings
// live in the one tree and pool; a function whose result mixes the batch (a sum over it, say)
// sees the zeros, which is the caller's to account for. The call key is the padded call's (Note
// [The call signature] in CallSignature.h).
int64_t GraphedCallable::batchOf(const FlatArgs& flat) const {
  const int64_t d = options_.bucket_dim;
  for (size_t i = 0; i < flat.keyed_tensors; ++i) {
    if (!flat.is_static[i] && flat.tensors[i].dim() > d) return flat.tensors[i].size(d);
  }
  return -1;
}

void GraphedCallable::resizeBatch(FlatArgs* flat, int64_t from, int64_t to) const {
  const int64_t d = options_.bucket_dim;
  // The same tensor at several positions stays one tensor (Note [Argument aliases]: the map of
  // the call as it came, made by flattenArgs).
  std::vector<at::Tensor> resized(flat->keyed_tensors);  // at the first position of each tensor
  for (size_t i = 0; i < flat->keyed_tensors; ++i) {
    at::Tensor& t = flat->tensors[i];
    if (flat->is_static[i] || t.dim() <= d || t.size(d) != from) continue;
    at::Tensor& done = resized[flat->aliases.sameAs(i)];
    if (!done.defined() && to <= from) done = t.narrow(d, 0, to).clone();
    if (!done.defined()) {
      std::vector<int64_t> sizes = t.sizes().vec();
      sizes[d] = to;
      done = at::zeros(sizes, t.options());
      done.narrow(d, 0, from).copy_(t);
    }
    t = done;
  }
  flat->rekey();
}

py::tuple GraphedCallable::resizeExample(const py::args& args, const py::kwargs& kwargs,
                                         int64_t size) const {
  FlatArgs flat;
  flattenArgs(args, kwargs, static_args_, &flat);
  TORCH_CHECK_VALUE(flat.unsupported.empty(), "capture(): the example arguments include ",
                    flat.unsupported);
  const int64_t b = batchOf(flat);
  TORCH_CHECK_VALUE(b >= 0,
                    "capture(): the example arguments have no tensor with a batch dimension "
                    "(dimension ",
                    options_.bucket_dim, ")");
  resizeBatch(&flat, b, size);
  auto rebuilt = rebuildArgs(args, kwargs, flat.tensors);
  return py::make_tuple(rebuilt.first, rebuilt.second);
}

py::object GraphedCallable::call(const py::args& args, const py::kwargs& kwargs) {
  if (delegate_ && !inTreeCall()) return delegate_(*args, **kwargs);
  const std::vector<int64_t>& buckets = options_.buckets;
  if (buckets.empty() || inTreeCall()) return callExact(args, kwargs);
  FlatArgs flat;
  flattenArgs(args, kwargs, static_args_, &flat);
  if (!flat.unsupported.empty()) return callExact(args, kwargs, &flat);  // eager, logged there
  const int64_t b = batchOf(flat);
  if (b < 0) return callExact(args, kwargs, &flat);
  auto it = std::lower_bound(buckets.begin(), buckets.end(), b);
  if (it == buckets.end()) {
    return fallback(args, kwargs, flat,
                    "its batch size (dimension " + std::to_string(options_.bucket_dim) +
                        ") is above the largest bucket (" + std::to_string(buckets.back()) +
                        "); add a larger bucket to graph it",
                    ReasonKind::kShapes);
  }
  const int64_t bucket = *it;
  if (bucket == b) return callExact(args, kwargs, &flat);
  resizeBatch(&flat, b, bucket);  // the key follows the padded tensors: no second flatten
  auto rebuilt = rebuildArgs(args, kwargs, flat.tensors);
  py::object out = callExact(py::reinterpret_borrow<py::args>(rebuilt.first),
                             py::reinterpret_borrow<py::kwargs>(rebuilt.second), &flat);
  std::vector<at::Tensor> outs;
  const OutputSpec spec = OutputSpec::flatten(out, &outs, name_, rebuilt.first, rebuilt.second);
  const int64_t d = options_.bucket_dim;
  for (at::Tensor& t : outs) {
    if (t.dim() > d && t.size(d) == bucket) t = t.narrow(d, 0, b);
  }
  return spec.unflatten(outs, rebuilt.first, rebuilt.second);
}

void GraphedCallable::addModuleTensors(FlatArgs* flat) {
  if (module_.is_none()) return;
  refreshModuleTensors();
  const std::shared_ptr<const ModuleTensors> snapshot = module_tensors_;  // a stable one
  flat->addModule(module_.attr("training").cast<bool>(), snapshot->tensors, snapshot->index);
}

py::object GraphedCallable::runFunction(Signature& sig, const py::args& args,
                                        const py::kwargs& kwargs,
                                        const std::vector<at::Tensor>& tensors,
                                        size_t keyed_tensors) {
  auto rebuilt = rebuildArgs(args, kwargs, tensors);
  try {
    if (options_.verify != Verify::kOff && !sig.verify_state_known) {
      return runFindingState(sig, rebuilt, tensors, keyed_tensors);
    }
    return fn_(*rebuilt.first, **rebuilt.second);
  } catch (py::error_already_set& e) {
    // A backend may handle this error (a rejected capture): free the pool tensors that the
    // failed run's frames hold before it does anything else -- unless a device capture is
    // still under way (Note [Freeing during a capture] in ThreadState.h).
    if (!deviceCaptureUnderway()) clearTracebackFrames(e);
    // Out of memory comes back as the C++ error it started as, which the tree handles (Note
    // [Out of memory] in TreeManager.h).
    if (e.matches(outOfMemoryErrorType())) {
      const std::string what = py::str(e.value()).cast<std::string>();
      TORCH_CHECK_WITH(OutOfMemoryError, false, what);
    }
    throw;
  }
}

void GraphedCallable::noteRan(Signature& sig) {
  if (sig.ran) return;
  sig.ran = true;
  // Buckets are meant to be many signatures: the warning counts past them. A call that failed
  // (a TypeError for a wrong argument, say) is not a signature the function runs with.
  const int64_t warn_at = kSignatureWarnLimit + static_cast<int64_t>(options_.buckets.size());
  if (options_.max_recorded_shapes == 0 && ++signatures_ran_ == warn_at + 1) {
    GRAPHTREES_LOG(LogLevel::kWarning,
                   "'" + name_ + "' has been called with more than " + std::to_string(warn_at) +
                       " distinct signatures (shapes, dtypes or non-tensor argument values); each "
                       "one is warmed up and recorded separately and keeps its own pool memory");
  }
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
  addModuleTensors(&flat);
  // The key's last components (the state the call runs under), or why the call cannot be graphed
  // (Note [The call signature] in CallSignature.h).
  std::string why_eager;
  switch (flat.complete(&why_eager)) {
    case FlatArgs::Verdict::kEager:
      return fallback(args, kwargs, flat, why_eager, flat.why_kind);
    case FlatArgs::Verdict::kNested:  // inside the caller's own capture: part of it
      return fn_(*args, **kwargs);
    case FlatArgs::Verdict::kGraph:
      break;
  }
  const c10::Device device = flat.device();
  // A backward belongs with its forward, whichever thread autograd runs it on.
  std::shared_ptr<TreeManager> found = TreeRegistry::find(
      device, &why_eager, mode_ == FunctionMode::kBackward ? &flat.tensors : nullptr);
  if (found == nullptr) return fallback(args, kwargs, flat, why_eager, ReasonKind::kDevice);

  const std::shared_ptr<Signature> sig_holder = signatureFor(flat, device);
  if (!sig_holder) return fallback(args, kwargs, flat, thrashingReason(), ReasonKind::kShapes);
  Signature& sig = *sig_holder;
  py::object result;  // the run's own result: what a warmup or an eager run returns
  // Each run learns or checks the result structure (Note [Results of a signature]).
  RunFn run = [&](const std::vector<at::Tensor>& tensors) {
    py::object out = runFunction(sig, args, kwargs, tensors, flat.keyed_tensors);
    std::vector<at::Tensor> outs = sig.learnResults(out, args, kwargs);
    result = std::move(out);
    return outs;
  };
  std::optional<ReplayVerifier> verifier = verifierFor(options_.verify, sig, flat, device);
  CallResult r;
  TreeRegistry::Handle tree;
  takeTreeBranchRequest();  // Note [A wrapper's cond split into tree branches]: this call's own
  try {
    tree = TreeRegistry::call(std::move(found), sig.record, flat.tensors, run, &r);
  } catch (py::error_already_set& e) {
    clearTracebackFrames(e);
    throw;
  }
  noteRan(sig);
  const std::string split = takeTreeBranchRequest();
  const std::string& why = r.reason.empty() ? sig.record.eager_reason : r.reason;
  stats_->note(r.kind, why, r.kind == RunKind::kEager ? treeReasonKind(why) : ReasonKind::kOther);
  py::object out = (r.kind == RunKind::kEager || r.kind == RunKind::kWarmup)
                       ? std::move(result)
                       : sig.spec->unflatten(r.outputs, args, kwargs);
  result = py::object();
  r.outputs.clear();
  if (tree) tree->debugCheck(sig.record, r.kind);  // none: it ran eagerly, nested (TreeLock.h)
  tree = TreeRegistry::Handle();                   // the verifier's eager run is user code
  if (!split.empty() && tree_branch_factory_) {
    try {
      py::object delegate = tree_branch_factory_(split);
      if (!delegate.is_none()) delegate_ = std::move(delegate);
    } catch (py::error_already_set& e) {  // the call's result stands; it stays here, eager
      GRAPHTREES_LOG(LogLevel::kWarning, "'" + name_ + "' keeps running eagerly (" + split +
                                             "): its tree-branch form failed: " +
                                             py::str(e.value()).cast<std::string>());
    }
  }
  if (verifier && r.kind == RunKind::kReplay) {
    return verifier->check(sig.record.name, options_.verify, std::move(out), *r.graph,
                           [&](const std::vector<at::Tensor>& copies) {
                             auto rebuilt = rebuildArgs(args, kwargs, copies);
                             return fn_(*rebuilt.first, **rebuilt.second);
                           });
  }
  return out;
}

GraphedCallable::~GraphedCallable() {
  if (!evict_when_freed_) return;
  try {
    evictRecordings("was freed (its compiled graph is gone)");
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning,
                   "evicting the recordings of '" + name_ + "', which was freed: " + e.what());
  }
}

void GraphedCallable::evictRecordings(const std::string& why) {
  // A snapshot: the evictions wait for tree locks (Note [Signatures and blocking calls]).
  const std::vector<std::shared_ptr<Signature>> sigs = signatures_.snapshot();
  for (const auto& sig : sigs) {
    TreeRegistry::evictFunction(sig->device, sig->record.id, "'" + sig->record.name + "' " + why,
                                /*later=*/true);
  }
  signatures_.erase(sigs);
}

py::list GraphedCallable::signatures() const {
  py::list out;
  for (const auto& sig_holder : signatures_.snapshot()) {  // acquire() below may wait
    const Signature& sig = *sig_holder;
    const FunctionRecord& r = sig.record;
    // Warmups and re-records are per tree: the calling thread's.
    const FunctionState* state = nullptr;
    TreeRegistry::Handle tree = TreeRegistry::acquire(sig.device, /*create=*/false);
    if (tree) state = tree->functionState(r.id);
    py::dict d;
    d["function_id"] = r.id;
    d["name"] = r.name;
    d["warmups"] = state ? state->warmups : 0;
    d["rerecords"] = state ? state->rerecords : 0;
    d["eager_reason"] = r.eager_reason.empty() ? py::object(py::none()) : py::str(r.eager_reason);
    // Why its last warmup or recording ran out of memory (Note [Out of memory]), or None.
    d["out_of_memory"] = state == nullptr || state->oom_reason.empty()
                             ? py::object(py::none())
                             : py::object(py::str(state->oom_reason));
    out.append(d);
  }
  return out;
}

}  // namespace graphtrees
