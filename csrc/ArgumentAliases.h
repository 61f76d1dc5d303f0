#pragma once

// Which of a call's tensor arguments are one tensor, and which share memory.
//
// Note [Argument aliases]
// A call's flat tensors (its arguments, then a wrapped module's parameters and buffers) may name
// one tensor at several positions (mha(x, x, x); f(x, x) with position 0 static; model(x,
// model.buf)), or different tensors over one storage (x and x[:2]). Eagerly the function sees one
// tensor, and a write through one position shows through the others. The alias map says, for
// each position, the first position holding the same tensor and the first holding a tensor over
// the same storage. It is computed with the call key (FlatArgs::rekey, then
// addModuleTensors()) and its pairs are part of the key (Note [The call signature] in
// CallSignature.h), so every call of a signature has the
// same map: the signature's FunctionRecord keeps it, and each call only pays for comparing its
// own argument tensors (pointer compares, a hash lookup per argument against the module's).
// Every decision that depends on identity reads this map, and only it:
//   - the kinds of inputs (TreeManager::keyOf through FunctionRecord::is_static): if any position
//     of a tensor is static, every position of it is used in place (inPlace()): a placeholder at
//     another position would make a second tensor. A managed tensor's positions are all managed
//     already (the ledger of live outputs is per storage), and a position that is static or
//     managed is never copied;
//   - the input plan (InputPlan::record, Note [A call's inputs] in InputPlan.h): the positions of
//     one copied tensor share one placeholder, one source, one copy-in and one write-back, so the
//     function sees one tensor as eagerly;
//   - the steps before a run that replace an argument: the clones of inputs a restore would
//     overwrite (PoolBookkeeping::cloneInputsAtRisk) and the padding of buckets
//     (GraphedCallable::resizeBatch) make one replacement per tensor, at its first position;
//   - the write-back (WriteBack::decide): a mutated copied input over a storage that another
//     input (not the same tensor) also uses cannot be written back: eagerly the other one shows
//     the write while the function runs. It runs eagerly instead, with the reason.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace graphtrees {

// A module's tensors by TensorImpl and by StorageImpl (their flat positions, counted from the
// first module tensor): made when the wrapper re-reads its module, used by every call.
struct ModuleTensorIndex {
  std::unordered_map<const c10::TensorImpl*, uint32_t> tensors;
  std::unordered_map<const c10::StorageImpl*, uint32_t> storages;
  void build(const std::vector<at::Tensor>& module_tensors);
};

class ArgumentAliases {
 public:
  // (later position, earlier position) pairs, in the order found.
  using Pairs = std::vector<std::pair<uint32_t, uint32_t>>;

  // The map of `tensors[0, keyed)` among themselves.
  void compute(const std::vector<at::Tensor>& tensors, size_t keyed);
  // Adds the module tensors that follow the `keyed` argument tensors at flat position `keyed`:
  // the arguments that are (or share memory with) one of them. Their pairs are added last.
  void addModuleTensors(const std::vector<at::Tensor>& tensors, size_t keyed,
                        const ModuleTensorIndex& module);
  // The pairs, which the call key holds (Note [The call signature] in CallSignature.h).
  const Pairs& samePairs() const { return same_; }
  const Pairs& storagePairs() const { return storage_; }

  // Whether no position aliases another (the common case: every question below is trivial).
  bool none() const { return same_.empty() && storage_.empty(); }
  // The first position holding the same tensor as position `i` (`i` itself if none before it).
  size_t sameAs(size_t i) const { return firstOf(same_, i); }
  // A position holding another tensor over position `i`'s storage, or -1.
  int64_t sharesStorageWith(size_t i) const;
  // `is_static` with every position of a tensor that has a static position made static.
  std::vector<uint8_t> inPlace(std::vector<uint8_t> is_static) const;

 private:
  static size_t firstOf(const Pairs& pairs, size_t i);
  Pairs same_;     // the same TensorImpl
  Pairs storage_;  // another TensorImpl over the same StorageImpl
};

}  // namespace graphtrees
