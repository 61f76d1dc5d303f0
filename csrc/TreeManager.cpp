#include "TreeManager.h"

#include "AutocastState.h"
#include "InputMutationCheck.h"
#include "Logging.h"
#include "ProcessState.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace graphtrees {

namespace {

// While a backward is pending, how often one callable may run on fresh inputs in one step (e.g.
// micro-batches before their backward) before a new step is forced.
constexpr int kMaxPendingRuns = 64;

const char* kindName(RunKind k) {
  static const char* const kNames[] = {"eager", "warmup", "record", "replay"};
  return kNames[static_cast<int>(k)];
}

// Gradients (outputs of backward functions) are always copied out rather than invalidated: they
// may sit in .grad (Note [Pinned gradients]).
bool copyOnOverwrite(const FunctionRecord& fn) {
  return fn.copy_on_overwrite || fn.mode == FunctionMode::kBackward;
}

std::string mutationReason(int64_t input, const std::string& op, const char* advice) {
  return "it mutates its input tensor #" + std::to_string(input) + " in place" +
         (op.empty() ? "" : " (" + op + ")") + "; a graph would mutate a private copy instead" +
         advice;
}

std::string firstLine(const std::string& s) {
  const size_t end = s.find('\n');
  return end == std::string::npos ? s : s.substr(0, end);
}

std::string whereOf(const TreeNode* node) {
  return node ? "node " + std::to_string(node->id()) : "the root";
}

}  // namespace

namespace {
std::atomic<int64_t> next_tree_serial{1};
}  // namespace

TreeManager::TreeManager(std::unique_ptr<Backend> backend, int64_t owner, StepCounter steps)
    : backend_(std::move(backend)),
      serial_(next_tree_serial++),
      owner_(owner),
      steps_(std::move(steps)),
      live_(*backend_),
      bookkeeping_(*backend_, live_),
      root_(-1, nullptr),
      seen_step_(steps_->load()) {}

TreeManager::~TreeManager() {
  try {
    close();
  } catch (const std::exception& e) {
    logMessage(LogLevel::kWarning,
               std::string("freeing the tree of ") + backend_->device().str() + ": " + e.what());
  }
}

void TreeManager::close() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (closed_) return;
  closed_ = true;
  pinned_by_node_.clear();
  pinned_by_warmup_function_.clear();
  live_.invalidateAll("graphtrees.reset() freed the pool");
  path_.clear();
  current_ = nullptr;
  root_.clearChildren();    // graphs first: they may hold references to the pool
  backend_->releasePool();  // may throw, after the pool is released
}

FunctionState& TreeManager::stateOf(FunctionRecord& fn) {
  if (C10_UNLIKELY(fn.state_tree != serial_)) {
    // Pointers into the maps stay valid: their entries are never erased.
    fn.state = &functions_[fn.id];
    fn.callable_state = &callables_[fn.callable_id];
    fn.state_tree = serial_;
  }
  return *fn.state;
}

bool TreeManager::producedAny(const std::vector<at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) {
    return t.defined() && t.has_storage() && live_.contains(t.storage().unsafeGetStorageImpl());
  });
}

int64_t TreeManager::liveOutputs() {
  live_.pruneGone();
  return static_cast<int64_t>(live_.size());
}

void TreeManager::noteGenerationRun(FunctionRecord& fn) {
  CallableState& c = *fn.callable_state;
  if (c.last_generation != generation_) {
    c.last_generation = generation_;
    c.runs_in_generation = 0;
  }
  c.runs_in_generation++;
}

// Note [Ending a path]
// A path ends when a new step begins (mark_step_begin(), or a function that already ran in this
// generation is called again on inputs that do not come from this generation), or when every
// output of the path is dead. Outputs of the ending generation that own pool blocks (outputs of
// warmups and recordings, and outputs that a restore gave ownership) are freed now, so that the
// next step can reuse their memory, and invalidated: as in PyTorch's trees, the previous step's
// pool outputs are the next step's scratch memory. The current call's own inputs are spared.
// Replayed outputs own nothing; they stay valid until a later replay or restore really reuses their
// memory (see replay() and PoolBookkeeping).
void TreeManager::endPath(const std::string& why, const std::vector<at::Tensor>& spare) {
  pinned_by_node_.clear();
  pinned_by_warmup_function_.clear();
  std::unordered_set<const c10::StorageImpl*> spared;
  for (const auto& t : spare) spared.insert(t.storage().unsafeGetStorageImpl());
  live_.invalidateIf(
      [&](int64_t, const LiveOutput&, const c10::StorageImpl& storage) {
        return live_.ownsPoolBlock(storage) && !spared.count(&storage);
      },
      [&] { return "a new step began: " + why; });
  if (current_ != nullptr || state_ != PathState::kNone) {
    logMessage(LogLevel::kDebug, "path ended: " + why);
  }
  path_.clear();
  current_ = nullptr;
  state_ = PathState::kNone;
  pending_forwards_ = 0;
  generation_++;
  live_.startGeneration();
}

bool TreeManager::mustStayDeadHolds(const TreeNode& node) const {
  return std::none_of(node.mustStayDead().begin(), node.mustStayDead().end(),
                      [&](int64_t slot) { return live_.liveInGeneration(slot, generation_); });
}

// ---------------------------------------------------------------------------------------------
// The call

TreeManager::CallKey TreeManager::keyOf(const FunctionRecord& fn,
                                        const std::vector<at::Tensor>& inputs) const {
  CallKey c;
  c.kinds.resize(inputs.size(), InputKind::kCopied);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (fn.is_static[i]) {
      c.kinds[i] = InputKind::kStatic;
      c.key_ptrs.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
      continue;
    }
    const LiveOutput* e = live_.find(t.storage().unsafeGetStorageImpl());
    if (e == nullptr || e->generation != generation_) continue;
    c.consumes_generation_output = true;
    if (e->node != nullptr) {
      c.kinds[i] = InputKind::kManaged;
      c.key_ptrs.push_back(static_cast<uintptr_t>(i));
      c.key_ptrs.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
    }
  }
  c.key_hash = TreeNode::hashKey(fn.id, c.key_ptrs);
  return c;
}

TreeNode* TreeManager::findChild(const FunctionRecord& fn, const CallKey& key,
                                 std::string* mismatch) const {
  const TreeNode* parent = current_ != nullptr ? current_ : &root_;
  if (const auto* candidates = parent->childrenFor(key.key_hash)) {
    for (TreeNode* c : *candidates) {
      if (!c->keyEquals(fn.id, key.key_ptrs)) continue;
      if (mustStayDeadHolds(*c)) return c;
      *mismatch = "an output of an earlier call in this step that was dead when node " +
                  std::to_string(c->id()) + " was recorded is alive now";
    }
  }
  // Explain why no recording of this function under this parent matches (rare path).
  for (const auto& c : parent->ownedChildren()) {
    if (!mismatch->empty()) break;
    if (c->functionId() == fn.id) *mismatch = c->whyKeyDiffers(key.kinds, key.key_ptrs);
  }
  return nullptr;
}

CallResult TreeManager::call(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                             const RunFn& run) {
  CallDepthGuard depth;
  CallResult result = callImpl(fn, inputs, run);
  finishRun(fn, result);
  return result;
}

// Note [Pending backward]
// In training, a forward function's outputs include the activations its backward will read. While
// a forward has run and its backward has not, no new generation starts on its own (a new step
// would free those activations): calling the forward again extends the path, which is how several
// micro-batches' forwards run before their backwards. A backward clears the state.
// mark_step_begin() still starts a new step. A forward whose backward never runs (evaluation
// under grad mode, say) extends the path at most kMaxPendingRuns times; then a warning says
// what to do and a new step starts anyway.
//
// Note [Pinned gradients]
// A backward's outputs are gradients. Autograd "steals" a gradient whose only reference is its
// own (it becomes .grad without a copy) and accumulates in place into such buffers; a gradient in
// pool memory would then be overwritten by the next replay. The tree keeps one extra reference to
// each backward output until the node runs again or the step ends, so autograd copies gradients
// into .grad, as it does for any gradient it cannot steal.
void TreeManager::finishRun(FunctionRecord& fn, const CallResult& result) {
  // A forward that ran eagerly saved nothing in the pool: no backward waits on this path.
  if (fn.mode == FunctionMode::kForward && result.kind != RunKind::kEager) {
    pending_forwards_++;
  } else if (fn.mode == FunctionMode::kBackward) {
    pending_forwards_ = std::max<int64_t>(0, pending_forwards_ - 1);
    if (result.kind == RunKind::kWarmup) {
      pinned_by_warmup_function_[fn.id] = result.outputs;
    } else if (result.kind != RunKind::kEager && current_ != nullptr) {
      pinned_by_node_[current_->id()] = result.outputs;
    }
  }
}

void TreeManager::debugCheck(const FunctionRecord& fn, RunKind kind) {
  if (!debugChecksEnabled()) return;
  std::string why;
  TORCH_INTERNAL_ASSERT(checkPoolInvariants(&why), "graphtrees pool invariant broken after a ",
                        kindName(kind), " of '", fn.name, "': ", why);
}

CallResult TreeManager::callImpl(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                 const RunFn& run) {
  TORCH_INTERNAL_ASSERT(fn.is_static.size() == inputs.size());
  FunctionState& st = stateOf(fn);
  if (!fn.eager_reason.empty()) return runEager(fn, inputs, run, fn.eager_reason);

  const int64_t step = steps_->load();
  if (step != seen_step_) {
    seen_step_ = step;
    endPath("graphtrees.mark_step_begin() was called", inputs);
  }
  if ((state_ == PathState::kWarmup || state_ == PathState::kRecording) &&
      !live_.anyLiveInGeneration(generation_)) {
    endPath("every output of the current path is dead", inputs);
  }
  CallKey key = keyOf(fn, inputs);
  const CallableState& callable = *fn.callable_state;
  if (callable.last_generation == generation_) {
    const bool fresh = !key.consumes_generation_output;
    bool new_step = false;
    if (pending_forwards_ > 0) {
      // A forward waits for its backward: extend the path (micro-batches, pipelines), up to a
      // bound for forwards whose backward never comes.
      if (fresh && callable.runs_in_generation >= kMaxPendingRuns) {
        new_step = true;
        if (logged_.insert("pending\n" + fn.name).second) {
          logMessage(LogLevel::kWarning,
                     "'" + fn.name + "' ran " + std::to_string(callable.runs_in_generation) +
                         " times in one step while a forward's backward was pending; starting a "
                         "new step anyway, which frees the pending forwards' activations. Call "
                         "backward() before running forwards that many times, run evaluation "
                         "under torch.no_grad(), or call graphtrees.mark_step_begin() at the "
                         "start of each step.");
        }
      }
    } else if (fresh) {
      new_step = true;
    } else if (callable.runs_in_generation >= fn.chain_limit) {
      // A function called again on an output of its own step extends the path (an unrolled
      // loop); after chain_limit runs the path restarts instead, so that a feedback loop
      // `h = f(h)` reuses a bounded chain of recordings rather than recording forever.
      new_step = true;
      if (logged_.insert("chain\n" + fn.name).second) {
        logMessage(LogLevel::kInfo,
                   "'" + fn.name + "' ran " + std::to_string(callable.runs_in_generation) +
                       " times in one step on outputs of that step (chain_limit=" +
                       std::to_string(fn.chain_limit) +
                       "); starting a new step, which releases that step's outputs (raise "
                       "chain_limit, or use on_overwrite='copy' to keep them valid)");
      }
    }
    if (new_step) {
      endPath("'" + fn.name + "' was called again", inputs);
      key = keyOf(fn, inputs);
    }
  }
  // A function that ran out of memory tries again once an eviction may have made room.
  const bool out_of_memory = st.oom_at_evictions >= 0 && st.oom_at_evictions == num_evictions_;
  if (state_ == PathState::kWarmup || st.warmups < fn.warmup_iters) {
    if (out_of_memory) return runEager(fn, inputs, run, st.oom_reason);
    return warmup(fn, allocationInputs(fn, inputs), run);
  }
  std::string mismatch;
  TreeNode* node = findChild(fn, key, &mismatch);
  if (node == nullptr && current_ != nullptr && root_functions_.count(fn.id) &&
      !live_.anyLiveInGeneration(generation_)) {
    endPath("every output of the current path is dead", inputs);
    key = keyOf(fn, inputs);
    mismatch.clear();
    node = findChild(fn, key, &mismatch);
  }
  if (node != nullptr) return replay(*node, fn, inputs, run);
  if (out_of_memory) return runEager(fn, inputs, run, st.oom_reason);

  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  const bool rerecord = parent->countChildrenOf(fn.id) > 0;
  if (rerecord) {
    if (mismatch.empty()) mismatch = "no recording matches the inputs";
    if (st.rerecords >= fn.rerecord_limit) {
      fn.eager_reason = "it was re-recorded " + std::to_string(st.rerecords) +
                        " times (rerecord_limit=" + std::to_string(fn.rerecord_limit) +
                        "), last because " + mismatch;
      return runEager(fn, inputs, run, fn.eager_reason);
    }
    logMessage(LogLevel::kInfo, "re-recording '" + fn.name + "' under " + whereOf(current_) +
                                    " because " + mismatch + " (re-record " +
                                    std::to_string(st.rerecords + 1) + " of at most " +
                                    std::to_string(fn.rerecord_limit) + ")");
  }
  CallResult result = record(fn, allocationInputs(fn, inputs), run, key);
  if (rerecord && result.kind == RunKind::kRecord) {  // counted once it succeeded
    st.rerecords++;
    num_rerecords_++;
  }
  return result;
}

void TreeManager::removeNode(TreeNode* node, const std::string& why) {
  while (!node->ownedChildren().empty()) removeNode(node->ownedChildren().back().get(), why);
  pinned_by_node_.erase(node->id());
  live_.invalidateIf(
      [&](int64_t, const LiveOutput& e, const c10::StorageImpl&) { return e.node == node; },
      [&] { return why; });
  TreeNode* parent = node->parent() != nullptr ? node->parent() : &root_;
  const int64_t function_id = node->functionId();
  num_nodes_--;
  parent->removeChild(node);  // destroys node
  if (parent == &root_ && parent->countChildrenOf(function_id) == 0) {
    root_functions_.erase(function_id);
  }
}

// Note [Out of memory]
// An allocation that fails while a warmup, the placeholders or a capture allocate in the pool (the
// device is out of memory, or the pool reached its budget: Note [Memory budget] in Backend.h)
// leaves the tree and the pool as they were: the failed run's tensors are freed as the error
// unwinds (the backend undoes a capture), nothing was published, and the segments the failed run
// added that no checkpoint needs go back to the device. The call then runs eagerly, with the
// reason logged. Under a budget, recordings off the current path are evicted, least recently used
// first, until enough segments came free. The function tries again at a later call once an
// eviction happened (or after reset()); until then it warms up and records nothing and runs
// eagerly, while its existing recordings still replay.
CallResult TreeManager::outOfMemory(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                    const RunFn& run, const char* during, const std::string& what) {
  num_oom_++;
  FunctionState& st = stateOf(fn);
  st.oom_at_evictions = num_evictions_;  // an eviction from here on makes room for a retry
  int64_t freed = bookkeeping_.releaseUnneededSegments(root_);  // what the failed run added
  st.oom_reason = std::string("it ran out of memory while ") + during + " (" + what + ")";
  if (budget_ >= 0) {
    std::string evicted;
    freed += evictForMemory(inputs, &evicted);
    st.oom_reason += evicted.empty() ? "; no recording off the current path (nor one whose outputs "
                                       "this call reads) was left to evict"
                                     : "; evicted " + evicted + " (" + bytesString(freed) +
                                           " returned to the device" +
                                           (backend_->returnsSegments()
                                                ? ""
                                                : ": on this device the budget caps the pool's "
                                                  "growth, and an eviction makes room inside it") +
                                           "), so a later call tries again";
  }
  return runEager(fn, inputs, run, st.oom_reason);
}

int64_t TreeManager::evictForMemory(const std::vector<at::Tensor>& inputs, std::string* evicted) {
  // The bytes the pool lacked, when the backend can tell; otherwise any bytes freed will do.
  const int64_t refused = backend_->refusedBytes();
  const int64_t need =
      refused > 0 ? std::max<int64_t>(1, backend_->stats().reserved_bytes + refused - budget_) : 0;
  // The call's own inputs stay valid: their producers are kept, with the current path.
  std::vector<const TreeNode*> keep(path_.begin(), path_.end());
  for (const auto& t : inputs) {
    const LiveOutput* e = live_.find(t.storage().unsafeGetStorageImpl());
    if (e != nullptr && e->node != nullptr) keep.push_back(e->node);
  }
  int64_t freed = 0;
  while (TreeNode* victim = leastRecentlyUsedExcept(root_, keep)) {
    const std::string what = "node " + std::to_string(victim->id()) + " ('" +
                             victim->functionName() + "', " + bytesString(victim->poolBytes()) +
                             " written)";
    removeNode(victim, "its recording was evicted to stay within the memory budget");
    num_evictions_++;
    const int64_t released = bookkeeping_.releaseUnneededSegments(root_);
    freed += released;
    logMessage(LogLevel::kInfo, "evicted " + what + " to stay within the memory budget of " +
                                    backend_->device().str() + " (" + bytesString(budget_) + "); " +
                                    bytesString(released) + " returned to the device");
    *evicted += (evicted->empty() ? "" : ", ") + what;
    // A backend that returns no segment while the pool lives (CUDA) gains room inside the pool
    // only: one victim per out-of-memory error, the next call tries again.
    if (!backend_->returnsSegments()) break;
    if (need > 0 ? freed >= need : freed > 0) break;
  }
  return freed;
}

bool TreeManager::evictFunction(int64_t function_id, const std::string& why) {
  std::vector<TreeNode*> victims;
  forEachNode(root_, [&](TreeNode& n) {
    if (n.functionId() != function_id) return true;
    victims.push_back(&n);  // its subtree goes with it
    return false;
  });
  for (TreeNode* v : victims) {  // the path holds every ancestor of its nodes
    if (std::find(path_.begin(), path_.end(), v) != path_.end()) return false;
  }
  for (TreeNode* v : victims) {
    const std::string name = v->functionName();
    const int64_t id = v->id();
    removeNode(v, "its recording was evicted: " + why);
    logMessage(LogLevel::kInfo, "evicted node " + std::to_string(id) + " ('" + name + "'): " + why);
  }
  pinned_by_warmup_function_.erase(function_id);
  num_evictions_++;
  return true;
}

void TreeManager::noteFallback(FunctionRecord& fn, const std::string& reason) {
  num_fallbacks_++;
  // Once per callable and reason (its signatures share the base name before '#').
  if (logged_.insert(fn.name.substr(0, fn.name.find('#')) + "\n" + reason).second) {
    logMessage(LogLevel::kWarning, "running '" + fn.name + "' eagerly: " + reason);
  }
}

CallResult TreeManager::runEager(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                 const RunFn& run, const std::string& reason) {
  noteFallback(fn, reason);
  return {run(inputs), RunKind::kEager};
}

// Note [The inputs a run uses]
// Before a warmup or a recording allocates in the pool, prepareToAllocate() may restore the pool
// to a checkpoint; a live output that the restore does not protect is invalidated, and an input
// that is such an output is replaced by a clone first. From then on the call's own argument list
// names tensors that raise "overwritten" when read: every run of the function -- the warmup, the
// capture and each of their eager fallbacks (rejected capture, input mutation, failed checkpoint,
// out of memory) -- must use the prepared list. warmup() and record() therefore receive only the
// prepared list (allocationInputs()), so the caller's list cannot be named by mistake.
std::vector<at::Tensor> TreeManager::allocationInputs(const FunctionRecord& fn,
                                                      const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> ins = inputs;
  bookkeeping_.prepareToAllocate(current_, &ins, fn.is_static);
  return ins;
}

CallResult TreeManager::warmup(FunctionRecord& fn, const std::vector<at::Tensor>& ins,
                               const RunFn& run, bool retried) {
  std::vector<int64_t> unmanaged;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (!fn.is_static[i] && !live_.contains(ins[i].storage().unsafeGetStorageImpl())) {
      unmanaged.push_back(static_cast<int64_t>(i));
    }
  }
  std::vector<at::Tensor> outs;
  int64_t mutated = -1;
  std::string mutating_op;
  try {
    InputMutationCheck mutations(ins, unmanaged);
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    PoolRoutingGuard routing(*backend_);
    outs = run(ins);
    routing.end();
    mutated = mutations.firstMutated(&mutating_op);
  } catch (const c10::OutOfMemoryError& e) {
    outs.clear();
    // Memory the device's allocator caches outside the pool may be enough: one more try.
    if (!retried && backend_->freeCachedMemory()) return warmup(fn, ins, run, /*retried=*/true);
    return outOfMemory(fn, ins, run, "warming it up", e.what_without_backtrace());
  }
  if (mutated >= 0) {
    fn.eager_reason = mutationReason(mutated, mutating_op,
                                     ". Pass it through static_argnums if its address is stable");
    noteFallback(fn, fn.eager_reason);
  }
  std::unordered_set<const c10::StorageImpl*> input_storages;
  for (const auto& t : ins) input_storages.insert(t.storage().unsafeGetStorageImpl());
  for (const auto& t : outs) {
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (input_storages.count(impl) || live_.contains(impl) || impl->nbytes() == 0) continue;
    if (!backend_->inPool(impl->data())) continue;
    live_.track(t.storage(), live_.newSlot(), nullptr, fn.name, copyOnOverwrite(fn), generation_);
  }
  bookkeeping_.moveKeptStateOutOfPool(fn.name);  // Note [Kept state]
  const int warmups = ++stateOf(fn).warmups;
  num_warmups_++;
  state_ = PathState::kWarmup;
  noteGenerationRun(fn);
  logMessage(LogLevel::kDebug, "warmed up '" + fn.name + "' (" + std::to_string(warmups) + "/" +
                                   std::to_string(fn.warmup_iters) + ")");
  return {std::move(outs), RunKind::kWarmup};
}

CallResult TreeManager::record(FunctionRecord& fn, const std::vector<at::Tensor>& ins,
                               const RunFn& run, const CallKey& key, bool retried) {
  live_.pruneGone();

  Recording rec;
  rec.function_id = fn.id;
  rec.function_name = fn.name;
  rec.input_kinds = key.kinds;
  rec.key_ptrs = key.key_ptrs;
  rec.key_hash = key.key_hash;
  rec.graph_device = backend_->device();
  rec.inputs = ins;
  rec.dense.assign(ins.size(), 1);
  try {
    // Placeholders for copied inputs, allocated in the pool (outside the capture).
    PoolRoutingGuard routing(*backend_);
    for (size_t i = 0; i < ins.size(); ++i) {
      if (key.kinds[i] != InputKind::kCopied) continue;
      const at::Tensor& src = ins[i];
      // The placeholder keeps the caller's strides (a compiled graph was made for them), gaps
      // included (a slice such as tokens[:, :-1]); only an input whose elements overlap (an
      // expanded tensor) gets a contiguous placeholder, since nothing can be copied into it.
      rec.dense[i] = TreeNode::elementsDoNotOverlap(src) ? 1 : 0;
      at::Tensor ph = rec.dense[i] ? at::empty_strided(src.sizes(), src.strides(), src.options())
                                   : at::empty(src.sizes(), src.options());
      ph.copy_(src);
      rec.inputs[i] = std::move(ph);
      rec.copied.push_back(static_cast<int64_t>(i));
    }
    routing.end();
  } catch (const c10::OutOfMemoryError& e) {
    rec = Recording();
    if (!retried && backend_->freeCachedMemory()) return record(fn, ins, run, key, true);
    return outOfMemory(fn, ins, run, "copying its inputs for a recording",
                       e.what_without_backtrace());
  }
  int64_t mutated = -1;
  std::string mutating_op;
  std::optional<InputMutationCheck> mutations;
  try {
    mutations.emplace(rec.inputs, rec.copied);
    CaptureScope scope;              // Python's GC paused, host reads watched
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    rec.graph = backend_->capture(run, rec.inputs, &rec.outputs, fn.name, fn.generators);
    mutated = mutations->firstMutated(&mutating_op);
  } catch (const c10::OutOfMemoryError& e) {
    rec = Recording();
    mutations.reset();
    if (!retried && backend_->freeCachedMemory()) return record(fn, ins, run, key, true);
    return outOfMemory(fn, ins, run, "recording it", e.what_without_backtrace());
  } catch (const CaptureRejected& e) {
    // The backend undid the capture; the tree is as it was. See Note [Rejected captures].
    fn.eager_reason = std::string("it cannot be recorded as a graph: ") + e.what();
    // A rejected recording that ran to its end (the CPU emulation) computed the call's results:
    // they are returned rather than running the function again, whose side effects (a
    // collective, on one rank only) would happen twice -- unless the run mutated an input.
    const bool keep = e.ran() && mutations->firstMutated(&mutating_op) < 0;
    mutations.reset();
    if (keep && live_.moveResultsOutOfPool(rec.outputs, rec.inputs, rec.copied)) {
      noteFallback(fn, fn.eager_reason);
      return {std::move(rec.outputs), RunKind::kEager};
    }
    rec = Recording();
    return runEager(fn, ins, run, fn.eager_reason);
  } catch (const std::exception& e) {
    // Note [Errors during a capture]
    // The warmup ran this function on the same kind of inputs without an error, so an error now
    // comes from the capture itself: torch refuses a host read, a pageable host-to-device copy or
    // an unregistered generator with a check before any CUDA call (the stream capture stays
    // valid, the backend ended it cleanly), or the function takes another path when
    // torch.cuda.is_current_stream_capturing() says True. Either way it is a rejected capture:
    // the function runs eagerly from now on, with the reason logged once. Only if the eager run
    // fails too is the error the user's own; then it propagates and the function is not marked
    // eager. A keyboard interrupt, or an error that the run itself turned into an eager reason,
    // propagates as it is.
    if (isInterrupt(e) || !fn.eager_reason.empty()) throw;
    const std::string why = e.what();
    mutations.reset();
    rec = Recording();
    CallResult result{run(ins), RunKind::kEager};
    fn.eager_reason = "it cannot be recorded as a graph: it raised while it was being recorded "
                      "(its warmup ran without an error): " +
                      firstLine(why);
    noteFallback(fn, fn.eager_reason);
    return result;
  }
  if (mutated >= 0) {
    fn.eager_reason = mutationReason(mutated, mutating_op, "");
    return runEager(fn, ins, run, fn.eager_reason);
  }
  // Ancestor outputs that are dead now: a later replay is valid only while they stay dead.
  std::vector<int64_t> must_stay_dead;
  for (TreeNode* p : path_) {
    for (const auto& s : p->slots()) {
      if (!live_.liveInGeneration(s.id, generation_)) must_stay_dead.push_back(s.id);
    }
  }
  std::vector<c10::Storage> slot_storages;
  auto node = TreeNode::fromRecording(
      next_node_id_, current_, std::move(rec), [this] { return live_.newSlot(); },
      [this](const c10::StorageImpl* s) { return live_.contains(s); }, std::move(must_stay_dead),
      &slot_storages);
  // Note [Publishing a node]
  // The checkpoint is taken before the node enters the tree: a checkpoint that throws (c10's
  // refuses blocks with pending cross-stream events) leaves the tree exactly as it was, and the
  // function runs eagerly from then on. Nothing that can fail runs after the node is published.
  try {
    node->publish(bookkeeping_.checkpoint(*node));
  } catch (const std::exception& e) {
    const std::string why = e.what();
    node.reset();
    slot_storages.clear();
    fn.eager_reason = "the pool could not be checkpointed after its recording: " + why;
    return runEager(fn, ins, run, fn.eager_reason);
  }
  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  TreeNode* raw = parent->addChild(std::move(node));
  next_node_id_++;
  num_nodes_++;
  if (current_ == nullptr) root_functions_.insert(fn.id);
  for (size_t k = 0; k < raw->slots().size(); ++k) {
    live_.track(slot_storages[k], raw->slots()[k].id, raw, fn.name, copyOnOverwrite(fn),
                generation_);
  }
  raw->markRun(++use_clock_, /*replayed=*/false);
  path_.push_back(raw);
  current_ = raw;
  state_ = PathState::kRecording;
  bookkeeping_.markExact();
  num_recordings_++;
  noteGenerationRun(fn);
  logMessage(LogLevel::kInfo, "recorded node " + std::to_string(raw->id()) + " for '" + fn.name +
                                  "' under " + whereOf(raw->parent()) + " (" +
                                  std::to_string(raw->copiedInputs().size()) + " copied inputs, " +
                                  std::to_string(raw->slots().size()) + " output blocks, " +
                                  bytesString(raw->poolBytes()) + " written)");
  // Outputs that alias an input the restore had to invalidate alias its clone (Note [The inputs a
  // run uses]).
  return {raw->buildOutputs(slot_storages, ins), RunKind::kRecord};
}

CallResult TreeManager::replay(TreeNode& node, FunctionRecord& fn,
                               const std::vector<at::Tensor>& inputs, const RunFn& run) {
  const c10::Device device = backend_->device();
  const auto& copied = node.copiedInputs();
  std::vector<at::Tensor> sources;
  sources.reserve(copied.size());
  for (int64_t i : copied) {
    const at::Tensor& src = inputs[i];
    const auto begin = reinterpret_cast<uintptr_t>(src.storage().data());
    // A source inside memory this replay writes must be read before anything is written.
    sources.push_back(node.overlapsFootprint(begin, begin + src.storage().nbytes()) ? src.clone()
                                                                                    : src);
  }
  pinned_by_node_.erase(node.id());
  // Note [Footprints and stale outputs]: outputs in memory this replay writes are overwritten now.
  live_.invalidateIf(
      [&](int64_t, const LiveOutput& e, const c10::StorageImpl&) {
        return node.overlapsFootprint(e.ptr, e.ptr + e.nbytes);
      },
      [&] { return "a replay of '" + fn.name + "' wrote to its memory"; });
  bookkeeping_.markStale();
  backend_->copyInputs(node.placeholders(), sources);
  node.graph().replay(run, inputs, copied, node.placeholders());
  std::vector<c10::Storage> storages;
  storages.reserve(node.slots().size());
  for (const auto& s : node.slots()) {
    storages.push_back(nonOwningStorage(s.ptr, s.nbytes, device));
    live_.track(storages.back(), s.id, &node, fn.name, copyOnOverwrite(fn), generation_);
  }
  path_.push_back(&node);
  current_ = &node;
  state_ = PathState::kExecution;
  node.markRun(++use_clock_, /*replayed=*/true);
  fn.replays++;
  num_replays_++;
  noteGenerationRun(fn);
  // Outputs that alias an input this replay overwrote alias its clone instead.
  std::vector<at::Tensor> alias_inputs = inputs;
  for (size_t k = 0; k < copied.size(); ++k) alias_inputs[copied[k]] = sources[k];
  return {node.buildOutputs(storages, alias_inputs), RunKind::kReplay};
}

// ---------------------------------------------------------------------------------------------
// Introspection

TreeInfo TreeManager::snapshot() {
  live_.pruneGone();
  TreeInfo t;
  t.device = backend_->device().str();
  t.thread = owner_;
  t.backend = backend_->name();
  static const char* const kStates[] = {"none", "warmup", "recording", "execution"};
  t.state = kStates[static_cast<int>(state_)];
  t.generation = generation_;
  t.num_nodes = num_nodes_;
  t.num_roots = static_cast<int64_t>(root_.ownedChildren().size());
  t.num_checkpoints = bookkeeping_.restores();
  t.num_rerecords = num_rerecords_;
  t.num_fallbacks = num_fallbacks_;
  t.num_warmups = num_warmups_;
  t.num_recordings = num_recordings_;
  t.num_replays = num_replays_;
  t.num_invalidations = live_.invalidations();
  t.num_evictions = num_evictions_;
  t.num_out_of_memory = num_oom_;
  t.bytes_released = bookkeeping_.bytesReleased();
  t.memory_budget = budget_;
  t.num_migrations = live_.migrations();
  t.pending_backward = pending_forwards_ > 0;
  t.live_outputs = static_cast<int64_t>(live_.size());
  t.current_node = current_ ? current_->id() : -1;
  t.pool = backend_->stats();
  std::vector<const TreeNode*> on_path(path_.begin(), path_.end());
  appendNodeInfos(root_, on_path, live_.liveCountPerNode(), &t.nodes);
  return t;
}

bool TreeManager::checkPoolInvariants(std::string* why) {
  return live_.checkInvariants(bookkeeping_.exact(), why);
}

}  // namespace graphtrees
