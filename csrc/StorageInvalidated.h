#pragma once

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

namespace graphtrees {

// Whether a storage was invalidated (Note [Output ownership]): its data raises "overwritten" on
// access. torch 2.14 says so directly; on torch 2.11 (no accessor) the access itself tells, and
// throws only for such a storage.
inline bool storageInvalidated(const c10::StorageImpl& s) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  return s.throw_on_immutable_data_ptr();
#else
  try {
    (void)s.data_ptr();
    return false;
  } catch (const c10::Error&) {
    return true;
  }
#endif
}

}  // namespace graphtrees
