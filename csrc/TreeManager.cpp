#include "TreeManager.h"

#include "AutocastState.h"
#include "BackendCall.h"
#include "CaptureObserver.h"
#include "FailureInjection.h"
#include "InputMutationCheck.h"
#include "Logging.h"
#include "PlaceholderViewCheck.h"
#include "PythonHooks.h"
#include "ThreadState.h"
#include "WriteBack.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace graphtrees {
namespace {

const char* kindName(RunKind k) {
  static const char* const kNames[] = {"eager", "warmup", "record", "replay"};
  return kNames[static_cast<int>(k)];
}

std::string whereOf(const TreeNode* node) {
  return node ? "node " + std::to_string(node->id()) : "the root";
}
}  // namespace

TreeManager::TreeManager(std::unique_ptr<Backend> backend, int64_t owner, StepCounter steps)
    : backend_(std::move(backend)),
      owner_(owner),
      policy_(std::move(steps)),
      live_(*backend_, counters_),
      bookkeeping_(*backend_, live_, counters_),
      root_(-1, nullptr) {}

TreeManager::~TreeManager() {
  try {
    close();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning, std::string("freeing the tree of ") +
                                           backend_->device().str() + ": " + e.what());
  }
}

void TreeManager::close() {
  std::lock_guard<TreeLock> lock(lock_);
  if (closed_) return;
  closed_ = true;
  pinned_by_node_.clear();
  pinned_by_warmup_function_.clear();
  runOrdered(*backend_, [&] { live_.invalidateAll("graphtrees.reset() freed the pool"); });
  path_.clear();
  current_ = nullptr;
  root_.clearChildren();    // graphs first: they may hold references to the pool
  backend_->releasePool();  // may throw, after the pool is released
}

FunctionState& TreeManager::stateOf(FunctionRecord& fn) {
  // Looked up here on every call: a record is shared by every thread's tree, and a cache on
  // it would be switched by another thread while this one replays without the GIL.
  return functions_[fn.id];
}

// Ends the current path (Note [Ending a path] in PathPolicy.cpp): the step's pool outputs are
// freed and invalidated, except `spare` (the current call's inputs).
void TreeManager::endPath(const PathEnd& why, const std::vector<at::Tensor>& spare) {
  pinned_by_node_.clear();
  pinned_by_warmup_function_.clear();
  std::unordered_set<const c10::StorageImpl*> spared;
  for (const auto& t : spare) spared.insert(t.storage().unsafeGetStorageImpl());
  for (const void* s : sparedInputs()) {  // Note [Inputs of a split graph] in ThreadState.h
    spared.insert(static_cast<const c10::StorageImpl*>(s));
  }
  live_.invalidateIf(
      [&](int64_t, const LiveOutput&, const c10::StorageImpl& storage) {
        return live_.ownsPoolBlock(storage) && !spared.count(&storage);
      },
      [&] { return "a new step began: " + why.text(); });
  if (current_ != nullptr || state_ != PathState::kNone) {
    GRAPHTREES_LOG(LogLevel::kDebug, "path ended: " + why.text());
  }
  path_.clear();
  current_ = nullptr;
  state_ = PathState::kNone;
  policy_.pathEnded();
  live_.startGeneration();
}

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
    if (e == nullptr || e->generation != policy_.generation()) continue;
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

CallResult TreeManager::call(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                             const RunFn& run) {
  CallDepthGuard depth(static_cast<int>(device().type()));
  BackendCall backend_call(*backend_);  // Note [Streams of the pool] in cuda/PoolStreams.cpp
  CallResult result = callImpl(fn, inputs, run);
  backend_call.end();
  finishRun(fn, result);
  return result;
}

void TreeManager::finishRun(FunctionRecord& fn, const CallResult& result) {
  policy_.noteFinished(fn, result.kind);
  if (fn.mode == FunctionMode::kBackward) {
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

  if (auto why = policy_.stepBegan()) endPath(*why, inputs);
  if ((state_ == PathState::kWarmup || state_ == PathState::kRecording) &&
      !live_.anyLiveInGeneration(policy_.generation())) {
    endPath("every output of the current path is dead", inputs);
  }
  CallKey key = keyOf(fn, inputs);
  if (auto why = policy_.calledAgain(fn, key.consumes_generation_output)) {
    endPath(*why, inputs);
    key = keyOf(fn, inputs);
  }
  const bool out_of_memory =  // it tries again once an eviction may have made room
      (st.oom_at_evictions >= 0 && st.oom_at_evictions == counters_.num_evictions) ||
      (st.oom_at_budget >= 0 && st.oom_at_budget == budget_epoch_);
  std::string eager = out_of_memory ? st.oom_reason : CaptureObserver::blindReason();
  const auto runsEagerly = [&] {  // asked only of a warmup or a recording, which need the device
    if (eager.empty()) eager = backend_->awaitCapturesElsewhere();  // Note [Locks around user code]
    return !eager.empty();
  };
  if (state_ == PathState::kWarmup || st.warmups < fn.options->warmup_iters) {
    if (runsEagerly()) return runEager(fn, inputs, run, eager);
    CallRange range(CallRange::Kind::kWarmup, backend_.get(), fn.name, -1);  // Note [Call ranges]
    return warmup(fn, allocationInputs(fn, inputs), run);
  }
  std::string mismatch;
  TreeNode* node = findChild(fn, key, &mismatch);
  if (node == nullptr && current_ != nullptr && root_functions_.count(fn.id) &&
      !live_.anyLiveInGeneration(policy_.generation())) {
    endPath("every output of the current path is dead", inputs);
    key = keyOf(fn, inputs);
    mismatch.clear();
    node = findChild(fn, key, &mismatch);
  }
  if (node != nullptr) return replay(*node, fn, inputs, run);
  if (runsEagerly()) return runEager(fn, inputs, run, eager);

  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  // A recording that replaces one that could never replay again is not churn.
  const bool rerecord = !replaceStaleRecordings(*parent, fn) && parent->countChildrenOf(fn.id) > 0;
  if (rerecord) {
    if (mismatch.empty()) mismatch = "no recording matches the inputs";
    if (st.rerecords >= fn.options->rerecord_limit) {
      fn.eager_reason = "it was re-recorded " + std::to_string(st.rerecords) +
                        " times (rerecord_limit=" + std::to_string(fn.options->rerecord_limit) +
                        "), last because " + mismatch;
      return runEager(fn, inputs, run, fn.eager_reason);
    }
    GRAPHTREES_LOG(LogLevel::kInfo, "re-recording '" + fn.name + "' under " + whereOf(current_) +
                                        " because " + mismatch + " (re-record " +
                                        std::to_string(st.rerecords + 1) + " of at most " +
                                        std::to_string(fn.options->rerecord_limit) + ")");
  }
  CallRange range(CallRange::Kind::kRecord, backend_.get(), fn.name, next_node_id_);
  CallResult result = record(fn, allocationInputs(fn, inputs), run, key);
  if (rerecord && result.kind == RunKind::kRecord) {  // counted once it succeeded
    st.rerecords++;
    counters_.num_rerecords++;
  }
  return result;
}

bool TreeManager::replaceStaleRecordings(TreeNode& parent, const FunctionRecord& fn) {
  std::vector<TreeNode*> stale;
  for (const auto& c : parent.ownedChildren()) {
    if (c->functionId() == fn.id && !c->staticInputsAlive()) stale.push_back(c.get());
  }
  for (TreeNode* n : stale) {
    const int64_t id = n->id();
    removeNode(n, "its static inputs were freed, so it could never replay again");
    GRAPHTREES_LOG(LogLevel::kInfo, "replaced node " + std::to_string(id) + " ('" + fn.name +
                                        "'): its static inputs were freed");
  }
  return !stale.empty();
}

void TreeManager::removeNode(TreeNode* node, const std::string& why) {
  while (!node->ownedChildren().empty()) removeNode(node->ownedChildren().back().get(), why);
  pinned_by_node_.erase(node->id());
  live_.invalidateIf(
      [&](int64_t, const LiveOutput& e, const c10::StorageImpl&) { return e.node == node; },
      [&] { return why; });
  TreeNode* parent = node->parent() != nullptr ? node->parent() : &root_;
  const int64_t function_id = node->functionId();
  counters_.num_nodes--;
  parent->removeChild(node);  // destroys node
  if (parent == &root_ && parent->countChildrenOf(function_id) == 0) {
    root_functions_.erase(function_id);
  }
}

CallResult TreeManager::outOfMemory(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                    const RunFn& run, const char* during, const std::string& what) {
  counters_.num_out_of_memory++;
  FunctionState& st = stateOf(fn);
  st.oom_at_evictions = counters_.num_evictions;  // an eviction from here on makes room for a retry
  int64_t freed = bookkeeping_.releaseUnneededSegments(root_);  // what the failed run added
  st.oom_reason = std::string("it ran out of memory while ") + during + " (" + what + ")";
  if (budget_ >= 0 && !backend_->returnsSegments()) {
    st.oom_at_evictions = -1;  // Note [Out of memory]: no eviction can make room here
    st.oom_at_budget = budget_epoch_;
    st.oom_reason += "; the pool is at its memory budget of " + bytesString(budget_) +
                     ", and on this device evicting recordings gives no memory back while the "
                     "tree lives, so nothing was evicted: it runs eagerly until "
                     "graphtrees.set_memory_budget() changes the budget or graphtrees.reset()";
  } else if (budget_ >= 0) {
    std::string evicted;
    freed += evictForMemory(inputs, &evicted);
    st.oom_reason += evicted.empty() ? "; no recording off the current path (nor one whose outputs "
                                       "this call reads) was left to evict"
                                     : "; evicted " + evicted + " (" + bytesString(freed) +
                                           " returned to the device), so a later call tries again";
  }
  return runEager(fn, inputs, run, st.oom_reason);
}

int64_t TreeManager::evictForMemory(const std::vector<at::Tensor>& inputs, std::string* evicted) {
  TORCH_INTERNAL_ASSERT(backend_->returnsSegments(), "evicting for memory frees nothing here");
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
    counters_.num_evictions++;
    const int64_t released = bookkeeping_.releaseUnneededSegments(root_);
    freed += released;
    GRAPHTREES_LOG(LogLevel::kInfo, "evicted " + what + " to stay within the memory budget of " +
                                        backend_->device().str() + " (" + bytesString(budget_) +
                                        "); " + bytesString(released) + " returned to the device");
    *evicted += (evicted->empty() ? "" : ", ") + what;
    if (need > 0 ? freed >= need : freed > 0) break;
  }
  return freed;
}

bool TreeManager::evictFunction(int64_t function_id, const std::string& why, bool later) {
  if (lock_.callInFlight() || deviceCapturingElsewhere()) {  // TreeLock.h, DeviceLock.h Notes
    pending_evictions_.emplace_back(function_id, why);
    return true;
  }
  std::vector<TreeNode*> victims;
  forEachNode(root_, [&](TreeNode& n) {
    if (n.functionId() != function_id) return true;
    victims.push_back(&n);  // its subtree goes with it
    return false;
  });
  for (TreeNode* v : victims) {  // the path holds every ancestor of its nodes
    if (std::find(path_.begin(), path_.end(), v) == path_.end()) continue;
    if (later) pending_evictions_.emplace_back(function_id, why);
    return later;
  }
  runOrdered(*backend_, [&] {  // migrations of outputs (on_overwrite="copy") outside a call
    for (TreeNode* v : victims) {
      GRAPHTREES_LOG(LogLevel::kInfo, "evicted node " + std::to_string(v->id()) + " ('" +
                                          v->functionName() + "'): " + why);
      removeNode(v, "its recording was evicted: " + why);
    }
  });
  pinned_by_warmup_function_.erase(function_id);
  functions_.erase(function_id);  // its state here (warmups, generators): it never runs again
  counters_.num_evictions++;
  return true;
}

void TreeManager::noteFallback(FunctionRecord& fn, const std::string& reason) {
  counters_.num_fallbacks++;
  // Once per callable and reason (its signatures share the base name before '#').
  if (logged_.insert(fn.name.substr(0, fn.name.find('#')) + "\n" + reason).second) {
    GRAPHTREES_LOG(LogLevel::kWarning, "running '" + fn.name + "' eagerly: " + reason);
  }
}

CallResult TreeManager::runEager(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                 const RunFn& run, const std::string& reason) {
  noteFallback(fn, reason);
  CallRange range(CallRange::Kind::kEager, backend_.get(), fn.name, -1, reason);
  return {run(inputs), RunKind::kEager, nullptr, reason};
}

std::vector<at::Tensor> TreeManager::allocationInputs(const FunctionRecord& fn,
                                                      const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> ins = inputs;
  bookkeeping_.prepareToAllocate(current_, &ins, fn.is_static, fn.aliases);
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
  WriteBackRefusal refused;
  CaptureObserver observer(/*watch_forks=*/true);  // Note [One capture observer]
  try {
    InputMutationCheck mutations(ins, unmanaged);
    DrawnGenerators drawn(backend_->device().type(), &stateOf(fn).drawn_generators);
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    PoolRoutingGuard routing(*backend_);
    outs = backend_->runRouted(run, ins);
    routing.end();
    // On the caller's tensors: one that can be written back is mutated as eagerly (WriteBack.h).
    WriteBack::decide(mutations, ins, unmanaged, fn.aliases, /*ran=*/nullptr, &refused);
  } catch (const c10::OutOfMemoryError& e) {
    outs.clear();
    // Memory the device's allocator caches outside the pool may be enough: one more try.
    if (retryAfterFreeingCache(retried)) return warmup(fn, ins, run, /*retried=*/true);
    return outOfMemory(fn, ins, run, "warming it up", e.what_without_backtrace());
  }
  if (const std::string why = observer.refusal(); refused.refused() || !why.empty()) {
    fn.eager_reason =
        why.empty() ? refused.reason(". Pass it through static_argnums if its address is stable")
                    : "it cannot be recorded as a graph: " + why;
    noteFallback(fn, fn.eager_reason);
  }
  live_.trackWarmupOutputs(outs, ins, fn.name, copyOnOverwrite(fn), policy_.generation());
  bookkeeping_.moveKeptStateOutOfPool(fn.name);  // Note [Kept state]
  const int warmups = ++stateOf(fn).warmups;
  counters_.num_warmups++;
  state_ = PathState::kWarmup;
  policy_.noteRun(fn);
  GRAPHTREES_LOG(LogLevel::kDebug, "warmed up '" + fn.name + "' (" + std::to_string(warmups) + "/" +
                                       std::to_string(fn.options->warmup_iters) + ")");
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
  CallResult fallback;
  if (!copyIntoPlaceholders(fn, ins, run, key, retried, &rec, &fallback)) return fallback;
  if (!capture(fn, ins, run, key, retried, &rec, &fallback)) return fallback;
  return publish(fn, ins, run, std::move(rec));
}

bool TreeManager::copyIntoPlaceholders(FunctionRecord& fn, const std::vector<at::Tensor>& ins,
                                       const RunFn& run, const CallKey& key, bool retried,
                                       Recording* rec, CallResult* fallback) {
  try {
    // Allocated in the pool, outside the capture.
    PoolRoutingGuard routing(*backend_);
    rec->plan = InputPlan::record(ins, key.kinds, fn.aliases, &rec->inputs);
    routing.end();
    return true;
  } catch (const c10::OutOfMemoryError& e) {
    *rec = Recording();
    *fallback = retryAfterFreeingCache(retried)
                    ? record(fn, ins, run, key, /*retried=*/true)
                    : outOfMemory(fn, ins, run, "copying its inputs for a recording",
                                  e.what_without_backtrace());
    return false;
  }
}

bool TreeManager::capture(FunctionRecord& fn, const std::vector<at::Tensor>& ins, const RunFn& run,
                          const CallKey& key, bool retried, Recording* rec, CallResult* fallback) {
  WriteBackRefusal refused;
  CaptureObserver observer(/*watch_forks=*/true);  // Note [One capture observer]
  std::optional<InputMutationCheck> mutations;
  try {
    mutations.emplace(rec->inputs, rec->plan.copied());
    CaptureScope scope;              // Python's GC paused, host reads watched
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    PlaceholderViewCheck views(ins, rec->inputs, rec->plan.copied(), rec->plan.dense());
    rec->graph = backend_->capture(run, rec->inputs, &rec->outputs, captureSpec(fn, stateOf(fn)));
    if (!observer.refusal().empty()) throw CaptureRejected(observer.refusal());  // views too
    // The placeholders ran: those that can be are written back (Note in WriteBack.h).
    rec->plan.setWriteBack(
        WriteBack::decide(*mutations, ins, rec->plan.copied(), fn.aliases, &rec->inputs, &refused));
  } catch (const c10::OutOfMemoryError& e) {
    *rec = Recording();
    mutations.reset();
    *fallback = retryAfterFreeingCache(retried)
                    ? record(fn, ins, run, key, /*retried=*/true)
                    : outOfMemory(fn, ins, run, "recording it", e.what_without_backtrace());
    return false;
  } catch (const CaptureRejected& e) {
    // The backend undid the capture; the tree is as it was. See Note [Rejected captures].
    fn.eager_reason = std::string("it cannot be recorded as a graph: ") + e.what();
    // A rejected recording that ran to its end (the CPU emulation) computed the call's results:
    // they are returned rather than running the function again, whose side effects (a
    // collective, on one rank only) would happen twice -- unless the run mutated an input, in
    // any way WriteBack can tell (a write through DLPack moves no counter and no op shows it).
    WriteBackRefusal no;
    const bool keep = e.ran() && !WriteBack::mutatedAny(*mutations, ins, rec->plan.copied(),
                                                        fn.aliases, rec->inputs, &no);
    mutations.reset();
    if (keep && live_.moveResultsOutOfPool(rec->outputs, rec->inputs, rec->plan.copied())) {
      noteFallback(fn, fn.eager_reason);
      *fallback = {std::move(rec->outputs), RunKind::kEager};
    } else {
      *rec = Recording();
      *fallback = runEager(fn, ins, run, fn.eager_reason);
    }
    return false;
  } catch (const std::exception& e) {
    // Note [Errors during a capture] in TreeManager.h.
    if (propagatesAsIs(e) || !fn.eager_reason.empty()) throw;
    const std::string why = e.what();
    mutations.reset();
    *rec = Recording();
    *fallback = {run(ins), RunKind::kEager};
    fn.eager_reason =
        "it cannot be recorded as a graph: it raised while it was being recorded "
        "(its warmup ran without an error): " +
        why.substr(0, why.find('\n'));
    noteFallback(fn, fn.eager_reason);
    return false;
  }
  if (!refused.refused()) return true;  // the write-back of the recording call is publish()'s
  fn.eager_reason = refused.reason("");
  *rec = Recording();
  *fallback = runEager(fn, ins, run, fn.eager_reason);
  return false;
}

CallResult TreeManager::publish(FunctionRecord& fn, const std::vector<at::Tensor>& ins,
                                const RunFn& run, Recording&& rec) {
  std::shared_ptr<Checkpoint> pool_state;  // Note [Publishing a node] in TreeManager.h
  try {
    pool_state = bookkeeping_.checkpointPool();
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    fn.eager_reason = std::string("the pool could not be checkpointed after its recording: ") +
                      (c10_error ? c10_error->what_without_backtrace() : e.what());
    if (live_.moveResultsOutOfPool(rec.outputs, rec.inputs, rec.plan.copied())) {
      noteFallback(fn, fn.eager_reason);
      rec.plan.writeBackRecording(ins);  // the run's mutations of copied inputs, as eagerly
      return {std::move(rec.outputs), RunKind::kEager};
    }
    rec = Recording();
    return runEager(fn, ins, run, fn.eager_reason);
  }
  // Ancestor outputs that are dead now: a later replay is valid only while they stay dead.
  std::vector<int64_t> must_stay_dead;
  for (TreeNode* p : path_) {
    for (const auto& s : p->slots()) {
      if (!live_.liveInGeneration(s.id, policy_.generation())) must_stay_dead.push_back(s.id);
    }
  }
  std::vector<c10::Storage> slot_storages;
  auto node = TreeNode::fromRecording(
      next_node_id_, current_, std::move(rec), [this] { return live_.newSlot(); },
      [this](const c10::StorageImpl* s) { return live_.contains(s); }, std::move(must_stay_dead),
      &slot_storages);
  node->publish(bookkeeping_.checkpoint(std::move(pool_state), *node));
  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  TreeNode* raw = parent->addChild(std::move(node));
  next_node_id_++;
  counters_.num_nodes++;
  if (current_ == nullptr) root_functions_.insert(fn.id);
  for (size_t k = 0; k < raw->slots().size(); ++k) {
    live_.track(slot_storages[k], raw->slots()[k].id, raw, fn.name, copyOnOverwrite(fn),
                policy_.generation());
  }
  raw->markRun(++use_clock_, /*replayed=*/false);
  path_.push_back(raw);
  current_ = raw;
  state_ = PathState::kRecording;
  bookkeeping_.markExact();
  counters_.num_recordings++;
  policy_.noteRun(fn);
  const InputPlan& plan = raw->inputPlan();
  const size_t written_back = plan.writeBack().size();
  GRAPHTREES_LOG(
      LogLevel::kInfo,
      "recorded node " + std::to_string(raw->id()) + " for '" + fn.name + "' under " +
          whereOf(raw->parent()) + " (" + std::to_string(plan.copied().size()) +
          " copied inputs, " +
          (written_back == 0 ? std::string() : std::to_string(written_back) + " written back, ") +
          std::to_string(raw->slots().size()) + " output blocks, " + bytesString(raw->poolBytes()) +
          " written)");
  // The recording's mutations of copied inputs reach the caller (`ins`: what it holds, Note
  // [Copied inputs written back]) now that no fallback can follow.
  plan.writeBackRecording(ins);
  // Outputs aliasing an input a restore invalidated alias its clone: Note [The inputs a run uses].
  return {raw->buildOutputs(slot_storages, ins), RunKind::kRecord};
}

CallResult TreeManager::replay(TreeNode& node, FunctionRecord& fn,
                               const std::vector<at::Tensor>& inputs, const RunFn& run) {
  CallRange range(CallRange::Kind::kReplay, backend_.get(), fn.name, node.id());
  const c10::Device device = backend_->device();
  const InputPlan& plan = node.inputPlan();  // Note [A call's inputs] in InputPlan.h
  const auto written = [&node](uintptr_t b, uintptr_t e) { return node.overlapsFootprint(b, e); };
  // Read before anything is written or invalidated (Note [Copied inputs written back]).
  const std::vector<at::Tensor> sources = plan.sources(inputs, written);
  pinned_by_node_.erase(node.id());
  // Note [Footprints and stale outputs]: outputs in memory this replay writes are overwritten now.
  live_.invalidateIf(
      [&](int64_t, const LiveOutput& e, const c10::StorageImpl&) {
        return node.overlapsFootprint(e.ptr, e.ptr + e.nbytes);
      },
      [&] { return "a replay of '" + fn.name + "' wrote to its memory"; });
  bookkeeping_.markStale();
  std::vector<at::Tensor> targets;
  try {
    plan.copyIn(*backend_, sources);
    node.graph().replay(run, inputs, plan.copied(), plan.placeholders());
    // What the caller holds now: its own tensor, unless it was invalidated (then the clone the
    // replay read), which the write-back fills and outputs aliasing the input alias.
    targets = plan.writeBack(inputs, sources, written);
  } catch (const c10::OutOfMemoryError&) {
    throw;  // Note [Out of memory]: a later call may find room
  } catch (const c10::Error& e) {
    // Note [A failed replay] in TreeManager.h: graphtrees' own steps failed (an error of the
    // user's code comes back as a Python error, and is the user's).
    if (fn.eager_reason.empty()) {
      const std::string why = e.what_without_backtrace();
      fn.eager_reason = "its replay failed: " + why.substr(0, why.find('\n'));
      noteFallback(fn, fn.eager_reason);
    }
    throw;
  }
  counters_.num_program_replays += node.graph().replaysProgram() ? 1 : 0;
  std::vector<c10::Storage> storages;
  storages.reserve(node.slots().size());
  for (const auto& s : node.slots()) {
    storages.push_back(nonOwningStorage(s.ptr, s.nbytes, device));
    live_.track(storages.back(), s.id, &node, fn.name, copyOnOverwrite(fn), policy_.generation());
  }
  path_.push_back(&node);
  current_ = &node;
  state_ = PathState::kExecution;
  node.markRun(++use_clock_, /*replayed=*/true);
  fn.replays++;
  counters_.num_replays++;
  policy_.noteRun(fn);
  return {node.buildOutputs(storages, targets), RunKind::kReplay, node.sharedGraph()};
}

}  // namespace graphtrees
