// The stand-in's shared state: configuration, the lock, errors and reports, the device's
// properties, and the control functions tests call (standin_api.h).

#include "standin.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

// Note [Unmodelled calls]
// A CUDA entry point the stand-in does not define is simply absent from libcudart.so.13: since
// the stand-in carries the runtime's SONAME (and is preloaded), the real runtime never loads, and
// the first call of a missing function ends the process with the dynamic loader's "undefined
// symbol: cudaXxx", naming it. A driver function asked for by name (cudaGetDriverEntryPoint-
// ByVersion, cuGetProcAddress) that the stand-in lacks is reported as not found, which torch
// turns into its own error naming it. Inside defined functions, an argument or mode the stand-in
// does not model (a conditional node, a child graph launched into a capture, IPC, a second
// device) fails with cudaErrorNotSupported and a report on stderr naming the call -- never a
// silent success. A device attribute it has no value for is cudaErrorInvalidValue, reported.
//
// Note [Stand-in handles]
// A stream, event, graph or executable graph handle is a pointer into the driver, and a real
// driver may crash on one that was destroyed (or on garbage), or silently act on whatever object
// took its place. The stand-in never frees a handle's object, so an address is never reused,
// and remembers what destroyed it: a call given a destroyed handle -- or one it never created
// (not a live handle, not retired, not one of the special streams 0, cudaStreamLegacy and
// cudaStreamPerThread) -- ends the process with abort(), naming the call, the handle and which
// of the two it is, on stderr (even when CUDA_STANDIN_QUIET=1). A null event, graph or
// executable graph is an argument the driver checks: cudaErrorInvalidValue or
// cudaErrorInvalidResourceHandle, as before. CUDA_STANDIN_HANDLE_ERRORS=1 (for debugging) turns
// the end of the process into a report and the error the call returned before
// (cudaErrorInvalidResourceHandle for streams and events, cudaErrorInvalidValue for graphs).

namespace standin {

namespace {

size_t parseBytes(const char* s, size_t dflt) {
  if (s == nullptr || *s == '\0') return dflt;
  char* end = nullptr;
  double v = std::strtod(s, &end);
  switch (end && *end ? *end : ' ') {
    case 'k':
    case 'K':
      v *= 1024.0;
      break;
    case 'm':
    case 'M':
      v *= 1024.0 * 1024.0;
      break;
    case 'g':
    case 'G':
      v *= 1024.0 * 1024.0 * 1024.0;
      break;
    default:
      break;
  }
  return static_cast<size_t>(v);
}

bool flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

std::recursive_mutex& mutex() {
  static auto* m = new std::recursive_mutex();  // leaked: atexit work still locks it
  return *m;
}
thread_local int lock_depth = 0;
thread_local std::vector<std::function<void()>>* pending_callbacks = nullptr;
thread_local cudaError_t last_error = cudaSuccess;

std::mutex& messageMutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::string& lastMessage() {
  static auto* s = new std::string();
  return *s;
}
std::atomic<int64_t> sticky{0};

const char* const kInjectable[] = {"cudaGraphInstantiateWithFlags", "cudaGraphLaunch",
                                   "cudaStreamEndCapture", "cudaStreamSynchronize",
                                   "cudaMemcpyAsync"};
std::map<std::string, int>& armed() {
  static auto* m = new std::map<std::string, int>();
  return *m;
}

void report(const char* kind, const char* fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  {
    std::lock_guard<std::mutex> g(messageMutex());
    lastMessage() = buf;
  }
  if (!config().quiet) std::fprintf(stderr, "[cuda stand-in] %s: %s\n", kind, buf);
}

}  // namespace

int driverVersion() {
  static const int version = [] {
    const char* v = std::getenv("CUDA_STANDIN_DRIVER_VERSION");
    return v != nullptr && *v != '\0' ? std::atoi(v) : 13000;
  }();
  return version;
}

Config& config() {
  static Config* c = [] {
    auto* cfg = new Config();
    cfg->capacity = parseBytes(std::getenv("CUDA_STANDIN_MEMORY"), size_t(16) << 30);
    const char* p = std::getenv("CUDA_STANDIN_POISON");
    cfg->poison = 0xFF;
    if (p != nullptr && *p)
      cfg->poison = std::strcmp(p, "off") == 0 ? -1 : (int)std::strtol(p, nullptr, 0);
    cfg->deferred = flag("CUDA_STANDIN_DEFERRED");
    cfg->trace = flag("CUDA_STANDIN_TRACE");
    cfg->quiet = flag("CUDA_STANDIN_QUIET");
    cfg->host_access = flag("CUDA_STANDIN_HOST_ACCESS");
    cfg->handle_errors = flag("CUDA_STANDIN_HANDLE_ERRORS");
    return cfg;
  }();
  return *c;
}

Lock::Lock() {
  mutex().lock();
  if (lock_depth++ == 0) pending_callbacks = nullptr;
}

Lock::~Lock() {
  std::vector<std::function<void()>>* callbacks = nullptr;
  if (--lock_depth == 0) {
    callbacks = pending_callbacks;
    pending_callbacks = nullptr;
  }
  mutex().unlock();
  if (callbacks != nullptr) {
    for (auto& fn : *callbacks) fn();
    delete callbacks;
  }
}

void afterUnlock(std::function<void()> fn) {
  if (lock_depth == 0) {
    fn();
    return;
  }
  if (pending_callbacks == nullptr) pending_callbacks = new std::vector<std::function<void()>>();
  pending_callbacks->push_back(std::move(fn));
}

void runUnlocked(const std::function<void()>& fn) {
  const int depth = lock_depth;
  auto* callbacks = pending_callbacks;
  lock_depth = 0;
  pending_callbacks = nullptr;
  for (int i = 0; i < depth; ++i) mutex().unlock();
  fn();
  for (int i = 0; i < depth; ++i) mutex().lock();
  lock_depth = depth;
  pending_callbacks = callbacks;
}

cudaError_t setError(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

cudaError_t fail(cudaError_t e, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report(errorName(e), fmt, ap);
  va_end(ap);
  return setError(e);
}

void trace(const char* fmt, ...) {
  if (!config().trace) return;
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "[cuda stand-in] ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
}

void deviceFault(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report("device fault (cudaErrorIllegalAddress, sticky)", fmt, ap);
  va_end(ap);
  stats().device_faults++;
  int64_t expected = 0;
  sticky.compare_exchange_strong(expected, static_cast<int64_t>(cudaErrorIllegalAddress));
}

cudaError_t stickyError() {
  return static_cast<cudaError_t>(sticky.load());
}

cudaError_t injectedFailure(const char* call) {
  Lock lock;
  auto it = armed().find(call);
  if (it == armed().end()) return cudaSuccess;
  const auto e = static_cast<cudaError_t>(it->second);
  armed().erase(it);
  return fail(e, "%s: failure injected by standin_fail_next()", call);
}

StandinStats& stats() {
  static auto* s = new StandinStats();
  return *s;
}

namespace {
std::map<const void*, std::pair<HandleKind, const char*>>& retired() {
  static auto* m = new std::map<const void*, std::pair<HandleKind, const char*>>();
  return *m;
}
const char* handleKindName(HandleKind k) {
  switch (k) {
    case HandleKind::kStream:
      return "stream";
    case HandleKind::kEvent:
      return "event";
    case HandleKind::kGraph:
      return "graph";
    case HandleKind::kGraphExec:
      return "executable graph";
  }
  return "handle";
}
}  // namespace

void retireHandle(const void* handle, HandleKind kind, const char* by) {
  Lock lock;
  retired()[handle] = {kind, by};
}

void badHandle(const char* call, HandleKind kind, const void* handle) {
  char what[512];
  {
    Lock lock;
    auto it = retired().find(handle);
    if (it == retired().end()) {
      std::snprintf(what, sizeof(what), "%s %p was never created: an unknown handle",
                    handleKindName(kind), handle);
    } else if (it->second.first != kind) {
      std::snprintf(what, sizeof(what), "%s %p is a %s, destroyed by %s: a stale handle",
                    handleKindName(kind), handle, handleKindName(it->second.first),
                    it->second.second);
    } else {
      std::snprintf(what, sizeof(what), "%s %p was destroyed by %s: a stale handle",
                    handleKindName(kind), handle, it->second.second);
    }
  }
  if (config().handle_errors) {
    fail(cudaErrorInvalidResourceHandle, "%s: %s", call, what);
    return;
  }
  std::fprintf(stderr,
               "[cuda stand-in] %s: %s, on which a driver may crash; the stand-in ends the "
               "process (CUDA_STANDIN_HANDLE_ERRORS=1 makes it an error instead)\n",
               call, what);
  std::fflush(stderr);
  std::abort();
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

double nowMs() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

const char* errorName(cudaError_t e) {
  switch (e) {
#define NAME(x) \
  case x:       \
    return #x;
    NAME(cudaSuccess)
    NAME(cudaErrorInvalidValue)
    NAME(cudaErrorMemoryAllocation)
    NAME(cudaErrorInitializationError)
    NAME(cudaErrorInvalidConfiguration)
    NAME(cudaErrorInvalidDevice)
    NAME(cudaErrorInvalidResourceHandle)
    NAME(cudaErrorNotReady)
    NAME(cudaErrorIllegalAddress)
    NAME(cudaErrorNotSupported)
    NAME(cudaErrorIllegalState)
    NAME(cudaErrorStreamCaptureUnsupported)
    NAME(cudaErrorStreamCaptureInvalidated)
    NAME(cudaErrorStreamCaptureMerge)
    NAME(cudaErrorStreamCaptureUnmatched)
    NAME(cudaErrorStreamCaptureUnjoined)
    NAME(cudaErrorStreamCaptureIsolation)
    NAME(cudaErrorStreamCaptureImplicit)
    NAME(cudaErrorStreamCaptureWrongThread)
    NAME(cudaErrorCapturedEvent)
    NAME(cudaErrorSymbolNotFound)
    NAME(cudaErrorInvalidSymbol)
    NAME(cudaErrorPeerAccessUnsupported)
    NAME(cudaErrorHostMemoryAlreadyRegistered)
    NAME(cudaErrorHostMemoryNotRegistered)
    NAME(cudaErrorInvalidDevicePointer)
    NAME(cudaErrorUnknown)
#undef NAME
    default:
      return "cudaErrorUnknown";
  }
}

const char* errorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorNotSupported:
      return "operation not supported (CUDA stand-in)";
    case cudaErrorIllegalState:
      return "operation not permitted when stream is in this state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnmatched:
      return "capture was not initiated in this stream";
    case cudaErrorStreamCaptureUnjoined:
      return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorSymbolNotFound:
      return "named symbol not found";
    case cudaErrorInvalidSymbol:
      return "invalid device symbol";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    default:
      return errorName(e);
  }
}

}  // namespace standin

using namespace standin;

// ---- the control API (standin_api.h) ----------------------------------------------------------

extern "C" {

__attribute__((visibility("default"))) void standin_stats(StandinStats* out) {
  Lock lock;
  *out = stats();
  out->sticky_error = static_cast<int64_t>(stickyError());
  out->deferred = config().deferred ? 1 : 0;
  out->capacity = static_cast<int64_t>(config().capacity);
}

__attribute__((visibility("default"))) void standin_set_capacity(int64_t bytes) {
  Lock lock;
  config().capacity = static_cast<size_t>(bytes);
}

__attribute__((visibility("default"))) size_t standin_last_message(char* buf, size_t len) {
  std::lock_guard<std::mutex> g(messageMutex());
  const std::string& m = lastMessage();
  if (buf != nullptr && len > 0) {
    std::snprintf(buf, len, "%s", m.c_str());
  }
  return m.size();
}

__attribute__((visibility("default"))) int standin_fail_next(const char* call, int error) {
  for (const char* name : kInjectable) {
    if (std::strcmp(name, call) == 0) {
      Lock lock;
      armed()[call] = error;
      return 0;
    }
  }
  return -1;
}

__attribute__((visibility("default"))) void standin_clear_sticky_error(void) {
  sticky.store(0);
}

__attribute__((visibility("default"))) void standin_reset_counters(void) {
  Lock lock;
  StandinStats& s = stats();
  const int64_t in_use = s.bytes_in_use, graphs = s.live_graphs, execs = s.live_execs,
                mapped = s.vmm_mapped_bytes;
  s = StandinStats();
  s.bytes_in_use = in_use;
  s.peak_bytes = in_use;
  s.live_graphs = graphs;
  s.live_execs = execs;
  s.vmm_mapped_bytes = mapped;
  resetLaunchCounts();
  std::lock_guard<std::mutex> g(messageMutex());
  lastMessage().clear();
}

}  // extern "C"

// ---- errors -----------------------------------------------------------------------------------

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t s = stickyError();
  if (s != cudaSuccess) return s;
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t s = stickyError();
  return s != cudaSuccess ? s : last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  return errorName(error);
}

const char* cudaGetErrorString(cudaError_t error) {
  return errorString(error);
}

// ---- versions and devices ---------------------------------------------------------------------

cudaError_t cudaDriverGetVersion(int* v) {
  if (v == nullptr) return setError(cudaErrorInvalidValue);
  *v = driverVersion();
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (v == nullptr) return setError(cudaErrorInvalidValue);
  *v = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return setError(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

}  // extern "C"

namespace {
thread_local int current_device = 0;
}

namespace standin {

// One device, an H100-like sm_90 part whose memory is the host's (Note [Stand-in memory]).
void fillProperties(cudaDeviceProp* p) {
  std::memset(p, 0, sizeof(*p));
  std::snprintf(p->name, sizeof(p->name), "CUDA stand-in (host memory, kernels not executed)");
  for (int i = 0; i < 16; ++i) p->uuid.bytes[i] = static_cast<char>(0xA0 + i);
  p->totalGlobalMem = config().capacity;
  p->sharedMemPerBlock = 48 << 10;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->memPitch = SIZE_MAX;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->totalConstMem = 64 << 10;
  p->major = 9;
  p->minor = 0;
  p->textureAlignment = 512;
  p->texturePitchAlignment = 32;
  p->multiProcessorCount = 132;
  p->canMapHostMemory = 1;
  p->concurrentKernels = 1;
  p->pciBusID = 0;
  p->asyncEngineCount = 2;
  p->unifiedAddressing = 1;
  p->memoryBusWidth = 5120;
  p->l2CacheSize = 50 << 20;
  p->persistingL2CacheMaxSize = 30 << 20;
  p->maxThreadsPerMultiProcessor = 2048;
  p->streamPrioritiesSupported = 1;
  p->globalL1CacheSupported = 1;
  p->localL1CacheSupported = 1;
  p->sharedMemPerMultiprocessor = 228 << 10;
  p->regsPerMultiprocessor = 65536;
  p->managedMemory = 1;
  p->hostNativeAtomicSupported = 0;
  p->concurrentManagedAccess = 1;
  p->computePreemptionSupported = 1;
  p->cooperativeLaunch = 1;
  p->sharedMemPerBlockOptin = 227 << 10;
  p->maxBlocksPerMultiProcessor = 32;
  p->accessPolicyMaxWindowSize = 128 << 20;
  p->reservedSharedMemPerBlock = 1 << 10;
  p->hostRegisterSupported = 1;
  p->memoryPoolsSupported = 1;
  p->clusterLaunch = 1;
  p->deviceNumaId = -1;
  p->hostNumaId = -1;
}

// The value of a device attribute (the runtime's cudaDeviceAttr and the driver's
// CUdevice_attribute share their numbers); false if the stand-in has none.
bool deviceAttribute(int attr, int* value) {
  cudaDeviceProp p;
  fillProperties(&p);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = p.maxThreadsPerBlock;
      return true;
    case cudaDevAttrMaxBlockDimX:
      *value = p.maxThreadsDim[0];
      return true;
    case cudaDevAttrMaxBlockDimY:
      *value = p.maxThreadsDim[1];
      return true;
    case cudaDevAttrMaxBlockDimZ:
      *value = p.maxThreadsDim[2];
      return true;
    case cudaDevAttrMaxGridDimX:
      *value = p.maxGridSize[0];
      return true;
    case cudaDevAttrMaxGridDimY:
      *value = p.maxGridSize[1];
      return true;
    case cudaDevAttrMaxGridDimZ:
      *value = p.maxGridSize[2];
      return true;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = (int)p.sharedMemPerBlock;
      return true;
    case cudaDevAttrTotalConstantMemory:
      *value = (int)p.totalConstMem;
      return true;
    case cudaDevAttrWarpSize:
      *value = p.warpSize;
      return true;
    case cudaDevAttrMaxPitch:
      *value = 2147483647;
      return true;
    case cudaDevAttrMaxRegistersPerBlock:
      *value = p.regsPerBlock;
      return true;
    case cudaDevAttrClockRate:
      *value = 1980000;
      return true;  // kHz
    case cudaDevAttrTextureAlignment:
      *value = (int)p.textureAlignment;
      return true;
    case cudaDevAttrGpuOverlap:
      *value = 1;
      return true;
    case cudaDevAttrMultiProcessorCount:
      *value = p.multiProcessorCount;
      return true;
    case cudaDevAttrKernelExecTimeout:
      *value = 0;
      return true;
    case cudaDevAttrIntegrated:
      *value = 0;
      return true;
    case cudaDevAttrCanMapHostMemory:
      *value = 1;
      return true;
    case cudaDevAttrComputeMode:
      *value = 0;
      return true;
    case cudaDevAttrConcurrentKernels:
      *value = 1;
      return true;
    case cudaDevAttrEccEnabled:
      *value = 0;
      return true;
    case cudaDevAttrPciBusId:
      *value = 0;
      return true;
    case cudaDevAttrPciDeviceId:
      *value = 0;
      return true;
    case cudaDevAttrPciDomainId:
      *value = 0;
      return true;
    case cudaDevAttrTccDriver:
      *value = 0;
      return true;
    case cudaDevAttrMemoryClockRate:
      *value = 2619000;
      return true;  // kHz
    case cudaDevAttrGlobalMemoryBusWidth:
      *value = p.memoryBusWidth;
      return true;
    case cudaDevAttrL2CacheSize:
      *value = p.l2CacheSize;
      return true;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = p.maxThreadsPerMultiProcessor;
      return true;
    case cudaDevAttrAsyncEngineCount:
      *value = p.asyncEngineCount;
      return true;
    case cudaDevAttrUnifiedAddressing:
      *value = 1;
      return true;
    case cudaDevAttrTexturePitchAlignment:
      *value = 32;
      return true;
    case cudaDevAttrComputeCapabilityMajor:
      *value = p.major;
      return true;
    case cudaDevAttrComputeCapabilityMinor:
      *value = p.minor;
      return true;
    case cudaDevAttrStreamPrioritiesSupported:
      *value = 1;
      return true;
    case cudaDevAttrGlobalL1CacheSupported:
      *value = 1;
      return true;
    case cudaDevAttrLocalL1CacheSupported:
      *value = 1;
      return true;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = (int)p.sharedMemPerMultiprocessor;
      return true;
    case cudaDevAttrMaxRegistersPerMultiprocessor:
      *value = p.regsPerMultiprocessor;
      return true;
    case cudaDevAttrManagedMemory:
      *value = 1;
      return true;
    case cudaDevAttrIsMultiGpuBoard:
      *value = 0;
      return true;
    case cudaDevAttrMultiGpuBoardGroupID:
      *value = 0;
      return true;
    case cudaDevAttrHostNativeAtomicSupported:
      *value = 0;
      return true;
    case cudaDevAttrSingleToDoublePrecisionPerfRatio:
      *value = 2;
      return true;
    case cudaDevAttrPageableMemoryAccess:
      *value = 0;
      return true;
    case cudaDevAttrConcurrentManagedAccess:
      *value = 1;
      return true;
    case cudaDevAttrComputePreemptionSupported:
      *value = 1;
      return true;
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
      *value = 1;
      return true;
    case cudaDevAttrCooperativeLaunch:
      *value = 1;
      return true;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = (int)p.sharedMemPerBlockOptin;
      return true;
    case cudaDevAttrCanFlushRemoteWrites:
      *value = 0;
      return true;
    case cudaDevAttrHostRegisterSupported:
      *value = 1;
      return true;
    case cudaDevAttrPageableMemoryAccessUsesHostPageTables:
      *value = 0;
      return true;
    case cudaDevAttrDirectManagedMemAccessFromHost:
      *value = 0;
      return true;
    case cudaDevAttrMaxBlocksPerMultiprocessor:
      *value = p.maxBlocksPerMultiProcessor;
      return true;
    case cudaDevAttrMaxPersistingL2CacheSize:
      *value = p.persistingL2CacheMaxSize;
      return true;
    case cudaDevAttrMaxAccessPolicyWindowSize:
      *value = p.accessPolicyMaxWindowSize;
      return true;
    case cudaDevAttrReservedSharedMemoryPerBlock:
      *value = (int)p.reservedSharedMemPerBlock;
      return true;
    case cudaDevAttrSparseCudaArraySupported:
      *value = 0;
      return true;
    case cudaDevAttrHostRegisterReadOnlySupported:
      *value = 1;
      return true;
    case cudaDevAttrTimelineSemaphoreInteropSupported:
      *value = 0;
      return true;
    case cudaDevAttrMemoryPoolsSupported:
      *value = 1;
      return true;
    case cudaDevAttrGPUDirectRDMASupported:
      *value = 0;
      return true;
    case cudaDevAttrGPUDirectRDMAFlushWritesOptions:
      *value = 0;
      return true;
    case cudaDevAttrGPUDirectRDMAWritesOrdering:
      *value = 0;
      return true;
    case cudaDevAttrMemoryPoolSupportedHandleTypes:
      *value = 0;
      return true;
    case cudaDevAttrClusterLaunch:
      *value = 1;
      return true;
    case cudaDevAttrDeferredMappingCudaArraySupported:
      *value = 0;
      return true;
    case cudaDevAttrIpcEventSupport:
      *value = 0;
      return true;
    case cudaDevAttrMemSyncDomainCount:
      *value = 4;
      return true;
    case cudaDevAttrNumaConfig:
      *value = 0;
      return true;
    case cudaDevAttrNumaId:
      *value = -1;
      return true;
    case cudaDevAttrMpsEnabled:
      *value = 0;
      return true;
    case cudaDevAttrHostNumaId:
      *value = -1;
      return true;
    case cudaDevAttrGpuPciDeviceId:
      *value = 0;
      return true;
    case cudaDevAttrGpuPciSubsystemId:
      *value = 0;
      return true;
    case cudaDevAttrHostNumaMemoryPoolsSupported:
      *value = 0;
      return true;
    case cudaDevAttrHostNumaMultinodeIpcSupported:
      *value = 0;
      return true;
    case cudaDevAttrHostMemoryPoolsSupported:
      *value = 0;
      return true;
    default:
      return false;
  }
}

int currentDevice() {
  return current_device;
}

}  // namespace standin

extern "C" {

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return setError(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d): the stand-in has one device", device);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return setError(cudaErrorInvalidValue);
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties(%d): one device", device);
  fillProperties(prop);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return setError(cudaErrorInvalidValue);
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute(%d, device %d): one device",
                (int)attr, device);
  if (!deviceAttribute(static_cast<int>(attr), value)) {
    return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d is not modelled",
                (int)attr);
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* pciBusId, int len, int device) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceGetPCIBusId(%d): one device", device);
  if (pciBusId == nullptr || len <= 0) return setError(cudaErrorInvalidValue);
  std::snprintf(pciBusId, static_cast<size_t>(len), "0000:00:00.0");
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* leastPriority, int* greatestPriority) {
  if (leastPriority) *leastPriority = 0;
  if (greatestPriority) *greatestPriority = -5;
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (canAccessPeer == nullptr) return setError(cudaErrorInvalidValue);
  if (device != 0 || peerDevice != 0)
    return fail(cudaErrorInvalidDevice, "cudaDeviceCanAccessPeer(%d, %d): one device", device,
                peerDevice);
  *canAccessPeer = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int /*flags*/) {
  return fail(cudaErrorInvalidDevice,
              "cudaDeviceEnablePeerAccess(%d): the stand-in has one device and no peers",
              peerDevice);
}

cudaError_t cudaProfilerStart(void) {
  return cudaSuccess;
}

cudaError_t cudaProfilerStop(void) {
  return cudaSuccess;
}

}  // extern "C"
