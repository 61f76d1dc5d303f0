#include "TreeRegistry.h"

#include "BackendFactory.h"
#include "CallRange.h"
#include "Logging.h"
#include "PythonHooks.h"
#include "ThreadState.h"

#include <c10/util/Exception.h>

#include <map>
#include <tuple>

namespace graphtrees {

namespace {

// (owner thread, device type, device index): no string on the call path.
using TreeKey = std::tuple<int64_t, int, int>;
using DeviceKey = std::pair<int, int>;

DeviceKey deviceKeyOf(c10::Device device) {
  return {static_cast<int>(device.type()), static_cast<int>(device.index())};
}
TreeKey keyOf(int64_t owner, c10::Device device) {
  return {owner, static_cast<int>(device.type()), static_cast<int>(device.index())};
}
bool sameDevice(const TreeKey& k, c10::Device device) {
  return std::get<1>(k) == static_cast<int>(device.type()) &&
         std::get<2>(k) == static_cast<int>(device.index());
}

struct Registry {
  std::mutex mutex;
  std::map<TreeKey, std::shared_ptr<TreeManager>> trees;
  // Trees retired after a failed restore: their outputs stay valid until resetAll().
  std::vector<std::shared_ptr<TreeManager>> retired;
  // Trees of threads that exited: freed once none of their outputs is alive (or at resetAll()).
  std::vector<std::shared_ptr<TreeManager>> orphans;
  std::map<std::string, int64_t> retired_counts;
  std::map<std::string, int64_t> leaked_bytes;
  std::map<DeviceKey, int64_t> budgets;               // kept across reset()
  std::map<TreeKey, int64_t> fallbacks_without_tree;  // countFallbackWithoutTree()
  int calls_since_sweep = 0;
};

constexpr int kSweepInterval = 64;  // tree lookups between looks at the orphans

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: trees may be released at exit
  return *r;
}

// Frees the orphaned trees whose outputs are all dead. Called without the registry's lock.
void sweepOrphans() {
  std::vector<std::shared_ptr<TreeManager>> orphans;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.orphans.empty()) return;
    orphans.swap(r.orphans);
  }
  std::vector<std::shared_ptr<TreeManager>> keep;
  for (auto& tree : orphans) {
    // A capture running user code holds the device lock that freeing the pool takes.
    if (!tree->idle() || tree.use_count() != 1 || tree->deviceCapturingElsewhere()) {
      keep.push_back(std::move(tree));
      continue;
    }
    GRAPHTREES_LOG(LogLevel::kDebug, "freeing the " + tree->device().str() + " tree of thread " +
                                         std::to_string(tree->owner()) + ", which exited");
    tree.reset();  // ~TreeManager closes it; teardown errors become warnings
  }
  if (keep.empty()) return;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& t : keep) r.orphans.push_back(std::move(t));
}

// The trees of `device`, but for that of thread `except` (none when -1).
std::vector<std::shared_ptr<TreeManager>> treesOf(c10::Device device, int64_t except = -1) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::shared_ptr<TreeManager>> out;
  for (const auto& kv : r.trees) {
    if (std::get<0>(kv.first) != except && sameDevice(kv.first, device)) out.push_back(kv.second);
  }
  return out;
}

void onThreadExit(int64_t thread) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.fallbacks_without_tree.begin(); it != r.fallbacks_without_tree.end();) {
    it = std::get<0>(it->first) == thread ? r.fallbacks_without_tree.erase(it) : std::next(it);
  }
  for (auto it = r.trees.begin(); it != r.trees.end();) {
    if (std::get<0>(it->first) == thread) {
      r.orphans.push_back(std::move(it->second));
      it = r.trees.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

std::shared_ptr<TreeManager> TreeRegistry::findOrCreate(int64_t owner, const StepCounter& steps,
                                                        c10::Device device, bool create,
                                                        std::string* why_not) {
  static const bool hooked = [] {
    setThreadExitHook(&onThreadExit);
    return true;
  }();
  (void)hooked;
  const TreeKey key = keyOf(owner, device);
  std::shared_ptr<TreeManager> tree;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.trees.find(key);
    if (it != r.trees.end()) {
      // Orphans are looked at every so often, not at every call.
      if (r.orphans.empty() || ++r.calls_since_sweep < kSweepInterval) return it->second;
      r.calls_since_sweep = 0;
      tree = it->second;
    }
  }
  if (tree) {
    sweepOrphans();
    return tree;
  }
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.trees.find(key);
    if (it != r.trees.end()) return it->second;
    if (!create) return nullptr;
    std::string reason;
    auto backend = makeBackend(device, &reason);
    if (!backend) {
      if (why_not) *why_not = reason;
      return nullptr;
    }
    tree = std::make_shared<TreeManager>(std::move(backend), owner, steps);
    auto budget = r.budgets.find(deviceKeyOf(device));
    if (budget != r.budgets.end()) tree->setMemoryBudget(budget->second);  // not in use yet
    auto fallbacks = r.fallbacks_without_tree.find(key);
    if (fallbacks != r.fallbacks_without_tree.end()) {
      tree->counters_.num_fallbacks += fallbacks->second;
      r.fallbacks_without_tree.erase(fallbacks);
    }
    r.trees.emplace(key, tree);
  }
  // Logged outside the registry's lock: the log sink takes the GIL.
  GRAPHTREES_LOG(LogLevel::kDebug, "created the " + device.str() + " tree of thread " +
                                       std::to_string(owner) + " (backend " + tree->backendName() +
                                       ")");
  sweepOrphans();
  return tree;
}

TreeRegistry::Handle::Handle(std::shared_ptr<TreeManager> tree)
    : tree_(std::move(tree)), lock_(tree_->mutex()) {}  // waited for with the GIL released

std::shared_ptr<TreeManager> TreeRegistry::find(c10::Device device, std::string* why_not,
                                                const std::vector<at::Tensor>* produced_by) {
  const CallerThread me = callerThread();
  if (produced_by != nullptr) {
    for (auto& tree : treesOf(device, me.id)) {
      if (Handle(tree)->producedAny(*produced_by)) return tree;
    }
  }
  return findOrCreate(me.id, me.steps, device, /*create=*/true, why_not);
}

TreeRegistry::Handle TreeRegistry::acquire(c10::Device device, bool create, std::string* why_not) {
  const CallerThread me = callerThread();
  auto tree = findOrCreate(me.id, me.steps, device, create, why_not);
  return tree ? Handle(std::move(tree)) : Handle();
}

void TreeRegistry::countFallbackWithoutTree(c10::Device device) {
  const CallerThread me = callerThread();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.fallbacks_without_tree[keyOf(me.id, device)]++;
}

bool TreeRegistry::evictFunction(c10::Device device, int64_t function_id, const std::string& why,
                                 bool later) {
  bool all = true;
  for (auto& tree : treesOf(device)) {
    all = Handle(tree)->evictFunction(function_id, why, later) && all;
  }
  return all;
}

TreeRegistry::Handle TreeRegistry::call(std::shared_ptr<TreeManager> found, FunctionRecord& fn,
                                        const std::vector<at::Tensor>& inputs, const RunFn& run,
                                        CallResult* result) {
  const c10::Device device = found->device();
  std::string why_not;
  Handle tree(std::move(found));
  try {
    return runOn(tree, fn, inputs, run, result) ? std::move(tree) : Handle();
  } catch (const RestoreFailed& e) {
    // Nothing ran yet: retire the tree and run the call on a fresh one of the same thread.
    std::shared_ptr<TreeManager> failed = tree.tree_;
    tree = Handle();
    retire(failed, e.what());
    auto fresh = findOrCreate(failed->owner(), failed->steps(), device, true, &why_not);
    TORCH_CHECK(fresh, "graphtrees: no tree for ", device, ": ", why_not);
    tree = Handle(std::move(fresh));
  }
  return runOn(tree, fn, inputs, run, result) ? std::move(tree) : Handle();
}

bool TreeRegistry::runOn(Handle& tree, FunctionRecord& fn, const std::vector<at::Tensor>& inputs,
                         const RunFn& run, CallResult* result) {
  TreeLock& lock = tree->mutex();  // Note [User code outside the tree lock] in TreeLock.h
  if (lock.callInFlightElsewhere()) {
    // The tree's call in flight may be waiting for this thread: run as a nested call does.
    const std::string why =
        "it was called on another thread while a call on its tree ran user code (a nested "
        "graphed call, as a backward that autograd runs on its device thread while the forward's "
        "thread waits for it); it runs eagerly";
    tree->noteFallback(fn, why);
    tree->policy_.noteFinished(fn, RunKind::kEager);       // a backward closes its pending forward
    const RangeMarks* marks = rangeMarks(tree->device());  // Note [Call ranges] in CallRange.h
    tree = Handle();
    CallDepthGuard depth;  // the graphed calls it makes are part of it, as in a nested call
    CallRange range(CallRange::Kind::kEager, marks, fn.name, -1, why);
    *result = {run(inputs), RunKind::kEager, nullptr, why};
    return false;
  }
  {
    TreeLock::Call in_flight(lock);
    *result = tree->call(fn, inputs, [&](const std::vector<at::Tensor>& ins) {
      TreeLock::Lent lent(lock);
      return run(ins);
    });
  }
  tree->applyPending();
  return true;
}

void TreeRegistry::retire(const std::shared_ptr<TreeManager>& tree, const std::string& why) {
  const std::string key = tree->device().str();
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.trees.find(keyOf(tree->owner(), tree->device()));
    if (it == r.trees.end() || it->second != tree) return;  // already retired
    r.retired.push_back(std::move(it->second));
    r.trees.erase(it);
    r.retired_counts[key]++;
    r.leaked_bytes[key] += tree->leakedBytes();
  }
  GRAPHTREES_LOG(LogLevel::kWarning,
                 "restoring the pool of the " + key + " tree failed (" + why +
                     "); recording into a fresh pool from now on. The old tree's recordings and "
                     "outputs stay valid until graphtrees.reset().");
}

void TreeRegistry::resetAll() {
  TORCH_CHECK(!inTreeCall(),
              "graphtrees.reset() (or torch._dynamo.reset()) was called from inside a graphed "
              "function's run; call it between graphed calls.");
  std::vector<std::shared_ptr<TreeManager>> trees;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& kv : r.trees) trees.push_back(std::move(kv.second));
    r.trees.clear();
    for (auto& t : r.retired) trees.push_back(std::move(t));
    r.retired.clear();
    for (auto& t : r.orphans) trees.push_back(std::move(t));
    r.orphans.clear();
    r.retired_counts.clear();
    r.leaked_bytes.clear();
    r.fallbacks_without_tree.clear();
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

void TreeRegistry::releaseEmptyTrees() {
  TORCH_CHECK(!inTreeCall(),
              "torch._dynamo.reset() was called from inside a graphed function's run; call it "
              "between graphed calls.");
  std::vector<std::shared_ptr<TreeManager>> all;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& kv : r.trees) all.push_back(kv.second);
  }
  for (auto& tree : all) Handle(std::move(tree))->settlePending();
  all.clear();
  std::vector<std::shared_ptr<TreeManager>> empty;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.trees.begin(); it != r.trees.end();) {
      // Only this map and the caller hold it: no handle, no call (idle() try-locks it).
      if (it->second.use_count() == 1 && it->second->empty()) {
        empty.push_back(std::move(it->second));
        it = r.trees.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& tree : empty) {
    GRAPHTREES_LOG(LogLevel::kDebug, "freeing the empty " + tree->device().str() +
                                         " tree of thread " + std::to_string(tree->owner()));
  }
  empty.clear();  // ~TreeManager closes each; errors of a teardown become warnings
}

void TreeRegistry::setMemoryBudget(c10::Device device, int64_t bytes) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (bytes < 0) {
      r.budgets.erase(deviceKeyOf(device));
    } else {
      r.budgets[deviceKeyOf(device)] = bytes;
    }
  }
  // A tree created since takes the budget at its creation too.
  for (auto& tree : treesOf(device)) Handle(std::move(tree))->setMemoryBudget(bytes);
}

int64_t TreeRegistry::memoryBudget(c10::Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.budgets.find(deviceKeyOf(device));
  return it == r.budgets.end() ? -1 : it->second;
}

TreeInfo TreeRegistry::info(c10::Device device, bool* has_tree) {
  const int64_t me = callerThread().id;
  TreeInfo t;
  t.device = device.str();
  if (Handle tree = acquire(device, /*create=*/false)) {
    t = tree->snapshot();
    *has_tree = true;
  } else {
    *has_tree = false;
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!*has_tree) {
    auto fallbacks = r.fallbacks_without_tree.find(keyOf(me, device));
    if (fallbacks != r.fallbacks_without_tree.end()) t.counters.num_fallbacks = fallbacks->second;
  }
  auto retired = r.retired_counts.find(t.device);
  t.retired_trees = retired == r.retired_counts.end() ? 0 : retired->second;
  auto leaked = r.leaked_bytes.find(t.device);
  t.leaked_bytes = leaked == r.leaked_bytes.end() ? 0 : leaked->second;
  return t;
}

}  // namespace graphtrees
