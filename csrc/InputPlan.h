#pragma once

// How one recorded graph is fed its inputs, and how what it does to them reaches the caller: the
// node's input plan. It is made when the recording copies its inputs (record), decides the
// write-back after the capture (setWriteBack), lets its placeholders go when the node is built
// (detach), and at each replay reads the sources, copies them in, and writes back.
//
// Note [A call's inputs]
// One flat input goes through these rooms, in this order; the Notes tell each step.
//   - its kind (static, managed, copied): TreeManager::keyOf, FunctionRecord::is_static made whole
//     by ArgumentAliases::inPlace (Note [Argument aliases] in ArgumentAliases.h);
//   - before a warmup or a recording allocates, a live output it is may be cloned
//     (PoolBookkeeping::cloneInputsAtRisk; Note [The inputs a run uses] in TreeManager.h);
//   - a copied input gets a placeholder in the pool: InputPlan::record. Its views beyond the
//     placeholder are refused (Note [Views beyond a copied input] in PlaceholderViewCheck.h);
//   - what the run did to it is decided by WriteBack (Note [Copied inputs written back] in
//     WriteBack.h), and kept here;
//   - at a replay: sources() (read before anything is invalidated), copyIn() (Note [Input copies
//     in inference mode] in Backend.cpp, Note [Input copies of a replay] in cuda/InputCopies.cpp),
//     the graph, writeBack().
// The alias rule of the input path -- the positions of one tensor stay one tensor -- is applied
// here, once: record() finds, for each copied position, the first position holding the same
// tensor (ArgumentAliases::sameAs), and every later step reads that (`first_`): one placeholder
// per tensor, one source (and one clone) per tensor, one copy-in per tensor, one write-back per
// tensor. Who is the same tensor is decided once, by the call's alias map (Note [Argument
// aliases]); nothing compares TensorImpl pointers to find out again.

#include "ArgumentAliases.h"
#include "Backend.h"
#include "StorageInvalidated.h"
#include "WriteBack.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace graphtrees {

// How a recorded graph receives one flat tensor input.
enum class InputKind : uint8_t {
  kStatic,   // parameter, buffer or static_argnums: used in place, address checked
  kManaged,  // live output of an earlier node on the path: used in place, never copied
  kCopied,   // anything else: copied into a placeholder allocated in the pool at recording
};

class InputPlan {
 public:
  InputPlan() = default;

  // At a recording, with allocations routed to the pool: a placeholder for each input of kind
  // kCopied, holding a copy of it; the positions of one tensor share one. `ran` receives what the
  // capture runs on: `ins` with the placeholders at the copied positions.
  static InputPlan record(const std::vector<at::Tensor>& ins, const std::vector<InputKind>& kinds,
                          const ArgumentAliases& aliases, std::vector<at::Tensor>* ran);

  // The flat indices of the copied inputs, in order.
  const std::vector<int64_t>& copied() const { return copied_; }
  // Per flat input: the placeholder has the caller's strides (no overlapping elements).
  const std::vector<uint8_t>& dense() const { return dense_; }
  // Parallel to copied(): owning until detach(), non-owning views after.
  const std::vector<at::Tensor>& placeholders() const { return placeholders_; }

  // After the capture: the copied inputs its run mutated (WriteBack::decide over copied()), each
  // written back once per tensor.
  void setWriteBack(WriteBack decided);
  const WriteBack& writeBack() const { return write_back_; }

  // When the node is built: the placeholders become non-owning views, so that their blocks are
  // free for descendants once the recording is done (unless an output keeps them); a replay
  // copies into the same addresses.
  void detach(c10::Device device);

  // A replay, step 1: the values to copy in, parallel to copied(): the call's tensor, or a clone
  // of it where it lies in memory the replay writes (`written(begin, end)`). Read before anything
  // is written or invalidated; one per tensor. Inline: it runs at every replay.
  template <typename Written>
  std::vector<at::Tensor> sources(const std::vector<at::Tensor>& inputs,
                                  const Written& written) const {
    std::vector<at::Tensor> out;
    out.reserve(copied_.size());
    for (size_t k = 0; k < copied_.size(); ++k) {
      if (first_[k] != k) {
        out.push_back(out[first_[k]]);
        continue;
      }
      const at::Tensor& src = inputs[copied_[k]];
      const auto begin = reinterpret_cast<uintptr_t>(src.storage().data());
      out.push_back(written(begin, begin + src.storage().nbytes()) ? src.clone() : src);
    }
    return out;
  }

  // Step 2: copies the sources into the placeholders, once per tensor.
  void copyIn(Backend& backend, const std::vector<at::Tensor>& sources) const;

  // Step 4, after the graph ran: the mutated placeholders are copied back into what the caller
  // holds at each flat input, which is returned (outputs aliasing an input alias it): `inputs[i]`,
  // except where the source of copied input i is a clone and the caller's tensor was invalidated
  // or still lies in memory the replay writes; then the clone. One that on_overwrite="copy"
  // migrated out of the pool is the caller's again.
  template <typename Written>
  std::vector<at::Tensor> writeBack(const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& sources,
                                    const Written& written) const {
    std::vector<at::Tensor> targets = inputs;
    for (size_t k = 0; k < copied_.size(); ++k) {
      const int64_t i = copied_[k];
      if (sources[k].is_same(inputs[i]) || !inputs[i].has_storage()) continue;
      const c10::StorageImpl* s = inputs[i].storage().unsafeGetStorageImpl();
      if (storageInvalidated(*s)) {  // it raises "overwritten"
        targets[i] = sources[k];
        continue;
      }
      const auto begin = reinterpret_cast<uintptr_t>(s->data());
      if (written(begin, begin + s->nbytes())) targets[i] = sources[k];
    }
    write_back_.apply(placeholders_, targets);
    return targets;
  }
  // The recording call's write-back into `callers` (what the caller holds).
  void writeBackRecording(const std::vector<at::Tensor>& callers) const {
    write_back_.apply(placeholders_, callers);
  }

 private:
  std::vector<int64_t> copied_;
  // Per copied position k: the first position (index into copied_) holding the same tensor, k
  // itself if none before it. The alias rule, once (Note [A call's inputs]).
  std::vector<size_t> first_;
  bool repeats_ = false;  // some copied position repeats an earlier one
  std::vector<uint8_t> dense_;
  std::vector<at::Tensor> placeholders_;
  WriteBack write_back_;
};

}  // namespace graphtrees
