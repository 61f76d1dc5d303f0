#include "cuda/MemoryLimit.h"

#include "Logging.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

namespace graphtrees {

namespace CCA = c10::cuda::CUDACachingAllocator;

namespace {

// Bytes of the default pool's segments that hold no block: c10 gives them back to the device
// (release_cached_blocks) when an allocation would exceed the fraction, and retries.
int64_t releasableBytes(c10::DeviceIndex device) {
  int64_t bytes = 0;
  const CCA::SnapshotInfo snap = CCA::snapshot({0, 0}, /*include_traces=*/false);
  for (const auto& seg : snap.segments) {
    const bool default_pool =
        seg.owner_private_pool_id.first == 0 && seg.owner_private_pool_id.second == 0;
    if (seg.device == device && default_pool && seg.allocated_size == 0) {
      bytes += static_cast<int64_t>(seg.total_size);
    }
  }
  return bytes;
}

// The limits applied on one device (Note [Memory budget] above MemoryLimit).
struct Applied {
  std::mutex mutex;
  double user_fraction = 1.0;  // while any is applied
  std::map<const MemoryLimit*, double> fractions;
};

Applied& appliedOn(c10::DeviceIndex device) {
  static std::mutex guard;
  static auto* applied = new std::map<c10::DeviceIndex, Applied>();  // never freed
  std::lock_guard<std::mutex> lock(guard);
  return (*applied)[device];
}

// The fraction the device gets: the user's, lowered by every limit applied.
double lowest(const Applied& a) {
  double f = a.user_fraction;
  for (const auto& kv : a.fractions) f = std::min(f, kv.second);
  return f;
}

}  // namespace

void MemoryLimit::apply(int64_t pool_reserved) {
  if (limit_ < 0 || applied_) return;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  // What the rest of the device reserves and c10 cannot give back: counting the default pool's
  // empty segments too would let the pool grow past its cap by their size, since c10 releases
  // them to make room when the fraction is reached (found on the CUDA stand-in).
  const int64_t device_reserved = CCA::getDeviceStats(device_).reserved_bytes[agg].current;
  const int64_t kept_elsewhere = device_reserved - releasableBytes(device_) - pool_reserved;
  const int64_t allowed = std::max<int64_t>(kept_elsewhere, 0) + limit_;
  const double fraction = static_cast<double>(std::max<int64_t>(allowed, 0)) /
                          static_cast<double>(std::max<size_t>(total_bytes, 1));
  Applied& a = appliedOn(device_);
  std::lock_guard<std::mutex> lock(a.mutex);
  if (a.fractions.empty()) a.user_fraction = CCA::getMemoryFraction(device_);
  a.fractions[this] = fraction;
  applied_ = true;
  CCA::setMemoryFraction(lowest(a), device_);
}

void MemoryLimit::lift() {
  if (!applied_) return;
  applied_ = false;
  Applied& a = appliedOn(device_);
  std::lock_guard<std::mutex> lock(a.mutex);
  a.fractions.erase(this);
  CCA::setMemoryFraction(lowest(a), device_);
}

MemoryLimit::~MemoryLimit() {
  try {
    lift();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning, std::string("restoring the memory fraction: ") + e.what());
  }
}

MemoryLimit::Scope::~Scope() {
  try {
    limit_.lift();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning, std::string("restoring the memory fraction: ") + e.what());
  }
}

}  // namespace graphtrees
