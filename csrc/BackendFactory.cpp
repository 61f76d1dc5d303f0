#include "BackendFactory.h"

#include "cpu/ControlFlowCapture.h"
#include "cpu/CpuBackend.h"
#include "cpu/CpuPool.h"
#include "cpu/HostSyncWatch.h"
#include "cpu/ProgramRecorder.h"

#ifdef GRAPHTREES_WITH_CUDA
#include "cuda/ConditionalNodes.h"
#include "cuda/CudaBackend.h"
#endif

namespace graphtrees {

std::unique_ptr<Backend> makeBackend(c10::Device device, std::string* why_not) {
  switch (device.type()) {
    case c10::DeviceType::CPU:
      return std::make_unique<CpuBackend>();
    case c10::DeviceType::CUDA:
#ifdef GRAPHTREES_WITH_CUDA
      return makeCudaBackend(device, why_not);
#else
      *why_not =
          "graphtrees was built without its CUDA backend (no CUDA build of torch or no nvcc at "
          "build time); reinstall with a CUDA build of torch and the CUDA toolkit";
      return nullptr;
#endif
    default:
      *why_not =
          "graphtrees has no backend for device type '" + c10::DeviceTypeName(device.type()) + "'";
      return nullptr;
  }
}

std::vector<std::string> compiledBackends() {
#ifdef GRAPHTREES_WITH_CUDA
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

bool callerIsCapturing(c10::Device device) {
#ifdef GRAPHTREES_WITH_CUDA
  return device.is_cuda() && cudaCurrentStreamIsCapturing(device);
#else
  (void)device;
  return false;
#endif
}

const RangeMarks* rangeMarks(c10::Device device) {
#ifdef GRAPHTREES_WITH_CUDA
  if (device.is_cuda()) return &NvtxRanges::marks();
#else
  (void)device;
#endif
  return nullptr;
}

void noteUndispatchedHostRead(const char* what) {
  noteHostSync(what);
}

bool controlFlowEvent(const std::string& event, const std::vector<at::Tensor>& first,
                      const std::vector<at::Tensor>& second) {
  return cpuControlFlowEvent(event, first, second);
}

bool controlFlowPredicate(const at::Tensor& pred) {
  // A device's predicate is read only in a warmup, which may sync (a capture makes it a
  // conditional node: Note [Conditional nodes on CUDA] in cuda/ConditionalNodes.cpp).
  if (pred.defined() && !pred.device().is_cpu()) return cpuControlFlowPredicate(pred.cpu());
  return cpuControlFlowPredicate(pred);
}

std::string runWatchingHostReads(const std::function<void()>& run) {
  HostSyncWatch watch;
  if (CaptureObserver::current() == nullptr) {
    run();
    return std::string();
  }
  {
    HostSyncWatchGuard watching(&watch);
    run();
  }
  return watch.first;
}

std::string cudaConditionalUnavailable() {
#ifdef GRAPHTREES_WITH_CUDA
  return ConditionalNodes::unavailableReason();
#else
  return cudaBackendDisabledReason();
#endif
}

void cudaConditionalStep(const std::string& what, const at::Tensor& pred) {
#ifdef GRAPHTREES_WITH_CUDA
  ConditionalNodes::step(what, pred);
#else
  (void)pred;
  TORCH_CHECK(false, "graphtrees: ", cudaBackendDisabledReason(), " (", what, ")");
#endif
}

void noteUndispatchedAccess(const char* what) {
  ProgramRecorder::noteUndispatchedAccess(what);
}

#ifndef GRAPHTREES_WITH_CUDA
std::string cudaBackendDisabledReason() {
  return "graphtrees was built without its CUDA backend";
}
#endif

std::vector<int64_t> cpuPoolTotals() {
  return CpuPool::globalStats();
}

}  // namespace graphtrees
