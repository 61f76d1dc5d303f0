#include "ArgumentAliases.h"

#include <c10/util/Exception.h>

#include <array>

namespace graphtrees {

namespace {

const c10::StorageImpl* storageOf(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

}  // namespace

void ModuleTensorIndex::build(const std::vector<at::Tensor>& module_tensors) {
  tensors.clear();
  storages.clear();
  for (size_t j = 0; j < module_tensors.size(); ++j) {
    tensors.emplace(module_tensors[j].unsafeGetTensorImpl(), static_cast<uint32_t>(j));
    if (const c10::StorageImpl* s = storageOf(module_tensors[j])) {
      storages.emplace(s, static_cast<uint32_t>(j));
    }
  }
}

void ArgumentAliases::compute(const std::vector<at::Tensor>& tensors, size_t keyed) {
  same_.clear();
  storage_.clear();
  auto note = [&](size_t i, size_t j, bool same) {
    (same ? same_ : storage_).emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(j));
  };
  if (keyed <= 8) {  // pointer compares beat a hash map for the usual few arguments
    std::array<const c10::StorageImpl*, 8> storages{};
    for (size_t i = 0; i < keyed; ++i) storages[i] = storageOf(tensors[i]);
    for (size_t i = 1; i < keyed; ++i) {
      const c10::TensorImpl* impl = tensors[i].unsafeGetTensorImpl();
      size_t j = 0;
      while (j < i && tensors[j].unsafeGetTensorImpl() != impl) ++j;
      if (j < i) {
        note(i, j, true);
        continue;
      }
      if (storages[i] == nullptr) continue;
      for (j = 0; j < i && storages[j] != storages[i];) ++j;
      if (j < i) note(i, j, false);
    }
    return;
  }
  std::unordered_map<const c10::TensorImpl*, size_t> first;
  std::unordered_map<const c10::StorageImpl*, size_t> first_storage;
  for (size_t i = 0; i < keyed; ++i) {
    auto [it, fresh] = first.emplace(tensors[i].unsafeGetTensorImpl(), i);
    if (!fresh) {
      note(i, it->second, true);
      continue;
    }
    const c10::StorageImpl* storage = storageOf(tensors[i]);
    if (storage == nullptr) continue;
    auto [st, fresh_storage] = first_storage.emplace(storage, i);
    if (!fresh_storage) note(i, st->second, false);
  }
}

void ArgumentAliases::addModuleTensors(const std::vector<at::Tensor>& tensors, size_t keyed,
                                       const ModuleTensorIndex& module) {
  if (module.tensors.empty()) return;
  for (size_t i = 0; i < keyed; ++i) {
    auto it = module.tensors.find(tensors[i].unsafeGetTensorImpl());
    if (it != module.tensors.end()) {
      // The module tensor comes later in the flat list: it is the later position of the pair.
      same_.emplace_back(static_cast<uint32_t>(keyed + it->second), static_cast<uint32_t>(i));
      continue;
    }
    const c10::StorageImpl* storage = storageOf(tensors[i]);
    if (storage == nullptr) continue;
    auto st = module.storages.find(storage);
    if (st != module.storages.end()) {
      storage_.emplace_back(static_cast<uint32_t>(keyed + st->second), static_cast<uint32_t>(i));
    }
  }
}

size_t ArgumentAliases::firstOf(const Pairs& pairs, size_t i) {
  // Pairs point to an earlier position, which may itself be a later one of another pair.
  for (bool moved = true; moved;) {
    moved = false;
    for (const auto& [later, earlier] : pairs) {
      if (later == i) {
        i = earlier;
        moved = true;
        break;
      }
    }
  }
  return i;
}

int64_t ArgumentAliases::sharesStorageWith(size_t i) const {
  if (storage_.empty()) return -1;
  // Position i's storage group: the positions linked to its tensor by a storage pair.
  const size_t me = sameAs(i);
  for (const auto& [later, earlier] : storage_) {
    if (sameAs(later) == me) return earlier;
    if (sameAs(earlier) == me) return later;
  }
  return -1;
}

std::vector<uint8_t> ArgumentAliases::inPlace(std::vector<uint8_t> is_static) const {
  if (same_.empty()) return is_static;
  // Union over each tensor's positions: if one is static, all are.
  std::vector<uint8_t> root_static(is_static.size(), 0);
  for (size_t i = 0; i < is_static.size(); ++i) {
    if (is_static[i]) root_static[sameAs(i)] = 1;
  }
  for (size_t i = 0; i < is_static.size(); ++i) {
    if (root_static[sameAs(i)]) is_static[i] = 1;
  }
  return is_static;
}

}  // namespace graphtrees
