// Fat binaries, kernel registration and every way of launching a kernel; function attributes,
// occupancy and libraries.

#include "standin.h"

#include <cstring>
#include <unordered_map>

// Note [Stand-in kernels]
// The fat binaries that torch's libraries register at load time are accepted and never read.
// __cudaRegisterFunction gives each host stub the kernel's (mangled) name, so launches are
// recorded by name: through <<<>>> (__cudaPushCallConfiguration, __cudaGetKernel,
// __cudaLaunchKernel), cudaLaunchKernel, cudaLaunchKernelExC, cudaLaunchCooperativeKernel, the
// driver's cuLaunchKernel(Ex) for modules that Triton and NVRTC load, and the cuBLAS stand-in's
// GEMMs. A launch is validated as the device would (at least one thread and block, at most 1024
// threads per block and 64 in z, the grid limits, dynamic shared memory within the function's
// limit: 48 KiB unless cudaFuncSetAttribute raised it, 227 KiB at most) and then submitted to its
// stream: a node in a capture, otherwise work that is counted and never executed. So a kernel's
// output keeps whatever bytes its memory held (poison, for new memory), and nothing computed on
// the device has a value: a test that needs values needs a GPU. One kernel is the exception,
// the one that sets a conditional node's handle (Note [Stand-in conditional nodes] in
// capture.cpp).

namespace standin {

namespace {

std::unordered_map<const void*, const char*>& kernelNames() {
  static auto* m = new std::unordered_map<const void*, const char*>();
  return *m;
}
std::unordered_map<std::string, int64_t>& launchCounts() {
  static auto* m = new std::unordered_map<std::string, int64_t>();
  return *m;
}
std::unordered_map<const void*, int>& maxDynamicShmem() {
  static auto* m = new std::unordered_map<const void*, int>();
  return *m;
}

struct CallConfig {
  dim3 grid, block;
  size_t shmem;
  cudaStream_t stream;
};
thread_local std::vector<CallConfig> call_configs;

constexpr size_t kDefaultDynamicShmem = 48 << 10;
constexpr size_t kMaxDynamicShmem = 227 << 10;

}  // namespace

const char* kernelName(const void* host_fun) {
  auto it = kernelNames().find(host_fun);
  return it == kernelNames().end() ? "<unregistered kernel>" : it->second;
}

void resetLaunchCounts() {
  launchCounts().clear();
}

void setKernelName(const void* key, const char* name) {
  kernelNames()[key] = name;
}

cudaError_t launch(const char* name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                   const void* func_key, void** params) {
  Lock lock;
  if (stickyError() != cudaSuccess) return setError(stickyError());
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0 || threads > 1024 ||
      block.x > 1024 || block.y > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 2147483647u) {
    return fail(cudaErrorInvalidConfiguration,
                "launch of %s: grid (%u, %u, %u), block (%u, %u, %u) is not a valid configuration",
                name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
  }
  size_t limit = kDefaultDynamicShmem;
  auto it = maxDynamicShmem().find(func_key);
  if (it != maxDynamicShmem().end()) limit = static_cast<size_t>(it->second);
  if (shmem > limit || shmem > kMaxDynamicShmem) {
    return fail(cudaErrorInvalidValue,
                "launch of %s: %zu bytes of dynamic shared memory, above its limit of %zu "
                "(raise it with cudaFuncSetAttribute(MaxDynamicSharedMemorySize))",
                name, shmem, limit);
  }
  CUstream_st* s = resolveStream(stream, ("the launch of kernel " + std::string(name)).c_str());
  if (s == nullptr)
    return fail(cudaErrorInvalidResourceHandle, "launch of %s: unknown stream %s", name,
                hex(stream).c_str());
  bool captured = false;
  cudaError_t e = captureCheck(s, name, &captured);
  if (e != cudaSuccess) return e;
  launchCounts()[name]++;
  // The kernel that sets a conditional handle, which the stand-in runs itself (Note [Stand-in
  // conditional nodes] in capture.cpp): torch's set_conditional_handle_kernel(unsigned long long
  // handle, const bool* pred).
  if (params != nullptr && std::strstr(name, "set_conditional_handle_kernel") != nullptr) {
    uint64_t handle = 0;
    std::memcpy(&handle, params[0], sizeof(handle));
    const void* pred = nullptr;
    std::memcpy(&pred, params[1], sizeof(pred));
    if (!captured) {
      deviceFault("launch of %s outside a graph: conditional handle %llu is a graph's", name,
                  (unsigned long long)handle);
      return setError(stickyError());
    }
    NodeData n;
    n.kind = NodeKind::kKernel;
    n.name = name;
    n.grid = grid;
    n.block = block;
    n.sets_handle = handle;
    n.predicate = pred;
    addCaptureNode(s, std::move(n));
    return cudaSuccess;
  }
  // The value mode: a kernel that no engine op computes leaves unknown values wherever its
  // pointer arguments point, each time it runs (Note [Stand-in values] in values.cpp).
  std::shared_ptr<const std::vector<std::pair<uintptr_t, size_t>>> unknown;
  if (valuesEngine() && !valuesComputing()) {
    noteUncomputedLaunch(name);
    auto ranges = pointerArgRanges(params);
    if (!ranges.empty()) {
      unknown =
          std::make_shared<const std::vector<std::pair<uintptr_t, size_t>>>(std::move(ranges));
    }
  }
  if (captured) {
    NodeData n;
    n.kind = NodeKind::kKernel;
    n.name = name;
    n.grid = grid;
    n.block = block;
    n.shmem = shmem;
    n.unknown = std::move(unknown);
    addCaptureNode(s, std::move(n));
    return cudaSuccess;
  }
  stats().kernel_launches++;
  if (unknown != nullptr) {
    enqueue(s, "kernel", [unknown] {
      for (const auto& r : *unknown) markUnknown(r.first, r.second);
    });
  } else {
    enqueue(s, "kernel", nullptr);
  }
  return cudaSuccess;
}

void setMaxDynamicShmem(const void* key, int bytes) {
  maxDynamicShmem()[key] = bytes;
}

}  // namespace standin

using namespace standin;

extern "C" {

// ---- registration (static constructors of every CUDA library) ---------------------------------

void** __cudaRegisterFatBinary(void* fatCubin) {
  auto** handle = new void*(fatCubin);  // never freed: unregistered at exit
  return handle;
}

void __cudaRegisterFatBinaryEnd(void** /*fatCubinHandle*/) {}

void __cudaUnregisterFatBinary(void** /*fatCubinHandle*/) {}

char __cudaInitModule(void** /*fatCubinHandle*/) {
  return 1;
}

void __cudaRegisterFunction(void** /*fatCubinHandle*/, const char* hostFun, char* /*deviceFun*/,
                            const char* deviceName, int /*thread_limit*/, uint3* /*tid*/,
                            uint3* /*bid*/, dim3* /*bDim*/, dim3* /*gDim*/, int* /*wSize*/) {
  Lock lock;
  setKernelName(hostFun, deviceName);
}

// ---- launches ---------------------------------------------------------------------------------

unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem,
                                     struct CUstream_st* stream) {
  call_configs.push_back({gridDim, blockDim, sharedMem, stream});
  return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* gridDim, dim3* blockDim, size_t* sharedMem,
                                       void* stream) {
  if (call_configs.empty()) return setError(cudaErrorInvalidConfiguration);
  const CallConfig c = call_configs.back();
  call_configs.pop_back();
  *gridDim = c.grid;
  *blockDim = c.block;
  *sharedMem = c.shmem;
  *static_cast<cudaStream_t*>(stream) = c.stream;
  return cudaSuccess;
}

// The kernel handle of a host stub is the stub itself.
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* hostFun) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(hostFun));
  return cudaSuccess;
}

cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void** args,
                               size_t sharedMem, cudaStream_t stream) {
  Lock lock;
  return launch(kernelName(kernel), gridDim, blockDim, sharedMem, stream, kernel, args);
}

cudaError_t cudaLaunchKernel(const void* func, dim3 gridDim, dim3 blockDim, void** args,
                             size_t sharedMem, cudaStream_t stream) {
  Lock lock;
  return launch(kernelName(func), gridDim, blockDim, sharedMem, stream, func, args);
}

cudaError_t cudaLaunchCooperativeKernel(const void* func, dim3 gridDim, dim3 blockDim, void** args,
                                        size_t sharedMem, cudaStream_t stream) {
  Lock lock;
  return launch(kernelName(func), gridDim, blockDim, sharedMem, stream, func, args);
}

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func, void** args) {
  if (config == nullptr) return setError(cudaErrorInvalidValue);
  Lock lock;
  return launch(kernelName(func), config->gridDim, config->blockDim, config->dynamicSmemBytes,
                config->stream, func, args);
}

// ---- function attributes and occupancy --------------------------------------------------------

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  if (attr == nullptr) return setError(cudaErrorInvalidValue);
  Lock lock;
  std::memset(attr, 0, sizeof(*attr));
  attr->maxThreadsPerBlock = 1024;
  attr->numRegs = 32;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  auto it = maxDynamicShmem().find(func);
  attr->maxDynamicSharedSizeBytes =
      it == maxDynamicShmem().end() ? static_cast<int>(kDefaultDynamicShmem) : it->second;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  Lock lock;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > kMaxDynamicShmem) {
      return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory",
                  value);
    }
    setMaxDynamicShmem(func, value);
  }
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* numBlocks,
                                                                   const void* /*func*/,
                                                                   int blockSize,
                                                                   size_t /*dynamicSMemSize*/,
                                                                   unsigned int /*flags*/) {
  if (numBlocks == nullptr || blockSize <= 0) return setError(cudaErrorInvalidValue);
  const int by_threads = 2048 / blockSize;
  *numBlocks = by_threads < 1 ? 1 : (by_threads > 32 ? 32 : by_threads);
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func,
                                                          int blockSize, size_t dynamicSMemSize) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, func, blockSize,
                                                                dynamicSMemSize, 0);
}

// ---- libraries (cudaLibrary_t: code loaded at run time) ---------------------------------------

cudaError_t cudaLibraryLoadData(cudaLibrary_t* library, const void* /*code*/,
                                cudaJitOption* /*jitOptions*/, void** /*jitOptionsValues*/,
                                unsigned int /*numJitOptions*/,
                                cudaLibraryOption* /*libraryOptions*/,
                                void** /*libraryOptionValues*/,
                                unsigned int /*numLibraryOptions*/) {
  if (library == nullptr) return setError(cudaErrorInvalidValue);
  *library = reinterpret_cast<cudaLibrary_t>(new int(0));
  return cudaSuccess;
}

cudaError_t cudaLibraryUnload(cudaLibrary_t /*library*/) {
  return cudaSuccess;
}

cudaError_t cudaLibraryGetKernel(cudaKernel_t* pKernel, cudaLibrary_t /*library*/,
                                 const char* name) {
  if (pKernel == nullptr || name == nullptr) return setError(cudaErrorInvalidValue);
  Lock lock;
  char* copy = strdup(name);  // the handle names the kernel for its whole life
  *pKernel = reinterpret_cast<cudaKernel_t>(copy);
  setKernelName(copy, copy);
  return cudaSuccess;
}

cudaError_t cudaKernelSetAttributeForDevice(cudaKernel_t kernel, cudaFuncAttribute attr, int value,
                                            int device) {
  if (device != 0)
    return fail(cudaErrorInvalidDevice, "cudaKernelSetAttributeForDevice: one device");
  return cudaFuncSetAttribute(kernel, attr, value);
}

__attribute__((visibility("default"))) int64_t standin_kernel_count(const char* substring) {
  Lock lock;
  int64_t n = 0;
  for (const auto& kv : launchCounts()) {
    if (substring == nullptr || kv.first.find(substring) != std::string::npos) n += kv.second;
  }
  return n;
}

__attribute__((visibility("default"))) int standin_launch(const char* name, void* stream,
                                                          unsigned grid_x, unsigned block_x) {
  Lock lock;
  const cudaError_t e = launch(name, dim3(grid_x, 1, 1), dim3(block_x, 1, 1), 0,
                               static_cast<cudaStream_t>(stream), name);
  return static_cast<int>(e);
}

__attribute__((visibility("default"))) int standin_launch_writes(const char* name, void* stream,
                                                                 unsigned grid_x, unsigned block_x,
                                                                 void* out) {
  Lock lock;
  void* slots[24] = {};  // the argument array pointerArgRanges reads: &out, then nothing
  slots[0] = &out;
  const cudaError_t e = launch(name, dim3(grid_x, 1, 1), dim3(block_x, 1, 1), 0,
                               static_cast<cudaStream_t>(stream), name, out ? slots : nullptr);
  return static_cast<int>(e);
}

}  // extern "C"
