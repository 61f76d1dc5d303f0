#include "PlaceholderViewCheck.h"

#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cstring>

namespace graphtrees {

namespace {

// At most this many elements of a view over a tensor with gaps are looked up one by one; a larger
// one is refused.
constexpr int64_t kMaxElementsLookedUp = int64_t{1} << 16;

// Whether every element of the view (sizes, strides, offset) over `t`'s storage is an element of
// `t` (whose elements do not overlap), both in elements of t's dtype.
bool withinElements(const at::Tensor& t, const std::vector<int64_t>& sizes,
                    const std::vector<int64_t>& strides, int64_t offset) {
  if (sizes.size() != strides.size()) return false;
  int64_t numel = 1;
  int64_t last = offset;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] < 0 || strides[d] < 0) return false;
    numel *= sizes[d];
    last += (sizes[d] - 1) * strides[d];
  }
  int64_t t_last = t.storage_offset();
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of t's dims that matter
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return false;
    t_last += (t.size(d) - 1) * t.stride(d);
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  if (offset < t.storage_offset() || last > t_last) return false;
  if (t.is_non_overlapping_and_dense()) return true;  // every address in range is an element
  if (numel > kMaxElementsLookedUp) return false;
  std::sort(dims.rbegin(), dims.rend());
  std::vector<int64_t> index(sizes.size(), 0);
  for (int64_t n = 0; n < numel; ++n) {
    int64_t rest = offset - t.storage_offset();
    for (size_t d = 0; d < sizes.size(); ++d) rest += index[d] * strides[d];
    // Non-overlapping: the largest stride first, each digit as large as it can be.
    for (const auto& [stride, size] : dims) rest -= std::min(rest / stride, size - 1) * stride;
    if (rest != 0) return false;
    for (size_t d = sizes.size(); d-- > 0;) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
  return true;
}

bool isOp(const at::RecordFunction& fn, const char* name, const char* overload) {
  if (std::strcmp(fn.name(), name) != 0) return false;
  const char* o = fn.overload_name();
  return std::strcmp(o == nullptr ? "" : o, overload) == 0;
}

}  // namespace

PlaceholderViewCheck::PlaceholderViewCheck(const std::vector<at::Tensor>& ins,
                                           const std::vector<at::Tensor>& placeholders,
                                           const std::vector<int64_t>& copied,
                                           const std::vector<uint8_t>& dense)
    : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/false}) {
  for (int64_t i : copied) {
    const at::Tensor& p = placeholders[i];
    if (!p.has_storage() || !ins[i].has_storage()) continue;
    storages_.emplace(
        p.storage().unsafeGetStorageImpl(),
        Watched{i, p, ins[i].storage_offset(), ins[i].storage().nbytes(), dense[i] != 0});
  }
  if (!storages_.empty()) startWatching();
}

PlaceholderViewCheck::~PlaceholderViewCheck() {
  stopWatching();
}

Descend PlaceholderViewCheck::onStart(const ObservedOp& op, int /*level*/) {
  if (refusal_.empty()) check(op.fn);
  // Shown: a top-level op, or one that a library op's own implementation calls (its code
  // addresses storage as the user's would); not the ops an ATen kernel calls.
  return std::strncmp(op.fn.name(), "aten::", 6) != 0 ? Descend::kNested : Descend::kNo;
}

const PlaceholderViewCheck::Watched* PlaceholderViewCheck::watchedStorage(
    const c10::IValue& v) const {
  const c10::StorageImpl* storage = nullptr;
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().has_storage()) {
    storage = v.toTensor().storage().unsafeGetStorageImpl();
  } else if (v.isStorage()) {
    storage = v.toStorage().unsafeGetStorageImpl();
  }
  auto it = storage == nullptr ? storages_.end() : storages_.find(storage);
  return it == storages_.end() ? nullptr : &it->second;
}

void PlaceholderViewCheck::check(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (std::strncmp(name, "aten::as_strided", 16) != 0 && std::strcmp(name, "aten::set_") != 0) {
    return;
  }
  const bool as_strided = isOp(fn, "aten::as_strided", "") || isOp(fn, "aten::as_strided_", "") ||
                          isOp(fn, "aten::as_strided_copy", "");
  const bool whole_storage = isOp(fn, "aten::set_", "source_Storage");
  const bool storage_view = isOp(fn, "aten::set_", "source_Storage_storage_offset") ||
                            isOp(fn, "aten::set_", "source_Tensor_storage_offset");
  if (!as_strided && !whole_storage && !storage_view) return;
  const auto inputs = fn.inputs();
  const size_t source = as_strided ? 0 : 1;
  if (inputs.size() <= source) return;
  const Watched* w = watchedStorage(inputs[source]);
  if (w == nullptr) return;
  auto refuse = [&](const std::string& why) {
    refusal_ = std::string(name) +
               (fn.overload_name() && *fn.overload_name() ? std::string(".") + fn.overload_name()
                                                          : std::string()) +
               " on the memory of its input tensor #" + std::to_string(w->input) + " " + why +
               "; a recording runs on a copy of that input's elements only "
               "(Note [Views beyond a copied input]). Pass the tensor whose memory it "
               "addresses, or make the input static (static_argnums)";
    refuseRecording(refusal_);  // the capture's observer refuses it (TreeManager::capture)
  };
  if (!w->dense) return refuse("(whose elements overlap, so its copy has other strides)");
  const at::Tensor& p = w->placeholder;
  if (whole_storage) {
    if (w->caller_offset != 0 || w->caller_nbytes != p.storage().nbytes() ||
        !p.is_non_overlapping_and_dense()) {
      refuse("takes the whole storage, which holds more than the input");
    }
    return;
  }
  // as_strided(self, size, stride, offset?); set_(self, source, offset, size, stride)
  const size_t sizes_at = as_strided ? 1 : 3;
  const size_t strides_at = as_strided ? 2 : 4;
  const size_t offset_at = as_strided ? 3 : 2;
  if (inputs.size() <= std::max(strides_at, offset_at) || !inputs[sizes_at].isIntList() ||
      !inputs[strides_at].isIntList()) {
    return refuse("with sizes or strides it cannot read");
  }
  const c10::IValue& off = inputs[offset_at];
  const bool explicit_offset = !off.isNone();
  if (explicit_offset && !off.isInt()) return refuse("with a storage offset it cannot read");
  const at::Tensor self = inputs[0].isTensor() ? inputs[0].toTensor() : at::Tensor();
  if (!self.defined() || self.dtype().itemsize() != p.dtype().itemsize()) {
    return refuse("as elements of another size");
  }
  if (explicit_offset && w->caller_offset != 0) {
    return refuse("with an explicit storage offset, while the input starts at offset " +
                  std::to_string(w->caller_offset) + " of its storage");
  }
  const int64_t offset = explicit_offset ? off.toInt() : self.storage_offset();
  if (!withinElements(p, inputs[sizes_at].toIntVector(), inputs[strides_at].toIntVector(),
                      offset)) {
    refuse("reaches memory outside the input's own elements");
  }
}

}  // namespace graphtrees
