#pragma once

// Views of a copied input's memory that its placeholder cannot stand for, watched during a
// capture (Note [Views beyond a copied input]).

#include "CaptureObserver.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

// Note [Views beyond a copied input]
// A recording copies each copied input into a placeholder of its own: the input's elements, with
// its strides, at storage offset 0 (InputPlan::record). Code that only reads the
// input through its sizes and strides cannot tell. Code that addresses its storage directly can:
// `x.as_strided(size, stride, offset)`, `as_strided_`, `as_strided_copy` and `t.set_(storage,
// offset, size, stride)` name absolute positions in the storage, and eagerly they reach whatever
// the caller's storage holds there -- elements before or after the view, or in its gaps (the
// other half of `base[:, 0]`) -- which the placeholder does not have (its gaps hold nothing, and
// an offset means another element once the view no longer starts at the caller's offset). While
// a graph is recorded, a watcher of the capture observer (Note [One capture observer] in
// CaptureObserver.h) looks at these ops (top-level ones, and those a library op's implementation
// calls, a torch.library op defined in Python, say: views that ATen's own kernels make are
// derived from their input's geometry: it asks to be shown the ops an op calls only where that op
// is not aten::) on the storage of a placeholder. The recording is refused, and the function runs
// eagerly with the reason, when
//   - the view reaches an address that is not one of the input's own elements;
//   - an explicit storage offset is given while the caller's input does not start at offset 0 of
//     its storage (the offset cannot be told to be derived from the placeholder's own, which
//     would be right, or written for the caller's storage, which would not);
//   - `set_(storage)` takes the whole storage, which is more than the input (a view of a larger
//     tensor), or the input's elements overlap (its placeholder has other strides).
// A static input (static_argnums, parameters, buffers) is the caller's own tensor: not watched.
class PlaceholderViewCheck : public CaptureWatcher {
 public:
  // `ins`: the call's tensors; `placeholders`: what the capture runs on (rec->inputs); `copied`:
  // the flat indices of the copied inputs; `dense[i]`: placeholder i has the caller's strides.
  PlaceholderViewCheck(const std::vector<at::Tensor>& ins,
                       const std::vector<at::Tensor>& placeholders,
                       const std::vector<int64_t>& copied, const std::vector<uint8_t>& dense);
  ~PlaceholderViewCheck() override;
  PlaceholderViewCheck(const PlaceholderViewCheck&) = delete;
  PlaceholderViewCheck& operator=(const PlaceholderViewCheck&) = delete;

  // After the run: why a placeholder could not stand for its input, or empty (also reported to
  // the observer: CaptureObserver::refusal()).
  const std::string& refusal() const { return refusal_; }

 private:
  struct Watched {
    int64_t input;
    at::Tensor placeholder;
    int64_t caller_offset;
    size_t caller_nbytes;
    bool dense;
  };
  Descend onStart(const ObservedOp& op, int level) override;
  void check(const at::RecordFunction& fn);
  const Watched* watchedStorage(const c10::IValue& v) const;

  std::unordered_map<const c10::StorageImpl*, Watched> storages_;
  std::string refusal_;
};

}  // namespace graphtrees
