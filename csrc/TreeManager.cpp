#include "TreeManager.h"

#include "AutocastState.h"
#include "Hooks.h"
#include "Logging.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/UniqueVoidPtr.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <sstream>

namespace graphtrees {

namespace {

// A function called again in the generation it already ran in, on an output of that generation,
// extends the path (an unrolled loop); after this many runs the path restarts instead, so that a
// feedback loop `h = f(h)` reuses a bounded chain of recordings rather than recording forever.
constexpr int kMaxRunsPerGeneration = 16;
// While a backward is pending, how often one callable may run on fresh inputs in one step (e.g.
// micro-batches before their backward) before a new step is forced.
constexpr int kMaxPendingRuns = 64;

std::mutex& registryMutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::shared_ptr<TreeManager>>& registry() {
  static std::map<std::string, std::shared_ptr<TreeManager>> trees;
  return trees;
}
std::vector<std::shared_ptr<TreeManager>>& retiredTrees() {
  static std::vector<std::shared_ptr<TreeManager>> trees;
  return trees;
}
std::map<std::string, int64_t>& retiredCounts() {
  static std::map<std::string, int64_t> counts;
  return counts;
}
// Bytes of pool memory that failed restores left unreachable until reset(), per device.
std::map<std::string, int64_t>& leakedBytes() {
  static std::map<std::string, int64_t> bytes;
  return bytes;
}
std::atomic<int64_t> g_step{0};
std::atomic<uint64_t> g_epoch{1};
thread_local int tls_call_depth = 0;
std::atomic<bool> g_debug_checks{false};

std::function<void()>& gcHook() {
  static std::function<void()> hook;
  return hook;
}

class CallDepthGuard {
 public:
  CallDepthGuard() { ++tls_call_depth; }
  ~CallDepthGuard() { --tls_call_depth; }
};

// Routes this thread's allocations into the pool. end() ends the routing on the success path and
// lets its errors (an asynchronous device error surfacing at the synchronisation) propagate; on
// the error path the destructor ends it and turns its errors into a warning, so that the
// original error is the one that propagates.
class PoolRoutingGuard {
 public:
  explicit PoolRoutingGuard(Backend& backend) : backend_(backend) {
    backend_.beginAllocateToPool();
  }
  void end() {
    active_ = false;
    backend_.endAllocateToPool();
  }
  ~PoolRoutingGuard() {
    if (!active_) return;
    try {
      backend_.endAllocateToPool();
    } catch (const std::exception& e) {
      logMessage(LogLevel::kWarning,
                 std::string("ending the pool routing after an error failed too: ") + e.what());
    }
  }
  PoolRoutingGuard(const PoolRoutingGuard&) = delete;
  PoolRoutingGuard& operator=(const PoolRoutingGuard&) = delete;

 private:
  Backend& backend_;
  bool active_ = true;
};

// Note [Autocast and recordings]
// Under autocast with its cache enabled, a cast of a leaf tensor that requires grad (a parameter)
// is made once per autocast region and cached. A warmup would leave that cache's copies in the
// pool, untracked, and a capture would reuse them instead of recording the casts: the graph would
// read memory that is freed and reused when the region ends, and never see parameter updates.
// Warmups, captures and replays therefore run with the cache disabled (the casts become part of
// the recording), and the autocast state is part of the call signature (GraphedCallable).
class AutocastCacheOff {
 public:
  AutocastCacheOff() : prev_(at::autocast::is_autocast_cache_enabled()) {
    if (prev_) at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() {
    if (prev_) at::autocast::set_autocast_cache_enabled(true);
  }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool prev_;
};

const char* kindName(RunKind k) {
  switch (k) {
    case RunKind::kEager:
      return "eager";
    case RunKind::kWarmup:
      return "warmup";
    case RunKind::kRecord:
      return "record";
    case RunKind::kReplay:
      return "replay";
  }
  return "?";
}

std::string overwriteMessage(const std::string& producer, const std::string& by) {
  return "graphtrees: this tensor was returned by a run of '" + producer +
         "' and has been overwritten by a subsequent run (" + by +
         "). Its memory belongs to graphtrees' pool, which later runs reuse. Call .clone() on "
         "outputs you need to keep before running graphed functions again; "
         "graphtrees.mark_step_begin() marks where a new step starts.";
}

c10::Storage nonOwningStorage(uintptr_t ptr, size_t nbytes, c10::Device device) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                      c10::DataPtr(reinterpret_cast<void*>(ptr), device),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

std::string bytesString(int64_t n) {
  std::ostringstream os;
  if (n >= (1 << 20)) {
    os.precision(1);
    os << std::fixed << static_cast<double>(n) / (1 << 20) << " MiB";
  } else if (n >= 1024) {
    os.precision(1);
    os << std::fixed << static_cast<double>(n) / 1024 << " KiB";
  } else {
    os << n << " B";
  }
  return os.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Registry

std::shared_ptr<TreeManager> TreeManager::get(c10::Device device, bool create,
                                              std::string* why_not) {
  const std::string key = device.str();
  std::shared_ptr<TreeManager> tree;
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    auto& trees = registry();
    auto it = trees.find(key);
    if (it != trees.end()) return it->second;
    if (!create) return nullptr;
    std::string reason;
    auto backend = makeBackend(device, &reason);
    if (!backend) {
      if (why_not) *why_not = reason;
      return nullptr;
    }
    tree = std::make_shared<TreeManager>(std::move(backend));
    trees.emplace(key, tree);
  }
  // Logged outside the registry's lock: the log sink takes the GIL.
  logMessage(LogLevel::kDebug,
             "created the tree for " + key + " (backend " + tree->backend_->name() + ")");
  return tree;
}

void TreeManager::resetAll() {
  TORCH_CHECK(!inCall(),
              "graphtrees.reset() (or torch._dynamo.reset()) was called from inside a graphed "
              "function's run; call it between graphed calls.");
  std::vector<std::shared_ptr<TreeManager>> trees;
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    for (auto& kv : registry()) trees.push_back(std::move(kv.second));
    registry().clear();
    for (auto& t : retiredTrees()) trees.push_back(std::move(t));
    retiredTrees().clear();
    retiredCounts().clear();
    leakedBytes().clear();
    g_epoch++;
  }
  // Trees nobody else holds are closed here, so that an error of their teardown (an asynchronous
  // device error surfacing at the final synchronisation) reaches the caller. A tree that a call on
  // another thread is using goes when that call ends (its destructor warns instead).
  std::string error;
  for (auto& tree : trees) {
    if (tree.use_count() != 1) continue;
    try {
      tree->close();
    } catch (const c10::Error& e) {
      if (error.empty()) error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  trees.clear();
  TORCH_CHECK(error.empty(), "graphtrees.reset(): every tree was freed, but ", error);
}

void TreeManager::retire(TreeManager* tree, const std::string& why) {
  const std::string key = tree->device().str();
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    auto it = registry().find(key);
    if (it == registry().end() || it->second.get() != tree) return;  // already retired
    retiredTrees().push_back(std::move(it->second));
    registry().erase(it);
    retiredCounts()[key]++;
    g_epoch++;  // function records start afresh (warmup included) in the new tree
  }
  logMessage(LogLevel::kWarning,
             "restoring the pool of the " + key + " tree failed (" + why +
                 "); recording into a fresh pool from now on. The old tree's recordings and "
                 "outputs stay valid until graphtrees.reset().");
}

void TreeManager::failNextRestores(int n) {
  injectFailure(FailurePoint::kRestore, n);
}

void TreeManager::markStepBegin() {
  g_step++;
}

uint64_t TreeManager::epoch() {
  return g_epoch.load();
}

bool TreeManager::inCall() {
  return tls_call_depth > 0;
}

void TreeManager::setCollectGarbageHook(std::function<void()> hook) {
  gcHook() = std::move(hook);
}

void TreeManager::setDebugChecks(bool on) {
  g_debug_checks = on;
}

TreeManager::TreeManager(std::unique_ptr<Backend> backend)
    : backend_(std::move(backend)), root_(-1, nullptr), seen_step_(g_step.load()) {}

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
  pinned_.clear();
  for (auto& kv : live_) {
    try {
      invalidate(kv.second, "graphtrees.reset() freed the pool");
    } catch (const std::exception& e) {
      logMessage(LogLevel::kWarning, std::string("reset: ") + e.what());
    }
  }
  live_.clear();
  slot_of_.clear();
  path_.clear();
  current_ = nullptr;
  root_.clearChildren();   // graphs first: they may hold references to the pool
  backend_->releasePool();  // may throw, after the pool is released
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping helpers

void TreeManager::resetFunctionIfStale(FunctionRecord& fn) {
  const uint64_t e = epoch();
  if (fn.epoch == e) return;
  fn.epoch = e;
  fn.warmups = 0;
  fn.rerecords = 0;
  if (fn.callable->epoch != e) *fn.callable = CallableState{e, -1, 0};
}

bool TreeManager::ownsPoolBlock(const c10::StorageImpl& storage) const {
  return storage.data_ptr().get_deleter() == backend_->poolDeleter();
}

bool TreeManager::disown(c10::StorageImpl& storage) const {
  if (!ownsPoolBlock(storage)) return false;
  const bool swapped = storage.mutable_data_ptr().compare_exchange_deleter(
      backend_->poolDeleter(), &c10::detail::deleteNothing);
  TORCH_INTERNAL_ASSERT(swapped, "expected the pool's deleter");
  return true;
}

void TreeManager::trackStorage(const c10::Storage& storage, int64_t slot, TreeNode* node,
                               const FunctionRecord& fn) {
  Tracked t;
  t.weak = storage.getWeakStorageImpl();
  t.ptr = reinterpret_cast<uintptr_t>(storage.data());
  t.nbytes = storage.nbytes();
  t.generation = generation_;
  t.node = node;
  t.producer = fn.name;
  t.migrate = fn.mode == FunctionRecord::Mode::kBackward;
  auto old = live_.find(slot);
  if (old != live_.end()) eraseEntry(old);
  live_.emplace(slot, std::move(t));
  slot_of_[storage.unsafeGetStorageImpl()] = slot;
  generation_slots_.push_back(slot);
}

TreeManager::LiveMap::iterator TreeManager::eraseEntry(LiveMap::iterator it) {
  slot_of_.erase(it->second.weak._unsafe_get_target());
  return live_.erase(it);
}

bool TreeManager::gone(const Tracked& entry) {
  auto strong = entry.weak.lock();
  return !strong || strong->data_ptr().get() != reinterpret_cast<void*>(entry.ptr);
}

void TreeManager::pruneDead() {
  for (auto it = live_.begin(); it != live_.end();) {
    it = gone(it->second) ? eraseEntry(it) : std::next(it);
  }
}

void TreeManager::migrate(const Tracked& entry) {
  auto strong = entry.weak.lock();
  const c10::Device device = backend_->device();
  c10::DataPtr fresh = c10::GetAllocator(device.type())->allocate(entry.nbytes);
  TensorMeta bytes;
  bytes.sizes = {static_cast<int64_t>(entry.nbytes)};
  bytes.strides = {1};
  bytes.dtype = c10::ScalarType::Byte;
  bytes.device = device;
  makeTensor(nonOwningStorage(reinterpret_cast<uintptr_t>(fresh.get()), entry.nbytes, device),
             bytes)
      .copy_(makeTensor(nonOwningStorage(entry.ptr, entry.nbytes, device), bytes));
  if (disown(*strong)) backend_->freeBlock(reinterpret_cast<void*>(entry.ptr));
  strong->set_data_ptr_noswap(std::move(fresh));
  num_migrations_++;
}

void TreeManager::invalidate(const Tracked& entry, const std::string& by) {
  auto strong = entry.weak.lock();
  if (!strong || gone(entry)) return;  // dead, or moved out of the pool: nothing to overwrite
  if (entry.migrate && entry.nbytes > 0) {
    migrate(entry);  // a gradient someone still holds (e.g. as .grad): keep its value
    return;
  }
  if (disown(*strong)) backend_->freeBlock(reinterpret_cast<void*>(entry.ptr));
  strong->release_data_and_set_meta_custom_data_ptr_error_msg_(
      overwriteMessage(entry.producer, by));
  num_invalidations_++;
}

bool TreeManager::allGenerationOutputsDead() {
  for (int64_t slot : generation_slots_) {
    auto it = live_.find(slot);
    if (it != live_.end() && it->second.generation == generation_ && !it->second.weak.expired()) {
      return false;
    }
  }
  return true;
}

void TreeManager::noteGenerationRun(FunctionRecord& fn) {
  CallableState& c = *fn.callable;
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
// memory (see replay() and restoreCheckpoint()).
void TreeManager::endPath(const std::string& why, const std::vector<at::Tensor>& spare) {
  pinned_.clear();
  std::unordered_set<const c10::StorageImpl*> spared;
  for (const auto& t : spare) spared.insert(t.storage().unsafeGetStorageImpl());
  for (auto it = live_.begin(); it != live_.end();) {
    auto strong = it->second.weak.lock();
    if (gone(it->second)) {
      it = eraseEntry(it);
      continue;
    }
    if (ownsPoolBlock(*strong) && !spared.count(strong.get())) {
      invalidate(it->second, "a new step began: " + why);
      it = eraseEntry(it);
    } else {
      ++it;
    }
  }
  if (current_ != nullptr || state_ != PathState::kNone) {
    logMessage(LogLevel::kDebug, "path ended: " + why);
  }
  path_.clear();
  current_ = nullptr;
  state_ = PathState::kNone;
  pending_forwards_ = 0;
  generation_++;
  generation_slots_.clear();
}

// Before anything allocates in the pool after replays, the pool's bookkeeping must describe the
// memory that live outputs occupy. See Note [Checkpointing].
void TreeManager::prepareToAllocate(std::vector<at::Tensor>* inputs,
                                    const std::vector<uint8_t>& is_static) {
  if (!dirty_) return;
  if (current_ != nullptr) {
    restoreCheckpoint(current_, inputs, is_static);
    return;
  }
  pruneDead();
  // The path ended after replays. Blocks that live outputs own are allocated in the pool; replayed
  // outputs own nothing, so the allocator may hand their memory out again: they are invalidated.
  std::unordered_set<int64_t> at_risk;
  for (auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && !ownsPoolBlock(*strong)) at_risk.insert(kv.first);
  }
  cloneInputsAtRisk(inputs, is_static, at_risk);
  for (int64_t slot : at_risk) {
    auto it = live_.find(slot);
    invalidate(it->second, "a new recording or warmup reuses its memory");
    eraseEntry(it);
  }
  dirty_ = false;
}

void TreeManager::cloneInputsAtRisk(std::vector<at::Tensor>* inputs,
                                    const std::vector<uint8_t>& is_static,
                                    const std::unordered_set<int64_t>& slots_at_risk) {
  if (slots_at_risk.empty()) return;
  for (size_t i = 0; i < inputs->size(); ++i) {
    at::Tensor& t = (*inputs)[i];
    auto it = slot_of_.find(t.storage().unsafeGetStorageImpl());
    if (it == slot_of_.end() || !slots_at_risk.count(it->second)) continue;
    // A static input is used at its address, so a copy cannot stand in for it.
    TORCH_CHECK(!is_static[i], "graphtrees: static input ", i,
                " is an output of an earlier graphed run whose pool memory the next run reuses. "
                "Pass a tensor with a stable address as a static input (e.g. .clone() it once).");
    t = t.clone();
  }
}

// Note [Checkpointing]
// After node N is recorded, the pool's state is checkpointed (backend checkpoint()) together with
// the set of output slots that were live at that moment. Replays write memory without telling the
// allocator: afterwards its bookkeeping no longer matches what live outputs occupy (replayed
// outputs are non-owning views of pool memory). Before the pool must allocate again -- a warmup or
// a new recording while the path continues from N -- the pool is restored to N's checkpoint:
//   1. every live output that owns a pool block gives up ownership (its deleter becomes a no-op),
//      because the restore frees every block;
//   2. the restore re-creates N's layout; blocks that were allocated in it come back as owning
//      DataPtrs;
//   3. each live output whose slot was live at N's checkpoint takes the DataPtr of its block
//      (set_data_ptr_noswap), so the allocator cannot hand that memory out and the block is freed
//      when the tensor dies;
//   4. blocks whose tensors died since are freed (their DataPtrs are simply dropped), and live
//      outputs that the checkpoint does not protect are invalidated: the new run may reuse them.
// Only the allocator's bookkeeping is reset, never memory contents, so live outputs keep their
// data.
void TreeManager::restoreCheckpoint(TreeNode* node, std::vector<at::Tensor>* inputs,
                                    const std::vector<uint8_t>& is_static) {
  if (consumeInjectedFailure(FailurePoint::kRestore)) {
    throw RestoreFailed("simulated failure (graphtrees._C._fail_next_restores)");
  }
  if (node->checkpoint_ == nullptr) {  // not expected: nodes are published with a checkpoint
    throw RestoreFailed("node " + std::to_string(node->id()) + " has no checkpoint");
  }
  pruneDead();
  auto owningPtrs = [this] {
    std::unordered_set<void*> owning;
    for (auto& kv : live_) {
      auto strong = kv.second.weak.lock();
      if (strong && ownsPoolBlock(*strong)) owning.insert(reinterpret_cast<void*>(kv.second.ptr));
    }
    return owning;
  };
  if (!backend_->checkLiveAllocations(owningPtrs())) {
    if (gcHook()) gcHook()();
    pruneDead();
    const auto owning = owningPtrs();
    if (!backend_->checkLiveAllocations(owning)) {
      int64_t extra = 0;
      for (void* p : backend_->allocatedBlocks()) extra += owning.count(p) ? 0 : 1;
      TORCH_CHECK(false, "graphtrees: ", extra,
                  " tensor(s) allocated in graphtrees' pool by a warmup or recording are still "
                  "alive but were never returned by the graphed function (for example a cache "
                  "created lazily inside forward and stored on a module or in a global). The pool "
                  "cannot be restored for the next recording without freeing their memory. Create "
                  "such state before wrapping the function (e.g. run it once eagerly), register "
                  "it as a buffer before the first call, or return it.");
    }
  }
  std::unordered_set<int64_t> at_risk;
  for (auto& kv : live_) {
    if (!std::binary_search(node->checkpoint_live_slots_.begin(),
                            node->checkpoint_live_slots_.end(), kv.first)) {
      at_risk.insert(kv.first);
    }
  }
  cloneInputsAtRisk(inputs, is_static, at_risk);
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> disowned;
  for (auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && disown(*strong)) disowned.push_back(std::move(strong));
  }
  RestoreResult delta;
  try {
    delta = backend_->restore(*node->checkpoint_);
  } catch (const RestoreError& e) {
    // Note [Failed restores]
    // A restore that failed before it changed the pool (the CPU pool's restore is all or
    // nothing) leaves every block where it was: the outputs that gave up ownership above take it
    // back, and nothing leaks. One that failed half-way (c10's setCheckpointPoolState frees every
    // block, then re-creates the checkpoint's layout) leaves blocks that no DataPtr will ever
    // free: the outputs stay disowned (their memory stays readable, since a retired pool never
    // allocates again), and the bytes are reported as leaked until reset().
    if (e.poolUnchanged()) {
      for (auto& storage : disowned) {
        storage->mutable_data_ptr().compare_exchange_deleter(&c10::detail::deleteNothing,
                                                             backend_->poolDeleter());
      }
    } else {
      // Every block still allocated in the pool is out of reach now: disowned outputs free
      // nothing, and the blocks the restore re-created were never handed out.
      int64_t bytes = 0;
      try {
        bytes = backend_->stats().allocated_bytes;
      } catch (const std::exception&) {
        bytes = -1;  // unknown
      }
      std::lock_guard<std::mutex> lock(registryMutex());
      if (bytes > 0) leakedBytes()[backend_->device().str()] += bytes;
    }
    throw RestoreFailed(std::string("restoring the pool: ") + e.what() +
                        (e.poolUnchanged() ? " (the pool was left unchanged)"
                                           : " (the pool was left inconsistent; its memory is "
                                             "not reused until graphtrees.reset())"));
  }
  disowned.clear();
  std::unordered_map<uintptr_t, c10::DataPtr*> by_ptr;
  for (auto& dp : delta.dataptrs_allocd) by_ptr[reinterpret_cast<uintptr_t>(dp.get())] = &dp;
  for (auto it = live_.begin(); it != live_.end();) {
    auto strong = it->second.weak.lock();
    if (!strong) {
      it = eraseEntry(it);
      continue;
    }
    if (at_risk.count(it->first)) {
      invalidate(it->second,
                 "the pool was restored for a new run of the tree and reuses its memory");
      it = eraseEntry(it);
      continue;
    }
    auto found = by_ptr.find(it->second.ptr);
    if (found == by_ptr.end()) {  // not expected: be safe rather than hand out a wrong block
      invalidate(it->second, "its block was missing from the restored checkpoint");
      it = eraseEntry(it);
      continue;
    }
    strong->set_data_ptr_noswap(std::move(*found->second));
    by_ptr.erase(found);
    ++it;
  }
  // DataPtrs left in `delta` belong to blocks whose tensors died: dropping them frees the blocks.
  num_checkpoints_++;
  dirty_ = false;
  logMessage(LogLevel::kDebug, "restored the pool to the checkpoint of node " +
                                   std::to_string(node->id()) + " ('" + node->function_name_ +
                                   "'); checkpoints so far: " + std::to_string(num_checkpoints_));
}

bool TreeManager::deadBeforeHolds(const TreeNode& node) {
  for (int64_t slot : node.dead_before_) {
    auto it = live_.find(slot);
    if (it != live_.end() && it->second.generation == generation_ && !it->second.weak.expired()) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The call

TreeManager::Classified TreeManager::classify(const FunctionRecord& fn,
                                              const std::vector<at::Tensor>& inputs) {
  Classified c;
  c.kinds.resize(inputs.size(), InputKind::kCopied);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (fn.is_static[i]) {
      c.kinds[i] = InputKind::kStatic;
      c.key_ptrs.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
      continue;
    }
    auto it = slot_of_.find(t.storage().unsafeGetStorageImpl());
    if (it == slot_of_.end()) continue;
    const Tracked& e = live_.at(it->second);
    if (e.generation != generation_) continue;
    c.consumes_generation_output = true;
    if (e.node != nullptr) {
      c.kinds[i] = InputKind::kManaged;
      c.key_ptrs.push_back(static_cast<uintptr_t>(i));
      c.key_ptrs.push_back(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
    }
  }
  c.key_hash = TreeNode::hashKey(fn.id, c.key_ptrs);
  return c;
}

TreeNode* TreeManager::findChild(const FunctionRecord& fn, const Classified& cls,
                                 std::string* mismatch) {
  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  if (const auto* candidates = parent->childrenFor(cls.key_hash)) {
    for (TreeNode* c : *candidates) {
      if (!c->keyEquals(fn.id, cls.key_ptrs)) continue;
      if (deadBeforeHolds(*c)) return c;
      *mismatch = "an output of an earlier call in this step that was dead when node " +
                  std::to_string(c->id()) + " was recorded is alive now";
    }
  }
  if (mismatch->empty()) {
    // Explain why no recording of this function under this parent matches (rare path).
    for (const auto& c : parent->ownedChildren()) {
      if (c->function_id_ != fn.id) continue;
      size_t k = 0;
      for (size_t i = 0; i < cls.kinds.size() && mismatch->empty(); ++i) {
        const InputKind then = c->input_kinds_[i];
        if (then != cls.kinds[i]) {
          *mismatch = "input " + std::to_string(i) +
                      (then == InputKind::kManaged ? " was an output of the previous call when "
                                                     "recorded and is not now"
                                                   : " is an output of the previous call now");
        } else if (then == InputKind::kStatic) {
          if (c->key_ptrs_[k] != cls.key_ptrs[k]) {
            *mismatch = "static input " + std::to_string(i) + " changed address";
          }
          k += 1;
        } else if (then == InputKind::kManaged) {
          if (c->key_ptrs_[k + 1] != cls.key_ptrs[k + 1]) {
            *mismatch =
                "input " + std::to_string(i) + " (an output of an earlier call) changed address";
          }
          k += 2;
        }
      }
      if (!mismatch->empty()) break;
    }
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
// under grad mode, say) extends the path at most kMaxRunsPerGeneration times; then a warning says
// what to do and a new step starts anyway.
//
// Note [Pinned gradients]
// A backward's outputs are gradients. Autograd "steals" a gradient whose only reference is its
// own (it becomes .grad without a copy) and accumulates in place into such buffers; a gradient in
// pool memory would then be overwritten by the next replay. The tree keeps one extra reference to
// each backward output until the node runs again or the step ends, so autograd copies gradients
// into .grad, as it does for any gradient it cannot steal.
void TreeManager::finishRun(FunctionRecord& fn, const CallResult& result) {
  if (fn.mode == FunctionRecord::Mode::kForward) {
    pending_forwards_++;
  } else if (fn.mode == FunctionRecord::Mode::kBackward) {
    pending_forwards_ = std::max<int64_t>(0, pending_forwards_ - 1);
    if (result.kind == RunKind::kWarmup) {
      pinned_[-fn.id - 1] = result.outputs;
    } else if (result.kind != RunKind::kEager && current_ != nullptr) {
      pinned_[current_->id()] = result.outputs;
    }
  }
}

void TreeManager::debugCheck(const FunctionRecord& fn, RunKind kind) {
  if (!g_debug_checks.load()) return;
  std::string why;
  TORCH_INTERNAL_ASSERT(checkPoolInvariants(&why), "graphtrees pool invariant broken after a ",
                        kindName(kind), " of '", fn.name, "': ", why);
}

CallResult TreeManager::callImpl(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                                 const RunFn& run) {
  TORCH_INTERNAL_ASSERT(fn.is_static.size() == inputs.size());
  resetFunctionIfStale(fn);
  if (!fn.eager_reason.empty()) return runEager(fn, inputs, run, fn.eager_reason);

  const int64_t step = g_step.load();
  if (step != seen_step_) {
    seen_step_ = step;
    endPath("graphtrees.mark_step_begin() was called", inputs);
  }
  if ((state_ == PathState::kWarmup || state_ == PathState::kRecording) &&
      allGenerationOutputsDead()) {
    endPath("every output of the current path is dead", inputs);
  }
  Classified cls = classify(fn, inputs);
  const CallableState& callable = *fn.callable;
  if (callable.last_generation == generation_) {
    const bool fresh = !cls.consumes_generation_output;
    const bool pending = pending_forwards_ > 0;
    bool new_step = false;
    if (pending) {
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
    } else {
      new_step = fresh || callable.runs_in_generation >= kMaxRunsPerGeneration;
    }
    if (new_step) {
      endPath("'" + fn.name + "' was called again", inputs);
      cls = classify(fn, inputs);
    }
  }
  if (state_ == PathState::kWarmup || fn.warmups < fn.warmup_iters) {
    return warmup(fn, inputs, run);
  }
  std::string mismatch;
  TreeNode* node = findChild(fn, cls, &mismatch);
  if (node == nullptr && current_ != nullptr && root_functions_.count(fn.id) &&
      allGenerationOutputsDead()) {
    endPath("every output of the current path is dead", inputs);
    cls = classify(fn, inputs);
    mismatch.clear();
    node = findChild(fn, cls, &mismatch);
  }
  if (node != nullptr) return replay(*node, fn, inputs, run);

  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  const bool rerecord = parent->countChildrenOf(fn.id) > 0;
  if (rerecord) {
    if (mismatch.empty()) mismatch = "no recording matches the inputs";
    if (fn.rerecords >= fn.rerecord_limit) {
      fn.eager_reason = "it was re-recorded " + std::to_string(fn.rerecords) +
                        " times (rerecord_limit=" + std::to_string(fn.rerecord_limit) +
                        "), last because " + mismatch;
      return runEager(fn, inputs, run, fn.eager_reason);
    }
    logMessage(LogLevel::kInfo,
               "re-recording '" + fn.name + "' under " +
                   (current_ ? "node " + std::to_string(current_->id()) : "the root") +
                   " because " + mismatch + " (re-record " + std::to_string(fn.rerecords + 1) +
                   " of at most " + std::to_string(fn.rerecord_limit) + ")");
  }
  CallResult result = record(fn, inputs, run, cls);
  if (rerecord && result.kind == RunKind::kRecord) {  // counted once it succeeded
    fn.rerecords++;
    num_rerecords_++;
  }
  return result;
}

void TreeManager::removeNode(TreeNode* node, const std::string& why) {
  while (!node->ownedChildren().empty()) removeNode(node->ownedChildren().back().get(), why);
  pinned_.erase(node->id());
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->second.node == node) {
      invalidate(it->second, why);
      it = eraseEntry(it);
    } else {
      ++it;
    }
  }
  TreeNode* parent = node->parent() != nullptr ? node->parent() : &root_;
  num_nodes_--;
  parent->removeChild(node);  // destroys node
}

bool TreeManager::evictFunction(int64_t function_id, const std::string& why) {
  std::vector<TreeNode*> victims;
  std::vector<TreeNode*> stack{&root_};
  while (!stack.empty()) {
    TreeNode* n = stack.back();
    stack.pop_back();
    for (const auto& c : n->ownedChildren()) {
      if (c->function_id_ == function_id) {
        victims.push_back(c.get());  // its subtree goes with it
      } else {
        stack.push_back(c.get());
      }
    }
  }
  for (TreeNode* v : victims) {
    for (TreeNode* p : path_) {
      for (TreeNode* a = p; a != nullptr; a = a->parent()) {
        if (a == v) return false;
      }
    }
  }
  for (TreeNode* v : victims) {
    const std::string name = v->function_name_;
    const int64_t id = v->id();
    removeNode(v, "its recording was evicted: " + why);
    logMessage(LogLevel::kInfo, "evicted node " + std::to_string(id) + " ('" + name + "'): " + why);
  }
  root_functions_.erase(function_id);
  pinned_.erase(-function_id - 1);
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

namespace {
// Version counters of the inputs a function must not mutate; inference tensors have none.
std::vector<int64_t> versionsOf(const std::vector<at::Tensor>& tensors,
                                const std::vector<int64_t>& which) {
  std::vector<int64_t> v;
  v.reserve(which.size());
  for (int64_t i : which) {
    const auto& t = tensors[i];
    v.push_back(t.is_inference() ? -1 : static_cast<int64_t>(t._version()));
  }
  return v;
}
}  // namespace

CallResult TreeManager::warmup(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                               const RunFn& run) {
  std::vector<at::Tensor> ins = inputs;
  prepareToAllocate(&ins, fn.is_static);
  std::vector<int64_t> unmanaged;
  for (size_t i = 0; i < ins.size(); ++i) {
    if (!fn.is_static[i] && !slot_of_.count(ins[i].storage().unsafeGetStorageImpl())) {
      unmanaged.push_back(static_cast<int64_t>(i));
    }
  }
  const auto before = versionsOf(ins, unmanaged);
  std::vector<at::Tensor> outs;
  {
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    PoolRoutingGuard routing(*backend_);
    outs = run(ins);
    routing.end();
  }
  const auto after = versionsOf(ins, unmanaged);
  for (size_t k = 0; k < unmanaged.size(); ++k) {
    if (before[k] != after[k]) {
      fn.eager_reason = "it mutates its input tensor #" + std::to_string(unmanaged[k]) +
                        " in place; a graph would mutate a private copy instead. Pass it through "
                        "static_argnums if its address is stable";
      noteFallback(fn, fn.eager_reason);
      break;
    }
  }
  std::unordered_set<const c10::StorageImpl*> input_storages;
  for (const auto& t : ins) input_storages.insert(t.storage().unsafeGetStorageImpl());
  for (const auto& t : outs) {
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (input_storages.count(impl) || slot_of_.count(impl) || impl->nbytes() == 0) continue;
    if (!backend_->inPool(impl->data())) continue;
    trackStorage(t.storage(), next_slot_id_++, nullptr, fn);
  }
  fn.warmups++;
  num_warmups_++;
  state_ = PathState::kWarmup;
  noteGenerationRun(fn);
  logMessage(LogLevel::kDebug, "warmed up '" + fn.name + "' (" + std::to_string(fn.warmups) + "/" +
                                   std::to_string(fn.warmup_iters) + ")");
  return {std::move(outs), RunKind::kWarmup};
}

CallResult TreeManager::record(FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                               const RunFn& run, const Classified& cls) {
  std::vector<at::Tensor> ins = inputs;
  prepareToAllocate(&ins, fn.is_static);
  pruneDead();
  const c10::Device device = backend_->device();

  // Placeholders for copied inputs, allocated in the pool (outside the capture).
  std::vector<at::Tensor> run_inputs = ins;
  std::vector<int64_t> copied;
  std::vector<uint8_t> dense(ins.size(), 1);
  {
    PoolRoutingGuard routing(*backend_);
    for (size_t i = 0; i < ins.size(); ++i) {
      if (cls.kinds[i] != InputKind::kCopied) continue;
      const at::Tensor& src = ins[i];
      dense[i] = src.is_non_overlapping_and_dense() ? 1 : 0;
      at::Tensor ph = dense[i] ? at::empty_strided(src.sizes(), src.strides(), src.options())
                               : at::empty(src.sizes(), src.options());
      ph.copy_(src);
      run_inputs[i] = std::move(ph);
      copied.push_back(static_cast<int64_t>(i));
    }
    routing.end();
  }
  const auto before = versionsOf(run_inputs, copied);

  std::vector<at::Tensor> outs;
  std::unique_ptr<Graph> graph;
  try {
    CaptureScope scope;              // Python's GC paused, host reads watched
    AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
    graph = backend_->capture(run, run_inputs, &outs, fn.name);
  } catch (const CaptureRejected& e) {
    // The backend undid the capture; the tree is as it was. See Note [Rejected captures].
    outs.clear();
    run_inputs.clear();
    fn.eager_reason = std::string("it cannot be recorded as a graph: ") + e.what();
    return runEager(fn, inputs, run, fn.eager_reason);
  }

  const auto after = versionsOf(run_inputs, copied);
  for (size_t k = 0; k < copied.size(); ++k) {
    if (before[k] != after[k]) {
      fn.eager_reason = "it mutates its input tensor #" + std::to_string(copied[k]) +
                        " in place; a graph would mutate a private copy instead";
      outs.clear();
      graph.reset();
      return runEager(fn, inputs, run, fn.eager_reason);
    }
  }

  auto node = std::make_unique<TreeNode>(next_node_id_, current_);
  node->function_id_ = fn.id;
  node->function_name_ = fn.name;
  node->input_kinds_ = cls.kinds;
  node->key_ptrs_ = cls.key_ptrs;
  node->key_hash_ = cls.key_hash;
  node->copied_inputs_ = copied;
  node->footprint_ = graph->footprint();
  for (int64_t i : copied) {
    const auto& ph = run_inputs[i];
    const auto begin = reinterpret_cast<uintptr_t>(ph.storage().data());
    node->footprint_.push_back({begin, begin + ph.storage().nbytes()});
  }
  mergeIntervals(&node->footprint_);

  // Classify the outputs.
  std::unordered_map<const c10::StorageImpl*, int64_t> input_of;
  for (size_t i = 0; i < run_inputs.size(); ++i) {
    input_of.emplace(run_inputs[i].storage().unsafeGetStorageImpl(), static_cast<int64_t>(i));
  }
  std::unordered_map<const c10::StorageImpl*, int64_t> slot_index;
  std::vector<c10::Storage> slot_storages;
  for (const auto& o : outs) {
    TORCH_CHECK(o.device() == device, "graphtrees: '", fn.name, "' returned a tensor on ",
                o.device(), " while its graph runs on ", device,
                "; every tensor output of a graphed function must be on the graph's device.");
    OutputInfo info;
    info.meta = metaOf(o);
    c10::StorageImpl* impl = o.storage().unsafeGetStorageImpl();
    const auto data = reinterpret_cast<uintptr_t>(impl->data());
    const size_t nbytes = impl->nbytes();
    auto in = input_of.find(impl);
    auto known = slot_index.find(impl);
    if (nbytes == 0 || data == 0) {
      info.kind = OutputKind::kEmpty;
    } else if (in != input_of.end() &&
               !(cls.kinds[in->second] == InputKind::kCopied && !dense[in->second])) {
      // Keeps eager's aliasing: the output is a view of the caller's own input.
      info.kind = OutputKind::kInputAlias;
      info.index = in->second;
      const auto& src = run_inputs[in->second];
      info.byte_delta = o.storage_offset() * static_cast<int64_t>(o.itemsize()) -
                        src.storage_offset() * static_cast<int64_t>(src.itemsize());
    } else if (known != slot_index.end()) {
      info.kind = OutputKind::kPool;
      info.index = known->second;
    } else if (node->overlapsFootprint(data, data + nbytes)) {
      info.kind = OutputKind::kPool;
      info.index = static_cast<int64_t>(node->slots_.size());
      slot_index.emplace(impl, info.index);
      node->slots_.push_back({next_slot_id_++, data, nbytes});
      slot_storages.push_back(o.storage());
    } else {
      TORCH_CHECK(!slot_of_.count(impl), "graphtrees: '", fn.name,
                  "' returned a tensor produced by an earlier graphed call that was not passed "
                  "to it as an argument. Pass that tensor as an argument instead of capturing it.");
      info.kind = OutputKind::kConstant;
      info.index = static_cast<int64_t>(node->constants_.size());
      node->constants_.push_back(o.storage());
    }
    node->outputs_.push_back(std::move(info));
  }

  // Ancestor outputs that are dead now: a later replay is valid only while they stay dead.
  for (TreeNode* p : path_) {
    for (const auto& s : p->slots_) {
      auto it = live_.find(s.id);
      if (it == live_.end() || it->second.generation != generation_ || it->second.weak.expired()) {
        node->dead_before_.push_back(s.id);
      }
    }
  }

  // Placeholders become non-owning views: their blocks are free for descendants once this
  // recording is done (unless an output keeps them), and a replay copies into the same address.
  for (int64_t i : copied) {
    const auto& ph = run_inputs[i];
    node->placeholders_.push_back(
        makeTensor(nonOwningStorage(reinterpret_cast<uintptr_t>(ph.storage().data()),
                                    ph.storage().nbytes(), device),
                   metaOf(ph)));
  }
  node->graph_ = std::move(graph);
  outs.clear();
  run_inputs.clear();

  // Note [Publishing a node]
  // The checkpoint is taken before the node enters the tree: a checkpoint that throws (c10's
  // refuses blocks with pending cross-stream events) leaves the tree exactly as it was, and the
  // function runs eagerly from then on. Nothing that can fail runs after the node is published.
  try {
    node->checkpoint_ = backend_->checkpoint();
  } catch (const std::exception& e) {
    const std::string why = e.what();
    node.reset();
    slot_storages.clear();
    fn.eager_reason = "the pool could not be checkpointed after its recording: " + why;
    return runEager(fn, inputs, run, fn.eager_reason);
  }
  TreeNode* parent = current_ != nullptr ? current_ : &root_;
  TreeNode* raw = parent->addChild(std::move(node));
  next_node_id_++;
  num_nodes_++;
  if (current_ == nullptr) root_functions_.insert(fn.id);
  for (size_t k = 0; k < raw->slots_.size(); ++k) {
    trackStorage(slot_storages[k], raw->slots_[k].id, raw, fn);
  }
  for (auto& kv : live_) {
    if (!kv.second.weak.expired()) raw->checkpoint_live_slots_.push_back(kv.first);
  }
  std::sort(raw->checkpoint_live_slots_.begin(), raw->checkpoint_live_slots_.end());

  path_.push_back(raw);
  current_ = raw;
  state_ = PathState::kRecording;
  dirty_ = false;
  num_recordings_++;
  noteGenerationRun(fn);
  logMessage(LogLevel::kInfo,
             "recorded node " + std::to_string(raw->id()) + " for '" + fn.name + "' under " +
                 (raw->parent() ? "node " + std::to_string(raw->parent()->id()) : "the root") +
                 " (" + std::to_string(copied.size()) + " copied inputs, " +
                 std::to_string(raw->slots_.size()) + " output blocks, " +
                 bytesString(raw->poolBytes()) + " written)");
  // `ins`, not `inputs`: an input that the restore had to invalidate was replaced by a clone, and
  // outputs that alias it must alias the clone.
  return {raw->buildOutputs(slot_storages, ins), RunKind::kRecord};
}

CallResult TreeManager::replay(TreeNode& node, FunctionRecord& fn,
                               const std::vector<at::Tensor>& inputs, const RunFn& run) {
  const c10::Device device = backend_->device();
  const auto& copied = node.copied_inputs_;
  std::vector<at::Tensor> sources;
  sources.reserve(copied.size());
  for (int64_t i : copied) {
    const at::Tensor& src = inputs[i];
    const auto begin = reinterpret_cast<uintptr_t>(src.storage().data());
    // A source inside memory this replay writes must be read before anything is written.
    sources.push_back(node.overlapsFootprint(begin, begin + src.storage().nbytes()) ? src.clone()
                                                                                    : src);
  }
  pinned_.erase(node.id());
  // Outputs of earlier runs that live in memory this replay writes are overwritten now.
  for (auto it = live_.begin(); it != live_.end();) {
    const Tracked& e = it->second;
    if (gone(e)) {
      it = eraseEntry(it);
    } else if (node.overlapsFootprint(e.ptr, e.ptr + e.nbytes)) {
      invalidate(e, "a replay of '" + fn.name + "' wrote to its memory");
      it = eraseEntry(it);
    } else {
      ++it;
    }
  }
  dirty_ = true;
  backend_->copyInputs(node.placeholders_, sources);
  AutocastCacheOff no_cast_cache;  // Note [Autocast and recordings]
  if (node.graph_->replayRunsCallable()) {
    std::vector<at::Tensor> replay_inputs = inputs;
    for (size_t k = 0; k < copied.size(); ++k) replay_inputs[copied[k]] = node.placeholders_[k];
    node.graph_->replay(run, replay_inputs);
  } else {
    node.graph_->replay(run, {});
  }
  std::vector<c10::Storage> storages;
  storages.reserve(node.slots_.size());
  for (const auto& s : node.slots_) {
    storages.push_back(nonOwningStorage(s.ptr, s.nbytes, device));
    trackStorage(storages.back(), s.id, &node, fn);
  }
  path_.push_back(&node);
  current_ = &node;
  state_ = PathState::kExecution;
  node.replays_++;
  num_replays_++;
  noteGenerationRun(fn);
  // Outputs that alias an input this replay overwrote alias its clone instead.
  std::vector<at::Tensor> alias_inputs = inputs;
  for (size_t k = 0; k < copied.size(); ++k) alias_inputs[copied[k]] = sources[k];
  return {node.buildOutputs(storages, alias_inputs), RunKind::kReplay};
}

// ---------------------------------------------------------------------------------------------
// Introspection

TreeInfo TreeManager::info() {
  pruneDead();
  TreeInfo t;
  t.device = backend_->device().str();
  t.backend = backend_->name();
  switch (state_) {
    case PathState::kNone:
      t.state = "none";
      break;
    case PathState::kWarmup:
      t.state = "warmup";
      break;
    case PathState::kRecording:
      t.state = "recording";
      break;
    case PathState::kExecution:
      t.state = "execution";
      break;
  }
  t.generation = generation_;
  t.num_nodes = num_nodes_;
  t.num_roots = static_cast<int64_t>(root_.ownedChildren().size());
  t.num_checkpoints = num_checkpoints_;
  t.num_rerecords = num_rerecords_;
  t.num_fallbacks = num_fallbacks_;
  t.num_warmups = num_warmups_;
  t.num_recordings = num_recordings_;
  t.num_replays = num_replays_;
  t.num_invalidations = num_invalidations_;
  t.num_evictions = num_evictions_;
  t.num_migrations = num_migrations_;
  {
    std::lock_guard<std::mutex> lock(registryMutex());
    auto it = retiredCounts().find(t.device);
    t.retired_trees = it == retiredCounts().end() ? 0 : it->second;
    auto leaked = leakedBytes().find(t.device);
    t.leaked_bytes = leaked == leakedBytes().end() ? 0 : leaked->second;
  }
  t.pending_backward = pending_forwards_ > 0;
  t.live_outputs = static_cast<int64_t>(live_.size());
  t.current_node = current_ ? current_->id() : -1;
  t.pool = backend_->stats();
  std::unordered_map<int64_t, int64_t> live_per_node;
  for (auto& kv : live_) {
    if (kv.second.node) live_per_node[kv.second.node->id()]++;
  }
  std::vector<const TreeNode*> stack;
  for (const auto& c : root_.ownedChildren()) stack.push_back(c.get());
  std::reverse(stack.begin(), stack.end());
  while (!stack.empty()) {
    const TreeNode* n = stack.back();
    stack.pop_back();
    NodeInfo ni;
    ni.id = n->id();
    ni.parent = n->parent() ? n->parent()->id() : -1;
    ni.function_id = n->function_id_;
    ni.function = n->function_name_;
    for (const auto& c : n->ownedChildren()) ni.children.push_back(c->id());
    ni.pool_bytes = n->poolBytes();
    ni.num_outputs = static_cast<int64_t>(n->outputs_.size());
    for (InputKind k : n->input_kinds_) {
      ni.input_kinds += k == InputKind::kStatic ? 'S' : (k == InputKind::kManaged ? 'M' : 'C');
    }
    ni.live_outputs = live_per_node.count(n->id()) ? live_per_node[n->id()] : 0;
    ni.replays = n->replays_;
    ni.on_current_path = std::find(path_.begin(), path_.end(), n) != path_.end();
    t.nodes.push_back(std::move(ni));
    for (auto it = n->ownedChildren().rbegin(); it != n->ownedChildren().rend(); ++it) {
      stack.push_back(it->get());
    }
  }
  return t;
}

std::string TreeManager::toDot() {
  const TreeInfo t = info();
  std::ostringstream os;
  auto escape = [](const std::string& s) {
    std::string r;
    for (char ch : s) {
      if (ch == '"' || ch == '\\') r += '\\';
      r += ch;
    }
    return r;
  };
  os << "digraph graphtrees {\n";
  os << "  label=\"graphtrees tree on " << escape(t.device) << " (pool reserved "
     << bytesString(t.pool.reserved_bytes) << ")\";\n";
  os << "  node [shape=box, fontname=\"monospace\"];\n";
  for (const auto& n : t.nodes) {
    os << "  n" << n.id << " [label=\"#" << n.id << " " << escape(n.function) << "\\n"
       << bytesString(n.pool_bytes) << " written";
    if (n.live_outputs > 0) os << "\\nlive outputs: " << n.live_outputs;
    os << "\"";
    if (n.live_outputs > 0) os << ", style=filled, fillcolor=\"#c6efce\"";
    if (n.on_current_path) os << ", penwidth=2";
    os << "];\n";
  }
  for (const auto& n : t.nodes) {
    if (n.parent >= 0) os << "  n" << n.parent << " -> n" << n.id << ";\n";
  }
  os << "}\n";
  return os.str();
}

bool TreeManager::checkPoolInvariants(std::string* why) {
  pruneDead();
  std::unordered_set<void*> owning;
  int64_t non_owning = 0;
  for (auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (!strong) continue;
    if (ownsPoolBlock(*strong)) {
      owning.insert(reinterpret_cast<void*>(kv.second.ptr));
    } else {
      non_owning++;
    }
  }
  if (!backend_->checkLiveAllocations(owning)) {
    const auto blocks = backend_->allocatedBlocks();
    int64_t extra = 0;
    for (void* p : blocks) extra += owning.count(p) ? 0 : 1;
    *why = "the pool has " + std::to_string(blocks.size()) + " allocated blocks, " +
           std::to_string(extra) +
           " of them not owned by a tracked live output; tracked owning "
           "outputs: " +
           std::to_string(owning.size());
    return false;
  }
  if (!dirty_ && non_owning > 0) {
    *why = std::to_string(non_owning) +
           " live outputs do not own their blocks although no replay happened since the pool "
           "was last exact";
    return false;
  }
  return true;
}

}  // namespace graphtrees
