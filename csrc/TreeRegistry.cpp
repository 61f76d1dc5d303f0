#include "TreeRegistry.h"

#include "BackendFactory.h"
#include "Logging.h"
#include "ProcessState.h"

#include <c10/util/Exception.h>

#include <map>

namespace graphtrees {

namespace {

using DeviceKey = std::pair<int, int>;  // (device type, index): no string on the call path

DeviceKey keyOf(c10::Device device) {
  return {static_cast<int>(device.type()), static_cast<int>(device.index())};
}

struct Registry {
  std::mutex mutex;
  std::map<DeviceKey, std::shared_ptr<TreeManager>> trees;
  // Trees retired after a failed restore: their outputs stay valid until resetAll().
  std::vector<std::shared_ptr<TreeManager>> retired;
  std::map<std::string, int64_t> retired_counts;
  std::map<std::string, int64_t> leaked_bytes;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: trees may be released at exit
  return *r;
}

std::shared_ptr<TreeManager> findOrCreate(c10::Device device, bool create, std::string* why_not) {
  const DeviceKey key = keyOf(device);
  std::shared_ptr<TreeManager> tree;
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
    tree = std::make_shared<TreeManager>(std::move(backend));
    r.trees.emplace(key, tree);
  }
  // Logged outside the registry's lock: the log sink takes the GIL.
  logMessage(LogLevel::kDebug,
             "created the tree for " + device.str() + " (backend " + tree->backendName() + ")");
  return tree;
}

}  // namespace

TreeRegistry::Handle::Handle(std::shared_ptr<TreeManager> tree)
    : tree_(std::move(tree)), lock_(tree_->mutex(), std::try_to_lock) {
  if (!lock_.owns_lock()) runBlocking([this] { lock_.lock(); });  // the holder may need the GIL
}

std::shared_ptr<TreeManager> TreeRegistry::find(c10::Device device, std::string* why_not) {
  return findOrCreate(device, /*create=*/true, why_not);
}

TreeRegistry::Handle TreeRegistry::acquire(c10::Device device, bool create, std::string* why_not) {
  auto tree = findOrCreate(device, create, why_not);
  return tree ? Handle(std::move(tree)) : Handle();
}

TreeRegistry::Handle TreeRegistry::call(std::shared_ptr<TreeManager> found, FunctionRecord& fn,
                                        const std::vector<at::Tensor>& inputs, const RunFn& run,
                                        CallResult* result) {
  const c10::Device device = found->device();
  std::string why_not;
  Handle tree(std::move(found));
  try {
    *result = tree->call(fn, inputs, run);
    return tree;
  } catch (const RestoreFailed& e) {
    // Nothing ran yet: retire the tree and run the call on a fresh one.
    std::shared_ptr<TreeManager> failed = tree.tree_;
    tree = Handle();
    retire(failed, e.what());
  }
  tree = acquire(device, true, &why_not);
  TORCH_CHECK(tree, "graphtrees: no tree for ", device, ": ", why_not);
  *result = tree->call(fn, inputs, run);
  return tree;
}

void TreeRegistry::retire(const std::shared_ptr<TreeManager>& tree, const std::string& why) {
  const std::string key = tree->device().str();
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.trees.find(keyOf(tree->device()));
    if (it == r.trees.end() || it->second != tree) return;  // already retired
    r.retired.push_back(std::move(it->second));
    r.trees.erase(it);
    r.retired_counts[key]++;
    r.leaked_bytes[key] += tree->leakedBytes();
    advanceEpoch();  // function records start afresh (warmup included) in the new tree
  }
  logMessage(LogLevel::kWarning,
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
    r.retired_counts.clear();
    r.leaked_bytes.clear();
    advanceEpoch();
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

TreeInfo TreeRegistry::info(c10::Device device, bool* has_tree) {
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
  auto retired = r.retired_counts.find(t.device);
  t.retired_trees = retired == r.retired_counts.end() ? 0 : retired->second;
  auto leaked = r.leaked_bytes.find(t.device);
  t.leaked_bytes = leaked == r.leaked_bytes.end() ? 0 : leaked->second;
  return t;
}

}  // namespace graphtrees
