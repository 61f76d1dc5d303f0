#include "cuda/MemoryLimit.h"

#include "Logging.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

namespace graphtrees {

namespace CCA = c10::cuda::CUDACachingAllocator;

void MemoryLimit::apply(int64_t pool_reserved) {
  if (limit_ < 0 || saved_fraction_) return;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t device_reserved = CCA::getDeviceStats(device_).reserved_bytes[agg].current;
  const int64_t allowed = device_reserved - pool_reserved + limit_;
  saved_fraction_ = CCA::getMemoryFraction(device_);
  const double fraction = static_cast<double>(std::max<int64_t>(allowed, 0)) /
                          static_cast<double>(std::max<size_t>(total_bytes, 1));
  CCA::setMemoryFraction(std::min(fraction, *saved_fraction_), device_);
}

void MemoryLimit::lift() {
  if (!saved_fraction_) return;
  const double saved = *saved_fraction_;
  saved_fraction_.reset();
  CCA::setMemoryFraction(saved, device_);
}

MemoryLimit::Scope::~Scope() {
  try {
    limit_.lift();
  } catch (const std::exception& e) {
    logMessage(LogLevel::kWarning, std::string("restoring the memory fraction: ") + e.what());
  }
}

}  // namespace graphtrees
