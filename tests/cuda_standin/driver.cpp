// The driver API (libcuda.so.1), and the runtime's cudaGetDriverEntryPointByVersion.

// cuda.h renames many entry points to their current versions (cuMemGetAddressRange ->
// cuMemGetAddressRange_v2, ...): the functions below are defined under those names, which is
// what a program compiled against cuda.h (Triton's launcher, ATen's lazy NVRTC) asks dlsym for.
#include <cuda.h>

#include "standin.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <unordered_map>

// Note [Stand-in driver]
// The driver is reached two ways, and both lead here: c10's DriverAPI asks the runtime for entry
// points by name (cudaGetDriverEntryPointByVersion, and cuGetProcAddress for the same table),
// and ATen's lazy NVRTC, Triton and Inductor dlopen("libcuda.so.1"), an empty library of the
// stand-in's whose only dependency is libcudart.so.13, where dlsym finds these functions. A name
// the table does not hold is reported as not found (Note [Unmodelled calls]).
//   - One device (0) and its primary context; attributes as the runtime reports them.
//   - Modules (cuModuleLoadData, NVRTC's cuLink*) are accepted unread; cuModuleGetFunction
//     names a function, and its launches are kernels (Note [Stand-in kernels]).
//   - Virtual memory, for expandable segments: cuMemAddressReserve is an mmap'd PROT_NONE range,
//     and a second one of the same size, its view (Note [Stand-in memory]); cuMemCreate a memfd
//     of the size asked (counted against the capacity, poisoned); cuMemMap maps it
//     MAP_FIXED|MAP_SHARED into the reservation, PROT_NONE, and at the same offset into the
//     view, read-write; cuMemSetAccess makes the mapped ranges of a reservation device memory
//     for the copy checks, whose bytes the stand-in moves through the view -- the host still
//     cannot touch them (CUDA_STANDIN_HOST_ACCESS=1: it makes them readable and writable);
//     cuMemUnmap (which waits for the device) puts PROT_NONE back in both; the memory goes once
//     it is released and unmapped everywhere. Granularity is 2 MiB.
//   - cuMemsetD32Async and cuStreamWriteValue32 are stream-ordered memsets.
//   - IPC handles (cuMemExportToShareableHandle, ...) are CUDA_ERROR_NOT_SUPPORTED.

namespace standin {
void setKernelName(const void* key, const char* name);
void setMaxDynamicShmem(const void* key, int bytes);
}  // namespace standin

using namespace standin;

struct CUctx_st {
  int device = 0;
};
struct CUmod_st {
  int unused = 0;
};
struct CUfunc_st {
  char* name = nullptr;
  int max_dynamic_shmem = 48 << 10;
};
struct CUlinkState_st {
  std::vector<char> image;
};

namespace {

CUctx_st* primaryContext() {
  static auto* c = new CUctx_st();
  return c;
}
thread_local CUctx_st* current_ctx = nullptr;
thread_local std::vector<CUctx_st*> ctx_stack;
std::unordered_map<int, size_t>& limits() {
  static auto* m = new std::unordered_map<int, size_t>();
  return *m;
}

CUresult toResult(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return CUDA_SUCCESS;
    case cudaErrorInvalidValue:
      return CUDA_ERROR_INVALID_VALUE;
    case cudaErrorMemoryAllocation:
      return CUDA_ERROR_OUT_OF_MEMORY;
    case cudaErrorInvalidResourceHandle:
      return CUDA_ERROR_INVALID_HANDLE;
    case cudaErrorInvalidConfiguration:
      return CUDA_ERROR_INVALID_VALUE;
    case cudaErrorIllegalAddress:
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    case cudaErrorStreamCaptureUnsupported:
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    case cudaErrorStreamCaptureInvalidated:
      return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    case cudaErrorStreamCaptureImplicit:
      return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    case cudaErrorNotSupported:
      return CUDA_ERROR_NOT_SUPPORTED;
    default:
      return CUDA_ERROR_UNKNOWN;
  }
}

CUresult driverFail(CUresult r, const char* what) {
  fail(r == CUDA_ERROR_OUT_OF_MEMORY   ? cudaErrorMemoryAllocation
       : r == CUDA_ERROR_NOT_SUPPORTED ? cudaErrorNotSupported
                                       : cudaErrorInvalidValue,
       "%s", what);
  return r;
}

// ---- virtual memory ---------------------------------------------------------------------------

constexpr size_t kGranularity = size_t(2) << 20;

struct Physical {
  int fd = -1;
  size_t size = 0;
  int refs = 1;  // cuMemCreate's, plus cuMemRetainAllocationHandle's
  int maps = 0;
};
struct Mapping {
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  bool accessible = false;
};
std::map<CUmemGenericAllocationHandle, Physical>& physicals() {
  static auto* m = new std::map<CUmemGenericAllocationHandle, Physical>();
  return *m;
}
std::map<uintptr_t, Mapping>& mappings() {
  static auto* m = new std::map<uintptr_t, Mapping>();
  return *m;
}
struct Reservation {
  size_t size = 0;
  uintptr_t view = 0;  // the stand-in's read-write mirror of the range (Note [Stand-in memory])
};
std::map<uintptr_t, Reservation>& reservations() {
  static auto* m = new std::map<uintptr_t, Reservation>();
  return *m;
}
std::map<uintptr_t, size_t>& mappedRuns() {  // the kMapped allocations registered now
  static auto* m = new std::map<uintptr_t, size_t>();
  return *m;
}
CUmemGenericAllocationHandle next_handle = 1;

// The reservation holding [va, va + size), or nullptr.
const std::pair<const uintptr_t, Reservation>* reservationOf(uintptr_t va, size_t size) {
  auto it = reservations().upper_bound(va);
  if (it == reservations().begin()) return nullptr;
  --it;
  return va >= it->first && va + size <= it->first + it->second.size ? &*it : nullptr;
}

// Where the stand-in sees the bytes mapped at va (in a reservation).
uintptr_t viewOf(uintptr_t va) {
  const auto* r = reservationOf(va, 1);
  return r == nullptr ? 0 : r->second.view + (va - r->first);
}

// Registers the accessible mapped ranges, coalesced within a reservation, as device memory: a
// block of an expandable segment may span several physical allocations.
void refreshMappedRuns() {
  for (auto& kv : mappedRuns()) unregisterAllocation(kv.first);
  mappedRuns().clear();
  uintptr_t run_start = 0, run_end = 0;
  for (auto& kv : mappings()) {
    if (!kv.second.accessible) continue;
    if (run_end == kv.first && reservationOf(run_start, run_end + kv.second.size - run_start)) {
      run_end += kv.second.size;
      continue;
    }
    if (run_end > run_start) mappedRuns()[run_start] = run_end - run_start;
    run_start = kv.first;
    run_end = kv.first + kv.second.size;
  }
  if (run_end > run_start) mappedRuns()[run_start] = run_end - run_start;
  for (auto& kv : mappedRuns()) {
    registerAllocation(kv.first, kv.second, MemKind::kMapped, viewOf(kv.first));
  }
}

void dropPhysicalIfUnused(CUmemGenericAllocationHandle h) {
  auto it = physicals().find(h);
  if (it == physicals().end() || it->second.refs > 0 || it->second.maps > 0) return;
  close(it->second.fd);
  releaseDeviceBytes(it->second.size);
  stats().frees++;
  physicals().erase(it);
}

}  // namespace

extern "C" {

// ---- initialisation, devices, contexts --------------------------------------------------------

CUresult cuInit(unsigned int /*flags*/) {
  return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *driverVersion = standin::driverVersion();
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = 1;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal != 0) return driverFail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet: one device");
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  if (dev != 0 || name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  cudaDeviceProp p;
  fillProperties(&p);
  std::snprintf(name, static_cast<size_t>(len), "%s", p.name);
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* pi, CUdevice_attribute attrib, CUdevice dev) {
  if (pi == nullptr || dev != 0) return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {  // the driver's attributes that the runtime's enumeration lacks
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
      *pi = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *pi = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR:
    case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS:
    case CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_ALGORITHM_MASK:
    case CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_MAXIMUM_LENGTH:
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED:
      *pi = 0;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_TENSOR_MAP_ACCESS_SUPPORTED:
      *pi = 1;
      return CUDA_SUCCESS;
    default:
      break;
  }
  if (!deviceAttribute(static_cast<int>(attrib), pi)) {
    fail(cudaErrorInvalidValue, "cuDeviceGetAttribute: attribute %d is not modelled", (int)attrib);
    return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(size_t* bytes, CUdevice dev) {
  if (bytes == nullptr || dev != 0) return CUDA_ERROR_INVALID_VALUE;
  *bytes = config().capacity;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  if (uuid == nullptr || dev != 0) return CUDA_ERROR_INVALID_VALUE;
  cudaDeviceProp p;
  fillProperties(&p);
  std::memcpy(uuid->bytes, p.uuid.bytes, sizeof(uuid->bytes));
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  if (pctx == nullptr || dev != 0) return CUDA_ERROR_INVALID_VALUE;
  *pctx = primaryContext();
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
  if (flags) *flags = 0;
  if (active) *active = 1;  // the runtime's context is always there
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int /*flags*/) {
  return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
  return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pctx = current_ctx != nullptr ? current_ctx : primaryContext();
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  current_ctx = ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  ctx_stack.push_back(current_ctx);
  current_ctx = ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext* pctx) {
  if (pctx) *pctx = current_ctx;
  if (ctx_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  current_ctx = ctx_stack.back();
  ctx_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  return toResult(cudaDeviceSynchronize());
}

CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
  Lock lock;
  limits()[static_cast<int>(limit)] = value;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetLimit(size_t* pvalue, CUlimit limit) {
  if (pvalue == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  auto it = limits().find(static_cast<int>(limit));
  *pvalue = it != limits().end() ? it->second : (limit == CU_LIMIT_STACK_SIZE ? 1024 : 0);
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char** pStr) {
  if (pStr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS:
      *pStr = "no error";
      break;
    case CUDA_ERROR_INVALID_VALUE:
      *pStr = "invalid argument";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *pStr = "out of memory";
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
      *pStr = "operation not supported (CUDA stand-in)";
      break;
    case CUDA_ERROR_NOT_FOUND:
      *pStr = "named symbol not found";
      break;
    case CUDA_ERROR_INVALID_HANDLE:
      *pStr = "invalid resource handle";
      break;
    case CUDA_ERROR_ILLEGAL_ADDRESS:
      *pStr = "an illegal memory access was encountered";
      break;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
      *pStr = "operation not permitted when stream is capturing";
      break;
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
      *pStr = "operation failed due to a previous error during capture";
      break;
    default:
      *pStr = "unknown error";
      break;
  }
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** pStr) {
  if (pStr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS:
      *pStr = "CUDA_SUCCESS";
      break;
    case CUDA_ERROR_INVALID_VALUE:
      *pStr = "CUDA_ERROR_INVALID_VALUE";
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      *pStr = "CUDA_ERROR_OUT_OF_MEMORY";
      break;
    case CUDA_ERROR_NOT_SUPPORTED:
      *pStr = "CUDA_ERROR_NOT_SUPPORTED";
      break;
    default:
      *pStr = "CUDA_ERROR_UNKNOWN";
      break;
  }
  return CUDA_SUCCESS;
}

CUresult cuMemGetInfo(size_t* free_bytes, size_t* total) {
  return toResult(cudaMemGetInfo(free_bytes, total));
}

// ---- pointers ---------------------------------------------------------------------------------

CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  Lock lock;
  const void* p = reinterpret_cast<const void*>(ptr);
  const Allocation* a = findAllocation(p);
  if (a == nullptr) return CUDA_ERROR_INVALID_VALUE;  // not memory the device knows
  const bool device = isDeviceKind(a->kind);
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      *static_cast<CUcontext*>(data) = primaryContext();
      break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      *static_cast<unsigned*>(data) = device ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      *static_cast<CUdeviceptr*>(data) = ptr;
      break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (device) return CUDA_ERROR_INVALID_VALUE;
      *static_cast<void**>(data) = const_cast<void*>(p);
      break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      *static_cast<unsigned long long*>(data) = a->base;
      break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      *static_cast<unsigned*>(data) = 0;
      break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      *static_cast<int*>(data) = 0;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      *static_cast<CUdeviceptr*>(data) = a->base;
      break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      *static_cast<size_t*>(data) = a->size;
      break;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      *static_cast<unsigned*>(data) = 1;
      break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
      *static_cast<unsigned*>(data) = 1;
      break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
      *static_cast<unsigned*>(data) = 0;
      break;
    default:
      fail(cudaErrorInvalidValue, "cuPointerGetAttribute: attribute %d is not modelled",
           (int)attribute);
      return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute* attributes,
                                void** data, CUdeviceptr ptr) {
  for (unsigned i = 0; i < numAttributes; ++i) {
    const CUresult r = cuPointerGetAttribute(data[i], attributes[i], ptr);
    if (r != CUDA_SUCCESS) return r;
  }
  return CUDA_SUCCESS;
}

CUresult cuMemGetAddressRange(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  Lock lock;
  const Allocation* a = findAllocation(reinterpret_cast<const void*>(dptr));
  if (a == nullptr || !isDeviceKind(a->kind)) return CUDA_ERROR_NOT_FOUND;
  if (pbase) *pbase = a->base;
  if (psize) *psize = a->size;
  return CUDA_SUCCESS;
}

CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
  return toResult(
      memsetD32(reinterpret_cast<void*>(dstDevice), ui, N, hStream, "cuMemsetD32Async"));
}

CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                              unsigned int /*flags*/) {
  return toResult(
      memsetD32(reinterpret_cast<void*>(addr), value, 1, stream, "cuStreamWriteValue32"));
}

// ---- virtual memory ---------------------------------------------------------------------------

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* /*prop*/,
                                       CUmemAllocationGranularity_flags /*option*/) {
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr /*addr*/,
                             unsigned long long /*flags*/) {
  Lock lock;
  if (ptr == nullptr || size == 0 || size % kGranularity != 0) {
    return driverFail(CUDA_ERROR_INVALID_VALUE,
                      "cuMemAddressReserve: size must be a multiple of 2 MiB");
  }
  const size_t align = alignment > kGranularity ? alignment : kGranularity;
  void* raw =
      mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED)
    return driverFail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAddressReserve: mmap failed");
  void* view = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (view == MAP_FAILED) {
    munmap(raw, size + align);
    return driverFail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAddressReserve: mmap failed");
  }
  const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + align - 1) & ~(align - 1);
  const uintptr_t head = start - reinterpret_cast<uintptr_t>(raw);
  if (head > 0) munmap(raw, head);
  const size_t tail = align - head;
  if (tail > 0) munmap(reinterpret_cast<void*>(start + size), tail);
  reservations()[start] = Reservation{size, reinterpret_cast<uintptr_t>(view)};
  *ptr = start;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  Lock lock;
  auto it = reservations().find(ptr);
  if (it == reservations().end() || it->second.size != size) {
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree: not a reservation");
  }
  for (auto& kv : mappings()) {
    if (kv.first >= ptr && kv.first < ptr + size) {
      return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree: the range is still mapped");
    }
  }
  munmap(reinterpret_cast<void*>(ptr), size);
  munmap(reinterpret_cast<void*>(it->second.view), size);
  reservations().erase(it);
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long /*flags*/) {
  Lock lock;
  if (handle == nullptr || size == 0 || size % kGranularity != 0) {
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: size must be a multiple of 2 MiB");
  }
  if (prop != nullptr && prop->location.id != 0) {
    return driverFail(CUDA_ERROR_INVALID_DEVICE, "cuMemCreate: one device");
  }
  if (!reserveDeviceBytes(size)) {
    fail(cudaErrorMemoryAllocation, "cuMemCreate(%zu): out of memory (%lld of %zu bytes in use)",
         size, (long long)stats().bytes_in_use, config().capacity);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const int fd = memfd_create("cuda-standin", 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) close(fd);
    releaseDeviceBytes(size);
    return driverFail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: memfd_create failed");
  }
  if (config().poison >= 0) {
    void* tmp = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (tmp != MAP_FAILED) {
      poison(tmp, size);
      munmap(tmp, size);
    }
  }
  const CUmemGenericAllocationHandle h = next_handle++;
  physicals()[h] = Physical{fd, size, 1, 0};
  stats().mallocs++;
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  Lock lock;
  auto it = physicals().find(handle);
  if (it == physicals().end())
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemRelease: unknown handle");
  it->second.refs--;
  dropPhysicalIfUnused(handle);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long /*flags*/) {
  Lock lock;
  auto it = physicals().find(handle);
  if (it == physicals().end())
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemMap: unknown handle");
  if (reservationOf(ptr, size) == nullptr || offset + size > it->second.size) {
    return driverFail(CUDA_ERROR_INVALID_VALUE,
                      "cuMemMap: outside a reservation or the allocation");
  }
  void* p = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                 it->second.fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) return driverFail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemMap: mmap failed");
  void* v = mmap(reinterpret_cast<void*>(viewOf(ptr)), size, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED, it->second.fd, static_cast<off_t>(offset));
  if (v == MAP_FAILED) {
    mmap(p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return driverFail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemMap: mmap failed");
  }
  it->second.maps++;
  mappings()[ptr] = Mapping{size, handle, false};
  stats().vmm_mapped_bytes += static_cast<int64_t>(size);
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* /*desc*/,
                        size_t /*count*/) {
  Lock lock;
  if (reservationOf(ptr, size) == nullptr) {
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: the range is not reserved");
  }
  // The device's access; the host's stays none (Note [Stand-in memory]).
  if (config().host_access &&
      mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) {
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: the range is not mapped");
  }
  for (auto& kv : mappings()) {
    if (kv.first >= ptr && kv.first < ptr + size) kv.second.accessible = true;
  }
  refreshMappedRuns();
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  Lock lock;
  runAll();  // unmapping waits for the work that may use the range
  std::vector<uintptr_t> gone;
  for (auto& kv : mappings()) {
    if (kv.first >= ptr && kv.first + kv.second.size <= ptr + size) gone.push_back(kv.first);
  }
  if (gone.empty() || reservationOf(ptr, size) == nullptr) {
    return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: nothing mapped there");
  }
  mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  mmap(reinterpret_cast<void*>(viewOf(ptr)), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  for (uintptr_t va : gone) {
    const Mapping m = mappings()[va];
    mappings().erase(va);
    stats().vmm_mapped_bytes -= static_cast<int64_t>(m.size);
    auto it = physicals().find(m.handle);
    if (it != physicals().end()) {
      it->second.maps--;
      dropPhysicalIfUnused(m.handle);
    }
  }
  refreshMappedRuns();
  return CUDA_SUCCESS;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  Lock lock;
  const auto va = reinterpret_cast<uintptr_t>(addr);
  for (auto& kv : mappings()) {
    if (va >= kv.first && va < kv.first + kv.second.size) {
      physicals()[kv.second.handle].refs++;
      *handle = kv.second.handle;
      return CUDA_SUCCESS;
    }
  }
  return driverFail(CUDA_ERROR_INVALID_VALUE, "cuMemRetainAllocationHandle: address not mapped");
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                CUmemGenericAllocationHandle handle) {
  Lock lock;
  if (prop == nullptr || !physicals().count(handle)) return CUDA_ERROR_INVALID_VALUE;
  std::memset(prop, 0, sizeof(*prop));
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = 0;
  return CUDA_SUCCESS;
}

CUresult cuMemExportToShareableHandle(void* /*shareableHandle*/, CUmemGenericAllocationHandle,
                                      CUmemAllocationHandleType, unsigned long long) {
  return driverFail(CUDA_ERROR_NOT_SUPPORTED, "cuMemExportToShareableHandle: IPC is not modelled");
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* /*handle*/,
                                        void* /*osHandle*/, CUmemAllocationHandleType) {
  return driverFail(CUDA_ERROR_NOT_SUPPORTED,
                    "cuMemImportFromShareableHandle: IPC is not modelled");
}

// ---- modules, functions, launches -------------------------------------------------------------

CUresult cuModuleLoadData(CUmodule* module, const void* /*image*/) {
  if (module == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *module = new CUmod_st();
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int /*numOptions*/,
                            CUjit_option* /*options*/, void** /*optionValues*/) {
  return cuModuleLoadData(module, image);
}

CUresult cuModuleLoad(CUmodule* module, const char* /*fname*/) {
  return cuModuleLoadData(module, nullptr);
}

CUresult cuModuleUnload(CUmodule hmod) {
  delete hmod;
  return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* hfunc, CUmodule /*hmod*/, const char* name) {
  if (hfunc == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  auto* f = new CUfunc_st();  // never freed: launches name it
  f->name = strdup(name);
  setKernelName(f, f->name);
  *hfunc = f;
  return CUDA_SUCCESS;
}

CUresult cuModuleGetGlobal(CUdeviceptr* /*dptr*/, size_t* /*bytes*/, CUmodule /*hmod*/,
                           const char* name) {
  fail(cudaErrorNotSupported, "cuModuleGetGlobal(%s): module globals are not modelled", name);
  return CUDA_ERROR_NOT_FOUND;
}

CUresult cuLinkCreate(unsigned int /*numOptions*/, CUjit_option* /*options*/,
                      void** /*optionValues*/, CUlinkState* stateOut) {
  if (stateOut == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *stateOut = new CUlinkState_st();
  return CUDA_SUCCESS;
}

CUresult cuLinkAddData(CUlinkState state, CUjitInputType /*type*/, void* data, size_t size,
                       const char* /*name*/, unsigned int /*numOptions*/, CUjit_option* /*options*/,
                       void** /*optionValues*/) {
  if (state == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const char* d = static_cast<const char*>(data);
  state->image.insert(state->image.end(), d, d + size);
  return CUDA_SUCCESS;
}

CUresult cuLinkComplete(CUlinkState state, void** cubinOut, size_t* sizeOut) {
  if (state == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (state->image.empty()) state->image.push_back(0);
  if (cubinOut) *cubinOut = state->image.data();
  if (sizeOut) *sizeOut = state->image.size();
  return CUDA_SUCCESS;
}

CUresult cuLinkDestroy(CUlinkState state) {
  delete state;
  return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int* pi, CUfunction_attribute attrib, CUfunction hfunc) {
  if (pi == nullptr || hfunc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
      *pi = 1024;
      break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS:
      *pi = 32;
      break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
      *pi = 90;
      break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
      *pi = hfunc->max_dynamic_shmem;
      break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
      *pi = -1;
      break;
    default:
      *pi = 0;
      break;  // sizes of static shared, constant and local memory: none
  }
  return CUDA_SUCCESS;
}

CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) {
  if (hfunc == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (value < 0 || value > (227 << 10)) {
      return driverFail(CUDA_ERROR_INVALID_VALUE,
                        "cuFuncSetAttribute: dynamic shared memory above 227 KiB");
    }
    Lock lock;
    hfunc->max_dynamic_shmem = value;
    setMaxDynamicShmem(hfunc, value);
  }
  return CUDA_SUCCESS;
}

CUresult cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache /*config*/) {
  return hfunc == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void** kernelParams, void** /*extra*/) {
  if (f == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return toResult(launch(f->name, dim3(gridDimX, gridDimY, gridDimZ),
                         dim3(blockDimX, blockDimY, blockDimZ), sharedMemBytes, hStream, f,
                         kernelParams));
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void** kernelParams) {
  return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                        sharedMemBytes, hStream, kernelParams, nullptr);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** kernelParams,
                          void** extra) {
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return cuLaunchKernel(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                        config->blockDimY, config->blockDimZ, config->sharedMemBytes,
                        config->hStream, kernelParams, extra);
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, CUfunction /*func*/,
                                                     int blockSize, size_t /*dynamicSMemSize*/) {
  if (numBlocks == nullptr || blockSize <= 0) return CUDA_ERROR_INVALID_VALUE;
  const int by_threads = 2048 / blockSize;
  *numBlocks = by_threads < 1 ? 1 : (by_threads > 32 ? 32 : by_threads);
  return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveClusters(int* numClusters, CUfunction /*func*/,
                                      const CUlaunchConfig* /*config*/) {
  if (numClusters == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *numClusters = 132;
  return CUDA_SUCCESS;
}

CUresult cuTensorMapEncodeTiled(CUtensorMap* tensorMap, CUtensorMapDataType, cuuint32_t,
                                void* /*globalAddress*/, const cuuint64_t*, const cuuint64_t*,
                                const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion,
                                CUtensorMapFloatOOBfill) {
  if (tensorMap == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memset(tensorMap, 0, sizeof(*tensorMap));  // read only by kernels, which never run
  return CUDA_SUCCESS;
}

CUresult cuTensorMapEncodeIm2col(CUtensorMap* tensorMap, CUtensorMapDataType, cuuint32_t,
                                 void* /*globalAddress*/, const cuuint64_t*, const cuuint64_t*,
                                 const int*, const int*, cuuint32_t, cuuint32_t, const cuuint32_t*,
                                 CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                 CUtensorMapFloatOOBfill) {
  if (tensorMap == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memset(tensorMap, 0, sizeof(*tensorMap));
  return CUDA_SUCCESS;
}

}  // extern "C"

// ---- entry points by name ---------------------------------------------------------------------

namespace {

void* lookupDriver(const char* symbol) {
  static const auto* table = new std::unordered_map<std::string, void*>{
#define ENTRY(name, fn) {name, reinterpret_cast<void*>(&fn)}
      ENTRY("cuInit", cuInit),
      ENTRY("cuDriverGetVersion", cuDriverGetVersion),
      ENTRY("cuDeviceGet", cuDeviceGet),
      ENTRY("cuDeviceGetCount", cuDeviceGetCount),
      ENTRY("cuDeviceGetName", cuDeviceGetName),
      ENTRY("cuDeviceGetAttribute", cuDeviceGetAttribute),
      ENTRY("cuDeviceTotalMem", cuDeviceTotalMem),
      ENTRY("cuDeviceGetUuid", cuDeviceGetUuid),
      ENTRY("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain),
      ENTRY("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease),
      ENTRY("cuDevicePrimaryCtxGetState", cuDevicePrimaryCtxGetState),
      ENTRY("cuCtxGetCurrent", cuCtxGetCurrent),
      ENTRY("cuCtxSetCurrent", cuCtxSetCurrent),
      ENTRY("cuCtxPushCurrent", cuCtxPushCurrent),
      ENTRY("cuCtxPopCurrent", cuCtxPopCurrent),
      ENTRY("cuCtxGetDevice", cuCtxGetDevice),
      ENTRY("cuCtxSynchronize", cuCtxSynchronize),
      ENTRY("cuCtxSetLimit", cuCtxSetLimit),
      ENTRY("cuCtxGetLimit", cuCtxGetLimit),
      ENTRY("cuGetErrorString", cuGetErrorString),
      ENTRY("cuGetErrorName", cuGetErrorName),
      ENTRY("cuMemGetInfo", cuMemGetInfo),
      ENTRY("cuPointerGetAttribute", cuPointerGetAttribute),
      ENTRY("cuPointerGetAttributes", cuPointerGetAttributes),
      ENTRY("cuMemGetAddressRange", cuMemGetAddressRange),
      ENTRY("cuMemsetD32Async", cuMemsetD32Async),
      ENTRY("cuStreamWriteValue32", cuStreamWriteValue32),
      ENTRY("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity),
      ENTRY("cuMemAddressReserve", cuMemAddressReserve),
      ENTRY("cuMemAddressFree", cuMemAddressFree),
      ENTRY("cuMemCreate", cuMemCreate),
      ENTRY("cuMemRelease", cuMemRelease),
      ENTRY("cuMemMap", cuMemMap),
      ENTRY("cuMemSetAccess", cuMemSetAccess),
      ENTRY("cuMemUnmap", cuMemUnmap),
      ENTRY("cuMemRetainAllocationHandle", cuMemRetainAllocationHandle),
      ENTRY("cuMemGetAllocationPropertiesFromHandle", cuMemGetAllocationPropertiesFromHandle),
      ENTRY("cuMemExportToShareableHandle", cuMemExportToShareableHandle),
      ENTRY("cuMemImportFromShareableHandle", cuMemImportFromShareableHandle),
      ENTRY("cuModuleLoad", cuModuleLoad),
      ENTRY("cuModuleLoadData", cuModuleLoadData),
      ENTRY("cuModuleLoadDataEx", cuModuleLoadDataEx),
      ENTRY("cuModuleUnload", cuModuleUnload),
      ENTRY("cuModuleGetFunction", cuModuleGetFunction),
      ENTRY("cuLinkCreate", cuLinkCreate),
      ENTRY("cuLinkAddData", cuLinkAddData),
      ENTRY("cuLinkComplete", cuLinkComplete),
      ENTRY("cuLinkDestroy", cuLinkDestroy),
      ENTRY("cuFuncGetAttribute", cuFuncGetAttribute),
      ENTRY("cuFuncSetAttribute", cuFuncSetAttribute),
      ENTRY("cuFuncSetCacheConfig", cuFuncSetCacheConfig),
      ENTRY("cuLaunchKernel", cuLaunchKernel),
      ENTRY("cuLaunchKernelEx", cuLaunchKernelEx),
      ENTRY("cuLaunchCooperativeKernel", cuLaunchCooperativeKernel),
      ENTRY("cuOccupancyMaxActiveBlocksPerMultiprocessor",
            cuOccupancyMaxActiveBlocksPerMultiprocessor),
      ENTRY("cuOccupancyMaxActiveClusters", cuOccupancyMaxActiveClusters),
      ENTRY("cuTensorMapEncodeTiled", cuTensorMapEncodeTiled),
      ENTRY("cuTensorMapEncodeIm2col", cuTensorMapEncodeIm2col),
#undef ENTRY
  };
  auto it = table->find(symbol);
  return it == table->end() ? nullptr : it->second;
}

}  // namespace

extern "C" {

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr,
                                             unsigned int /*cudaVersion*/,
                                             unsigned long long /*flags*/,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  if (symbol == nullptr || funcPtr == nullptr) return setError(cudaErrorInvalidValue);
  *funcPtr = lookupDriver(symbol);
  if (driverStatus != nullptr) {
    *driverStatus = *funcPtr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  }
  if (*funcPtr == nullptr) trace("driver entry point %s: not modelled", symbol);
  return cudaSuccess;
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int /*cudaVersion*/, cuuint64_t /*flags*/,
                          CUdriverProcAddressQueryResult* symbolStatus) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pfn = lookupDriver(symbol);
  if (symbolStatus != nullptr) {
    *symbolStatus = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  }
  if (*pfn == nullptr) {
    trace("cuGetProcAddress(%s): not modelled", symbol);
    return CUDA_ERROR_NOT_FOUND;
  }
  return CUDA_SUCCESS;
}

}  // extern "C"
