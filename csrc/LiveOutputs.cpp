#include "LiveOutputs.h"

#include "Logging.h"
#include "TreeNode.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/UniqueVoidPtr.h>

#include <algorithm>

namespace graphtrees {

namespace {

std::string overwriteMessage(const std::string& producer, const std::string& by) {
  return "graphtrees: this tensor was returned by a run of '" + producer +
         "' and has been overwritten by a subsequent run (" + by +
         "). Its memory belongs to graphtrees' pool, which later runs reuse. Call .clone() on "
         "outputs you need to keep before running graphed functions again, or wrap the function "
         "with on_overwrite=\"copy\" to have such outputs copied out of the pool before they "
         "are overwritten; graphtrees.mark_step_begin() marks where a new step starts.";
}

}  // namespace

void LiveOutputs::trackWarmupOutputs(const std::vector<at::Tensor>& outputs,
                                     const std::vector<at::Tensor>& inputs,
                                     const std::string& producer, bool copy_on_overwrite,
                                     int64_t generation) {
  std::unordered_set<const c10::StorageImpl*> input_storages;
  for (const auto& t : inputs) input_storages.insert(t.storage().unsafeGetStorageImpl());
  for (const auto& t : outputs) {
    const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (input_storages.count(impl) || contains(impl) || impl->nbytes() == 0) continue;
    if (!backend_.inPool(impl->data())) continue;
    track(t.storage(), newSlot(), nullptr, producer, copy_on_overwrite, generation);
  }
}

void LiveOutputs::track(const c10::Storage& storage, int64_t slot, TreeNode* node,
                        const std::string& producer, bool copy_on_overwrite, int64_t generation) {
  LiveOutput e;
  e.weak = storage.getWeakStorageImpl();
  e.ptr = reinterpret_cast<uintptr_t>(storage.data());
  e.nbytes = storage.nbytes();
  e.generation = generation;
  e.node = node;
  e.producer = producer;
  e.copy_on_overwrite = copy_on_overwrite;
  auto old = live_.find(slot);
  if (old != live_.end()) erase(old);
  live_.emplace(slot, std::move(e));
  slot_of_[storage.unsafeGetStorageImpl()] = slot;
  generation_slots_.push_back(slot);
}

LiveOutputs::Map::iterator LiveOutputs::erase(Map::iterator it) {
  slot_of_.erase(it->second.weak._unsafe_get_target());
  return live_.erase(it);
}

const LiveOutput* LiveOutputs::find(const c10::StorageImpl* storage) const {
  auto it = slot_of_.find(storage);
  return it == slot_of_.end() ? nullptr : &live_.at(it->second);
}

int64_t LiveOutputs::slotOf(const c10::StorageImpl* storage) const {
  auto it = slot_of_.find(storage);
  return it == slot_of_.end() ? -1 : it->second;
}

bool LiveOutputs::liveInGeneration(int64_t slot, int64_t generation) const {
  auto it = live_.find(slot);
  if (it == live_.end() || it->second.generation != generation) return false;
  auto strong = it->second.weak.lock();
  return strong && !isGone(it->second, *strong);
}

bool LiveOutputs::anyLiveInGeneration(int64_t generation) const {
  return std::any_of(generation_slots_.begin(), generation_slots_.end(),
                     [&](int64_t slot) { return liveInGeneration(slot, generation); });
}

void LiveOutputs::pruneGone() {
  invalidateIf([](int64_t, const LiveOutput&, const c10::StorageImpl&) { return false; },
               [] { return std::string(); });
}

std::vector<int64_t> LiveOutputs::liveSlots() const {
  std::vector<int64_t> out;
  for (const auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && !isGone(kv.second, *strong)) out.push_back(kv.first);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::unordered_set<void*> LiveOutputs::owningBlocks() const {
  std::unordered_set<void*> out;
  for (const auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && !isGone(kv.second, *strong) && ownsPoolBlock(*strong)) {
      out.insert(reinterpret_cast<void*>(kv.second.ptr));
    }
  }
  return out;
}

std::vector<void*> LiveOutputs::unownedBlocks() const {
  const auto owning = owningBlocks();
  std::vector<void*> out;
  if (backend_.checkLiveAllocations(owning)) return out;
  for (void* p : backend_.allocatedBlocks()) {
    if (!owning.count(p)) out.push_back(p);
  }
  return out;
}

std::unordered_map<int64_t, int64_t> LiveOutputs::liveCountPerNode() const {
  std::unordered_map<int64_t, int64_t> out;
  for (const auto& kv : live_) {
    if (kv.second.node != nullptr) out[kv.second.node->id()]++;
  }
  return out;
}

bool LiveOutputs::ownsPoolBlock(const c10::StorageImpl& storage) const {
  return storage.data_ptr().get_deleter() == backend_.poolDeleter();
}

bool LiveOutputs::disown(c10::StorageImpl& storage) const {
  if (!ownsPoolBlock(storage)) return false;
  const bool swapped = storage.mutable_data_ptr().compare_exchange_deleter(
      backend_.poolDeleter(), &c10::detail::deleteNothing);
  TORCH_INTERNAL_ASSERT(swapped, "expected the pool's deleter");
  return true;
}

void LiveOutputs::migrate(const LiveOutput& e, c10::StorageImpl& storage) {
  const c10::Device device = backend_.device();
  // Allocators allocate on the current device: make it the tree's (a cuda:1 tree may be called
  // while cuda:0 is current).
  const c10::DeviceGuard device_guard(device);
  c10::DataPtr fresh = c10::GetAllocator(device.type())->allocate(e.nbytes);
  TensorMeta bytes;
  bytes.sizes = {static_cast<int64_t>(e.nbytes)};
  bytes.strides = {1};
  bytes.dtype = c10::ScalarType::Byte;
  bytes.device = device;
  makeTensor(nonOwningStorage(reinterpret_cast<uintptr_t>(fresh.get()), e.nbytes, device), bytes)
      .copy_(makeTensor(nonOwningStorage(e.ptr, e.nbytes, device), bytes));
  if (disown(storage)) backend_.freeBlock(reinterpret_cast<void*>(e.ptr));
  storage.set_data_ptr_noswap(std::move(fresh));
  counters_.num_migrations++;
}

void LiveOutputs::moveOutOfPool(c10::StorageImpl& storage) {
  LiveOutput e;
  e.ptr = reinterpret_cast<uintptr_t>(storage.data());
  e.nbytes = storage.nbytes();
  migrate(e, storage);
}

bool LiveOutputs::moveResultsOutOfPool(const std::vector<at::Tensor>& results,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<int64_t>& copied) {
  std::unordered_set<const c10::StorageImpl*> placeholders;
  for (int64_t i : copied) placeholders.insert(inputs[i].storage().unsafeGetStorageImpl());
  for (const auto& t : results) {
    if (t.has_storage() && placeholders.count(t.storage().unsafeGetStorageImpl())) return false;
  }
  for (const auto& t : results) {
    if (!t.has_storage()) continue;
    c10::StorageImpl& storage = *t.storage().unsafeGetStorageImpl();
    if (storage.nbytes() > 0 && backend_.inPool(storage.data()) && !contains(&storage)) {
      moveOutOfPool(storage);
    }
  }
  return true;
}

void LiveOutputs::invalidate(const LiveOutput& e, c10::StorageImpl& storage,
                             const std::string& why) {
  if (e.copy_on_overwrite && e.nbytes > 0) {
    // on_overwrite="copy", or a gradient that may sit in .grad: keep its value.
    migrate(e, storage);
    GRAPHTREES_LOG(LogLevel::kDebug, "copied a live output of '" + e.producer + "' (" +
                                         std::to_string(e.nbytes) +
                                         " bytes) out of the pool: " + why);
    return;
  }
  if (disown(storage)) backend_.freeBlock(reinterpret_cast<void*>(e.ptr));
  storage.release_data_and_set_meta_custom_data_ptr_error_msg_(overwriteMessage(e.producer, why));
  counters_.num_invalidations++;
}

std::vector<c10::intrusive_ptr<c10::StorageImpl>> LiveOutputs::disownAll() {
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> out;
  for (auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && disown(*strong)) out.push_back(std::move(strong));
  }
  return out;
}

void LiveOutputs::reown(const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& storages) {
  for (const auto& storage : storages) {
    storage->mutable_data_ptr().compare_exchange_deleter(&c10::detail::deleteNothing,
                                                         backend_.poolDeleter());
  }
}

void LiveOutputs::adopt(RestoreResult* restored, const std::unordered_set<int64_t>& at_risk) {
  std::unordered_map<uintptr_t, c10::DataPtr*> by_ptr;
  for (auto& dp : restored->dataptrs_allocd) by_ptr[reinterpret_cast<uintptr_t>(dp.get())] = &dp;
  invalidateIf(
      [&](int64_t slot, const LiveOutput& e, c10::StorageImpl& storage) {
        if (at_risk.count(slot)) return true;
        auto found = by_ptr.find(e.ptr);
        if (found == by_ptr.end()) return true;  // not expected: be safe, never hand out a block
        storage.set_data_ptr_noswap(std::move(*found->second));
        by_ptr.erase(found);
        return false;
      },
      [] {
        return std::string("the pool was restored for a new run of the tree and reuses its memory");
      });
  // DataPtrs left in `restored` belong to blocks whose tensors died: dropping them frees them.
}

void LiveOutputs::invalidateAll(const std::string& why) {
  invalidateIf([](int64_t, const LiveOutput&, const c10::StorageImpl&) { return true; },
               [&] { return why; });
  live_.clear();
  slot_of_.clear();
  generation_slots_.clear();
}

bool LiveOutputs::checkInvariants(bool bookkeeping_exact, std::string* why) {
  pruneGone();
  const auto owning = owningBlocks();
  int64_t non_owning = 0;
  for (const auto& kv : live_) {
    auto strong = kv.second.weak.lock();
    if (strong && !ownsPoolBlock(*strong)) non_owning++;
  }
  if (!backend_.checkLiveAllocations(owning)) {
    *why = "the pool has " + std::to_string(backend_.allocatedBlocks().size()) +
           " allocated blocks, " + std::to_string(unownedBlocks().size()) +
           " of them not owned by a tracked live output; tracked owning outputs: " +
           std::to_string(owning.size());
    return false;
  }
  if (bookkeeping_exact && non_owning > 0) {
    *why = std::to_string(non_owning) +
           " live outputs do not own their blocks although no replay happened since the pool "
           "was last exact";
    return false;
  }
  return true;
}

}  // namespace graphtrees
